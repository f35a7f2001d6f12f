"""The comm lane's round body (:class:`acco.runner.RoundRunner`) driven by fake collectives.

No process group: the runner is rank 0 of 2, and a fake stands in for rank 1, adding its
known contributions to every collective and recording the order of the calls. Each test
checks the round's result against a one-process recomputation on the full flat vector.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
from torch import Tensor

from acco.loops import gradient_round, loop_classes
from acco.options import Mode, Options, RoundKind
from acco.rounds import CommLaneError, RoundSchedule
from acco.runner import RoundRunner
from acco.sharding import ShardedGroup, plan_flat
from acco.streams import CpuHooks
from acco.telemetry import StatsRecorder

pytestmark = pytest.mark.timeout(60)

SHAPES = [(3, 4), (5,)]  # 17 elements: chunks of 9, one element of padding on rank 1
WORLD_SIZE, RANK = 2, 0


class FakePeerCollectives:
    """The collectives of rank 0 of 2, where rank 1 contributes fixed values.

    Args:
        peer_grads: rank 1's hand-over buffer (its unreduced gradient sum, full length).
        peer_shard: what rank 1's all-gather sends (its updated chunk).
        peer_all_reduces: what rank 1 adds to each all-reduce, in call order.
        fail_on: a collective's name that raises instead (a broken link).
    """

    world_size, rank, active = WORLD_SIZE, RANK, True

    def __init__(
        self, peer_grads: Tensor, peer_shard: Tensor, peer_all_reduces: list[Tensor], fail_on: str | None = None
    ) -> None:
        self.peer_grads, self.peer_shard = peer_grads, peer_shard
        self.peer_all_reduces = list(peer_all_reduces)
        self.fail_on = fail_on
        self.calls: list[str] = []

    def _record(self, name: str) -> None:
        self.calls.append(name)
        if name == self.fail_on:
            raise RuntimeError(f"link down during {name}")

    def all_reduce_sum_(self, tensor: Tensor) -> None:
        self._record("all_reduce")
        tensor += self.peer_all_reduces.pop(0).to(tensor.dtype)

    def reduce_scatter_sum(self, output: Tensor, input: Tensor) -> None:
        self._record("reduce_scatter")
        chunk = output.numel()
        if output.data_ptr() != input.data_ptr():
            output.copy_(input[:chunk])
        output += self.peer_grads[:chunk]

    def all_gather(self, output: Tensor, input: Tensor) -> None:
        self._record("all_gather")
        chunk = input.numel()
        if output.data_ptr() != input.data_ptr():
            output[:chunk].copy_(input)
        output[chunk:].copy_(self.peer_shard)


def totals(update_weight: float, round_weight: float, micro_batches: int, nonfinite: float = 0.0) -> Tensor:
    """What one rank adds to the round's totals all-reduce (see RoundRunner._totals)."""
    return torch.tensor([update_weight, round_weight, micro_batches, nonfinite, 0.0], dtype=torch.float64)


