"""Rounds: what a round is, and the schedule that says which kind comes next.

A round is the time between two ``step()`` calls (docs/design.md, "Rounds and their state
machine"). Which kinds of round a mode launches, and in what order, is its loop's fact
(:mod:`acco.loops`, :mod:`acco.local`): in ``acco`` mode estimate and commit rounds
alternate, starting with an estimate; in ``dpu`` and ``sync`` every round commits; in
``local`` every round is an outer round. The weights of the micro-batches folded since the
last commit's hand-over are what the next update divides by; an estimate round's gradients
stay in the accumulator for the commit round after it.
"""

from __future__ import annotations

import time
from concurrent.futures import TimeoutError as FutureTimeoutError
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.profiler import record_function

from torch import Tensor

from acco.folding import WeightSum
from acco.streams import LaneFuture
from acco.module_buffers import BufferSnapshot
from acco.options import RoundKind
from acco.telemetry import RoundStats, StatsRecorder

__all__ = ["CommLaneError", "LaneRound", "Round", "RoundSchedule", "WATCH_SECONDS"]

# How often a watched wait (RoundSchedule.wait's ``watch``) looks at the round in flight.
WATCH_SECONDS = 0.25


class CommLaneError(RuntimeError):
    """A round failed on the comm lane; raised at the next call on the compute lane."""


@dataclass(kw_only=True)
class LaneRound:
    """A round handed to the comm lane, whatever it carries: its kind, its telemetry, its
    result once it lands.

    Attributes:
        kind: what the round does (:class:`~acco.options.RoundKind`).
        stats: its telemetry.
        buffer_snapshot: the module buffers the round synchronises (None: none kept).
        future: the comm lane's result.
        waited: the compute lane has already waited for it (e.g. ``state_dict()`` did).
    """

    kind: RoundKind
    stats: RoundStats
    buffer_snapshot: BufferSnapshot | None = None
    future: LaneFuture[RoundStats] | None = None
    waited: bool = False


@dataclass(kw_only=True)
class Round(LaneRound):
    """A gradient round (estimate or commit): the gradients handed over and their weights.

    Attributes:
        grads: per param group, the hand-over buffer the round reduces and gathers into.
        update_weight: the weights the update divides by (since the last commit's hand-over).
        round_weight: the weights of this round's own micro-batches.
        hyperparams: per param group, the hyper-parameters when the round was handed over.
        inv_scale: a GradScaler's inverse scale, which this rank's gradients are multiplied
            by before they are summed (:mod:`acco.amp`); None without a scaler.
    """

    grads: list[Tensor]
    update_weight: WeightSum
    round_weight: WeightSum
    hyperparams: list[dict[str, Any]]
    inv_scale: Tensor | None = None


