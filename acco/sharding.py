"""Sharding: how a param group's parameters are cut into shards, and the buffers that hold them.

Layouts and shard plans. A param group's parameters live in one padded flat buffer of
``world_size * chunk`` elements; rank ``r`` owns ``[r * chunk, (r + 1) * chunk)``. The
*layout* decides where each parameter sits in that buffer (docs/design.md, "Shards and
layouts"):

- ``flat``: parameters back to back, the buffer cut into equal chunks whatever the tensor
  boundaries (perfect balance; exact for element-wise optimizers).
- ``tensor``: every tensor whole inside one rank's chunk, tensors spread greedily
  (largest first, onto the least loaded rank), each chunk padded to the largest load so
  reduce-scatter and all-gather stay single calls.

The sharded buffers. :class:`ShardedGroup` holds one param group's flat buffers (the
accumulator, the hand-over buffer, the gathered result) and this rank's master shard;
:class:`ShardCopy` the estimate round's copy of the shard and its optimizer state
(:mod:`acco.startup` builds them from the options). docs/design.md, "Buffers and memory", has the formula
:meth:`ShardedGroup.buffer_bytes` reports against.
"""

from __future__ import annotations

import copy
import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from acco.mesh import InnerMesh, MeshParam, local_tensor
from acco.quantize import dequantize_row

__all__ = [
    "Layout",
    "ShardCopy",
    "ShardPlan",
    "ShardedGroup",
    "Slot",
    "plan_flat",
    "plan_layout",
    "plan_tensor",
    "squared_norm",
]


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


# Elements per piece of a norm: each piece's norm is taken in (at least) float32 by one
# fused kernel over all pieces, and the pieces' squares summed in float64. A single float32
# norm over a model-size shard drifts (1e-3 relative at 19M elements on CPU, whose
# vectorised lanes each add up a long run); one in float64 converts every element first, ten
# times the cost. Pieces of 64Ki stay within about 1e-5 of the float64 norm (torch's
# clip_grad_norm_, one float32 norm per tensor, drifts more on large tensors) in one pass.
NORM_PIECE = 1 << 16
MAX_NORM_PIECES = 1024  # larger pieces past 64M elements: the host's work per norm stays bounded


