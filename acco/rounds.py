"""Rounds: what a round is, and the schedule that says which kind comes next.

A round is the time between two ``step()`` calls (docs/design.md, "Rounds and their state
machine"). In ``acco`` mode estimate and commit rounds alternate, starting with an
estimate; in ``dpu`` and ``sync`` every round commits. The weights of the micro-batches
folded since the last commit's hand-over are what the next update divides by; an estimate
round's gradients stay in the accumulator for the commit round after it.
"""

from __future__ import annotations

from concurrent.futures import TimeoutError as FutureTimeoutError
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.profiler import record_function

from torch import Tensor

from acco.folding import WeightSum
from acco.streams import LaneFuture
from acco.module_buffers import BufferSnapshot
from acco.options import Mode, RoundKind
from acco.telemetry import RoundStats, StatsRecorder

__all__ = ["CommLaneError", "Round", "RoundSchedule"]


class CommLaneError(RuntimeError):
    """A round failed on the comm lane; raised at the next call on the compute lane."""


@dataclass
class Round:
    """A round handed to the comm lane: its inputs, and its result once it lands.

    Attributes:
        kind: estimate or commit.
        grads: per param group, the hand-over buffer the round reduces and gathers into.
        update_weight: the weights the update divides by (since the last commit's hand-over).
        round_weight: the weights of this round's own micro-batches.
        hyperparams: per param group, the hyper-parameters when the round was handed over.
        stats: its telemetry.
        future: the comm lane's result.
        buffer_snapshot: the module buffers the round synchronises (None: none kept).
        waited: the compute lane has already waited for it (e.g. ``state_dict()`` did).
        inv_scale: a GradScaler's inverse scale, which this rank's gradients are multiplied
            by before they are summed (:mod:`acco.amp`); None without a scaler.
    """

    kind: RoundKind
    grads: list[Tensor]
    update_weight: WeightSum
    round_weight: WeightSum
    hyperparams: list[dict[str, Any]]
    stats: RoundStats
    future: LaneFuture[RoundStats] | None = None
    buffer_snapshot: BufferSnapshot | None = None
    waited: bool = False
    inv_scale: Tensor | None = None


class RoundSchedule:
    """The round state machine: which kind of round the next hand-over launches, how many
    were launched, the weight sums the next rounds divide by, the round in flight, and the
    failure that ended the schedule (if any).

    Args:
        mode: the optimizer's mode.
        recorder: told when the compute lane has waited for a round.
        wait_seconds: how long a wait for the comm lane may take.
    """

    def __init__(self, mode: Mode, recorder: StatsRecorder, wait_seconds: float) -> None:
        self.mode = mode
        self.next_kind = {Mode.ACCO: RoundKind.ESTIMATE, Mode.LOCAL: RoundKind.OUTER}.get(mode, RoundKind.COMMIT)
        self.launched = 0
        self.pending = WeightSum()  # since the last commit's hand-over: the next update's
        self.current = WeightSum()  # since the last hand-over: this round's
        self.in_flight: Round | None = None
        self.failure: BaseException | None = None
        self.failed: Round | None = None  # a round that failed or timed out: close() keeps its tensors
        self._recorder = recorder
        self._wait_seconds = wait_seconds

    def count(self, weight: float | Tensor) -> None:
        """A micro-batch ended with ``weight``."""
        self.pending.add(weight)
        self.current.add(weight)

    def launch(
        self,
        grads: list[Tensor],
        hyperparams: list[dict[str, Any]],
        buffer_snapshot: BufferSnapshot | None,
        submit: Callable[[Round], LaneFuture[RoundStats]],
        inv_scale: Tensor | None = None,
        weight: WeightSum | None = None,
    ) -> None:
        """Put the next round, with the weights accumulated for it, in flight (``submit``
        hands it to the comm lane); advances the schedule. ``weight``: what this rank brings
        instead of its micro-batches' weights (an outer round: each replica counts once)."""
        kind = self.next_kind
        pending, current = (self.pending, self.current) if weight is None else (weight, weight)
        stats = RoundStats(self.launched, kind, current.micro_batches, current.host)
        round_ = Round(kind, grads, pending.copy(), current.copy(), hyperparams, stats, None, buffer_snapshot,
                       inv_scale=inv_scale)
        if kind is RoundKind.COMMIT:
            self.pending = WeightSum()
        self.current = WeightSum()
        self.launched += 1
        self.next_kind = self.following(kind)
        round_.future = submit(round_)
        self.in_flight = round_

    def take_in_flight(self) -> Round | None:
        """The round in flight, which is no longer in flight afterwards."""
        round_, self.in_flight = self.in_flight, None
        return round_

    def wait(self, round_: Round) -> RoundStats:
        """The round's stats once the comm lane has finished it (at once if already waited
        for). A failure or a timeout is kept in ``failure`` and re-raised."""
        if round_.waited:
            return round_.stats
        started = self._recorder.stamp()
        try:
            with record_function("acco.wait"):
                stats = round_.future.result(timeout=self._wait_seconds)
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

    def following(self, kind: RoundKind) -> RoundKind:
        """The kind of round after one of ``kind``."""
        if self.mode is Mode.ACCO:
            return RoundKind.COMMIT if kind is RoundKind.ESTIMATE else RoundKind.ESTIMATE
        return RoundKind.OUTER if self.mode is Mode.LOCAL else RoundKind.COMMIT

    def take_weights(self) -> WeightSum:
        """The weights of the micro-batches since the last inner update (``mode="local"``),
        which start again from zero."""
        weights, self.pending, self.current = self.current, WeightSum(), WeightSum()
        return weights

    def replay(
        self,
        kind: RoundKind,
        buffer_snapshot: BufferSnapshot | None,
        submit: Callable[[Round], LaneFuture[RoundStats]],
    ) -> None:
        """Put the last launched round, re-created from a checkpoint, in flight again: only
        its all-gather runs (``submit``)."""
        stats = RoundStats(self.launched - 1, kind, 0, 0.0, replayed=True)
        round_ = Round(kind, [], WeightSum(), WeightSum(), [], stats, None, buffer_snapshot)
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
