"""mode="local": who takes part in an outer round, how many inner steps each replica takes
for it, with what weight its pseudo-gradient counts, and when every replica stops.

One owner for that concern (docs/design.md, "Replicas of different speeds"): the local loop
(:mod:`acco.local`) asks :class:`Pacing` whether a round launches now, hands its
:class:`HandOver` to each round and gives it the round's :class:`ReplicaReport` when the
round lands; the comm lane weighs the replicas' pseudo-gradients by
:meth:`ReplicaReport.factors`.

- **Weights** (``outer_weighting``): each replica's pseudo-gradient counts by the
  ``accumulate()`` weights its updates trained on since its last hand-over (``"tokens"``),
  once (``"equal"``), or by FedNova's normalisation (``"normalized"``).
- **Pacing** (``pacing``): each replica's inner steps per round: ``sync_every`` each
  (``"lockstep"``), a fixed list, or in proportion to its measured speed (``"speed"``),
  the fastest ``sync_every``, from the speeds every replica reported in the last round, once
  a replica is slower than the fastest by more than :data:`SPEED_BAND` in
  :data:`APART_REPORTS` successive rounds (or by more than twice that in one); when plans first
  differ rank 0 says so once. Once paced apart, a replica does not wait long for the others'
  hand-overs (:meth:`Pacing.patience`):
  it goes on taking inner steps, and the round lands when it completes, so a loop's own
  collective at every step never waits in a circle; a round the others never hand over to raises
  :class:`PacingStall`.
- **How often** (``sync_every="auto"``, the default): H for the next round, chosen at each
  landing by :func:`plan_sync_every` from the report's paces and the round times the replicas
  measured, with why (:class:`EveryChoice`).
- **Stopping together**: a replica's stop request travels in its next hand-over; once that
  round has landed every replica's ``should_stop`` is True, at the same round. A replica that
  calls ``finish()`` while the others train ends the run the same way.

Every rank derives the same plan and the same stop from the same report, which the round's
first all-reduce carries: no collective of its own.
"""

from __future__ import annotations

import collections
import logging
import math
import statistics
import time
import warnings
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from acco.options import BLOCK_OR_HIDE, FIT, FIXED, SPEED, LocalOptions, Weighting

__all__ = ["APART_REPORTS", "AUTO_GROWTH", "AUTO_HYSTERESIS", "AUTO_WAIT_SHARE", "EveryChoice", "HIDDEN_STEPS", "HIDDEN_WAIT_SHARE", "HIDE_COST",
           "HandOver", "PACE_BLOCK", "PATIENCE_ROUNDS", "PATIENCE_SECONDS", "PEER_LATE_STEPS", "PEER_PATIENCE",
           "PEER_PATIENCE_SECONDS", "Pacing", "PacingStall", "ROUND_WINDOW", "ReplicaReport", "SPEED_BAND",
           "STALL_ROUNDS", "STALL_SHARE", "block_median", "pace_window", "plan_sync_every"]

_log = logging.getLogger("acco")

