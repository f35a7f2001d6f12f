"""The constructor's arguments: their enums, their checks, and the param groups they give.

Everything here runs before the first collective and creates no state, so a bad argument
raises on the rank that passed it and never leaves a half-built optimizer or a hung rank
(docs/design.md, "Errors").
"""

from __future__ import annotations

import collections
import copy
import datetime
import enum
import functools
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from acco.sharding import Layout
from acco.module_buffers import BufferPolicy
from acco.outer_step import LinearOuterStep
from acco.quantize import OUTER_BITS, TOPK_BITS, TOPK_BLOCK, BlockCodec, TopKCodec, check_estimate_dtype

__all__ = ["AUTO", "AUTO_EVERY_BOUNDS", "BLOCK_OR_HIDE", "FIT", "FIXED", "DEFAULT_ELASTIC_OUTER", "DEFAULT_OUTER", "DEFAULT_PACING", "HALF", "DEFAULT_OVERLAP", "DEFAULT_SYNC_DELAY", "DEFAULT_SYNC_EVERY", "DEFAULT_TIMEOUT", "LOCKSTEP", "LocalOptions", "MODE_ONLY", "Mode", "NonFinite", "Options", "Overlap", "RoundKind", "SPEED", "Weighting", "base_hyperparams", "build_base_optimizer", "check_estimate_dtypes", "choose_fused", "check_optimizer_class", "default_outer", "ignore_other_modes", "parse_enum", "probe_defaults", "resolve_groups"]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)

E = TypeVar("E", bound=enum.Enum)


class Mode(str, enum.Enum):
    """What a round does (docs/design.md, "The algorithm")."""

    SYNC = "sync"  # ZeRO-1: reduce-scatter -> update -> all-gather inside step(), no overlap
    DPU = "dpu"  # every round commits, with the previous round's gradients; overlapped
    ACCO = "acco"  # estimate and commit rounds alternate; overlapped, delay compensated
    LOCAL = "local"  # inner steps on each replica, an outer round every sync_every steps (acco.local)


class NonFinite(str, enum.Enum):
    """What a round does when some rank's gradients hold NaN or inf."""

    RAISE = "raise"  # CommLaneError on every rank; shards and state untouched
    SKIP = "skip"  # no update on any rank; reported in RoundStats.skipped and skipped_updates


class RoundKind(str, enum.Enum):
    """An estimate round places the look-ahead theta~ and changes no state; a commit round
    updates the master shard and the optimizer state."""

    ESTIMATE = "estimate"
    COMMIT = "commit"
    OUTER = "outer"  # mode="local": the mean pseudo-gradient -> the sharded outer update -> the new global values


class Overlap(str, enum.Enum):
    """mode="local": what the inner steps taken while an outer round is in flight become
    when it lands (docs/design.md, "Local steps")."""

    DISCARD = "discard"  # dropped: every replica takes the new global values (torchft's default)
    KEEP = "keep"  # added on top of the new global values (they count in the next outer round)
    # Kept, and taken from an estimate: at the launch each replica moves to the outer step its own
    # pseudo-gradient would give (acco.outer_step); the landing corrects that start to the real one.
    ESTIMATE = "estimate"


class Weighting(str, enum.Enum):
    """mode="local": how an outer round weighs each replica's pseudo-gradient in the mean
    (docs/design.md, "Replicas of different speeds")."""

    TOKENS = "tokens"  # by the accumulate() weights it trained on since its last hand-over
    EQUAL = "equal"  # each replica once, whatever it trained on (torchft's DiLoCo)
    # FedNova's normalisation: each pseudo-gradient over its inner steps, the mean times the
    # weighted mean of the steps (a replica's step count no longer scales its share).
    NORMALIZED = "normalized"


# Optimizers whose update of an element depends only on that element's own gradient and
# state, so a flat shard may cut a tensor anywhere.
_ELEMENTWISE: tuple[type, ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adadelta,
    torch.optim.Rprop,
    torch.optim.ASGD,
)
# Optimizers known to look at whole tensors (orthogonalisation, factored moments).
_WHOLE_TENSOR: tuple[type, ...] = tuple(
    getattr(torch.optim, name) for name in ("Muon", "Adafactor", "SparseAdam") if hasattr(torch.optim, name)
)
# Param-group entries that are acco's, not the base optimizer's hyper-parameters.
_NOT_HYPERPARAMS = ("params", "optimizer_class", "layout")


