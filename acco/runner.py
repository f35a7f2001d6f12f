"""The comm lane's round body: totals, reduce-scatter, update, all-gather.

:class:`LaneWork` is what every round body shares (the all-gather, the module buffers, the
non-finite check, a replayed round); :class:`RoundRunner` runs one gradient
:class:`~acco.rounds.Round` on it, on the comm lane's thread (an outer round of
``mode="local"`` has its own body, :class:`acco.outer_round.OuterRunner`)
(docs/design.md, "A round on the comm lane"). It holds no reference to the optimizer: its
collaborators (the groups' buffers, the base optimizers, the collectives, the device hooks,
the stats recorder) are handed to it, so a test can drive it with fake collectives and no
process group. Its host synchronisations (reading the weights, the base optimizer's own)
block only the lane's thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from acco.sharding import ShardedGroup
from acco.collectives import Collectives
from acco.streams import DeviceHooks
from acco.module_buffers import BufferSync
from acco.options import NonFinite, Options, RoundKind
from acco.rounds import CommLaneError, LaneRound, Round
from acco.telemetry import RoundStats, StatsRecorder

__all__ = ["LaneWork", "RoundRunner", "average_and_step", "step_shard"]


class LaneWork:
    """What every round body on the comm lane shares: its collaborators, the all-gather of
    each rank's shard, the module buffers' synchronisation, the non-finite check, and the
    replay of a round re-created from a checkpoint. :class:`RoundRunner` runs gradient
    rounds on it; :class:`acco.outer_round.OuterRunner` outer rounds.

    Args:
        groups: each param group's buffers.
        collectives: the comm lane's own collectives (every rank calls them in round order).
        device_hooks: the lane's device hooks (stamps, small host copies).
        recorder: where the round's phases are stamped.
        options: ``nonfinite``, ``max_grad_norm``, ``estimate_dtype``, ``timeout``.
        buffer_sync: the module buffers a round's snapshot is synchronised for, if any.
        mesh_collectives: with DTensor parameters, the comm lane's group over every rank of
            the mesh, for the sums that span it (weights, non-finite flags, the gradient
            norm); ``collectives`` otherwise.
        replica_size: ranks per replica group, which all pass the same weights (counted once).
    """

    def __init__(
        self,
        groups: Sequence[ShardedGroup],
        collectives: Collectives,
        device_hooks: DeviceHooks,
        recorder: StatsRecorder,
        options: Options,
        buffer_sync: BufferSync | None = None,
        mesh_collectives: Collectives | None = None,
        replica_size: int = 1,
    ) -> None:
        self._groups = list(groups)
        self._mesh_comm = collectives if mesh_collectives is None else mesh_collectives
        self._replica_size = replica_size
        self._comm = collectives
        self._device_hooks = device_hooks
        self._recorder = recorder
        self._options = options
        self._buffer_sync = buffer_sync

    def replay(self, round_: LaneRound) -> RoundStats:
        """A round re-created from a checkpoint: its saved result (already in each group's
        ``gather_input``) is all-gathered again."""
        self._recorder.lane_start(round_.stats)
        self._all_gather(round_.stats)
        self._recorder.lane_end(round_.stats)
        return round_.stats

    def _failed(self, round_: LaneRound, error: Exception) -> CommLaneError:
        return CommLaneError(
            f"{round_.kind.value} round {round_.stats.index} failed on the comm lane during {round_.stats.phase}: {error}"
        )

    def _skip(self, round_: LaneRound) -> RoundStats:
        """End a round that saw NaN/inf with ``nonfinite="skip"``: its result is the master
        shard, unchanged."""
        round_.stats.skipped = True
        self._all_gather(round_.stats, unchanged=True)
        self._synchronise_buffers(round_)
        self._recorder.lane_end(round_.stats)
        return round_.stats

    def _gather_result(self, round_: LaneRound, sent: Sequence[Tensor] | None,
                       delta_from: list[Tensor] | None = None) -> None:
        """A round's end on the lane: every rank's updated shard all-gathered, the bytes of
        ``sent`` (the reduce-scatter's inputs; None: a quantised round, not counted) and of
        the gathered result recorded, the module buffers synchronised."""
        self._all_gather(round_.stats, delta_from=delta_from)
        if sent is not None:
            round_.stats.collective_bytes = sum(t.nbytes for t in sent) + sum(g.gathered.nbytes for g in self._groups)
        self._synchronise_buffers(round_)

    def _all_gather(self, stats: RoundStats, delta_from: list[Tensor] | None = None, unchanged: bool = False) -> None:
        """Every rank's ``gather_input`` into ``gathered``. With ``delta_from`` (the light
        estimate round: the committed master shards, which every rank's live parameters
        hold in full) only the delta from them travels, in ``estimate_dtype``; ``unchanged``
        (a skipped round) sends the master shards themselves."""
        with self._recorder.phase(stats, "all-gather"):
            for number, group in enumerate(self._groups):
                if unchanged:
                    group.write_result(group.prepare_master())
                if delta_from is None:
                    self._comm.all_gather(group.gathered, group.gather_input)
                    continue
                delta = group.gather_input.to(group.master_dtype, copy=True).sub_(delta_from[number])
                group.gather_from_delta(*self._comm.all_gather_quantized(delta, self._options.estimate_dtype))

    def _synchronise_buffers(self, round_: LaneRound) -> None:
        if round_.buffer_snapshot is not None and self._buffer_sync is not None:
            with self._recorder.phase(round_.stats, "buffers"):
                self._buffer_sync.synchronise(round_.buffer_snapshot, self._comm)

    def _nonfinite_flag(self, tensors: Sequence[Tensor]) -> Tensor:
        """1.0 where some of ``tensors`` may hold NaN or inf, on the device, read nothing:
        a sum is NaN or inf whenever an element is, and costs a thirtieth of an exact scan;
        :meth:`_confirm_nonfinite` scans only when some rank's sum was not finite."""
        sums = torch.stack([t.sum().double() for t in tensors])
        return (~torch.isfinite(sums)).any().double()

    def _confirm_nonfinite(self, tensors: Sequence[Tensor], collectives: Any = None) -> int:
        """How many ranks really hold a NaN or inf (a sum may overflow on huge finite values).

        Runs on every rank once the all-reduced flags say some rank's sum was not finite, over
        ``collectives`` (default: the mesh's; an elastic round: the round's participants).
        """
        exact = torch.stack([(~torch.isfinite(t)).any() for t in tensors]).any().double().reshape(1)
        (self._mesh_comm if collectives is None else collectives).all_reduce_sum_(exact)
        return int(self._device_hooks.host_copy(exact)(self._options.timeout.total_seconds()).item())