# Speed pacing engages only on a real speed gap (docs/loops.md, "Replicas of different speeds",
# and benchmarks/pacing_loops.py, which measured the rule). A replica's pace is measured from its
# step-to-step times over its last pace_window() steps, leaving out the steps in which step()
# waited for a round while PACE_BLOCK others are timed: after a round, the replica whose comm lane
# finished first may wait for the other in the loop's own collective, which is not its speed. The
# pace is the median of the means of PACE_BLOCK consecutive steps: a loop with a collective at
# every step makes the replicas' step times equal over a few steps but not one by one (their
# compute takes turns being the longer), so a median of single steps differed by up to 12%
# between equal replicas on loaded cores, where the median of blocks stayed within 6%
# (pacing_loops.py); one long step (an evaluation, a checkpoint) moves one block.
# A replica takes fewer than sync_every steps only when it is slower than the fastest by more
# than SPEED_BAND in APART_REPORTS successive reports (one noisy round does not pace equal
# replicas apart), or by more than twice SPEED_BAND in one (no noise measured comes near: a
# replica 1.5x or 3x slower is paced from the second round on).
SPEED_BAND = 0.2
PACE_BLOCK = 4
APART_REPORTS = 2
# Once speed pacing gave the replicas different plans, a replica whose round must land waits for
# the others' hand-overs as long as the plan expects (the longest planned round less its own, at
# the last report's paces) and PATIENCE_ROUNDS of the longest planned round more (at least
# PATIENCE_SECONDS), then goes on taking inner steps and lands the round when it completes: a
# loop's own collective at a step count then meets every replica at that step, and nothing waits
# in a circle. PacingStall is raised only once a round has waited for the others' hand-overs
# longer than the longest planned round times STALL_ROUNDS, and at least STALL_SHARE of the
# optimizer's timeout: some replica stopped stepping.
PATIENCE_ROUNDS = 0.25
PATIENCE_SECONDS = 0.05
# sync_every="auto": a round (blocking, or hidden behind a step by the default landing) waits for
# the link, not for a replica a little behind (the
# phases of equal replicas drift by a good share of a step per round on a busy machine, and the
# skew grows with H: on 2 CPU ranks it was most of the wait at H = 4 on an unlimited link, and
# half of it at H = 30 behind 20 Mbit/s). A replica whose round still waits for the others'
# hand-overs after this share of one of its inner steps goes on with its next step and lands the
# round after it, that step's progress kept on the new global values (a late landing, as paced
# replicas do); the last replica to hand over waits for the round's transfer alone.
PEER_PATIENCE = 0.05
# ... and it lands that round after at most PEER_LATE_STEPS inner steps, waiting then if it must:
# with no bound a replica a little faster than the other never waits, its lead grows round after
# round to a whole round, and every step it takes is taken from its own parameters, not from the
# replicas' mean (on 2 CPU ranks at H = 4 the lead reached two steps and the held-out loss lost
# what the waits gave back). One step absorbs the jitter of equal replicas; a lasting gap is
# pacing's (SPEED_BAND) or waited for.
PEER_LATE_STEPS = 1
PEER_PATIENCE_SECONDS = 0.005  # (at least: the comm lane takes the round up and hears the others' hand-overs)
STALL_ROUNDS = 4.0
STALL_SHARE = 0.1
# sync_every="auto" (the default): H is chosen at each landing from the replicas' paces t and the
# round's own time T (its transfer and reduction: the waits for the other replicas left out, which
# no H amortises and pacing is for), with when the round lands (the default sync_delay, None):
# - blocking (sync_delay 0): the smallest H for which the wait T is at most AUTO_WAIT_SHARE of
#   the time a round takes, T / (H t + T) <= 0.04 (a replica a little behind is not waited for:
#   the late landing below);
# - one inner step after its launch (HIDDEN_STEPS), where blocking would need an H more than
#   HIDE_COST steps above the H at which the round's excess over a step, max(0, T - t), costs
#   HIDDEN_WAIT_SHARE (3%: the step hides the link, not all of the others' skew): the round hides
#   behind a step (each replica takes it from its own estimate of the outer step, the estimate
#   rule), H grows only for what a step does not hide. Per inner step a round a step late at
#   H = 4 trained as blocking at H = 8 (held-out loss at 150 inner steps, medians of 3 seeds behind
#   20, 200 and 500 Mbit/s: a step late 2.50-2.54, blocking H = 8 2.53, H = 4 2.46-2.48;
#   benchmarks/results/landing-hide-*.json): the step costs about 4 steps of H.
# Measured on 2 CPU ranks (docs/loops.md, "The defaults: H and the landing chosen from the link"):
# a blocking round every 4 steps waited 23-27% of the time behind 20 Mbit/s and 6-8% on an
# unlimited link (the round's 4-bit encoding and decoding, and the replica behind); blocking at an
# H that waits less trained worse per step (H = 8: +1.96% against data-parallel at equal tokens
# where H = 4 was +0.47%, seed 1337); a round landing one step late cost less (+1.10%), one in
# flight until done more (+2.2%: the replicas drift apart in phase and the steps in flight grow
# to most of a round).
# With sync_delay=0 the blocking rule alone; with sync_delay="auto" (a round lands once done) the
# smallest H it fits behind, T <= H t.
# H rises at once when the measures ask for more (the wait is over the budget), at most AUTO_GROWTH
# times from one round to the next (one round slowed by something else does not take H to the
# upper bound), and falls only when the choice is below H / AUTO_HYSTERESIS (noise in the measures
# does not make it flap).
AUTO_WAIT_SHARE = 0.04
HIDDEN_WAIT_SHARE = 0.03
HIDE_COST = 4
AUTO_GROWTH = 2
AUTO_HYSTERESIS = 1.25
HIDDEN_STEPS = 1
# A replica reports the median of its last ROUND_WINDOW rounds' own times: on 2 shared cores a
# round's encoding and decoding ran 0.04-0.1 s round to round beside the replica's own steps, and
# H followed each one (4 to 12 on an unlimited link). The first round a process lands is not
# timed: it makes the comm lane's connections (1.3 s on an unlimited link here, against 0.03 s).
ROUND_WINDOW = 5


@dataclass(frozen=True)
class EveryChoice:
    """Why an outer round has its H and its landing (``sync_every="auto"``): what the planner
    chose them from, as :attr:`acco.RoundStats.sync_every_choice` shows it.

    Attributes:
        sync_every: the H chosen.
        sync_delay: with the default landing, the inner steps from the round's launch to its
            landing (0: blocking; 1: it hides behind a step); 0 otherwise (the options' hold).
        needed: the H the measures ask for, before the bounds, the growth cap and the
            hysteresis (nan: not measured yet, the H stays).
        step_seconds: the fastest replica's seconds per inner step, from the report.
        round_seconds: the slowest round's own time any replica measured (transfer and
            reduction), from the report.
        rule: ``"block-or-hide"`` (the default landing), ``"fixed"`` (an int ``sync_delay``
            d, 0 blocking: ``max(0, T - d t) <= s / (1 - s) H t``, ``s`` =
            :data:`AUTO_WAIT_SHARE`, :data:`HIDDEN_WAIT_SHARE` for d > 0) or ``"fit"``
            (``sync_delay="auto"``: ``T <= H t``).
        report_round: the index of the landed round whose report the choice came from (-1:
            none, the first rounds run the lower bound).
    """

    sync_every: int
    sync_delay: int = 0
    needed: float = math.nan
    step_seconds: float = 0.0
    round_seconds: float = 0.0
    rule: str = FIXED
    report_round: int = -1

    def as_dict(self) -> dict[str, Any]:
        return {"sync_every": self.sync_every, "sync_delay": self.sync_delay, "needed": self.needed,
                "step_seconds": self.step_seconds, "round_seconds": self.round_seconds, "rule": self.rule,
                "report_round": self.report_round}

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> EveryChoice:
        return cls(int(saved["sync_every"]), int(saved.get("sync_delay", 0)), float(saved["needed"]),
                   float(saved["step_seconds"]), float(saved["round_seconds"]), str(saved.get("rule", FIXED)),
                   int(saved["report_round"]))


