"""The comm lane really runs while the compute lane computes."""

from __future__ import annotations

import time

import pytest
import torch

from acco import AccoOptimizer
from tests.helpers import TIMEOUT, assert_params_close
from tests.reference import OPTIMIZERS, RECURRENCES, loss_fn, make_model, micro_batch, params_of

pytestmark = pytest.mark.timeout(120)


class SlowSGD(torch.optim.SGD):
    """SGD whose step takes a while, standing in for a slow update or network."""

    def step(self, closure=None):
        time.sleep(0.3)
        return super().step(closure)


def overlapping_rank(mode: str) -> dict:
    model = make_model()
    opt = AccoOptimizer(model, SlowSGD, mode=mode, lr=0.1, timeout=TIMEOUT)
    intervals: list[list[tuple[float, float]]] = []
    for r in range(4):
        loss_fn(model, *micro_batch(r, 0, 0)).backward()
        opt.accumulate()
        opt.step()
        # The heterogeneous loop: keep computing until the round in flight has landed.
        computed = []
        while not opt.ready():
            started = time.perf_counter()
            loss_fn(model, *micro_batch(r, 0, len(computed) + 1)).backward()
            opt.accumulate()
            computed.append((started, time.perf_counter()))
        intervals.append(computed)
    opt.finish()
    lanes = [(s.lane_start, s.lane_end) for s in opt.round_stats]
    return {"intervals": intervals, "lanes": lanes, "hidden": [s.hidden_share for s in opt.round_stats]}


@pytest.mark.parametrize("mode", ["dpu", "acco"])
def test_micro_batches_run_inside_the_lane_round(ranks, mode) -> None:
    """While a slow round is on the comm lane the compute lane runs at least two micro-batches inside
    it, and hardly waits at step()."""
    for result in ranks(2).run(overlapping_rank, mode):
        for computed, (lane_start, lane_end) in zip(result["intervals"], result["lanes"]):
            inside = [(a, b) for a, b in computed if lane_start < a and b < lane_end]
            assert len(inside) >= 2, (computed, lane_start, lane_end)
        # The compute lane hardly waited for the rounds it overlapped.
        assert min(result["hidden"][:3]) > 0.5


def test_sync_does_not_overlap() -> None:
    """In sync mode nothing is in flight after step(): no micro-batch overlaps a round."""
    result = overlapping_rank("sync")
    assert all(computed == [] for computed in result["intervals"])
    assert max(result["hidden"]) < 0.2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["sync", "dpu", "acco"])
def test_cuda_stream_lane_matches_the_recurrence(mode) -> None:
    """On CUDA each mode follows its recurrence (world size 1)."""
    model = make_model().cuda()
    cls, hp = OPTIMIZERS["adamw"]
    opt = AccoOptimizer(model, cls, mode=mode, **hp)
    data = []
    for r in range(6):
        x, y = micro_batch(r, 0, 0)
        loss_fn(model, x.cuda(), y.cuda()).backward()
        opt.accumulate()
        opt.step()
        data.append([(x, y, 1.0)])
    opt.finish()
    expected = RECURRENCES[mode](params_of(make_model()), "adamw", data)
    assert_params_close({name: value.cpu() for name, value in params_of(model).items()}, expected,
                        rtol=1e-4, atol=1e-4)
