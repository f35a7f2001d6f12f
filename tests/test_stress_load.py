"""The stress tier's elastic soaks under load (``python -m pytest -q -m stress``): ten runs of 3
groups with one paused (SIGSTOP) for 6 s, and ten beside four CPU hogs, through
benchmarks/elastic_stress.py's harness (tests/test_stress.py's :func:`run_and_check`). A file
of its own: with ``-n 2 --dist loadfile`` a second worker takes it."""

from __future__ import annotations

import pytest

from tests.test_stress import run_and_check

pytestmark = pytest.mark.stress


@pytest.mark.timeout(900)
@pytest.mark.parametrize("scenario, parallel, extra", [
    ("pause", 3, ()),  # a paused run is mostly idle: three at a time
    ("hogs", 2, ("--steps", "150")),  # 15 rounds of 3 groups, two runs at a time beside the four hogs (the benchmark: 30)
])  # fmt: skip
def test_groups_end_identical_in_every_run(tmp_path, scenario, parallel, extra) -> None:
    run_and_check(tmp_path, scenario, parallel, extra)
