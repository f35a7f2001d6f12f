"""Layouts: where each parameter of a param group sits in its padded flat buffer.

A param group's parameters live in one padded flat buffer of ``world_size * chunk``
elements; rank ``r`` owns ``[r * chunk, (r + 1) * chunk)``. The *layout* decides where each
parameter sits in that buffer (docs/design.md, "Shards and layouts"):

- ``flat``: parameters back to back, the buffer cut into equal chunks whatever the tensor
  boundaries (perfect balance; exact for element-wise optimizers).
- ``tensor``: every tensor whole inside one rank's chunk, tensors spread greedily
  (largest first, onto the least loaded rank), each chunk padded to the largest load so
  reduce-scatter and all-gather stay single calls.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Layout", "ShardPlan", "Slot", "plan_flat", "plan_layout", "plan_tensor"]


class Layout(str, enum.Enum):
    """How a param group's parameters are cut into per-rank shards."""

    FLAT = "flat"
    TENSOR = "tensor"


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in the padded flat buffer."""

    offset: int
    numel: int
    shape: torch.Size


@dataclass(frozen=True)
class ShardPlan:
    """The placement of one param group's parameters across ``world_size`` ranks."""

    layout: Layout
    world_size: int
    chunk: int
    slots: tuple[Slot, ...]

    @property
    def padded_numel(self) -> int:
        return self.chunk * self.world_size

    def rank_range(self, rank: int) -> tuple[int, int]:
        """The ``[start, stop)`` range of the flat buffer that ``rank`` owns."""
        return rank * self.chunk, (rank + 1) * self.chunk

    def owner(self, index: int) -> int | None:
        """The rank holding all of parameter ``index``, or None if it straddles ranks."""
        slot = self.slots[index]
        first = min(slot.offset // self.chunk, self.world_size - 1)  # an empty slot may sit at the very end
        if slot.numel == 0 or (slot.offset + slot.numel - 1) // self.chunk == first:
            return first
        return None

    def owned(self, rank: int) -> list[int]:
        """Indices of the parameters whose elements all lie in ``rank``'s chunk."""
        return [i for i in range(len(self.slots)) if self.owner(i) == rank]


def _shapes(shapes: Sequence[Sequence[int]]) -> list[torch.Size]:
    return [torch.Size(s) for s in shapes]


def plan_flat(shapes: Sequence[Sequence[int]], world_size: int) -> ShardPlan:
    """Back-to-back parameters, the buffer cut into ``world_size`` equal chunks."""
    sizes = _shapes(shapes)
    slots, offset = [], 0
    for size in sizes:
        slots.append(Slot(offset, size.numel(), size))
        offset += size.numel()
    chunk = max(1, math.ceil(offset / world_size))
    return ShardPlan(Layout.FLAT, world_size, chunk, tuple(slots))


def plan_tensor(shapes: Sequence[Sequence[int]], world_size: int) -> ShardPlan:
    """Whole tensors per rank, assigned largest first to the least loaded rank.

    The largest chunk is at most ``ceil(total / world_size) + max(numel)``, the usual
    bound for greedy list scheduling.
    """
    sizes = _shapes(shapes)
    loads = [0] * world_size
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i].numel(), i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owner[i] = rank
        loads[rank] += sizes[i].numel()
    chunk = max(1, max(loads))
    local_offset = [0] * world_size
    slots = []
    for i, size in enumerate(sizes):
        rank = owner[i]
        slots.append(Slot(rank * chunk + local_offset[rank], size.numel(), size))
        local_offset[rank] += size.numel()
    return ShardPlan(Layout.TENSOR, world_size, chunk, tuple(slots))


def plan_layout(layout: Layout, shapes: Sequence[Sequence[int]], world_size: int) -> ShardPlan:
    return plan_flat(shapes, world_size) if layout is Layout.FLAT else plan_tensor(shapes, world_size)

