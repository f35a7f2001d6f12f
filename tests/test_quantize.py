"""acco.quantize: the row-wise rounding of the light estimate round (``estimate_dtype=``).

- ``needs_scale``: exactly the 1-byte (float8) types carry a scale;
- ``quantize_rows`` / ``dequantize_row``: 16-bit types are a plain cast (scales of 1);
  float8 rows get one fp32 scale each, so the row's largest magnitude maps to the type's
  largest finite value. A round trip loses at most half a unit in the last place of the
  dtype (relative 2^-8 bf16, 2^-11 fp16, 2^-4 e4m3fn, 2^-3 e5m2), plus half a subnormal
  step times the row's scale; zero rows stay zero; nothing becomes NaN or inf, even where
  fp32 rounding puts a scaled value past the largest finite one (clamped);
- ``check_estimate_dtype``: a floating dtype lighter than the reduce dtype, else
  ``TypeError``/``ValueError`` naming the value.

The collectives that carry these rows between ranks are in tests/test_collectives.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from acco.quantize import check_estimate_dtype, dequantize_row, needs_scale, quantize_rows

pytestmark = pytest.mark.timeout(60)

ESTIMATE_DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# A few fp32 ulps: dividing by the scale and multiplying back each round in fp32.
FP32_SLACK = 4 * 2.0**-24


def quantize(rows: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return quantize_rows(rows, dtype)


def round_trip(rows: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(payload, scales, every row dequantized)."""
    payload, scales = quantize(rows, dtype)
    restored = torch.stack([dequantize_row(row, scale) for row, scale in zip(payload, scales)])
    return payload, scales, restored


def assert_within_rounding(restored: Tensor, rows: Tensor, scales: Tensor, dtype: torch.dtype) -> None:
    """|restored - rows| <= half an ulp of ``dtype`` (relative), plus half its smallest
    subnormal step at each row's scale, plus fp32 slack."""
    info = torch.finfo(dtype)
    relative = info.eps / 2 + FP32_SLACK
    absolute = (scales * info.smallest_normal * info.eps / 2).unsqueeze(1)
    error = (restored - rows).abs()
    allowed = relative * rows.abs() + absolute
    worst = int((error - allowed).argmax())
    assert bool((error <= allowed).all()), (
        f"{dtype}: {float(rows.flatten()[worst])} came back as {float(restored.flatten()[worst])}")


@st.composite
def row_sets(draw: st.DrawFn, largest_exponent: int) -> Tensor:
    """1-5 rows of 1-33 values; each row its own magnitude 10^e (|e| <= ``largest_exponent``),
    some values exactly 0 and sometimes a whole row of zeros."""
    count = draw(st.integers(1, 5))
    width = draw(st.integers(1, 33))
    exponents = draw(st.lists(st.integers(-largest_exponent, largest_exponent), min_size=count, max_size=count))
    zero_rows = draw(st.lists(st.booleans(), min_size=count, max_size=count))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    rows = torch.randn(count, width, generator=generator)
    rows *= torch.tensor([10.0**e for e in exponents]).unsqueeze(1)
    rows[torch.rand(count, width, generator=generator) < 0.1] = 0.0
    rows[torch.tensor(zero_rows)] = 0.0
    return rows


# ------------------------------------------------------------------------ needs_scale


@pytest.mark.parametrize(("dtype", "scaled"), [
    (torch.float64, False), (torch.float32, False), (torch.bfloat16, False), (torch.float16, False),
    (torch.float8_e4m3fn, True), (torch.float8_e5m2, True),
])
def test_only_one_byte_types_need_a_scale(dtype: torch.dtype, scaled: bool) -> None:
    """float8 has too little range for raw values and no infinities to absorb an
    overflow; 16-bit types travel as a plain cast."""
    assert needs_scale(dtype) is scaled


# ----------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", ESTIMATE_DTYPES)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_round_trip_loses_at_most_the_dtypes_rounding(dtype: torch.dtype, data: st.DataObject) -> None:
    """Random rows of any magnitude come back within half an ulp of ``dtype`` (plus the
    subnormal step at the row's scale), with a payload of ``dtype`` and fp32 scales."""
    # float16 has no scale: its rows must stay within its range (|x| < 65504).
    rows = data.draw(row_sets(largest_exponent=3 if dtype is torch.float16 else 20))
    payload, scales, restored = round_trip(rows, dtype)
    assert payload.dtype is dtype and payload.shape == rows.shape
    assert scales.dtype is torch.float32 and scales.shape == (rows.shape[0],)
    assert torch.isfinite(restored).all()
    assert_within_rounding(restored, rows, scales, dtype)


