"""Speed pacing that no loop can hang on (mode="local", ``pacing="speed"``, the default).

- Replicas of equal speed keep equal plans, bit for bit the lockstep run: behind rate-limited
  links with 32-bit rounds of over a second, a loop that broadcasts rank 0's step count at every
  inner step ends with equal plans (the replica whose comm lane finished a round first used to
  count its wait in that broadcast for the other as compute, and the plans drifted apart).
- A replica 3x slower is paced (fewer steps a round) once two reports show it, and rank 0 warns
  once, naming the plans and what they mean for the loop's own collectives.
- A loop whose own collective at every inner step meets paced replicas trains on: the replica that
  hands over first goes on stepping and lands the round late; only a replica that stops stepping
  raises PacingStall (on the replica waiting for its hand-over, within its bound), no hang.
- The rule itself, on reports: the dead band and the two reports, the pace over blocks of steps
  (a step with a wait for a round left out), the patience, the bound.
"""

from __future__ import annotations

import logging
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from acco.options import LocalOptions, Mode
from acco.replicas import (APART_REPORTS, PACE_BLOCK, PATIENCE_ROUNDS, PATIENCE_SECONDS, PEER_PATIENCE,
                           PEER_PATIENCE_SECONDS, SPEED_BAND, STALL_ROUNDS, STALL_SHARE, Pacing, PacingStall,
                           ReplicaReport, block_median, pace_window)
from tests.helpers import assert_identical_across_ranks, assert_params_equal, this_rank
from tests.ranks import run_script
from tests.reference import make_model, params_of
from tests.test_local import build, inner_step

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import netns  # noqa: E402

pytestmark = pytest.mark.timeout(180)
JOB = str(Path(__file__).resolve().parent / "pacing_job.py")


def job(out: Path, *args: str, netns_name: str | None = None, timeout: float = 120.0) -> list[dict]:
    """tests/pacing_job.py on 2 ranks; each rank's record, with its exit status and stderr."""
    results = run_script(JOB, str(out), *args, netns=netns_name, timeout=timeout)
    records = []
    for rank, result in enumerate(results):
        path = out / f"rank{rank}.pt"
        assert path.exists(), f"rank {rank} wrote nothing (exit {result.returncode}):\n{result.stderr[-3000:]}"
        records.append({**torch.load(path, weights_only=False), "returncode": result.returncode, "stderr": result.stderr})
    return records


@pytest.fixture(params=[pytest.param("10mbit", marks=pytest.mark.measured), "40mbit"])
def slow_link(request):
    """A network namespace whose loopback carries 10 or 40 Mbit/s (skipped where one cannot be made;
    the fast tier runs 40, the measured tier, ``-m measured``, 10 too)."""
    try:
        netns.check_requirements()
        with netns.namespace(request.param) as name:
            yield name
    except netns.NetnsError as error:
        pytest.skip(f"no rate-limited namespace here: {error}")


def test_equal_replicas_behind_a_slow_link_keep_equal_plans(slow_link, tmp_path) -> None:
    """Two equal replicas, 32-bit rounds of over a second at 10 Mbit/s (1 MB of parameters) and
    of a quarter second at 40, sync_every=30, a broadcast of rank 0's step count at every inner
    step deciding the stop: with the default pacing every round's plan is [30, 30] (so the run is
    the lockstep one, whose launches equal plans repeat:
    test_equal_replicas_are_the_lockstep_run_bit_for_bit), nothing is warned, and the job ends."""
    speed = job(tmp_path, "--loop", "broadcast", "--outer-bits", "32", "--width", "256", "--steps", "90",
                netns_name=slow_link)
    for record in speed:
        assert record["returncode"] == 0 and record["error"] is None, record["stderr"][-3000:]
        assert record["steps"] == 90
        assert record["plans"] and all(plan == [30, 30] for plan in record["plans"]), record["plans"]
        assert not record["warnings"] and not record["logged"]
        # The premise: rounds far longer than a step (finish()'s, which carries nothing, moves half).
        assert statistics.median(record["round_seconds"]) > 0.2, record["round_seconds"]
    assert_identical_across_ranks(speed)