class RoundRunner(LaneWork):
    """Runs gradient rounds (estimate, commit) on the comm lane, one at a time, in launch order.

    Args:
        groups: each param group's buffers.
        base_optimizers: each group's base optimizer on this rank's shard (None: this rank
            owns nothing of that group).
        *args, **kwargs: the rest of :class:`LaneWork`'s.
    """

    def __init__(
        self, groups: Sequence[ShardedGroup], base_optimizers: Sequence[torch.optim.Optimizer | None], *args: Any, **kwargs: Any
    ) -> None:
        super().__init__(groups, *args, **kwargs)
        self._base = list(base_optimizers)
        self._one_rank = not any(g.multi_rank for g in self._groups) and self._mesh_comm is self._comm
        self._squares = torch.zeros(0)  # this round's, set by its totals before _clip reads them

    @property
    def _squares_serve_clip(self) -> bool:
        """With one rank and clipping, the non-finite check takes the squared norms _clip needs."""
        return self._one_rank and self._options.max_grad_norm is not None

    def run(self, round_: Round) -> RoundStats:
        """One round: the totals' all-reduce, reduce-scatter, average (and clip), update, all-gather.

        Raises:
            CommLaneError: naming the round and the phase it failed in.
        """
        stats, record = round_.stats, self._recorder
        record.lane_start(stats)
        try:
            if round_.inv_scale is not None:  # a GradScaler's: each rank unscales its own
                with record.phase(stats, "unscale"):
                    for grads in round_.grads:
                        grads.mul_(round_.inv_scale)
            with record.phase(stats, "totals"):
                update_weight, nonfinite = self._totals(round_)
            if nonfinite:  # no update: the round's result is the committed shard, unchanged
                return self._skip(round_)
            light = round_.kind is RoundKind.ESTIMATE and self._options.estimate_dtype is not None
            with record.phase(stats, "reduce-scatter"):
                for group, grads in zip(self._groups, round_.grads):
                    if light:
                        self._comm.reduce_scatter_quantized(group.grad_shard, grads, self._options.estimate_dtype)
                    else:
                        self._comm.reduce_scatter_sum(group.grad_shard, grads)
            # What the reduced sums are divided by: the update weight, and the clipping scale's inverse.
            divisor: float | Tensor = update_weight
            if self._options.max_grad_norm is not None:
                with record.phase(stats, "grad-norm"):
                    norm, divisor = self._clip(self._options.max_grad_norm, update_weight)
                    record.grad_norm(stats, self._device_hooks.host_copy(norm))
            with record.phase(stats, "update"):
                masters = [group.prepare_master() for group in self._groups]
                for group, base, hyperparams in zip(self._groups, self._base, round_.hyperparams):
                    if base is not None:
                        average_and_step(group, base, hyperparams, round_.kind is RoundKind.ESTIMATE, divisor)
                    else:
                        group.write_result(group.master)
            self._gather_result(round_, None if light else round_.grads, delta_from=masters if light else None)
        except Exception as error:
            raise self._failed(round_, error) from error
        record.lane_end(stats)
        return stats

    def _totals(self, round_: Round) -> tuple[float, float]:
        """All-reduce this rank's weights and flags; returns (update weight, how many
        ranks hold non-finite gradients), after recording the weights in the stats.

        Raises ``ValueError`` for invalid or zero weights, ``FloatingPointError`` for
        non-finite gradients with ``nonfinite="raise"``.
        """
        stats, limit = round_.stats, self._options.timeout.total_seconds()
        local = self._local_totals(round_)
        read_local = self._device_hooks.host_copy(local)
        totals = local.clone()
        self._mesh_comm.all_reduce_sum_(totals)
        if self._replica_size > 1:  # every rank of a replica group counted its weights
            totals[[0, 1, 2, 4]] /= self._replica_size
        _, stats.local_weight, _, _, _ = read_local(limit).tolist()
        update_weight, global_weight, global_micro_batches, nonfinite, invalid = (
            self._device_hooks.host_copy(totals)(limit).tolist()
        )
        stats.update_weight, stats.global_weight = update_weight, global_weight
        stats.global_micro_batches = int(global_micro_batches)
        if invalid:
            raise ValueError(f"accumulate() got {int(invalid)} invalid weight(s) (negative, NaN or inf)")
        if not update_weight > 0:
            raise ValueError(
                f"the total weight over all ranks is {update_weight}: no rank called "
                "accumulate() (with a positive weight) before step()"
            )
        if nonfinite:  # before the reduce-scatter, which may reuse the buffer's other chunks
            nonfinite = self._confirm_nonfinite(round_.grads)
        # With a GradScaler an overflow is expected: the update is skipped, as GradScaler does.
        if nonfinite and self._options.nonfinite is NonFinite.RAISE and round_.inv_scale is None:
            raise FloatingPointError(f"non-finite gradients on {int(nonfinite)} rank(s)")
        return update_weight, nonfinite

    def _local_totals(self, round_: Round) -> Tensor:
        """This rank's [update weight, round weight, round micro-batches, whether its
        gradients look non-finite, invalid weights], float64 on the gradients' device, made
        without reading anything from the device."""
        update, local = round_.update_weight, round_.round_weight
        host = torch.tensor([update.host, local.host, local.micro_batches, 0.0, 0.0], dtype=torch.float64)
        totals = self._device_hooks.to_device(host)
        if update.device is not None:
            totals[0] += update.device[0]
        if local.device is not None:
            totals[1] += local.device[0]
            totals[4] += local.device[1]
        totals[3] += self._squares_flag(round_) if self._squares_serve_clip else self._nonfinite_flag(round_.grads)
        return totals

    def _squares_flag(self, round_: Round) -> Tensor:
        """The non-finite flag from the squared norms of ``round_``'s gradients, kept for
        :meth:`_clip`: with one rank the reduce-scatter leaves the sums where they are, so
        the one pass over them serves both (a square is NaN or inf whenever an element is)."""
        self._squares = torch.stack([g.squared_norm(grads) for g, grads in zip(self._groups, round_.grads)])
        return (~torch.isfinite(self._squares)).any().double()

    def _clip(self, max_norm: float, update_weight: float) -> tuple[Tensor, Tensor]:
        """The global 2-norm of the averaged gradient (the reduced sums over ``update_weight``),
        as ``torch.nn.utils.clip_grad_norm_`` would take it on the full gradient, and what the
        sums are divided by to average and clip them at once (a 0-dim tensor); both on the
        device, so nothing waits for the reduce-scatter on the host.

        One fused norm over each shard (:func:`acco.sharding.squared_norm`) and one all-reduce
        of the squares (over the whole mesh with DTensor parameters, a replicated one counted
        once); the division is left to the update (:func:`average_and_step`)."""
        if self._squares_serve_clip:  # taken with this round's non-finite flag (one rank)
            squares = self._squares.sum().reshape(1)
        else:
            squares = torch.stack([g.squared_norm(g.grad_shard) for g in self._groups]).sum().reshape(1)
        squares.div_(update_weight * update_weight)  # the average's, as every rank sends
        self._mesh_comm.all_reduce_sum_(squares)
        norm = squares.sqrt()
        scale = (max_norm / (norm + 1e-6)).clamp_(max=1.0)
        return norm, (update_weight / scale).reshape(())


