"""docs/migrating.md: its two loops run, and its diff is the diff between them.

The DDP loop (before) and the acco loop (after) are taken from the page as they stand and run
on 2 gloo ranks as torchrun runs them. ``sync`` is ZeRO-1: it logs the DDP loop's loss at
every iteration; ``acco`` and ``dpu`` train, committing one update per iteration after the
first; rank 0's checkpoint (consolidated) loads into a fresh optimizer without a process
group.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import pytest
import torch

from acco import AccoOptimizer
from tests.ranks import ROOT, run_script

pytestmark = pytest.mark.timeout(300)
PAGE = Path(ROOT) / "docs" / "migrating.md"
ITERS = 8


def blocks() -> dict[str, str]:
    text = PAGE.read_text()
    files = dict(re.findall(r"<!-- file: (\S+) -->\n```python\n(.*?)```", text, flags=re.S))
    files["diff"] = re.search(r"```diff\n(.*?)```", text, flags=re.S).group(1)
    return files


def logged(output: str) -> list[tuple[float, int]]:
    """(loss, committed updates) per iteration, as rank 0 printed them."""
    return [(float(loss), int(updates)) for loss, updates in re.findall(r"loss (\S+), (\d+) updates", output)]


def run(tmp_path: Path, name: str, *args: str) -> list[tuple[float, int]]:
    script = tmp_path / name
    script.write_text(blocks()[name])
    results = run_script(str(script), *args, cwd=str(tmp_path))
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"{name} {args} rank {rank}:\n{result.stderr[-3000:]}"
    return logged(results[0].stdout)


def test_the_diff_on_the_page_is_the_diff_between_its_loops() -> None:
    files = blocks()
    diff = difflib.unified_diff(files["before.py"].splitlines(keepends=True), files["after.py"].splitlines(keepends=True),
                                "before.py", "after.py")
    assert "".join(diff) == files["diff"]


def test_sync_logs_the_ddp_loss_at_every_iteration(tmp_path) -> None:
    ddp = run(tmp_path, "before.py")
    sync = run(tmp_path, "after.py", "sync")
    assert len(ddp) == len(sync) == ITERS
    for (ddp_loss, ddp_updates), (loss, updates) in zip(ddp, sync):
        assert updates == ddp_updates
        assert loss == pytest.approx(ddp_loss, abs=2e-6)


@pytest.mark.parametrize("mode", ["acco", "dpu"])
def test_the_overlapped_modes_train_one_update_per_iteration(tmp_path, mode) -> None:
    log = run(tmp_path, "after.py", mode)
    assert [updates for _, updates in log] == list(range(ITERS))  # each lands one round later
    assert log[-1][0] < log[0][0] - 1.0
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    model = torch.nn.Sequential(torch.nn.Embedding(256, 64), torch.nn.Linear(64, 256))
    model.load_state_dict(saved["model"])
    opt = AccoOptimizer(model, torch.optim.AdamW, mode=mode, lr=1e-2)  # one process, no group
    opt.load_state_dict(saved["optimizer"])  # rank 0's consolidated file: every rank's part
    assert opt.num_updates == ITERS - 1
    opt.finish()
