"""The loops: what ``step()``, ``ready()``, ``finish()``, ``eval()`` and a mode's own state
mean, one object per mode, chosen once at construction.

:class:`Loop` is what every loop is: the facts that differ between modes, as class
attributes that the shared code reads (the round kinds :class:`~acco.rounds.RoundSchedule`
cycles through, whether the accumulator is double-buffered and where the master shard lives
for :func:`acco.startup.build_groups`, whether a GradScaler may drive it for
:mod:`acco.amp`, which optimizer runs on the shards for the layout), and the verbs
:class:`~acco.AccoOptimizer` delegates to. A loop is handed :class:`LoopParts`, a narrow
view of the optimizer (its groups, schedule, lane and collaborators), never the optimizer
(nor anything that holds it: a cycle would keep an unfinished optimizer, and its lane's
thread, alive until the cyclic collector runs).

This module holds the per-update loops, in which every ``step()`` ends a round of the
sharded update (SPEC section 2): :class:`SyncLoop` (ZeRO-1, blocking), :class:`DpuLoop`
(overlapped, one round stale) and :class:`AccoLoop` (estimate and commit rounds,
overlapped). ``mode="local"``'s loop lives whole in :mod:`acco.local`. Adding a mode:
docs/design.md, "Adding a mode".
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.profiler import record_function

from acco.collectives import Collectives
from acco.folding import GradFolder
from acco.module_buffers import BufferSnapshot, BufferSync
from acco.options import Mode, Options, RoundKind, base_hyperparams, build_base_optimizer, choose_fused
from acco.rounds import CommLaneError, LaneRound, Round, RoundSchedule
from acco.runner import LaneWork, RoundRunner
from acco.sharding import ShardedGroup
from acco.streams import ThreadLane
from acco.telemetry import RoundStats, StatsRecorder

__all__ = ["AccoLoop", "DpuLoop", "Loop", "LoopParts", "SyncLoop", "UpdateCounts", "UpdateLoop", "gradient_round"]


@dataclass
class UpdateCounts:
    """The updates a loop has applied on this rank (``AccoOptimizer.num_updates`` and its
    neighbours read them; the loop and ``load_state_dict()`` write them).

    Attributes:
        num_updates: updates applied (committed rounds; ``mode="local"``: inner updates).
        skipped_updates: updates skipped for NaN/inf with ``nonfinite="skip"``.
        committed_weight: the weights of the micro-batches the applied updates covered.
    """

    num_updates: int = 0
    skipped_updates: int = 0
    committed_weight: float = 0.0


@dataclass
class LoopParts:
    """What a loop is handed: the optimizer's param groups and buffers, its round schedule,
    its gradient folder, the comm lane and the collaborators of a round body.

    Attributes:
        param_groups: the optimizer's ``param_groups`` (hyper-parameters read at each round).
        groups: each param group's :class:`~acco.sharding.ShardedGroup`.
        schedule: the round state machine (the loop's ``round_kinds``).
        folder: folds micro-batch gradients into the accumulators.
        counts: the updates applied, which the loop counts.
        lane: the comm lane (its thread, or CUDA side stream and thread).
        lane_comm: the comm lane's own collectives.
        recorder: the rounds' telemetry.
        options: the checked constructor arguments.
        buffer_sync: the module buffers kept identical across ranks, if any.
        mesh_comm: with DTensor parameters, the lane's group over the whole mesh (or None).
        replica_size: ranks per replica group (1 on flat ranks).
        optimizer_class / defaults: the base optimizer and its keyword arguments.
    """

    param_groups: list[dict[str, Any]]
    groups: list[ShardedGroup]
    schedule: RoundSchedule
    folder: GradFolder
    counts: UpdateCounts
    lane: ThreadLane
    lane_comm: Collectives
    recorder: StatsRecorder
    options: Options
    buffer_sync: BufferSync | None
    mesh_comm: Collectives | None
    replica_size: int
    optimizer_class: type[torch.optim.Optimizer]
    defaults: dict[str, Any]

    def lane_work_args(self) -> tuple[Any, ...]:
        """:class:`~acco.runner.LaneWork`'s arguments after ``groups`` (and a runner's own)."""
        return (self.lane_comm, self.lane.device_hooks, self.recorder, self.options, self.buffer_sync,
                self.mesh_comm, self.replica_size)  # fmt: skip


class Loop:
    """One mode's loop. Subclasses set the facts below and implement the verbs.

    Facts (class attributes, read before the loop exists):
        mode: the :class:`~acco.options.Mode` it implements.
        round_kinds: the kinds of round it launches, in the order they repeat.
        double_buffered: the compute lane keeps accumulating while a round runs (a second
            model-size buffer); False only where nothing is computed meanwhile.
        master_in_params: the live parameters hold the committed values at every round
            boundary, so the master shard need not be kept (:class:`~acco.sharding.ShardedGroup`).
        gathers_into_params: nothing reads the live parameters while a round runs, so they may
            be views of the all-gather's target, their chunk the master shard stepped in place:
            a landed round copies nothing (:class:`~acco.sharding.ShardedGroup`).
        grad_scaler_refusal: why a ``torch.amp.GradScaler`` cannot drive this loop (None: it can).
        pending_sums_across_ranks: the gradients accumulated for the next update are summed over
            every rank by it, so a checkpoint may hold their sum on rank 0 (False: each rank's
            are its own, and the loop's state keeps them).
        rounds_per_update: the rounds (``step()`` calls) one committed update of K micro-batches
            spans where a framework's step is one update (:mod:`acco.integrations.schedules`):
            ``acco``'s estimate and commit round of K/2 each; one round of K otherwise
            (``local``: one inner update).

    Attributes:
        shard_optimizers: per param group, the optimizer stepped on this rank's shard on the
            comm lane (None: this rank owns nothing of the group).
        lane_work: the round body the comm lane runs.
    """

    mode: ClassVar[Mode]
    round_kinds: ClassVar[tuple[RoundKind, ...]]
    double_buffered: ClassVar[bool] = True
    master_in_params: ClassVar[bool] = False
    gathers_into_params: ClassVar[bool] = False
    grad_scaler_refusal: ClassVar[str | None] = None
    pending_sums_across_ranks: ClassVar[bool] = True
    rounds_per_update: ClassVar[int] = 1

    shard_optimizers: list[torch.optim.Optimizer | None]
    lane_work: LaneWork

    def __init__(self, parts: LoopParts) -> None:
        self._parts = parts
        self._groups, self._schedule, self._counts = parts.groups, parts.schedule, parts.counts

    @staticmethod
    def sharded_class(options: Options) -> type | None:
        """The optimizer class whose update runs on the shards and so decides each group's
        layout (None: the group's own base optimizer class)."""
        return None

    @staticmethod
    def keeps_master(options: Options) -> bool:
        """Whether each group keeps a master shard (and its gradient) for the update on the
        shards (False: the update's state lives elsewhere, e.g. an elastic round's)."""
        return True

    # ------------------------------------------------------------- the verbs

    def step(self, inv_scale: Tensor | None) -> bool:
        """The round boundary; True when the model now holds newly committed parameters."""
        raise NotImplementedError

    def ready(self) -> bool:
        """Whether ``step()`` would return without waiting for the comm lane (this rank)."""
        raise NotImplementedError

    def finish(self) -> bool:
        """Land what ``finish()`` lands; True when that committed an update."""
        raise NotImplementedError

    def eval(self) -> None:
        """Put the parameters to evaluate in the model (``AccoOptimizer.eval``)."""

    def train(self, restore: bool) -> None:
        """Undo :meth:`eval` (``restore``: write the set-aside parameters back)."""

    def state_dict(self) -> dict[str, Any] | None:
        """The loop's own state, beyond the groups and the schedule (None: nothing)."""
        return None

    def saved_masters(self) -> list[Tensor] | None:
        """Per param group, what a state dict saves as this rank's master shard where the
        groups keep none (:meth:`keeps_master` False); None: the groups' own."""
        return None

    def load_state_dict(self, saved: dict[str, Any], buffer_snapshot: BufferSnapshot | None) -> None:
        """Restore the loop's own state and the round in flight (after the groups, the counts and
        the schedule). ``saved``: the state dict's ``"acco"`` entry; ``buffer_snapshot``: the
        round in flight's module buffers. A per-update loop's round in flight is at the same
        step on every rank (each ``step()`` is a round of all of them): its all-gather runs
        again (collective), from the result each rank saved."""
        kind = saved["round"]["in_flight_kind"]
        if kind is not None:
            self.replay(RoundKind(kind), buffer_snapshot)

    def buffer_bytes(self) -> list[dict[str, int]]:
        """Bytes of each buffer held now, per param group (docs/memory.md)."""
        return [group.buffer_bytes() for group in self._groups]

    # Rounds a loop runs at construction, before any training (elastic replicas' join round):
    # load_state_dict() may still follow them.
    rounds_before_training: int = 0

    # The local loop's own counters and views, neutral in a per-update loop.
    outer_rounds: int = 0
    skipped_outer_rounds: int = 0

    def global_parameters(self) -> list[list[Tensor]]:
        raise RuntimeError(f"global_parameters(): mode='local' only (this optimizer is mode={self.mode.value!r})")

    # Replicas that take their own numbers of steps and stop together (mode="local",
    # acco.replicas); in the per-update modes every rank takes the same updates.
    should_stop = False
    replica = 0

    @property
    def replica_steps(self) -> list[int]:
        return []

    def request_stop(self) -> None:
        raise RuntimeError(self._stop_refusal("request_stop()"))

    def stop_after(self, steps: int | None, seconds: float | None) -> None:
        raise RuntimeError(self._stop_refusal("stop_after()"))

    def _stop_refusal(self, verb: str) -> str:
        return (f"{verb}: mode='local' only (in mode={self.mode.value!r} every rank takes the same updates: stop at an "
                "update count)")

    @property
    def base_optimizers(self) -> list[torch.optim.Optimizer | None]:
        """The base optimizer on this rank's shards (empty where it runs elsewhere)."""
        return list(self.shard_optimizers)

    @property
    def inner_optimizers(self) -> list[torch.optim.Optimizer]:
        return []

    @property
    def outer_optimizers(self) -> list[torch.optim.Optimizer | None]:
        return []

    # ---------------------------------------------- shared by the loops' verbs

    def replay(self, kind: RoundKind, buffer_snapshot: BufferSnapshot | None) -> None:
        """Put a checkpoint's round in flight again: only its all-gather runs."""
        round_ = LaneRound(kind=kind, stats=self._schedule.replayed_stats(kind), buffer_snapshot=buffer_snapshot)
        self._schedule.restore(round_, self._submit_with(self.lane_work.replay))

    def _submit_with(self, body: Callable[[Any], RoundStats]) -> Callable[[LaneRound], Any]:
        lane = self._parts.lane
        return lambda round_: lane.submit(lambda: body(round_))

    def _buffer_snapshot(self) -> BufferSnapshot | None:
        return None if self._parts.buffer_sync is None else self._parts.buffer_sync.snapshot()

    def synchronise_buffers_now(self) -> None:
        """``finish()``: the module buffers once more, on the comm lane, without delay, so
        they are identical on every rank from here on."""
        sync = self._parts.buffer_sync
        if sync is None:
            return
        try:
            synced = self._parts.lane.run(functools.partial(sync.synchronised, self._parts.lane_comm),
                                          self._parts.options.wait_seconds)  # fmt: skip
        except Exception as error:
            raise CommLaneError(f"the final module-buffer synchronisation failed on the comm lane: {error}") from error
        sync.land(synced, exact=True)

    def _land_buffers(self, round_: LaneRound) -> None:
        if round_.buffer_snapshot is not None:
            self._parts.buffer_sync.land(round_.buffer_snapshot)


def gradient_round(
    schedule: RoundSchedule,
    grads: list[Tensor],
    hyperparams: list[dict[str, Any]],
    buffer_snapshot: BufferSnapshot | None = None,
    inv_scale: Tensor | None = None,
) -> Round:
    """The gradient round of the schedule's next kind over ``grads``, with the weights
    accumulated for it (which start again from zero)."""
    update_weight, round_weight = schedule.hand_over_weights()
    stats = schedule.next_stats(round_weight.micro_batches, round_weight.host)
    return Round(kind=schedule.next_kind, stats=stats, buffer_snapshot=buffer_snapshot, grads=grads,
                 update_weight=update_weight, round_weight=round_weight, hyperparams=hyperparams,
                 inv_scale=inv_scale)  # fmt: skip


class UpdateLoop(Loop):
    """A per-update loop: every ``step()`` lands the round in flight (its result into the
    model) and hands this round's gradients to the next, which reduce-scatters them, steps
    the base optimizer on this rank's shard and all-gathers the result on the comm lane.

    Facts beyond :class:`Loop`'s:
        lands_at_once: ``step()`` waits for the round it launched (sync: no overlap).
    """

    lands_at_once: ClassVar[bool] = False

    def __init__(self, parts: LoopParts) -> None:
        super().__init__(parts)
        for group, sharded in zip(parts.param_groups, parts.groups):  # the fastest kernel on a flat shard
            choose_fused(group, sharded.device, sharded.master_dtype)
        self.shard_optimizers = [
            build_base_optimizer(g, s.master_views, parts.optimizer_class, parts.defaults)
            for g, s in zip(parts.param_groups, parts.groups)
        ]
        self.lane_work = RoundRunner(parts.groups, self.shard_optimizers, *parts.lane_work_args())
        self._eval_at: int | None = None  # rounds launched when eval() set the live parameters aside

    def step(self, inv_scale: Tensor | None) -> bool:
        committed = self._land_in_flight()
        self._launch(inv_scale)
        if self.lands_at_once:
            committed = self._land_in_flight()
        return committed

    def ready(self) -> bool:
        in_flight = self._schedule.in_flight
        return in_flight is None or in_flight.future.done()

    def finish(self) -> bool:
        """A commit round in flight lands; an estimate round in flight is dropped."""
        round_ = self._schedule.in_flight
        if round_ is not None and round_.kind is RoundKind.ESTIMATE:
            self._schedule.take_in_flight()
            self._schedule.wait(round_)
            return False
        return self._land_in_flight()

    def eval(self) -> None:
        """Load the committed parameters: a commit round in flight is waited for (its result
        still lands at the next ``step()``), the live parameters set aside until ``train()``."""
        if self._eval_at == self._schedule.launched:
            return  # holds the committed parameters already
        self.train(restore=True)  # drops a copy set aside before a step(): the model has moved on since
        round_ = self._schedule.in_flight
        if round_ is None or round_.kind is not RoundKind.COMMIT:
            return
        self._schedule.check_usable("eval")
        self._schedule.wait(round_)
        self._eval_at = self._schedule.launched
        with record_function("acco.load_params"):
            for group in self._groups:
                group.set_live_aside()
                group.load_params_from_buffer()

    def train(self, restore: bool) -> None:
        restore = restore and self._eval_at == self._schedule.launched
        self._eval_at = None
        for group in self._groups:
            group.take_live_back(restore)

    def _launch(self, inv_scale: Tensor | None) -> None:
        """Hand this round's gradients over and start the next round on the comm lane
        (``inv_scale``: a GradScaler's, :mod:`acco.amp`)."""
        keep_accumulating = self._schedule.next_kind is RoundKind.ESTIMATE
        with self._parts.folder.views_released():
            grads = [group.hand_over(keep_accumulating) for group in self._groups]
        # The hyper-parameters in param_groups now: a commit round is handed over after the
        # scheduler has stepped for the previous update, so committed updates follow the
        # schedule exactly as in sync mode.
        hyperparams = [base_hyperparams(g) for g in self._parts.param_groups]
        round_ = gradient_round(self._schedule, grads, hyperparams, self._buffer_snapshot(), inv_scale)
        self._schedule.launch(round_, self._submit_with(self.lane_work.run))

    def _land_in_flight(self) -> bool:
        """Wait for the round in flight and load its result into the model."""
        round_ = self._schedule.take_in_flight()
        if round_ is None:
            return False
        stats = self._schedule.wait(round_)
        with record_function("acco.load_params"):
            for group in self._groups:
                group.load_params_from_buffer()
            self._land_buffers(round_)
        if round_.kind is not RoundKind.COMMIT:
            return False
        if stats.skipped:
            self._counts.skipped_updates += 1
            return False
        self._counts.num_updates += 1
        self._counts.committed_weight += stats.update_weight
        return True


class SyncLoop(UpdateLoop):
    """ZeRO-1: ``step()`` reduce-scatters, updates and all-gathers in the accumulator itself
    and waits for it; equal to plain training on the global batch."""

    mode = Mode.SYNC
    round_kinds = (RoundKind.COMMIT,)
    # Nothing is computed while a round runs: it reduces, updates and gathers in the
    # accumulator itself.
    double_buffered = False
    # Each round's result is loaded as the committed parameters: with fp32 parameters those
    # hold the master shard.
    master_in_params = True
    # step() waits for the round: the parameters are the all-gather's target, the master shard
    # their chunk (parameters in the master dtype).
    gathers_into_params = True
    lands_at_once = True


class DpuLoop(UpdateLoop):
    """Delayed parameter update: every round commits the previous round's gradients,
    overlapped, uncompensated."""

    mode = Mode.DPU
    round_kinds = (RoundKind.COMMIT,)
    master_in_params = True


class AccoLoop(UpdateLoop):
    """ACCO: an estimate round (theta~ placed, nothing changed) and a commit round (both
    rounds' gradients) alternate, overlapped; the live parameters hold estimates."""

    mode = Mode.ACCO
    round_kinds = (RoundKind.ESTIMATE, RoundKind.COMMIT)
    rounds_per_update = 2  # the estimate round, then the commit round that applies both rounds' gradients
    grad_scaler_refusal = (
        "torch.amp.GradScaler is not supported in mode='acco': a commit round sums the estimate "
        "round's gradients and its own, and the scale may change between the two rounds. Use bf16 "
        "autocast (no scaler needed), or mode='dpu' or mode='sync' with the GradScaler"
    )


def loop_classes(extra: Sequence[type[Loop]] = ()) -> dict[Mode, type[Loop]]:
    """Each mode's loop class, by the mode it declares (``extra``: loops of other modules)."""
    return {loop.mode: loop for loop in (SyncLoop, DpuLoop, AccoLoop, *extra)}