def average_and_step(group: ShardedGroup, base: torch.optim.Optimizer, hyperparams: dict, estimate: bool,
                     divisor: float | Tensor) -> None:
    """:func:`step_shard` on the reduced gradient sums ``grad_shard`` divided by ``divisor``.

    A fused optimizer that takes a ``grad_scale`` (GradScaler's contract, ``_step_supports_amp_scaling``)
    divides the gradient in its own pass, reading ``grad_shard`` itself; any other gets the
    quotient in ``master_grad``, one pass before it steps."""
    folds = (
        hyperparams.get("fused", base.param_groups[0].get("fused")) is True
        and getattr(base, "_step_supports_amp_scaling", False)
        and group.grad_shard.dtype == group.master_dtype
    )
    if not folds:
        torch.div(group.grad_shard, divisor, out=group.master_grad)
        step_shard(group, base, hyperparams, estimate)
        return
    # float32 on the shard's device, as the fused kernels read GradScaler's scale; a number is
    # filled in by a kernel (a host-to-device copy from pageable memory would wait for the stream)
    if isinstance(divisor, Tensor):
        base.grad_scale = divisor.to(torch.float32).reshape(1)
    else:
        base.grad_scale = torch.full((1,), divisor, dtype=torch.float32, device=group.device)
    try:
        step_shard(group, base, hyperparams, estimate, grads=group.grad_shard)
    finally:
        base.grad_scale = None


