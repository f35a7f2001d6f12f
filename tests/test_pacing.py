"""Speed pacing that no loop can hang on (mode="local", ``pacing="speed"``, the default).

- Replicas of equal speed keep equal plans, bit for bit the lockstep run: behind a rate-limited
  link with 32-bit rounds of over a second, a loop that broadcasts rank 0's step count at every
  inner step ends (it used to wait for the timeout: the mean step time counted a replica's wait in
  that broadcast for the other's landing, and the plans drifted apart).
- A replica 3x slower is paced (fewer steps a round), and rank 0 warns once, naming the plans and
  what they mean for the loop's own collectives.
- A loop whose own collective at every inner step meets paced replicas raises a clear error (on
  the replica waiting for the round, within its bound; the others fail as it exits), no hang.
- The rule itself, on reports: the dead band, the median over a window of steps, the bound.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from acco.options import LocalOptions, Mode
from acco.replicas import SPEED_BAND, STALL_ROUNDS, STALL_SHARE, Pacing, PacingStall, ReplicaReport, pace_window
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


@pytest.fixture
def slow_link():
    """A network namespace whose loopback carries 10 Mbit/s (skipped where one cannot be made)."""
    try:
        netns.check_requirements()
        with netns.namespace("10mbit") as name:
            yield name
    except netns.NetnsError as error:
        pytest.skip(f"no rate-limited namespace here: {error}")


def test_equal_replicas_behind_a_slow_link_keep_equal_plans(slow_link, tmp_path) -> None:
    """Two equal replicas, 32-bit rounds of over a second (1 MB of parameters at 10 Mbit/s),
    sync_every=30, a broadcast of rank 0's step count at every inner step deciding the stop: with
    the default pacing every round's plan is [30, 30] (so the run is the lockstep one, whose
    launches equal plans repeat: test_equal_replicas_are_the_lockstep_run_bit_for_bit), nothing is
    warned, and the job ends (it used to wait for the timeout)."""
    started = time.perf_counter()
    speed = job(tmp_path, "--loop", "broadcast", "--outer-bits", "32", "--width", "256", "--steps", "90",
                netns_name=slow_link)
    assert time.perf_counter() - started < 60  # a hang waits for the 30 s timeout at least, twice
    for record in speed:
        assert record["returncode"] == 0 and record["error"] is None, record["stderr"][-3000:]
        assert record["steps"] == 90
        assert record["plans"] and all(plan == [30, 30] for plan in record["plans"]), record["plans"]
        assert not record["warnings"] and not record["logged"]
        # The premise: rounds of over a second (finish()'s, which carries nothing, moves half).
        assert statistics.median(record["round_seconds"]) > 1.0, record["round_seconds"]
    assert_identical_across_ranks(speed)


def sleepy_rank(options: dict, budget: int, sleep: list[float]) -> dict:
    """A plain loop (stop on should_stop), rank r sleeping sleep[r] s a step; the warnings and
    acco log records about pacing this rank raised."""
    rank = this_rank()
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
            steps = 0
            while not opt.should_stop:
                time.sleep(sleep[rank])
                inner_step(opt, model, steps, rank, True)
                steps += 1
            opt.finish()
    finally:
        logging.getLogger("acco").removeHandler(handler)
    return {"params": params_of(model), "steps": steps, "plans": [list(s.replicas.steps) for s in opt.round_stats],
            "warnings": [str(w.message) for w in caught if "speed pacing" in str(w.message)],
            "logged": [m for m in logged if "speed pacing" in m]}


def test_a_slow_replica_is_paced_and_rank_0_warns_once(ranks) -> None:
    """Replica 1 three times slower (30 ms a step against 10): the first round in lockstep, then
    the fast replica takes sync_every and the slow one about a third; rank 0 warns once (the
    warning and the acco logger), naming the plan and the fix; rank 1 says nothing."""
    options = {"sync_every": 8, "sync_delay": 0, "pacing": "speed"}
    results = ranks(2).run(sleepy_rank, options, 48, [0.01, 0.03])
    assert_identical_across_ranks(results)
    plans = results[0]["plans"]
    assert plans[0] == [8, 8]
    assert all(fast == 8 and 2 <= slow <= 5 for fast, slow in plans[1:-1]), plans  # a third, on loaded cores up to 5
    first, _ = results
    assert len(first["warnings"]) == 1 and len(first["logged"]) == 1
    message = first["warnings"][0]
    assert f"plan {plans[1]}" in message and "pacing='lockstep'" in message and "outer rounds" in message
    assert not results[1]["warnings"] and not results[1]["logged"]


@pytest.mark.parametrize("bits", [32, 4])
def test_equal_replicas_are_the_lockstep_run_bit_for_bit(ranks, bits) -> None:
    """Default pacing, equal replicas (10 ms a step each: a step of this test's model alone takes
    about a millisecond, where the two ranks' share of 2 loaded cores differs by more than the
    band): every plan sync_every each, no warning, and the model bit for bit the lockstep run's,
    at 32 and at 4 bits, finish()'s partial round too."""
    options = {"sync_every": 4, "sync_delay": 0, "outer_bits": bits, "pacing": "speed"}
    speed = ranks(2).run(sleepy_rank, options, 18, [0.01, 0.01])
    lockstep = ranks(2).run(sleepy_rank, {**options, "pacing": "lockstep"}, 18, [0.01, 0.01])
    for a, b in zip(speed, lockstep):
        assert all(plan == [4, 4] for plan in a["plans"][:-1]), a["plans"]
        assert not a["warnings"] and not a["logged"]
        assert a["steps"] == b["steps"]
        assert_params_equal(a["params"], b["params"])


