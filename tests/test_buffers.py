"""Module buffers (BatchNorm running statistics) identical across ranks, on 2 gloo ranks.

Each rank trains on differently scaled data, so its running statistics differ from the
other's unless acco keeps them identical.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

from acco import AccoOptimizer, checkpoint
from tests.helpers import TIMEOUT, assert_identical_across_ranks

pytestmark = pytest.mark.timeout(120)

ROUNDS = 8


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3))


def batch(round_: int, rank: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * round_ + 100 * rank + index)
    return (1.0 + 3.0 * rank) * torch.randn(8, 5, generator=g) + rank, torch.randn(8, 3, generator=g)


def train_rounds(model: nn.Module, opt: AccoOptimizer, rounds: range, ready_loop: bool = False) -> None:
    rank = dist.get_rank()
    for r in rounds:
        index = 0
        while index < 2 or (ready_loop and not opt.ready() and index < 6):
            x, y = batch(r, rank, index)
            nn.functional.mse_loss(model(x), y).backward()
            opt.accumulate()
            index += 1
        opt.step()


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def trained(mode: str, buffers: str | None, ready_loop: bool = False) -> dict[str, torch.Tensor]:
    model = bn_model()
    opt = AccoOptimizer(model, torch.optim.AdamW, mode=mode, buffers=buffers, lr=1e-2, timeout=TIMEOUT)
    train_rounds(model, opt, range(ROUNDS), ready_loop)
    opt.finish()
    return {"state": state_of(model)}


@pytest.mark.parametrize("buffers", ["broadcast", "average"])
@pytest.mark.parametrize("mode", ["sync", "dpu", "acco"])
def test_parameters_and_buffers_are_bit_identical_after_finish(ranks, mode, buffers):
    results = ranks(2).run(trained, mode, buffers)
    assert "1.running_mean" in results[0]["state"] and "1.num_batches_tracked" in results[0]["state"]
    assert_identical_across_ranks(results, key="state")


def test_the_ready_loop_keeps_them_identical_too(ranks):
    assert_identical_across_ranks(ranks(2).run(trained, "acco", "average", True), key="state")


def test_none_leaves_each_rank_its_own_statistics(ranks):
    first, second = (result["state"] for result in ranks(2).run(trained, "acco", None))
    assert all(torch.equal(first[n], second[n]) for n in first if "running" not in n)  # parameters: identical
    assert not torch.allclose(first["1.running_mean"], second["1.running_mean"])  # differently scaled data


def one_sync_round(buffers: str) -> dict[str, torch.Tensor]:
    """One round in sync mode: this rank's own running statistics before step(), and the
    buffers after it."""
    model = bn_model()
    opt = AccoOptimizer(model, torch.optim.SGD, mode="sync", buffers=buffers, lr=0.1, timeout=TIMEOUT)
    x, y = batch(0, dist.get_rank(), 0)
    nn.functional.mse_loss(model(x), y).backward()
    opt.accumulate()
    before = state_of(model)
    opt.step()
    after = state_of(model)
    opt.finish()
    return {"before": before, "after": after}


def test_average_is_the_mean_of_the_ranks_statistics_computed_by_hand(ranks):
    first, second = ranks(2).run(one_sync_round, "average")
    for name in ("1.running_mean", "1.running_var"):
        mean = (first["before"][name] + second["before"][name]) / 2
        assert not torch.equal(first["before"][name], second["before"][name])
        torch.testing.assert_close(first["after"][name], mean, rtol=0, atol=1e-7)
        assert torch.equal(first["after"][name], second["after"][name])
    # num_batches_tracked is an integer: rank 0's (equal here: one forward each)
    assert first["after"]["1.num_batches_tracked"] == 1


def test_broadcast_gives_every_rank_rank_0s_statistics(ranks):
    first, second = ranks(2).run(one_sync_round, "broadcast")
    for name in ("1.running_mean", "1.running_var"):
        assert torch.equal(first["after"][name], first["before"][name])  # rank 0 keeps its own
        assert torch.equal(second["after"][name], first["before"][name])


def checkpoint_rank(mode: str, buffers: str, directory: str) -> dict[str, dict[str, torch.Tensor]]:
    """Save after 4 rounds, train 4 more; then load into a fresh model and optimizer and
    train the same 4: both continuations, this rank's full model state."""
    model = bn_model()
    opt = AccoOptimizer(model, torch.optim.AdamW, mode=mode, buffers=buffers, lr=1e-2, timeout=TIMEOUT)
    train_rounds(model, opt, range(4))
    checkpoint.save(directory, opt, model)
    train_rounds(model, opt, range(4, 8))
    live = state_of(model)
    opt.finish()
    finished = state_of(model)

    fresh = bn_model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)  # nothing of the fresh model's own values survives the load
    opt2 = AccoOptimizer(fresh, torch.optim.AdamW, mode=mode, buffers=buffers, lr=1e-2, timeout=TIMEOUT)
    checkpoint.load(directory, opt2, fresh)
    train_rounds(fresh, opt2, range(4, 8))
    live2 = state_of(fresh)
    opt2.finish()
    return {"live": live, "live2": live2, "finished": finished, "finished2": state_of(fresh)}


