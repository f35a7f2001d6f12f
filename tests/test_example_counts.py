"""examples/train_gpt.py counts samples as the ranks computed them, flat and on a mesh.

acco's ``RoundStats.global_micro_batches`` counts a replica group's micro-batches once (its
ranks reduce one mean gradient). Under ``--inner fsdp`` each of a group's S ranks computed
micro-batches of its own, so the example multiplies by S; under ``--inner tp`` the S ranks
share theirs, so only R ranks draw data (the header says so).
"""

from __future__ import annotations

import argparse
import collections
from types import SimpleNamespace

import pytest

from acco import RoundKind
from examples.train_gpt import Progress, data_parallel_ranks

pytestmark = pytest.mark.timeout(180)


def args(mesh: tuple[int, int] | None, inner: str = "fsdp") -> argparse.Namespace:
    return argparse.Namespace(mesh=mesh, inner=inner)


@pytest.mark.parametrize("mesh, inner, expected", [
    (None, "fsdp", (4, 1)),
    ((2, 2), "fsdp", (4, 2)),
    ((2, 2), "tp", (2, 1)),
    ((1, 4), "tp", (1, 1)),
])
def test_who_draws_data_and_how_many_micro_batches_one_counted_one_is(mesh, inner, expected) -> None:
    assert data_parallel_ranks(args(mesh, inner), world_size=4) == expected


def test_a_2x2_fsdp_mesh_logs_every_ranks_micro_batches() -> None:
    """4 ranks computing 2 micro-batches a round: acco's stats count 4 (2 per replica group),
    the log says 8 and samples/s counts 8 x the sequences per micro-batch."""
    rounds = [SimpleNamespace(index=i, global_micro_batches=4, local_micro_batches=2, kind=RoundKind.COMMIT,
                              hidden_share=1.0, grad_norm=1.0) for i in range(3)]
    opt = SimpleNamespace(round_stats=collections.deque(rounds))
    _, per_counted = data_parallel_ranks(args((2, 2), "fsdp"), world_size=4)
    progress = Progress(opt, sequences_per_micro_batch=5, ranks_per_counted=per_counted)
    assert "micro-batches/round rank 0 2.0 all 8.0" in progress.line(3, 10, 1e-3)
    assert progress.samples == 3 * 8 * 5


def test_the_example_in_local_mode_paces_a_slow_rank(tmp_path) -> None:
    """examples/train_gpt.py --mode local with rank 1 five times slower in its backward passes (it
    repeats each four times), run through tests/train_gpt_job.py (which writes what each rank's
    optimizer decided): the default pacing ("speed") is on; after each landed outer round both
    replicas take the plan the library's planner derives from the paces the replicas reported in
    this run (a step's fixed costs, which the load inflates, keep the measured ratio well under 5,
    so the plans themselves vary with the load: [8, 2] to [8, 6]); the slow replica reported the
    slower pace in every round, and each report of a gap past twice the band paced it; each
    replica's inner updates, as the example prints them, are the steps its hand-overs reported,
    the fast one asking to stop within a round of --updates; both stop at the same outer round
    and exit 0, the last plan printed is the planner's, and the progress lines carry each
    replica's steps and tokens per round."""
    import json
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    from acco.replicas import SPEED_BAND
    from tests.test_replicas import speed_plans

    job = Path(__file__).resolve().parent / "train_gpt_job.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(job),
               str(tmp_path), "--mode", "local", "--slowdown", "1:5", "--sync-every", "8", "--updates", "64",
               "--log-every", "16", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "32",
               "--batch-size", "4", "--max-bytes", "200000", "--eval-batches", "2", "--eval-every", "32",
               "--timeout", "60"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=150, env={**os.environ, "OMP_NUM_THREADS": "1"})
    # torchrun's summary ends stderr: the failing rank's own lines come first, so keep them
    errors = "\n".join(line for line in done.stderr.splitlines() if "Error" in line or "[rank" in line)
    assert done.returncode == 0, done.stdout[-3000:] + errors[-6000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert all(rank["pacing"] == "speed" and rank["sync_every"] == 8 for rank in ranks), ranks
    reports = ranks[0]["reports"]
    assert ranks[1]["reports"] == reports and ranks[0]["outer_rounds"] == ranks[1]["outer_rounds"]
    # The mechanism: on every rank, the plan in force once n rounds had landed is the planner's on
    # the first n reports (the first plan: sync_every each, nothing measured yet).
    replayed = [[8, 8]] + speed_plans(reports, sync_every=8, sync_delay=ranks[0]["sync_delay"])
    for rank in ranks:
        planned = {int(n): plan for n, plan in rank["planned"].items()}
        assert all(plan == replayed[n] for n, plan in planned.items()), (planned, replayed, reports)
    # The slow replica reported the slower pace in every round; and the rule itself, not the
    # planner's code: a report of a gap past twice SPEED_BAND paces it below sync_every.
    seconds = [report["step_seconds"] for report in reports]
    assert all(fast < slow for fast, slow in seconds), seconds
    wide = [n for n, (fast, slow) in enumerate(seconds) if fast < (1 - 2 * SPEED_BAND) * slow]
    assert all(replayed[n + 1][1] < 8 for n in wide), (wide, replayed, seconds)
    # Each replica's inner updates, as the example prints them, are the steps its hand-overs
    # reported (the steps the fast one took while it waited for the slow one's last hand-over land
    # in the last round); the fast one asked to stop (stop_after) once its next launch was past
    # --updates less a round, and at most one round followed, one in which a replica finished
    # (its finish()'s, or the fast one's regular round if it had stepped on a whole plan).
    counts = re.search(r"inner updates per replica \[(\d+), (\d+)\] \(at most \d+\)", done.stdout)
    assert counts is not None, done.stdout[-3000:]
    printed = [int(n) for n in counts.groups()]
    assert printed == [rank["num_updates"] for rank in ranks], (printed, ranks)
    assert printed == [sum(report["steps"][m] for report in reports) for m in range(2)], (printed, reports)
    asked = next(n for n, report in enumerate(reports) if any(report["stop"]))
    assert reports[asked]["stop"][0] and len(reports) - asked - 1 <= 1, reports
    assert all(any(report["finishing"]) for report in reports[asked + 1 :]), reports
    assert sum(report["steps"][0] for report in reports[: asked + 1]) > 64 - 8, reports
    plan = re.search(r"last plan \[(\d+), (\d+)\] steps per round", done.stdout)
    assert plan is not None and [int(n) for n in plan.groups()] == replayed[-1], done.stdout[-3000:]
    assert re.search(r"steps/round per replica [\d.]+ [\d.]+", done.stdout), done.stdout[-3000:]
    assert "tokens/round" in done.stdout and "eval loss" in done.stdout
