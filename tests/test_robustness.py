"""Faults: every failure is loud, fast and on every rank.

A rank that raises, dies or hangs; an exception in the base optimizer on the comm lane;
non-finite gradients under both policies; the lane thread's lifetime. Misuse of the API
(bad arguments, wrong call order) is in tests/test_misuse.py.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from acco import AccoOptimizer, CommLaneError
from tests.helpers import TIMEOUT, assert_params_equal
from tests.ranks import RankError, RankPool
from tests.reference import loss_fn, make_model, micro_batch, params_of

pytestmark = pytest.mark.timeout(180)
FAULT_TIMEOUT = 3.0  # seconds, the optimizer's timeout in the fault tests
MARGIN = 8.0


def lane_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "acco-comm-lane"]


def faulty_rank(fault: str, report: str) -> dict:
    """Rank 1 misbehaves after two rounds; rank 0 keeps training and reports what it saw."""
    rank = dist.get_rank()
    model = make_model()
    outcome: dict = {"rank": rank}
    started = None
    try:
        with AccoOptimizer(model, torch.optim.SGD, mode="acco", lr=0.1,
                           timeout=datetime.timedelta(seconds=FAULT_TIMEOUT)) as opt:
            for r in range(20):
                if rank == 1 and r == 2:
                    while not opt.ready():  # round 1 done on both lanes: the fault hits round 2's totals
                        time.sleep(0.01)
                    if fault == "raises":
                        raise ValueError("a bug in rank 1's loop")
                    if fault == "killed":
                        os._exit(1)
                    if fault == "stuck":  # hung until rank 0 has reported what it saw (or long past its timeout)
                        deadline = time.monotonic() + FAULT_TIMEOUT + MARGIN + 5
                        while not Path(report).exists() and time.monotonic() < deadline:
                            time.sleep(0.05)
                        return outcome
                loss_fn(model, *micro_batch(r, rank, 0)).backward()
                opt.accumulate()
                started = time.monotonic()
                opt.step()
    except Exception as error:  # what the user sees
        outcome.update(error=f"{type(error).__name__}: {error}",
                       seconds=time.monotonic() - started if started else None)
    outcome["lane_threads_left"] = len(lane_threads())
    if rank == 0:
        Path(report).write_text(json.dumps(outcome))
    return outcome


@pytest.mark.parametrize("fault", ["raises", "killed", "stuck"])
def test_a_failing_rank_makes_the_other_raise_within_the_timeout(tmp_path, fault) -> None:
    """When rank 1 raises, dies or hangs, rank 0 gets a CommLaneError naming the round and phase within
    the optimizer's timeout (plus a margin), never a hang."""
    report = tmp_path / "rank0.json"
    pool = RankPool(2)  # its own processes: a killed rank breaks a pool
    try:
        try:
            pool.run(faulty_rank, fault, str(report), timeout=FAULT_TIMEOUT + MARGIN + 30)
        except RankError:
            pass  # rank 1 died (killed)
    finally:
        pool.close(kill=True)
    outcome = json.loads(report.read_text())
    assert outcome["error"].startswith("CommLaneError"), outcome
    assert "round" in outcome["error"] and "during totals" in outcome["error"], outcome
    assert outcome["seconds"] < FAULT_TIMEOUT + MARGIN, outcome


def nonfinite_rank(policy: str, mode: str) -> dict:
    rank = dist.get_rank()
    model = make_model()
    opt = AccoOptimizer(model, torch.optim.AdamW, mode=mode, lr=1e-2, nonfinite=policy, timeout=TIMEOUT)
    history, committed, errors = [params_of(model)], [], []
    for r in range(6):
        loss_fn(model, *micro_batch(r, rank, 0)).backward()
        if rank == 1 and r == 2:
            next(model.parameters()).grad[0, 0] = float("nan")
        opt.accumulate()
        try:
            committed.append(opt.step())
        except CommLaneError as error:
            errors.append(str(error))
            break
        history.append(params_of(model))
    if not errors:
        opt.finish()
    else:
        opt.close()
    finite = all(torch.isfinite(v).all() for h in history for v in h.values())
    return {"history": history, "committed": committed, "errors": errors, "finite": finite,
            "skipped": opt.skipped_updates, "updates": opt.num_updates}


@pytest.mark.parametrize("mode", ["dpu", "acco"])
def test_nan_gradients_on_one_rank_raise_on_every_rank(ranks, mode) -> None:
    """A NaN gradient on one rank raises on every rank (nonfinite='raise'), before any parameter turns
    non-finite."""
    for result in ranks(2).run(nonfinite_rank, "raise", mode):
        assert len(result["errors"]) == 1 and "non-finite gradients on 1 rank(s)" in result["errors"][0]
        assert result["finite"]


