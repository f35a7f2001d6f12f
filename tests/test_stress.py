"""The stress tier's soaks (``python -m pytest -q -m stress``), through the benchmarks' own
harness (benchmarks/elastic_stress.py, benchmarks/exit_stress.py), not a copy of it:

- ten runs of a 2-rank FSDP2 replica group with one of its ranks killed at a random point: the
  launcher restarts the group, every group ends identical with exit 0, and the held-out loss is
  within 2% of the same job run uninterrupted;
- ten kills of a replica group in a run's last rounds, ten runs with a group paused (SIGSTOP)
  for 6 s, ten runs of 3 groups beside four CPU hogs: every group ends identical, exit 0;
- the exit test's job (benchmarks/exit_stress.py's case: sync, ``finish()``, no
  ``destroy_process_group()``) fifty times beside two CPU hogs: every rank exits 0, no abort.

The fast tier runs each of these once (tests/test_elastic.py, tests/test_elastic_mesh.py,
tests/test_exit.py); here they are repeated on a loaded machine, where a race shows.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

pytestmark = pytest.mark.stress

RUNS = 10  # per elastic scenario
EXIT_RUNS = 50
EXIT_HOGS = 2
EXIT_AT_ONCE = 3  # jobs at a time: with the hogs, more processes than cores, as a busy node has


@pytest.mark.timeout(900)
@pytest.mark.parametrize("scenario, parallel, extra", [
    ("rank-kill", 2, ()), ("late-kill", 2, ()), ("pause", 2, ()),
    ("hogs", 1, ("--steps", "150")),  # 15 rounds of 3 groups beside the hogs (the benchmark: 30)
])  # fmt: skip
def test_elastic_groups_survive_every_run(tmp_path, scenario, parallel, extra) -> None:
    """:data:`RUNS` runs of ``scenario`` (benchmarks/elastic_stress.py), ``parallel`` at a
    time, every one passing (:func:`elastic_stress.passed`: exit 0, identical groups;
    rank-kill: restarted, held-out loss within 2% of the uninterrupted run's)."""
    pytest.importorskip("torchft")
    import elastic_stress

    lines: list[str] = []
    results = elastic_stress.run_scenario(scenario, RUNS, tmp_path, extra, parallel, report=lines.append)
    assert len(results) == RUNS
    assert all(elastic_stress.passed(result) for result in results), "\n".join(lines)


@pytest.mark.timeout(600)
def test_a_finished_job_exits_cleanly_every_time_beside_cpu_hogs() -> None:
    """:data:`EXIT_RUNS` jobs of the sync-finish-no-destroy case (:data:`EXIT_AT_ONCE` at a
    time) beside :data:`EXIT_HOGS` CPU hogs (benchmarks/exit_stress.py): no rank aborts or
    exits non-zero."""
    import exit_stress
    from common import cpu_hogs

    with cpu_hogs(EXIT_HOGS):
        bad = exit_stress.run_case("sync:finish:0", EXIT_RUNS, at_once=EXIT_AT_ONCE)
    assert not bad, "\n".join(f"run {run} rank {rank}: exit {code}\n{tail}" for run, rank, code, tail in bad)
