"""The light estimate round (``estimate_dtype=``) on real gloo ranks.

- The committed parameters still follow the acco recurrence exactly once it is rebuilt from
  the look-ahead points the ranks actually used (the decompressed estimates): only where the
  commit round's gradients are taken moves, never what is committed.
- Those look-ahead points are the full-precision ones up to the rounding of the delta.
- An estimate round moves half (bf16) or a quarter (float8) of a commit round's bytes, so an
  update moves at most 1.5x (bf16) or 1.3x (float8) of a ZeRO-1 update's bytes.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn

from acco import AccoOptimizer, RoundKind
from tests.helpers import TIMEOUT, assert_identical_across_ranks, assert_params_close
from tests.reference import (OPTIMIZERS, RECURRENCES, loss_fn, make_model, micro_batch, micro_batches_per_round,
                             params_of, round_data)

pytestmark = pytest.mark.timeout(120)
# Where each function's send buffer is, and how many times its bytes cross the wire from
# this rank, per rank in the group: an all-to-all keeps one chunk of N, an all-gather sends
# its input to N - 1 ranks, a point-to-point send (the gloo reduce-scatter) once.
SENDS = {
    "all_reduce": (0, lambda n: 1),
    "all_to_all_single": (1, lambda n: (n - 1) / n),
    "all_gather_into_tensor": (1, lambda n: n - 1),
    "all_gather_single": (1, lambda n: n - 1),
    "isend": (0, lambda n: 1),
}


class CountedSends:
    """Bytes each lane collective sends, in call order (wraps torch.distributed's functions)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self._originals = {}
        for name, (index, share) in SENDS.items():
            if not hasattr(dist, name):
                continue
            original = self._originals[name] = getattr(dist, name)

            def counted(*args, _original=original, _name=name, _index=index, _share=share, **kwargs):  # type: ignore[no-untyped-def]
                if threading.current_thread().name == "acco-comm-lane":
                    sent = args[_index]
                    wire = sent.numel() * sent.element_size() * _share(dist.get_world_size())
                    self.calls.append((_name, round(wire)))
                return _original(*args, **kwargs)

            setattr(dist, name, counted)

    def restore(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)

    def per_round(self) -> list[int]:
        """Bytes each round's reduce-scatter and all-gather put on the wire from this rank
        (scales included). A round opens with the all-reduce of its 5 float64 weights (40
        bytes, left out: a ZeRO-1 update needs its own count of samples too)."""
        rounds: list[int] = []
        for name, size in self.calls:
            if name == "all_reduce" and size == 40:
                rounds.append(0)
            elif name != "all_reduce":
                rounds[-1] += size
        return rounds


def light_rank(layout: str, dtype_name: str | None, rounds: int) -> dict:
    rank = dist.get_rank()
    model = make_model(seed=rank)
    cls, hp = OPTIMIZERS["adamw"]
    dtype = None if dtype_name is None else getattr(torch, dtype_name)
    opt = AccoOptimizer(model, cls, mode="acco", layout=layout, estimate_dtype=dtype, timeout=TIMEOUT, **hp)
    estimates = []
    for r in range(rounds):
        for i in range(micro_batches_per_round(r, rank, True)):
            loss_fn(model, *micro_batch(r, rank, i)).backward()
            opt.accumulate()
        opt.step()
        if opt.round_stats and opt.round_stats[-1].kind is RoundKind.ESTIMATE and r > 0:
            estimates.append(params_of(model))  # the look-ahead the next round computes at
    opt.finish()
    return {"params": params_of(model), "estimates": estimates}


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("layout", ["flat", "tensor"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_commits_follow_the_recurrence_rebuilt_from_the_decompressed_estimates(
    ranks, world_size: int, layout: str, dtype: str
) -> None:
    """With estimate_dtype the committed parameters follow the acco recurrence rebuilt from the
    estimate parameters the ranks actually used; those are the full-precision ones up to the
    rounding of the delta, and not equal to them."""
    rounds = 8
    results = ranks(world_size).run(light_rank, layout, dtype, rounds)
    assert_identical_across_ranks(results)
    for other in results[1:]:
        for used, seen in zip(results[0]["estimates"], other["estimates"]):
            for name in used:
                assert torch.equal(used[name], seen[name]), "ranks computed at different look-ahead points"
    init = params_of(make_model(seed=0))
    data = round_data(rounds, world_size, True)
    estimates = results[0]["estimates"]
    assert len(estimates) == rounds // 2  # the last one, theta~(4), is dropped by finish()
    expected = RECURRENCES["acco"](init, "adamw", data, estimates=estimates)
    assert_params_close(results[0]["params"], expected)

    # The look-ahead points are the full-precision ones, up to the rounding of the delta
    # (relative to the step's size), and not the same: the estimate did travel lighter.
    full = ranks(world_size).run(light_rank, layout, None, rounds)[0]["estimates"]
    tolerance = {"bfloat16": 0.02, "float8_e4m3fn": 0.15}[dtype]
    moved = False
    for light, exact in zip(estimates, full):
        for name in exact:
            step = (exact[name] - init[name]).abs().max()
            assert (light[name] - exact[name]).abs().max() <= tolerance * step + 1e-6, name
            moved |= not torch.equal(light[name], exact[name])
    assert moved


def bytes_rank(dtype_name: str | None) -> list[int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64))
    dtype = None if dtype_name is None else getattr(torch, dtype_name)
    counter = CountedSends()
    try:
        opt = AccoOptimizer(model, torch.optim.AdamW, mode="acco", estimate_dtype=dtype, lr=1e-3, timeout=TIMEOUT)
        for r in range(6):
            model(torch.randn(8, 64)).square().mean().backward()
            opt.accumulate()
            opt.step()
        opt.finish()
    finally:
        counter.restore()
    return counter.per_round()


@pytest.mark.parametrize(("dtype", "estimate_share", "update_vs_zero1"), [
    ("bfloat16", 0.5, 1.5),
    ("float8_e4m3fn", 0.25, 1.3),
])
def test_an_estimate_round_moves_a_fraction_of_the_bytes(ranks, dtype, estimate_share, update_vs_zero1) -> None:
    """An estimate round puts half (bf16) or a quarter (float8) of a commit round's bytes on the wire;
    commit rounds are unchanged, so an update moves at most 1.5x or 1.3x a ZeRO-1 update."""
    full = ranks(3).run(bytes_rank, None)[0]
    light = ranks(3).run(bytes_rank, dtype)[0]
    assert len(full) == len(light) == 6  # estimate, commit, estimate, ...
    assert abs(full[0] - full[1]) <= 8, "without the option an estimate round moves what a commit round moves"
    commit = light[1]
    assert light[1::2] == full[1::2], "commit rounds are unchanged"
    for estimate in light[0::2]:
        assert estimate <= estimate_share * commit * 1.01, (light, full)
    # A ZeRO-1 update moves one commit round's reduce-scatter + all-gather.
    assert (light[0] + light[1]) / commit <= update_vs_zero1, (light, full)
    assert abs((full[0] + full[1]) / commit - 2.0) < 1e-3