def test_a_collective_at_every_step_raises_instead_of_hanging(tmp_path) -> None:
    """Replica 1 three times slower; the loop all-reduces its loss at every inner step once the
    first (lockstep) round has landed and pacing has given the replicas [8, 3]. Replica 1 hands
    over after 3 steps and waits for replica 0's hand-over, while replica 0 waits in the loop's
    all-reduce for replica 1: a deadlock. Replica 1 raises PacingStall after its bound
    (STALL_SHARE of timeout=30 s: 3 s, which is above 4 planned rounds here), naming the cause and
    the fix; replica 0's all-reduce fails as replica 1's process exits; nothing waits for the
    30 s timeout."""
    started = time.time()
    records = job(tmp_path, "--loop", "allreduce", "--sync-every", "8", "--sleep", "0.01", "0.03",
                  "--collective-from", "8", "--steps", "400", "--timeout", "30", timeout=90)
    fast, slow = records
    assert slow["returncode"] != 0 and fast["returncode"] != 0
    assert slow["plans"][0] == [8, 8] and slow["error"] is not None, slow["stderr"][-3000:]
    assert slow["error"].startswith("PacingStall"), slow["error"]
    for words in ("collective of its own at step counts", "pacing='lockstep'", "opt.should_stop", "plan [8, "):
        assert words in slow["error"], slow["error"]
    waited = float(slow["error"].split(" waited ")[1].split("s ")[0])
    bound = STALL_SHARE * 30
    assert bound <= waited <= bound + 1.0, slow["error"]
    assert fast["error"] is not None and fast["failed_at"] - slow["failed_at"] < 10, (fast["error"], slow["error"])
    assert time.time() - started < 30 + 30  # well before timeout=30 s had passed twice over; no hang


# ----------------------------------------------------------------------------- the rule


def pacing(replicas: int = 2, every: int = 30, delay: int = 0, schedule: str | tuple = "speed") -> Pacing:
    options = LocalOptions.check(Mode.LOCAL, every, delay, None, None, pacing=schedule)
    paced = Pacing(options)
    paced.join(0, replicas)
    return paced


def report(seconds: tuple[float, ...], steps: tuple[int, ...] = (30, 30)) -> ReplicaReport:
    count = len(seconds)
    return ReplicaReport(steps=steps, weights=(1.0,) * count, step_seconds=seconds, stop=(False,) * count,
                         finishing=(False,) * count)


def test_the_dead_band() -> None:
    """A replica within SPEED_BAND of the fastest's speed keeps sync_every; beyond it the plan is
    in proportion to its speed; equal plans are lockstep (nothing warned, nothing watched)."""
    paced = pacing()
    assert paced.plan == [30, 30]  # the first round: sync_every each
    edge = 1.0 / (1.0 - SPEED_BAND)
    paced.landed(report((0.1, 0.1 * edge * 0.999)))
    assert paced.plan == [30, 30] and not paced.paced_apart
    with pytest.warns(UserWarning, match=r"plan \[30, 23\]"):  # once, where plans first differ
        paced.landed(report((0.1, 0.1 * edge * 1.05)))
    assert paced.plan == [30, round(30 / (edge * 1.05))] and paced.paced_apart
    paced.landed(report((0.1, 0.3)))
    assert paced.plan == [30, 10]
    paced.landed(report((0.1, 0.1)))  # the gap closed: a full round again (and finish() stays safe)
    assert paced.plan == [30, 30] and paced.paced_apart


def test_the_pace_is_a_median_over_a_window_of_steps(monkeypatch) -> None:
    """The reported pace: the median of the last pace_window(sync_every) step times, across rounds,
    the waits for a round left out: one long step (an evaluation, a wait in the loop's own
    collective) does not move it, and a one-step round reports the window's median."""
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    paced = pacing(every=8)
    assert pace_window(8) == 8 and pace_window(30) == 30 and pace_window(2) == 8
    for step in range(8):
        now[0] += 5.0 if step == 4 else 0.1  # one step holds a 5 s evaluation
        paced.stepped(1.0)
        if step == 6:
            paced.waited_for_round(2.0)  # step() waited 2 s for a round: left out of the next step
            now[0] += 2.0
    assert paced.hand_over().step_seconds == pytest.approx(0.1)
    now[0] += 0.1
    paced.stepped(1.0)  # a one-step round (finish()'s)
    assert paced.hand_over().step_seconds == pytest.approx(0.1)


def test_the_stall_bound() -> None:
    """STALL_ROUNDS times the longest planned round at the reported paces, at least STALL_SHARE of
    the timeout, at most the timeout; none while plans are equal."""
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
    with pytest.raises(PacingStall, match="collective of its own at step counts"):
        paced.check_stall(STALL_ROUNDS * longest + 0.5, paced.stall_bound(600.0), 3)


def test_a_stalled_step_or_round_does_not_end_a_seconds_budget_early() -> None:
    """stop_after(seconds=): a replica just back from an 8 s stall (one step of its round took
    8 s, and so did that round) with a minute left does not ask to stop: the budget measures the
    median of its last step and round times, which the stall moves by none."""
    paced = pacing(every=10)
    paced.stop_after(None, 60.0)
    now = time.perf_counter()
    paced.step_times.extend([0.05] * 9 + [8.0])
    paced.round_walls.extend([0.55] * 4 + [8.5])
    paced.busy_since, paced.timed_steps, paced.round_steps = now - 8.0, 1, 1  # the stall in this round's first step
    paced.check_budget(inner_steps=1)
    assert not paced.stop_requested
    paced.stop_seconds = now + 0.5  # half a second left: the next launch is past it
    paced.check_budget(inner_steps=1)
    assert paced.stop_requested
