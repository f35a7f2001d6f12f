"""mode="local" with sparse outer rounds (``outer_topk``) on real gloo ranks.

Reference (tests/reference.py, ``local_reference`` with ``outer_topk``, written from
docs/design.md "Sparse outer rounds"): ``sparsified`` keeps each block's largest magnitudes by
a plain sort, quantises them value by value, and the recurrence carries each replica's residual
and the copy of the global values every rank holds, as at 4 bits dense.
"""

from __future__ import annotations

import datetime
import math

import pytest
import torch

from acco import AccoOptimizer
from acco.options import Options
from acco.quantize import RowBlocks, TopKCodec
from tests.helpers import assert_identical_across_ranks, assert_params_close, assert_params_equal
from tests.reference import make_model, sparsified
from tests.test_local import H, expected, resume_rank
from tests.test_outer_bits import run_rank

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("bits", [32, 16, 8, 4, 2])
def test_codec_delivers_what_the_reference_keeps(bits) -> None:
    """One row of three parameters' pieces (blocks of 4096 cut at each piece's start, a short
    last block) through the codec equals ``sparsified``: the same values kept, decoded alike;
    the row is as long as its parts (places 16 bits each, values, a bf16 scale per block below
    16 bits, whole words)."""
    torch.manual_seed(bits)
    sizes = [5000, 70, 3930]  # pieces of 5000 (a short second block), 70 (one), 3930
    values = torch.randn(sum(sizes)) * torch.linspace(0.1, 3.0, sum(sizes))
    blocks = RowBlocks([(0, 5000), (5000, 5070), (5070, 9000)], 9000, 4096)
    codec = TopKCodec(1 / 64, bits)
    encoded = codec.encode(values, blocks)
    decoded = codec.decode(encoded, blocks)
    assert torch.equal(decoded, sparsified(values, 1 / 64, bits, sizes, row=9000))
    kept = [64, math.ceil(904 / 64), math.ceil(70 / 64), math.ceil(3930 / 64)]
    assert (decoded != 0).sum() == sum(kept)
    scales = 2 * len(kept) if bits <= 8 else 0
    assert encoded.numel() == codec.row_bytes(blocks) == 4 * math.ceil((scales + sum(kept) * (2 + bits / 8)) / 4)


def test_codec_keeps_zero_blocks_zero_and_a_scale_of_zero_finite() -> None:
    """A block of zeros decodes to zeros at every width (its scale 0 never divides)."""
    blocks = RowBlocks([(0, 100)], 100, 4096)
    for bits in (8, 4, 2):
        codec = TopKCodec(0.1, bits)
        assert torch.equal(codec.decode(codec.encode(torch.zeros(100), blocks), blocks), torch.zeros(100))


def longest_row(sizes: list[int], chunk: int, world_size: int, fraction: float, bits: int) -> int:
    """The longest row a sparse round sends: per piece of a parameter in a rank's chunk (one
    block: the test model's pieces are short), ceil(fraction n) places and values, a scale."""
    ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    longest = 0
    for rank in range(world_size):
        first, last = rank * chunk, (rank + 1) * chunk
        pieces = [min(end, last) - max(end - size, first) for size, end in zip(sizes, ends)]
        kept = [math.ceil(fraction * n) for n in pieces if n > 0]
        raw = sum(kept) * (2 + bits / 8) + (2 * len(kept) if bits <= 8 else 0)
        longest = max(longest, 4 * math.ceil(raw / 4))
    return longest


@pytest.mark.parametrize("world_size,bits,delay,overlap", [
    (2, 32, 0, "discard"),
    (3, 32, 1, "keep"),
    (2, 4, 0, "discard"),
    (3, 2, 0, "discard"),
    (2, 2, 2, "estimate"),
])
def test_sparse_rounds_equal_their_recurrence(ranks, world_size, bits, delay, overlap) -> None:
    """Every replica ends where the one-process recurrence of the same compression puts it
    (top-k per block, the kept values at ``bits``, error feedback on the reduce leg and the
    copy's lag on the gather leg), identical on every rank; each round moves the codec's
    bytes; a quarter of the values is not the dense round."""
    steps, fraction = 8, 0.25
    options = {"sync_every": H, "sync_delay": delay, "overlap": overlap, "outer_bits": bits, "outer_topk": fraction}
    results = ranks(world_size).run(run_rank, steps, options)
    reference = expected(world_size, steps, "adamw", sync_every=H, sync_delay=delay, overlap=overlap,
                         outer_bits=bits, outer_topk=fraction)
    dense = expected(world_size, steps, "adamw", sync_every=H, sync_delay=delay, overlap=overlap,
                     outer_bits=32 if bits == 32 else 4)
    assert_identical_across_ranks(results)
    assert_params_close(results[0]["params"], reference[0], rtol=0, atol=1e-6)
    assert max((reference[0][k] - dense[0][k]).abs().max() for k in reference[0]) > 1e-4  # not vacuous
    padded = results[0]["padded"]
    sizes = [p.numel() for p in make_model().parameters()]
    rounds = results[0]["bytes"]
    row = longest_row(sizes, padded // world_size, world_size, fraction, bits)
    assert len(rounds) >= 2 and rounds == [2 * world_size * row] * len(rounds)
    assert_params_equal(results[0]["global"], results[0]["params"])
    assert results[0]["sizes"]["outer_residual"] == 4 * padded  # error feedback at every width


def test_resume_with_sparse_residuals_is_bit_identical(ranks) -> None:
    """A state saved with a sparse round in flight carries the residuals (most of each
    pseudo-gradient waits in them) and resumes bit for bit."""
    options = {"sync_every": H, "sync_delay": 2, "outer_bits": 2, "outer_topk": 0.25}
    results = ranks(2).run(resume_rank, 9, 4, options)
    for result in results:
        assert result["in_flight"] and result["residuals"]
        assert_params_equal(result["resumed"], result["straight"])
    assert_identical_across_ranks(results, "resumed")


@pytest.mark.parametrize("kwargs,match", [
    ({"outer_topk": 0}, "Invalid outer_topk: 0"),
    ({"outer_topk": 1.0}, "Invalid outer_topk: 1.0"),
    ({"outer_topk": True}, "Invalid outer_topk: True"),
    ({"outer_topk": "1/64"}, "Invalid outer_topk: '1/64'"),
    ({"outer_bits": 2}, "2 with outer_topk"),
    ({"outer_topk": 1 / 64, "outer_bits": 3}, "Invalid outer_bits: 3"),
])
def test_refusals_before_any_collective(kwargs, match) -> None:
    """Bad sparse settings are refused at construction, naming the value (no process group
    exists here: a collective would fail differently)."""
    with pytest.raises(ValueError, match=match):
        AccoOptimizer(make_model(), torch.optim.AdamW, mode="local", sync_every=4, **kwargs)


def test_topk_is_ignored_outside_local_mode() -> None:
    """Like every local-mode argument, ``outer_topk`` in another mode warns and is ignored."""
    with pytest.warns(UserWarning, match="outer_topk"):
        options = Options.check(mode="acco", nonfinite="raise", layout="flat", max_grad_norm=None, param_dtype=None,
                                reduce_dtype=None, timeout=datetime.timedelta(seconds=10), estimate_dtype=None,
                                outer_topk=1 / 64)  # fmt: skip
    assert options.local is None