def plan_sync_every(current: int, bounds: tuple[int, int], step_seconds: float, round_seconds: float,
                    rule: str = FIXED, report_round: int = -1, current_delay: int = 0) -> EveryChoice:
    """The next rounds' H (and, by ``rule``, landing) for ``sync_every="auto"``: the smallest H
    in ``bounds`` for which a blocking round of ``round_seconds`` (its own transfer and
    reduction) takes at most :data:`AUTO_WAIT_SHARE` of the time of H inner steps of
    ``step_seconds`` and itself (``"fixed"``; for a round landing ``current_delay`` steps after
    its launch what they do not hide, and :data:`HIDDEN_WAIT_SHARE`); or that, unless a round
    landing :data:`HIDDEN_STEPS` later would do with more than :data:`HIDE_COST` steps less,
    then the H at which its excess over them takes :data:`HIDDEN_WAIT_SHARE`
    (``"block-or-hide"``); or the smallest H a round in flight fits behind (``"fit"``). Above ``current`` at most :data:`AUTO_GROWTH` times it, below it only past
    :data:`AUTO_HYSTERESIS`; ``current`` (and ``current_delay``) while either measure is missing."""
    delay = current_delay if rule != FIT else 0
    if not step_seconds > 0 or not round_seconds > 0:
        return EveryChoice(current, delay, math.nan, step_seconds, round_seconds, rule, report_round)

    def steps_for(hidden_steps: int) -> float:
        """The H at which a round landing ``hidden_steps`` after its launch waits its share."""
        share = AUTO_WAIT_SHARE if hidden_steps == 0 else HIDDEN_WAIT_SHARE
        return max(0.0, round_seconds - hidden_steps * step_seconds) / step_seconds * (1.0 - share) / share

    def smallest(needed: float) -> int:  # (the lower bound, not the upper: past it, the smaller wait wins)
        return max(math.ceil(needed - 1e-9), bounds[0])  # (no step for a rounding error)

    if rule == FIT:
        needed = round_seconds / step_seconds
    elif rule == FIXED:  # (the steps a round lands after hide that much of it)
        needed = steps_for(delay)
    else:
        delay, needed = 0, steps_for(0)
        hidden = steps_for(HIDDEN_STEPS)
        if smallest(hidden) + HIDE_COST < smallest(needed):
            needed, delay = hidden, HIDDEN_STEPS
    chosen = min(smallest(needed), bounds[1])
    if chosen > current:
        chosen = min(chosen, AUTO_GROWTH * current)
    elif chosen >= current / AUTO_HYSTERESIS:
        chosen = current
    return EveryChoice(chosen, delay, needed, step_seconds, round_seconds, rule, report_round)


def pace_window(sync_every: int) -> int:
    """How many of a replica's last step times its pace is measured over: a round's worth (so a
    gap must hold over most of a round's steps to count), across rounds (a replica that takes a
    few steps a round, or a last round of one step, is measured over as many), at least 4
    blocks of :data:`PACE_BLOCK`."""
    return max(sync_every, 4 * PACE_BLOCK)


def block_median(times: Sequence[float]) -> float:
    """The median of the means of consecutive blocks of :data:`PACE_BLOCK` step times (the
    oldest block may be shorter); 0 for none."""
    if not times:
        return 0.0
    times = list(times)
    first = len(times) % PACE_BLOCK or PACE_BLOCK
    blocks = [times[:first]] + [times[i : i + PACE_BLOCK] for i in range(first, len(times), PACE_BLOCK)]
    return statistics.median(statistics.fmean(block) for block in blocks)


class PacingStall(RuntimeError):
    """A round has waited for the other replicas' hand-overs far longer than their measured pace
    explains while speed pacing gave them different plans: some replica stopped stepping."""


@dataclass(frozen=True)
class HandOver:
    """What a replica tells the others with its parameters at an outer round's launch.

    Attributes:
        steps: inner steps it took since its last hand-over.
        weight: the ``accumulate()`` weights of those steps' updates (its tokens, or
            micro-batches by default): its pseudo-gradient's weight in the mean.
        step_seconds: its seconds per inner step (:meth:`Pacing.pace`; 0: not measured).
        stop: it asks every replica to stop (``request_stop()``) at this round.
        finishing: the round is its last (``finish()``).
        round_seconds: its last rounds' own time, as its comm lane timed them (the median of
            the last :data:`ROUND_WINDOW`): transfer and reduction, the waits for the other
            replicas left out (0: none measured).
    """

    steps: int
    weight: float
    step_seconds: float
    stop: bool = False
    finishing: bool = False
    round_seconds: float = 0.0

    @classmethod
    def of_ranks(cls, entries: Sequence[Sequence[float]]) -> HandOver:
        """A replica group's hand-over from each of its ranks' ``[steps, weight, step_seconds,
        stop, finishing, round_seconds]`` (rank order): its first rank's steps and weight (its
        ranks pass the same), its slowest rank's seconds per step and per round, a stop or a
        finish any rank asks for."""
        return cls(int(entries[0][0]), entries[0][1], max(entry[2] for entry in entries),
                   any(entry[3] for entry in entries), any(entry[4] for entry in entries),
                   max((entry[5] for entry in entries if len(entry) > 5), default=0.0))  # fmt: skip


