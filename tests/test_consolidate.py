""""Rank 0 saves optimizer.state_dict()": consolidate_state_dict(to=0), one file, any world size.

The loop nanoGPT, Lightning and most hand-written trainers use: every rank calls
``opt.consolidate_state_dict(to=0)``, rank 0 saves ``{"model", "optimizer"}`` with
``torch.save``, and every rank of *new processes* (``run_fresh``: torchrun's environment, a
new process group) loads that one file into a fresh model and optimizer. The resumed run
must equal the uninterrupted one, in every mode, at the same world size and at another:
every round's 6 micro-batches are the same global set, cut into 2 or 3 ranks' shares. In
``acco`` mode the state is consolidated with an estimate round in flight and its gradients
pending, the hardest moment.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from acco import AccoOptimizer
from tests.helpers import TIMEOUT, assert_identical_across_ranks, assert_params_close
from tests.ranks import run_fresh
from tests.reference import loss_fn, make_model, micro_batch, params_of

pytestmark = pytest.mark.timeout(300)
BEFORE, AFTER = 3, 4  # rounds before the checkpoint, and after it
GLOBAL_MICRO_BATCHES = 6


def train_rounds(model, opt, first: int, count: int) -> None:
    """Rounds ``first`` .. ``first + count - 1``, this rank taking its share of each round's
    global micro-batches."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    share = GLOBAL_MICRO_BATCHES // world_size
    for r in range(first, first + count):
        for m in range(rank * share, (rank + 1) * share):
            loss_fn(model, *micro_batch(r, 0, m)).backward()
            opt.accumulate()
        opt.step()


def saved_then_uninterrupted(mode: str, path: str) -> dict:
    model = make_model()
    opt = AccoOptimizer(model, torch.optim.AdamW, mode=mode, lr=1e-2, timeout=TIMEOUT)
    train_rounds(model, opt, 0, BEFORE)
    opt.consolidate_state_dict(to=0)
    if dist.get_rank() == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    dist.barrier()
    train_rounds(model, opt, BEFORE, AFTER)
    opt.finish()
    return {"params": params_of(model)}


def resumed(mode: str, path: str) -> dict:
    dist.init_process_group("gloo")
    model = make_model(seed=1)  # other values: the checkpoint must restore them
    checkpoint = torch.load(path, weights_only=True)
    model.load_state_dict(checkpoint["model"])
    opt = AccoOptimizer(model, torch.optim.AdamW, mode=mode, lr=1e-2, timeout=TIMEOUT)
    opt.load_state_dict(checkpoint["optimizer"])
    in_flight = opt.in_flight
    train_rounds(model, opt, BEFORE, AFTER)
    opt.finish()
    return {"params": params_of(model), "in_flight": None if in_flight is None else in_flight.value}


@pytest.mark.parametrize("mode", ["acco", "dpu", "sync"])
def test_rank_zero_saves_and_every_rank_of_new_processes_resumes(ranks, tmp_path, mode) -> None:
    path = str(tmp_path / "ckpt.pt")
    uninterrupted = ranks(2).run(saved_then_uninterrupted, mode, path)
    saved = torch.load(path, weights_only=True)["optimizer"]
    assert saved["param_groups"][0]["acco"]["mode"] == mode  # the whole state, in torch's layout
    for world_size in (2, 3):
        results = run_fresh(resumed, mode, path, world_size=world_size)
        assert_identical_across_ranks(results)
        if mode != "sync":
            assert results[0]["in_flight"] == ("estimate" if mode == "acco" else "commit")
        assert_params_close(results[0]["params"], uninterrupted[0]["params"], rtol=1e-6, atol=1e-6)


def rank_state_dicts_after_consolidating() -> dict:
    model = make_model()
    opt = AccoOptimizer(model, torch.optim.AdamW, mode="acco", lr=1e-2, timeout=TIMEOUT)
    train_rounds(model, opt, 0, 2)
    opt.consolidate_state_dict(to=1)
    whole = opt.state_dict()
    train_rounds(model, opt, 2, 1)  # the next accumulate() ends the consolidated state
    after = opt.state_dict()
    opt.finish()
    try:
        opt.consolidate_state_dict(to=2)
    except ValueError as error:
        bad = str(error)
    return {"whole": "acco" in whole["param_groups"][0], "after": "acco" in after["param_groups"][0], "bad": bad}


def test_only_the_target_rank_holds_the_whole_state_until_the_next_step(ranks) -> None:
    results = ranks(2).run(rank_state_dicts_after_consolidating)
    assert [r["whole"] for r in results] == [False, True]
    assert [r["after"] for r in results] == [False, False]
    assert all("Invalid rank to consolidate on: 2" in r["bad"] for r in results)


def loaded_shard_elsewhere(path: str) -> str:
    model = make_model()
    opt = AccoOptimizer(model, torch.optim.AdamW, mode="sync", lr=1e-2, timeout=TIMEOUT)
    train_rounds(model, opt, 0, 1)
    if dist.get_rank() == 0:
        torch.save(opt.state_dict(), path)  # rank 0's shard only: the mistake the hint is for
    dist.barrier()
    fresh = AccoOptimizer(make_model(), torch.optim.AdamW, mode="sync", lr=1e-2, timeout=TIMEOUT)
    try:
        fresh.load_state_dict(torch.load(path, weights_only=True))
    except ValueError as error:
        return str(error)
    finally:
        opt.finish()
        fresh.close()
    return ""


def test_loading_one_ranks_shard_elsewhere_names_the_way_that_works(ranks, tmp_path) -> None:
    messages = ranks(2).run(loaded_shard_elsewhere, str(tmp_path / "shard.pt"))
    assert messages[0] == ""
    assert "consolidate_state_dict(to=0)" in messages[1] and "acco.checkpoint.save" in messages[1]
