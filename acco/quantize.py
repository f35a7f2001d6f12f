"""Row-wise quantisation for the light estimate round (``estimate_dtype=``).

A row is what one rank sends to (reduce-scatter) or receives from (all-gather) one other
rank. 16-bit types are a plain cast. float8 types get one fp32 scale per row, so the row's
largest magnitude maps to the type's largest finite value (float8 has no infinities to
absorb an overflow: e4m3fn turns it into NaN).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["check_estimate_dtype", "dequantize_row", "needs_scale", "quantize_rows"]


def needs_scale(dtype: torch.dtype) -> bool:
    return dtype.itemsize == 1


def check_estimate_dtype(dtype: object, reduce_dtype: torch.dtype) -> torch.dtype:
    """``dtype`` if it can carry a lighter estimate round than ``reduce_dtype``; else ValueError."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"Invalid estimate_dtype: {dtype!r} (a floating torch.dtype such as torch.bfloat16)")
    if dtype.itemsize >= reduce_dtype.itemsize:
        raise ValueError(
            f"Invalid estimate_dtype: {dtype} is not lighter than the reduce dtype {reduce_dtype}, "
            "so the estimate round would move as many bytes"
        )
    return dtype


def quantize_rows(rows: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``rows`` (2-D, floating) as ``dtype`` plus one fp32 scale per row (ones for 16-bit
    types). ``rows`` is left as it is; values beyond ``dtype``'s range are clamped to it
    (float16 would make them inf, float8 e4m3fn NaN)."""
    scales = torch.ones(rows.shape[0], dtype=torch.float32, device=rows.device)
    largest = torch.finfo(dtype).max
    if not needs_scale(dtype):
        if largest >= torch.finfo(rows.dtype).max:
            return rows.to(dtype), scales  # bf16 from fp32: the same range, nothing to clamp
        payload = torch.empty(rows.shape, dtype=dtype, device=rows.device)
        for row, out in zip(rows, payload):  # a row at a time: no full-size temporary
            out.copy_(row.clamp(-largest, largest))
        return payload, scales
    amax = rows.abs().amax(dim=1).float()
    # A row whose largest magnitude is too small for amax / largest to be a normal fp32
    # keeps scale 1: its values then round to zero, never to NaN (0 / 0).
    scaled = amax / largest
    scales = torch.where(scaled > 0, scaled, scales)
    payload = torch.empty(rows.shape, dtype=dtype, device=rows.device)
    for row, out, scale in zip(rows, payload, scales):  # a row at a time: no full-size fp32 temporary
        out.copy_(row.float().div(scale).clamp_(-largest, largest))
    return payload, scales


def dequantize_row(row: Tensor, scale: Tensor) -> Tensor:
    """One row back in fp32 (a new tensor)."""
    return row.float() * scale