@dataclass(frozen=True)
class ReplicaReport:
    """Every replica's :class:`HandOver` for one outer round, by replica (the same on every
    rank: it travels in the round's first, small all-reduce)."""

    steps: tuple[int, ...]
    weights: tuple[float, ...]
    step_seconds: tuple[float, ...]
    stop: tuple[bool, ...]
    finishing: tuple[bool, ...]
    round_seconds: tuple[float, ...] = ()

    @classmethod
    def of(cls, hand_overs: Sequence[HandOver]) -> ReplicaReport:
        """The report of these hand-overs, in replica order."""
        return cls(tuple(h.steps for h in hand_overs), tuple(h.weight for h in hand_overs),
                   tuple(h.step_seconds for h in hand_overs), tuple(h.stop for h in hand_overs),
                   tuple(h.finishing for h in hand_overs), tuple(h.round_seconds for h in hand_overs))  # fmt: skip

    def factors(self, weighting: Weighting) -> list[float] | None:
        """Each replica's pseudo-gradient's factor in the mean over replicas (they sum to the
        number of replicas; all 0: nobody trained since its hand-over); None: every replica
        counts once, as equal weights and step counts give."""
        count = len(self.weights)
        total = sum(self.weights)
        if not any(self.steps) or total == 0 and weighting is not Weighting.EQUAL:
            return [0.0] * count  # (a join or a finish with nothing to hand over: no outer step, no momentum)
        if weighting is Weighting.EQUAL or len(set(self.weights)) == 1 and len(set(self.steps)) == 1:
            return None
        shares = [weight / total for weight in self.weights]
        if weighting is Weighting.TOKENS:
            return [count * share for share in shares]
        # NORMALIZED (FedNova): sum_r p_r (Delta_r / tau_r) times tau_eff = sum_r p_r tau_r.
        effective = sum(share * steps for share, steps in zip(shares, self.steps))
        return [count * share * effective / steps if steps else 0.0 for share, steps in zip(shares, self.steps)]

    def as_dict(self) -> dict[str, list]:
        return {"steps": list(self.steps), "weights": list(self.weights), "step_seconds": list(self.step_seconds),
                "stop": list(self.stop), "finishing": list(self.finishing),
                "round_seconds": list(self.round_seconds)}  # fmt: skip

    @classmethod
    def from_dict(cls, saved: dict[str, list]) -> ReplicaReport:
        return cls(*(tuple(saved[name]) for name in ("steps", "weights", "step_seconds", "stop", "finishing")),
                   tuple(saved.get("round_seconds", ())))  # (saved before round times were reported: none)