@pytest.mark.parametrize("dtype", ESTIMATE_DTYPES)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_scales_are_per_row_and_zero_rows_stay_zero(dtype: torch.dtype, data: st.DataObject) -> None:
    """float8: scale = the row's largest magnitude / the dtype's largest value, so that
    magnitude travels as +-max; a row of zeros has scale 1 and comes back as zeros.
    16-bit types: every scale is 1."""
    rows = data.draw(row_sets(largest_exponent=3 if dtype is torch.float16 else 20))
    payload, scales, restored = round_trip(rows, dtype)
    amax = rows.abs().amax(dim=1)
    zero = amax == 0
    assert torch.equal(restored[zero], torch.zeros_like(rows[zero]))
    if not needs_scale(dtype):
        assert torch.equal(scales, torch.ones_like(scales))
        return
    largest = torch.finfo(dtype).max
    assert torch.equal(scales[zero], torch.ones_like(scales[zero]))
    assert torch.equal(scales[~zero], amax[~zero] / largest)
    assert torch.equal(payload.float().abs().amax(dim=1)[~zero], torch.full_like(amax[~zero], largest))


@pytest.mark.parametrize("dtype", FLOAT8)
def test_rows_far_apart_in_magnitude_each_keep_their_precision(dtype: torch.dtype) -> None:
    """Rows of 1e-6 and 1e6 side by side: each round-trips within the rounding. One
    scale for both would flush the small row to zero."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 64, generator=generator) * torch.tensor([[1e-6], [1.0], [1e6]])
    _, scales, restored = round_trip(rows, dtype)
    assert_within_rounding(restored, rows, scales, dtype)
    assert (restored[0] != 0).float().mean() > 0.9
    shared = quantize(rows.reshape(1, -1), dtype)
    assert (dequantize_row(*[t[0] for t in shared])[:64] == 0).float().mean() > 0.9


@pytest.mark.parametrize("dtype", FLOAT8)
def test_a_scaled_value_past_the_largest_is_clamped_not_nan(dtype: torch.dtype) -> None:
    """Where fp32 rounds amax / (amax / max) above max, the value still travels as +-max,
    never NaN (e4m3fn has no infinity) or inf (e5m2)."""
    largest = torch.finfo(dtype).max
    candidates = torch.linspace(1.0, 2.0, 4097)
    overshoot = candidates[candidates / (candidates / largest) > largest]
    assert overshoot.numel() > 0, "no amax whose scaled value rounds past the largest: the case is not exercised"
    rows = torch.stack([overshoot, -overshoot], dim=1)  # each row: +amax, -amax
    payload, scales, restored = round_trip(rows, dtype)
    assert torch.equal(payload.float(), torch.tensor([largest, -largest]).expand_as(rows))
    assert torch.isfinite(restored).all()
    assert_within_rounding(restored, rows, scales, dtype)


@pytest.mark.parametrize("dtype", FLOAT8)
def test_rows_at_the_edge_of_fp32_range_stay_finite(dtype: torch.dtype) -> None:
    """Values near fp32's largest (and tiny values beside them) neither overflow nor turn NaN."""
    edge = torch.finfo(torch.float32).max
    rows = torch.tensor([[edge, -edge, 1.0, 0.0], [1e-30, -3e-31, 0.0, 2e-30]])
    payload, scales, restored = round_trip(rows, dtype)
    assert not torch.isnan(payload.float()).any() and torch.isfinite(restored).all()
    assert_within_rounding(restored, rows, scales, dtype)


@pytest.mark.parametrize("dtype", ESTIMATE_DTYPES)
def test_dequantize_row_returns_a_new_fp32_tensor(dtype: torch.dtype) -> None:
    """The dequantized row is fp32 and separate memory: writing to it (the all-gather adds
    the live parameters into it) leaves the received payload as it was."""
    payload, scales = quantize(torch.tensor([[0.5, -2.0, 3.0]]), dtype)
    received = payload.clone()
    row = dequantize_row(payload[0], scales[0])
    assert row.dtype is torch.float32
    row.add_(100.0)
    assert torch.equal(payload.view(torch.uint8), received.view(torch.uint8))


# ---------------------------------------------------------------- check_estimate_dtype


