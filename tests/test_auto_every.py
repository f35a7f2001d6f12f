"""``sync_every="auto"``: H chosen before each round from the measured inner step time and the
round's own time (acco.replicas.plan_sync_every), the same on every replica, saved and resumed."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from acco import AccoOptimizer
from acco.options import AUTO_EVERY_BOUNDS
from acco.replicas import AUTO_HYSTERESIS, AUTO_SHARE, Pacing, plan_sync_every
from tests.helpers import TIMEOUT, assert_params_equal
from tests.reference import OPTIMIZERS, make_model, params_of
from tests.ranks import run_script
from tests.test_local import inner_step

BENCHMARKS = str(Path(__file__).resolve().parent.parent / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

import netns  # noqa: E402

JOB = str(Path(__file__).resolve().parent / "auto_every_job.py")

pytestmark = pytest.mark.timeout(120)

BOUNDS = (4, 128)


def test_the_plan_is_the_smallest_h_whose_round_costs_its_share() -> None:
    step, share = 0.1, AUTO_SHARE
    # Blocking: a round of AUTO_SHARE * 1 s costs AUTO_SHARE of 10 steps of 0.1 s.
    assert plan_sync_every(30, BOUNDS, step, share * 10 * step, blocking=True) == 10
    # In flight: the round must fit behind its steps (5 steps of 0.1 s for a round of 0.45 s).
    assert plan_sync_every(30, BOUNDS, step, 0.45, blocking=False) == 5
    # The bounds.
    assert plan_sync_every(30, BOUNDS, step, 100.0, blocking=True) == BOUNDS[1]
    assert plan_sync_every(30, BOUNDS, step, 1e-6, blocking=True) == BOUNDS[0]
    # Nothing measured yet: H stays.
    assert plan_sync_every(7, BOUNDS, 0.0, 0.5, blocking=True) == 7
    assert plan_sync_every(7, BOUNDS, 0.1, 0.0, blocking=True) == 7
    # Hysteresis: a choice within AUTO_HYSTERESIS of H leaves it; one outside moves it.
    inside = int(10 * AUTO_HYSTERESIS)
    assert plan_sync_every(10, BOUNDS, step, share * inside * step, blocking=True) == 10
    assert plan_sync_every(10, BOUNDS, step, share * (inside + 1) * step, blocking=True) == inside + 1
    assert plan_sync_every(10, BOUNDS, step, share * 7 * step, blocking=True) == 7


def test_auto_is_checked_before_anything_is_built() -> None:
    model = torch.nn.Linear(2, 2)
    opt = AccoOptimizer(model, torch.optim.AdamW, mode="local", sync_every="auto")
    assert (opt.options.local.sync_every, opt.options.local.auto_every) == (AUTO_EVERY_BOUNDS[0], AUTO_EVERY_BOUNDS)
    assert "sync_every: auto (4-128, from 4)" in repr(opt)
    opt.finish()
    opt = AccoOptimizer(model, torch.optim.AdamW, mode="local", sync_every=("auto", 8, 64))
    assert (opt.options.local.sync_every, opt.options.local.auto_every) == (8, (8, 64))
    opt.finish()
    for bad in ("often", ("auto", 0, 8), ("auto", 16, 8), ("auto", 4), ("auto", 4.0, 8)):
        with pytest.raises(ValueError, match="Invalid sync_every"):
            AccoOptimizer(model, torch.optim.AdamW, mode="local", sync_every=bad)
    for options, says in ((dict(sync_delay=3), "Invalid sync_delay"), (dict(sync_delay="half"), "Invalid sync_delay"),
                          (dict(pacing=[4, 4]), "Invalid pacing")):
        with pytest.raises(ValueError, match=says):
            AccoOptimizer(model, torch.optim.AdamW, mode="local", sync_every="auto", **options)


def auto_rank(steps: int, save_at: int | None, states: list[dict] | None, delay: object) -> dict:
    """Replicas in lockstep with sync_every="auto" (bounds 2-16): each round's H, and the state
    saved after ``save_at`` inner steps (or, from ``states``, each rank's own, the H a resumed run
    starts with)."""
    rank = dist.get_rank()
    model = make_model()
    cls, hp = OPTIMIZERS["adamw"]
    opt = AccoOptimizer(model, cls, mode="local", sync_every=("auto", 2, 16), sync_delay=delay, pacing="lockstep",
                        timeout=TIMEOUT, **hp)  # fmt: skip
    if states is not None:
        opt.load_state_dict(states[rank])
    saved = None
    for step in range(steps):
        inner_step(opt, model, step, rank, weighted=False)
        if save_at is not None and step + 1 == save_at:
            saved = opt.state_dict()
    opt.finish()
    history = [(s.index, s.sync_every, None if s.replayed else list(s.replicas.steps)) for s in opt.round_stats]
    return {"history": history, "saved": saved}


@pytest.mark.parametrize("delay", [0, "auto"])
def test_every_replica_takes_the_same_h_each_round(ranks, delay) -> None:
    """The H of each round is the same on both replicas and what each replica stepped (with
    rounds landing in flight too, at different steps on each replica: the new H starts at the
    next launch); the first round runs the lower bound."""
    results = ranks(2).run(auto_rank, 60, None, None, delay)
    histories = [r["history"] for r in results]
    assert histories[0] == histories[1]
    assert histories[0][0][1] == 2
    for _, every, stepped in histories[0][:-1]:  # (the last round: finish()'s, over the steps left)
        assert 2 <= every <= 16 and stepped == [every, every]


def test_a_resume_keeps_the_h_it_had_chosen(ranks) -> None:
    """Each rank's state saved mid-run holds the H of the steps since its last launch and the
    one the next launch takes; a resumed run's first round is that H."""
    results = ranks(2).run(auto_rank, 60, 30, None, 0)
    saved = [r["saved"] for r in results]
    chosen = saved[0]["acco"]["local"]["sync_every"]
    assert 2 <= chosen <= 16 and saved[1]["acco"]["local"]["sync_every"] == chosen
    assert saved[0]["acco"]["local"]["next_every"] == saved[1]["acco"]["local"]["next_every"]
    resumed = ranks(2).run(auto_rank, 4, None, saved, 0)
    assert resumed[0]["history"] == resumed[1]["history"]
    assert resumed[0]["history"][0][1] == chosen


