"""Goodput of elastic local steps, a discrete-event model (issue 46, item 3; docs/goodput.md).

R replica groups each take H inner steps (``sync_every``), then an outer round among the groups
present. Goodput is the share of the inner steps the hardware could take (R x wall time / mean
seconds per step) whose progress reaches the global values. The model plays one event per group
per outer round, not per step: a group's H step times enter as their sum, drawn from a lognormal
of mean H t and coefficient of variation cv / sqrt(H) (the sum of H independent steps, as
Fenton-Wilkinson approximate it). Kinds of round:

- ``lockstep``: every round waits for every live group. A live group that stalls holds all the
  others until it is back; a group that dies is waited for until the lighthouse's heartbeat
  timeout sees it, then the rounds go on without it; it restarts (the restart time includes its
  heal from a peer), joins the next round, and its inner steps since its last round are lost.
- ``speed-paced``: as lockstep, each group taking inner steps in proportion to its mean speed
  (acco's ``pacing="speed"``): lasting speed differences (``--speed-spread``) cost nothing, a
  transient stall still holds everyone.
- ``quorum-grace``: torchft's lighthouse and acco's grace window, speed-paced. A round lands once
  every group of the last round has handed over; or else once a quorum has (``min_replicas`` and
  more than half of the live groups: the lighthouse's split-brain guard, so 2 groups always wait
  for each other), the lighthouse has issued it (at once if every live group asked, else when the
  first has waited the join timeout) and the grace window after it has passed (adaptive:
  ``grace_factor`` times the median spread of the last rounds' hand-over times (the last
  participant's after the median one's) within [floor, cap], acco's ``ElasticRunner.grace``; or ``--grace SECONDS``). A group later than that keeps
  its progress: its inner steps all count in the next round it reaches, which it waits for once
  it is back; the others wait the window for it in the next rounds while it was in one of the
  last three (``grace_memory``). A group that dies loses its steps since the last round it took
  part in, and the next three rounds wait the grace window for it.
- ``quorum-drop``: the same rounds, but a late group heals from the others and loses its steps
  since its last round (acco before the grace window, torchft's DiLoCo).
- ``data-parallel``: lockstep, a round after every inner step, the gradients all-reduced at
  ``--dp-bits`` (plain DDP: fp32).

A round costs latency + bytes / link rate, each group sending a ring reduce-scatter and
all-gather's bytes, 2 (n - 1) / n x params x bits / 8 among n groups (about one byte per
parameter each way at 4 bits and large n). Stalls come at a Poisson rate per hour of a group's
own compute (``--stalls-per-hour``), ``--stall-seconds`` each, or at given inner steps
(``--stall I:K:T``, as examples/elastic_local.py's option); failures at a Poisson rate per group
(``--mtbf-hours``). A run ends after ``--seconds`` of wall time, or (``Setup.steps``) as
``stop_after(steps=)`` with acco's ``finish()`` ends it: once one group has taken its steps,
every group ends in the next round it reaches. Random numbers are drawn per group and per
purpose from the seed, so the kinds of round meet the same noise, stalls and failures, and a seed
gives the same result every time. Every default is read from a file of the repository (``--help``
names it; the JSON keeps where each came from).

Assumptions and limits: a group's steps are independent draws (no drift of a machine's speed);
stalls are alive and heartbeating (a stopped process is a failure here); a failure while a group
waits for a round counts from its next inner steps; a round itself never fails (acco drops a
round whose peer dies inside its collectives: here the round lands without it); the heal is in
the restart time; rounds do not overlap inner steps (``sync_delay=0``, as the elastic example);
the outer state's rebuild and a late pseudo-gradient's staleness are not costed (what counts is
progress, not its quality).

    python benchmarks/goodput_model.py                                 # the default grid: table + JSON
    python benchmarks/goodput_model.py --figure docs/goodput.png       # and the figure
    python benchmarks/goodput_model.py --calibrate runs/elastic        # step time from a real run's records

Held to real runs (``--check DIR [DIR ...]``): run examples/elastic_local.py with a stall (on steps,
``--steps``, or on time, ``--seconds``), e.g. ::

    python examples/elastic_local.py --replicas 3 --steps 400 --step-seconds 0.05 --stall 2:100:5 \\
        --log-dir runs/goodput-r3
    python examples/elastic_local.py --replicas 3 --steps 400 --step-seconds 0.05 --stall 2:100:5 \\
        --grace lockstep --log-dir runs/goodput-r3-lockstep
    python benchmarks/goodput_model.py --check runs/goodput-r3 --stall 2:100:5 --kind quorum-grace
    python benchmarks/goodput_model.py --check runs/goodput-r3-lockstep --stall 2:100:5 --kind lockstep

For each directory it reads ``replica-*.jsonl`` and measures the goodput: the groups' ``counted``
steps (where the records have them; otherwise their inner steps in the rounds they landed), over
R x the wall time from the first record to the last / the mean seconds per inner step of the
rounds without a stall. A record holds one time per round, so that step time holds its share of
the round: the check measures what stalls cost against the run's own unstalled pace. The model
plays the same R, H, step time and spread (from the records), stall schedule and stop rule
(``--stop``; by default on steps where every group ended at the same step count, else on the
run's wall time), once without and once with the stalls, and its goodput is the second's
throughput over the first's. It prints both goodputs, every kind's prediction and the relative
error of ``--kind``'s, and writes them to benchmarks/results/goodput_model-check.json.
"""

from __future__ import annotations

import argparse
import ast
import collections
import importlib.util
import json
import math
import random
import re
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

__all__ = [
    "KINDS", "LOCAL_KINDS", "REPORTED", "Defaults", "Outcome", "RoundRule", "RunRecords", "Setup", "Stall",
    "base_setup", "calibrated", "check", "figure", "grid", "main", "paced_steps", "read_run", "repository_defaults",
    "round_seconds", "simulate", "table",
]

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
DEFAULT_OUT = RESULTS_DIR / "goodput_model.json"
CHECK_OUT = RESULTS_DIR / "goodput_model-check.json"

# Decoupled DiLoCo (DeepMind, arXiv 2604.21428): goodput reported for their quorum + grace
# syncer and for data parallel under heavy simulated failures. Theirs, not reproduced here (no
# code); shown beside the model's figures as a reference.
REPORTED = {"source": "Decoupled DiLoCo (arXiv 2604.21428), reported, not reproduced",
            "quorum-grace": 0.88, "data-parallel": 0.27}


