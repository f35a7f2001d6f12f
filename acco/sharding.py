"""Layouts, flat buffers, and every torch.distributed call acco makes.

A param group's parameters live in one padded flat buffer of ``world_size * chunk``
elements; rank ``r`` owns ``[r * chunk, (r + 1) * chunk)``. The *layout* decides where
each parameter sits in that buffer:

- ``flat``: parameters back to back, the buffer cut into equal chunks whatever the tensor
  boundaries (perfect balance; exact for element-wise optimizers).
- ``tensor``: every tensor whole inside one rank's chunk, tensors spread greedily
  (largest first, onto the least loaded rank), each chunk padded to the largest load so
  reduce-scatter and all-gather stay single calls.

:class:`Collectives` is the only place that calls ``torch.distributed``, so torch's renames
and backend quirks are handled once.
"""

from __future__ import annotations

import copy
import datetime
import enum
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from acco.quantize import dequantize_row, needs_scale, quantize_rows

__all__ = [
    "Collectives",
    "Layout",
    "ShardCopy",
    "ShardPlan",
    "ShardedGroup",
    "Slot",
    "plan_flat",
    "plan_tensor",
    "plan_layout",
]


# The gloo reduce-scatter's pieces: the first (its only receive buffer) and the largest.
_REDUCE_SCATTER_FIRST_PIECE_BYTES = 1 << 20
_REDUCE_SCATTER_LARGEST_PIECE_BYTES = 16 << 20
_REDUCE_SCATTER_ONE_PIECE_BYTES = 16 << 20  # chunks up to this size go in one piece


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