# mode="local": the outer SGD and H, chosen together on 2026-11-28 against data-parallel at equal
# tokens (benchmarks/local_quality.py; docs/loops.md, "Local steps against data-parallel"). At
# R = 2, H = 4, no momentum: lr 1.0, 1.2 and 1.4 ended 0.39%, 0.48% and 0.51% above data-parallel
# at 20 tokens per parameter (0.47% and 0.65% for 1.0 and 1.2 at the 0.83M example); momentum
# across rounds (DiLoCo's 0.7 / 0.9, the 0.5 / 0.3 of 2026-11-26) 7-9% above it at H = 8, lr 2 34%.
# lr 1.0, plain averaging: as good as any, and a replica alone in a round (an elastic group lost)
# moves the global values by its own progress, no more (an lr above 1 overshoots by its excess).
DEFAULT_OUTER = functools.partial(torch.optim.SGD, lr=1.0, momentum=0.0)
# Elastic replica groups (membership=) keep the damped outer step of 2026-11-27: with plain
# averaging the stress tier's rank-kill runs at seed 1337 end up to 2.3% above the survivor alone
# (6 of 10 within its 2% in lockstep, 4 of 10 on 2026-11-28), with this one -0.4% to +1.4% of the
# expected. No rejoin mechanism was found (the heal is exact; at seed 7 the same runs end below
# the survivor alone, and at seed 1337 group 0 alone after three joint rounds, no restart at all,
# ends 3% above it): docs/elastic.md, "A rejoin at plain averaging".
DEFAULT_ELASTIC_OUTER = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.3, nesterov=True)
# sync_every="auto", the default (acco.replicas.plan_sync_every): H is chosen at each landing from the
# measured inner step time and the round's own time, so that waiting for rounds costs at most 4% of
# the wall time, within these bounds unless given ("auto", lo, hi). The first rounds run the lower
# bound: measured quickly, and 4 is the H the outer step was chosen at against data-parallel (on a
# link whose rounds cost less than that, H stays 4). Measured against fixed H at equal time behind
# 20, 200 and 500 Mbit/s and an unlimited link (docs/loops.md, "Local steps that never wait").
AUTO_EVERY_BOUNDS = (4, 128)
DEFAULT_SYNC_EVERY = "auto"


def default_outer(sync_every: int | str, elastic: bool = False) -> functools.partial:
    """The outer optimizer ``mode="local"`` uses unless given one, for ``sync_every`` inner
    steps per round, an int or ``"auto"`` (the same at H = 4, 8 and 30: docs/loops.md, "Local
    steps against data-parallel"); ``elastic``: with ``membership=`` (replica groups that come and go: the
    damped step their recovery was measured with, docs/elastic.md)."""
    return DEFAULT_ELASTIC_OUTER if elastic else DEFAULT_OUTER


# When an outer round lands: 0 at once (blocking DiLoCo), "auto" at the first inner step at which
# the comm lane has finished it (at the latest sync_every steps after its launch), "half"
# sync_every // 2 inner steps after its launch, an int that many. The default (None) is chosen
# with H: with sync_every="auto" each round blocks, at the H where that costs at most 4% of the wall
# time, unless landing one inner step after its launch (hidden behind that step) lets H stay more
# than HIDE_COST steps smaller
# (acco.replicas.plan_sync_every; docs/loops.md, "Local steps that never wait"); with a fixed
# sync_every it blocks, the recurrence bit for bit. Elastic replica groups (membership=) block:
# a dropped round or a heal rewrites a replica's parameters on the comm lane. With a delay the
# default rule is "estimate" (each replica starts from its own estimate of the outer step and keeps
# every step), or "discard" with an outer optimizer that has no linear split. Typed, so a
# configurator can override them.
AUTO, HALF = "auto", "half"
DEFAULT_SYNC_DELAY = None
# How sync_every="auto" lands rounds (acco.replicas.plan_sync_every): each blocking or a step late
# (the default sync_delay), a fixed number of steps after the launch (an int sync_delay: 0 blocks),
# once done (sync_delay="auto").
BLOCK_OR_HIDE, FIXED, FIT = "block-or-hide", "fixed", "fit"
DEFAULT_OVERLAP = "estimate"
# Bits per value an outer round sends (docs/design.md, "Lighter outer rounds"): 4 measured as
# fp32 at equal inner steps and on an unlimited link, and ahead behind 20 and 50 Mbit/s
# (docs/loops.md, "Lighter outer rounds"); and whether below 16 what quantisation dropped is
# sent later.
DEFAULT_OUTER_BITS = 4
DEFAULT_OUTER_ERROR_FEEDBACK = True
# The share of each block's values a sparse outer round sends (docs/design.md, "Sparse outer
# rounds"); None: every value (a dense round).
DEFAULT_OUTER_TOPK = None
# How many inner steps each replica takes per outer round (docs/loops.md, "Replicas of different
# speeds"): "speed" in proportion to its measured speed, the fastest sync_every, so that no replica
# waits for another; "lockstep" sync_every each; or a fixed number per replica (reproducible).
SPEED, LOCKSTEP = "speed", "lockstep"
DEFAULT_PACING = SPEED
DEFAULT_OUTER_WEIGHTING = "tokens"

