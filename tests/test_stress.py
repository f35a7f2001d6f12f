"""The stress tier's elastic soaks (``python -m pytest -q -m stress``), through the benchmark's
own harness (benchmarks/elastic_stress.py), not a copy of it (the exit soak: tests/test_exit.py):

- ten runs of a 2-rank FSDP2 replica group with one of its ranks killed at a random point: the
  launcher restarts the group, every group ends identical with exit 0, and the held-out loss is
  within 2% of the one expected from group 0's share of inner steps taken alone (between the
  same job run uninterrupted and with group 0 alone: elastic_stress.expected_loss);
- ten kills of a replica group in a run's last rounds: every group ends identical, exit 0
  (ten runs with a group paused and ten beside CPU hogs: tests/test_stress_load.py).

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


def run_and_check(tmp_path: Path, scenario: str, parallel: int, extra: tuple[str, ...] = ()) -> None:
    """:data:`RUNS` runs of ``scenario`` (benchmarks/elastic_stress.py), ``parallel`` at a
    time, every one passing (:func:`elastic_stress.passed`: exit 0, identical groups;
    rank-kill: restarted, held-out loss within 2% of the expected one)."""
    pytest.importorskip("torchft")
    import elastic_stress

    lines: list[str] = []

    def report(line: str) -> None:  # as each run ends (pytest shows it if the test fails, a timeout too)
        print(line, flush=True)
        lines.append(line)

    results = elastic_stress.run_scenario(scenario, RUNS, tmp_path, extra, parallel, report=report)
    assert len(results) == RUNS
    assert all(elastic_stress.passed(result) for result in results), "\n".join(lines)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("scenario", ["rank-kill", "late-kill"])
def test_killed_groups_rejoin_in_every_run(tmp_path, scenario) -> None:
    """Ten runs of a rank of a 2-rank FSDP2 group killed at a random point, ten of a group killed
    in a run's last rounds, two at a time (the pause and the hogs: tests/test_stress_load.py)."""
    run_and_check(tmp_path, scenario, parallel=2)
