"""mode="local": inner steps on each replica, an outer round across replicas every ``sync_every``.

The local loop, whole. Each rank (each replica group, on a mesh) trains its own copy of the
model with the inner optimizer, a whole torch optimizer stepped on the training thread at
every ``step()`` on this replica's own gradients; no collective across replicas runs there.
Every ``sync_every`` inner steps an *outer round* starts on the comm lane
(:class:`acco.outer_round.OuterRunner`): the replicas' parameters are reduce-scattered, each rank subtracts
their mean from its shard of the *snapshot* (the last global values, kept only as this rank's
1/R shard, at full precision), steps that shard with the outer optimizer (its state 1/R too)
and all-gathers the new global values. The round *lands* ``sync_delay`` inner steps after its
launch (default ``sync_every // 2``), or with ``sync_delay="auto"`` at the first inner step at
which the comm lane has finished it (at the latest ``sync_every`` steps after its launch): the
replica takes the new global values, and what it learnt meanwhile is dropped
(``overlap="discard"``, the default) or kept on top of them (``"keep"``). ``sync_delay=0`` is
blocking DiLoCo. ``outer_bits`` (4 by default) makes the round send differences, quantised
(:class:`QuantizedLegs`). The recurrences: docs/design.md, "Local steps" and "Lighter outer
rounds".

:class:`LocalLoop` is the loop (:mod:`acco.loops` says what a loop is); :class:`InnerSteps`
the inner update; :class:`LocalClock` when rounds launch and land; :class:`OuterRound` and
:class:`OuterRunner` the outer round and its body on the comm lane, once (:mod:`acco.outer_round`:
a fixed group's hooks, :class:`FixedRunner`; elastic replicas', the membership's runner,
:mod:`acco.elastic`); the legs: :mod:`acco.legs`.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.profiler import record_function

from acco.folding import WeightSum
from acco.loops import Loop, LoopParts
from acco.mesh import dtensor_like, is_dtensor, local_tensor
from acco.module_buffers import BufferSnapshot
from acco.options import BLOCK_OR_HIDE, LocalOptions, Mode, NonFinite, Options, Overlap, RoundKind, base_hyperparams
from acco.portable import full, per_param
from acco.legs import QuantizedLegs
from acco.outer_round import FixedRunner, OuterRound
from acco.replicas import Pacing, ReplicaReport
from acco.rounds import LaneRound
from acco.sharding import ShardedGroup
from acco.telemetry import RoundStats

__all__ = ["InnerSteps", "LocalClock", "LocalLoop"]

# How often a landing that waits for the other replicas' hand-overs within its patience looks.
_POLL_SECONDS = 0.002
# A round's phases that wait for the other replicas rather than move or reduce anything: their
# hand-overs (``totals``), an elastic round's quorum, grace window and commit vote, a heal served to
# a restarted group. No H amortises them (pacing and membership are for them), so the round's own
# time that sync_every="auto" plans from leaves them out.
_PEER_PHASES = frozenset({"totals", "quorum", "grace", "agree", "heal"})


def _nothing_left(round_: OuterRound) -> RoundStats:
    """The comm lane's part of a round restored with its result: none. (It goes through the lane
    all the same: on CUDA the landing is then ordered after the restore's copies, as after any
    round.)"""
    return round_.stats


def _waits_for_hand_overs(round_: LaneRound) -> bool:
    """Whether the round has not yet got past the other replicas' hand-overs (its first
    all-reduce, the ``totals`` phase, or before it starts)."""
    return round_.stats.phase in ("queued", "totals")


class LocalLoop(Loop):
    """``mode="local"``'s loop: every ``step()`` is one inner update of this replica; every
    ``sync_every`` steps an outer round launches on the comm lane, and lands when it is done
    (``sync_delay="auto"``) or ``sync_delay`` steps later.

    Attributes:
        snapshot: per param group, this rank's 1/R shard of the global values the last outer
            round landed (full precision): what the outer optimizer steps. It is the group's
            master shard (:attr:`acco.sharding.ShardedGroup.master`), the values this rank
            owns, so checkpoints save and reshard it as any mode's.
        shard_optimizers: the outer optimizers, one per param group on the snapshot's shard
            (None: this rank owns nothing of the group).
        inner: the inner optimizers and the inner update.
        clock: when outer rounds launch and land, and what has landed.
        global_values: per param group, the global values the last outer round landed, whole
            and flat (``param_dtype``; the initial parameters before the first landing): what
            ``eval()`` and ``global_parameters()`` give at any step on this rank alone, with no
            collective. One model size per rank.
    """

    mode = Mode.LOCAL
    round_kinds = (RoundKind.OUTER,)
    pending_sums_across_ranks = False
    grad_scaler_refusal = "torch.amp.GradScaler is not supported in mode='local' yet: use bf16 autocast (no scaler needed)"

    def __init__(self, parts: LoopParts) -> None:
        super().__init__(parts)
        local = parts.options.local
        self.snapshot = [group.master for group in parts.groups]
        self.shard_optimizers = [
            local.outer_optimizer([{"params": group.master_views}]) if group.master_views else None
            for group in parts.groups
        ]
        self.inner = InnerSteps(parts.param_groups, parts.groups, parts.optimizer_class, parts.defaults)
        self.clock = LocalClock(local)
        # Built after start-up: every rank holds rank 0's parameters, the first global values.
        self.global_values = [group.flat_params() for group in parts.groups]
        # overlap="estimate": every rank's copy of the outer step's common part (acco.outer_step),
        # written by the comm lane's gather leg, read at a launch once the last round has landed;
        # none where that part is the global values themselves (plain averaging: no third leg).
        self.common_terms = None
        if local.overlap is Overlap.ESTIMATE and local.may_overlap and not local.estimate.common_is_values:
            self.common_terms = [local.estimate.common(torch.empty_like(values), values, [], []) for values in self.global_values]
        self.residuals = None
        if local.error_feedback and local.membership is None:
            self.residuals = [torch.zeros(g.plan.padded_numel, dtype=torch.float32, device=g.device) for g in parts.groups]
        if local.membership is None:
            codec = local.codec()
            legs = None if codec is None else QuantizedLegs(codec, self.global_values, self.residuals)
            self.lane_work = FixedRunner(parts.groups, self.shard_optimizers, self.snapshot, legs,
                                         *parts.lane_work_args(), common_terms=self.common_terms)  # fmt: skip
        else:  # elastic replicas (torchft): the round among the replica groups present, sharded among them
            self.lane_work = local.membership.runner(parts.groups, self.global_values, local.codec(),
                                                     local.error_feedback, local.outer_optimizer, self.heal_state,
                                                     self.load_heal_state, *parts.lane_work_args())  # fmt: skip
        self.pacing = self.clock.pacing  # who takes part in a round, how many steps each: acco.replicas
        self.pacing.lands_late = self.lane_work.lands_late
        self.pacing.join(self.lane_work.replica, self.lane_work.replicas)
        self._evaluating = False  # eval() put the global values in the model (step() refuses meanwhile)
        self._rounds_landed_here = 0  # (this process's: the first one's time is not the link's)
        if local.membership is not None:
            # The join: a first round with nothing to hand over (torchft forms its quorum with the
            # replica groups alive; a group behind them, e.g. restarted, takes a peer's state in it:
            # load_heal_state()). A checkpoint may still be loaded after it.
            self._run_until_landed()
            self.rounds_before_training = self._schedule.launched

    @staticmethod
    def sharded_class(options: Options) -> type | None:
        """The outer optimizer runs on the shards, so its class decides the layout."""
        return options.local.outer_class

    @staticmethod
    def keeps_master(options: Options) -> bool:
        """Elastic replicas keep their outer state per round's participants (the membership's
        runner): the fixed layout's snapshot shard and its gradient would go unused."""
        return options.local.membership is None

    def step(self, inv_scale: Tensor | None) -> bool:
        """This replica's inner update, then the outer round in flight lands (once done, or
        ``sync_delay`` steps after its launch) and the next one starts (every ``sync_every``)."""
        if self._evaluating:
            raise RuntimeError(
                "step() between opt.eval() and opt.train(): the model holds the global values, not this replica's "
                "parameters; call opt.train() before the next forward pass"
            )
        self.pacing.check_step()
        clock, weights, options = self.clock, self._schedule.take_round_weights(), self._parts.options
        try:
            with self._parts.folder.views_released():
                updated, skipped = self.inner.step(weights, options.max_grad_norm, options.nonfinite, clock.inner_steps)
        except BaseException:
            self._schedule.put_back_round_weights(weights)
            raise
        self._counts.num_updates += int(updated)
        self._counts.skipped_updates += int(skipped)
        self._counts.committed_weight += weights.total() if updated else 0.0
        clock.stepped(weights.total() if updated else 0.0)
        if clock.lands_after(clock.inner_steps, self._round_done()):
            self._land_or_go_on()
        if clock.launches_now() and self._schedule.in_flight is None:  # (a late round lands first)
            self._launch()
            if not clock.overlaps:
                self._land_or_go_on()
        self.pacing.check_budget(clock.inner_steps)
        return updated

    def ready(self) -> bool:
        """``step()`` waits only when the round in flight must land at its end and has not
        finished yet (a late round never waits)."""
        clock = self.clock
        if clock.late:
            return self._round_done() or not self.pacing.late_round_due(clock.inner_steps + 1 - clock.late_at,
                                                                         clock.launches_now(ahead=1))
        return self._round_done() or not clock.lands_after(clock.inner_steps + 1, done=False)

    def _round_done(self) -> bool:
        """Whether the comm lane has finished the round in flight (True: none in flight)."""
        in_flight = self._schedule.in_flight
        return in_flight is None or in_flight.future.done()

    def finish(self) -> bool:
        """The round in flight lands, then one more (blocking) over the inner steps since,
        so every replica ends at the same, global parameters."""
        self.train(restore=True)  # a landing adds to this replica's parameters, not to eval()'s
        clock = self.clock
        committed = self._schedule.in_flight is not None
        if committed:
            self._land()
        if self.pacing.finish_runs_last_round(clock.unsynced):
            self.pacing.finishing = True
            self._run_until_landed(discard=True)
            committed = True
        elif clock.unsynced:  # another replica finished: its last round was the one just landed
            for group, values in zip(self._groups, self.global_values):
                group.load_params(values)
            clock.unsynced = False
        while not self.lane_work.ends_job:  # elastic replicas: until a round ends the job on every group present
            self.pacing.finishing = True
            self._run_until_landed(discard=True)
            committed = True
        return committed

    def _launch(self) -> None:
        """Hand the live parameters to an outer round on the comm lane."""
        clock = self.clock
        clock.round_delay = self.pacing.delay  # (the default landing: this round's, as the planner chose)
        params = [group.hand_over_params() for group in self._groups]
        if clock.keeps_progress:
            if clock.handed_over is None:
                clock.handed_over = [torch.empty_like(p) for p in params]
            if clock.estimates:  # start from the estimate (the last round has landed: its common part is here)
                estimate = clock.options.estimate
                # What the steps from the last start undid of its offset leaves the pseudo-gradient.
                weight = estimate.recovery * clock.offset_steps / (clock.offset_every or clock.options.sync_every)
                with record_function("acco.outer_estimate"):
                    commons = self.common_terms or self.global_values
                    for group, start, common, values, handed in zip(self._groups, clock.handed_over, commons,
                                                                    self.global_values, params):  # fmt: skip
                        estimate.start(start, common, values, handed, weight, group.plan.world_size)
                        group.load_params(start)
            else:
                torch._foreach_copy_(clock.handed_over, params)
        stats = self._schedule.next_stats(0, 0.0)
        # The H of the steps this round carries, and why (the hand-over then takes the next one's).
        stats.sync_every, stats.sync_every_choice = self.pacing.sync_every, self.pacing.choice
        hand_over = self.pacing.hand_over()
        round_ = OuterRound(kind=RoundKind.OUTER, stats=stats,
                            buffer_snapshot=self._buffer_snapshot(), params=params, hand_over=hand_over)  # fmt: skip
        self._schedule.launch(round_, self._submit_with(self.lane_work.run))
        clock.launched_at = clock.inner_steps

    def _land_or_go_on(self) -> None:
        """The round in flight lands now; or, if it is still waiting for the others' hand-overs
        after :meth:`acco.replicas.Pacing.patience` (once speed pacing paced the replicas apart,
        or with ``sync_every="auto"``), this replica goes on taking inner steps and the round
        lands *late*, at the first ``step()`` that finds it complete, the progress made since its
        launch kept on top of the new global values (a loop's own collective at a step count then
        meets every replica at that step: nobody waits in a circle); its next launch waits for
        that landing, and where the replicas launch at the same step counts
        (:attr:`acco.replicas.Pacing.lands_by_launch`) it lands there at the latest. A late round
        the others never hand over to raises :class:`acco.replicas.PacingStall` after
        :meth:`acco.replicas.Pacing.stall_bound`."""
        clock, round_ = self.clock, self._schedule.in_flight
        if clock.late:
            if round_.future.done() or self.pacing.late_round_due(clock.inner_steps - clock.late_at, clock.launches_now()):
                self._land()
            else:
                self._check_late_stall(round_)
            return
        patience = self.pacing.patience(blocks=not clock.overlaps)
        # (a round in flight that must land before this replica's next launch waits for it here)
        due = self.pacing.lands_by_launch and clock.launches_now()
        if patience is None or due or self._completes_within(round_, patience):
            self._land()
            return
        clock.late, clock.late_since, clock.late_at = True, time.perf_counter(), clock.inner_steps
        if not clock.overlaps:  # blocking: no step since the launch, the live parameters are those handed over
            if clock.handed_over is None:
                clock.handed_over = [group.flat_params() for group in self._groups]
            else:
                for group, handed in zip(self._groups, clock.handed_over):
                    torch._foreach_copy_(group.views(handed), [p.detach() for p in group.locals()])

    def _completes_within(self, round_: LaneRound, patience: float) -> bool:
        """Whether the round gets past waiting for the other replicas' hand-overs (its
        ``totals`` phase) within ``patience`` seconds of waiting here; what follows is the
        round's own transfer, which the landing waits for."""
        started = time.perf_counter()
        try:
            while not round_.future.done() and _waits_for_hand_overs(round_):
                left = patience - (time.perf_counter() - started)
                if left <= 0:
                    return False
                time.sleep(min(left, _POLL_SECONDS))
            return True
        finally:
            waited = time.perf_counter() - started
            self.pacing.waited_for_round(waited)
            round_.stats.patience_seconds += waited

    def _check_late_stall(self, round_: LaneRound) -> None:
        """A late round still waiting for the others' hand-overs past the stall bound raises."""
        if not _waits_for_hand_overs(round_):
            return
        bound = self.pacing.stall_bound(self._parts.options.timeout.total_seconds())
        self.pacing.check_stall(time.perf_counter() - self.clock.late_since, bound, round_.stats.index)

    def _run_until_landed(self, discard: bool = False) -> None:
        """A blocking round, launched again while it is dropped (elastic replicas: run again with
        the replica groups present; a fixed group's round always lands)."""
        while True:
            self._launch()
            if self._land(discard=discard):
                return

    def heal_state(self) -> dict[str, Any]:
        """What a restarted replica group takes from this one (elastic replicas): the global
        values, the inner optimizers' state, the clock, the H the steps after this round take
        (``sync_every="auto"``) and the update counts, as they are at this round's launch
        (copies: torchft serves them while the round runs)."""
        return {
            "global_values": [values.detach().cpu().clone() for values in self.global_values],
            "inner": [{"param_groups": copy.deepcopy(s["param_groups"]),
                       "state": {i: {k: local_tensor(v).detach().to("cpu", copy=True) if isinstance(v, Tensor)
                                     else copy.deepcopy(v)
                                     for k, v in e.items()} for i, e in s["state"].items()}}
                      for s in self.inner.state_dicts()],
            "clock": {"inner_steps": self.clock.inner_steps, "outer_rounds": self.clock.outer_rounds,
                      "skipped_outer_rounds": self.clock.skipped_outer_rounds},
            "every": self.pacing.every_state(),
            "counts": {"num_updates": self._counts.num_updates, "skipped_updates": self._counts.skipped_updates,
                       "committed_weight": self._counts.committed_weight},
        }  # fmt: skip

    def load_heal_state(self, state: dict[str, Any]) -> None:
        """A peer's :meth:`heal_state`, taken inside an elastic round's quorum while ``step()``
        waits for the round: this replica restarts from the global values with the peer's inner
        optimizer state, clock and counts (its own inner steps, if any, are the peer's now)."""
        with torch.no_grad():
            for group, values, target in zip(self._groups, state["global_values"], self.global_values):
                target.copy_(values)
                group.load_params(target)
        self.inner.load_state_dicts(state["inner"])
        clock = state["clock"]
        self.clock.inner_steps = int(clock["inner_steps"])
        self.clock.outer_rounds = int(clock["outer_rounds"])
        self.clock.skipped_outer_rounds = int(clock["skipped_outer_rounds"])
        self.clock.launched_at = self.clock.inner_steps
        self.clock.unsynced = False
        if "every" in state:  # (a peer of an older version: this replica plans again from its reports)
            self.pacing.load_every_state(state["every"])
        counts = state["counts"]
        self._counts.num_updates = int(counts["num_updates"])
        self._counts.skipped_updates = int(counts["skipped_updates"])
        self._counts.committed_weight = float(counts["committed_weight"])

    def _land(self, discard: bool = False) -> bool:
        """Wait for the outer round in flight and give the replica the new global values, the
        progress made since its launch on top (``overlap="keep"``) unless ``discard``; False: the
        round was dropped (elastic replicas: a participant failed), and this replica keeps its
        parameters and its inner steps, which the next round carries."""
        clock, round_ = self.clock, self._schedule.take_in_flight()
        started = time.perf_counter()
        stats = self._schedule.wait(round_, self._stall_watch())
        self.pacing.waited_for_round(time.perf_counter() - started)
        if stats.dropped:
            self.pacing.put_back(round_.hand_over)
            clock.launched_at = None
            return False
        self.pacing.seat(self.lane_work.replica, self.lane_work.replicas)  # elastic replicas: this round's
        if not stats.replayed and self._rounds_landed_here:
            # The round's own time, what the next hand-over reports (sync_every="auto"): its phases but
            # the waits for the other replicas (none yet on CUDA before the device has passed them).
            # Not the first round this process lands (it makes the comm lane's connections), nor a
            # restored one (it ran in the saving run: the last times measured stay).
            self.pacing.round_timed(sum(s for phase, s in stats.phase_seconds.items() if phase not in _PEER_PHASES))
        self._rounds_landed_here += 1
        every = self.pacing.sync_every  # the landing round's H (the report may choose the next one's)
        self.pacing.landed(getattr(round_, "report", None), stats.index)  # (a restored round: as the state saved it)
        # (No inner step since the launch: the new global values themselves, bit for bit.)
        keep = clock.keeps_progress and not discard and clock.inner_steps > clock.launched_at
        clock.late = False
        # "keep"'s landing leaves the start's offset from the new global values in handed_over.
        clock.offset_steps = clock.inner_steps - clock.launched_at if keep else 0
        clock.offset_every = every
        with record_function("acco.load_params"):
            for number, group in enumerate(self._groups):
                self.global_values[number].copy_(group.gathered)
                if keep:
                    group.add_params_from_buffer(clock.handed_over[number])
                else:
                    group.load_params_from_buffer()
            self._land_buffers(round_)
        clock.unsynced = keep
        clock.launched_at = None
        clock.outer_rounds += 1
        clock.skipped_outer_rounds += int(stats.skipped)
        return True

    def _stall_watch(self) -> Callable[[LaneRound], None] | None:
        """What a wait for a round watches while the replicas' plans differ: how long the comm
        lane has been waiting for the others' hand-overs (the round's ``totals``), which
        :meth:`Pacing.check_stall` bounds; None: nothing to watch (equal plans)."""
        bound = self.pacing.stall_bound(self._parts.options.timeout.total_seconds())
        if bound is None:
            return None
        since = time.perf_counter()

        def watch(round_: LaneRound) -> None:
            nonlocal since
            now = time.perf_counter()
            if round_.stats.phase != "totals":  # not (or no longer) waiting for the others' hand-overs
                since = now
                return
            self.pacing.check_stall(now - since, bound, round_.stats.index)

        return watch

    @property
    def outer_rounds(self) -> int:  # type: ignore[override]
        return self.clock.outer_rounds

    @property
    def skipped_outer_rounds(self) -> int:  # type: ignore[override]
        return self.clock.skipped_outer_rounds

    def global_parameters(self) -> list[list[Tensor]]:
        return [[view.clone() for view in group.views(values)] for group, values in zip(self._groups, self.global_values)]

    def request_stop(self) -> None:
        self.pacing.stop_requested = True

    def stop_after(self, steps: int | None, seconds: float | None) -> None:
        self.pacing.stop_after(steps, seconds)

    @property
    def should_stop(self) -> bool:
        return self.pacing.should_stop

    @property
    def replica(self) -> int:
        return self.pacing.replica

    @property
    def replica_steps(self) -> list[int]:
        return list(self.pacing.plan)

    def eval(self) -> None:
        """Put the global values of the last landed round in the model, this replica's
        parameters set aside until :meth:`train`: on this rank alone, at any step, a round
        in flight or not (nothing waits, nothing is communicated)."""
        if self._evaluating:
            return
        self._evaluating = True
        with record_function("acco.load_params"):
            for group, values in zip(self._groups, self.global_values):
                group.set_live_aside()
                group.load_params(values)

    def train(self, restore: bool) -> None:
        restore, self._evaluating = restore and self._evaluating, False
        for group in self._groups:
            group.take_live_back(restore)

    @property
    def base_optimizers(self) -> list[torch.optim.Optimizer | None]:
        return []  # the base optimizer runs whole on the live parameters: the inner ones

    @property
    def inner_optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self.inner.optimizers)

    @property
    def outer_optimizers(self) -> list[torch.optim.Optimizer | None]:
        return self.lane_work.outer_optimizers

    def state_dict(self) -> dict[str, Any]:
        """The clock, this replica's parameters and inner optimizers' state, and the
        parameters the round in flight was handed (per parameter, so any layout loads them)."""
        handed = self.clock.handed_over
        if handed is not None:
            handed = [per_param(g.plan, h) for g, h in zip(self._groups, handed)]
        # Each replica's own parameters (those eval() set aside, if it did): they differ between
        # outer rounds, and the model's checkpoint is often rank 0's only (acco.checkpoint,
        # consolidate_state_dict). Its pending gradients too: they are this replica's, not a
        # share of a sum over ranks (pending_sums_across_ranks), so a consolidated state keeps them apart.
        in_flight = self._schedule.in_flight
        report = getattr(in_flight, "report", None)
        return {
            **self.clock.state_dict(),
            "flight_report": None if report is None else report.as_dict(),
            # The new global values of the round in flight (state_dict() waited for the comm lane
            # to finish it): a load lands them from here, with no collective. With
            # sync_delay="auto" another replica may have landed this round before its own save,
            # and would never join a collective that rebuilt them.
            "landing_values": None if in_flight is None else [per_param(g.plan, g.gathered) for g in self._groups],
            "handed_over": handed,
            "inner": self.inner.state_dicts(),
            "live": [group.live_values() for group in self._groups],
            "global_values": [per_param(g.plan, v) for g, v in zip(self._groups, self.global_values)],
            "accumulators": [per_param(g.plan, g.grad_accumulator) for g in self._groups],
            "round_weight": self._schedule.current.total(),
            "round_micro_batches": self._schedule.current.micro_batches,
            "replicas": self.lane_work.replicas,
            "place": self.lane_work.place,
            "residuals": None if self.residuals is None else [per_param(g.plan, r) for g, r in zip(self._groups, self.residuals)],
            # overlap="estimate": identical on every rank; a round in flight has already updated it
            "common_terms": None if self.common_terms is None else [per_param(g.plan, c) for g, c in zip(self._groups, self.common_terms)],
            # elastic replicas: the outer state of the round's participants, the lineage (acco.elastic)
            "elastic": self.lane_work.state_dict(),
        }

    def saved_masters(self) -> list[Tensor] | None:
        """Elastic replicas keep no master shard (their outer state is the round's chunks):
        a state dict saves this rank's chunk of the global values in its place, so a portable
        checkpoint (a mesh's) reads as any local-mode one."""
        if self.keeps_master(self._parts.options):
            return None
        out = []
        for group, values in zip(self._groups, self.global_values):
            start, stop = group.plan.rank_range(group.rank)
            chunk = torch.zeros(group.plan.chunk, dtype=group.master_dtype, device=values.device)
            stop = min(stop, values.numel())
            chunk[: max(0, stop - start)] = values[start:stop]
            out.append(chunk)
        return out

    def load_state_dict(self, saved: dict[str, Any], buffer_snapshot: BufferSnapshot | None) -> None:
        """After the groups and the schedule: this replica's own part (``saved["local"]`` is
        this rank's, or on another number of replicas rank 0's: docs/checkpoints.md), then the
        round it saved in flight (:meth:`_restore_in_flight`)."""
        self._load_own_state(saved["local"])
        self._restore_in_flight(saved["local"], buffer_snapshot, saved["round"]["in_flight_kind"] is not None)

    def _restore_in_flight(self, saved: dict[str, Any], buffer_snapshot: BufferSnapshot | None, legacy: bool) -> None:
        """The round this replica saved in flight (finished on its comm lane, not landed), in
        flight again with the new global values it had gathered and its report as exchanged:
        it lands where it would have, and nothing is sent. (With sync_delay="auto" another
        replica may have landed it before its own save, and would never join a collective that
        rebuilt it.) ``legacy``: a state saved before it held those values says a round was in
        flight; its gather leg runs again, as it did then (collective)."""
        if "landing_values" in saved:
            if saved["landing_values"] is None:
                return
            with torch.no_grad():
                for group, values in zip(self._groups, saved["landing_values"]):
                    group.gathered.copy_(full(group.plan, values, group.param_dtype))
            body: Callable[[OuterRound], RoundStats] = _nothing_left
        elif legacy:
            body = self.lane_work.replay
        else:
            return
        report = saved.get("flight_report")
        round_ = OuterRound(kind=RoundKind.OUTER, stats=self._schedule.replayed_stats(RoundKind.OUTER),
                            buffer_snapshot=buffer_snapshot, params=[],
                            report=None if report is None else ReplicaReport.from_dict(report))  # fmt: skip
        round_.stats.sync_every, round_.stats.sync_every_choice = self.pacing.sync_every, self.pacing.choice
        self._schedule.restore(round_, self._submit_with(body))

    def _load_own_state(self, saved: dict[str, Any]) -> None:
        """This replica's clock, parameters, inner optimizers, pending gradients, global values,
        residuals, common terms and (elastic replicas) membership state."""
        self.clock.load_state_dict(saved)
        if saved["handed_over"] is not None:
            self.clock.handed_over = [full(g.plan, values, g.param_dtype).to(g.device)
                                      for g, values in zip(self._groups, saved["handed_over"])]  # fmt: skip
        self.inner.load_state_dicts(saved["inner"])
        with torch.no_grad():
            for group, values in zip(self._groups, saved["live"]):
                torch._foreach_copy_([p.detach() for p in group.locals()], [v.to(group.device) for v in values])
            for group, values, target in zip(self._groups, saved["global_values"], self.global_values):
                target.copy_(full(group.plan, values, group.param_dtype))
            for group, values in zip(self._groups, saved["accumulators"]):
                group.grad_accumulator.copy_(full(group.plan, values, group.reduce_dtype))
        self._schedule.put_back_round_weights(WeightSum(float(saved["round_weight"]), None, int(saved["round_micro_batches"])))
        if self.residuals is not None:
            self._load_residuals(saved)
        if self.common_terms is not None:
            self._load_common_terms(saved)
        if saved.get("elastic") is not None:
            self.lane_work.load_state_dict(saved["elastic"])

    def _load_common_terms(self, saved: dict[str, Any]) -> None:
        """The copies of the outer step's common part; from a state saved without the estimate
        rule, the global values (the outer momentum's part of the first estimate is left out,
        the commit is exact)."""
        estimate = self.clock.options.estimate
        with torch.no_grad():
            for number, (group, target) in enumerate(zip(self._groups, self.common_terms)):
                if saved.get("common_terms") is None:
                    estimate.common(target, self.global_values[number], [], [])
                else:
                    target.copy_(full(group.plan, saved["common_terms"][number], group.param_dtype))

    def _load_residuals(self, saved: dict[str, Any]) -> None:
        """This rank's residuals; zero when the state holds none (saved without error
        feedback) or another rank's (saved at another number of ranks, or resharded to
        another layout, where rank 0's part is every rank's: its residual would count R
        times). What is dropped is less than one quantisation step of each value of the last
        pseudo-gradient sent."""
        saved_residuals = saved.get("residuals")
        if (saved_residuals is None or saved.get("place") != self.lane_work.place
                or any(tuple(v.shape) != tuple(slot.shape) for group, values in zip(self._groups, saved_residuals)
                       for v, slot in zip(values, group.plan.slots))):  # fmt: skip
            for residual in self.residuals:
                residual.zero_()
            return
        with torch.no_grad():
            for group, values, target in zip(self._groups, saved["residuals"], self.residuals):
                target.copy_(full(group.plan, values, torch.float32))

    def buffer_bytes(self) -> list[dict[str, int]]:
        """Adds ``handed_over`` (the parameters the round in flight was handed, with
        ``overlap="keep"``; the replica's start with ``"estimate"``), ``global_values``,
        ``outer_residual`` (``outer_bits`` below 16 with error feedback) and ``common_term``
        (``"estimate"``); ``master`` is the snapshot's shard."""
        sizes = super().buffer_bytes()
        handed = self.clock.handed_over
        for number, entry in enumerate(sizes):
            entry["handed_over"] = 0 if handed is None else handed[number].nbytes
            entry["global_values"] = self.global_values[number].nbytes
            entry["outer_residual"] = 0 if self.residuals is None else self.residuals[number].nbytes
            entry.update(self.lane_work.buffer_bytes(number))  # elastic replicas: the round's outer state
            entry["common_term"] = 0 if self.common_terms is None else self.common_terms[number].nbytes
        return sizes