# The arguments one mode alone reads, each with its owner and the value that means "not given".
# Given otherwise in another mode they are ignored, with one warning, so that a configurator's
# typed defaults (nanoGPT's configurator.py overrides only what has one) serve every mode.
MODE_ONLY: dict[str, tuple[Mode, Any]] = {
    "estimate_dtype": (Mode.ACCO, None),
    "sync_every": (Mode.LOCAL, DEFAULT_SYNC_EVERY),
    "sync_delay": (Mode.LOCAL, DEFAULT_SYNC_DELAY),
    "overlap": (Mode.LOCAL, DEFAULT_OVERLAP),
    "outer_optimizer": (Mode.LOCAL, None),
    "outer_bits": (Mode.LOCAL, DEFAULT_OUTER_BITS),
    "outer_error_feedback": (Mode.LOCAL, DEFAULT_OUTER_ERROR_FEEDBACK),
    "outer_topk": (Mode.LOCAL, DEFAULT_OUTER_TOPK),
    "pacing": (Mode.LOCAL, DEFAULT_PACING),
    "outer_weighting": (Mode.LOCAL, DEFAULT_OUTER_WEIGHTING),
    "membership": (Mode.LOCAL, None),
}
# The outer optimizer's hyper-parameters that describe() shows, those it has.
_OUTER_SHOWN = ("lr", "momentum", "nesterov", "betas", "weight_decay")


