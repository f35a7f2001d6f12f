"""An outer round's two legs: the reduce of the replicas' pseudo-gradients to each chunk's owner,
and the gather of the new global values, read by the one outer round
(:class:`acco.outer_round.OuterRunner`) whoever takes part. :class:`QuantizedLegs` below 32 bits
(``outer_bits``; docs/design.md, "Lighter outer rounds"), :class:`PlainLegs` at 32 (a fixed
group's reduce-scatter and all-gather of the parameters themselves)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from acco.collectives import Collectives
from acco.quantize import BlockCodec, RowBlocks, TopKCodec
from acco.sharding import ShardedGroup

__all__ = ["PlainLegs", "QuantizedLegs"]


class QuantizedLegs:
    """An outer round's two legs below 32 bits (``outer_bits``; docs/design.md, "Lighter
    outer rounds") or sparse (``outer_topk``, "Sparse outer rounds"). Differences travel,
    never raw parameters, each encoded per block by a :class:`~acco.quantize.BlockCodec` or
    a :class:`~acco.quantize.TopKCodec`:

    - reduce: each rank's pseudo-gradient, the global values it holds minus its parameters
      (plus its residual: what quantising the previous ones dropped), one encoded row per
      destination chunk in one all-to-all; each owner decodes the rows of its chunk and sums
      them in fp32;
    - gather: each owner's new master shard minus the copy of it every rank holds, encoded
      and all-gathered; every rank adds the decoded rows to its copy.

    So the copies (``global_values``) are identical on every rank, and each round's gather
    carries what the last one did not deliver along (its rounding, or the values a sparse
    round left out: the gather leg's error feedback is the master's lead over the copies): they stay within one quantisation step of
    the master shards, which keep full precision, as the outer optimizer's state does.

    Args:
        codec: the encoding of both legs.
        global_values: per param group, the copy of the global values this rank holds (read
            here; the loop writes it at a landing).
        residuals: per param group, this rank's residual (fp32, flat like the round's
            buffer), or None: no error feedback.
    """

    def __init__(self, codec: BlockCodec | TopKCodec, global_values: Sequence[Tensor], residuals: Sequence[Tensor] | None) -> None:
        self._codec = codec
        self._global_values = global_values
        self._residuals = residuals
        self._rows: dict[int, list[RowBlocks]] = {}  # per param group: each rank's row

    def reduce(self, comm: Collectives, group: ShardedGroup, number: int, params: Tensor,
               factors: Sequence[float] | None, out: Tensor) -> int:
        """``out`` = the mean over ranks of the decoded pseudo-gradients of this rank's chunk
        (summed in fp32 in rank order), each times its replica's factor (``factors``; None:
        once each); returns the bytes this rank sent (one row per rank, its own included). The
        residual stays in unweighted units: what was sent is weighed only once decoded."""
        codec, rows, plan = self._codec, self._rows_of(group, number), group.plan
        copies = self._global_values[number].view(plan.world_size, plan.chunk)
        handed = params.view(plan.world_size, plan.chunk)
        residuals = None if self._residuals is None else self._residuals[number].view(plan.world_size, plan.chunk)
        # One destination's chunk at a time, in fp32: no model-size temporary.
        scratch = None if residuals is not None else torch.empty(plan.chunk, dtype=torch.float32, device=params.device)
        encoded = self._empty_rows(rows, params.device)
        for destination, (blocks, target) in enumerate(zip(rows, encoded)):
            payload = scratch if residuals is None else residuals[destination]
            if residuals is None:
                payload.copy_(copies[destination])
            else:
                payload.add_(copies[destination])
            payload.sub_(handed[destination])
            sent = codec.encode(payload, blocks)
            target[: sent.numel()].copy_(sent)
            if residuals is not None:  # what was sent leaves the residual
                payload.sub_(codec.decode(sent, blocks))
        received = torch.empty_like(encoded)
        comm.all_to_all(received, encoded)
        own = rows[group.rank]
        total = torch.zeros(group.plan.chunk, dtype=torch.float32, device=params.device)
        for source, row in enumerate(received):
            if factors is None:
                total.add_(codec.decode(row, own))
            elif factors[source]:
                total.add_(codec.decode(row, own), alpha=factors[source])
        torch.div(total, float(plan.world_size), out=out)
        return encoded.nbytes

    def copies(self, number: int) -> Tensor:
        """The copy of the global values this rank holds for param group ``number``."""
        return self._global_values[number]

    def gather(self, comm: Collectives, group: ShardedGroup, number: int, master: Tensor, values: Tensor,
               out: Tensor) -> int:
        """Every rank's ``out`` = ``values`` (its copy of what the owners hold in ``master``)
        + every owner's decoded update of it (``out`` may be ``values``: updated in place);
        returns the bytes received."""
        codec, plan, rows = self._codec, group.plan, self._rows_of(group, number)
        start, stop = plan.rank_range(group.rank)
        sent = codec.encode(master.float().sub(values[start:stop]), rows[group.rank])
        received = self._empty_rows(rows, sent.device)
        mine = received[group.rank].clone()
        mine[: sent.numel()].copy_(sent)
        comm.all_gather(received.view(-1), mine)
        copies = values.view(plan.world_size, -1)
        for target, row, blocks, copy in zip(out.view(plan.world_size, -1), received, rows, copies):
            target.copy_(codec.decode(row, blocks).add_(copy))
        return received.nbytes

    def _rows_of(self, group: ShardedGroup, number: int) -> list[RowBlocks]:
        """Each rank's row of the group's flat buffer as blocks (the same on every rank)."""
        if number not in self._rows:
            plan, rows = group.plan, []
            for rank in range(plan.world_size):
                first, last = plan.rank_range(rank)
                pieces = [(max(s.offset, first) - first, min(s.offset + s.numel, last) - first)
                          for s in sorted(plan.slots, key=lambda s: s.offset)
                          if s.numel and s.offset < last and s.offset + s.numel > first]  # fmt: skip
                rows.append(RowBlocks(pieces, plan.chunk, self._codec.block))
            self._rows[number] = rows
        return self._rows[number]

    def _empty_rows(self, rows: Sequence[RowBlocks], device: torch.device) -> Tensor:
        """One row of bytes per rank, as long as the longest encoded row (collectives move
        rows of one length)."""
        width = max(self._codec.row_bytes(blocks) for blocks in rows)
        return torch.zeros((len(rows), width), dtype=torch.uint8, device=device)


class PlainLegs:
    """A fixed group's outer round at 32 bits: the replicas' parameters reduce-scattered (each
    times its factor), their mean subtracted from the owner's snapshot shard; the owners'
    new shards (``gather_input``, which the outer step writes) all-gathered.

    Args:
        snapshot: per param group, this rank's snapshot shard (the master shard).
    """

    def __init__(self, snapshot: Sequence[Tensor]) -> None:
        self._snapshot = snapshot

    def reduce(self, comm: Collectives, group: ShardedGroup, number: int, params: Tensor,
               factors: Sequence[float] | None, out: Tensor) -> int:
        """``out`` = the snapshot's shard minus the replicas' (weighted) mean; the bytes sent."""
        if factors is not None:  # this replica's share of the weighted mean
            params.mul_(factors[comm.rank])
        comm.reduce_scatter_sum(group.grad_shard, params)
        torch.div(group.grad_shard, float(group.plan.world_size), out=out)
        torch.sub(self._snapshot[number], out, out=out)
        return params.nbytes

    def gather(self, comm: Collectives, group: ShardedGroup, number: int, master: Tensor, values: Tensor | None,
               out: Tensor) -> int:
        """Every owner's ``gather_input`` into ``out``; the bytes received."""
        comm.all_gather(out, group.gather_input)
        return out.nbytes
