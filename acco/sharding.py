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

import datetime
import enum
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from acco.quantize import dequantize_row, needs_scale, quantize_rows

__all__ = [
    "Collectives",
    "Layout",
    "ShardPlan",
    "ShardedGroup",
    "Slot",
    "plan_flat",
    "plan_tensor",
    "plan_layout",
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


class ShardedGroup:
    """One param group's live parameters, flat buffers and this rank's master shard.

    Buffers (all ``plan.padded_numel`` long unless said otherwise):

    - ``grad_accumulator``: where the compute lane folds ``p.grad`` (``weight * grad``);
    - ``grad_handover``: the gradients a round in flight is reducing; the compute lane
      never writes it while the round runs;
    - ``gathered``: the comm lane's all-gather target, copied into the live parameters
      only at a round boundary;
    - ``master`` (``plan.chunk`` long, fp32): this rank's shard of the parameters;
      ``master_views`` are the tensors the base optimizer sees, ``master_grad`` their
      gradients;
    - ``grad_shard`` (chunk): this rank's reduce-scatter result; ``gather_input`` (chunk):
      the updated shard in the parameters' dtype, the all-gather's input.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        plan: ShardPlan,
        rank: int,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
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
        n, chunk = plan.padded_numel, plan.chunk
        self.grad_accumulator = torch.zeros(n, dtype=self.reduce_dtype, device=self.device)
        self.grad_handover = torch.zeros(n, dtype=self.reduce_dtype, device=self.device)
        self.gathered = torch.zeros(n, dtype=self.param_dtype, device=self.device)
        self.master = torch.zeros(chunk, dtype=self.master_dtype, device=self.device)
        self.grad_shard = torch.zeros(chunk, dtype=self.reduce_dtype, device=self.device)
        self.master_grad = torch.zeros(chunk, dtype=self.master_dtype, device=self.device)
        self.gather_input = torch.zeros(chunk, dtype=self.param_dtype, device=self.device)
        self.master_views = self.shard_views(self.master)
        self._accumulator_views = self._views(self.grad_accumulator)
        self._gathered_views = self._views(self.gathered)

    def _views(self, buffer: Tensor) -> list[Tensor]:
        return [buffer[s.offset : s.offset + s.numel].view(s.shape) for s in self.plan.slots]

    def accumulate_grads(self, weight: float | Tensor) -> bool:
        """Add ``weight * p.grad`` into the accumulator and drop ``p.grad``.

        ``weight`` is a number, or a 0-dim tensor on the gradients' device (never read on
        the host). Returns whether any parameter had a gradient.
        """
        targets, grads = [], []
        for param, view in zip(self.params, self._accumulator_views):
            if param.grad is None:
                continue  # unused in this micro-batch: contributes zero
            if param.grad.is_sparse:
                raise TypeError("acco does not support sparse gradients")
            targets.append(view)
            grads.append(param.grad)
            param.grad = None
        if targets and isinstance(weight, Tensor):
            # p.grad is consumed anyway: scale it in place, in fp32 at least.
            torch._foreach_mul_(grads, weight.to(torch.promote_types(grads[0].dtype, torch.float32)))
            torch._foreach_add_(targets, grads)
        elif targets:
            torch._foreach_add_(targets, grads, alpha=weight)
        return bool(targets)

    def hand_over(self, keep_accumulating: bool) -> Tensor:
        """Give the accumulated gradients to a round; returns the buffer the round reads.

        With ``keep_accumulating`` (an acco estimate round) the accumulator keeps its
        contents, so the following commit round sees both rounds' gradients; otherwise it
        starts again from zero.
        """
        if keep_accumulating:
            self.grad_handover.copy_(self.grad_accumulator)
        else:
            self.grad_handover, self.grad_accumulator = self.grad_accumulator, self.grad_handover
            self.grad_accumulator.zero_()
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
        self.master.copy_(values[start:stop])
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
        """Copy ``gathered`` into the live parameters: the only write to them."""
        with torch.no_grad():
            torch._foreach_copy_([p.data for p in self.params], self._gathered_views)

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
        """``output`` = this rank's chunk of the sum of ``input`` over ranks."""
        if not self.active:
            output.copy_(input[: output.numel()])
            return
        if self._runs_on_gloo(input):
            # gloo's reduce_scatter moves as many bytes as an all-reduce; an all-to-all
            # moves each chunk once and the sum is done locally.
            received = self._scratch_like(input)
            dist.all_to_all_single(received, input, group=self.group)
            torch.sum(received.view(self.world_size, -1), dim=0, out=output)
            return
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=self.group)

    def all_gather(self, output: Tensor, input: Tensor) -> None:
        """``output`` = the concatenation of every rank's ``input``."""
        if not self.active:
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