@dataclass(frozen=True)
class LocalOptions:
    """The checked arguments of ``mode="local"`` (:mod:`acco.local`).

    Attributes:
        sync_delay: inner steps from an outer round's launch to its landing (``"half"``
            resolved), or ``"auto"``.
        estimate: with ``overlap="estimate"``, the outer step split into its common part and
            the part linear in the pseudo-gradient (None otherwise).
        pacing: ``"speed"``, ``"lockstep"``, or each replica's inner steps per round (a tuple).
        outer_weighting: how each replica's pseudo-gradient counts in the outer round's mean.
        outer_hyperparams: the outer optimizer's lr, momentum, ... as built (``describe()``).
        membership: who takes part in each outer round under failures (an
            :class:`acco.elastic.TorchFT`), or None: every replica of the process group.
        auto_every: with ``sync_every="auto"``, the bounds (lo, hi) H is chosen in
            (``sync_every`` is then the first round's, lo); None: a fixed ``sync_every``.
        landing: with ``sync_every="auto"``, how the planner lands rounds
            (:func:`acco.replicas.plan_sync_every`): ``"block-or-hide"`` (the default
            ``sync_delay``: each round blocks or lands one step late, ``sync_delay`` then
            holding 0), ``"fixed"`` (an int ``sync_delay``, 0: blocking) or ``"fit"``
            (``sync_delay="auto"``).
    """

    sync_every: int
    sync_delay: int | str
    overlap: Overlap
    outer_optimizer: Callable[..., torch.optim.Optimizer]
    outer_class: type
    outer_bits: int = DEFAULT_OUTER_BITS
    outer_error_feedback: bool = DEFAULT_OUTER_ERROR_FEEDBACK
    estimate: LinearOuterStep | None = None
    pacing: str | tuple[int, ...] = DEFAULT_PACING
    outer_weighting: Weighting = Weighting.TOKENS
    outer_hyperparams: tuple[tuple[str, Any], ...] = ()
    membership: Any = None
    auto_every: tuple[int, int] | None = None
    landing: str = FIXED
    outer_topk: float | None = DEFAULT_OUTER_TOPK

    def describe(self) -> list[str]:
        """The resolved settings, one ``"name: value"`` each (``repr(opt)``, and the line logged
        at construction)."""
        outer = ", ".join(f"{name}={value}" for name, value in self.outer_hyperparams)
        return [
            f"sync_every: {self.sync_every}" if self.auto_every is None else
            f"sync_every: auto ({self.auto_every[0]}-{self.auto_every[1]}, from {self.sync_every})",
            f"sync_delay: {self.sync_delay}" if self.landing != BLOCK_OR_HIDE else
            "sync_delay: chosen with sync_every (0, or 1 where a round hides behind a step)",
            f"overlap: {self.overlap.value}",
            f"outer_optimizer: {self.outer_class.__name__}({outer})",
            f"outer_bits: {self.outer_bits}",
            *([f"outer_topk: {self.outer_topk:g}"] if self.outer_topk is not None else []),
            f"outer_error_feedback: {self.error_feedback}",
            f"pacing: {list(self.pacing) if isinstance(self.pacing, tuple) else self.pacing}",
            f"outer_weighting: {self.outer_weighting.value}",
            *([f"membership: {type(self.membership).__name__}"] if self.membership is not None else []),
        ]

    @property
    def error_feedback(self) -> bool:
        """Each rank keeps what its round did not send of its pseudo-gradient (below 16 bits:
        the rounding; with ``outer_topk``: the values left out too)."""
        return self.outer_error_feedback and (self.outer_bits < 16 or self.outer_topk is not None)

    def codec(self) -> BlockCodec | TopKCodec | None:
        """The encoding of both legs of an outer round; None: a dense round at 32 bits (the
        parameters themselves reduce-scattered)."""
        if self.outer_topk is not None:
            return TopKCodec(self.outer_topk, self.outer_bits)
        return None if self.outer_bits == 32 else BlockCodec(self.outer_bits)

    @property
    def auto_delay(self) -> bool:
        """A round lands when it has completed (``sync_delay="auto"``), not after a fixed count."""
        return self.sync_delay == AUTO

    @property
    def overlaps(self) -> bool:
        """Inner steps run while every round is in flight (every ``sync_delay`` but 0)."""
        return self.sync_delay != 0

    @property
    def may_overlap(self) -> bool:
        """Inner steps may run while a round is in flight: every round, or those the planner
        lands a step late (the default landing)."""
        return self.overlaps or self.landing == BLOCK_OR_HIDE

    @property
    def lockstep(self) -> bool:
        """Every replica takes ``sync_every`` inner steps per round (``"lockstep"``, or a
        schedule giving each replica the same number, which is then ``sync_every``)."""
        return self.pacing == LOCKSTEP or (isinstance(self.pacing, tuple) and len(set(self.pacing)) == 1)

    @classmethod
    def check(cls, mode: Mode, sync_every: Any, sync_delay: Any, overlap: Any, outer_optimizer: Any,
              outer_bits: Any = DEFAULT_OUTER_BITS, outer_error_feedback: Any = DEFAULT_OUTER_ERROR_FEEDBACK,
              pacing: Any = DEFAULT_PACING, outer_weighting: Any = DEFAULT_OUTER_WEIGHTING, membership: Any = None,
              outer_topk: Any = DEFAULT_OUTER_TOPK) -> LocalOptions | None:  # fmt: skip
        """The options of ``mode="local"`` (None in another mode: :func:`ignore_other_modes`
        has set them aside); ``ValueError`` / ``TypeError`` naming a bad value."""
        if mode is not Mode.LOCAL:
            return None
        every, auto_every = _check_sync_every(DEFAULT_SYNC_EVERY if sync_every is None else sync_every)
        delay = 0 if sync_delay is None else sync_delay  # (the default: blocking, or chosen with H below)
        if delay == HALF:
            if auto_every is not None:
                raise ValueError("Invalid sync_delay with sync_every='auto' (the default): 'half' (half of an H that "
                                 "moves: give an int up to the lower bound, \"auto\", or an int sync_every)")  # fmt: skip
            delay = every // 2
        if delay != AUTO and (isinstance(delay, bool) or not isinstance(delay, int) or not 0 <= delay <= every):
            most = f"the lower bound of sync_every='auto' (the default), {every}" if auto_every else f"sync_every={every}"
            raise ValueError(
                f"Invalid sync_delay: {sync_delay!r} (None, \"auto\", \"half\" or an int in [0, {most}]: the inner steps "
                "an outer round overlaps; 0 blocks)"
            )
        chosen = parse_enum(Overlap, DEFAULT_OVERLAP if overlap is None else overlap, "overlap")
        outer = default_outer(every, elastic=membership is not None) if outer_optimizer is None else outer_optimizer
        if not callable(outer):
            raise TypeError(f"Invalid outer_optimizer: {outer!r} (a torch.optim.Optimizer class or a partial of one)")
        try:
            probe = outer([torch.zeros(2, requires_grad=True)])
        except Exception as error:
            raise ValueError(f"Invalid outer_optimizer: {outer!r} could not be built on a tensor: {error}") from error
        if not isinstance(probe, torch.optim.Optimizer):
            raise TypeError(f"Invalid outer_optimizer: {outer!r} built a {type(probe).__name__}, not a torch.optim.Optimizer")
        check_optimizer_class(type(probe))
        estimate = None
        if chosen is Overlap.ESTIMATE:
            try:
                estimate = LinearOuterStep.of(probe)
            except ValueError:
                if overlap is not None:  # asked for: refused, naming why
                    raise
                chosen = Overlap.DISCARD  # the default rule has no split for this outer optimizer
        if chosen is Overlap.DISCARD and delay == every:
            raise ValueError(
                f"Invalid sync_delay: {delay} with overlap='discard': a round landing sync_every={every} steps after "
                "its launch would throw away every inner step (use a smaller sync_delay, or overlap='keep' / "
                "'estimate')"
            )
        outer_bits = DEFAULT_OUTER_BITS if outer_bits is None else outer_bits
        if outer_error_feedback is None:
            outer_error_feedback = DEFAULT_OUTER_ERROR_FEEDBACK
        topk = _check_outer_topk(outer_topk)
        allowed = OUTER_BITS if topk is None else TOPK_BITS
        if isinstance(outer_bits, bool) or outer_bits not in allowed:
            raise ValueError(
                f"Invalid outer_bits: {outer_bits!r} (one of {', '.join(map(str, allowed))}: bits per value an outer "
                + ("round sends, scales included" if topk is None else "round sends of each value it keeps")
                + ("; 2 with outer_topk)" if topk is None and outer_bits == 2 else ")")
            )
        if not isinstance(outer_error_feedback, bool):
            raise ValueError(f"Invalid outer_error_feedback: {outer_error_feedback!r} (a bool)")
        paced = _check_pacing(DEFAULT_PACING if pacing is None else pacing, every, delay)
        if auto_every is not None and isinstance(paced, tuple):
            raise ValueError(f"Invalid pacing with sync_every='auto' (the default): {pacing!r} (\"speed\" or "
                             "\"lockstep\": a fixed schedule per replica would not follow H; give an int sync_every for "
                             "it)")  # fmt: skip
        weighting = parse_enum(Weighting, DEFAULT_OUTER_WEIGHTING if outer_weighting is None else outer_weighting,
                               "outer_weighting")  # fmt: skip
        if membership is not None:
            _check_membership(membership, delay, paced, int(outer_bits), type(probe), topk)
        shown = tuple((name, probe.defaults[name]) for name in _OUTER_SHOWN if name in probe.defaults)
        landing = FIXED
        if auto_every is not None and delay == AUTO:
            landing = FIT
        elif auto_every is not None and sync_delay is None and membership is None and estimate is not None:
            landing = BLOCK_OR_HIDE  # (a round a step late keeps that step: the estimate rule's)
        return cls(every, delay, chosen, outer, type(probe), int(outer_bits), outer_error_feedback, estimate, paced,
                   weighting, shown, membership, auto_every, landing, topk)  # fmt: skip


