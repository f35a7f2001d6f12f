"""Starting an optimizer: its sharded groups built from the options, every rank from rank 0's values.

:func:`build_groups` makes one :class:`~acco.sharding.ShardedGroup` per param group as the
mode needs them; :func:`start_identical` checks that every rank built the same ones, then
broadcasts rank 0's parameters (and module buffers).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from acco.collectives import Collectives
from acco.mesh import InnerMesh, local_tensor
from acco.module_buffers import BufferSync
from acco.options import Mode, Options
from acco.sharding import ShardedGroup, plan_layout

__all__ = ["build_groups", "start_identical"]


def build_groups(
    param_groups: Sequence[dict[str, Any]], options: Options, rank: int, world_size: int, inner: InnerMesh | None = None
) -> list[ShardedGroup]:
    """One :class:`ShardedGroup` per param group, as ``options.mode`` needs them; with
    ``inner`` (DTensor parameters) each works on the parameters' local tensors."""
    groups = [
        ShardedGroup(
            g["params"],
            plan_layout(g["layout"], [local_tensor(p).shape for p in g["params"]], world_size),
            rank,
            param_dtype=options.param_dtype,
            reduce_dtype=options.reduce_dtype,
            # sync computes nothing while a round runs: the round reduces, updates and
            # gathers in the accumulator itself.
            double_buffered=options.mode is not Mode.SYNC,
            # sync and dpu load each round's result as the committed parameters: with
            # fp32 parameters those hold the master shard (acco's hold estimates).
            # (mode="local": the master shard is the snapshot, which the live parameters are not.)
            master_in_params=options.mode in (Mode.SYNC, Mode.DPU),
            inner=inner,
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
        [options.mode.value, options.nonfinite.value, str(options.max_grad_norm), str(options.estimate_dtype), extra,
         str(options.local and (options.local.sync_every, options.local.sync_delay, options.local.overlap.value,
                                options.local.outer_class.__name__))]
        + [f"{name}:{group.fingerprint()}" for name, group in zip(header, groups)]
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