class RoundSchedule:
    """The round state machine: which kind of round the next hand-over launches, how many
    were launched, the weight sums the next rounds divide by, the round in flight, and what
    ended the schedule (a failure, or the optimizer finished or closed).

    Args:
        kinds: the kinds of round a loop launches, in the order they repeat (acco: estimate,
            commit; dpu and sync: commit; local: outer): the loop's, not this class's, fact.
        recorder: told when the compute lane has waited for a round.
        wait_seconds: how long a wait for the comm lane may take.
    """

    def __init__(self, kinds: tuple[RoundKind, ...], recorder: StatsRecorder, wait_seconds: float) -> None:
        if not kinds:
            raise AssertionError("a loop launches at least one kind of round")
        self.kinds = kinds
        self.next_kind = kinds[0]
        self.launched = 0
        self.pending = WeightSum()  # since the last commit's hand-over: the next update's
        self.current = WeightSum()  # since the last hand-over: this round's
        self.in_flight: LaneRound | None = None
        self.failure: BaseException | None = None
        self.failed: LaneRound | None = None  # a round that failed or timed out: close() keeps its tensors
        self.closed = False  # finish() or close(): no round launches any more
        self._recorder = recorder
        self._wait_seconds = wait_seconds

    def check_usable(self, call: str) -> None:
        """``RuntimeError`` naming ``call`` once a round failed or the optimizer is finished."""
        if self.failure is not None:
            raise RuntimeError(f"{call}() after the comm lane failed: {self.failure}") from self.failure
        if self.closed:
            raise RuntimeError(f"{call}() after finish() or close(): the optimizer is finished")

    def count(self, weight: float | Tensor) -> None:
        """A micro-batch ended with ``weight``."""
        self.pending.add(weight)
        self.current.add(weight)

    def next_stats(self, micro_batches: int, weight: float) -> RoundStats:
        """Fresh telemetry for the round the next :meth:`launch` puts in flight."""
        return RoundStats(self.launched, self.next_kind, micro_batches, weight)

    def hand_over_weights(self) -> tuple[WeightSum, WeightSum]:
        """The weights a gradient round of ``next_kind`` divides by (those since the last
        commit's hand-over) and its own (since the last hand-over); both start again from
        zero as the round is handed over (the first only after a commit)."""
        pending, current = self.pending.copy(), self.current.copy()
        if self.next_kind is RoundKind.COMMIT:
            self.pending = WeightSum()
        self.current = WeightSum()
        return pending, current

    def launch(self, round_: LaneRound, submit: Callable[[LaneRound], LaneFuture[RoundStats]]) -> None:
        """Put ``round_`` (of ``next_kind``) in flight (``submit`` hands it to the comm
        lane); advances the schedule."""
        if round_.kind is not self.next_kind:
            raise AssertionError(f"launching a {round_.kind.value} round where a {self.next_kind.value} round is due")
        self.launched += 1
        self.next_kind = self.following(round_.kind)
        round_.future = submit(round_)
        self.in_flight = round_

    def take_in_flight(self) -> LaneRound | None:
        """The round in flight, which is no longer in flight afterwards."""
        round_, self.in_flight = self.in_flight, None
        return round_

    def wait(self, round_: LaneRound, watch: Callable[[LaneRound], None] | None = None) -> RoundStats:
        """The round's stats once the comm lane has finished it (at once if already waited
        for); ``watch(round_)``, if given, is called every :data:`WATCH_SECONDS` meanwhile and
        may raise to end the wait. A failure, a timeout or ``watch``'s error is kept in
        ``failure`` and re-raised."""
        if round_.waited:
            return round_.stats
        started = self._recorder.stamp()
        try:
            with record_function("acco.wait"):
                stats = self._result(round_, watch)
        except FutureTimeoutError:
            self.failed = round_  # its device work may still read its tensors
            self.failure = TimeoutError(
                f"{round_.kind.value} round {round_.stats.index} still running on the comm lane after "
                f"{self._wait_seconds:.0f}s (phase: {round_.stats.phase}); another rank may be "
                "dead or no longer calling step()"
            )
            raise self.failure from None
        except BaseException as error:
            self.failed, self.failure = round_, error
            raise
        round_.waited = True
        self._recorder.landed(stats, started)
        return stats

    def _result(self, round_: LaneRound, watch: Callable[[LaneRound], None] | None) -> RoundStats:
        if watch is None:
            return round_.future.result(timeout=self._wait_seconds)
        deadline = time.monotonic() + self._wait_seconds
        while True:
            left = deadline - time.monotonic()
            try:
                return round_.future.result(timeout=max(0.0, min(WATCH_SECONDS, left)))
            except FutureTimeoutError:
                if left <= WATCH_SECONDS:
                    raise
            watch(round_)

    def following(self, kind: RoundKind) -> RoundKind:
        """The kind of round after one of ``kind``."""
        return self.kinds[(self.kinds.index(kind) + 1) % len(self.kinds)]

    def take_round_weights(self) -> WeightSum:
        """The weights of this round's micro-batches (since the last ``step()``), for a loop
        that applies them on the training thread (``mode="local"``'s inner steps); every
        sum starts again from zero."""
        weights, self.pending, self.current = self.current, WeightSum(), WeightSum()
        return weights

    def put_back_round_weights(self, weights: WeightSum) -> None:
        """Undo :meth:`take_round_weights` (the update failed before it applied anything)."""
        self.pending, self.current = weights, weights.copy()

    def replayed_stats(self, kind: RoundKind) -> RoundStats:
        """Telemetry for the last launched round, re-created from a checkpoint."""
        return RoundStats(self.launched - 1, kind, 0, 0.0, replayed=True)

    def restore(self, round_: LaneRound, submit: Callable[[LaneRound], LaneFuture[RoundStats]]) -> None:
        """Put ``round_``, the last launched round re-created from a checkpoint, in flight again
        (``submit`` hands what is left of it to the comm lane); the schedule counts it already."""
        round_.future = submit(round_)
        self.in_flight = round_

    def state_dict(self) -> dict[str, Any]:
        return {
            "rounds_launched": self.launched,
            "next_kind": self.next_kind.value,
            "in_flight_kind": None if self.in_flight is None else self.in_flight.kind.value,
            "pending_weight": self.pending.total(),
            "pending_micro_batches": self.pending.micro_batches,
            "round_weight": self.current.total(),
            "round_micro_batches": self.current.micro_batches,
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.launched = int(saved["rounds_launched"])
        self.next_kind = RoundKind(saved["next_kind"])
        self.pending = WeightSum(float(saved["pending_weight"]), None, int(saved["pending_micro_batches"]))
        self.current = WeightSum(float(saved["round_weight"]), None, int(saved["round_micro_batches"]))