@dataclass
class Pacing:
    """This replica's part in the outer rounds: how many inner steps it takes per round, what
    it reports at a launch, and whether every replica stops.

    With ``pacing="lockstep"`` (or a list giving every replica the same count) a replica
    launches every ``sync_every`` inner steps, the same on every rank. Otherwise replica r
    launches after ``plan[r]`` steps: its schedule's, or with ``"speed"`` the last landed
    round's report's. ``"speed"`` starts in lockstep (``sync_every`` each) and stays there
    while every replica's speed is within :data:`SPEED_BAND` of the fastest's (replicas of
    equal speed: the lockstep run, bit for bit); once a replica is slower than that in
    :data:`APART_REPORTS` successive reports (twice that gap: in one) it takes ``clamp(floor(H t_min / t_r + 1/2),
    max(1, D), H)`` steps, so a round takes about the same time on each. ``t_r`` is replica r's
    pace (:meth:`pace`).

    Attributes:
        options: ``sync_every``, ``sync_delay``, ``pacing``.
        replica / replicas: this replica's number and how many there are.
        plan: each replica's inner steps in the current round.
        paced_apart: some landed round gave the replicas different plans (then ``finish()``
            always runs a last round: a replica cannot know what the others hold).
        announce: this rank logs the warning when plans first differ (global rank 0).
        gap_reports: how many successive landed reports showed a replica outside the band.
        round_steps / round_weight: the inner steps since the last launch, and the weights of
            their updates (what the next hand-over reports).
        stop_requested / should_stop: this replica asks to stop at its next launch; some
            replica asked (or finished) in a round that has landed.
        finishing / peer_finished: this replica's next launch is its last (``finish()``);
            the replicas that ended with a round this one landed as a regular one.
        lands_late: the outer rounds may land after this replica went on stepping (a fixed
            group's; an elastic round, which may be dropped and carried, blocks).
        last_report: the report of the last landed round (None before the first).
        stop_steps / stop_seconds: ``stop_after()``'s budget (inner steps of the fastest; a
            deadline on ``time.perf_counter()``), None: none.
        sync_every: H, the fastest replica's inner steps per round: ``options.sync_every``, or
            with ``sync_every="auto"`` the last landed report's choice (:func:`plan_sync_every`).
        round_seconds: the median own time of the last :data:`ROUND_WINDOW` rounds this
            replica landed, as its comm lane timed them (what its next hand-over reports).
        round_times: those times.
        next_every: the H a landed report chose, taken at the next launch (a round may land
            mid-way through the steps of the next, at a different step on each replica: the
            steps a launch covers keep the H they started with, on every replica alike).
        choice / next_choice: why ``sync_every`` / ``next_every`` are what they are
            (:class:`EveryChoice`; None: not chosen by the planner).
        delay: the landing of the rounds launched from now on, in inner steps after the launch,
            with the default landing (``"block-or-hide"``: 0 or :data:`HIDDEN_STEPS`; until the
            planner has measured, :data:`HIDDEN_STEPS`); ``options.sync_delay`` otherwise.
    """

    options: LocalOptions
    sync_every: int = 0
    round_seconds: float = 0.0
    round_times: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=ROUND_WINDOW))
    next_every: int = 0
    delay: int = -1
    choice: EveryChoice | None = None
    next_choice: EveryChoice | None = None
    replica: int = 0
    replicas: int = 1
    plan: list[int] = field(default_factory=list)
    round_steps: int = 0
    round_weight: float = 0.0
    stop_requested: bool = False
    should_stop: bool = False
    paced_apart: bool = False
    announce: bool = False
    gap_reports: int = 0
    finishing: bool = False
    peer_finished: list[int] = field(default_factory=list)
    lands_late: bool = True
    last_report: ReplicaReport | None = None
    stop_steps: int | None = None
    stop_seconds: float | None = None
    # This replica's pace (wall clock, not saved), for stop_after()'s budget: its mean step time
    # from the end of its first step (what came before is not its pace) or from its last launch,
    # the waits for a round left out.
    busy_since: float = field(default_factory=time.perf_counter)
    timed_steps: int = 0
    waited: float = 0.0
    # The last launch-to-launch times (whole rounds only): their median measures a round for
    # stop_after(seconds=), so one round a stall stretched does not end the job early.
    round_walls: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=5))
    round_pace: float = 0.0  # seconds per step over the last round (0: not measured)
    # The pace reported: the last pace_window(sync_every) step-to-step times, across rounds, each
    # less the time step() waited for a round in it, with whether it held such a wait; timed from
    # the end of the first step (None before it).
    step_times: collections.deque[tuple[float, bool]] = field(default_factory=collections.deque)
    last_step_end: float | None = None
    waited_in_step: float = 0.0

    def __post_init__(self) -> None:
        self.sync_every = self.sync_every or self.options.sync_every
        if self.delay < 0:
            fixed = self.options.sync_delay if isinstance(self.options.sync_delay, int) else 0  # ("auto": unused)
            self.delay = HIDDEN_STEPS if self.options.landing == BLOCK_OR_HIDE else fixed
        self.next_every = self.next_every or self.sync_every
        if not self.plan:
            self.plan = self.first_plan()
        self.step_times = collections.deque(maxlen=pace_window(self.options.sync_every))

    def join(self, replica: int, replicas: int) -> None:
        """This replica's number among ``replicas``, once the outer round's group is known.

        Raises:
            ValueError: a schedule with another number of entries (on every rank alike).
        """
        self.replica, self.replicas = replica, replicas
        self.announce = not dist.is_initialized() or dist.get_rank() == 0
        self.plan = self.first_plan()
        self.paced_apart = len(set(self.plan)) > 1  # a schedule that gives replicas different steps
        if len(self.plan) != replicas:
            raise ValueError(
                f"Invalid pacing: {self.options.pacing!r} gives {len(self.plan)} replicas' inner steps, and there are "
                f"{replicas} replicas (one entry per replica, in process-group order)"
            )

    def seat(self, replica: int, replicas: int) -> None:
        """This replica's number among the participants of the round landing now (elastic
        replicas: they change from round to round); a plan for another number of them starts
        again from the first, until this round's report gives one (``"speed"``)."""
        self.replica, self.replicas = replica, replicas
        if len(self.plan) != replicas:
            self.plan = self.first_plan()

    @property
    def lockstep(self) -> bool:
        return self.options.lockstep

    def first_plan(self) -> list[int]:
        """The first round's steps: the schedule's; ``sync_every`` each otherwise (with
        ``"speed"`` nothing is measured yet, and replicas of equal speed never leave lockstep)."""
        pacing = self.options.pacing
        if isinstance(pacing, tuple):
            return list(pacing)
        return [self.sync_every] * self.replicas

    @property
    def target(self) -> int:
        """This replica's inner steps in the current round."""
        return self.plan[self.replica] if self.replica < len(self.plan) else self.sync_every

    @property
    def _fixed_lockstep(self) -> bool:
        """Launches at multiples of a fixed H (a resumed run finds them from the step count)."""
        return self.lockstep and self.options.auto_every is None

    def launches_now(self, inner_steps: int, ahead: int = 0) -> bool:
        """Whether this replica's round launches after ``inner_steps`` inner steps (``ahead``:
        that many more than it has taken, ``ready()``'s look at the next step)."""
        if self._fixed_lockstep:
            return (inner_steps + ahead) % self.sync_every == 0
        return self.round_steps + ahead >= self.target

    def steps_to_launch(self, inner_steps: int) -> int:
        """Inner steps this replica takes before its next launch."""
        if self._fixed_lockstep:
            return self.sync_every - inner_steps % self.sync_every
        return max(self.target - self.round_steps, 0)

    def check_step(self) -> None:
        """Refuse an inner step once another replica has finished (its last round was this
        one's regular one: no round would ever meet this replica's next).

        Raises:
            RuntimeError: naming what to do.
        """
        if self.peer_finished:
            raise RuntimeError(
                f"step() after replica(s) {self.peer_finished} called finish(): the replicas take different numbers "
                "of inner steps (pacing), so a loop must stop on opt.should_stop, which turned True on every replica "
                "at the same outer round (opt.stop_after(steps=...) or opt.request_stop(); docs/loops.md, \"Replicas "
                "of different speeds\"); call opt.finish() now"
            )

    def stepped(self, weight: float) -> None:
        """An inner step ended (``weight``: its update's, 0 if none was applied)."""
        self.round_steps += 1
        self.round_weight += weight
        now = time.perf_counter()
        if self.last_step_end is None:  # the first step: both measures start at its end
            self.busy_since, self.waited = now, 0.0
        else:
            self.step_times.append((now - self.last_step_end - self.waited_in_step, self.waited_in_step > 0))
            self.timed_steps += 1
        self.last_step_end, self.waited_in_step = now, 0.0

    def waited_for_round(self, seconds: float) -> None:
        """``step()`` waited this long for a round: not this replica's pace."""
        self.waited += seconds
        self.waited_in_step += seconds

    def seconds_per_step(self, now: float) -> float:
        """This replica's pace since the last launch (0: not measured yet)."""
        return (now - self.busy_since - self.waited) / self.timed_steps if self.timed_steps else 0.0

    def pace(self) -> float:
        """This replica's seconds per inner step, the one measure of its speed (0: none timed
        yet): :func:`block_median` of its last step-to-step times, each less the time ``step()``
        waited for a round in it, and without the steps that held such a wait while at least
        :data:`PACE_BLOCK` others are timed (after its wait, the loop's own collective may wait
        for a replica still in its own: not this replica's speed). What a hand-over reports, and
        what ``stop_after(seconds=)`` budgets with."""
        clear = [seconds for seconds, waited in self.step_times if not waited]
        return block_median(clear if len(clear) >= PACE_BLOCK else [seconds for seconds, _ in self.step_times])

    def hand_over(self) -> HandOver:
        """What the launch now tells the others (its pace: :meth:`pace`); the round's counters
        start again."""
        now = time.perf_counter()
        report = HandOver(self.round_steps, self.round_weight, self.pace(), self.stop_requested, self.finishing,
                          self.round_seconds)
        if self.timed_steps == self.round_steps and self.timed_steps:
            self.round_walls.append(now - self.busy_since)
        self.round_pace = self.seconds_per_step(now) or self.round_pace
        self.busy_since, self.waited, self.timed_steps = now, 0.0, 0
        self.round_steps, self.round_weight = 0, 0.0
        self._take_next()  # (sync_delay="auto": a round lands at another step on each replica: from the launch)
        return report

    def _take_next(self) -> None:
        """The planner's last choice from here on (``sync_every="auto"``): H for the steps from
        now, and the landing of the rounds launched from now."""
        self.choice = self.next_choice or self.choice
        if self.next_choice is not None and self.options.landing == BLOCK_OR_HIDE:
            self.delay = self.next_choice.sync_delay
        if self.next_every != self.sync_every:
            self.sync_every = self.next_every
            self.plan = [self.sync_every] * len(self.plan) if len(set(self.plan)) == 1 or self.last_report is None \
                else self.speed_plan(self.last_report)

    def round_timed(self, seconds: float) -> None:
        """A round this replica landed took ``seconds`` of its comm lane's own time: what its
        next hand-over reports, as the median of the last :data:`ROUND_WINDOW`."""
        self.round_times.append(seconds)
        self.round_seconds = statistics.median(self.round_times)

    def every_state(self) -> dict[str, Any]:
        """The H of the steps from here on and the H the next launch takes, with why (what a
        restarted elastic replica group takes from a peer, so it steps its rounds as they do)."""
        return {"sync_every": self.sync_every, "next_every": self.next_every, "delay": self.delay,
                "choice": None if self.choice is None else self.choice.as_dict(),
                "next_choice": None if self.next_choice is None else self.next_choice.as_dict()}

    def load_every_state(self, saved: dict[str, Any]) -> None:
        """A peer's :meth:`every_state` (an equal plan follows the new H)."""
        equal = len(set(self.plan)) == 1
        self.sync_every, self.next_every = int(saved["sync_every"]), int(saved["next_every"])
        self.delay = int(saved.get("delay", self.delay))
        choice, next_choice = saved.get("choice"), saved.get("next_choice")
        self.choice = None if choice is None else EveryChoice.from_dict(choice)
        self.next_choice = None if next_choice is None else EveryChoice.from_dict(next_choice)
        if equal:
            self.plan = [self.sync_every] * len(self.plan)

    def put_back(self, hand_over: HandOver) -> None:
        """A round was dropped (elastic replicas): its hand-over's steps and weight count again
        in the next one, which carries them."""
        self.round_steps += hand_over.steps
        self.round_weight += hand_over.weight

    def finish_runs_last_round(self, unsynced: bool) -> bool:
        """Whether ``finish()`` runs a last round: once replicas were paced apart, or where a
        round may land late (``sync_every="auto"``), always (none can know whether another holds
        steps no round has carried: a late replica took steps past a round the others stopped
        at; one without weighs nothing), in lockstep (or speed pacing that never left it) when
        this replica holds such steps (every replica alike), never once another replica has
        finished."""
        if self.peer_finished:
            return False
        return unsynced or self.paced_apart or self.may_land_late

    def landed(self, report: ReplicaReport | None, index: int = -1) -> None:
        """Round ``index`` landed with ``report`` (None: a round restored from a state saved
        without it): the stop agreed, the next plan."""
        if report is None:
            return
        self.last_report = report
        if any(report.stop):
            self.should_stop = True
        if any(report.finishing) and not self.finishing:
            self.should_stop = True
            self.peer_finished = [r for r, done in enumerate(report.finishing) if done]
        bounds = self.options.auto_every
        if bounds is not None:
            # The fastest replica's pace (it takes H steps), the slowest round time anyone measured.
            paces = [s for s in report.step_seconds if s > 0]
            self.next_choice = plan_sync_every(self.next_every, bounds, min(paces) if paces else 0.0,
                                               max(report.round_seconds, default=0.0), self.options.landing, index,
                                               self.delay)  # fmt: skip
            self.next_every = self.next_choice.sync_every
            if self.options.landing != FIT:
                # Every replica lands this round at the same step of the next (at its launch, or
                # HIDDEN_STEPS after it): the steps since take the new H and the next launch its landing.
                self._take_next()
        if self.options.pacing == SPEED:
            plan = self.speed_plan(report)
            self.gap_reports = self.gap_reports + 1 if len(set(plan)) > 1 else 0
            # From equal plans a gap must hold over APART_REPORTS successive reports, unless it is
            # past twice the band; once apart, every report's plan.
            seconds = report.step_seconds
            wide = all(s > 0 for s in seconds) and min(seconds) / max(seconds) < 1.0 - 2 * SPEED_BAND
            if len(set(self.plan)) == 1 and self.gap_reports < APART_REPORTS and not wide:
                plan = [self.sync_every] * len(plan)
            self.plan = plan
        if len(set(self.plan)) > 1 and not self.paced_apart:
            self.paced_apart = True
            self._warn_paced_apart(report)

    def speed_plan(self, report: ReplicaReport) -> list[int]:
        """This report's steps in proportion to each replica's measured speed, the fastest ``sync_every``:
        ``sync_every`` for a replica within :data:`SPEED_BAND` or one step of the fastest,
        otherwise at least the delay a round lands after; the plan as it was while any
        replica's speed is unmeasured."""
        seconds = report.step_seconds
        if len(seconds) != self.replicas or not all(s > 0 for s in seconds):
            return self.plan
        every, delay = self.sync_every, self.options.sync_delay
        least = max(1, delay) if isinstance(delay, int) else 1
        fastest = min(seconds)
        plan = []
        for s in seconds:
            speed = fastest / s  # this replica's speed, the fastest's 1
            steps = every * speed  # what it does in the fastest's round
            # Within the band, or within one step of the fastest: a full round (measurement noise
            # and a replica barely slower do not take steps off it; the others wait less than that).
            plan.append(every if speed >= 1.0 - SPEED_BAND or steps > every - 1 else max(least, math.floor(steps + 0.5)))
        return plan

    def _warn_paced_apart(self, report: ReplicaReport) -> None:
        """Once, on rank 0: the plans differ, and what that means for the loop's own collectives."""
        if not self.announce:
            return
        paces = ", ".join(f"{1000 * s:.1f}" for s in report.step_seconds)
        message = (
            f"acco: speed pacing gives the replicas different inner steps per outer round from now on: plan "
            f"{self.plan} (sync_every={self.sync_every}; measured ms per inner step: {paces}). A replica "
            "that hands over first goes on taking inner steps until the round completes, so a collective of the "
            "loop's own at step counts (an all-reduce of the loss, an evaluation's broadcast, a time budget agreed "
            "at every step) still meets the others, but it holds every replica to the slowest one's pace. Run such "
            "collectives at outer rounds (when opt.outer_rounds changes; stop on opt.should_stop with "
            "opt.stop_after()), or pass pacing='lockstep'."
        )
        _log.warning(message)
        warnings.warn(message, UserWarning, stacklevel=2)

    def patience(self, blocks: bool = True) -> float | None:
        """How long a landing waits for the other replicas' hand-overs before this replica goes
        on taking inner steps (the round lands once it completes): the longest planned round less
        its own and :data:`PATIENCE_ROUNDS` of the longest more, at the last report's paces (at
        least :data:`PATIENCE_SECONDS`), once speed pacing gave the replicas
        different plans (their launches are no longer at the same step counts, even where their
        plans are equal again); with ``sync_every="auto"`` otherwise, for a round that ``blocks``
        and one the default landing hides behind a step, :data:`PEER_PATIENCE` of an inner step
        at this replica's pace (a round waits for the link, not for a peer a little behind: with
        replicas a few percent apart in speed, the faster one would otherwise wait that share of
        its time at any H); None (as long as it takes) with a fixed ``sync_every``, or a fixed
        ``sync_delay``, where every replica reaches every step count with the others and the
        rounds are the recurrence's bit for bit."""
        if not self.lands_late:
            return None
        if not self.paced_apart or self.options.pacing != SPEED:
            if not self.may_land_late or not (blocks or self.options.landing == BLOCK_OR_HIDE):
                return None
            return max(PEER_PATIENCE * self.pace(), PEER_PATIENCE_SECONDS)
        seconds = self.last_report.step_seconds if self.last_report is not None else ()
        rounds = [steps * s for steps, s in zip(self.plan, seconds)]
        if not rounds:
            return PATIENCE_SECONDS
        longest, own = max(rounds), rounds[self.replica] if self.replica < len(rounds) else 0.0
        return max(longest - own + PATIENCE_ROUNDS * longest, PATIENCE_SECONDS)

    @property
    def may_land_late(self) -> bool:
        """A round may land late on equal plans: with ``sync_every="auto"``, where the outer
        rounds can (:attr:`lands_late`)."""
        return self.lands_late and self.options.auto_every is not None

    @property
    def lands_by_launch(self) -> bool:
        """A late round lands by this replica's next launch, waiting there if it must: the
        replicas launch at the same step counts (they were never paced apart by speed), so the
        one behind reaches its own launch before this one's next."""
        return not (self.paced_apart and self.options.pacing == SPEED)

    def late_round_due(self, late_steps: int, at_launch: bool) -> bool:
        """Whether a late round lands now, waiting if it must: after :data:`PEER_LATE_STEPS`
        inner steps late, or at this replica's next launch, where the replicas launch at the same
        step counts (:attr:`lands_by_launch`); never while paced apart (it lands when complete)."""
        return self.lands_by_launch and (at_launch or late_steps >= PEER_LATE_STEPS)

    def stall_bound(self, timeout: float) -> float | None:
        """How long a round may wait for the other replicas' hand-overs before
        :meth:`check_stall` raises: :data:`STALL_ROUNDS` times the longest planned round at the
        last report's paces, at least :data:`STALL_SHARE` of ``timeout``, at most ``timeout``;
        None (no bound but the timeout) until the replicas were paced apart."""
        if not self.paced_apart:
            return None
        seconds = self.last_report.step_seconds if self.last_report is not None else ()
        longest = max((steps * s for steps, s in zip(self.plan, seconds)), default=0.0)
        return min(timeout, max(STALL_ROUNDS * longest, STALL_SHARE * timeout))

    def check_stall(self, waited: float, bound: float | None, index: int) -> None:
        """Raise once round ``index`` has waited ``waited`` seconds for the other replicas'
        hand-overs, past ``bound`` (:meth:`stall_bound`).

        Raises:
            PacingStall: naming the likely cause.
        """
        if bound is None or waited <= bound:
            return
        head = (f"outer round {index}: replica {self.replica} has waited {waited:.1f}s for the other replicas to "
                f"hand over (bound {bound:.1f}s: {STALL_ROUNDS:g} rounds at their measured pace, at least "
                f"{STALL_SHARE:g} of timeout; plan {self.plan}): ")
        tail = " (docs/loops.md, \"Loops with collectives of their own\"). The other replicas fail when this process exits."
        if self.options.pacing != SPEED:
            raise PacingStall(
                head + "a fixed schedule's replicas wait for each other's hand-overs (its rounds are reproducible). "
                "Most likely the loop runs a collective of its own at step counts, which a replica that takes more "
                "steps per round waits in for this one: run such collectives at outer rounds, or pass pacing='speed' "
                "(a replica that hands over first goes on stepping) or 'lockstep'" + tail
            )
        raise PacingStall(
            head + "some replica stopped taking inner steps (a hung data loader or device, or a wait in its loop for "
            "something this replica never does, such as a collective only some replicas call). A replica that hands "
            "over first goes on taking inner steps while it waits, so a collective every replica calls at every step "
            "does not stall a round" + tail
        )

    def stop_after(self, steps: int | None, seconds: float | None) -> None:
        """A budget this replica enforces (:meth:`check_budget` at every inner step).

        Raises:
            ValueError: a budget that is not positive.
        """
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"Invalid steps: {steps!r} (an int >= 1: inner steps of the fastest replica)")
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0):
            raise ValueError(f"Invalid seconds: {seconds!r} (a number > 0)")
        self.stop_steps = steps
        self.stop_seconds = None if seconds is None else time.perf_counter() + float(seconds)

    def check_budget(self, inner_steps: int) -> None:
        """``stop_after()``: ask to stop at the next launch once the round after it would end
        past ``steps`` (the fastest replica's ``sync_every`` a round), or, for ``seconds``,
        once the next launch is nearer the deadline than the end of the round after it (the
        median of the last rounds' times and of the last steps' as the measure: within half a
        round of the budget; a stall, one long step or round, moves neither)."""
        if self.stop_requested or (self.stop_steps is None and self.stop_seconds is None):
            return
        ahead = self.steps_to_launch(inner_steps)
        if self.stop_steps is not None and inner_steps + ahead + self.sync_every > self.stop_steps:
            self.stop_requested = True
        if self.stop_seconds is None:
            return
        now = time.perf_counter()
        per_step = self.pace() or self.seconds_per_step(now) or self.round_pace
        if per_step:
            # (before any whole round: its steps)
            next_round = statistics.median(self.round_walls) if self.round_walls else self.sync_every * per_step
            if now + ahead * per_step + next_round / 2 > self.stop_seconds:
                self.stop_requested = True

    def state_dict(self) -> dict[str, Any]:
        """The plan (with the report it came from and the successive reports of a gap), the
        steps and weights since the last hand-over and the stop state (the wall-clock parts are
        measured again after a load); the round in flight's report is the loop's to save."""
        return {
            **self.every_state(),
            "round_seconds": self.round_seconds,
            "round_times": list(self.round_times),
            "plan": list(self.plan),
            "hand_over_steps": self.round_steps,
            "hand_over_weight": self.round_weight,
            "stop_requested": self.stop_requested,
            "should_stop": self.should_stop,
            "stop_steps": self.stop_steps,
            "paced_apart": self.paced_apart,
            "gap_reports": self.gap_reports,
            "last_report": None if self.last_report is None else self.last_report.as_dict(),
        }

    def load_state_dict(self, saved: dict[str, Any], round_steps: int) -> None:
        """``round_steps``: the steps since the last launch, for a state saved without them. A
        state saved at another number of replicas restarts the plan (``first_plan``)."""
        every = int(saved.get("sync_every", self.options.sync_every))
        self.load_every_state({"sync_every": every, "next_every": saved.get("next_every", every),
                               "choice": saved.get("choice"), "next_choice": saved.get("next_choice")})
        self.round_seconds = float(saved.get("round_seconds", 0.0))
        self.round_times.clear()
        self.round_times.extend(float(t) for t in saved.get("round_times", [self.round_seconds] if self.round_seconds else []))
        plan = saved.get("plan")
        self.plan = list(plan) if plan is not None and len(plan) == self.replicas else self.first_plan()
        self.round_steps = int(saved.get("hand_over_steps", round_steps))
        self.round_weight = float(saved.get("hand_over_weight", 0.0))
        self.stop_requested, self.should_stop = bool(saved.get("stop_requested")), bool(saved.get("should_stop"))
        self.stop_steps = saved.get("stop_steps")
        # Saved before this was kept: a state whose plan differs was paced apart, one from an
        # equal plan is taken as never (finish() then decides as in lockstep).
        self.paced_apart = bool(saved.get("paced_apart", len(set(self.plan)) > 1))
        self.gap_reports = int(saved.get("gap_reports", 0))
        last = saved.get("last_report")
        # (the plan's paces: how long a landing waits for the others; a state saved at another
        # number of replicas measures them again)
        self.last_report = None if last is None or len(last["steps"]) != self.replicas else ReplicaReport.from_dict(last)
        self.timed_steps, self.waited, self.round_pace = 0, 0.0, 0.0
        self.round_walls.clear()
        self.step_times.clear()
        self.last_step_end, self.waited_in_step = None, 0.0