def _check_outer_topk(outer_topk: Any) -> float | None:
    """None (every value) or the share of each block's values a round sends, in (0, 1)."""
    if outer_topk is None:
        return None
    if isinstance(outer_topk, bool) or not isinstance(outer_topk, (int, float)) or not 0 < outer_topk < 1:
        raise ValueError(f"Invalid outer_topk: {outer_topk!r} (None: every value; or the share of each block of "
                         f"{TOPK_BLOCK} values an outer round sends, in (0, 1), e.g. 1/64)")  # fmt: skip
    return float(outer_topk)


def _check_sync_every(sync_every: Any) -> tuple[int, tuple[int, int] | None]:
    """An int >= 1 (fixed H), ``"auto"`` or ``("auto", lo, hi)``: (the first round's H, the
    bounds or None)."""
    if sync_every == AUTO:
        return AUTO_EVERY_BOUNDS[0], AUTO_EVERY_BOUNDS
    if isinstance(sync_every, (tuple, list)) and len(sync_every) == 3 and sync_every[0] == AUTO:
        lo, hi = sync_every[1], sync_every[2]
        if all(isinstance(b, int) and not isinstance(b, bool) for b in (lo, hi)) and 1 <= lo <= hi:
            return lo, (lo, hi)
    elif not isinstance(sync_every, bool) and isinstance(sync_every, int) and sync_every >= 1:
        return sync_every, None
    raise ValueError(f"Invalid sync_every: {sync_every!r} (an int >= 1: inner steps per outer round; \"auto\", or "
                     "(\"auto\", lo, hi) with 1 <= lo <= hi: chosen from the link and the step time)")


def _check_membership(membership: Any, sync_delay: Any, pacing: Any, outer_bits: int, outer_class: type,
                      outer_topk: float | None) -> None:
    """Elastic rounds (:mod:`acco.elastic`): blocking, paced by speed or in lockstep (no fixed
    schedule: the participants change), quantised (torchft's gloo
    group has all-to-all and all-gather, no reduce-scatter), an element-wise outer optimizer (it
    steps flat chunks among the replicas present)."""
    if not all(callable(getattr(membership, name, None)) for name in ("start_round", "agree", "bind")):
        raise TypeError(f"Invalid membership: {membership!r} (an acco.elastic.TorchFT)")
    if not issubclass(outer_class, _ELEMENTWISE):
        raise ValueError(f"Invalid outer_optimizer with membership: {outer_class.__name__} (elastic rounds step flat "
                         "chunks of the parameters: an element-wise optimizer such as SGD or Adam)")  # fmt: skip
    if sync_delay != 0:
        raise ValueError(f"Invalid sync_delay with membership: {sync_delay!r} (elastic outer rounds are blocking: 0)")
    if pacing not in (SPEED, LOCKSTEP):
        raise ValueError(f"Invalid pacing with membership: {pacing!r} ('speed' or 'lockstep': a schedule per replica "
                         "cannot follow the replica groups present, which change from round to round)")  # fmt: skip
    if outer_bits == 32 and outer_topk is None:
        raise ValueError("Invalid outer_bits with membership: 32 (elastic rounds send quantised differences over "
                         "all-to-all and all-gather: 16, 8 or 4; 32 with outer_topk)")  # fmt: skip