def sleepy_rank(options: dict, budget: int, sleep: list[float], reported: bool = False) -> dict:
    """A plain loop (stop on should_stop), rank r sleeping sleep[r] s a step; the warnings and
    acco log records about pacing this rank raised. ``reported``: each replica's pace is its
    sleep exactly (``Pacing.pace`` replaced for this run), not the measured one: on loaded
    cores two ranks' shares differ by more than the band, and the plan follows what the
    replicas report (the measure itself: test_the_pace_is_a_median_of_block_means)."""
    rank = this_rank()
    measured = Pacing.pace
    if reported:
        Pacing.pace = lambda self: sleep[rank]  # type: ignore[method-assign]
    model = make_model(seed=rank)
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("acco").addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = build(model, "adamw", **options)
            opt.stop_after(steps=budget)
            steps, planned = 0, []
            while not opt.should_stop:
                time.sleep(sleep[rank])
                inner_step(opt, model, steps, rank, True)
                steps += 1
                while len(planned) < len(opt.round_stats):  # the plan each landed round gave
                    planned.append(list(opt.replica_steps))
            opt.finish()
    finally:
        logging.getLogger("acco").removeHandler(handler)
        Pacing.pace = measured  # type: ignore[method-assign]
    return {"params": params_of(model), "steps": steps, "plans": [list(s.replicas.steps) for s in opt.round_stats],
            "planned": planned,
            "warnings": [str(w.message) for w in caught if "speed pacing" in str(w.message)],
            "logged": [m for m in logged if "speed pacing" in m]}


@pytest.mark.parametrize("reported", [True, pytest.param(False, marks=pytest.mark.measured)])
def test_a_slow_replica_is_paced_and_rank_0_warns_once(ranks, reported) -> None:
    """Replica 1 three times slower (30 ms a step against 10, reported as such; measured in the
    measured tier, ``-m measured``): the first round in lockstep (nothing measured), then, a gap past twice the band
    in one report, the fast replica takes sync_every and the slow one a third (measured on
    loaded cores: up to 5 of 8); rank 0 warns once (the warning and the acco logger), naming the
    plan and the fix; rank 1 says nothing."""
    options = {"sync_every": 8, "sync_delay": 0, "pacing": "speed"}
    results = ranks(2).run(sleepy_rank, options, 48, [0.01, 0.03], reported)
    assert_identical_across_ranks(results)
    plans, planned = results[0]["plans"], results[0]["planned"]
    assert plans[0] == [8, 8]
    # The plans each round gave (the steps a replica hands over can be more: it steps on while
    # it waits for the other's hand-over, as long as the load makes that wait).
    slowest = 3 if reported else 5
    assert all(fast == 8 and 2 <= slow <= slowest for fast, slow in planned[:-1]), planned
    first, _ = results
    assert len(first["warnings"]) == 1 and len(first["logged"]) == 1
    message = first["warnings"][0]
    assert f"plan {planned[0]}" in message and "pacing='lockstep'" in message and "outer rounds" in message
    assert not results[1]["warnings"] and not results[1]["logged"]


@pytest.mark.parametrize("bits, reported", [(32, True), (4, True), pytest.param(32, False, marks=pytest.mark.measured)])
def test_equal_replicas_are_the_lockstep_run_bit_for_bit(ranks, bits, reported) -> None:
    """Default pacing, equal replicas (10 ms a step each, reported as such; measured in the
    measured tier, ``-m measured``: a step of this test's model alone takes about a millisecond, and on a machine
    loaded far past its cores the two ranks' shares can differ by more than the band): every
    plan sync_every each, no warning, and the model bit for bit the lockstep run's, at 32 and
    at 4 bits, finish()'s partial round too."""
    options = {"sync_every": 4, "sync_delay": 0, "outer_bits": bits, "pacing": "speed"}
    speed = ranks(2).run(sleepy_rank, options, 18, [0.01, 0.01], reported)
    lockstep = ranks(2).run(sleepy_rank, {**options, "pacing": "lockstep"}, 18, [0.01, 0.01])
    for a, b in zip(speed, lockstep):
        assert all(plan == [4, 4] for plan in a["plans"][:-1]), a["plans"]
        assert not a["warnings"] and not a["logged"]
        assert a["steps"] == b["steps"]
        assert_params_equal(a["params"], b["params"])


