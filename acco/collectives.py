"""Every torch.distributed call acco makes, on one process group.

:class:`Collectives` is the only place that calls ``torch.distributed``, so torch's renames
(``reduce_scatter_tensor`` -> ``reduce_scatter_single``) and backend quirks (gloo's
reduce-scatter, gloo with CUDA tensors) are handled once. See docs/design.md, "Collectives".
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from acco.quantize import dequantize_row, needs_scale, quantize_rows

__all__ = ["Collectives", "ReconfigurableCollectives", "destroy_drained_groups"]

# The gloo groups drain() left to torch (finish()): destroyed at interpreter exit by
# destroy_drained_groups() if torch still holds them then (gone already if the user destroyed them).
_DRAINED: list[weakref.ref] = []


def destroy_drained_groups() -> None:
    """At interpreter exit (acco's exit hook), not collective: destroy the gloo groups that
    :meth:`Collectives.drain` left to torch and that are still alive, so their worker threads
    are joined while Python can still run them. A drained group's two worker threads each
    drop the last collective they ran only after its caller has returned; the drain's barrier
    completes once those collectives have, not once the threads have dropped them, and a
    thread that drops a tensor Python made while the interpreter finalises needs the GIL and
    aborts the process ("terminate called without an active exception"). Destroying a group
    joins its threads with the GIL released."""
    while _DRAINED:
        group = _DRAINED.pop()()
        if group is not None:
            with contextlib.suppress(ValueError, RuntimeError):  # destroyed already, or torch's world gone
                dist.destroy_process_group(group)

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
        self.released = False  # see release(): no collective may run afterwards
        # The gloo reduce-scatter's first-piece receive buffer, per (size, dtype, device).
        self._scratch: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}

    # The gloo reduce-scatter's pieces (instance-tunable, e.g. lowered in tests): chunks up
    # to one_piece_bytes go in one piece (latency); larger ones start with a first piece
    # (its only receive buffer) and double up to the largest.
    one_piece_bytes: int = 16 << 20
    first_piece_bytes: int = 1 << 20
    largest_piece_bytes: int = 16 << 20

    @property
    def scratch_numel(self) -> int:
        """Elements of receive buffer the collectives hold (the gloo reduce-scatter's)."""
        return sum(t.numel() for t in self._scratch.values())

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

    def new_group(self, ranks: list[int], timeout: datetime.timedelta) -> Collectives:
        """A private group over ``ranks`` (global ranks; this rank among them), for the comm
        lane's sums over a whole mesh. Every rank in ``ranks`` must call it."""
        if not (dist.is_available() and dist.is_initialized()) or len(ranks) <= 1:
            return Collectives(None)
        group = dist.new_group(ranks, timeout=timeout, backend=self.backend, use_local_synchronization=True)
        return Collectives(group)

    def drain(self) -> None:
        """Collective: return once this group's worker threads hold no finished collective.

        Why it matters at exit: a gloo group's worker thread frees a finished collective's
        tensors after the caller has returned, and freeing a tensor Python made takes the
        GIL. A thread that waits for the GIL until the interpreter is finalising is ended by
        Python mid-C++ frame, and the process aborts ("terminate called without an active
        exception") after a clean run. Queueing a barrier waits for the collectives before it
        (with the GIL released), and a barrier holds no tensor; but a worker thread may still
        be dropping the last of them when it returns, so the group is also destroyed at exit
        (:func:`destroy_drained_groups`), joining its threads while Python runs. gloo only:
        that is where it was seen and tested; another backend's teardown is left as torch does it.
        """
        if self.active and self.backend == "gloo":
            dist.barrier(group=self.group)
            _DRAINED.append(weakref.ref(self.group))

    def destroy(self) -> None:
        """At interpreter exit, not collective: destroy a gloo group :meth:`new_lane_group` or
        :meth:`new_group` made (its threads are joined, the GIL released meanwhile: see
        :meth:`drain` for why), then :meth:`release`. A group on another backend is only
        released: NCCL's teardown waits for the peers. Safe after the user's
        ``destroy_process_group()``.

        Only at exit: torch names a group made with ``use_local_synchronization`` by its ranks
        and the number of groups alive, so a group made after this one is destroyed can get its
        name, and its rendezvous then reads this group's stale addresses from the store.
        """
        group = self.group
        self.release()
        if group is None or self.backend != "gloo":
            return
        with contextlib.suppress(ValueError):  # "Invalid process group": destroyed already
            dist.destroy_process_group(group)
        # The last reference goes with this frame.

    def release(self) -> None:
        """Drop this object's reference to its group, so that torch frees it when the user
        destroys it; every collective raises ``RuntimeError`` afterwards."""
        self.group = None
        self.released = True

    def group_ranks(self) -> list[int]:
        """The global ranks of this group ([this rank] without one)."""
        if self.group is None:
            return [self.global_rank()]
        return list(dist.get_process_group_ranks(self.group))

    @staticmethod
    def global_rank() -> int:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (the same length on every rank), in group rank order."""
        if not self.active:
            return [list(values)]
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        mine = torch.tensor(values, dtype=torch.int64, device=device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine, group=self.group)
        return [t.tolist() for t in every]

    # Tests only: issue the collectives even in a group of one rank (e.g. to run NCCL from
    # the comm lane's thread on a machine with one GPU).
    communicate_alone: bool = False

    @property
    def active(self) -> bool:
        if self.released:
            raise RuntimeError("a collective after the optimizer gave its process groups back (finish() or close())")
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

    def gather_objects(self, value: Any, dst: int) -> list[Any] | None:
        """Every rank's ``value`` (picklable) on group rank ``dst``, in group rank order
        (None on the others)."""
        if not self.active:
            return [value]
        every: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(value, every, dst=dist.get_global_rank(self.group, dst), group=self.group)
        return every

    def reduce_sum_(self, tensor: Tensor, dst: int) -> None:
        """``tensor`` on group rank ``dst`` = the sum over ranks; undefined on the others."""
        if self.active:
            dist.reduce(tensor, dist.get_global_rank(self.group, dst), op=dist.ReduceOp.SUM, group=self.group)

    def all_gather_objects(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable: tensors and plain values), in group rank order."""
        if not self.active:
            return [value]
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, value, group=self.group)
        return every

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
        if chunk * itemsize <= self.one_piece_bytes:
            first = chunk
        else:
            first = max(1, self.first_piece_bytes // itemsize)
        largest = max(first, self.largest_piece_bytes // itemsize)
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

    def all_to_all(self, output: Tensor, input: Tensor) -> None:
        """Row ``r`` of ``input`` (2-D, one row per rank) to rank ``r``; row ``r`` of
        ``output`` from rank ``r``. Raw bytes travel (any dtype, uint8 included)."""
        if not self.active:
            output.copy_(input)
            return
        dist.all_to_all_single(output, input, group=self.group)

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


class ReconfigurableCollectives:
    """The collectives of an outer round over torchft's reconfigurable process group
    (:mod:`acco.elastic`): the group's own methods, as torchft's groups present themselves to
    c10d as one-rank groups, with this replica's rank and the number of replicas taken from
    the round's quorum. gloo has no reduce-scatter there: the rounds use all-to-all and
    all-gather. Every wait is bounded by ``timeout`` (a dead peer's socket fails at once; a
    hung one after the group's own timeout).

    Args:
        group: a ``torchft.process_group.ProcessGroup`` configured for this quorum.
        rank / world_size: this replica's place among the quorum's participants, and their number.
        timeout: the most a collective waits.
    """

    def __init__(self, group: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
        self.group, self.rank, self.world_size, self._timeout = group, rank, world_size, timeout

    def all_reduce_sum_(self, tensor: Tensor) -> None:
        if self.world_size > 1:
            self.group.allreduce([tensor], dist.ReduceOp.SUM).wait(self._timeout)

    def all_gather(self, output: Tensor, input: Tensor) -> None:
        """``output`` = every replica's ``input``, concatenated in rank order."""
        if self.world_size == 1:
            output[: input.numel()].copy_(input)
            return
        from torch.distributed.distributed_c10d import AllgatherOptions

        self.group.allgather_into_tensor_coalesced([output], [input], AllgatherOptions()).wait(self._timeout)

    def all_to_all(self, output: Tensor, input: Tensor) -> None:
        """Row ``r`` of ``input`` to replica ``r``; row ``r`` of ``output`` from replica ``r``."""
        if self.world_size == 1:
            output.copy_(input)
            return
        from torch.distributed.distributed_c10d import AllToAllOptions

        self.group.alltoall_base(output, input, [], [], AllToAllOptions()).wait(self._timeout)
