"""Starting an optimizer: its sharded groups built from the options, every rank from rank 0's values.

:func:`build_groups` makes one :class:`~acco.sharding.ShardedGroup` per param group as the
mode's loop needs them; :func:`start_identical` checks that every rank built the same ones, then
broadcasts rank 0's parameters (and module buffers); :func:`open_groups` makes the process
groups the optimizer owns.
"""

from __future__ import annotations

import datetime
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from acco.collectives import Collectives
from acco.mesh import InnerMesh, local_tensor
from acco.module_buffers import BufferSync
from acco.options import Options
from acco.sharding import ShardedGroup, plan_layout

__all__ = ["MadeGroups", "build_groups", "open_groups", "start_identical"]


def build_groups(
    param_groups: Sequence[dict[str, Any]],
    options: Options,
    rank: int,
    world_size: int,
    inner: InnerMesh | None = None,
    *,
    double_buffered: bool,
    master_in_params: bool,
    master: bool = True,
    gather_into_params: bool = False,
) -> list[ShardedGroup]:
    """One :class:`ShardedGroup` per param group, as the mode's loop needs them (its facts
    ``double_buffered``, ``master_in_params``, ``master`` and ``gathers_into_params``,
    :class:`acco.loops.Loop`); with ``inner``
    (DTensor parameters) each works on the parameters' local tensors."""
    groups = [
        ShardedGroup(
            g["params"],
            plan_layout(g["layout"], [local_tensor(p).shape for p in g["params"]], world_size),
            rank,
            param_dtype=options.param_dtype,
            reduce_dtype=options.reduce_dtype,
            double_buffered=double_buffered,
            master_in_params=master_in_params,
            master=master,
            inner=inner,
            gather_into_params=gather_into_params,
        )
        for g in param_groups
    ]
    if any(g.reduce_dtype.itemsize < 4 for g in groups):
        warnings.warn(
            "acco accumulates gradients in reduce_dtype, here a 16-bit type: sums over many "
            "micro-batches lose precision; pass reduce_dtype=torch.float32 to accumulate in fp32",
            stacklevel=3,
        )
    return groups


def start_identical(
    groups: Sequence[ShardedGroup],
    comm: Collectives,
    options: Options,
    header: list[str],
    buffer_sync: BufferSync | None = None,
) -> None:
    """Check that every rank built the same groups (and module buffers), then give every
    rank rank 0's parameters and buffers. ``ValueError`` on every rank when the model, mode,
    layout or optimizer class differs. Collective."""
    extra = "" if buffer_sync is None else buffer_sync.fingerprint()
    fingerprint = "|".join(
        [options.fingerprint(), extra] + [f"{name}:{group.fingerprint()}" for name, group in zip(header, groups)]
    )
    if not comm.same_on_all_ranks(fingerprint):
        raise ValueError(
            "AccoOptimizer: the model, mode, layout or optimizer class differs across ranks "
            f"(this rank: {fingerprint[:200]!r})"
        )
    for group in groups:
        initial = group.initial_values()
        comm.broadcast_(initial, src=0)
        group.set_initial_values(initial)
    if buffer_sync is not None:
        buffer_sync.land(buffer_sync.synchronised(comm, broadcast=True), exact=True)


@dataclass(frozen=True)
class MadeGroups:
    """The process groups an optimizer makes (and gives back at ``finish()``).

    Attributes:
        lane: the comm lane's own group (its collectives never interleave with the user's).
        mesh: with DTensor parameters, the lane's group over the whole mesh, where that is
            more than the user's group; None otherwise.
        replica: a replica group's ranks (``ready()`` on a mesh: they must agree, since
            FSDP2 reduce-scatters in every backward); None with one rank per replica.
    """

    lane: Collectives
    mesh: Collectives | None
    replica: Collectives | None

    def owned(self) -> list[Collectives]:
        return [comm for comm in (self.lane, self.mesh, self.replica) if comm is not None]


def open_groups(comm: Collectives, inner: InnerMesh, timeout: datetime.timedelta) -> MadeGroups:
    """Make the optimizer's own process groups from the user's ``comm``. Collective."""
    lane = comm.new_lane_group(timeout)
    mesh = None
    if inner.active:
        inner.gather_ranks(comm)
        if inner.ranks != sorted(comm.group_ranks()):
            mesh = comm.new_group(inner.ranks, timeout)
    replica = comm.new_group(inner.replica_ranks, timeout) if inner.replica_size > 1 else None
    return MadeGroups(lane, mesh, replica)