def _check_pacing(pacing: Any, sync_every: int, sync_delay: int | str) -> str | tuple[int, ...]:
    """``"speed"``, ``"lockstep"`` or a tuple of inner steps per replica (each in
    ``[max(1, sync_delay), sync_every]``: a round lands by its replica's next launch)."""
    if pacing in (SPEED, LOCKSTEP):
        return pacing
    least = max(1, sync_delay) if isinstance(sync_delay, int) else 1
    if isinstance(pacing, (list, tuple)) and pacing and all(
            isinstance(s, int) and not isinstance(s, bool) and least <= s <= sync_every for s in pacing):  # fmt: skip
        if max(pacing) != sync_every:
            raise ValueError(f"Invalid pacing: {pacing!r} (the fastest replica takes sync_every={sync_every} steps)")
        return tuple(pacing)
    raise ValueError(
        f"Invalid pacing: {pacing!r} (\"speed\", \"lockstep\", or each replica's inner steps per outer round: a list "
        f"of ints in [{least}, sync_every={sync_every}], one per replica)"
    )


@dataclass(frozen=True)
class Options:
    """The checked keyword arguments of :class:`acco.AccoOptimizer` (see its docstring)."""

    mode: Mode
    nonfinite: NonFinite
    layout: Layout | None
    max_grad_norm: float | None
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    timeout: datetime.timedelta
    estimate_dtype: torch.dtype | None
    buffer_policy: BufferPolicy | None = BufferPolicy.BROADCAST
    local: LocalOptions | None = None

    @classmethod
    def check(
        cls,
        *,
        mode: Any,
        nonfinite: Any,
        layout: Any,
        max_grad_norm: Any,
        param_dtype: Any,
        reduce_dtype: Any,
        timeout: Any,
        estimate_dtype: Any,
        buffers: Any = BufferPolicy.BROADCAST,
        module: Any = None,
        sync_every: Any = None,
        sync_delay: Any = None,
        overlap: Any = None,
        outer_optimizer: Any = None,
        outer_bits: Any = DEFAULT_OUTER_BITS,
        outer_error_feedback: Any = DEFAULT_OUTER_ERROR_FEEDBACK,
        pacing: Any = DEFAULT_PACING,
        outer_weighting: Any = DEFAULT_OUTER_WEIGHTING,
        membership: Any = None,
        outer_topk: Any = DEFAULT_OUTER_TOPK,
    ) -> Options:
        """The options, or ``TypeError`` / ``ValueError`` naming the bad value (``module``
        is checked, not kept). The arguments of another mode are ignored, with one warning
        (:func:`ignore_other_modes`); ``max_grad_norm=0`` is None, no clipping (nanoGPT's
        ``grad_clip=0.0``, the Hugging Face Trainer's ``max_grad_norm=0``)."""
        checked_mode = parse_enum(Mode, mode, "mode")
        if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
                                          or not max_grad_norm >= 0):  # fmt: skip
            raise ValueError(f"Invalid max_grad_norm: {max_grad_norm!r} (a number >= 0; 0 or None: no clipping)")
        given = ignore_other_modes(checked_mode, {
            "estimate_dtype": estimate_dtype, "sync_every": sync_every, "sync_delay": sync_delay, "overlap": overlap,
            "outer_optimizer": outer_optimizer, "outer_bits": outer_bits, "outer_error_feedback": outer_error_feedback,
            "pacing": pacing, "outer_weighting": outer_weighting, "membership": membership, "outer_topk": outer_topk,
        })  # fmt: skip
        for name, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise TypeError(f"Invalid {name}: {dtype!r} (a floating torch.dtype, or None)")
        if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
            raise ValueError(f"Invalid timeout: {timeout!r} (a positive datetime.timedelta)")
        if module is not None and not isinstance(module, nn.Module):
            raise TypeError(f"Invalid module: {type(module).__name__} (an nn.Module whose buffers to keep identical)")
        local = LocalOptions.check(
            checked_mode, given["sync_every"], given["sync_delay"], given["overlap"], given["outer_optimizer"],
            given["outer_bits"], given["outer_error_feedback"], given["pacing"], given["outer_weighting"],
            given["membership"], given["outer_topk"],
        )  # fmt: skip
        quorum = getattr(given["membership"], "quorum_timeout", None)
        if local is not None and quorum is not None and not timeout > quorum:
            raise ValueError(f"Invalid timeout: {timeout} with a membership whose quorum_timeout is {quorum} (step() "
                             "waits for an elastic round's quorum: timeout must be longer)")  # fmt: skip
        if local is not None:
            for name, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
                if dtype is not None:
                    raise ValueError(
                        f"{name}={dtype} with mode='local': the inner optimizer steps the model's own parameters "
                        "and gradients; cast the model (or use autocast) instead"
                    )
        return cls(
            mode=checked_mode,
            nonfinite=parse_enum(NonFinite, nonfinite, "nonfinite"),
            layout=None if layout is None else parse_enum(Layout, layout, "layout"),
            max_grad_norm=float(max_grad_norm) if max_grad_norm else None,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            timeout=timeout,
            estimate_dtype=given["estimate_dtype"],
            buffer_policy=None if buffers is None else parse_enum(BufferPolicy, buffers, "buffers"),
            local=local,
        )

    def describe(self) -> list[str]:
        """The mode and its resolved settings, one ``"name: value"`` each (``repr(opt)``, and
        the line logged at construction)."""
        buffers = None if self.buffer_policy is None else self.buffer_policy.value
        common = [f"mode: {self.mode.value}", f"max_grad_norm: {self.max_grad_norm}",
                  f"nonfinite: {self.nonfinite.value}", f"buffers: {buffers}", f"timeout: {self.timeout}"]  # fmt: skip
        if self.local is not None:
            return common + self.local.describe()
        return common + [f"param_dtype: {self.param_dtype}", f"reduce_dtype: {self.reduce_dtype}",
                         f"estimate_dtype: {self.estimate_dtype}"]  # fmt: skip

    def fingerprint(self) -> str:
        """What every rank must have chosen alike, as text (checked at start-up)."""
        local = self.local and (self.local.sync_every, self.local.auto_every, self.local.sync_delay, self.local.landing,
                                self.local.overlap.value,
                                self.local.outer_class.__name__, self.local.outer_bits, self.local.outer_topk,
                                self.local.error_feedback,
                                self.local.pacing, self.local.outer_weighting.value)  # fmt: skip
        return "|".join([self.mode.value, self.nonfinite.value, str(self.max_grad_norm), str(self.estimate_dtype), str(local)])

    @property
    def wait_seconds(self) -> float:
        """How long the compute lane waits for a round. The lane's own collectives time out
        after ``timeout``; waiting a little longer lets their error (naming the phase) come
        first."""
        return self.timeout.total_seconds() * 1.1 + 5.0


