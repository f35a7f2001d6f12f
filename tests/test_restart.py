"""The example under torchrun with restarts: a rank killed with SIGKILL after a checkpoint
costs only the work since that checkpoint, and the run ends where an uninterrupted one does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(300)
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"
TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "32", "--batch-size", "4",
        "--max-bytes", "200000", "--eval-batches", "2", "--eval-every", "0", "--log-every", "50",
        "--updates", "60", "--ckpt-every", "20", "--timeout", "20"]


# mode="local" on a 2 x 2 mesh (FSDP2 inside each replica group), replicas in lockstep (reproducible),
# a checkpoint every second outer round of 5 inner updates, each round 2 updates in flight.
LOCAL_MESH = ["--mode", "local", "--mesh", "2x2", "--inner", "fsdp", "--pacing", "lockstep", "--sync-every", "5",
              "--sync-delay", "2", "--updates", "20", "--ckpt-every", "10"]
RUNS = {"acco": (2, 5, ["--mode", "acco"]), "local-mesh": (4, 1, LOCAL_MESH)}


def torchrun(tmp: Path, name: str, nproc: int, restarts: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               f"--max-restarts={restarts}", str(EXAMPLE), *TINY, "--ckpt-dir", str(tmp / name / "ckpt"),
               "--save-final", str(tmp / name / "final.pt"), *extra]
    (tmp / name).mkdir()
    log = open(tmp / name / "log.txt", "w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def worker_with_rank(parent: int, rank: int) -> int | None:
    for task in Path(f"/proc/{parent}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ:
                return int(child)
    return None


def kill_leftovers(marker: str) -> None:
    """Workers of a hung attempt may sit in their own sessions: find them by their arguments."""
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / "cmdline").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
        except OSError:
            continue


def finish(process: subprocess.Popen, tmp: Path, name: str) -> str:
    try:
        process.wait(timeout=240)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        kill_leftovers(str(tmp / name))
    log = (tmp / name / "log.txt").read_text()
    assert process.returncode == 0, log[-3000:]
    return log


@pytest.mark.parametrize("run", [pytest.param("acco"), pytest.param("local-mesh", marks=pytest.mark.stress)])
def test_a_killed_rank_resumes_from_the_last_checkpoint(tmp_path, run) -> None:
    """Under torchrun with restarts, a rank killed after a checkpoint resumes from it and the run ends
    bit for bit where an uninterrupted one does: acco on 2 ranks, and (the stress tier: 35 s)
    mode="local" on a 2 x 2 mesh (FSDP2 inside; killed mid-round, the job restarts once from its
    DCP checkpoint; the fast tier resumes meshes from DCP in tests/test_local_mesh_checkpoints.py)."""
    nproc, restarts, extra = RUNS[run]
    reference = torchrun(tmp_path, "uninterrupted", nproc, restarts, *extra)  # beside the killed run
    run = torchrun(tmp_path, "killed", nproc, restarts, *extra)
    latest = tmp_path / "killed" / "ckpt" / "latest"
    deadline = time.monotonic() + 200
    while not latest.exists():
        assert run.poll() is None and time.monotonic() < deadline, "no checkpoint before the run ended"
        time.sleep(0.05)
    victim = worker_with_rank(run.pid, 1)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    log = finish(run, tmp_path, "killed")
    assert "resumed from" in log, log[-3000:]
    finish(reference, tmp_path, "uninterrupted")

    expected = torch.load(tmp_path / "uninterrupted" / "final.pt", weights_only=True)
    actual = torch.load(tmp_path / "killed" / "final.pt", weights_only=True)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
