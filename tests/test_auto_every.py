"""``sync_every="auto"``: H chosen before each round from the measured inner step time and the
round's own time (acco.replicas.plan_sync_every), the same on every replica, saved and resumed."""

from __future__ import annotations

import copy
import math
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from acco import AccoOptimizer
from acco.options import AUTO_EVERY_BOUNDS, BLOCK_OR_HIDE, FIT, FIXED
from acco.replicas import (AUTO_GROWTH, AUTO_HYSTERESIS, AUTO_WAIT_SHARE, HIDDEN_STEPS, HIDDEN_WAIT_SHARE, HIDE_COST,
                           EveryChoice, Pacing, plan_sync_every)
from tests.helpers import TIMEOUT, assert_identical_across_ranks, assert_params_equal
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
    step, share = 0.1, AUTO_WAIT_SHARE
    ratio = (1 - share) / share  # a blocking round of T costs T / (H t + T) <= share once H t >= T ratio

    def plan(current: int, round_seconds: float, blocking: bool = True, step_seconds: float = step) -> int:
        return plan_sync_every(current, BOUNDS, step_seconds, round_seconds, FIXED if blocking else FIT).sync_every

    # Blocking: a round of 10 steps' worth / ratio costs exactly the share of 10 steps and itself.
    assert plan(16, 10 * step / ratio) == 10
    assert plan(16, 10 * step / ratio * 1.01) == 11
    # In flight: the round must fit behind its steps (5 steps of 0.1 s for a round of 0.45 s).
    assert plan(30, 0.45, blocking=False) == 5
    # The bounds: a fast link keeps the lower one.
    assert plan(128, 100.0) == BOUNDS[1]
    assert plan(30, 1e-6) == BOUNDS[0]
    # Up at once, at most AUTO_GROWTH times a round (a round slowed by something else does not take
    # H to the upper bound); down only past AUTO_HYSTERESIS.
    assert plan(8, 100.0) == AUTO_GROWTH * 8
    assert plan(10, 11 * step / ratio) == 11
    inside = math.ceil(10 / AUTO_HYSTERESIS)
    assert plan(10, inside * step / ratio) == 10
    assert plan(10, (inside - 1) * step / ratio) == inside - 1
    # Nothing measured yet: H stays, and the choice says so.
    unmeasured = plan_sync_every(7, BOUNDS, 0.0, 0.5, FIXED)
    assert unmeasured.sync_every == 7 and math.isnan(unmeasured.needed)
    assert plan(7, 0.0) == 7
    # The choice says what it was made from.
    choice = plan_sync_every(4, BOUNDS, step, 10 * step / ratio, FIXED, report_round=3)
    assert (choice.step_seconds, choice.round_seconds, choice.report_round) == (step, 10 * step / ratio, 3)
    assert choice.needed == pytest.approx(10) and EveryChoice.from_dict(choice.as_dict()) == choice


def test_the_default_landing_blocks_a_cheap_round_and_hides_a_long_one() -> None:
    """The default landing (``"block-or-hide"``): a round blocks at the H that keeps its wait
    within AUTO_WAIT_SHARE, unless landing HIDDEN_STEPS after its launch would do with an H more
    than HIDE_COST steps smaller (its excess over the step within HIDDEN_WAIT_SHARE); past the
    upper bound, the smaller wait (hiding) wins; unmeasured, the landing stays."""
    step = 0.1
    blocking = (1 - AUTO_WAIT_SHARE) / AUTO_WAIT_SHARE  # T / t times this: blocking's H
    hiding = (1 - HIDDEN_WAIT_SHARE) / HIDDEN_WAIT_SHARE  # (T - t) / t times this: hiding's

    def plan(round_seconds: float, current: int = 4, bounds: tuple[int, int] = BOUNDS) -> tuple[int, int]:
        choice = plan_sync_every(current, bounds, step, round_seconds, BLOCK_OR_HIDE, current_delay=HIDDEN_STEPS)
        return choice.sync_every, choice.sync_delay

    assert plan(3 * step / blocking) == (4, 0)  # cheap: blocking at the lower bound
    assert plan(8 * step / blocking) == (8, 0)  # hiding would need the lower bound, 4: not more than HIDE_COST less
    assert plan((5 + HIDE_COST) * step / blocking, current=8) == (4, HIDDEN_STEPS)  # blocking 9, hidden 4: hidden
    hidden = math.ceil(0.5 * hiding)  # what a step does not hide of a round of 1.5 steps
    assert plan(1.5 * step, current=32) == (hidden, HIDDEN_STEPS) and math.ceil(1.5 * blocking) > hidden + HIDE_COST
    assert plan(1.5 * step, current=4, bounds=(4, 4)) == (4, HIDDEN_STEPS)  # both past the bound: hidden waits less
    assert plan(0.0) == (4, HIDDEN_STEPS)  # unmeasured: as it was