@pytest.mark.stress
@pytest.mark.timeout(240)
def test_h_follows_the_link_when_its_rate_changes(tmp_path) -> None:
    """Behind 5 Mbit/s a 4-bit round of a 1.05M-parameter model moves about 1 MB through the
    loopback (about 1.7 s), far over AUTO_SHARE (0.2) of 128 steps of 0.02 s: once measured, H goes
    to the upper bound. The job then lifts the limit. A round's H is planned from the round
    three before it (a hand-over reports the last round landed, the landing plans, the next
    launch takes the plan), so the fourth round after the lift is the first planned from a round
    on the fast link: from there H is half the bound or less, on both replicas alike (skipped
    where no rate-limited namespace can be made)."""
    try:
        netns.check_requirements()
        with netns.namespace("5mbit") as name:
            results = run_script(JOB, str(tmp_path), netns=name, timeout=200)
    except netns.NetnsError as error:
        pytest.skip(f"no rate-limited namespace here: {error}")
    records = []
    for rank, result in enumerate(results):
        path = tmp_path / f"rank{rank}.pt"
        assert path.exists(), f"rank {rank} wrote nothing (exit {result.returncode}):\n{result.stderr[-3000:]}"
        records.append(torch.load(path, weights_only=False))
    for record in records:
        assert record["error"] is None, record["error"]
    assert records[0]["rounds"] == records[1]["rounds"] and records[0]["lifted_after"] == records[1]["lifted_after"]
    every = dict(records[0]["rounds"])
    lifted = records[0]["lifted_after"]
    assert every[0] == 2 and every[lifted] == 128, every  # from the lower bound to the upper behind 5 Mbit/s
    assert every[lifted + 1] == every[lifted + 2] == every[lifted + 3] == 128, every  # from rounds behind 5 Mbit/s
    assert max(every[lifted + 4], every[lifted + 5]) <= 128 // 2, every  # from rounds on the lifted link


# Each round's time as a function of the H just stepped, so that the planner's choices move every
# round, the same in every run: from H the next round takes CYCLE[H] (blocking, steps of 0.01 s).
CYCLE = {2: 10, 10: 4, 4: 14, 14: 2}
STEP_SECONDS = 0.01


def planned_rank(start: int, steps: int, save_at: int | None, states: list[dict] | None) -> dict:
    """Replicas in lockstep with sync_every=("auto", 2, 16), blocking, their measures replaced
    by :data:`CYCLE`'s (the wall clock of one run is not another's): inner steps ``start`` to
    ``start + steps``, from this rank's model and optimizer state in ``states`` if given; the
    state after ``save_at`` inner steps."""
    rank = dist.get_rank()
    measured_pace, measured_hand_over = Pacing.pace, Pacing.hand_over

    def hand_over(self):  # type: ignore[no-untyped-def]
        if self.round_seconds > 0:  # a round has landed: its time, as CYCLE has it
            self.round_seconds = AUTO_SHARE * STEP_SECONDS * (CYCLE[self.sync_every] - 0.5)
        return measured_hand_over(self)

    Pacing.pace, Pacing.hand_over = (lambda self: STEP_SECONDS), hand_over  # type: ignore[method-assign]
    try:
        model = make_model(seed=100 if states else 0)  # a resumed run's other values are overwritten
        cls, hp = OPTIMIZERS["adamw"]
        opt = AccoOptimizer(model, cls, mode="local", sync_every=("auto", 2, 16), sync_delay=0, pacing="lockstep",
                            timeout=TIMEOUT, **hp)  # fmt: skip
        if states is not None:
            model.load_state_dict(states[rank]["model"])
            opt.load_state_dict(states[rank]["optimizer"])
        saved = None
        for step in range(start, start + steps):
            inner_step(opt, model, step, rank, weighted=False)
            if step + 1 == save_at:
                # (a copy, as torch.save makes one: the state's tensors are the optimizer's own, and train on)
                saved = {"optimizer": copy.deepcopy(opt.state_dict()), "model": copy.deepcopy(model.state_dict())}
        opt.finish()
    finally:
        Pacing.pace, Pacing.hand_over = measured_pace, measured_hand_over  # type: ignore[method-assign]
    history = [(s.index, s.sync_every) for s in opt.round_stats if not s.replayed]
    return {"history": history, "saved": saved, "params": params_of(model)}


def test_a_checkpoint_taken_while_the_planner_runs_resumes_bit_for_bit(ranks) -> None:
    """A run saved after 37 inner steps (inside a round, H having moved 2 -> 10 -> 4 -> ...) and
    resumed in new processes ends with the uninterrupted run's parameters on every replica, bit
    for bit, through the same H in every round after the save."""
    whole = ranks(2).run(planned_rank, 0, 80, 37, None)
    every = [h for _, h in whole[0]["history"]]
    assert {2, 10, 4, 14} <= set(every), every  # the planner moved H, before the save and after
    resumed = ranks(2).run(planned_rank, 37, 43, None, [r["saved"] for r in whole])
    for rank in range(2):
        assert_params_equal(resumed[rank]["params"], whole[rank]["params"])
    after = [h for _, h in resumed[0]["history"]]
    assert after == every[len(every) - len(after):], (every, after)