class InnerSteps:
    """The inner optimizers (one per param group, on the live parameters) and the inner
    update: this replica's mean gradient from its accumulator, clipped over the replica,
    checked for NaN/inf, stepped.

    Args:
        param_groups: the optimizer's param groups (their hyper-parameters are read at each step).
        groups: their sharded buffers (the accumulators hold this replica's gradient sums).
        optimizer_class / defaults: the inner optimizer, as the base optimizer is given.
    """

    def __init__(
        self,
        param_groups: Sequence[dict[str, Any]],
        groups: Sequence[ShardedGroup],
        optimizer_class: type[torch.optim.Optimizer],
        defaults: dict[str, Any],
    ) -> None:
        self._param_groups = param_groups
        self._groups = list(groups)
        self.optimizers = []
        for group in param_groups:
            cls = group["optimizer_class"]
            kwargs = defaults if cls is optimizer_class else {}
            self.optimizers.append(cls([{**base_hyperparams(group), "params": group["params"]}], **kwargs))

    def step(self, weights: WeightSum, max_grad_norm: float | None, nonfinite: NonFinite, step: int) -> tuple[bool, bool]:
        """One inner update from the accumulators (zeroed after); returns whether it was
        applied, and whether it was skipped for NaN/inf (neither: no micro-batch).

        Raises:
            ValueError: invalid weights. FloatingPointError: NaN or inf in the gradients with
            ``nonfinite="raise"`` (nothing updated; the accumulators hold the gradient sums
            again, up to the rounding of dividing and multiplying by the weight).
        """
        total = weights.total()
        if weights.device is not None and float(weights.device[1]):
            raise ValueError(f"accumulate() got {int(weights.device[1])} invalid weight(s) (negative, NaN or inf)")
        if total == 0:
            self._zero_accumulators()
            return False, False
        params, grads = [], []
        for group in self._groups:
            group.grad_accumulator.div_(total)
            for param, view in zip(group.params, group.accumulator_views()):
                param.grad = dtensor_like(view, param) if is_dtensor(param) else view
                params.append(param)
                grads.append(param.grad)
        try:
            norm = torch.nn.utils.get_total_norm(grads)
            if is_dtensor(norm):  # a replica's DTensor gradients: the norm over the replica group
                norm = norm.full_tensor()
            if not math.isfinite(float(norm)):
                if nonfinite is NonFinite.RAISE:
                    for group in self._groups:
                        group.grad_accumulator.mul_(total)  # back to the sums accumulated
                    raise FloatingPointError(f"non-finite gradients in inner step {step} on this replica")
                self._zero_accumulators()
                return False, True
            if max_grad_norm is not None:
                torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, norm)
            for optimizer, group in zip(self.optimizers, self._param_groups):
                optimizer.param_groups[0].update(base_hyperparams(group))
                optimizer.step()
            self._zero_accumulators()
            return True, False
        finally:
            for param in params:
                param.grad = None

    def _zero_accumulators(self) -> None:
        for group in self._groups:
            group.grad_accumulator.zero_()

    def state_dicts(self) -> list[dict[str, Any]]:
        return [optimizer.state_dict() for optimizer in self.optimizers]

    def load_state_dicts(self, saved: Sequence[dict[str, Any]]) -> None:
        """The inner optimizers' state dicts; a DTensor parameter's state may come as its local
        blocks (a heal moves each rank's own), which become DTensors like the parameter."""
        for optimizer, state in zip(self.optimizers, saved):
            optimizer.load_state_dict(state)
            for param, entry in optimizer.state.items():
                if not is_dtensor(param):
                    continue
                for key, value in entry.items():
                    if isinstance(value, Tensor) and not is_dtensor(value) and value.shape == local_tensor(param).shape:
                        entry[key] = dtensor_like(value, param)


