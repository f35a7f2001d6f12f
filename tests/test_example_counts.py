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
    repeats each four times; a step's fixed costs keep the measured ratio lower, about 3 on an idle
    machine, under 2 on a loaded one with 1:3): the default pacing gives it fewer inner updates per outer round, the fast
    replica takes at most --updates, both stop at the same outer round and exit 0, and the
    progress lines carry each replica's steps and tokens per round."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(example),
               "--mode", "local", "--slowdown", "1:5", "--sync-every", "8", "--updates", "64", "--log-every", "16",
               "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "32", "--batch-size", "4",
               "--max-bytes", "200000", "--eval-batches", "2", "--eval-every", "32", "--timeout", "60"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=150, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    counts = re.search(r"inner updates per replica \[(\d+), (\d+)\] \(at most 64\)", done.stdout)
    assert counts is not None, done.stdout[-3000:]
    fast, slow = int(counts.group(1)), int(counts.group(2))
    assert 48 <= fast <= 64 and slow < fast, (fast, slow)
    plan = re.search(r"last plan \[8, (\d+)\] steps per round", done.stdout)
    assert plan is not None and int(plan.group(1)) <= 4, done.stdout[-3000:]
    assert re.search(r"steps/round per replica [\d.]+ [\d.]+", done.stdout), done.stdout[-3000:]
    assert "tokens/round" in done.stdout and "eval loss" in done.stdout