@pytest.mark.parametrize(("dtype", "reduce_dtype"), [
    (torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.float8_e4m3fn, torch.float32),
    (torch.float8_e5m2, torch.bfloat16), (torch.float8_e4m3fn, torch.float16), (torch.float32, torch.float64),
])
def test_a_lighter_floating_dtype_is_accepted(dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
    """A floating dtype with fewer bytes than the reduce dtype is returned as it is."""
    assert check_estimate_dtype(dtype, reduce_dtype) is dtype


@pytest.mark.parametrize(("dtype", "reduce_dtype", "error", "message"), [
    ("bfloat16", torch.float32, TypeError, "Invalid estimate_dtype: 'bfloat16' \\(a floating torch.dtype"),
    (None, torch.float32, TypeError, "Invalid estimate_dtype: None"),
    (torch.int8, torch.float32, TypeError, "Invalid estimate_dtype: torch.int8"),
    (torch.complex64, torch.float32, TypeError, "Invalid estimate_dtype: torch.complex64"),
    (torch.float32, torch.float32, ValueError,
     "Invalid estimate_dtype: torch.float32 is not lighter than the reduce dtype torch.float32"),
    (torch.bfloat16, torch.float16, ValueError,
     "Invalid estimate_dtype: torch.bfloat16 is not lighter than the reduce dtype torch.float16"),
    (torch.float64, torch.float32, ValueError, "torch.float64 is not lighter than the reduce dtype torch.float32"),
])
def test_an_estimate_dtype_that_is_not_a_lighter_float_is_refused(
    dtype: object, reduce_dtype: torch.dtype, error: type[Exception], message: str
) -> None:
    """Not a floating torch.dtype: TypeError; not lighter on the wire: ValueError; both
    name the value."""
    with pytest.raises(error, match=message):
        check_estimate_dtype(dtype, reduce_dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_the_input_is_left_as_it_is_and_dequantize_returns_a_new_tensor(dtype: torch.dtype) -> None:
    """quantize_rows never writes its input; dequantize_row never returns (or writes) its own."""
    rows = torch.randn(3, 17, generator=torch.Generator().manual_seed(0)) * 50
    before = rows.clone()
    payload, scales = quantize_rows(rows, dtype)
    assert torch.equal(rows, before)
    fp32_row = torch.randn(5)
    kept = fp32_row.clone()
    out = dequantize_row(fp32_row, torch.tensor(2.0))
    assert out.data_ptr() != fp32_row.data_ptr() and torch.equal(fp32_row, kept)
    torch.testing.assert_close(out, 2 * kept)


def test_float16_clamps_what_it_cannot_hold_instead_of_making_it_inf() -> None:
    """float16 has no scale: values beyond 65504 travel as 65504, never as inf."""
    rows = torch.tensor([[1e6, -1e6, 3.0], [70000.0, 1.0, -2.0]])
    payload, _ = quantize_rows(rows, torch.float16)
    assert torch.isfinite(payload).all()
    assert payload[0, 0] == 65504 and payload[0, 1] == -65504 and payload[1, 0] == 65504 and payload[0, 2] == 3


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_a_row_too_small_for_a_scale_rounds_to_zero_not_nan(dtype: torch.dtype) -> None:
    """A row whose largest magnitude divided by the dtype's largest value underflows fp32
    keeps scale 1: it arrives as zeros, never NaN."""
    rows = torch.tensor([[1e-44, -1e-44, 0.0], [1.0, 2.0, 3.0]])
    payload, scales = quantize_rows(rows, dtype)
    back = dequantize_row(payload[0], scales[0])
    assert torch.isfinite(back).all() and torch.equal(back, torch.zeros(3))
    assert scales[0] == 1.0


# ---------------------------------------------------------------- the outer rounds' codec

@pytest.mark.parametrize("bits", [16, 8, 4])
@settings(max_examples=20, deadline=None)
@given(sizes=st.lists(st.integers(1, 150), min_size=1, max_size=4), gap=st.integers(0, 70),
       seed=st.integers(0, 2**16), magnitude=st.sampled_from([0.0, 1e-30, 1e-3, 1.0, 1e4]))
def test_block_codec_equals_the_reference_quantiser(bits, sizes, gap, seed, magnitude) -> None:
    """A row of parameter pieces (and padding after them) encodes to ``row_bytes`` and decodes
    to what tests/reference.py's independent quantiser gives (blocks of 64 from each piece's
    start, bf16 scales, levels half to even), bit for bit; the padding decodes to 0."""
    from acco.quantize import BlockCodec, RowBlocks
    from tests.reference import quantised

    length = sum(sizes) + gap
    values = torch.randn(length, generator=torch.Generator().manual_seed(seed)) * magnitude
    values[sum(sizes):] = 0.0
    pieces, start = [], 0
    for size in sizes:
        pieces.append((start, start + size))
        start += size
    codec, blocks = BlockCodec(bits), RowBlocks(pieces, length, 64)
    encoded = codec.encode(values, blocks)
    assert encoded.dtype == torch.uint8 and encoded.numel() == codec.row_bytes(blocks)
    if bits < 16:
        assert encoded.numel() == sum(-(-s // 64) for s in sizes) * (64 * bits // 8 + 2)
    decoded = codec.decode(encoded, blocks)
    assert torch.equal(decoded, quantised(values, bits, sizes, length))
    assert torch.isfinite(decoded).all() and not decoded[sum(sizes):].any()


def test_block_codec_rejects_other_widths() -> None:
    from acco.quantize import BlockCodec

    with pytest.raises(ValueError, match="bits: 2"):
        BlockCodec(2)