def squared_norm(values: Tensor) -> Tensor:
    """The squared 2-norm of ``values`` (1-D), a 0-dim float64 tensor on its device: one pass,
    in pieces (``NORM_PIECE``) whose float32 norms add up in float64; no host synchronisation."""
    if values.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=values.device)
    dtype = torch.float64 if values.dtype == torch.float64 else torch.float32
    piece = max(NORM_PIECE, -(-values.numel() // MAX_NORM_PIECES))
    norms = torch._foreach_norm(list(values.split(piece)), 2, dtype=dtype)
    return torch.stack(norms).double().square().sum()


# ------------------------------------------------------------- the sharded buffers


class ShardedGroup:
    """One param group's live parameters, flat buffers and this rank's master shard.

    Model-size buffers (``plan.padded_numel`` elements):

    - ``grad_accumulator`` (``reduce_dtype``): where the compute lane folds gradients
      (``weight * grad``; :class:`acco.folding.GradFolder` does, through
      :meth:`accumulator_views`);
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
    ``master_grad`` and ``gathered`` (= ``gather_input``) are separate buffers; but a group
    that keeps no master (``master=False``: an elastic replica's, whose outer round reads its
    hand-over only before it writes the new global values) gathers into its round buffer.

    ``master`` (``plan.chunk`` long, fp32, fp64 for fp64 parameters) is this rank's shard
    of the parameters; ``master_views`` are the tensors the base optimizer sees. With
    ``master_in_params`` (sync and dpu, whose live parameters hold the committed values at
    every round boundary) and every dtype the master dtype, it is not kept at all: each
    round copies it from the live parameters into a chunk of the round's buffer already
    sent (:meth:`shard_workspace`) and steps it there; :meth:`prepare_master` does that
    once per round, on the comm lane. With ``gather_into_params`` (sync, whose step() waits for
    the round) and the parameters in the master dtype, the parameters themselves become views
    of one flat buffer laid out like the round's (:attr:`gathers_into_params`): it is
    ``gathered``, its chunk ``r`` the master shard, stepped in place and all-gathered in place,
    so a landed round copies nothing.

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
        master: bool = True,
        inner: InnerMesh | None = None,
        gather_into_params: bool = False,
    ) -> None:
        self.params = list(params)
        # DTensor parameters (docs/design.md, "Meshes"): everything below works on their
        # local tensors; mesh_params read their gradients, norm_weights count them in the norm.
        self.mesh_params: list[MeshParam | None] = [
            None if inner is None else inner.mesh_param(p) for p in self.params
        ]
        self.norm_weights = None if inner is None else inner.norm_weights(self.params)
        first = local_tensor(params[0])
        self.plan = plan
        self.rank = rank
        self.device = first.device
        self.param_dtype = param_dtype or first.dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        # The master shard and the optimizer state are never below fp32.
        self.master_dtype = torch.float64 if first.dtype == torch.float64 else torch.float32
        # With several ranks the collectives run in place in the round's buffer. One rank
        # has nothing to communicate, and its round buffer must keep the gradient sum (so
        # the round's result goes elsewhere).
        self.multi_rank = plan.world_size > 1
        self.double_buffered = double_buffered or not self.multi_rank
        n, chunk = plan.padded_numel, plan.chunk
        self.grad_accumulator = torch.zeros(n, dtype=self.reduce_dtype, device=self.device)
        self.grad_handover: Tensor | None = None if self.double_buffered else self.grad_accumulator
        # The live parameters hold the committed values at every round boundary in sync and
        # dpu. When they are in the master dtype (and every buffer too), the master shard is
        # not kept: each round copies it from the live parameters into a chunk of its own
        # buffer that was already sent (prepare_master), and the base optimizer steps it there.
        self.master_in_params = (
            master_in_params
            and self.multi_rank
            and self.param_dtype == self.reduce_dtype == self.master_dtype == first.dtype
        )
        # Sync mode with parameters in the master dtype: the parameters become views of one flat
        # buffer laid out like the round's, which is the all-gather's target and whose chunk r is
        # the master shard, stepped in place (nothing reads the parameters while a sync round runs).
        self._param_buffer: Tensor | None = None
        if gather_into_params and master and inner is None and self.param_dtype == first.dtype == self.master_dtype:
            self._param_buffer = self.flat_params()
            self.master_in_params = False
        self.keeps_master = master
        if not master:  # the update on the shards keeps its state elsewhere (an elastic round's)
            self._master = torch.empty(0, dtype=self.master_dtype, device=self.device)
            placeholder = self._master
        elif self._param_buffer is not None:
            start, stop = plan.rank_range(rank) if self.multi_rank else (0, n)
            self._master = self._param_buffer[start:stop]
            placeholder = self._master
            self._param_views = self._views(self._param_buffer)
            self._seat_params()
        elif self.master_in_params:
            self._master = torch.empty(0, dtype=self.master_dtype, device=self.device)
            placeholder = self.grad_accumulator[:chunk]  # no storage of its own; moved each round
        else:
            self._master = torch.zeros(chunk, dtype=self.master_dtype, device=self.device)
            placeholder = self._master
        self._master_grad: Tensor | None = None
        if master and not (self.multi_rank and self.reduce_dtype == self.master_dtype):
            self._master_grad = torch.zeros(chunk, dtype=self.master_dtype, device=self.device)
        self._gathered: Tensor | None = self._param_buffer
        if self._gathered is None and (
            (not self.multi_rank and master) or self.param_dtype.itemsize > self.reduce_dtype.itemsize
        ):
            self._gathered = torch.zeros(n, dtype=self.param_dtype, device=self.device)
        # Views of master (distinct tensors, also in the flat layout) that the base optimizer
        # is built on; point_master_views() may move them to a workspace for one update.
        self.master_views = [view.view(view.shape) for view in self.shard_views(placeholder)] if master else []
        self._accumulator_views = self._views(self.grad_accumulator)
        # The estimate round's copy of the master shard and optimizer state (acco mode),
        # allocated at the first estimate and reused by every later one.
        self._estimate_copy: ShardCopy | None = None
        self._live_aside: list[Tensor] | None = None  # eval()'s copy of the live parameters

    @property
    def gathers_into_params(self) -> bool:
        """The parameters are views of the all-gather's target: a landed round needs no copy."""
        return self._param_buffer is not None

    def _seat_params(self) -> None:
        """Make every parameter a view of its slot of the parameter buffer, keeping its values
        (at construction, and again for a parameter whose ``.data`` the user replaced)."""
        with torch.no_grad():
            for param, view in zip(self.params, self._param_views):
                if param.data_ptr() != view.data_ptr() or param.stride() != view.stride():
                    view.copy_(param.detach())
                    param.data = view

    @property
    def has_dtensors(self) -> bool:
        return any(m is not None for m in self.mesh_params)

    def locals(self) -> list[Tensor]:
        """The tensors acco reads and writes: the parameters, or their local tensors
        (looked up each time: FSDP2 may re-create them, e.g. in a model's load_state_dict)."""
        return [local_tensor(p) for p in self.params]

    def squared_norm(self, shard: Tensor) -> Tensor:
        """The squared 2-norm of this rank's chunk ``shard`` of a gradient, a 0-dim float64
        tensor on its device (nothing read on the host), a parameter replicated over an inner
        dimension weighted by one over its copies."""
        total = squared_norm(shard)
        if self.norm_weights is None:
            return total
        start, _ = self.plan.rank_range(self.rank)
        for index, offset, length in self._chunk_pieces():
            weight = self.norm_weights[index]
            if weight != 1.0:
                total = total - (1.0 - weight) * squared_norm(shard[offset - start : offset - start + length])
        return total

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
        if not self.multi_rank:
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
        if not self.multi_rank:
            return self.gathered
        start, stop = self.plan.rank_range(self.rank)
        return self.gathered[start:stop]

    @property
    def master(self) -> Tensor:
        """This rank's master shard (``plan.chunk`` long, master dtype). With
        ``master_in_params`` it is valid only between :meth:`prepare_master` and the end of
        the round's update."""
        return self._master

    def prepare_master(self) -> Tensor:
        """The committed master shard for this round's update; call once per round, on the
        comm lane, after the reduce-scatter.

        With ``master_in_params`` this copies this rank's chunk of the live parameters (the
        committed values) into a chunk of the round's buffer that was already sent, and
        points the base optimizer's parameters there; the all-gather then carries the result.
        """
        if self.master_in_params:
            workspace = self.shard_workspace()
            if workspace is None:
                raise AssertionError("master_in_params without a free chunk in the round's buffer")
            with torch.no_grad():
                self._master.set_(workspace)
                self._params_to_shard(self._master)
            self.point_master_views(self._master)
        return self._master

    def write_result(self, shard: Tensor) -> None:
        """Put this rank's updated ``shard`` into ``gather_input`` for the all-gather (nothing
        to copy where the update ran there: the master shard inside the parameter buffer)."""
        target = self.gather_input
        if target.data_ptr() == shard.data_ptr() and target.dtype == shard.dtype and target.shape == shard.shape:
            return
        target.copy_(shard)

    def shard_copy(self) -> ShardCopy:
        """The estimate round's copy of the master shard and optimizer state (allocated at
        the first estimate, reused by every later one)."""
        if self._estimate_copy is None:
            self._estimate_copy = ShardCopy()
        return self._estimate_copy

    def master_values(self, result_pending: bool) -> Tensor:
        """A copy of the committed master shard at a round boundary (``result_pending``: a
        finished round has not been loaded yet; its result is the committed values)."""
        if not self.master_in_params:
            return self._master.clone()
        if result_pending:
            return self.gather_input.clone()
        shard = torch.empty(self.plan.chunk, dtype=self.master_dtype, device=self.device)
        self._params_to_shard(shard)
        return shard

    def load_master_values(self, values: Tensor, result_pending: bool) -> None:
        """Restore the committed master shard (``result_pending``: a replayed round brings it;
        a group that keeps none has its loop restore what stands for it)."""
        if not self.keeps_master:
            return
        if not self.master_in_params:
            self._master.copy_(values)
        elif not result_pending:
            # The master shard is the live parameters' chunk: write it there (the same
            # values when the model's state was restored too).
            start, _ = self.plan.rank_range(self.rank)
            with torch.no_grad():
                for index, offset, length in self._chunk_pieces():
                    self.locals()[index].view(-1)[offset - self.plan.slots[index].offset :][:length].copy_(
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
        values = self.locals()
        shard.zero_()  # padding
        pieces = self._chunk_pieces()
        if pieces:
            torch._foreach_copy_(
                [shard[offset - start : offset - start + length] for _, offset, length in pieces],
                [
                    values[index].detach().reshape(-1)[offset - self.plan.slots[index].offset :][:length]
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
        if not self.multi_rank or self.reduce_dtype != self.master_dtype:
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
            "gathered": 0 if self._gathered is None or self.gathers_into_params else self._gathered.nbytes,
            "master": 0 if self.master_in_params or self.gathers_into_params else self._master.nbytes,
            "master_grad": 0 if self._master_grad is None else self._master_grad.nbytes,
        }
        sizes["estimate_copy"] = 0 if self._estimate_copy is None else self._estimate_copy.nbytes()
        return sizes

    def accumulator_views(self) -> list[Tensor]:
        """Each parameter's slot of the accumulator, in its shape (new after a hand-over
        that swapped the buffers)."""
        return self._accumulator_views

    def hand_over(self, keep_accumulating: bool) -> Tensor:
        """Give the accumulated gradients to a round; returns the buffer the round reads.

        With ``keep_accumulating`` (an acco estimate round) the accumulator keeps its
        contents, so the following commit round sees both rounds' gradients; otherwise it
        starts again from zero. Single-buffered, the round reads the accumulator itself.
        Gradient views into the accumulator must be released first and re-taken from
        :meth:`accumulator_views` after (:meth:`acco.folding.GradFolder.views_released`).
        """
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
            self._accumulator_views = self._views(self.grad_accumulator)
        return self.grad_handover

    def hand_over_params(self) -> Tensor:
        """Copy the live parameters into the round's buffer and return it (an outer round of
        ``mode="local"``: the replicas' parameters are what it reduces)."""
        buffer = self.round_buffer()
        with torch.no_grad():
            torch._foreach_copy_(self._views(buffer), [p.detach() for p in self.locals()])
        return buffer

    def add_params_from_buffer(self, handed_over: Tensor) -> None:
        """live parameters += ``gathered`` - ``handed_over`` (the parameters an outer round was
        handed, flat like the round's buffer): the progress made since stays on top of the new
        global values. ``handed_over`` is overwritten."""
        handed_over.sub_(self.gathered)
        with torch.no_grad():
            torch._foreach_sub_([p.detach() for p in self.locals()], self._views(handed_over))

    def initial_values(self) -> Tensor:
        """The live parameters as one padded flat buffer in the master dtype."""
        return self.flat_params(self.master_dtype)

    def set_initial_values(self, values: Tensor) -> None:
        """Start from ``values`` (broadcast from rank 0): master shard and live parameters,
        which take ``param_dtype`` here (the master keeps full precision)."""
        start, stop = self.plan.rank_range(self.rank)
        if self.keeps_master and not self.master_in_params:
            self._master.copy_(values[start:stop])
        with torch.no_grad():
            for index, (param, value) in enumerate(zip(self.locals(), self._views(values))):
                if param.dtype == self.param_dtype:
                    param.copy_(value)
                else:  # plain parameters only: options refuse a param_dtype for DTensors
                    self.params[index].data = value.to(self.param_dtype)

    def gather_from_delta(self, rows: Tensor, scales: Tensor) -> None:
        """``gathered`` = the live parameters + every rank's dequantized delta (row ``r``:
        rank ``r``'s chunk). For the light estimate round, whose live parameters are the
        committed ones on every rank; one chunk-sized fp32 temporary at a time."""
        with torch.no_grad():
            torch._foreach_copy_(self._views(self.gathered), [p.detach() for p in self.locals()])
        chunks = self.gathered.view(self.plan.world_size, -1)
        for chunk, row, scale in zip(chunks, rows, scales):
            chunk.copy_(dequantize_row(row, scale).add_(chunk))

    def flat_params(self, dtype: torch.dtype | None = None) -> Tensor:
        """A new tensor of the live parameters, flat and padded like the round's buffer, in
        ``dtype`` (default ``param_dtype``)."""
        values = torch.zeros(self.plan.padded_numel, dtype=dtype or self.param_dtype, device=self.device)
        torch._foreach_copy_(self._views(values), [p.detach() for p in self.locals()])
        return values

    def views(self, flat: Tensor) -> list[Tensor]:
        """Each parameter's slot of a flat buffer laid out like the round's, in its (local) shape."""
        return self._views(flat)

    def load_params(self, flat: Tensor) -> None:
        """Copy a flat buffer laid out like the round's into the live parameters (in place:
        a DTensor's local tensor)."""
        if flat is self._param_buffer:  # the parameters are its views already
            return
        with torch.no_grad():
            torch._foreach_copy_([p.detach() for p in self.locals()], self._views(flat))

    def live_values(self) -> list[Tensor]:
        """Copies of the live parameters, or of those :meth:`set_live_aside` kept while the
        model holds others (``eval()``)."""
        if self._live_aside is not None:
            return [value.clone() for value in self._live_aside]
        return [p.detach().clone() for p in self.locals()]

    def set_live_aside(self) -> None:
        """Keep a copy of the live parameters (``eval()``, before loading the committed ones)."""
        self._live_aside = [p.detach().clone() for p in self.locals()]

    def take_live_back(self, restore: bool) -> None:
        """Drop the copy :meth:`set_live_aside` kept, first writing it back with ``restore``."""
        aside, self._live_aside = self._live_aside, None
        if restore and aside is not None:
            with torch.no_grad():
                torch._foreach_copy_([p.detach() for p in self.locals()], aside)

    def load_params_from_buffer(self) -> None:
        """Copy ``gathered`` into the live parameters: the only write to them.

        Single-buffered, ``gathered`` is the accumulator: it is zeroed here, for the next
        round's gradients. DTensor parameters are written in place in their local tensors,
        which FSDP2's next all-gather reads.
        """
        self.load_params(self.gathered)
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

    def check_params_unchanged(self, number: int) -> None:
        """RuntimeError when a parameter's shape or dtype changed since construction; a
        parameter whose ``.data`` was replaced (same shape and dtype) is seated again in the
        parameter buffer, its new values kept."""
        for index, (param, slot) in enumerate(zip(self.locals(), self.plan.slots)):
            if param.shape != slot.shape or param.dtype != self.param_dtype:
                raise RuntimeError(
                    f"parameter {index} of group {number} changed to {tuple(param.shape)} {param.dtype} after "
                    f"construction (was {tuple(slot.shape)} {self.param_dtype}): build a new AccoOptimizer"
                )
        if self._param_buffer is not None:
            self._seat_params()

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

    def state_tensors(self) -> list[Tensor]:
        """The tensors holding the copy of the optimizer state (the same ones every round)."""
        return [v for s in self._state_copy.values() for v in s.values() if isinstance(v, Tensor)]

    def nbytes(self) -> int:
        total = 0 if self._master_copy is None else self._master_copy.nbytes
        return total + sum(v.nbytes for s in self._state_copy.values() for v in s.values() if isinstance(v, Tensor))


def _copy_into(target: Any, value: Any) -> Any:
    """``value`` copied into ``target`` when it fits, else a fresh copy."""
    if isinstance(value, Tensor):
        if isinstance(target, Tensor) and target.shape == value.shape and target.dtype == value.dtype:
            return target.copy_(value)
        return value.clone()
    return copy.deepcopy(value)