def ignore_other_modes(mode: Mode, given: dict[str, Any]) -> dict[str, Any]:
    """``given`` (arguments of :data:`MODE_ONLY`) with those of another mode than ``mode`` at
    their defaults. Those given otherwise are named in one ``UserWarning``, raised at the
    caller of ``AccoOptimizer(...)``; their values are not checked (no mode reads them)."""
    kept, ignored = dict(given), collections.defaultdict(list)
    for name, value in given.items():
        owner, default = MODE_ONLY[name]
        if owner is not mode and value is not None and value != default:
            ignored[owner].append(f"{name}={value!r}")
            kept[name] = default
    if ignored:
        parts = [f"{', '.join(names)} only appl{'ies' if len(names) == 1 else 'y'} to mode={owner.value!r}"
                 for owner, names in ignored.items()]  # fmt: skip
        # stacklevel: this function, Options.check, AccoOptimizer.__init__, the caller.
        warnings.warn(f"{'; '.join(parts)}: ignored with mode={mode.value!r}", UserWarning, stacklevel=4)
    return kept


def parse_enum(enum_type: type[E], value: Any, what: str) -> E:
    """``enum_type(value)``, or a ``ValueError`` that lists the choices."""
    try:
        return enum_type(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in enum_type)
        raise ValueError(f"Invalid {what}: {value!r} (choose from {choices})") from None


def check_optimizer_class(optimizer_class: Any) -> None:
    """``TypeError`` unless a ``torch.optim.Optimizer`` subclass whose ``step()`` needs no closure."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}")
    closure = inspect.signature(optimizer_class.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(
            f"{optimizer_class.__name__} needs a closure in step(), which a sharded overlapped optimizer "
            "cannot provide"
        )


def probe_defaults(optimizer_class: type[torch.optim.Optimizer], defaults: dict[str, Any]) -> dict[str, Any]:
    """The base optimizer's full defaults; builds one on a dummy tensor, so bad
    hyper-parameters raise the base optimizer's own error before any collective."""
    probe = optimizer_class([torch.zeros(2, 2, requires_grad=True)], **defaults)
    return dict(probe.defaults)


def base_hyperparams(group: dict[str, Any]) -> dict[str, Any]:
    """A copy of a param group's hyper-parameters for the base optimizer (no params)."""
    return {k: v.clone() if isinstance(v, Tensor) else copy.deepcopy(v) for k, v in group.items() if k not in _NOT_HYPERPARAMS}


def _fused_devices() -> tuple[str, ...]:
    """The device types torch has fused optimizer kernels for (its own list where it has one)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # torch moved it: the two that every release since 2.4 supports
        return ("cuda", "cpu")
    return tuple(_get_fused_kernels_supported_devices())


def _fused_steps(group: dict[str, Any], device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the group's class, with its hyper-parameters and ``fused=True``, steps a
    ``dtype`` tensor on ``device``: torch checks devices and dtypes only at the first step, and
    some classes' kernels exist on fewer devices than its list says; one step on a
    one-element tensor settles it."""
    probe = torch.zeros(1, dtype=dtype, device=device, requires_grad=True)
    probe.grad = torch.zeros_like(probe)
    try:
        group["optimizer_class"]([{**base_hyperparams(group), "params": [probe], "fused": True}]).step()
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False
    return True