@pytest.mark.parametrize("loop", ["allreduce", "broadcast"])
def test_a_collective_at_every_step_beside_a_3x_slower_replica_trains_on(tmp_path, loop) -> None:
    """Replica 1 three times slower; the loop runs a collective at every inner step (an all-reduce
    of the loss from step 24, once pacing has given the replicas [8, 3]; or a broadcast of rank
    0's step count from the first step, deciding the stop). The replica that hands over first
    goes on stepping while it waits for the other's hand-over, so each step's collective meets
    the other replica's same step: the job ends (it used to raise PacingStall after a deadlock),
    every replica took the loop's steps, finish() leaves them identical, and the held-out loss
    of the global values is finite and below the start's."""
    records = job(tmp_path, "--loop", loop, "--sync-every", "8", "--sleep", "0.01", "0.03",
                  "--collective-from", "24", "--steps", "120", "--timeout", "30", timeout=90)
    for record in records:
        assert record["returncode"] == 0 and record["error"] is None, record["stderr"][-3000:]
        assert record["steps"] == 120
        assert math.isfinite(record["loss_end"]) and record["loss_end"] < record["loss_start"], record
    assert_identical_across_ranks(records)
    if loop == "allreduce":  # paced apart before the collective started
        assert any(len(set(plan)) > 1 for plan in records[0]["plans"]), records[0]["plans"]


def test_a_replica_that_stops_stepping_raises_pacing_stall(tmp_path) -> None:
    """Replica 1 three times slower, paced apart, then it stops stepping for 5 s (a hung data
    loader) after its inner step 40: replica 0, gone on stepping while its round waits for replica
    1's hand-over, raises PacingStall once that wait passes its bound (STALL_SHARE of timeout=20 s:
    2 s, above 4 planned rounds here), naming the plan and the cause; replica 1 fails as replica 0
    exits; nothing waits for the 20 s timeout."""
    records = job(tmp_path, "--loop", "plain", "--sync-every", "8", "--sleep", "0.01", "0.03", "--hang-at", "40", "5",
                  "--steps", "400", "--timeout", "20", timeout=90)
    fast, slow = records
    assert fast["returncode"] != 0 and fast["error"] is not None, fast["stderr"][-3000:]
    assert fast["error"].startswith("PacingStall"), fast["error"]
    for words in ("stopped taking inner steps", "plan [8, ", "docs/loops.md"):
        assert words in fast["error"], fast["error"]
    waited = float(fast["error"].split(" has waited ")[1].split("s ")[0])
    bound = STALL_SHARE * 20
    assert bound <= waited < 20, fast["error"]  # past the bound, long before the timeout
    assert slow["returncode"] != 0 and slow["error"] is not None


# ----------------------------------------------------------------------------- the rule


def pacing(replicas: int = 2, every: int | str = 30, delay: int | None = 0, schedule: str | tuple = "speed") -> Pacing:
    options = LocalOptions.check(Mode.LOCAL, every, delay, None, None, pacing=schedule)
    paced = Pacing(options)
    paced.join(0, replicas)
    return paced


def report(seconds: tuple[float, ...], steps: tuple[int, ...] = (30, 30)) -> ReplicaReport:
    count = len(seconds)
    return ReplicaReport(steps=steps, weights=(1.0,) * count, step_seconds=seconds, stop=(False,) * count,
                         finishing=(False,) * count)