class ShardedGroup:
    """One param group's live parameters, flat buffers and this rank's master shard.

    Model-size buffers (``plan.padded_numel`` elements):

    - ``grad_accumulator`` (``reduce_dtype``): where the compute lane folds gradients
      (``weight * grad``), during backward or at ``accumulate_grads``;
    - ``grad_handover``: the buffer a round reduces, updates and gathers into. With
      ``double_buffered`` it is a second buffer, swapped with the accumulator at each
      hand-over (allocated at the first one), so the compute lane keeps accumulating while
      the round runs; without it (``sync`` mode, where nothing is computed while a round
      runs) it *is* the accumulator, zeroed once the round's result is loaded.

    Everything else is a view of the round's buffer once there is more than one rank:

    - ``grad_shard`` = its chunk ``r``: the reduce-scatter runs in place;
    - ``master_grad``: ``grad_shard`` itself when ``reduce_dtype`` is the master dtype (the
      gradient is averaged in place), else a chunk-sized buffer in the master dtype;
    - ``gathered``: the all-gather target, the round's buffer itself once its
      reduce-scatter has run (nothing reads the gradients any more): as is when
      ``param_dtype == reduce_dtype``, reinterpreted (its first bytes) when ``param_dtype``
      is narrower, a separate buffer only when it is wider;
    - ``gather_input`` = chunk ``r`` of ``gathered``: the all-gather runs in place.

    With one rank there is nothing to communicate and the round's buffer keeps the
    (unaveraged) gradient sum: ``grad_shard`` is the whole round buffer, and
    ``master_grad`` and ``gathered`` (= ``gather_input``) are separate buffers.

    ``master`` (``plan.chunk`` long, fp32, fp64 for fp64 parameters) is this rank's shard
    of the parameters; ``master_views`` are the tensors the base optimizer sees. With
    ``master_in_params`` (sync and dpu, whose live parameters hold the committed values at
    every round boundary) and every dtype the master dtype, it is not kept at all: each
    round copies it from the live parameters into a chunk of the round's buffer already
    sent (:meth:`shard_workspace`) and steps it there.

    Per rank, with P parameters, N ranks and the bytes of each dtype ``b_*``:
    ``P b_reduce`` (accumulator) + ``P b_reduce`` (hand-over, not in sync) +
    ``P/N b_master`` (master shard, not with ``master_in_params``) + ``P/N b_master``
    (``master_grad``, only when ``b_reduce`` is not the master dtype) + ``P b_param``
    (``gathered``, only when ``param_dtype`` is wider than ``reduce_dtype``), plus the
    base optimizer's state for ``P/N`` and, in acco mode, one copy of that state (and of
    the master shard where no free chunk of the round's buffer can hold the estimate's
    working copy). :meth:`buffer_bytes` gives the figures.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        plan: ShardPlan,
        rank: int,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        *,
        double_buffered: bool = True,
        master_in_params: bool = False,
    ) -> None:
        first = params[0]
        self.params = list(params)
        self.plan = plan
        self.rank = rank
        self.device = first.device
        self.param_dtype = param_dtype or first.dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        # The master shard and the optimizer state are never below fp32.
        self.master_dtype = torch.float64 if first.dtype == torch.float64 else torch.float32
        # One rank has no collective to run in place, and its round buffer must keep the
        # gradient sum (so the round's result goes elsewhere).
        self.in_place = plan.world_size > 1
        self.double_buffered = double_buffered or not self.in_place
        n, chunk = plan.padded_numel, plan.chunk
        self.grad_accumulator = torch.zeros(n, dtype=self.reduce_dtype, device=self.device)
        self.grad_handover: Tensor | None = None if self.double_buffered else self.grad_accumulator
        # The live parameters hold the committed values at every round boundary in sync and
        # dpu. When they are in the master dtype (and every buffer too), the master shard is
        # not kept: each round copies it from the live parameters into a chunk of its own
        # buffer that was already sent (see master), and the base optimizer steps it there.
        self.master_in_params = (
            master_in_params
            and self.in_place
            and self.param_dtype == self.reduce_dtype == self.master_dtype == first.dtype
        )
        self._rounds = 0  # hand-overs so far; master is reloaded once per round
        self._master_round = -1
        if self.master_in_params:
            self._master = torch.empty(0, dtype=self.master_dtype, device=self.device)
            placeholder = self.grad_accumulator[:chunk]  # no storage of its own; moved each round
        else:
            self._master = torch.zeros(chunk, dtype=self.master_dtype, device=self.device)
            placeholder = self._master
        self._master_grad: Tensor | None = None
        if not (self.in_place and self.reduce_dtype == self.master_dtype):
            self._master_grad = torch.zeros(chunk, dtype=self.master_dtype, device=self.device)
        self._gathered: Tensor | None = None
        if not self.in_place or self.param_dtype.itemsize > self.reduce_dtype.itemsize:
            self._gathered = torch.zeros(n, dtype=self.param_dtype, device=self.device)
        # Views of master (distinct tensors, also in the flat layout) that the base optimizer
        # is built on; point_master_views() may move them to a workspace for one update.
        self.master_views = [view.view(view.shape) for view in self.shard_views(placeholder)]
        self._accumulator_views = self._views(self.grad_accumulator)
        # Whether p.grad points into the accumulator (autograd then accumulates in place).
        self.grad_views = False
        # The estimate round's copy of the master shard and optimizer state (acco mode),
        # allocated at the first estimate and reused by every later one.
        self.estimate_copy: ShardCopy | None = None

    def _views(self, buffer: Tensor) -> list[Tensor]:
        return [buffer[s.offset : s.offset + s.numel].view(s.shape) for s in self.plan.slots]

    # --------------------------------------------------------- the round's buffer

    def round_buffer(self) -> Tensor:
        """The buffer the current (or next replayed) round reduces and gathers into."""
        if self.grad_handover is None:  # double-buffered, before the first hand-over
            self.grad_handover = torch.zeros_like(self.grad_accumulator)
        return self.grad_handover

    @property
    def grad_shard(self) -> Tensor:
        """This rank's reduce-scatter result: chunk ``r`` of the round's buffer."""
        buffer = self.round_buffer()
        if not self.in_place:
            return buffer
        start, stop = self.plan.rank_range(self.rank)
        return buffer[start:stop]

    @property
    def master_grad(self) -> Tensor:
        """The averaged gradient the base optimizer reads, in the master dtype."""
        return self.grad_shard if self._master_grad is None else self._master_grad

    @property
    def gathered(self) -> Tensor:
        """The all-gather target, copied into the live parameters at a round boundary."""
        if self._gathered is not None:
            return self._gathered
        buffer = self.round_buffer()
        if buffer.dtype == self.param_dtype:
            return buffer
        # A narrower param_dtype (bf16 parameters, fp32 reduction): the result fits in the
        # first bytes of the round's buffer, free once its reduce-scatter has run.
        size = self.plan.padded_numel * self.param_dtype.itemsize
        return buffer.view(torch.uint8)[:size].view(self.param_dtype)

    @property
    def gather_input(self) -> Tensor:
        """This rank's updated shard in ``param_dtype``: chunk ``r`` of ``gathered``."""
        if not self.in_place:
            return self.gathered
        start, stop = self.plan.rank_range(self.rank)
        return self.gathered[start:stop]

    @property
    def master(self) -> Tensor:
        """This rank's master shard (``plan.chunk`` long, master dtype).

        With ``master_in_params`` it exists only on the comm lane during a round: the first
        access of a round copies this rank's chunk of the live parameters (the committed
        values) into a chunk of the round's buffer that was already sent, and points the
        base optimizer's parameters there; the all-gather then carries the result.
        """
        if not self.master_in_params:
            return self._master
        if self._master_round != self._rounds:
            workspace = self.shard_workspace()
            if workspace is None:
                raise AssertionError("master_in_params without a free chunk in the round's buffer")
            with torch.no_grad():
                self._master.set_(workspace)
                self._params_to_shard(self._master)
            self.point_master_views(self._master)
            self._master_round = self._rounds
        return self._master

    def master_values(self, in_flight: bool) -> Tensor:
        """A copy of the committed master shard at a round boundary (``in_flight``: a
        finished round has not been loaded yet; its result is the committed values)."""
        if not self.master_in_params:
            return self._master.clone()
        if in_flight:
            return self.gather_input.clone()
        shard = torch.empty(self.plan.chunk, dtype=self.master_dtype, device=self.device)
        self._params_to_shard(shard)
        return shard

    def load_master_values(self, values: Tensor, in_flight: bool) -> None:
        """Restore the committed master shard (``in_flight``: a replayed round brings it)."""
        if not self.master_in_params:
            self._master.copy_(values)
        elif not in_flight:
            # The master shard is the live parameters' chunk: write it there (the same
            # values when the model's state was restored too).
            start, _ = self.plan.rank_range(self.rank)
            with torch.no_grad():
                for index, offset, length in self._chunk_pieces():
                    self.params[index].data.view(-1)[offset - self.plan.slots[index].offset :][:length].copy_(
                        values[offset - start : offset - start + length]
                    )

    def _chunk_pieces(self) -> list[tuple[int, int, int]]:
        """(parameter index, offset in the flat buffer, length) of every piece of a
        parameter inside this rank's chunk."""
        start, stop = self.plan.rank_range(self.rank)
        pieces = []
        for index, slot in enumerate(self.plan.slots):
            lo, hi = max(start, slot.offset), min(stop, slot.offset + slot.numel)
            if lo < hi:
                pieces.append((index, lo, hi - lo))
        return pieces

    def _params_to_shard(self, shard: Tensor) -> None:
        start, _ = self.plan.rank_range(self.rank)
        shard.zero_()  # padding
        pieces = self._chunk_pieces()
        if pieces:
            torch._foreach_copy_(
                [shard[offset - start : offset - start + length] for _, offset, length in pieces],
                [
                    self.params[index].detach().reshape(-1)[offset - self.plan.slots[index].offset :][:length]
                    for index, offset, length in pieces
                ],
            )

    def shard_workspace(self) -> Tensor | None:
        """A chunk of the round's buffer that nothing reads during the update, usable as a
        chunk-sized tensor in the master dtype; None where there is none.

        Valid between the round's reduce-scatter and its all-gather: every chunk but this
        rank's has been sent by then, so one of them can hold the estimate's working copy
        of the master shard. It must overlap neither ``grad_shard`` nor ``gather_input``.
        """
        if not self.in_place or self.reduce_dtype != self.master_dtype:
            return None
        buffer = self.round_buffer()
        chunk, size = self.plan.chunk, buffer.element_size()
        busy = [(self.rank * chunk * size, (self.rank + 1) * chunk * size)]
        if self._gathered is None:
            width = self.param_dtype.itemsize
            busy.append((self.rank * chunk * width, (self.rank + 1) * chunk * width))
        for step in range(1, self.plan.world_size):
            index = (self.rank + step) % self.plan.world_size
            start, stop = index * chunk * size, (index + 1) * chunk * size
            if all(stop <= a or b <= start for a, b in busy):
                return buffer[index * chunk : (index + 1) * chunk]
        return None

    def point_master_views(self, shard: Tensor) -> None:
        """Make ``master_views`` (the base optimizer's parameters, its state keys) views of
        ``shard``: the same tensor objects, so the optimizer and its state follow."""
        with torch.no_grad():
            for view, target in zip(self.master_views, self.shard_views(shard)):
                view.set_(target)

    def buffer_bytes(self) -> dict[str, int]:
        """Bytes of each buffer this group holds now (views of another buffer count 0)."""
        sizes = {
            "grad_accumulator": self.grad_accumulator.nbytes,
            "grad_handover": 0
            if self.grad_handover is None or self.grad_handover is self.grad_accumulator
            else self.grad_handover.nbytes,
            "gathered": 0 if self._gathered is None else self._gathered.nbytes,
            "master": 0 if self.master_in_params else self._master.nbytes,
            "master_grad": 0 if self._master_grad is None else self._master_grad.nbytes,
        }
        sizes["estimate_copy"] = 0 if self.estimate_copy is None else self.estimate_copy.nbytes()
        return sizes

    # ----------------------------------------------------------------- gradients

    def accumulate_grads(self, weight: float | Tensor) -> bool:
        """Add ``weight * p.grad`` into the accumulator and drop ``p.grad``.

        ``weight`` is a number, or a 0-dim tensor on the gradients' device (never read on
        the host). Returns whether any parameter had a gradient.
        """
        targets, grads = [], []
        for param, view in zip(self.params, self._accumulator_views):
            if param.grad is None or _same_memory(param.grad, view):
                continue  # unused in this micro-batch (contributes zero), or already in place
            if param.grad.is_sparse:
                raise TypeError("acco does not support sparse gradients")
            targets.append(view)
            grads.append(param.grad)
            param.grad = None
        if targets and isinstance(weight, Tensor):
            # p.grad is consumed anyway: scale it in place, in fp32 at least.
            torch._foreach_mul_(grads, _scale_for(grads[0], weight))
            torch._foreach_add_(targets, grads)
        elif targets:
            torch._foreach_add_(targets, grads, alpha=weight)
        return bool(targets)

    def fold_grad(self, index: int, weight: float | Tensor) -> bool:
        """Fold parameter ``index``'s ``p.grad`` into its slot of the accumulator, as soon as
        backward has produced it (the post-accumulate-grad hook's work).

        A ``p.grad`` that is already its accumulator view was accumulated in place by
        autograd (at weight 1). Any other is added at ``weight`` and replaced by that view
        (``grad_views``) or dropped. Returns whether there was a gradient.
        """
        param, view = self.params[index], self._accumulator_views[index]
        grad = param.grad
        if grad is None:
            return False
        if _same_memory(grad, view):
            return True
        if grad.is_sparse:
            raise TypeError("acco does not support sparse gradients")
        if isinstance(weight, Tensor):  # a weight on the device: never read on the host
            view.add_(grad.detach().mul_(_scale_for(grad, weight)))
        else:
            view.add_(grad.detach(), alpha=weight)
        param.grad = view if self.grad_views else None
        return True

    def can_view_grads(self) -> bool:
        """Whether ``p.grad`` may be a view of the accumulator (autograd needs p.grad in the
        parameter's dtype)."""
        return self.reduce_dtype == self.param_dtype

    def attach_grad_views(self) -> None:
        """Point every ``p.grad`` at its slot of the accumulator: the next backward adds
        into it in place, and no separate gradient is allocated."""
        self.grad_views = True
        for param, view in zip(self.params, self._accumulator_views):
            param.grad = view

    def detach_grad_views(self) -> None:
        """``p.grad`` = None where it is an accumulator view (the sum stays accumulated);
        ``grad_views`` is left as it is."""
        for param, view in zip(self.params, self._accumulator_views):
            if param.grad is not None and _same_memory(param.grad, view):
                param.grad = None

    def holds_grad(self) -> bool:
        """Whether some ``p.grad`` holds a gradient not yet in the accumulator."""
        return any(
            p.grad is not None and not _same_memory(p.grad, view) for p, view in zip(self.params, self._accumulator_views)
        )

    def hand_over(self, keep_accumulating: bool) -> Tensor:
        """Give the accumulated gradients to a round; returns the buffer the round reads.

        With ``keep_accumulating`` (an acco estimate round) the accumulator keeps its
        contents, so the following commit round sees both rounds' gradients; otherwise it
        starts again from zero. Single-buffered, the round reads the accumulator itself.
        """
        self._rounds += 1
        if not self.double_buffered:
            if keep_accumulating:
                raise AssertionError("a single-buffered group cannot keep accumulating during a round")
            return self.grad_accumulator
        other = self.grad_handover if self.grad_handover is not None else torch.empty_like(self.grad_accumulator)
        if keep_accumulating:
            other.copy_(self.grad_accumulator)
            self.grad_handover = other
        else:
            self.grad_handover, self.grad_accumulator = self.grad_accumulator, other
            self.grad_accumulator.zero_()
            if self.grad_views:
                self.detach_grad_views()  # they point into the buffer the round now reads
                self._accumulator_views = self._views(self.grad_accumulator)
                self.attach_grad_views()
            else:
                self._accumulator_views = self._views(self.grad_accumulator)
        return self.grad_handover

    def initial_values(self) -> Tensor:
        """The live parameters as one padded flat buffer in the master dtype."""
        values = torch.zeros(self.plan.padded_numel, dtype=self.master_dtype, device=self.device)
        torch._foreach_copy_(self._views(values), [p.detach() for p in self.params])
        return values

    def set_initial_values(self, values: Tensor) -> None:
        """Start from ``values`` (broadcast from rank 0): master shard and live parameters,
        which take ``param_dtype`` here (the master keeps full precision)."""
        start, stop = self.plan.rank_range(self.rank)
        if not self.master_in_params:
            self._master.copy_(values[start:stop])
        with torch.no_grad():
            for param, value in zip(self.params, self._views(values)):
                if param.dtype == self.param_dtype:
                    param.copy_(value)
                else:
                    param.data = value.to(self.param_dtype)

    def gather_from_delta(self, rows: Tensor, scales: Tensor) -> None:
        """``gathered`` = the live parameters + every rank's dequantized delta (row ``r``:
        rank ``r``'s chunk). For the light estimate round, whose live parameters are the
        committed ones on every rank; one chunk-sized fp32 temporary at a time."""
        with torch.no_grad():
            torch._foreach_copy_(self._views(self.gathered), [p.detach() for p in self.params])
        chunks = self.gathered.view(self.plan.world_size, -1)
        for chunk, row, scale in zip(chunks, rows, scales):
            chunk.copy_(dequantize_row(row, scale).add_(chunk))

    def load_params_from_buffer(self) -> None:
        """Copy ``gathered`` into the live parameters: the only write to them.

        Single-buffered, ``gathered`` is the accumulator: it is zeroed here, for the next
        round's gradients.
        """
        with torch.no_grad():
            torch._foreach_copy_([p.data for p in self.params], self._views(self.gathered))
        if not self.double_buffered:
            self.grad_accumulator.zero_()

    def shard_views(self, shard: Tensor) -> list[Tensor]:
        """Views of a chunk-sized tensor as the base optimizer sees this rank's shard.

        ``flat``: the whole 1-D chunk. ``tensor``: each owned parameter in its own shape.
        """
        if self.plan.layout is Layout.FLAT:
            return [shard]
        start, _ = self.plan.rank_range(self.rank)
        slots = [self.plan.slots[i] for i in self.plan.owned(self.rank)]
        return [shard[s.offset - start : s.offset - start + s.numel].view(s.shape) for s in slots]

    def fingerprint(self) -> str:
        return f"{self.plan.layout.value}:{self.param_dtype}:{self.reduce_dtype}:" + ";".join(
            "x".join(map(str, s.shape)) for s in self.plan.slots
        )