# --------------------------------------------------------------------------- the inputs


@dataclass(frozen=True)
class Stall:
    """Group ``group`` sleeps ``seconds`` when its step count is ``step`` (before that step)."""

    group: int
    step: int
    seconds: float

    @classmethod
    def parse(cls, text: str) -> Stall:
        try:
            group, step, seconds = text.split(":")
            stall = cls(int(group), int(step), float(seconds))
        except ValueError:
            raise ValueError(f"Invalid stall: {text!r} (I:K:T: group, inner step, seconds)") from None
        if stall.group < 0 or stall.step < 0 or not stall.seconds >= 0:
            raise ValueError(f"Invalid stall: {text!r} (group, step >= 0, seconds >= 0)")
        return stall


@dataclass(frozen=True)
class Setup:
    """One job to simulate, times in seconds. The defaults here are neutral (no round cost, no
    stall, no failure); the CLI's come from the repository (:func:`repository_defaults`)."""

    replicas: int
    sync_every: int  # H
    step_seconds: float  # mean seconds per inner step
    step_cv: float = 0.0  # coefficient of variation of one step's time
    params: float = 0.0  # model parameters (a round's bytes)
    bits: int = 4  # outer rounds
    dp_bits: int = 32  # data parallel's all-reduce
    link_mbit: float = math.inf  # per group
    latency: float = 0.0  # a round's fixed cost
    heartbeat: float = 1.0  # the lighthouse sees a dead group after this
    join: float = 0.5  # the lighthouse's join timeout
    restart: float = 2.5  # kill to rejoin, heal included
    min_replicas: int = 1
    stall_seconds: float = 0.0  # each random stall
    stalls_per_hour: float = 0.0  # random stalls per hour of a group's compute
    stalls: tuple[Stall, ...] = ()  # stalls at given steps
    mtbf_hours: float = math.inf  # per group; inf: no failures
    grace: float | str = "adaptive"  # or seconds
    grace_factor: float = 3.0
    grace_floor: float = 0.05
    grace_cap: float = 10.0
    grace_rounds: int = 8  # rounds whose spreads the adaptive window takes the median of
    grace_memory: int = 3  # the window waits for a group of the last this many rounds (acco's)
    spread_counts_late: bool = True  # acco's ElasticRunner: every participant's hand-over time
    spread_from_first: bool = False  # the last hand-over after the first (True), or after the median (acco's)
    speed_spread: float = 0.0  # CV of the groups' lasting speeds
    duration: float | None = 3600.0  # the run's wall time, or
    steps: int | None = None  # the inner steps after which a group ends the job (stop_after(steps=))

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.sync_every < 1:
            raise ValueError(f"Invalid replicas / sync_every: {self.replicas} / {self.sync_every} (>= 1)")
        if not self.step_seconds > 0:
            raise ValueError(f"Invalid step_seconds: {self.step_seconds} (> 0)")
        if self.step_cv < 0 or self.speed_spread < 0:
            raise ValueError(f"Invalid step_cv / speed_spread: {self.step_cv} / {self.speed_spread} (>= 0)")
        if not self.link_mbit > 0 or self.latency < 0 or self.params < 0:
            raise ValueError(f"Invalid link_mbit / latency / params: {self.link_mbit} / {self.latency} / {self.params}")
        if min(self.heartbeat, self.join, self.restart, self.stall_seconds, self.stalls_per_hour) < 0:
            raise ValueError("Invalid heartbeat, join, restart, stall_seconds or stalls_per_hour: negative")
        if not self.mtbf_hours > 0:
            raise ValueError(f"Invalid mtbf_hours: {self.mtbf_hours} (> 0; inf: no failures)")
        if self.grace != "adaptive" and (isinstance(self.grace, str) or not self.grace >= 0):
            raise ValueError(f"Invalid grace: {self.grace!r} ('adaptive' or seconds >= 0)")
        if (self.duration is None) == (self.steps is None):
            raise ValueError(f"Give one of duration and steps, not {self.duration} and {self.steps}")
        if (self.duration is not None and not self.duration > 0) or (self.steps is not None and self.steps < 1):
            raise ValueError(f"Invalid duration / steps: {self.duration} / {self.steps}")
        if not 1 <= self.min_replicas <= self.replicas:
            raise ValueError(f"Invalid min_replicas: {self.min_replicas} (1 to {self.replicas})")

    def compute_share(self, rule: RoundRule) -> float:
        """Goodput with no stall, no failure and no spread: H t / (H t + round)."""
        compute = rule.sync_every(self) * self.step_seconds
        return compute / (compute + round_seconds(self, self.replicas, rule.bits(self)))


def round_seconds(setup: Setup, participants: int, bits: int) -> float:
    """An outer round (or a data-parallel all-reduce) among ``participants`` groups: latency
    plus a ring reduce-scatter and all-gather's bytes per group over the link."""
    if participants < 2 or math.isinf(setup.link_mbit):
        return setup.latency
    sent = 2 * (participants - 1) / participants * setup.params * bits / 8
    return setup.latency + sent * 8 / (setup.link_mbit * 1e6)


# ---------------------------------------------------------------------- kinds of round


class RoundRule:
    """When a round lands and what a group left out of it keeps: one object per kind of round."""

    name = ""
    keeps_progress = True  # a late group's inner steps count in its next round

    def sync_every(self, setup: Setup) -> int:
        return setup.sync_every

    def bits(self, setup: Setup) -> int:
        return setup.bits

    def steps_per_round(self, setup: Setup, step_seconds: Sequence[float]) -> list[int]:
        return [self.sync_every(setup)] * len(step_seconds)

    def land(self, events: list[tuple[float, bool, _Group]], setup: Setup, grace: float, absent: int = 0) -> float:
        """The time the round lands, from each live group's event: (time, handed over, group),
        a group that died giving the time the lighthouse stops hearing it (``absent``: dead
        groups acco still waits for, :attr:`_Group.expected`)."""
        raise NotImplementedError


class Lockstep(RoundRule):
    """Every live group, every round."""

    name = "lockstep"

    def land(self, events: list[tuple[float, bool, _Group]], setup: Setup, grace: float, absent: int = 0) -> float:
        return max((t for t, _, _ in events), default=math.inf)


def paced_steps(setup: Setup, step_seconds: Sequence[float]) -> list[int]:
    """Speed pacing: the fastest group takes H inner steps a round, the others in proportion to
    their speed (acco's ``pacing="speed"``, its measured pace taken as the group's mean)."""
    fastest = min(step_seconds)
    return [max(1, round(setup.sync_every * fastest / t)) for t in step_seconds]