def choose_fused(group: dict[str, Any], device: torch.device, dtype: torch.dtype) -> None:
    """Set ``fused=True`` in a param group whose base optimizer (one of torch's own classes) has
    a fused kernel, when the user chose neither ``fused`` nor ``foreach`` and the master shard's
    ``device`` and ``dtype`` allow it: torch's rule (a floating dtype on a device of its fused list; the
    class's kernel stepping there). At default arguments torch picks ``foreach``, several
    times slower on a flat shard (each rank steps one model-size tensor). Fused kernels fold
    the update into one pass and may round differently from ``foreach`` in the last bit."""
    cls = group["optimizer_class"]
    if not cls.__module__.startswith("torch.optim"):  # a subclass's step() may be anything: left as given
        return
    accepted = inspect.signature(cls.__init__).parameters
    if "fused" not in accepted or accepted["fused"].default is not None:
        return
    if group.get("fused") is not None or group.get("foreach") is not None or group.get("differentiable"):
        return
    if device.type not in _fused_devices() or not dtype.is_floating_point:
        return
    if _fused_steps(group, device, dtype):
        group["fused"] = True


def build_base_optimizer(
    group: dict[str, Any],
    views: list[Tensor],
    optimizer_class: type[torch.optim.Optimizer],
    defaults: dict[str, Any],
) -> torch.optim.Optimizer | None:
    """A group's base optimizer on this rank's shard ``views`` (None: it owns nothing of
    the group, in the tensor layout). A group naming its own class takes its
    hyper-parameters from the group only."""
    if not views:
        return None
    cls = group["optimizer_class"]
    kwargs = defaults if cls is optimizer_class else {}
    return cls([{**base_hyperparams(group), "params": views}], **kwargs)


def resolve_groups(
    params: Any, optimizer_class: type[torch.optim.Optimizer], layout: Layout | None, sharded_class: type | None = None
) -> list[dict[str, Any]]:
    """Param-group dicts holding each trainable parameter once, each with its base
    optimizer class and layout resolved.

    A group may name its own ``optimizer_class`` (e.g. Muon for hidden matrices, AdamW for
    the rest) and ``layout``; it then starts from that class's defaults. ``sharded_class``:
    the optimizer whose update runs on the shards and so decides the layout (``mode="local"``:
    the outer optimizer; the group's own class otherwise).
    """
    check_optimizer_class(optimizer_class)
    groups = []
    for group in _trainable_groups(params):
        cls = group.get("optimizer_class", optimizer_class)
        check_optimizer_class(cls)
        chosen = _choose_layout(group.get("layout", layout), sharded_class or cls)
        if cls is not optimizer_class:
            group = {**probe_defaults(cls, {}), **group}
        groups.append({**group, "optimizer_class": cls, "layout": chosen})
    return groups


def check_estimate_dtypes(estimate_dtype: torch.dtype | None, options: Options, groups: list[dict[str, Any]]) -> None:
    """``estimate_dtype`` must be lighter than every group's reduce dtype."""
    if estimate_dtype is None:
        return
    for group in groups:
        check_estimate_dtype(estimate_dtype, options.reduce_dtype or options.param_dtype or group["params"][0].dtype)


def _choose_layout(layout: Layout | str | None, optimizer_class: type) -> Layout:
    if layout is None:
        return Layout.FLAT if issubclass(optimizer_class, _ELEMENTWISE) else Layout.TENSOR
    chosen = parse_enum(Layout, layout, "layout")
    if chosen is Layout.FLAT and issubclass(optimizer_class, _WHOLE_TENSOR):
        raise ValueError(
            f"layout='flat' cuts tensors across ranks, but {optimizer_class.__name__} updates whole "
            "tensors: use layout='tensor'"
        )
    return chosen


def _trainable_groups(params: Any) -> list[dict[str, Any]]:
    """Param-group dicts holding each trainable parameter once."""
    if isinstance(params, nn.Module):
        params = params.parameters()
    if isinstance(params, Tensor):
        raise TypeError("params must be a module or an iterable of tensors or dicts, got a single Tensor")
    items = list(params)
    if not items:
        raise ValueError("AccoOptimizer got an empty parameter list")
    if not isinstance(items[0], dict):
        items = [{"params": items}]
    seen: set[int] = set()
    groups = []
    for number, group in enumerate(items):
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(f"param group {number} must be a dict with a 'params' entry, got {type(group).__name__}")
        members = [group["params"]] if isinstance(group["params"], Tensor) else list(group["params"])
        kept = []
        for p in members:
            if not isinstance(p, Tensor):
                raise TypeError(f"param group {number} holds a {type(p).__name__}, not a Tensor")
            if p.requires_grad and id(p) not in seen:  # frozen: left alone; tied: once
                seen.add(id(p))
                kept.append(p)
        if not kept:
            raise ValueError(f"param group {number} has no parameter with requires_grad=True")
        kinds = {(p.dtype, p.device) for p in kept}
        if len(kinds) > 1:
            raise ValueError(
                f"param group {number} mixes dtypes/devices {sorted(map(str, kinds))}: "
                "put each dtype/device in its own param group"
            )
        groups.append({**group, "params": kept})
    return groups