class ShardCopy:
    """A copy of a master shard and its base optimizer's state, allocated once.

    An acco estimate round steps the base optimizer on a copy and then puts the real shard
    and state back: :meth:`save` copies them into tensors allocated at the first call and
    reused after, :meth:`restore` copies them back into the same tensors the optimizer
    holds (so nothing is allocated per round, and the state keeps its tensors). When the
    estimate runs on a workspace copy of the master shard (:meth:`ShardedGroup.shard_workspace`),
    pass ``master=None``: only the state is copied.
    """

    def __init__(self) -> None:
        self._master_copy: Tensor | None = None
        self._state_copy: dict[Tensor, dict[str, Any]] = {}

    def save(self, master: Tensor | None, state: dict[Tensor, dict[str, Any]]) -> None:
        if master is not None:
            if self._master_copy is None:
                self._master_copy = torch.empty_like(master)
            self._master_copy.copy_(master)
        saved: dict[Tensor, dict[str, Any]] = {}
        for param, values in state.items():
            previous = self._state_copy.get(param, {})
            saved[param] = {key: _copy_into(previous.get(key), value) for key, value in values.items()}
        self._state_copy = saved

    def restore(self, master: Tensor | None, state: dict[Tensor, dict[str, Any]]) -> None:
        if master is not None:
            if self._master_copy is None:
                raise AssertionError("ShardCopy.restore() of a master shard it never saved")
            master.copy_(self._master_copy)
        for param in list(state):
            if param not in self._state_copy:
                del state[param]  # created by the step being undone (the first estimate)
        for param, saved in self._state_copy.items():
            values = state.setdefault(param, {})
            for key in list(values):
                if key not in saved:
                    del values[key]
            for key, value in saved.items():
                current = values.get(key)
                if isinstance(value, Tensor) and isinstance(current, Tensor) and current.shape == value.shape:
                    current.copy_(value)
                else:
                    values[key] = value.clone() if isinstance(value, Tensor) else copy.deepcopy(value)

    def nbytes(self) -> int:
        total = 0 if self._master_copy is None else self._master_copy.nbytes
        return total + sum(v.nbytes for s in self._state_copy.values() for v in s.values() if isinstance(v, Tensor))


