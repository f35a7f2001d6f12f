"""docs/migrating.md: its loops run, and its diff is the diff between the first two.

The DDP loop (before), the acco loop (after) and the nanoGPT port in local mode
(train_local) are taken from the page as they stand and run on 2 gloo ranks as torchrun runs
them. ``sync`` is ZeRO-1: it logs the DDP loop's loss at every iteration; ``acco`` and ``dpu``
train, committing one update per iteration after the first; rank 0's checkpoint
(consolidated) loads into a fresh optimizer without a process group. The local-mode port,
stopped and resumed in new processes, ends bit for bit where the uninterrupted run ends.
"""

from __future__ import annotations

import difflib
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from acco import AccoOptimizer
from tests.helpers import assert_params_equal
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


def run_page_script(directory: Path, name: str, *args: str) -> str:
    """The page's ``name`` run on 2 ranks in ``directory``; rank 0's output, every rank having
    exited 0."""
    directory.mkdir(exist_ok=True)
    script = directory / name
    script.write_text(blocks()[name])
    results = run_script(str(script), *args, cwd=str(directory))
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"{name} {args} rank {rank}:\n{result.stderr[-3000:]}"
    return results[0].stdout


def run(tmp_path: Path, name: str, *args: str) -> list[tuple[float, int]]:
    return logged(run_page_script(tmp_path, name, *args))


def test_the_diff_on_the_page_is_the_diff_between_its_loops() -> None:
    files = blocks()
    diff = difflib.unified_diff(files["before.py"].splitlines(keepends=True), files["after.py"].splitlines(keepends=True),
                                "before.py", "after.py")
    assert "".join(diff) == files["diff"]


def test_sync_logs_the_ddp_loss_at_every_iteration(tmp_path) -> None:
    with ThreadPoolExecutor(max_workers=2) as pool:  # both jobs at once
        ddp, sync = pool.map(lambda args: run(tmp_path / args[0], *args[1:]), [("ddp", "before.py"), ("sync", "after.py", "sync")])
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


def test_the_local_mode_port_resumed_in_new_processes_ends_as_the_uninterrupted_run(tmp_path) -> None:
    """train_local.py as the page has it, run whole (12 iterations), and stopped at iteration 8
    (saved there on rank 0's shared decision, 2 inner steps after the last outer round) then
    resumed in new processes: the two halves log the whole run's lines, and after finish() the
    resumed run saves the same model bit for bit. The checkpoint's model is the global values
    (what eval() gives after loading its optimizer state), not rank 0's own parameters."""
    with ThreadPoolExecutor(max_workers=2) as pool:  # both jobs at once
        whole, stopped = (output.splitlines() for output in pool.map(
            lambda args: run_page_script(tmp_path / args[0], "train_local.py", *args[1:]),
            [("whole",), ("stopped", "max_iters=8")]))  # fmt: skip
    saved = torch.load(tmp_path / "stopped" / "ckpt.pt", weights_only=True)
    assert saved["iter_num"] == 8 and len(saved["rng"]) == 2
    resumed = run_page_script(tmp_path / "stopped", "train_local.py", "init_from=resume").splitlines()
    at_8 = next(number for number, line in enumerate(whole) if line.startswith("step 8:"))
    assert stopped == whole[: at_8 + 1] and resumed == whole[at_8:]
    assert whole[at_8 - 1].endswith(", 2 outer rounds") and whole[-2].endswith(", 4 outer rounds")
    ended = torch.load(tmp_path / "whole" / "final.pt", weights_only=True)
    ended_resumed = torch.load(tmp_path / "stopped" / "final.pt", weights_only=True)
    assert ended["iter_num"] == ended_resumed["iter_num"] == 12
    assert_params_equal(ended_resumed["model"], ended["model"])

    model = torch.nn.Sequential(torch.nn.Embedding(256, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 256))
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2]},
              {"params": [p for p in model.parameters() if p.dim() < 2]}]  # fmt: skip
    opt = AccoOptimizer(groups, torch.optim.AdamW, module=model, mode="local", sync_every=3, lr=1e-2)
    opt.load_state_dict(saved["optimizer"])  # one process: rank 0's replica
    own = {name: p.detach().clone() for name, p in model.named_parameters()}
    opt.eval()
    assert_params_equal(model.state_dict(), saved["model"])
    assert all(not torch.equal(own[name], saved["model"][name]) for name in own)
    opt.finish()