def every_history(opt: AccoOptimizer) -> list[dict]:
    """Each round's index, H, why (its :class:`EveryChoice`), report, and whether it landed."""
    return [{"index": s.index, "sync_every": s.sync_every,
             "choice": None if s.sync_every_choice is None else s.sync_every_choice.as_dict(),
             "report": None if s.replicas is None else s.replicas.as_dict(), "landed": not (s.dropped or s.replayed)}
            for s in opt.round_stats]  # fmt: skip


def assert_planned(history: list[dict], bounds: tuple[int, int], first_delay: int = 0) -> int:
    """Every round's H is the planner's, replayed: the lower bound until a choice is made, then
    :func:`plan_sync_every` on the report of the landed round its choice names (the fastest
    replica's pace, the slowest round time) from the H chosen before it. Returns how many
    choices were replayed."""
    reports = {h["index"]: h["report"] for h in history if h["landed"] and h["report"] is not None}
    current, current_delay, last, replayed = bounds[0], first_delay, None, 0
    for h in history:
        choice = h["choice"]
        if choice is None:
            assert h["sync_every"] == bounds[0], h
            continue
        assert h["sync_every"] == choice["sync_every"], h
        if choice["report_round"] == last:  # (a round launched again without a landing: the same choice)
            continue
        report = reports[choice["report_round"]]
        paces = [s for s in report["step_seconds"] if s > 0]
        assert (choice["step_seconds"], choice["round_seconds"]) == (min(paces, default=0.0),
                                                                      max(report["round_seconds"], default=0.0)), h
        again = plan_sync_every(current, bounds, choice["step_seconds"], choice["round_seconds"], choice["rule"],
                                choice["report_round"], current_delay)  # fmt: skip
        assert (again.sync_every, again.sync_delay) == (choice["sync_every"], choice["sync_delay"]), (again, h)
        assert again.needed == pytest.approx(choice["needed"], nan_ok=True), (again, h)
        current, current_delay, last = choice["sync_every"], choice["sync_delay"], choice["report_round"]
        replayed += 1
    return replayed


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
    for options, says in ((dict(sync_delay=5), "Invalid sync_delay"), (dict(sync_delay="half"), "Invalid sync_delay"),
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
    return {"history": history, "saved": saved, "every": every_history(opt)}


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
    for result in results:  # each round's H is the planner's choice from the run's own reports
        assert_planned(result["every"], (2, 16))


def test_a_resume_keeps_the_h_it_had_chosen(ranks) -> None:
    """Each rank's state saved mid-run holds the H of the steps since its last launch and the
    one the next launch takes; a resumed run's first round is that H, and its rounds are the same
    on both replicas."""
    results = ranks(2).run(auto_rank, 60, 30, None, 0)
    saved = [r["saved"] for r in results]
    chosen = saved[0]["acco"]["local"]["sync_every"]
    assert 2 <= chosen <= 16 and saved[1]["acco"]["local"]["sync_every"] == chosen
    assert saved[0]["acco"]["local"]["next_every"] == saved[1]["acco"]["local"]["next_every"]
    resumed = ranks(2).run(auto_rank, 4, None, saved, 0)
    # (a rank saved while a round it would have landed late was in flight replays its landing)
    landed = [[entry for entry in r["history"] if entry[2] is not None] for r in resumed]
    assert landed[0] == landed[1]
    assert resumed[0]["history"][0][1] == resumed[1]["history"][0][1] == chosen


def late_rank(every: object, late_seconds: float) -> dict:
    """Replicas in lockstep, 50 ms an inner step, replica 1 ``late_seconds`` behind at its hand-over
    after step 8: the inner step after which each landed round landed on this replica."""
    rank = dist.get_rank()
    model = make_model()
    cls, hp = OPTIMIZERS["adamw"]
    opt = AccoOptimizer(model, cls, mode="local", sync_every=every, sync_delay=0, pacing="lockstep", timeout=TIMEOUT,
                        **hp)  # fmt: skip
    landed_after = []
    for step in range(16):
        time.sleep(0.05 + (late_seconds if rank == 1 and step == 7 else 0.0))
        before = opt.outer_rounds
        inner_step(opt, model, step, rank, weighted=False)
        landed_after += [step + 1] * (opt.outer_rounds - before)
    opt.finish()
    return {"landed_after": landed_after, "params": params_of(model),
            "patience": [s.patience_seconds for s in opt.round_stats]}


@pytest.mark.parametrize("every", [("auto", 4, 4), 4])
def test_a_round_waits_for_the_link_not_for_a_replica_behind(ranks, every) -> None:
    """sync_every="auto" (bounds 4-4: H stays 4), blocking rounds: replica 1 hands over round 2 a second late;
    replica 0 waits PEER_PATIENCE of a step for it (asserted), goes on stepping and lands the round late,
    its steps since kept, by its next launch at the latest (after step 12), where it waits if it
    must (and round 3 may then land late too, by step 16); both replicas launch every round at
    the same step counts and end identical. With a
    fixed sync_every (4) replica 0 waits for replica 1 at the launch (its rounds are the
    recurrence's bit for bit)."""
    results = ranks(2).run(late_rank, every, 1.0)
    assert_identical_across_ranks(results)
    fast, slow = (r["landed_after"] for r in results)
    if every == 4:
        assert fast[:4] == slow[:4] == [4, 8, 12, 16], (fast, slow)
        assert results[0]["patience"][1] == 0.0
        return
    # Each round launched after steps 4, 8, 12 and 16 on both, and landed by the next launch (the
    # first may land late on either, as the machine's timing makes one replica hand over first).
    for landed in (fast, slow):
        assert all(4 * (n + 1) <= step <= 4 * (n + 2) for n, step in enumerate(landed[:4])), landed
    # Round 2: replica 0 waited its patience for replica 1 and went on, landing it late. (Replica 1,
    # last to hand over, lands it at 8 on a quiet machine; beside two busy loops the exchange
    # itself outlasted its patience too, and it landed at 9: the load's, not the rule's.)
    assert 8 < fast[1] <= 12, (fast, slow)
    assert results[0]["patience"][1] > 0.0


def hidden_rank(every: object, delay: object, round_steps: float) -> dict:
    """Replicas in lockstep, their measures replaced (steps of 10 ms, rounds of ``round_steps``
    of them; no late landing): the inner step after which each round landed, the parameters."""
    rank = dist.get_rank()
    measured_pace, measured_hand_over, measured_patience = Pacing.pace, Pacing.hand_over, Pacing.patience

    def hand_over(self):  # type: ignore[no-untyped-def]
        if self.round_seconds > 0:
            self.round_seconds = round_steps * STEP_SECONDS
        return measured_hand_over(self)

    Pacing.pace, Pacing.hand_over = (lambda self: STEP_SECONDS), hand_over  # type: ignore[method-assign]
    Pacing.patience = lambda self, blocks=True: None  # type: ignore[method-assign]
    try:
        model = make_model()
        cls, hp = OPTIMIZERS["adamw"]
        opt = AccoOptimizer(model, cls, mode="local", sync_every=every, sync_delay=delay, pacing="lockstep",
                            timeout=TIMEOUT, **hp)  # fmt: skip
        landed_after = []
        for step in range(24):
            before = opt.outer_rounds
            inner_step(opt, model, step, rank, weighted=False)
            landed_after += [step + 1] * (opt.outer_rounds - before)
        trained = params_of(model)
        opt.finish()
    finally:
        Pacing.pace, Pacing.hand_over, Pacing.patience = measured_pace, measured_hand_over, measured_patience  # type: ignore[method-assign]
    return {"landed_after": landed_after, "trained": trained, "params": params_of(model), "every": every_history(opt)}


def test_a_round_longer_than_blocking_allows_hides_behind_a_step(ranks) -> None:
    """The default landing with rounds of 1.5 inner steps (bounds 4-4: H stays 4): blocking
    would wait 27% of the time, so every round lands one step after its launch, as the first
    ones do before anything is measured; the 24 inner steps are then bit for bit the fixed
    ``sync_every=4, sync_delay=1`` run's (the estimate rule; finish() then runs a last round with
    "auto", where a replica may have landed late), both replicas end identical, and every
    choice is the planner's, replayed."""
    hidden = ranks(2).run(hidden_rank, ("auto", 4, 4), None, 1.5)
    fixed = ranks(2).run(hidden_rank, 4, 1, 1.5)
    assert_identical_across_ranks(hidden)
    for a, b in zip(hidden, fixed):
        assert a["landed_after"] == b["landed_after"] == [5, 9, 13, 17, 21], a["landed_after"]
        assert_params_equal(a["trained"], b["trained"])  # (finish() then runs a last round with "auto")
        assert assert_planned(a["every"], (4, 4), first_delay=HIDDEN_STEPS) >= 3
        assert all(h["choice"]["sync_delay"] == HIDDEN_STEPS for h in a["every"] if h["choice"] is not None)


@pytest.mark.stress
@pytest.mark.timeout(240)
def test_h_follows_the_link_when_its_rate_changes(tmp_path) -> None:
    """Behind 5 Mbit/s a 4-bit round of a 1.05M-parameter model moves about 1 MB through the
    loopback (about 1.7 s), far over what AUTO_WAIT_SHARE (4%) of 128 steps of 0.05 s leaves it:
    once measured, H doubles round after round to the upper bound. The job then lifts the limit.
    A hand-over reports the median of the replica's last ROUND_WINDOW (5) rounds, the landing
    plans from it and the next launch takes the plan, so the fifth round after the lift is the
    first planned from a median of rounds on the fast link: from there H is below the bound, on
    both replicas alike (skipped where no rate-limited namespace can be made)."""
    try:
        netns.check_requirements()
        with netns.namespace("5mbit") as name:
            results = run_script(JOB, str(tmp_path), "--rounds-after", "8", netns=name, timeout=200)
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
    climb = [every[n] for n in range(lifted + 1) if n > 1]
    assert all(b in (a, min(2 * a, 128)) for a, b in zip(climb, climb[1:])), every  # at most doubling a round
    assert all(every[lifted + n] == 128 for n in range(1, 5)), every  # planned from rounds behind 5 Mbit/s
    assert every[lifted + 5] < 128 and every[lifted + 6] < 128, every  # from a median of rounds on the lifted link


# Each round's time as a function of the H just stepped, so that the planner's choices move every
# few rounds, the same in every run: a round after fewer than 16 steps asks for 16 (H doubles
# towards it, AUTO_GROWTH at a time), one after 16 for 2 (H falls back). Steps of 0.01 s.
STEP_SECONDS = 0.01


def cycled_round_seconds(stepped: int) -> float:
    """The round time that makes a blocking plan ask for 16 after fewer than 16 steps, 2 after 16."""
    asked = 2 if stepped >= 16 else 16
    return (asked - 0.5) * STEP_SECONDS * AUTO_WAIT_SHARE / (1 - AUTO_WAIT_SHARE)


def planned_rank(start: int, steps: int, save_at: int | None, states: list[dict] | None) -> dict:
    """Replicas in lockstep with sync_every=("auto", 2, 16), blocking, their measures replaced
    by :func:`cycled_round_seconds` and no late landing (the wall clock of one run is not another's): inner steps ``start`` to
    ``start + steps``, from this rank's model and optimizer state in ``states`` if given; the
    state after ``save_at`` inner steps."""
    rank = dist.get_rank()
    measured_pace, measured_hand_over, measured_patience = Pacing.pace, Pacing.hand_over, Pacing.patience

    def hand_over(self):  # type: ignore[no-untyped-def]
        if self.round_seconds > 0:  # a round has landed: its time, as cycled_round_seconds has it
            self.round_seconds = cycled_round_seconds(self.sync_every)
        return measured_hand_over(self)

    Pacing.pace, Pacing.hand_over = (lambda self: STEP_SECONDS), hand_over  # type: ignore[method-assign]
    # No late landing either: where a replica lands a round that waited for a peer depends on the
    # wall clock too (test_a_round_waits_for_the_link_not_for_a_replica_behind); this is the planner's.
    Pacing.patience = lambda self, blocks=True: None  # type: ignore[method-assign]
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
        Pacing.pace, Pacing.hand_over, Pacing.patience = measured_pace, measured_hand_over, measured_patience  # type: ignore[method-assign]
    history = [(s.index, s.sync_every) for s in opt.round_stats if not s.replayed]
    return {"history": history, "saved": saved, "params": params_of(model)}


def test_a_checkpoint_taken_while_the_planner_runs_resumes_bit_for_bit(ranks) -> None:
    """A run saved after 37 inner steps (inside a round, H having moved 2 -> 4 -> 8 -> ...) and
    resumed in new processes ends with the uninterrupted run's parameters on every replica, bit
    for bit, through the same H in every round after the save."""
    whole = ranks(2).run(planned_rank, 0, 80, 37, None)
    every = [h for _, h in whole[0]["history"]]
    assert {2, 4, 8, 16} <= set(every), every  # the planner moved H, up and down, before the save and after
    resumed = ranks(2).run(planned_rank, 37, 43, None, [r["saved"] for r in whole])
    for rank in range(2):
        assert_params_equal(resumed[rank]["params"], whole[rank]["params"])
    after = [h for _, h in resumed[0]["history"]]
    assert after == every[len(every) - len(after):], (every, after)