def _scale_for(grad: Tensor, weight: Tensor) -> Tensor:
    """A device weight in the dtype to scale ``grad`` by: at least fp32, so a bf16 gradient
    is not multiplied by a rounded weight."""
    return weight.to(torch.promote_types(grad.dtype, torch.float32))


def _same_memory(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` is ``b``'s memory (a gradient view of the accumulator)."""
    if a.is_sparse or a.numel() == 0:
        return False  # empty tensors may all share one null pointer
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype


def _copy_into(target: Any, value: Any) -> Any:
    """``value`` copied into ``target`` when it fits, else a fresh copy."""
    if isinstance(value, Tensor):
        if isinstance(target, Tensor) and target.shape == value.shape and target.dtype == value.dtype:
            return target.copy_(value)
        return value.clone()
    return copy.deepcopy(value)


class Collectives:
    """The collectives acco issues, on one process group (or none for a single process).

    All methods must be called by every rank of the group, in the same order.
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        if group is None:
            self.rank, self.world_size, self.backend = 0, 1, None
        else:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            self.backend = str(dist.get_backend(group))
        # The gloo reduce-scatter's first-piece receive buffer, per (size, dtype, device).
        self._scratch: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}

    @classmethod
    def from_user_group(cls, group: dist.ProcessGroup | None) -> Collectives:
        """The user's group, the default group, or none when torch.distributed is idle."""
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        return cls(group)

    def new_lane_group(self, timeout: datetime.timedelta) -> Collectives:
        """A private group over the same ranks, for the comm lane only.

        gloo aborts when two threads issue collectives on one group, and the user's code
        may run its own collectives while a round is in flight.
        """
        if self.group is None:
            return Collectives(None)
        ranks = dist.get_process_group_ranks(self.group)
        group = dist.new_group(ranks, timeout=timeout, backend=self.backend, use_local_synchronization=True)
        return Collectives(group)

    # Tests only: issue the collectives even in a group of one rank (e.g. to run NCCL from
    # the comm lane's thread on a machine with one GPU).
    communicate_alone: bool = False

    @property
    def active(self) -> bool:
        return self.group is not None and (self.world_size > 1 or self.communicate_alone)

    def broadcast_(self, tensor: Tensor, src: int = 0) -> None:
        if self.active:
            dist.broadcast(tensor, dist.get_global_rank(self.group, src), group=self.group)

    def all_reduce_sum_(self, tensor: Tensor) -> None:
        if self.active:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)

    def all_reduce_max_(self, tensor: Tensor) -> None:
        if self.active:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)

    def same_on_all_ranks(self, text: str) -> bool:
        """Whether every rank passed the same ``text`` (one small all-reduce)."""
        digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")
        t = torch.tensor([digest, -digest], dtype=torch.int64)
        if self.backend == "nccl":
            t = t.cuda()
        self.all_reduce_max_(t)
        return int(t[0]) == -int(t[1])

    def barrier(self) -> None:
        if self.active:
            dist.barrier(group=self.group)

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        """Every rank's ``data`` on rank 0 (None on the others)."""
        if not self.active:
            return [data]
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.group)
        longest = int(max(s.item() for s in sizes))
        payload = torch.zeros(longest, dtype=torch.uint8, device=device)
        payload[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        received = [torch.zeros_like(payload) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(payload, received, dst=dist.get_global_rank(self.group, 0), group=self.group)
        if received is None:
            return None
        return [bytes(r[: int(s.item())].cpu().tolist()) for r, s in zip(received, sizes)]

    def reduce_scatter_sum(self, output: Tensor, input: Tensor) -> None:
        """``output`` = this rank's chunk of the sum of ``input`` over ranks.

        ``output`` may be that chunk of ``input`` itself (in place). The other chunks of
        ``input`` are undefined afterwards (gloo receives into them once they are sent).
        """
        if not self.active:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input[: output.numel()])
            return
        if self._runs_on_gloo(input) and input.is_cuda:
            # gloo's send/recv take CPU tensors only; its all-to-all stages CUDA tensors
            # through the host (at the cost of a model-size receive buffer).
            received = self._scratch_like(input)
            dist.all_to_all_single(received, input, group=self.group)
            torch.sum(received.view(self.world_size, -1), dim=0, out=output)
            return
        if self._runs_on_gloo(input):
            self._reduce_scatter_pairwise(output, input)
            return
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=self.group)

    def _reduce_scatter_pairwise(self, output: Tensor, input: Tensor) -> None:
        # gloo's reduce_scatter moves as many bytes as an all-reduce. Instead, N - 1 steps:
        # at step k send chunk r + k to its owner and receive rank r - k's copy of chunk r,
        # piece by piece, adding each piece as it arrives. Each chunk crosses the network
        # once. Only the first piece needs a receive buffer of its own (1 MiB): every later
        # one lands in the part of the first step's chunk already sent, which nothing reads
        # any more, and may be as large as that part (pieces double, up to 16 MiB).
        rows = input.view(self.world_size, -1)
        own = rows[self.rank]
        if output.data_ptr() != own.data_ptr():
            output.copy_(own)
        chunk, itemsize = own.numel(), own.element_size()
        # A chunk of a few MiB goes in one piece (a chunk-sized buffer, small then): pieces
        # are round trips, and a small model's reduce-scatter is latency-bound.
        if chunk * itemsize <= _REDUCE_SCATTER_ONE_PIECE_BYTES:
            first = chunk
        else:
            first = max(1, _REDUCE_SCATTER_FIRST_PIECE_BYTES // itemsize)
        largest = max(first, _REDUCE_SCATTER_LARGEST_PIECE_BYTES // itemsize)
        scratch = self._scratch_like(own[:first])
        sent_of_first_step: Tensor | None = None  # the row whose sent prefix is free
        sent = 0
        for step in range(1, self.world_size):
            dst = (self.rank + step) % self.world_size
            src = (self.rank - step) % self.world_size
            start = 0
            while start < chunk:
                room = first if sent_of_first_step is None else min(largest, sent)
                stop = min(chunk, start + room)
                received = scratch[: stop - start] if sent_of_first_step is None else sent_of_first_step[: stop - start]
                works = [
                    dist.isend(rows[dst, start:stop], dist.get_global_rank(self.group, dst), group=self.group),
                    dist.irecv(received, dist.get_global_rank(self.group, src), group=self.group),
                ]
                for work in works:
                    work.wait()
                output[start:stop].add_(received)
                if step == 1:
                    sent_of_first_step, sent = rows[dst], stop
                start = stop

    def all_gather(self, output: Tensor, input: Tensor) -> None:
        """``output`` = the concatenation of every rank's ``input``, which may be this
        rank's chunk of ``output`` itself (in place)."""
        if not self.active:
            if output.data_ptr() != input.data_ptr():
                output[: input.numel()].copy_(input)
            return
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        all_gather(output, input, group=self.group)

    def reduce_scatter_quantized(self, output: Tensor, input: Tensor, dtype: torch.dtype) -> None:
        """As :meth:`reduce_scatter_sum`, the chunks travelling in ``dtype`` (one scale per
        chunk for float8) and summed in fp32 on arrival; for the light estimate round.

        An all-to-all of raw bytes: neither NCCL nor gloo reduces float8.
        """
        if not self.active:
            output.copy_(input[: output.numel()])  # nothing travels: nothing to make lighter
            return
        payload, scales = quantize_rows(input.view(self.world_size, -1), dtype)
        received = torch.empty_like(payload)
        dist.all_to_all_single(received.view(torch.uint8), payload.view(torch.uint8), group=self.group)
        received_scales = scales
        if needs_scale(dtype):
            received_scales = torch.empty_like(scales)
            dist.all_to_all_single(received_scales, scales, group=self.group)
        total = torch.zeros(output.shape, dtype=torch.float32, device=output.device)
        for row, scale in zip(received, received_scales):
            total.add_(dequantize_row(row, scale))
        output.copy_(total)

    def all_gather_quantized(self, input: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Every rank's ``input`` in ``dtype``: (payloads, one row per rank; fp32 scales).

        Dequantize row ``r`` with :func:`acco.quantize.dequantize_row` and scale ``r``.
        """
        if not self.active:
            return input.view(1, -1), torch.ones(1, dtype=torch.float32, device=input.device)
        payload, scales = quantize_rows(input.view(1, -1), dtype)
        rows = torch.empty((self.world_size, input.numel()), dtype=dtype, device=input.device)
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        all_gather(rows.view(torch.uint8).view(-1), payload.view(torch.uint8).view(-1), group=self.group)
        all_scales = torch.ones(self.world_size, dtype=torch.float32, device=input.device)
        if needs_scale(dtype):
            all_gather(all_scales, scales, group=self.group)
        return rows, all_scales

    def _runs_on_gloo(self, tensor: Tensor) -> bool:
        # A group made without a backend name serves CPU tensors with gloo ("cpu:gloo,cuda:nccl").
        backend = self.backend or ""
        return backend == "gloo" or (tensor.device.type == "cpu" and "cpu:gloo" in backend)

    def _scratch_like(self, tensor: Tensor) -> Tensor:
        key = (tensor.numel(), tensor.dtype, tensor.device)
        if key not in self._scratch:
            self._scratch[key] = torch.empty_like(tensor)
        return self._scratch[key]