def test_the_dead_band_and_two_reports() -> None:
    """A replica within SPEED_BAND of the fastest's speed keeps sync_every; beyond it in
    APART_REPORTS successive reports the plan is in proportion to its speed (one report of a gap,
    noise, changes nothing), beyond twice the band in one; once apart every report's plan; equal
    plans are lockstep (nothing warned, no patience, nothing watched)."""
    assert APART_REPORTS == 2
    paced = pacing()
    assert paced.plan == [30, 30] and paced.patience() is None  # the first round: sync_every each
    edge = 1.0 / (1.0 - SPEED_BAND)
    paced.landed(report((0.1, 0.1 * edge * 0.999)))
    assert paced.plan == [30, 30] and not paced.paced_apart
    paced.landed(report((0.1, 0.1 * edge * 1.05)))  # one report of a gap
    assert paced.plan == [30, 30] and not paced.paced_apart
    paced.landed(report((0.1, 0.1)))
    paced.landed(report((0.1, 0.1 * edge * 1.05)))  # not successive: still one
    assert paced.plan == [30, 30] and not paced.paced_apart
    with pytest.warns(UserWarning, match=r"plan \[30, 23\]"):  # once, where plans first differ
        paced.landed(report((0.1, 0.1 * edge * 1.05)))
    assert paced.plan == [30, round(30 / (edge * 1.05))] and paced.paced_apart
    paced.landed(report((0.1, 0.3)))
    assert paced.plan == [30, 10]
    paced.landed(report((0.1, 0.1)))  # the gap closed: a full round again (and finish() stays safe)
    assert paced.plan == [30, 30] and paced.paced_apart
    paced.landed(report((0.1, 0.1 * edge * 1.05)))  # from equal plans again: two reports
    assert paced.plan == [30, 30]
    paced.landed(report((0.1, 0.1)))
    paced.landed(report((0.1, 0.1 / (1.0 - 2 * SPEED_BAND) * 1.01)))  # past twice the band: one
    assert paced.plan == [30, 18]


def test_the_pace_is_a_median_of_block_means(monkeypatch) -> None:
    """The reported pace: the median of the means of PACE_BLOCK consecutive step times over the
    last pace_window(sync_every) steps, across rounds, each step in which step() waited for a
    round left out: one long step (an evaluation) moves one block, not the median; the step
    after a wait for a round (where the loop's own collective may wait for a replica still in its
    wait) is left out while PACE_BLOCK others are timed (a replica that lands a round at every
    step is still measured, its waits taken off); a one-step round reports the window's pace. Steps whose times take turns
    being long and short (two replicas' compute under a per-step collective) give the mean."""
    assert PACE_BLOCK == 4 and pace_window(8) == 16 and pace_window(30) == 30
    assert block_median([]) == 0.0
    assert block_median([0.1, 0.3] * 8) == pytest.approx(0.2)  # a median of single steps: 0.1 or 0.3
    assert block_median([0.1] * 11 + [5.0]) == pytest.approx(0.1)
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    paced = pacing(every=16)
    for step in range(17):
        now[0] += 5.0 if step == 4 else 0.1  # one step holds a 5 s evaluation
        paced.stepped(1.0)
        if step == 6:
            paced.waited_for_round(2.0)  # step() waited 2 s for a round: the next step is not timed
            now[0] += 2.5
    assert len(paced.step_times) == 16 and sum(waited for _, waited in paced.step_times) == 1
    assert paced.hand_over().step_seconds == pytest.approx(0.1)
    now[0] += 0.1
    paced.stepped(1.0)  # a one-step round (finish()'s)
    assert paced.hand_over().step_seconds == pytest.approx(0.1)
    every_step = pacing(every=16)
    for _ in range(8):  # one step a round: a wait for a round in every step
        now[0] += 0.3
        every_step.stepped(1.0)
        every_step.waited_for_round(1.0)
        now[0] += 1.0
    assert every_step.pace() == pytest.approx(0.3)


def test_the_patience() -> None:
    """Once speed pacing paced the replicas apart a landing waits for the others' hand-overs as
    long as the plan expects (the longest planned round less this replica's) and PATIENCE_ROUNDS
    of the longest planned round more, at least PATIENCE_SECONDS, equal plans again or not;
    before, and with a fixed schedule, as long as it takes (None)."""
    paced = pacing()
    assert paced.patience() is None
    with pytest.warns(UserWarning, match="speed pacing"):
        paced.landed(report((0.1, 0.35)))
    assert paced.plan == [30, 9]
    longest = 30 * 0.1  # replica 0's planned round; replica 1's: 9 x 0.35 = 3.15 s
    assert paced.patience() == pytest.approx(9 * 0.35 - 3.0 + PATIENCE_ROUNDS * 9 * 0.35)  # replica 0 waits for 1
    paced.replica = 1
    assert paced.patience() == pytest.approx(PATIENCE_ROUNDS * 9 * 0.35)
    paced.landed(report((0.1, 0.1)))
    assert paced.plan == [30, 30] and paced.patience() == pytest.approx(PATIENCE_ROUNDS * longest)
    paced.landed(report((0.001, 0.001)))
    assert paced.patience() == PATIENCE_SECONDS
    assert pacing(schedule=(30, 10)).patience() is None  # a schedule's rounds are the recurrence's


