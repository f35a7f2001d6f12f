"""What each round did: :class:`RoundStats`, and the :class:`StatsRecorder` that fills them.

On CUDA the times come from timing events on the two streams, which are known only once
the GPU has passed them; the recorder keeps each round's raw stamps and turns them into
seconds when they are (``resolve()``), so reading telemetry never blocks the training
thread. Only the recorder writes a ``RoundStats``' private fields. See docs/design.md,
"Telemetry".
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor
from torch.profiler import record_function

from acco.options import RoundKind
from acco.streams import DeviceHooks, Stamp

__all__ = ["RoundStats", "StatsRecorder"]


@dataclass
class RoundStats:
    """What one round did, on this rank.

    Times are ``time.perf_counter()`` seconds on CPU. On CUDA they are GPU times, from
    timing events on the streams (seconds since the lane was made): the lane's times from
    the side stream, the waits from the training thread's stream, where a wait is the time
    that stream sat idle at the round boundary for the round's result. They are filled in
    once the GPU has passed those events (at the latest by ``finish()``); reading them never
    blocks the training thread before then.

    Attributes:
        index: rounds are numbered from 0 in launch order, the same on every rank.
        kind: ``RoundKind.ESTIMATE`` or ``RoundKind.COMMIT`` (``RoundKind.OUTER`` in
            ``mode="local"``: the replicas' parameters reduced, the outer update, the new
            global values gathered).
        local_micro_batches / local_weight: what this rank accumulated during the round
            (0 for an outer round, which carries parameters).
        global_micro_batches / global_weight: the same summed over all ranks.
        update_weight: the global weight the update divided by (an acco commit covers two
            rounds; an outer round: the replicas whose mean it takes, each counted once).
        lane_start / lane_end: when the comm lane started and finished the round.
        phase_seconds: time spent in each lane phase (``unscale`` with a GradScaler,
            ``totals``: the small all-reduce of
            weights and flags, ``reduce-scatter``, ``grad-norm`` with ``max_grad_norm``,
            ``update``, ``all-gather``, ``buffers`` when module buffers are kept identical).
        phase_cpu_seconds: CPU time the lane's thread spent in each phase (host time only;
            on CPU the rest of a phase's time is waiting for the network).
        wait_seconds / wait_start / wait_end: how long (and when) the compute lane
            blocked in ``step()`` for this round.
        patience_seconds: how long ``step()`` waited, before that, for the other replicas'
            hand-overs until this replica went on stepping and landed the round late
            (``mode="local"``; host time): also time spent waiting for the round.
        grad_norm: the global 2-norm of the averaged gradient before clipping (only with
            ``max_grad_norm``).
        skipped: the round saw non-finite gradients and, with ``nonfinite="skip"``,
            changed nothing.
        collective_bytes: bytes of this rank's reduce-scatter input and all-gather output at
            full precision (a ring sends (N-1)/N of them per rank; 0 for a light estimate
            round, whose quantised payload is smaller, and for a skipped or replayed one).
        replayed: the round was re-created by ``load_state_dict()`` from a checkpoint's
            round in flight: it only all-gathers its saved result again.
        replicas: an outer round's report of every replica's hand-over (inner steps, tokens,
            seconds per step, stop requests: :class:`acco.local.ReplicaReport`); None otherwise.
        sync_every: an outer round's H, the fastest replica's inner steps in it (with
            ``sync_every="auto"``, what the planner chose); None otherwise.
        sync_every_choice: with ``sync_every="auto"``, why the round has its H: the step time
            and round time the planner chose it from, and the H they asked for
            (:class:`acco.replicas.EveryChoice`); None for the first rounds (the lower bound)
            and otherwise.
        phase: the lane phase the round is in (or failed in); ``"queued"`` before it starts.
        participants: an elastic outer round's replica groups (:mod:`acco.elastic`); None otherwise.
        dropped: an elastic outer round some participant failed: it changed nothing (each
            replica keeps its parameters; the next round carries its inner steps).
        content_heal: an elastic outer round in which this replica group took the others'
            global values (it had missed a round they landed; :mod:`acco.elastic`).
        counted: an elastic outer round's count of this replica group's inner steps that its
            landed update included (0: dropped, skipped, or its steps replaced by a heal);
            None otherwise.
        spread: an elastic outer round's seconds from its median participant's hand-over to
            its last one's (what the adaptive grace window measures); None otherwise.
    """

    index: int
    kind: RoundKind
    local_micro_batches: int
    local_weight: float
    global_micro_batches: int = 0
    global_weight: float = 0.0
    update_weight: float = 0.0
    lane_start: float = math.nan
    lane_end: float = math.nan
    phase_seconds: dict[str, float] = field(default_factory=dict)
    phase_cpu_seconds: dict[str, float] = field(default_factory=dict)
    wait_seconds: float = 0.0
    patience_seconds: float = 0.0
    wait_start: float = math.nan
    wait_end: float = math.nan
    grad_norm: float = math.nan
    skipped: bool = False
    replayed: bool = False
    replicas: Any = None
    sync_every: int | None = None
    sync_every_choice: Any = None
    phase: str = "queued"
    participants: int | None = None
    dropped: bool = False
    content_heal: bool = False
    counted: int | None = None
    spread: float | None = None
    collective_bytes: int = 0
    # The raw stamps, turned into the fields above by StatsRecorder.resolve().
    _stamps: dict[str, Stamp] = field(default_factory=dict, repr=False, compare=False)
    _phases: list[tuple[str, Stamp, Stamp]] = field(default_factory=list, repr=False, compare=False)
    _norm: Callable[[float], Tensor] | None = field(default=None, repr=False, compare=False)

    @property
    def lane_seconds(self) -> float:
        return self.lane_end - self.lane_start

    @property
    def hidden_share(self) -> float:
        """Share of the round's comm-lane time that ran while the compute lane computed
        (did not overlap the compute lane's wait for it), in [0, 1]."""
        if not self.lane_seconds > 0:
            return 1.0
        waited_during_round = max(0.0, min(self.lane_end, self.wait_end) - max(self.lane_start, self.wait_start))
        return min(1.0, max(0.0, 1.0 - waited_during_round / self.lane_seconds))


class StatsRecorder:
    """Stamps rounds on either lane and keeps the last ``keep`` rounds' stats.

    The comm lane calls :meth:`lane_start`, :meth:`phase`, :meth:`grad_norm` and
    :meth:`lane_end` while it runs a round; the compute lane calls :meth:`landed` once it
    has waited for the round.
    """

    def __init__(self, device_hooks: DeviceHooks, keep: int = 1024) -> None:
        self._device_hooks = device_hooks
        self._history: collections.deque[RoundStats] = collections.deque(maxlen=keep)
        self._unresolved: collections.deque[RoundStats] = collections.deque()

    def stamp(self) -> Stamp:
        """Now, on the calling thread's lane (its current stream on CUDA)."""
        return self._device_hooks.stamp()

    def lane_start(self, stats: RoundStats) -> None:
        stats._stamps["lane_start"] = self.stamp()

    def lane_end(self, stats: RoundStats) -> None:
        stats._stamps["lane_end"] = self.stamp()

    @contextmanager
    def phase(self, stats: RoundStats, name: str) -> Iterator[None]:
        """A named phase of a round on the comm lane (also a profiler label)."""
        stats.phase = name
        started, cpu = self.stamp(), time.thread_time()
        with record_function(f"acco.{name}"):
            yield
        stats._phases.append((name, started, self.stamp()))
        stats.phase_cpu_seconds[name] = stats.phase_cpu_seconds.get(name, 0.0) + time.thread_time() - cpu

    def grad_norm(self, stats: RoundStats, read: Callable[[float], Tensor]) -> None:
        """The norm before clipping, as a host copy the lane has started (read once done)."""
        stats._norm = read

    def landed(self, stats: RoundStats, wait_start: Stamp) -> None:
        """The compute lane waited for the round from ``wait_start`` until now."""
        stats._stamps.update(wait_start=wait_start, wait_end=self.stamp())
        self._history.append(stats)
        self._unresolved.append(stats)
        self.resolve(block=False)

    def resolve(self, block: bool) -> None:
        """Turn stamps into seconds, oldest round first, as far as the device has passed
        them (``block``: wait until it has)."""
        while self._unresolved and _resolve(self._unresolved[0], block):
            self._unresolved.popleft()

    @property
    def history(self) -> collections.deque[RoundStats]:
        self.resolve(block=False)
        return self._history


def _resolve(stats: RoundStats, block: bool) -> bool:
    """Fill in ``stats``' times from its stamps; False while the device has not passed them."""
    times = {key: stamp.seconds(block) for key, stamp in stats._stamps.items()}
    phases = [(name, a.seconds(block), b.seconds(block)) for name, a, b in stats._phases]
    if any(t is None for t in times.values()) or any(a is None or b is None for _, a, b in phases):
        return False
    for key, value in times.items():
        setattr(stats, key, value)
    if "wait_end" in times:
        stats.wait_seconds = stats.wait_end - stats.wait_start
    stats.phase_seconds = {}
    for name, a, b in phases:
        stats.phase_seconds[name] = stats.phase_seconds.get(name, 0.0) + b - a
    if stats._norm is not None:
        stats.grad_norm = float(stats._norm(math.inf))  # a host copy the lane has finished
    stats._stamps, stats._phases, stats._norm = {}, [], None
    return True