def build(mode: Mode, comm: FakePeerCollectives, *, max_grad_norm: float | None = None, nonfinite: str = "raise"):
    """A param group on rank 0 of 2, its SGD base optimizer, and a runner over ``comm``."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen, requires_grad=True) for s in SHAPES]
    plan = plan_flat(SHAPES, WORLD_SIZE)
    loop = loop_classes()[mode]  # the mode's facts: its buffers and its round kinds
    group = ShardedGroup(params, plan, RANK, double_buffered=loop.double_buffered, master_in_params=loop.master_in_params)
    group.set_initial_values(group.initial_values())
    base = torch.optim.SGD(group.master_views, lr=0.1, momentum=0.9)
    options = Options.check(
        mode=mode, nonfinite=nonfinite, layout=None, max_grad_norm=max_grad_norm, param_dtype=None,
        reduce_dtype=None, timeout=datetime.timedelta(seconds=10), estimate_dtype=None,
    )  # fmt: skip
    recorder = StatsRecorder(CpuHooks())
    runner = RoundRunner([group], [base], comm, CpuHooks(), recorder, options)
    schedule = RoundSchedule(loop.round_kinds, recorder, options.wait_seconds)
    return group, base, runner, schedule


def launch(group: ShardedGroup, schedule: RoundSchedule, grads: Tensor, weights: list[float]) -> Any:
    """Fold ``grads`` (this rank's gradient sum) as ``len(weights)`` micro-batches, hand over."""
    group.grad_accumulator.copy_(grads)
    for weight in weights:
        schedule.count(weight)
    keep = schedule.next_kind is RoundKind.ESTIMATE
    hyperparams = [{"lr": 0.1, "momentum": 0.9, "dampening": 0, "weight_decay": 0, "nesterov": False}]
    return hand_over(schedule, [group.hand_over(keep)], hyperparams)


def hand_over(schedule: RoundSchedule, grads: list[Tensor], hyperparams: list[dict]) -> Any:
    """The round the schedule launches, taken back from it: the test runs it itself."""
    schedule.launch(gradient_round(schedule, grads, hyperparams), submit=lambda round_: None)
    return schedule.take_in_flight()


def reference_sgd(start: Tensor, averaged: Tensor) -> Tensor:
    """One SGD(momentum) step on the full flat vector, in one process."""
    p = start.clone().requires_grad_(True)
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = averaged.clone()
    opt.step()
    return p.detach()


def flat_grads(seed: int) -> Tensor:
    grads = torch.randn(18, generator=torch.Generator().manual_seed(seed))
    grads[17:] = 0  # padding holds no gradient
    return grads


@pytest.mark.parametrize("mode", [Mode.DPU, Mode.SYNC])
def test_a_commit_round_averages_over_both_ranks_and_updates_the_shard(mode):
    mine, peer = flat_grads(1), flat_grads(2)
    peer_shard = torch.full((9,), 7.0)
    comm = FakePeerCollectives(peer, peer_shard, [totals(3.0, 3.0, 3)])
    group, base, runner, schedule = build(mode, comm)
    start = group.initial_values()
    round_ = launch(group, schedule, mine, [1.0, 1.0])

    stats = runner.run(round_)

    assert comm.calls == ["all_reduce", "reduce_scatter", "all_gather"]
    assert (stats.update_weight, stats.global_weight, stats.global_micro_batches) == (5.0, 5.0, 5)
    assert stats.local_weight == 2.0 and not stats.skipped
    assert set(stats.phase_cpu_seconds) == {"totals", "reduce-scatter", "update", "all-gather"}
    expected = reference_sgd(start, (mine + peer) / 5.0)
    torch.testing.assert_close(group.gathered[:9], expected[:9])
    assert torch.equal(group.gathered[9:], peer_shard)  # rank 1's chunk, as it sent it
    assert len(base.state) == 1  # the momentum buffer now exists: a commit changes the state


def test_an_estimate_round_leaves_the_master_shard_and_the_state_as_found():
    mine, peer = flat_grads(3), flat_grads(4)
    comm = FakePeerCollectives(peer, torch.zeros(9), [totals(1.0, 1.0, 1), totals(2.0, 1.0, 1)])
    group, base, runner, schedule = build(Mode.ACCO, comm)
    start = group.initial_values()

    estimate = launch(group, schedule, mine, [1.0])
    assert estimate.kind is RoundKind.ESTIMATE
    runner.run(estimate)
    torch.testing.assert_close(group.gathered[:9], reference_sgd(start, (mine + peer) / 2.0)[:9])
    assert torch.equal(group.master, start[:9]) and not base.state  # nothing committed

    # The commit round divides the sum over both rounds by both rounds' weights (2 + 2).
    group.grad_accumulator.add_(mine)  # the estimate round's gradients stayed: add this round's
    schedule.count(1.0)
    commit = hand_over(schedule, [group.hand_over(False)], estimate.hyperparams)
    comm.peer_grads = 2 * peer
    stats = runner.run(commit)
    assert commit.kind is RoundKind.COMMIT and stats.update_weight == 4.0
    torch.testing.assert_close(group.master, reference_sgd(start, (2 * mine + 2 * peer) / 4.0)[:9])


def test_nonfinite_gradients_on_the_peer_skip_the_update_everywhere():
    mine = flat_grads(5)
    comm = FakePeerCollectives(flat_grads(6), torch.zeros(9), [totals(1.0, 1.0, 1, nonfinite=1.0), torch.ones(1)])
    group, base, runner, schedule = build(Mode.DPU, comm, nonfinite="skip")
    start = group.initial_values()
    stats = runner.run(launch(group, schedule, mine, [1.0]))
    # The exact scan's all-reduce confirms it, then the committed shard is gathered unchanged.
    assert comm.calls == ["all_reduce", "all_reduce", "all_gather"]
    assert stats.skipped and not base.state
    assert torch.equal(group.gathered[:9], start[:9])


def test_clipping_uses_the_norm_over_both_ranks_shards():
    mine, peer = flat_grads(7), flat_grads(8)
    averaged = (mine + peer) / 2.0
    peer_square = averaged[9:].double().square().sum().reshape(1)
    comm = FakePeerCollectives(peer, torch.zeros(9), [totals(1.0, 1.0, 1), peer_square])
    group, _, runner, schedule = build(Mode.DPU, comm, max_grad_norm=0.5)
    start = group.initial_values()
    round_ = launch(group, schedule, mine, [1.0])
    runner.run(round_)
    norm = averaged.norm()
    expected = reference_sgd(start, averaged * min(1.0, 0.5 / (float(norm) + 1e-6)))
    torch.testing.assert_close(group.gathered[:9], expected[:9])
    runner_stats = round_.stats
    assert "grad-norm" in runner_stats.phase_cpu_seconds


def test_a_failing_collective_names_the_round_and_the_phase():
    comm = FakePeerCollectives(flat_grads(9), torch.zeros(9), [totals(1.0, 1.0, 1)], fail_on="all_gather")
    group, _, runner, schedule = build(Mode.DPU, comm)
    with pytest.raises(CommLaneError, match="commit round 0 failed on the comm lane during all-gather: link down"):
        runner.run(launch(group, schedule, flat_grads(10), [1.0]))


def test_a_zero_total_weight_fails_before_any_gradient_moves():
    comm = FakePeerCollectives(flat_grads(11), torch.zeros(9), [totals(0.0, 0.0, 0)])
    group, _, runner, schedule = build(Mode.DPU, comm)
    with pytest.raises(CommLaneError, match="during totals: the total weight over all ranks is 0"):
        runner.run(launch(group, schedule, flat_grads(12), [0.0]))
    assert comm.calls == ["all_reduce"]