def step_shard(group: ShardedGroup, base: torch.optim.Optimizer, hyperparams: dict, estimate: bool,
               grads: Tensor | None = None) -> None:
    """Run an optimizer on this rank's shard (the master shard, with ``master_grad``, or
    ``grads``) into ``gather_input``; an estimate leaves the master shard and the optimizer state
    as it found them."""
    base.param_groups[0].update(hyperparams)
    for param, grad in zip(group.master_views, group.shard_views(group.master_grad if grads is None else grads)):
        param.grad = grad
    if not estimate:
        base.step()
        group.write_result(group.master)
        return
    estimate_copy = group.shard_copy()
    workspace = group.shard_workspace()
    if workspace is None:  # step the real shard, then put it back from the copy
        estimate_copy.save(group.master, base.state)
        base.step()
        group.gather_input.copy_(group.master)
        estimate_copy.restore(group.master, base.state)
        return
    # Step a working copy of the shard held in a chunk of the round's buffer that was sent
    # already: the master shard itself is never touched, so it needs no copy.
    workspace.copy_(group.master)
    group.point_master_views(workspace)
    try:
        estimate_copy.save(None, base.state)
        base.step()
        group.gather_input.copy_(workspace)
        estimate_copy.restore(None, base.state)
    finally:
        group.point_master_views(group.master)
