"""benchmarks/local_quality.py's cells and comparison, on made-up results (no training)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import common  # noqa: E402
import local_quality  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_cells_name_a_method_and_an_inner_lr_factor() -> None:
    assert local_quality.parse_cell("sync") == ("sync", 1.0)
    assert local_quality.parse_cell("local-h8-olr1-mom0.6@ilr0.5") == ("local-h8-olr1-mom0.6", 0.5)
    assert local_quality.method_of("sync") == "acco-sync"
    assert local_quality.method_of("local-hdefault") == "local-hdefault-lockstep"  # equal replicas: lockstep
    with pytest.raises(ValueError, match="unknown method"):
        local_quality.parse_cell("local-x8")
    with pytest.raises(ValueError, match="NAME@ilrF"):
        local_quality.parse_cell("local-h8@lr2")


def test_the_library_default_h_is_a_method_of_its_own() -> None:
    """``local-hdefault`` leaves sync_every (and the outer optimizer) to the library, so the row
    follows a change of the defaults without a new name."""
    spec = common.LocalSpec.parse("local-hdefault-lockstep")
    assert spec is not None and spec.sync_every is None and spec.pacing == "lockstep"
    assert "H = default" in spec.label()
    assert common.LocalSpec.parse("local-h0") is None


def test_every_cell_is_compared_with_data_parallel_and_the_best_local_cell() -> None:
    data = {"cells": {"sync": {"final_loss": 2.0}, "local-hdefault": {"final_loss": 2.02},
                      "local-h4-olr0.7-mom0.9": {"final_loss": 2.01}}}
    result = local_quality.compare(data)
    assert result["best"] == "local-h4-olr0.7-mom0.9" and result["data_parallel"] == 2.0
    assert result["defaults"]["vs_data_parallel"] == pytest.approx(1.0)
    assert result["defaults"]["vs_best"] == pytest.approx(100 * (2.02 / 2.01 - 1))
    assert result["rows"]["sync"]["vs_best"] is None
    assert list(result["rows"]) == ["sync", "local-h4-olr0.7-mom0.9", "local-hdefault"]  # by loss


def test_every_setting_names_a_size_of_the_registry_and_runs_data_parallel_first() -> None:
    for name, setting in local_quality.SETTINGS.items():
        assert name.startswith(setting.size + "-r") and setting.size in local_quality.SIZES
        assert setting.cells[0] == local_quality.SYNC and local_quality.DEFAULTS in setting.cells
        for cell in setting.cells:
            local_quality.parse_cell(cell)
