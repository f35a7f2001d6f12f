"""benchmarks/goodput_model.py: the discrete-event model of elastic local steps' goodput
(docs/goodput.md) against its closed forms, and its ``--check`` of real runs' records on
records written here the way examples/elastic_local.py writes them."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import goodput_model as gm  # noqa: E402

pytestmark = pytest.mark.timeout(60)

# 0.1 s steps, H = 10, no round time and no spread: every round takes exactly 1 s.
EXACT = gm.Setup(replicas=2, sync_every=10, step_seconds=0.1, step_cv=0.0, grace_floor=0.05, join=0.5, steps=100,
                 duration=None)  # fmt: skip


@pytest.mark.parametrize("kind", list(gm.KINDS))
def test_without_stalls_or_failures_every_kind_gets_its_compute_share(kind: str) -> None:
    setup = gm.Setup(replicas=4, sync_every=10, step_seconds=0.1, step_cv=0.02, params=1e6, bits=4, dp_bits=4,
                     link_mbit=100.0, latency=0.01, duration=300.0)  # fmt: skip
    rule = gm.KINDS[kind]
    share = setup.compute_share(rule)
    outcome = gm.simulate(setup, rule, seed=0)
    # A round: the latency and its bytes, 2 x 3/4 x 1e6 x 4 / 8 = 750 kB, over 100 Mbit/s (0.06 s).
    compute = rule.sync_every(setup) * 0.1
    assert share == pytest.approx(compute / (compute + 0.01 + 0.06))
    # Below it only by waiting for the slowest of 4 groups' step times, and the last round cut by the run's end.
    assert share * 0.97 < outcome.goodput <= share * 1.001
    assert outcome.late == 0 and outcome.failures == 0


@pytest.mark.parametrize("kind", ["lockstep", "speed-paced", "quorum-grace", "quorum-drop"])
def test_one_stall_at_two_groups_costs_its_length_in_every_kind(kind: str) -> None:
    """Group 0 sleeps 0.55 s before its step 35: everyone waits (with 2 groups a quorum needs both:
    the lighthouse's split-brain guard), each group's 100 steps take 10.55 s, goodput 10 / 10.55."""
    setup = replace(EXACT, stalls=(gm.Stall(0, 35, 0.55),))
    outcome = gm.simulate(setup, gm.KINDS[kind], seed=0)
    assert outcome.wall == pytest.approx(10.55)
    assert outcome.counted == 200
    assert outcome.goodput == pytest.approx(10.0 / 10.55)


def test_a_late_group_keeps_its_steps_and_does_not_hold_the_others() -> None:
    """3 groups, group 0 stalled 3 s before its step 35, the run cut at 10.05 s. Lockstep: rounds
    land at 1, 2, 3, then 7, 8, 9, 10 s: 7 rounds x 30 steps. Quorum + grace: the others' round 4
    waits the join timeout (0.5 s) and the grace floor (0.05 s: no spread yet), then lands at
    4.55 s and every second after, 9 rounds of theirs by 9.55 s; group 0 hands over at 7 s, joins
    their round at 7.55 s with its 10 steps and lands 2 more rounds: 30 + 10 + 20 of its own."""
    setup = replace(EXACT, replicas=3, steps=None, duration=10.05, stalls=(gm.Stall(0, 35, 3.0),))
    capacity = 3 * 10.05 / 0.1
    lockstep = gm.simulate(setup, gm.KINDS["lockstep"], seed=0)
    grace = gm.simulate(setup, gm.KINDS["quorum-grace"], seed=0)
    drop = gm.simulate(setup, gm.KINDS["quorum-drop"], seed=0)
    assert lockstep.counted == 7 * 30 and lockstep.goodput == pytest.approx(210 / capacity)
    assert grace.counted == 2 * 90 + 60 and grace.goodput == pytest.approx(240 / capacity)
    assert grace.late == 3  # group 0 missed the others' rounds landing at 4.55, 5.55 and 6.55 s
    assert drop.counted == grace.counted - 10  # healed from the others: its round-4 steps are lost


def test_quorum_grace_is_no_worse_than_lockstep_under_random_stalls() -> None:
    setup = gm.Setup(replicas=8, sync_every=10, step_seconds=0.1, step_cv=0.05, stall_seconds=3.0,
                     stalls_per_hour=120.0, mtbf_hours=math.inf, duration=600.0)  # fmt: skip
    for seed in (0, 1):
        lockstep = gm.simulate(setup, gm.KINDS["lockstep"], seed)
        grace = gm.simulate(setup, gm.KINDS["quorum-grace"], seed)
        assert grace.late > 0
        assert grace.goodput > lockstep.goodput + 0.05
    # Deterministic for a seed.
    assert gm.simulate(setup, gm.KINDS["quorum-grace"], 3) == gm.simulate(setup, gm.KINDS["quorum-grace"], 3)


def test_a_failure_loses_the_dead_groups_steps_and_the_rest_goes_on() -> None:
    setup = gm.Setup(replicas=4, sync_every=10, step_seconds=0.1, mtbf_hours=0.05, restart=2.0, duration=900.0)
    alive = gm.simulate(replace(setup, mtbf_hours=math.inf), gm.KINDS["lockstep"], 0)
    failing = gm.simulate(setup, gm.KINDS["lockstep"], 0)
    assert alive.goodput == pytest.approx(1.0)
    # About 4 x 900 s / 180 s = 20 failures, each costing its group ~2.5 s and the others up to 1 s.
    assert 8 <= failing.failures <= 40
    assert 0.85 < failing.goodput < 1.0 - failing.failures * 2.0 / (4 * 900)


def write_run(directory: Path, *, replicas: int, stall: tuple[int, int, float], counted: bool) -> None:
    """Records as examples/elastic_local.py writes them for a lockstep run of 100 steps a group,
    H = 10, 0.1 s a step, group ``stall[0]`` sleeping ``stall[2]`` s at its step ``stall[1]``."""
    directory.mkdir()
    start = 1_800_000_000.0
    for g in range(replicas):
        now, lines = start, []
        for round_, step in enumerate(range(0, 101, 10), start=1):
            if step:
                now += 1.0 + (stall[2] if stall[1] in range(step - 10, step) else 0.0)
            record = {"round": round_, "inner_step": step, "participants": replicas, "dropped": False,
                      "content_heal": False, "steps": [10 if step else 0] * replicas, "seconds": now - start,
                      "time": now, "pid": 100 + g}  # fmt: skip
            if counted:
                record["counted"] = 10 if step else 0
            lines.append(json.dumps(record))
        lines.append(lines[-1])  # a record written twice counts once
        lines.append(json.dumps({"final": True, "eval_loss": 2.0, "inner_step": 100, "round": 12}))
        (directory / f"replica-{g}.jsonl").write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("counted", [True, False])
def test_check_measures_a_run_and_the_model_predicts_it(tmp_path: Path, counted: bool) -> None:
    write_run(tmp_path / "run", replicas=2, stall=(1, 45, 2.0), counted=counted)
    stall = gm.Stall(1, 45, 2.0)
    run = gm.read_run(tmp_path / "run", [stall])
    assert (run.replicas, run.sync_every, run.final_steps) == (2, 10, (100, 100))
    assert run.wall == pytest.approx(12.0) and run.step_seconds == pytest.approx(0.1) and run.step_cv == 0.0
    assert run.counted == 200 and run.counted_from == ("counted" if counted else "inner steps")
    base = gm.Setup(replicas=2, sync_every=10, step_seconds=1.0, mtbf_hours=math.inf)
    result = gm.check(tmp_path / "run", [stall], base, kind="lockstep", seeds=[0])
    assert result["stop"] == "steps"
    assert result["measured"] == pytest.approx(10.0 / 12.0)
    assert result["model"]["lockstep"] == pytest.approx(10.0 / 12.0)
    assert result["model"]["quorum-grace"] == pytest.approx(10.0 / 12.0)  # 2 groups: a quorum needs both
    assert abs(result["relative_error"]) < 1e-9


def test_the_cli_writes_its_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "goodput.json"
    gm.main(["--replicas", "2", "4", "--stalls-per-hour", "0", "30", "--seconds", "300", "--seeds", "0",
             "--out", str(out)])  # fmt: skip
    saved = json.loads(out.read_text())
    assert {(r["kind"], r["replicas"], r["stalls_per_hour"]) for r in saved["rows"]} == {
        (k, r, s) for k in gm.KINDS for r in (2, 4) for s in (0.0, 30.0)}
    assert set(saved["sources"]) >= {"step_seconds", "restart", "grace_*"}
    printed = capsys.readouterr().out
    assert "| 30 | quorum-grace |" in printed and "reported" in printed
