"""The stress tier's elastic soaks (``python -m pytest -q -m stress``), through the benchmark's
own harness (benchmarks/elastic_stress.py), not a copy of it (the exit soak: tests/test_exit.py):

- ten runs of a 2-rank FSDP2 replica group with one of its ranks killed at a random point: the
  launcher restarts the group, every group ends identical with exit 0, and the held-out loss is
  within 2% of the same job run uninterrupted;
- ten kills of a replica group in a run's last rounds, ten runs with a group paused (SIGSTOP)
  for 6 s, ten runs of 3 groups beside four CPU hogs: every group ends identical, exit 0;

The fast tier runs each of these once (tests/test_elastic.py, tests/test_elastic_mesh.py);
here they are repeated, several runs at a time, on a loaded machine, where a race shows.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

pytestmark = pytest.mark.stress

RUNS = 10  # per elastic scenario


@pytest.mark.timeout(900)
@pytest.mark.parametrize("scenario, parallel, extra", [
    ("rank-kill", 5, ()), ("late-kill", 5, ()), ("pause", 5, ()),
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