@pytest.mark.parametrize("buffers", ["broadcast", "average"])
@pytest.mark.parametrize("mode", ["dpu", "acco"])
def test_a_checkpoint_keeps_the_buffers_and_continues_bit_identically(ranks, mode, buffers):
    with tempfile.TemporaryDirectory() as directory:
        results = ranks(2).run(checkpoint_rank, mode, buffers, directory + "/ckpt")
    for result in results:
        for name in result["live"]:
            assert torch.equal(result["live"][name], result["live2"][name]), name
            assert torch.equal(result["finished"][name], result["finished2"][name]), name


def test_bad_policy_and_module_are_rejected_before_any_collective():
    model = bn_model()
    with pytest.raises(ValueError, match="Invalid buffers: 'mean'"):
        AccoOptimizer(model, torch.optim.SGD, buffers="mean", lr=0.1)
    with pytest.raises(TypeError, match="Invalid module"):
        AccoOptimizer(model.parameters(), torch.optim.SGD, module="model", lr=0.1)


def test_one_rank_runs_no_buffer_collective_and_trains_as_plain_torch():
    """World size 1: the buffers evolve exactly as without acco's buffer policy."""
    states = []
    for buffers in ("average", None):
        model = bn_model()
        opt = AccoOptimizer(model, torch.optim.SGD, mode="sync", buffers=buffers, lr=0.1)
        for r in range(3):
            x, y = batch(r, 0, 0)
            nn.functional.mse_loss(model(x), y).backward()
            opt.accumulate()
            opt.step()
        opt.finish()
        states.append(state_of(model))
    assert all(torch.equal(states[0][n], states[1][n]) for n in states[0])


def replaced_buffer_rank() -> dict[str, torch.Tensor]:
    """The model replaces a buffer's tensor mid-training (as EMA code that assigns does)."""
    model = bn_model()
    opt = AccoOptimizer(model, torch.optim.SGD, mode="dpu", buffers="average", lr=0.1, timeout=TIMEOUT)
    train_rounds(model, opt, range(2))
    model[1].running_mean = model[1].running_mean * 2.0 + dist.get_rank()  # a new tensor, rank-specific
    train_rounds(model, opt, range(2, 4))
    opt.finish()
    return {"state": state_of(model)}


def test_a_buffer_the_model_replaces_stays_synchronised(ranks):
    assert_identical_across_ranks(ranks(2).run(replaced_buffer_rank), key="state")


def bad_buffer_state_rank() -> str:
    """A state dict whose module buffer has another shape is refused before anything changes."""
    model = bn_model()
    opt = AccoOptimizer(model, torch.optim.SGD, mode="dpu", lr=0.1, timeout=TIMEOUT)
    train_rounds(model, opt, range(2))
    state = opt.state_dict()
    opt.finish()
    state["acco"]["buffers"]["live"][0] = torch.zeros(7)
    fresh = bn_model()
    opt2 = AccoOptimizer(fresh, torch.optim.SGD, mode="dpu", lr=0.1, timeout=TIMEOUT)
    before = state_of(fresh)
    try:
        opt2.load_state_dict(state)
    except ValueError as error:
        unchanged = all(torch.equal(before[k], v) for k, v in state_of(fresh).items())
        fresh_still = opt2.num_updates == 0 and opt2.in_flight is None
        opt2.close()
        return f"{error} | unchanged={unchanged and fresh_still}"
    return "loaded"


def test_a_mismatched_buffer_in_a_state_dict_is_refused_before_any_change(ranks):
    for message in ranks(2).run(bad_buffer_state_rank):
        assert "saved module buffer '1.running_mean' does not match" in message and "unchanged=True" in message


def test_module_and_params_naming_two_models_is_an_error():
    with pytest.raises(ValueError, match="module= names another model"):
        AccoOptimizer(bn_model(), torch.optim.SGD, module=bn_model(), lr=0.1)