def test_the_patience_with_auto_sync_every() -> None:
    """sync_every="auto" (the default): a landing waits for the others' hand-overs PEER_PATIENCE of
    this replica's inner step (at least PEER_PATIENCE_SECONDS), then the replica goes on stepping
    (the round waits for the link, not for a peer a little behind), a blocking round or, with the
    default landing, one hidden behind a step; a fixed sync_every, or a fixed sync_delay above 0,
    waits as long as it takes (its rounds are the recurrence's bit for bit); once paced apart, the
    plan's."""
    assert pacing(every="auto", delay=None).patience(blocks=False) == PEER_PATIENCE_SECONDS  # hidden: the default landing
    assert pacing(every="auto", delay=1).patience(blocks=False) is None  # a fixed sync_delay
    assert pacing(every="auto", delay=1).patience(blocks=True) == PEER_PATIENCE_SECONDS
    auto = pacing(every="auto")
    assert auto.patience() == PEER_PATIENCE_SECONDS  # nothing timed yet
    auto.step_times.extend([(0.2, False)] * 8)
    assert auto.patience() == pytest.approx(PEER_PATIENCE * 0.2)
    assert pacing(every=4).patience() is None
    assert pacing(every="auto", schedule="lockstep").patience() == PEER_PATIENCE_SECONDS
    with pytest.warns(UserWarning, match="speed pacing"):
        auto.landed(report((0.1, 0.35)))
    assert auto.patience() > PEER_PATIENCE * 0.2  # paced apart: the plan's patience


def test_the_stall_bound() -> None:
    """STALL_ROUNDS times the longest planned round at the reported paces, at least STALL_SHARE of
    the timeout, at most the timeout; none before the replicas were paced apart, then even where plans
    are equal again (their launches are no longer at the same step counts)."""
    paced = pacing()
    assert paced.stall_bound(600.0) is None
    with pytest.warns(UserWarning, match="speed pacing"):
        paced.landed(report((0.5, 2.0)))
    assert paced.plan == [30, 8]
    longest = max(30 * 0.5, 8 * 2.0)
    assert paced.stall_bound(600.0) == pytest.approx(STALL_ROUNDS * longest)
    assert paced.stall_bound(3000.0) == pytest.approx(STALL_SHARE * 3000.0)
    assert paced.stall_bound(20.0) == pytest.approx(20.0)
    paced.check_stall(STALL_ROUNDS * longest, paced.stall_bound(600.0), 3)
    paced.landed(report((0.5, 0.5)))
    assert paced.plan == [30, 30] and paced.stall_bound(600.0) is not None  # launches no longer aligned
    schedule = pacing(schedule=(30, 8))  # a fixed schedule's replicas wait for each other: its own cause
    schedule.landed(report((0.5, 2.0), steps=(30, 8)))
    with pytest.raises(PacingStall, match="fixed schedule's replicas wait for each other"):
        schedule.check_stall(schedule.stall_bound(600.0) + 1.0, schedule.stall_bound(600.0), 3)
    with pytest.raises(PacingStall, match="stopped taking inner steps"):
        paced.check_stall(STALL_ROUNDS * longest + 0.5, paced.stall_bound(600.0), 3)


def test_a_stalled_step_or_round_does_not_end_a_seconds_budget_early() -> None:
    """stop_after(seconds=): a replica just back from an 8 s stall (one step of its round took
    8 s, and so did that round) with a minute left does not ask to stop: the budget measures the
    median of its last step and round times, which the stall moves by none."""
    paced = pacing(every=10)
    paced.stop_after(None, 60.0)
    now = time.perf_counter()
    paced.step_times.extend([(0.05, False)] * 9 + [(8.0, False)])
    paced.round_walls.extend([0.55] * 4 + [8.5])
    paced.busy_since, paced.timed_steps, paced.round_steps = now - 8.0, 1, 1  # the stall in this round's first step
    paced.check_budget(inner_steps=1)
    assert not paced.stop_requested
    paced.stop_seconds = now + 0.5  # half a second left: the next launch is past it
    paced.check_budget(inner_steps=1)
    assert paced.stop_requested