@dataclass
class LocalClock:
    """When outer rounds launch and land, counted in this replica's inner steps; how many
    steps each replica takes per round, and when every replica stops, is :attr:`pacing`'s.

    Attributes:
        options: ``sync_every``, ``sync_delay``, ``overlap``.
        pacing: this replica's part in the rounds (:class:`acco.replicas.Pacing`).
        inner_steps: ``step()`` calls so far.
        launched_at: the inner step the round in flight was launched after (None: none).
        unsynced: the live parameters hold progress that no outer round has carried yet.
        outer_rounds / skipped_outer_rounds: landed outer rounds, and those that changed
            nothing (NaN/inf in some replica's parameters with ``nonfinite="skip"``).
        offset_steps: inner steps the replica took from the last landed round's start before
            that landing corrected it (0: not landed with its progress kept); ``handed_over``
            then holds that start's offset from the new global values.
        offset_every: H of the round that landing was (what the offset's share is of).
        handed_over: per param group, the parameters the round in flight was handed
            (``overlap="keep"`` with a delay, or a blocking round that lands late: what the
            landing subtracts), or None.
        late: the round in flight passed its landing point while waiting for the other
            replicas' hand-overs, and this replica went on stepping; it lands once complete.
        late_since: when it did (``time.perf_counter()``; not saved).
        late_at: the inner step it did at.
        round_delay: with the default landing, the round in flight's delay, as the planner chose
            it at its launch.
    """

    options: LocalOptions
    pacing: Pacing = field(init=False)
    inner_steps: int = 0
    launched_at: int | None = None
    unsynced: bool = False
    outer_rounds: int = 0
    skipped_outer_rounds: int = 0
    handed_over: list[Tensor] | None = field(default=None, repr=False)
    offset_steps: int = 0
    offset_every: int = 0
    late: bool = False
    late_since: float = 0.0
    late_at: int = 0
    round_delay: int = 0

    def __post_init__(self) -> None:
        self.pacing = Pacing(self.options)

    def stepped(self, weight: float) -> None:
        """An inner step ended (``weight``: its update's, 0 if none was applied)."""
        self.inner_steps += 1
        self.unsynced = True
        self.pacing.stepped(weight)

    def lands_after(self, steps: int, done: bool) -> bool:
        """Whether the round in flight lands once ``steps`` inner steps are done (``done``:
        the comm lane has finished it, which lands it there with ``sync_delay="auto"``, at
        the latest at this replica's next launch)."""
        if self.launched_at is None:
            return False
        since = steps - self.launched_at
        if self.options.auto_delay:
            return since > 0 and (done or since >= self.pacing.target)
        return since >= self.delay

    def launches_now(self, ahead: int = 0) -> bool:
        return self.pacing.launches_now(self.inner_steps, ahead)

    @property
    def delay(self) -> int | str:
        """The round in flight's (or the next one's) landing: ``sync_delay``, or with the
        default landing the planner's for it (0, or 1: a step after its launch)."""
        return self.round_delay if self.options.landing == BLOCK_OR_HIDE else self.options.sync_delay

    @property
    def overlaps(self) -> bool:
        """Inner steps run while the round in flight is (it does not block)."""
        return self.delay != 0

    @property
    def keeps_progress(self) -> bool:
        """Whether a landing adds the progress made since the launch to the new global values:
        the overlap rule's (``"keep"``, ``"estimate"``), and a blocking round's that lands late
        (every inner step counts once)."""
        if self.overlaps:
            return self.options.overlap in (Overlap.KEEP, Overlap.ESTIMATE)
        return self.late

    @property
    def estimates(self) -> bool:
        """Whether a launch moves the replica to its estimate of the outer step (``handed_over``
        then holds that start, not the parameters handed)."""
        return self.options.overlap is Overlap.ESTIMATE and self.overlaps

    def state_dict(self) -> dict[str, Any]:
        """The counters and the pacing's state (``handed_over`` is the optimizer's to save, per
        parameter)."""
        return {
            "inner_steps": self.inner_steps,
            "launched_at": self.launched_at,
            "unsynced": self.unsynced,
            "outer_rounds": self.outer_rounds,
            "skipped_outer_rounds": self.skipped_outer_rounds,
            "offset_steps": self.offset_steps,
            "offset_every": self.offset_every,
            "late": self.late,
            "late_at": self.late_at,
            "round_delay": self.round_delay,
            **self.pacing.state_dict(),
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.inner_steps, self.launched_at = int(saved["inner_steps"]), saved["launched_at"]
        self.unsynced = bool(saved["unsynced"])
        self.outer_rounds, self.skipped_outer_rounds = int(saved["outer_rounds"]), int(saved["skipped_outer_rounds"])
        self.offset_steps = int(saved.get("offset_steps", 0))
        self.offset_every = int(saved.get("offset_every", 0))
        self.late, self.late_since = bool(saved.get("late", False)), time.perf_counter()
        self.late_at = int(saved.get("late_at", self.inner_steps))
        self.round_delay = int(saved.get("round_delay", 0))
        since = self.inner_steps % self.options.sync_every if self.launched_at is None else self.inner_steps - self.launched_at
        self.pacing.load_state_dict(saved, since)
