"""A job ends as a DDP job does: exit status 0, no abort, whatever way it ends.

gloo's worker threads free a finished collective's tensors after the caller has returned,
which takes the GIL; one still doing so when the interpreter finalises aborts the process
("terminate called without an active exception", SIGABRT) after a clean run. The minimal job
of tests/exit_job.py runs in fresh processes (atexit and finalisation only happen there), in
every mode, ended by ``finish()`` or not (forgotten, or an exception), with and without
``destroy_process_group()``. Before the fix, the job without ``finish()`` aborted in 8 of 8
runs and the one with both in about 1 of 4 under torchrun.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.ranks import run_script

pytestmark = pytest.mark.timeout(300)

JOB = str(Path(__file__).resolve().parent / "exit_job.py")
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_job(mode: str, end: str, destroy: bool) -> list[subprocess.CompletedProcess]:
    return run_script(JOB, mode, end, "1" if destroy else "0")


def assert_clean_exit(results: list[subprocess.CompletedProcess], expected: int) -> None:
    for rank, result in enumerate(results):
        assert "terminate called" not in result.stderr, f"rank {rank} aborted:\n{result.stderr[-3000:]}"
        assert result.returncode == expected, f"rank {rank} exited with {result.returncode}:\n{result.stderr[-3000:]}"


CASES = [(mode, end, destroy) for mode in ("acco", "dpu", "sync") for end in ("finish", "forget")
         for destroy in (True, False)]
# The fast tier: each mode once, each way to end and each destroy_process_group() choice at least once.
FAST_CASES = [("acco", "forget", False), ("dpu", "finish", True), ("sync", "forget", True)]


def assert_every_case_exits_cleanly(cases: list[tuple[str, str, bool]]) -> None:
    """Three jobs at a time (their ranks load both cores, as a busy machine would: an abort is
    likelier, not less likely)."""
    def one(case: tuple[str, str, bool]) -> str | None:
        try:
            assert_clean_exit(run_job(*case), expected=0)
        except AssertionError as error:
            return f"{case}: {error}"
        return None

    with ThreadPoolExecutor(max_workers=3) as pool:
        failures = [failure for failure in pool.map(one, cases) if failure]
    assert not failures, "\n".join(failures)


def test_a_job_of_each_mode_exits_cleanly() -> None:
    """Each mode, ended by finish() or not, with and without destroy_process_group(): exit 0 and
    no abort on every rank (every combination: the stress tier; many runs of one case beside CPU
    hogs: the stress tier, through benchmarks/exit_stress.py)."""
    assert_every_case_exits_cleanly(FAST_CASES)


@pytest.mark.stress
def test_every_job_exits_cleanly() -> None:
    """Every mode, ended by finish() or not, with and without destroy_process_group()."""
    assert_every_case_exits_cleanly(CASES)


SOAK_RUNS, SOAK_HOGS, SOAK_AT_ONCE = 50, 2, 3  # with the hogs, more processes than cores, as on a busy node


@pytest.mark.stress
@pytest.mark.timeout(600)
def test_a_finished_job_exits_cleanly_every_time_beside_cpu_hogs() -> None:
    """:data:`SOAK_RUNS` jobs of benchmarks/exit_stress.py's case (sync, finish(), no
    destroy_process_group()), :data:`SOAK_AT_ONCE` at a time, beside :data:`SOAK_HOGS` CPU
    hogs, through that benchmark's own harness: no rank aborts or exits non-zero."""
    sys.path.insert(0, str(BENCHMARKS))
    import exit_stress
    from common import cpu_hogs

    with cpu_hogs(SOAK_HOGS):
        bad = exit_stress.run_case("sync:finish:0", SOAK_RUNS, at_once=SOAK_AT_ONCE)
    assert not bad, "\n".join(f"run {run} rank {rank}: exit {code}\n{tail}" for run, rank, code, tail in bad)


def test_an_exception_ends_the_job_with_its_own_status() -> None:
    results = run_job("acco", "raise", destroy=False)
    assert_clean_exit(results, expected=1)
    assert all("the job failed on purpose" in result.stderr for result in results)