class SpeedPaced(Lockstep):
    """Lockstep rounds, each group taking inner steps in proportion to its mean speed."""

    name = "speed-paced"

    def steps_per_round(self, setup: Setup, step_seconds: Sequence[float]) -> list[int]:
        return paced_steps(setup, step_seconds)


class DataParallel(Lockstep):
    """A lockstep round after every inner step, at the data-parallel all-reduce's bits."""

    name = "data-parallel"

    def sync_every(self, setup: Setup) -> int:
        return 1

    def bits(self, setup: Setup) -> int:
        return setup.dp_bits


class QuorumGrace(RoundRule):
    """torchft's quorum (``min_replicas``, more than half the live groups, the join timeout)
    and acco's grace window for a group of the last round that has not handed over."""

    name = "quorum-grace"

    def steps_per_round(self, setup: Setup, step_seconds: Sequence[float]) -> list[int]:
        return paced_steps(setup, step_seconds)  # acco's default pacing, in elastic rounds too

    def land(self, events: list[tuple[float, bool, _Group]], setup: Setup, grace: float, absent: int = 0) -> float:
        live = len(events)
        waiting = sum(1 for _, _, g in events if g.in_last_round)  # torchft's fast quorum waits for these
        missing = absent + sum(1 for _, _, g in events if g.expected(setup))  # acco's grace window for these
        handed, first, issued = 0, math.inf, math.inf  # issued: when the lighthouse gives the first quorum
        for t, handed_over, g in sorted(events, key=lambda event: event[0]):
            if t > issued + grace:
                return issued + grace
            if handed_over:
                handed, first = handed + 1, min(first, t)
                waiting -= g.in_last_round
                missing -= g.expected(setup)
            else:  # its heartbeats stopped: no longer live (acco still waits for it: it is missing)
                live -= 1
            if handed >= max(setup.min_replicas, live // 2 + 1):
                if missing == 0:  # every group acco waits for is in (those of the last round among them)
                    return t
                # torchft's quorum: at once if every group of its last one or every live group asked;
                # else once the first has waited the join timeout. Then acco's grace window.
                issued = min(issued, t if waiting == 0 or handed == live else max(t, first + setup.join))
        return issued + grace


class QuorumDrop(QuorumGrace):
    """The same rounds; a late group heals from the others and loses its steps since its last round."""

    name = "quorum-drop"
    keeps_progress = False


KINDS: dict[str, RoundRule] = {rule.name: rule for rule in
                               (Lockstep(), SpeedPaced(), QuorumGrace(), QuorumDrop(), DataParallel())}
LOCAL_KINDS = [name for name in KINDS if name != DataParallel.name]  # what examples/elastic_local.py runs


# ------------------------------------------------------------------------ the simulation


@dataclass
class _Group:
    """One replica group's state between two rounds."""

    index: int
    step_seconds: float  # its mean seconds per inner step
    steps_per_round: int
    noise: random.Random  # its step times
    faults: random.Random  # its stalls and failures
    ready: float = 0.0  # when its hand-over for the next round it can join is there
    pending: int = 0  # inner steps since its last round
    position: int = 0  # its step count (``num_updates``: a heal takes a peer's)
    counted: int = 0
    dies_at: float = math.inf  # its next failure
    dying: bool = False  # it dies before it hands over
    back_at: float | None = None  # dead until then
    until_stall: float = math.inf  # seconds of its compute until its next random stall
    missed_rounds: int = 0  # rounds landed without it since the last it was in

    @property
    def in_last_round(self) -> bool:
        return self.missed_rounds == 0

    def expected(self, setup: Setup) -> bool:
        """acco's grace window waits for it: it was in one of the last ``grace_memory`` rounds."""
        return self.missed_rounds < setup.grace_memory
    missed: bool = False  # a round landed without it while it was alive
    finished: bool = False


@dataclass(frozen=True)
class Outcome:
    """One simulated run: ``goodput`` = ``counted`` / ``capacity`` (R x wall / mean step time)."""

    goodput: float
    counted: int
    capacity: float
    wall: float
    rounds: int
    late: int  # group-rounds a live group was left out of
    failures: int


def simulate(setup: Setup, rule: RoundRule, seed: int) -> Outcome:
    """One run of ``setup`` under ``rule``; deterministic for a seed."""
    speeds = random.Random(f"{seed}:speeds")
    sigma = math.sqrt(math.log1p(setup.speed_spread**2))
    step_seconds = [setup.step_seconds * (speeds.lognormvariate(-sigma**2 / 2, sigma) if sigma else 1.0)
                    for _ in range(setup.replicas)]  # fmt: skip
    per_round = rule.steps_per_round(setup, step_seconds)
    groups = [_Group(g, step_seconds[g], per_round[g], random.Random(f"{seed}:{g}:noise"),
                     random.Random(f"{seed}:{g}:faults")) for g in range(setup.replicas)]  # fmt: skip
    stall_rate = setup.stalls_per_hour / 3600.0
    failure_rate = 0.0 if math.isinf(setup.mtbf_hours) else 1.0 / (setup.mtbf_hours * 3600.0)
    for g in groups:
        g.dies_at = g.faults.expovariate(failure_rate) if failure_rate else math.inf
        g.until_stall = g.faults.expovariate(stall_rate) if stall_rate else math.inf
    spreads: collections.deque[float] = collections.deque(maxlen=setup.grace_rounds)
    bits = rule.bits(setup)
    sigmas: dict[int, float] = {}

    def start(g: _Group, at: float) -> None:
        """``g`` takes its next round's inner steps from ``at``: when it hands over, and whether
        it dies first."""
        n = g.steps_per_round if setup.steps is None else min(g.steps_per_round, setup.steps - g.position)
        if n <= 0:
            g.finished, g.ready, g.dies_at = True, at, math.inf  # it hands over nothing, at once
            return
        if n not in sigmas:
            sigmas[n] = math.sqrt(math.log1p(setup.step_cv**2 / n))
        s = sigmas[n]
        busy = n * g.step_seconds * (math.exp(g.noise.gauss(-s * s / 2, s)) if s else 1.0)  # a lognormal
        delay = 0.0
        if setup.stalls:
            delay = sum(stall.seconds for stall in setup.stalls
                        if stall.group == g.index and g.position <= stall.step < g.position + n)  # fmt: skip
        left = busy
        while g.until_stall <= left:  # random stalls come on the group's own compute clock
            delay += setup.stall_seconds
            left -= g.until_stall
            g.until_stall = g.faults.expovariate(stall_rate)
        g.until_stall -= left
        g.pending += n
        g.position += n
        g.ready = at + busy + delay
        g.dying = g.dies_at < g.ready

    for g in groups:
        start(g, 0.0)
    end = setup.duration if setup.duration is not None else math.inf
    now, rounds, late, failures, ending = 0.0, 0, 0, 0, False
    while True:
        alive = [g for g in groups if g.back_at is None]
        events = [(g.dies_at + setup.heartbeat, False, g) if g.dying else (g.ready, True, g) for g in alive]
        if setup.grace == "adaptive":
            median = statistics.median(spreads) if spreads else 0.0
            grace = min(setup.grace_cap, max(setup.grace_floor, setup.grace_factor * median))
        else:
            grace = float(setup.grace)
        landing = rule.land(events, setup, grace, sum(1 for g in groups if g.back_at is not None and g.expected(setup)))
        if math.isinf(landing):  # no quorum can form: the job waits for a group to come back
            returns = [g.back_at for g in groups if g.back_at is not None]
            if not returns:
                raise AssertionError("no live group and none restarting")
            landing = max(now, min(returns))
        participants = [g for g in alive if not g.dying and g.ready <= landing]
        back = [g for g in groups if g.back_at is not None and g.back_at <= landing]
        next_start = landing + round_seconds(setup, len(participants) + len(back), bits)
        if next_start > end:
            break
        for g in alive:
            if g.dying and g.dies_at + setup.heartbeat <= landing:  # seen gone: its steps are lost
                failures += 1
                g.back_at, g.pending, g.dying = g.dies_at + setup.restart, 0, False
            elif not g.dying and g.ready > landing:
                late += 1
                g.missed = True
        for g in groups:
            if participants and g not in participants and g not in back:
                g.missed_rounds += 1
        if participants:
            # The window's measure, acco's: how late the last participant handed over after the
            # median one (a late group's hand-over, early as it waited for this round, leaves the
            # median where it is; "all-first": after the first, which it does not; a finished
            # group's, handing over nothing, never counts).
            timed = [g.ready for g in participants if not g.finished and (setup.spread_counts_late or g.in_last_round)]
            if len(timed) > 1:
                spreads.append(max(timed) - (min(timed) if setup.spread_from_first else statistics.median(timed)))
            top = max(g.position for g in participants)
        else:
            top = max(g.position for g in groups)
        for g in participants:
            if rule.keeps_progress or not g.missed:  # else it heals from the others: its steps are lost
                g.counted += g.pending
            g.pending, g.missed, g.missed_rounds = 0, False, 0
        for g in back:  # restarted: it heals inside this round (a peer's step count) and trains from it
            g.dies_at = g.back_at + (g.faults.expovariate(failure_rate) if failure_rate else math.inf)
            g.back_at, g.position, g.missed_rounds, g.missed = None, top, 0, False
        # The end of a job (acco's finish()): once a group has taken its steps, every group
        # finishes in the first round it reaches from then on, a late one with its steps.
        ending = ending or (setup.steps is not None and any(g.position >= setup.steps for g in participants))
        for g in participants + back:
            if ending:
                g.finished, g.ready, g.dies_at, g.dying = True, next_start, math.inf, False
            else:
                start(g, next_start)
        now, rounds = next_start, rounds + 1
        if setup.steps is not None and all(g.finished for g in groups):
            end = now
            break
    wall = end
    capacity = sum(wall / g.step_seconds for g in groups)
    counted = sum(g.counted for g in groups)
    return Outcome(counted / capacity if capacity else 0.0, counted, capacity, wall, rounds, late, failures)


# ------------------------------------------------------------- defaults from the repository


@dataclass(frozen=True)
class Defaults:
    """The model's inputs as this repository's files measured or set them; ``sources`` says
    where each one comes from."""

    step_seconds: float
    step_cv: float
    latency: float
    link_mbit: float
    params: float
    bits: int
    sync_every: int
    heartbeat: float
    join: float
    min_replicas: int
    restart: float
    stall_seconds: float
    grace_factor: float
    grace_floor: float
    grace_cap: float
    grace_rounds: int
    measured_round: float  # a round of 2 groups at link_mbit, 4 bits, as pacing_noise.py measured it
    sources: dict[str, str] = field(default_factory=dict)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise SystemExit(f"goodput_model: cannot read {path} for a default ({error}): give the flag instead")


def _pacing_noise(path: Path) -> dict[str, float]:
    """Step time, its spread and a round's fixed cost from pacing_noise.py's runs of equal
    replicas (2 CPU ranks, the GPT of examples/train_gpt.py): the rounds after the first of the
    ``plain`` loop. A lognormal's mean over its median is exp(sigma^2 / 2), which gives the
    spread of single steps from each round's mean and median step time."""
    runs = [r for r in _read_json(path)["runs"] if r["loop"] == "plain" and r["slowdown"] == 1.0]
    rounds = [(run, x) for run in runs for x in run["rounds"] if x["index"] > 0]
    means = [m for _, x in rounds for m in x["mean"]]
    logs = [math.log(m / d) for _, x in rounds for m, d in zip(x["mean"], x["median"]) if d > 0]
    sigma2 = 2 * max(0.0, statistics.median(logs))
    # A round's fixed cost: its lane time less the wait for hand-overs, on the unlimited link at 4 bits.
    fixed = [x["lane_s"] - x["totals_s"] for run, x in rounds if run["rate"] is None and run["bits"] == 4]
    rated = [run for run in runs if run["rate"] is not None and run["bits"] == 4]
    rate = re.fullmatch(r"(\d+(?:\.\d+)?)mbit", rated[0]["rate"]) if rated else None
    if not means or not fixed or rate is None:
        raise SystemExit(f"goodput_model: {path} lacks the runs for the step time and round defaults: give the flags")
    # The same measure at that rate: what the model's round of 2 groups is held to.
    measured = [x["lane_s"] - x["totals_s"] for run, x in rounds if run is rated[0]]
    return {"step_seconds": statistics.mean(means), "step_cv": math.sqrt(math.expm1(sigma2)),
            "latency": statistics.median(fixed), "link_mbit": float(rate.group(1)),
            "measured_round": statistics.median(measured)}


def _class_constants(path: Path, class_name: str, names: Sequence[str]) -> dict[str, Any]:
    """Literal class attributes of ``class_name`` in ``path``, read without importing it (acco
    imports torch)."""
    found: dict[str, Any] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for statement in node.body:
                if not isinstance(statement, ast.Assign):
                    continue
                for target in statement.targets:
                    targets = target.elts if isinstance(target, ast.Tuple) else [target]
                    values = statement.value.elts if isinstance(statement.value, ast.Tuple) else [statement.value]
                    for t, v in zip(targets, values):
                        if isinstance(t, ast.Name) and t.id in names:
                            found[t.id] = ast.literal_eval(v)
    missing = set(names) - set(found)
    if missing:
        raise SystemExit(f"goodput_model: {path} has no {class_name}.{', '.join(sorted(missing))}: give the flags")
    return found


def _launcher_defaults() -> Any:
    """examples/elastic_local.py's option defaults (its parser; the module imports no torch at the top)."""
    spec = importlib.util.spec_from_file_location("_elastic_local", REPO_ROOT / "examples" / "elastic_local.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.parse_args(["--log-dir", "unused"])


def repository_defaults() -> Defaults:
    """Every default input, read from the repository's result files and code."""
    pacing = _pacing_noise(RESULTS_DIR / "pacing_noise.json")
    launcher = _launcher_defaults()
    grace = _class_constants(REPO_ROOT / "acco" / "elastic.py", "ElasticRunner",
                             ["grace_factor", "grace_floor", "grace_cap", "grace_rounds"])  # fmt: skip
    recovery = _read_json(RESULTS_DIR / "elastic-recovery.json")
    rejoins = [run["rejoin_seconds"] for run in recovery["killed"] if run.get("rejoin_seconds") is not None]
    header = _read_json(RESULTS_DIR / "example_runs.json")["runs"]["sync"]["header"]
    params = re.search(r"([\d.]+)M parameters", header)
    events = [r["event"] or "" for r in _read_json(RESULTS_DIR / "elastic_stress-pause-latekill.json")["runs"]]
    pauses = [float(m.group(1)) for e in events if (m := re.search(r"paused replica \d+ for ([\d.]+) s", e))]
    if not rejoins or params is None or not pauses:
        raise SystemExit("goodput_model: a result file lacks a default (restart, params or stall): give the flags")
    pacing_source = "benchmarks/results/pacing_noise.json (benchmarks/pacing_noise.py: 2 CPU ranks, equal speeds)"
    return Defaults(
        **pacing, params=float(params.group(1)) * 1e6, bits=launcher.outer_bits, sync_every=launcher.sync_every,
        heartbeat=launcher.heartbeat_ms / 1000, join=launcher.join_ms / 1000, min_replicas=launcher.min_replicas,
        restart=statistics.median(rejoins), stall_seconds=statistics.median(pauses), **grace,
        sources={
            "step_seconds": f"{pacing_source}: mean seconds per inner step, plain loop, rounds after the first",
            "step_cv": f"{pacing_source}: lognormal spread from each round's mean / median step time",
            "latency": f"{pacing_source}: median lane time less hand-over wait, unlimited link, 4-bit rounds",
            "link_mbit": f"{pacing_source}: the rate of its rate-limited 4-bit runs",
            "measured_round": f"{pacing_source}: median lane time less hand-over wait, that rate, 4-bit rounds",
            "params": "benchmarks/results/example_runs.json: examples/train_gpt.py's model (pacing_noise.py's)",
            "bits, sync_every, heartbeat, join, min_replicas": "examples/elastic_local.py's option defaults (--outer-bits, "
                                                               "--sync-every, --heartbeat-ms, --join-ms, --min-replicas)",
            "restart": "benchmarks/results/elastic-recovery.json: median 'kill to rejoin' (restart and heal)",
            "stall_seconds": "benchmarks/results/elastic_stress-pause-latekill.json: the pause scenario's length",
            "grace_*": "acco/elastic.py: ElasticRunner.grace_factor, grace_floor, grace_cap, grace_rounds",
        },
    )  # fmt: skip


# ------------------------------------------------------------------ real runs' records


@dataclass(frozen=True)
class RunRecords:
    """What a real run's ``replica-*.jsonl`` records measure."""

    directory: str
    replicas: int
    sync_every: int
    wall: float  # from the first record to the last
    step_seconds: float  # mean seconds per inner step of the rounds without a stall (round included)
    step_cv: float  # of a single step, from the spread of those rounds' per-step times
    counted: int
    counted_from: str  # "counted" (the records say) or "inner steps" (the landed rounds' steps)
    final_steps: tuple[int, ...]  # each group's last inner step


def _records(path: Path) -> list[dict[str, Any]]:
    seen: set[str] = set()
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line in seen:  # a record written twice (a retried log flush) counts once
            continue
        seen.add(line)
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a kill
    return out


def read_run(directory: Path, stalls: Sequence[Stall] = (), sync_every: int | None = None) -> RunRecords:
    """Measure a run of examples/elastic_local.py from its records (``stalls``: its ``--stall``
    options, whose rounds the step time leaves out)."""
    paths = sorted(Path(directory).glob("replica-*.jsonl"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))
    if not paths:
        raise ValueError(f"{directory}: no replica-*.jsonl records")
    per_group = {int(re.sub(r"\D", "", p.stem)): _records(p) for p in paths}
    rounds = {g: [r for r in records if not r.get("final") and "time" in r] for g, records in per_group.items()}
    if not all(rounds.values()):
        raise ValueError(f"{directory}: a group wrote no round record")
    # Intervals between a group's consecutive records of one process: (start, end, steps, group, first step).
    intervals = []
    for g, records in rounds.items():
        for before, after in zip(records, records[1:]):
            steps = after["inner_step"] - before["inner_step"]
            if after.get("pid") == before.get("pid") and steps > 0 and not after.get("dropped"):
                intervals.append((before["time"], after["time"], steps, g, before["inner_step"]))
    stalled = [(a, b) for a, b, n, g, k in intervals for s in stalls if s.group == g and k <= s.step < k + n]
    clean = [(b - a) / n for a, b, n, _, _ in intervals
             if not any(a < stop and b > begin for begin, stop in stalled)]  # fmt: skip
    if clean:  # a stall not scheduled (a loaded machine) is not the run's pace either
        typical = statistics.median(clean)
        clean = [x for x in clean if x <= 3 * typical]
    if len(clean) < 2:
        raise ValueError(f"{directory}: fewer than 2 rounds without a stall to measure the step time")
    steps_seen = [n for _, _, n, _, _ in intervals]
    h = sync_every or collections.Counter(steps_seen).most_common(1)[0][0]
    mean = statistics.mean(clean)
    cv = statistics.stdev(clean) / mean * math.sqrt(h)  # a round's per-step time averages h steps
    if all("counted" in r for records in rounds.values() for r in records):
        counted, source = sum(r["counted"] or 0 for records in rounds.values() for r in records), "counted"
    else:
        counted, source = 0, "inner steps"
        for records in rounds.values():
            for before, after in zip(records, records[1:]):
                if after.get("pid") == before.get("pid") and not after.get("dropped") and not after.get("content_heal"):
                    counted += max(0, after["inner_step"] - before["inner_step"])
    begin = min(records[0]["time"] for records in rounds.values())
    wall = max(records[-1]["time"] for records in rounds.values()) - begin
    finals = tuple(max(r["inner_step"] for r in per_group[g]) for g in sorted(per_group))
    return RunRecords(str(directory), len(paths), h, wall, mean, cv, counted, source, finals)


def check(directory: Path, stalls: Sequence[Stall], base: Setup, *, kind: str, stop: str = "auto",
          seeds: Sequence[int] = (0, 1, 2), sync_every: int | None = None, explicit_step: bool = False,
          explicit_cv: bool = False) -> dict[str, Any]:
    """Measured goodput of a real run beside the model's for the same job (``base``: the
    inputs the run does not measure)."""
    run = read_run(directory, stalls, sync_every)
    measured = run.counted * run.step_seconds / (run.replicas * run.wall)
    if stop == "auto":  # equal step counts: stop_after(steps=); else the run stopped on time
        stop = "steps" if len(set(run.final_steps)) == 1 else "seconds"
    length = ({"steps": max(run.final_steps), "duration": None} if stop == "steps"
              else {"steps": None, "duration": run.wall})  # fmt: skip
    setup = replace(base, replicas=run.replicas, sync_every=run.sync_every,
                    min_replicas=min(base.min_replicas, run.replicas), **length)  # fmt: skip
    setup = calibrated(setup, run, explicit_step=explicit_step, explicit_cv=explicit_cv)
    predicted = {}
    for name in LOCAL_KINDS:
        rule = KINDS[name]
        ratios = []
        for seed in seeds:  # the model's own unstalled pace is its yardstick, as the run's is
            calm = simulate(replace(setup, stalls=(), stalls_per_hour=0.0, mtbf_hours=math.inf), rule, seed)
            stalled = simulate(replace(setup, stalls=tuple(stalls)), rule, seed)
            ratios.append((stalled.counted / stalled.wall) / (calm.counted / calm.wall))
        predicted[name] = statistics.median(ratios)
    return {"run": asdict(run), "stop": stop, "stalls": [asdict(s) for s in stalls], "measured": measured,
            "model": predicted, "kind": kind, "relative_error": predicted[kind] / measured - 1}


# ------------------------------------------------------------------- the grid and its table


def grid(base: Setup, replicas: Sequence[int], stall_rates: Sequence[float], kinds: Sequence[str],
         seeds: Sequence[int]) -> list[dict[str, Any]]:
    """Median goodput over ``seeds`` for every kind of round x R x stall rate."""
    rows = []
    for rate in stall_rates:
        for name in kinds:
            for r in replicas:
                setup = replace(base, replicas=r, stalls_per_hour=rate, min_replicas=min(base.min_replicas, r))
                outcomes = [simulate(setup, KINDS[name], seed) for seed in seeds]
                rows.append({"kind": name, "replicas": r, "stalls_per_hour": rate,
                             "goodput": statistics.median(o.goodput for o in outcomes),
                             "seeds": [asdict(o) for o in outcomes],
                             "compute_share": setup.compute_share(KINDS[name])})  # fmt: skip
    return rows


def _percent(x: float) -> str:
    return f"{100 * x:.0f}%"


def table(rows: Sequence[dict[str, Any]], base: Setup) -> str:
    """Goodput per kind of round (rows, blocks per stall rate) x R (columns), the compute share
    first, Decoupled DiLoCo's reported figures beside the heaviest block's rows."""
    replicas = sorted({row["replicas"] for row in rows})
    rates = sorted({row["stalls_per_hour"] for row in rows})
    kinds = list(dict.fromkeys(row["kind"] for row in rows))
    by = {(row["kind"], row["replicas"], row["stalls_per_hour"]): row for row in rows}
    header = ["stalls / group-hour", "kind of round", *[f"R={r}" for r in replicas], "reported (theirs)*"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    ceilings: dict[tuple[str, ...], list[str]] = {}  # kinds whose rounds cost the same share one row
    for name in kinds:
        shares = tuple(_percent(by[(name, r, rates[0])]["compute_share"]) for r in replicas)
        ceilings.setdefault(shares, []).append(name)
    for shares, names in ceilings.items():
        lines.append(f"| ceiling | {', '.join(names)}: H t / (H t + round) | " + " | ".join(shares) + " |  |")
    for rate in rates:
        for name in kinds:
            cells = [_percent(by[(name, r, rate)]["goodput"]) for r in replicas]
            reported = _percent(REPORTED[name]) if rate == rates[-1] and name in REPORTED else ""
            lines.append(f"| {rate:g} | {name} | " + " | ".join(cells) + f" | {reported} |")
    failures = "none" if math.isinf(base.mtbf_hours) else f"MTBF {base.mtbf_hours:g} h per group"
    lines.append("")
    lines.append(f"Stalls of {base.stall_seconds:g} s; failures: {failures}, restart {base.restart:.1f} s; "
                 f"H = {base.sync_every}, step {base.step_seconds * 1000:.0f} ms (CV {base.step_cv:.2f}); "
                 f"median of {len(rows[0]['seeds'])} seeds over {base.duration:g} s each.")  # fmt: skip
    lines.append(f"*{REPORTED['source']}: their setting (TPU learners, heavy simulated failures, their own "
                 "syncer), not this model's; placed beside the heaviest stall rate only for scale.")
    return "\n".join(lines)


# Kinds that often coincide (equal-speed groups; a late group's one round) drawn so both show.
STYLES = {"lockstep": ("tab:blue", "-", "o", 3.0), "speed-paced": ("tab:cyan", "--", "x", 1.2),
          "quorum-grace": ("tab:green", "-", "o", 3.0), "quorum-drop": ("tab:olive", "--", "x", 1.2),
          "data-parallel": ("tab:purple", "-", "s", 1.5)}


def figure(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Goodput against R, a line per kind of round, a panel per stall rate; Decoupled DiLoCo's
    reported figures as grey lines."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    rates = sorted({row["stalls_per_hour"] for row in rows})
    kinds = list(dict.fromkeys(row["kind"] for row in rows))
    replicas = sorted({row["replicas"] for row in rows})
    fig, axes = plt.subplots(1, len(rates), figsize=(4.0 * len(rates), 3.9), sharey=True, squeeze=False)
    for ax, rate in zip(axes[0], rates):
        for name in kinds:
            points = sorted((row["replicas"], row["goodput"]) for row in rows
                            if row["kind"] == name and row["stalls_per_hour"] == rate)  # fmt: skip
            colour, line, marker, width = STYLES[name]
            ax.plot([p[0] for p in points], [100 * p[1] for p in points], color=colour, linestyle=line,
                    marker=marker, linewidth=width, label=name)  # fmt: skip
        for name, line in (("quorum-grace", "--"), ("data-parallel", ":")):
            ax.axhline(100 * REPORTED[name], color="grey", linestyle=line, linewidth=0.9)
        ax.set_xscale("log", base=2)
        ax.set_xticks(replicas, [str(r) for r in replicas])
        ax.minorticks_off()
        ax.set_xlabel("replica groups R")
        ax.set_title(f"{rate:g} stalls per group-hour", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("goodput (%)")
    axes[0][0].set_ylim(0, 100)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for name, line in (("quorum-grace", "--"), ("data-parallel", ":")):
        handles.append(plt.Line2D([], [], color="grey", linestyle=line))
        labels.append(f"{name}, Decoupled DiLoCo reported (theirs, their setting)")
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------- the CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    src = "default: benchmarks/results/pacing_noise.json"
    add("--replicas", type=int, nargs="+", default=[2, 4, 8, 16, 64], help="replica groups R (default: %(default)s)")
    add("--sync-every", type=int, default=None, help="H (default: examples/elastic_local.py's --sync-every)")
    add("--step-seconds", type=float, default=None, help=f"mean seconds per inner step ({src})")
    add("--step-cv", type=float, default=None, help=f"coefficient of variation of one step's time ({src})")
    add("--calibrate", type=Path, default=None, metavar="DIR", help="step time and spread from a real run's "
        "DIR/replica-*.jsonl (examples/elastic_local.py), its round in the step time unless "
        "--latency-ms / --link-mbit give one")  # fmt: skip
    add("--params", type=float, default=None, help="model parameters (default: benchmarks/results/example_runs.json)")
    add("--bits", type=int, default=None, help="outer round bits (default: examples/elastic_local.py's --outer-bits)")
    add("--dp-bits", type=int, default=32, help="data parallel's all-reduce bits (default %(default)s: plain DDP's "
        "fp32 gradients)")  # fmt: skip
    add("--link-mbit", type=float, default=None, help=f"link rate per group, Mbit/s; inf: unlimited ({src})")
    add("--latency-ms", type=float, default=None, help=f"a round's fixed cost ({src})")
    add("--heartbeat-ms", type=float, default=None, help="lighthouse heartbeat timeout (default: the launcher's)")
    add("--join-ms", type=float, default=None, help="lighthouse join timeout (default: the launcher's)")
    add("--restart-seconds", type=float, default=None, help="a dead group's kill to rejoin "
        "(default: median of benchmarks/results/elastic-recovery.json)")  # fmt: skip
    add("--min-replicas", type=int, default=None, help="a quorum's minimum (default: the launcher's)")
    add("--grace", default="adaptive", help="'adaptive' (acco's rule, the default) or seconds")
    add("--spread", choices=["all", "all-first", "on-time"], default="all", help="the adaptive window's spread of "
        "hand-over times: the last participant's after the median one (the default: acco/elastic.py's), after "
        "the first one, or among the last round's groups only")  # fmt: skip
    add("--grace-factor", type=float, default=None, help="adaptive window: times the median spread "
        "(default: acco/elastic.py's ElasticRunner.grace_factor)")  # fmt: skip
    add("--stall-seconds", type=float, default=None, help="length of a random stall "
        "(default: benchmarks/results/elastic_stress-pause-latekill.json's pause)")  # fmt: skip
    add("--stalls-per-hour", type=float, nargs="+", default=[0.0, 6.0, 30.0], help="random stalls per hour of a "
        "group's compute (default: %(default)s; a scenario, not a measurement)")  # fmt: skip
    add("--stall", action="append", default=[], metavar="I:K:T", help="group I sleeps T s at its inner step K "
        "(as examples/elastic_local.py's --stall); repeatable")  # fmt: skip
    add("--mtbf-hours", type=float, default=None, help="mean time between failures per group; inf: none "
        "(default 1: a scenario, not a measurement; --check: none)")  # fmt: skip
    add("--speed-spread", type=float, default=0.0, help="CV of the groups' lasting speeds (0: equal groups, as "
        "pacing_noise.json's)")  # fmt: skip
    add("--seconds", type=float, default=3600.0, help="simulated wall time per run (default: %(default)s)")
    add("--seeds", type=int, nargs="+", default=[0, 1, 2], help="median over these (default: %(default)s)")
    add("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS))
    add("--out", type=Path, default=None, help=f"JSON (default: {DEFAULT_OUT.relative_to(REPO_ROOT)}, "
        f"--check: {CHECK_OUT.relative_to(REPO_ROOT)})")  # fmt: skip
    add("--figure", type=Path, default=None, metavar="PATH", help="draw goodput against R here")
    add("--check", type=Path, nargs="+", default=None, metavar="DIR", help="real runs to hold the model to")
    add("--kind", choices=LOCAL_KINDS, default="quorum-grace", help="--check: the kind of round the runs used")
    add("--stop", choices=["auto", "steps", "seconds"], default="auto", help="--check: the runs' stop rule "
        "(auto: steps where every group ended at the same step count)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        args.stalls = tuple(Stall.parse(text) for text in args.stall)
        if args.grace != "adaptive":
            args.grace = float(args.grace)
    except ValueError as error:
        parser.error(str(error))
    return args


def base_setup(args: argparse.Namespace, defaults: Defaults, *, from_records: bool = False) -> tuple[Setup, dict]:
    """The Setup of the flags, each one not given from the defaults; and where each input
    came from. ``from_records``: the step time will come from a run's records, which hold one
    time per round: the round is then in it (latency 0, unlimited link) unless given."""
    sources = dict(defaults.sources)
    latency, link = defaults.latency, defaults.link_mbit
    if from_records:
        latency, link = 0.0, math.inf
        sources.update(latency="0 unless --latency-ms: the records' step time holds its share of the round",
                       link_mbit="unlimited unless --link-mbit: the records' step time holds the round")  # fmt: skip
    mtbf = args.mtbf_hours if args.mtbf_hours is not None else (math.inf if args.check else 1.0)
    setup = Setup(
        replicas=2, sync_every=args.sync_every or defaults.sync_every,
        step_seconds=args.step_seconds or defaults.step_seconds,
        step_cv=defaults.step_cv if args.step_cv is None else args.step_cv,
        params=args.params or defaults.params, bits=args.bits or defaults.bits, dp_bits=args.dp_bits,
        link_mbit=link if args.link_mbit is None else args.link_mbit,
        latency=latency if args.latency_ms is None else args.latency_ms / 1000,
        heartbeat=defaults.heartbeat if args.heartbeat_ms is None else args.heartbeat_ms / 1000,
        join=defaults.join if args.join_ms is None else args.join_ms / 1000,
        restart=defaults.restart if args.restart_seconds is None else args.restart_seconds,
        min_replicas=args.min_replicas or defaults.min_replicas,
        stall_seconds=defaults.stall_seconds if args.stall_seconds is None else args.stall_seconds,
        stalls=args.stalls, mtbf_hours=mtbf, grace=args.grace,
        grace_factor=args.grace_factor or defaults.grace_factor, grace_floor=defaults.grace_floor,
        grace_cap=defaults.grace_cap, grace_rounds=defaults.grace_rounds, spread_counts_late=args.spread != "on-time", spread_from_first=args.spread == "all-first",
        speed_spread=args.speed_spread,
        duration=args.seconds,
    )  # fmt: skip
    return setup, sources


def calibrated(setup: Setup, run: RunRecords, *, explicit_step: bool = False, explicit_cv: bool = False) -> Setup:
    """``setup`` with the step time and spread a run measured, less the round's share of each
    step (a record's time per step holds it) where ``setup`` has a round of its own."""
    step = setup.step_seconds if explicit_step else run.step_seconds
    if not explicit_step:
        share = round_seconds(setup, run.replicas, setup.bits) / run.sync_every
        if share >= step:
            raise ValueError(f"the round given ({share:.4f} s per step) is more than the measured step "
                             f"time ({step:.4f} s)")
        step -= share
    return replace(setup, step_seconds=step, step_cv=setup.step_cv if explicit_cv else run.step_cv)


def _write(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {path}")


def main(argv: Sequence[str] | None = None) -> None:
    try:
        run_main(parse_args(argv), argv)
    except ValueError as error:  # an input the model refuses, named by Setup
        raise SystemExit(f"goodput_model: {error}") from None


def run_main(args: argparse.Namespace, argv: Sequence[str] | None) -> None:
    began = time.perf_counter()
    defaults = repository_defaults()
    base, sources = base_setup(args, defaults, from_records=bool(args.check or args.calibrate))
    explicit = {"explicit_step": args.step_seconds is not None, "explicit_cv": args.step_cv is not None}
    if args.check:
        results = []
        for directory in args.check:
            try:
                result = check(directory, args.stalls, base, kind=args.kind, stop=args.stop, seeds=args.seeds,
                               sync_every=args.sync_every, **explicit)  # fmt: skip
            except (OSError, ValueError, KeyError, TypeError) as error:
                print(f"{directory}: cannot check ({type(error).__name__}: {error})")
                continue
            run = result["run"]
            print(f"{directory}: R={run['replicas']}, H={run['sync_every']}, stop on {result['stop']} "
                  f"(final steps {list(run['final_steps'])}), wall {run['wall']:.2f} s, "
                  f"step {run['step_seconds'] * 1000:.1f} ms (CV {run['step_cv']:.2f}), "
                  f"stalls {' '.join(args.stall) or 'none'}")  # fmt: skip
            print(f"  measured goodput {result['measured']:.3f} (from {run['counted_from']}); model "
                  + ", ".join(f"{name} {value:.3f}" for name, value in result["model"].items()))
            print(f"  model ({args.kind}) against measured: {100 * result['relative_error']:+.1f}%")
            results.append(result)
        _write(args.out or CHECK_OUT, {"benchmark": "goodput_model-check", "inputs": asdict(base),
                                       "sources": sources, "checks": results})  # fmt: skip
        return
    if args.calibrate:
        run = read_run(args.calibrate, args.stalls, args.sync_every)
        base = calibrated(base, run, **explicit)
        sources.update(step_seconds=f"{run.directory}: seconds per inner step of its unstalled rounds",
                       step_cv=f"{run.directory}: their spread")  # fmt: skip
    rows = grid(base, args.replicas, args.stalls_per_hour, args.kinds, args.seeds)
    print(table(rows, base))
    # The round formula against a measured round (2 groups, 4 bits, pacing_noise.json's link).
    rated = replace(base, bits=4, link_mbit=defaults.link_mbit, latency=defaults.latency, params=defaults.params)
    round_check = {"model": round_seconds(rated, 2, 4), "measured": defaults.measured_round,
                   "link_mbit": defaults.link_mbit}  # fmt: skip
    print(f"A round of 2 groups at 4 bits and {defaults.link_mbit:g} Mbit/s: {round_check['model']:.3f} s in the "
          f"model, {round_check['measured']:.3f} s measured (pacing_noise.json).")  # fmt: skip
    elapsed = time.perf_counter() - began
    print(f"\n{len(rows) * len(args.seeds)} runs in {elapsed:.1f} s")
    _write(args.out or DEFAULT_OUT, {
        "benchmark": "goodput_model",
        "command": "python benchmarks/goodput_model.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "inputs": asdict(base), "sources": sources, "round_check": round_check, "replicas": args.replicas,
        "stalls_per_hour": args.stalls_per_hour, "seeds": args.seeds, "rows": rows, "reported": REPORTED,
        "runtime_s": round(elapsed, 2),
    })  # fmt: skip
    if args.figure:
        figure(rows, args.figure)
        print(f"wrote {args.figure}")


if __name__ == "__main__":
    main()