@pytest.mark.parametrize("mode", ["dpu", "acco"])
def test_nan_gradients_with_skip_keep_parameters_unchanged_on_every_rank(ranks, mode) -> None:
    """With nonfinite='skip' the poisoned update is skipped on every rank: the parameters stay where
    they were and the ranks agree."""
    results = ranks(2).run(nonfinite_rank, "skip", mode)
    for result in results:
        assert result["errors"] == [] and result["finite"]
        assert result["skipped"] == 1
        assert_params_equal(result["history"][-1], results[0]["history"][-1])
    history, committed = results[0]["history"], results[0]["committed"]
    # The round handed over at step 3 (index 2) is the poisoned one; it lands at step 4.
    # dpu: that commit is skipped, so the parameters after step 4 equal those after step 3.
    # acco: round 2 is an estimate (skipped: no look-ahead) and its commit at round 3,
    # which still sums the poisoned gradients, is skipped too.
    if mode == "dpu":
        assert committed[3] is False
        assert_params_equal(history[4], history[3])
        assert results[0]["updates"] == 5
    else:
        assert committed[4] is False  # the commit of update 2 was skipped
        assert_params_equal(history[5], history[3])
        assert results[0]["updates"] == 2


class ExplodingSGD(torch.optim.SGD):
    """SGD whose every step raises, standing in for a bug in the base optimizer."""

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        raise FloatingPointError("injected failure in the base optimizer")


def lane_failure() -> list[str]:
    """The messages of the calls after a commit round failed on the comm lane."""
    model = make_model()
    opt = AccoOptimizer(model, ExplodingSGD, mode="dpu", lr=0.1, timeout=TIMEOUT)
    loss_fn(model, *micro_batch(0, 0, 0)).backward()
    opt.accumulate()
    opt.step()  # launches the round that fails on the lane
    messages = []
    for call in (opt.step, opt.step, opt.finish):
        try:
            call()
        except RuntimeError as error:
            messages.append(f"{type(error).__name__}: {error}")
    return messages


def test_an_exception_on_the_lane_surfaces_at_the_next_call(ranks) -> None:
    """The base optimizer's exception reaches the user as a CommLaneError at the next
    call, on every rank, and every later call says the comm lane failed."""
    for messages in ranks(2).run(lane_failure):
        assert messages[0].startswith("CommLaneError: commit round 0 failed on the comm lane during update")
        assert "injected failure" in messages[0]
        assert all("after the comm lane failed" in m for m in messages[1:])


def test_huge_finite_gradients_are_not_taken_for_non_finite() -> None:
    """Finite gradients whose fp32 sum overflows are not mistaken for non-finite; real infinities are."""
    param = torch.nn.Parameter(torch.zeros(8))
    opt = AccoOptimizer([param], torch.optim.SGD, mode="sync", lr=0.0)
    param.grad = torch.full((8,), 3e38)  # finite, but their float32 sum overflows
    opt.accumulate()
    assert opt.step() and opt.skipped_updates == 0
    param.grad = torch.zeros(8)
    param.grad[1], param.grad[2] = float("inf"), -float("inf")  # the sum is NaN
    opt.accumulate()
    with pytest.raises(CommLaneError, match="non-finite gradients on 1 rank"):
        opt.step()
    opt.close()


def test_the_lane_thread_never_outlives_the_optimizer() -> None:
    """The comm lane's thread ends when an optimizer with a round in flight is collected, or when a
    with block exits on any exception."""
    # Only this test's lanes count: an earlier test's optimizer kept alive by a reference
    # cycle may be collected (and its lane end) at any gc.collect() below.
    before = set(lane_threads())

    def one_round():
        model = make_model()
        opt = AccoOptimizer(model, torch.optim.SGD, mode="acco", lr=0.1)
        loss_fn(model, *micro_batch(0, 0, 0)).backward()
        opt.accumulate()
        opt.step()
        return opt

    def wait_for_threads(alive: set[threading.Thread]) -> None:
        """Until no lane thread but those in ``alive`` runs (10 s at most)."""
        deadline = time.monotonic() + 10
        while set(lane_threads()) - alive and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not set(lane_threads()) - alive

    # Garbage collection of an optimizer with a round in flight.
    opt = one_round()
    del opt
    gc.collect()
    wait_for_threads(before)

    # KeyboardInterrupt, or any exception, in the loop of a `with` block.
    for error in (KeyboardInterrupt, RuntimeError):
        with pytest.raises(error):
            with one_round() as opt:
                raise error()
        wait_for_threads(before)
        with pytest.raises(RuntimeError, match="after finish"):
            opt.step()
