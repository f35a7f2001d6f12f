"""Quantisation: rows of the light estimate round (``estimate_dtype=``), and the block codec
of ``mode="local"``'s outer rounds (``outer_bits=``).

A row is what one rank sends to (reduce-scatter) or receives from (all-gather) one other
rank. For the estimate round, 16-bit types are a plain cast, float8 types get one fp32 scale
per row, so the row's largest magnitude maps to the type's largest finite value (float8 has
no infinities to absorb an overflow: e4m3fn turns it into NaN).

An outer round's rows go through :class:`BlockCodec` (every value, ``outer_bits``) or
:class:`TopKCodec` (the largest of each block, ``outer_topk``): a row of fp32 values becomes a
row of bytes (values, scales, and the kept values' places), so one collective of ``uint8``
carries them all.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["OUTER_BITS", "TOPK_BITS", "TOPK_BLOCK", "BlockCodec", "RowBlocks", "TopKCodec", "check_estimate_dtype", "dequantize_row",
           "needs_scale", "quantize_rows"]

# What an outer round may send per value (docs/design.md, "Lighter outer rounds"), and per kept
# value with outer_topk (docs/design.md, "Sparse outer rounds").
OUTER_BITS = (32, 16, 8, 4)
TOPK_BITS = (32, 16, 8, 4, 2)
TOPK_BLOCK = 4096  # values per block of a sparse round (SparseLoCo's chunks)
_SORTED_BLOCKS = 256  # blocks sorted at once by TopKCodec.encode (1M values: 12 MB of temporaries)


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


class RowBlocks:
    """Where one row's blocks take their values: every parameter's piece of the row is cut
    into blocks of its own from the piece's start, so a block never mixes two tensors (whose
    magnitudes differ) and a parameter's blocks depend only on its own values; the row's
    padding is not sent. Kept as one ``(start in the row, start in the blocks, length)`` per
    piece, not as an index: no per-value memory between rounds.

    Args:
        pieces: ``(start, stop)`` of each parameter's piece of the row, in order.
        length: the row's length.
        block: values per block.
    """

    def __init__(self, pieces: list[tuple[int, int]], length: int, block: int) -> None:
        self.length = length
        self.pieces: list[tuple[int, int, int]] = []
        offset = 0
        for start, stop in pieces:
            self.pieces.append((start, offset, stop - start))
            offset += math.ceil((stop - start) / block) * block
        self.blocks = offset // block

    def gather(self, row: Tensor, block: int) -> Tensor:
        """The row's blocks as a new fp32 ``(blocks, block)`` tensor, each piece's last block
        padded with zeros."""
        values = torch.zeros(self.blocks * block, dtype=torch.float32, device=row.device)
        for start, offset, count in self.pieces:
            values[offset : offset + count].copy_(row[start : start + count])
        return values.view(self.blocks, block)

    def scatter(self, values: Tensor) -> Tensor:
        """The blocks' values back in a new fp32 row, zero outside the pieces."""
        row = torch.zeros(self.length, dtype=torch.float32, device=values.device)
        flat = values.view(-1)
        for start, offset, count in self.pieces:
            row[start : start + count].copy_(flat[offset : offset + count])
        return row

    def counts(self, block: int) -> Tensor:
        """The values of each block (int64): ``block``, but a piece's last block may be short."""
        counts = torch.full((self.blocks,), block, dtype=torch.int64)
        for _, offset, count in self.pieces:
            if count % block:
                counts[(offset + count) // block] = count % block
        return counts


class BlockCodec:
    """Rows of values as rows of bytes: ``bits`` per value (16: bf16; 8: int8; 4: int4, two
    per byte), and below 16 one bf16 scale per block of ``block`` values (symmetric: the
    block's largest magnitude maps to the largest level, 127 or 7; round half to even);
    :class:`RowBlocks` says which values form each block.

    Integers rather than float8 / fp4 at equal bytes: on the outer rounds' pseudo-gradients
    they lose less (benchmarks/outer_bits.py, "formats"). bf16 scales rather than fp32: the
    same range, and half the bytes, so blocks of 64 cost 0.25 bits per value (int4 4.25 bits,
    0.133 of fp32; int8 8.25, 0.258). A block's scale is rounded to bf16 before its values
    are divided by it, so decoding is exact arithmetic on what was sent.

    Args:
        bits: 16, 8 or 4.
        block: values per scale; ``block * bits`` a multiple of 16, so every scale sits at an
            even byte offset.
    """

    def __init__(self, bits: int, block: int = 64) -> None:
        if bits not in (16, 8, 4):
            raise ValueError(f"Invalid bits: {bits!r} (16, 8 or 4)")
        if block < 1 or block * bits % 16:
            raise ValueError(f"Invalid block: {block!r} (values per scale whose {bits}-bit values fill whole bf16 slots)")
        self.bits = bits
        self.block = block
        self.levels = (1 << (bits - 1)) - 1  # 127 or 7; unused for 16 bits

    def row_bytes(self, blocks: RowBlocks) -> int:
        """Bytes of one encoded row."""
        if self.bits == 16:
            return 2 * blocks.length
        return blocks.blocks * (self.block * self.bits // 8 + 2)

    def encode(self, row: Tensor, blocks: RowBlocks) -> Tensor:
        """``row`` (1-D, floating) as a new ``uint8`` tensor of :meth:`row_bytes`."""
        if self.bits == 16:
            return row.to(torch.bfloat16).view(torch.uint8)
        padded = blocks.gather(row, self.block)
        scales = (padded.abs().amax(dim=1) / self.levels).to(torch.bfloat16)
        # A zero block (or one too small for a normal bf16 scale) keeps scale 0: its values
        # decode to zero, never to NaN (0 / 0).
        divisor = torch.where(scales > 0, scales.float(), 1.0)
        levels = padded.div_(divisor[:, None]).round_().clamp_(-self.levels, self.levels)
        if self.bits == 4:
            nibbles = (levels.to(torch.int16) + 8).to(torch.uint8).view(-1, 2)  # stored as level + 8
            values = nibbles[:, 0] | (nibbles[:, 1] << 4)  # low nibble first
        else:
            values = levels.to(torch.int8).view(torch.uint8).view(-1)
        return torch.cat([values, scales.view(torch.uint8)])

    def decode(self, row: Tensor, blocks: RowBlocks) -> Tensor:
        """One encoded row (its first :meth:`row_bytes`) back as fp32 values, the row's
        padding zero (a new tensor)."""
        if self.bits == 16:
            return row[: 2 * blocks.length].view(torch.bfloat16).float()
        payload = blocks.blocks * self.block * self.bits // 8
        scales = row[payload : payload + 2 * blocks.blocks].view(torch.bfloat16).float()
        values = row[:payload]
        if self.bits == 4:
            values = torch.stack([values & 0xF, values >> 4], dim=-1).view(-1).to(torch.int16) - 8
        else:
            values = values.view(torch.int8)
        return blocks.scatter(values.float().view(blocks.blocks, self.block).mul_(scales[:, None]))


class TopKCodec:
    """Rows of values as the largest magnitudes of each block (``outer_topk``; docs/design.md,
    "Sparse outer rounds"): of a block's n values the ``ceil(fraction n)`` largest in
    magnitude travel (equal ones in the order of their places), each as its place in the block
    (16 bits) and its value, the rest decode
    to zero (error feedback keeps them for later rounds). Zeros never travel: a block with fewer
    nonzero values fills its other slots with :data:`EMPTY`, no place (no level decodes to 0). Blocks are :class:`RowBlocks`'s, of
    ``block`` values, so they never straddle two parameters or two ranks' chunks (nor FSDP2's
    shards, which are those chunks on a mesh).

    Kept values: 32 bits as they are, 16 as bf16; 8, 4 and 2 as one of ``2 ** bits`` levels
    spread evenly over [-s, s], s the block's largest magnitude rounded to bf16 (one bf16
    scale per block): level q in [-L, L - 1] (L = 2 ** (bits - 1)) decodes to (q + 1/2) s / L,
    the middle of its step, as kept values are the large ones (no level is wasted on zero).

    Args:
        fraction: the share of each block's values kept, in (0, 1].
        bits: 32, 16, 8, 4 or 2 per kept value.
        block: values per block (at most 65535: a place is 16 bits, :data:`EMPTY` none).
    """

    EMPTY = 0xFFFF

    def __init__(self, fraction: float, bits: int, block: int = TOPK_BLOCK) -> None:
        if not 0 < fraction <= 1:
            raise ValueError(f"Invalid fraction: {fraction!r} (in (0, 1])")
        if bits not in TOPK_BITS:
            raise ValueError(f"Invalid bits: {bits!r} (one of {', '.join(map(str, TOPK_BITS))})")
        if not 1 <= block < self.EMPTY:
            raise ValueError(f"Invalid block: {block!r} (1 to 65534 values: a place in a block is 16 bits)")
        self.fraction = fraction
        self.bits = bits
        self.block = block

    def kept(self, blocks: RowBlocks) -> Tensor:
        """How many values each block keeps (int64): ``ceil(fraction n)`` of its n, at least one."""
        counts = blocks.counts(self.block)
        return torch.ceil(counts.double() * self.fraction).long().clamp_(1).minimum(counts)

    def _layout(self, kept: Tensor) -> tuple[int, int, int, int]:
        """Byte offsets in a row: (places, values, scales, end), every part aligned to its type."""
        n = int(kept.sum())
        if self.bits > 8:  # the values (fp32 first: aligned), then their places
            places, values, scales, end = n * self.bits // 8, 0, 0, n * self.bits // 8 + 2 * n
        else:  # the blocks' bf16 scales, the places, then the values' codes packed in bytes
            places, values, scales = 2 * kept.numel(), 2 * kept.numel() + 2 * n, 0
            end = values + math.ceil(n * self.bits / 8)
        return places, values, scales, -(-end // 4) * 4  # (rows of whole words: the next row's stay aligned)

    def row_bytes(self, blocks: RowBlocks) -> int:
        """Bytes of one encoded row."""
        return self._layout(self.kept(blocks))[3]

    def encode(self, row: Tensor, blocks: RowBlocks) -> Tensor:
        """``row`` (1-D, floating) as a new ``uint8`` tensor of :meth:`row_bytes`."""
        kept = self.kept(blocks).to(row.device)
        padded = blocks.gather(row, self.block)
        counts = blocks.counts(self.block).to(row.device)
        columns = torch.arange(self.block, device=row.device)
        magnitude = padded.abs().masked_fill_(columns[None, :] >= counts[:, None], -1.0)  # padding never kept
        most = int(kept.max())
        # The largest first, equal magnitudes in the order of their places (decoded levels are
        # often equal): a stable sort, a slice of blocks at a time (its indices are 8 bytes a value).
        top = torch.empty((magnitude.shape[0], most), dtype=magnitude.dtype, device=row.device)
        places = torch.empty((magnitude.shape[0], most), dtype=torch.int64, device=row.device)
        for start in range(0, magnitude.shape[0], _SORTED_BLOCKS):
            part = magnitude[start : start + _SORTED_BLOCKS].sort(dim=1, descending=True, stable=True)
            top[start : start + _SORTED_BLOCKS] = part.values[:, :most]
            places[start : start + _SORTED_BLOCKS] = part.indices[:, :most]
        chosen = torch.arange(most, device=row.device)[None, :] < kept[:, None]
        values = padded.gather(1, places)[chosen]
        places = places.masked_fill_(top <= 0, self.EMPTY)[chosen]  # (zeros and padding: no place)
        offsets = self._layout(kept)
        out = torch.zeros(offsets[3], dtype=torch.uint8, device=row.device)
        out[offsets[0] : offsets[0] + 2 * places.numel()].copy_(places.to(torch.int32).to(torch.int16).view(torch.uint8))
        if self.bits == 32:
            encoded = values.float().view(torch.uint8)
        elif self.bits == 16:
            encoded = values.to(torch.bfloat16).view(torch.uint8)
        else:
            scales = top[:, 0].clamp(min=0).to(torch.bfloat16)
            out[offsets[2] : offsets[2] + 2 * scales.numel()].copy_(scales.view(torch.uint8))
            half = 1 << (self.bits - 1)
            steps = (scales.float() / half).repeat_interleave(kept)
            # A block whose scale is 0 holds zeros: its levels decode to 0 whatever they are.
            levels = torch.floor(values / torch.where(steps > 0, steps, 1.0)).clamp_(-half, half - 1)
            codes = (levels + half).to(torch.uint8)  # in [0, 2 ** bits)
            per_byte = 8 // self.bits
            codes = torch.cat([codes, codes.new_zeros(-codes.numel() % per_byte)]).view(-1, per_byte)
            encoded = codes[:, 0].clone()
            for i in range(1, per_byte):  # the first value in the low bits
                encoded |= codes[:, i] << (i * self.bits)
        out[offsets[1] : offsets[1] + encoded.numel()].copy_(encoded)
        return out

    def decode(self, row: Tensor, blocks: RowBlocks) -> Tensor:
        """One encoded row back as fp32 values, zero where nothing was kept (a new tensor)."""
        kept = self.kept(blocks).to(row.device)
        n = int(kept.sum())
        offsets = self._layout(kept)
        places = row[offsets[0] : offsets[0] + 2 * n].view(torch.int16).to(torch.int64) & 0xFFFF
        sent = places != self.EMPTY
        if self.bits == 32:
            values = row[offsets[1] : offsets[1] + 4 * n].view(torch.float32).clone()
        elif self.bits == 16:
            values = row[offsets[1] : offsets[1] + 2 * n].view(torch.bfloat16).float()
        else:
            scales = row[offsets[2] : offsets[2] + 2 * kept.numel()].view(torch.bfloat16).float()
            half, per_byte = 1 << (self.bits - 1), 8 // self.bits
            packed = row[offsets[1] : offsets[1] + math.ceil(n * self.bits / 8)]
            mask = (1 << self.bits) - 1
            codes = torch.stack([(packed >> (i * self.bits)) & mask for i in range(per_byte)], dim=-1).view(-1)[:n]
            values = (codes.float() - half + 0.5) * (scales / half).repeat_interleave(kept)
        first = torch.arange(kept.numel(), device=row.device).repeat_interleave(kept) * self.block
        flat = torch.zeros(blocks.blocks * self.block, dtype=torch.float32, device=row.device)
        flat[(first + places)[sent]] = values[sent]
        return blocks.scatter(flat.view(blocks.blocks, self.block))
