"""torch.amp.GradScaler driving acco (fp16 on older GPUs), on 2 gloo ranks (acco.amp).

``sync`` and ``dpu``: the same parameters as the run without a scaler when nothing overflows
(bit for bit: the scale is a power of two, and it grows during the run); an overflow on one
rank skips that update on every rank, exactly as ``nonfinite="skip"`` skips it, and backs
that rank's scale off. ``acco`` mode and the misuses GradScaler cannot be exact with are
refused with a ``ValueError`` naming GradScaler, before anything is updated.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from acco import AccoOptimizer
from tests.helpers import TIMEOUT, assert_identical_across_ranks, assert_params_equal
from tests.reference import loss_fn, make_model, micro_batch, params_of

pytestmark = pytest.mark.timeout(120)
ROUNDS = 6
OVERFLOW_ROUND = 2  # rank 1's gradients overflow in this round (with ``overflow``)


def trained(mode: str, scaled: bool, overflow: bool = False) -> dict:
    """ROUNDS rounds of 2 micro-batches; with ``overflow`` rank 1's loss is inf in one round
    (a NaN gradient with ``nonfinite="skip"`` and no scaler: the reference for the skip)."""
    rank = dist.get_rank()
    model = make_model()
    opt = AccoOptimizer(model, torch.optim.AdamW, mode=mode, lr=1e-2, timeout=TIMEOUT,
                        nonfinite="raise" if scaled else "skip")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2) if scaled else None
    scales, committed = [], []
    for r in range(ROUNDS):
        for i in range(2):
            loss = loss_fn(model, *micro_batch(r, rank, i))
            if overflow and rank == 1 and r == OVERFLOW_ROUND and i == 1:
                loss = loss * float("inf") if scaled else loss * float("nan")
            (scaler.scale(loss) if scaled else loss).backward()
            opt.accumulate()
        if scaled:
            committed.append(bool(scaler.step(opt)))
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            committed.append(opt.step())
    opt.finish()
    return {"params": params_of(model), "scales": scales, "committed": committed,
            "num_updates": opt.num_updates, "skipped": opt.skipped_updates}


@pytest.mark.parametrize("mode", ["sync", "dpu"])
def test_equal_to_the_run_without_a_scaler(ranks, mode) -> None:
    plain, scaled = ranks(2).run(trained, mode, False), ranks(2).run(trained, mode, True)
    assert_identical_across_ranks(scaled)
    assert_params_equal(scaled[0]["params"], plain[0]["params"])
    assert scaled[0]["scales"][-1] > 2.0**12  # the scale grew between rounds
    assert scaled[0]["num_updates"] == plain[0]["num_updates"] == ROUNDS


@pytest.mark.parametrize("mode", ["sync", "dpu"])
def test_an_overflow_on_one_rank_skips_that_update_on_every_rank(ranks, mode) -> None:
    reference = ranks(2).run(trained, mode, False, True)  # the same round skipped by nonfinite="skip"
    scaled = ranks(2).run(trained, mode, True, True)
    assert_identical_across_ranks(scaled)
    assert_params_equal(scaled[0]["params"], reference[0]["params"])
    assert [s["skipped"] for s in scaled] == [1, 1] and [s["num_updates"] for s in scaled] == [ROUNDS - 1] * 2
    assert scaled[0]["committed"] == scaled[1]["committed"] == reference[0]["committed"]
    # Rank 1's scaler saw the inf and backed off; rank 0's gradients were finite.
    assert scaled[1]["scales"][OVERFLOW_ROUND] == scaled[1]["scales"][OVERFLOW_ROUND - 1] / 2
    assert scaled[0]["scales"][OVERFLOW_ROUND] >= scaled[0]["scales"][OVERFLOW_ROUND - 1]


def refused(misuse: str) -> dict:
    model = make_model()
    before = params_of(model)
    mode = "acco" if misuse == "acco" else "sync"
    opt = AccoOptimizer(model, torch.optim.AdamW, mode=mode, lr=1e-2, timeout=TIMEOUT)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(loss_fn(model, *micro_batch(0, dist.get_rank(), 0))).backward()
    opt.accumulate(weight=4.0 if misuse == "weights" else None)
    if misuse == "unscale":
        scaler.unscale_(opt)
    try:
        scaler.step(opt)
    except ValueError as error:
        message = str(error)
    else:
        message = ""
    outcome = {"message": message, "unchanged": all(torch.equal(p, before[n]) for n, p in params_of(model).items()),
               "launched": opt.in_flight is not None or opt.num_updates > 0}
    opt.close()
    return outcome


@pytest.mark.parametrize("misuse, says", [
    ("acco", "not supported in mode='acco'"),
    ("unscale", "scaler.unscale_(opt)"),
    ("weights", "equal-weight accumulate()"),
])
def test_what_cannot_be_exact_is_refused_before_anything_is_updated(ranks, misuse, says) -> None:
    for outcome in ranks(2).run(refused, misuse):
        assert "GradScaler" in outcome["message"] or "unscale_" in outcome["message"], outcome["message"]
        assert says in outcome["message"]
        assert outcome["unchanged"] and not outcome["launched"]
