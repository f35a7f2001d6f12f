"""The three modes against independent one-process references, on real gloo ranks.

- sync: plain single-process training on the global batch (all ranks' micro-batches);
- dpu and acco: the recurrences of docs/design.md ("The algorithm"), recomputed in tests/reference.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from acco import AccoOptimizer
from tests.helpers import TIMEOUT, assert_identical_across_ranks, assert_params_close, this_rank
from tests.reference import (OPTIMIZERS, RECURRENCES, loss_fn, make_model, micro_batch, micro_batches_per_round,
                             params_of, round_data)

pytestmark = pytest.mark.timeout(120)


def run_rank(mode: str, layout: str, optimizer: str, rounds: int, uneven: bool) -> dict:
    """One rank's training loop; every rank starts from different parameters."""
    rank = this_rank()
    model = make_model(seed=rank)
    cls, hp = OPTIMIZERS[optimizer]
    opt = AccoOptimizer(model, cls, mode=mode, layout=layout, timeout=TIMEOUT, **hp)
    committed = []
    for r in range(rounds):
        for i in range(micro_batches_per_round(r, rank, uneven)):
            loss_fn(model, *micro_batch(r, rank, i)).backward()
            opt.accumulate()
        committed.append(opt.step())
    committed.append(opt.finish())
    return {"params": params_of(model), "committed": committed, "num_updates": opt.num_updates}


def plain_training(optimizer: str, rounds: int, world_size: int) -> dict:
    """Single-process training on the global batch: every rank's micro-batches at once."""
    model = make_model(seed=0)
    cls, hp = OPTIMIZERS[optimizer]
    opt = cls(model.parameters(), **hp)
    for r in range(rounds):
        batches = [micro_batch(r, rank, i) for rank in range(world_size) for i in range(2)]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
    return params_of(model)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("layout", ["flat", "tensor"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_sync_equals_plain_training_on_the_global_batch(ranks, world_size, layout, optimizer) -> None:
    """sync (ZeRO-1) equals single-process training on all ranks' micro-batches at once, commits every
    round, and all ranks hold identical parameters."""
    rounds = 4
    if world_size == 1:
        results = [run_rank("sync", layout, optimizer, rounds, False)]  # no process group
    else:
        results = ranks(world_size).run(run_rank, "sync", layout, optimizer, rounds, False)
    assert_identical_across_ranks(results)
    assert results[0]["committed"] == [True] * rounds + [False]
    assert_params_close(results[0]["params"], plain_training(optimizer, rounds, world_size))


@pytest.mark.parametrize("mode", ["dpu", "acco"])
@pytest.mark.parametrize("layout", ["flat", "tensor"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_overlapped_modes_equal_their_recurrence(ranks, world_size, layout, mode) -> None:
    """dpu and acco, with ranks starting from different parameters and uneven micro-batch counts, equal
    their recurrence (docs/design.md) on every rank."""
    rounds = 6
    results = ranks(world_size).run(run_rank, mode, layout, "adamw", rounds, True)
    assert_identical_across_ranks(results)
    init = params_of(make_model(seed=0))  # rank 0's parameters are broadcast
    expected = RECURRENCES[mode](init, "adamw", round_data(rounds, world_size, True))
    assert_params_close(results[0]["params"], expected)


@pytest.mark.parametrize("rounds", [5, 6])
def test_acco_commits_every_other_round_and_drops_a_trailing_estimate(ranks, rounds) -> None:
    """acco's step() returns True exactly when it lands a commit round (rounds 2, 4, ...); finish()
    lands a last commit round or drops a trailing estimate round, leaving the committed parameters
    of the recurrence."""
    results = ranks(2).run(run_rank, "acco", "flat", "sgd", rounds, False)
    # step(): estimate, commit, estimate, ... lands; True when a commit lands.
    expected_steps = [r >= 2 and r % 2 == 0 for r in range(rounds)]
    assert results[0]["committed"] == expected_steps + [rounds % 2 == 0]
    assert results[0]["num_updates"] == rounds // 2
    init = params_of(make_model(seed=0))
    expected = RECURRENCES["acco"](init, "sgd", round_data(rounds, 2, False))
    assert_params_close(results[0]["params"], expected)


def test_dpu_commits_every_round_after_the_first(ranks) -> None:
    """dpu commits every round after the first, finish() landing the last."""
    results = ranks(2).run(run_rank, "dpu", "tensor", "sgd", 4, False)
    assert results[1]["committed"] == [False, True, True, True, True]
    assert results[1]["num_updates"] == 4


@pytest.mark.parametrize("mode", ["sync", "dpu", "acco"])
def test_world_size_one_without_a_process_group(mode) -> None:
    """Without torch.distributed each mode still equals its recurrence."""
    assert not dist.is_initialized()
    result = run_rank(mode, "flat", "adamw", 4, True)
    init = params_of(make_model(seed=0))
    expected = RECURRENCES[mode](init, "adamw", round_data(4, 1, True))
    assert_params_close(result["params"], expected)
