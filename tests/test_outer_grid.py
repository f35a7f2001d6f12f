"""benchmarks/outer_grid.py's decision and planning, on made-up results (no training)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import common  # noqa: E402
import outer_grid  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def results(name: str, losses: dict[tuple[float, float], float]) -> dict:
    setting = outer_grid.SETTINGS[name]
    return {"setting": {"name": name}, "methods": {
        outer_grid.cell_name(setting, lr, mu): {"final_loss": loss} for (lr, mu), loss in losses.items()}}


def test_the_choice_is_within_the_bar_in_every_setting() -> None:
    """A cell 0.5% from the best in one setting and the best in the other is chosen over one that
    is 0.05% off in the first and 3% off in the second; a cell measured in one setting only is never
    chosen, however good."""
    data = {"small-r2-h30": results("small-r2-h30", {(0.7, 0.6): 2.00, (0.5, 0.3): 2.01, (1.0, 0.9): 1.999}),
            "large-r2-h30": results("large-r2-h30", {(0.7, 0.6): 2.06, (0.5, 0.3): 2.00})}
    decision = outer_grid.decide(data)
    assert decision["choice"] == (0.5, 0.3)
    assert decision["gaps"][1.0, 0.9]["large-r2-h30"] is None
    assert decision["best"] == {"small-r2-h30": (1.0, 0.9), "large-r2-h30": (0.5, 0.3)}
    assert decision["gaps"][0.5, 0.3]["small-r2-h30"] == pytest.approx(100 * (2.01 / 1.999 - 1))


def test_no_choice_when_the_bar_is_missed() -> None:
    data = {"small-r2-h30": results("small-r2-h30", {(0.7, 0.6): 2.00, (0.5, 0.3): 2.10}),
            "small-r2-h8": results("small-r2-h8", {(0.7, 0.6): 2.10, (0.5, 0.3): 2.00})}
    decision = outer_grid.decide(data)
    assert decision["choice"] is None and "5.00%" in decision["why"]


def test_a_check_setting_runs_the_grids_best_three_and_the_defaults(tmp_path) -> None:
    losses = {cell: 2.0 + i / 100 for i, cell in enumerate(outer_grid.GRID[::-1])}  # (1.0, 0.9) best
    common.write_json(outer_grid.results_path("small-r2-h30", tmp_path), results("small-r2-h30", losses))
    planned = outer_grid.planned_cells("small-r4-h30", tmp_path)
    assert planned[:3] == [(1.0, 0.9), (1.0, 0.6), (1.0, 0.3)]
    assert outer_grid.OLD_DEFAULT in planned and len(planned) == len(set(planned))
    with pytest.raises(SystemExit, match="run that first"):
        outer_grid.planned_cells("large-r4-h30", tmp_path)
