"""AccoOptimizer: a sharded optimizer whose communication overlaps the next gradients.

A *round* is the time between two :meth:`AccoOptimizer.step` calls. During a round the
compute lane (the caller's loop) folds micro-batch gradients into a local accumulator while
the comm lane runs the previous round's reduce-scatter -> sharded update -> all-gather into a
buffer the model does not read. ``step()`` is the round boundary: it waits for the comm
lane, loads its result into the model and hands the new gradients over.

In ``acco`` mode rounds alternate between an *estimate round* (the look-ahead
``theta~(t+1) = Opt(theta(t), g~(t))`` computed on a copy of the shard and optimizer state)
and a *commit round* (``theta(t+1) = Opt(theta(t), g~(t) + g(t))``, which updates them).
``dpu`` commits every round with a one-round-stale gradient; ``sync`` is ZeRO-1 with no
overlap. See SPEC section 2 and the README.
"""

from __future__ import annotations

import collections
import copy
import datetime
import enum
import functools
import inspect
import math
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import TimeoutError as FutureTimeoutError
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.profiler import record_function

from acco.quantize import check_estimate_dtype
from acco.sharding import Collectives, Layout, ShardCopy, ShardedGroup, ShardPlan, plan_layout
from acco.streams import LaneFuture, Stamp, make_lane

__all__ = ["AccoOptimizer", "CommLaneError", "Mode", "NonFinite", "RoundKind", "RoundStats"]


class Mode(str, enum.Enum):
    """What a round does; see the module docstring."""

    SYNC = "sync"
    DPU = "dpu"
    ACCO = "acco"


class NonFinite(str, enum.Enum):
    """What a round does when some rank's gradients hold NaN or inf."""

    RAISE = "raise"  # CommLaneError on every rank; shards and state untouched
    SKIP = "skip"  # no update on any rank; reported in RoundStats.skipped and skipped_updates


class RoundKind(str, enum.Enum):
    ESTIMATE = "estimate"
    COMMIT = "commit"


class CommLaneError(RuntimeError):
    """A round failed on the comm lane; raised at the next call on the compute lane."""


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

_DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
_STATE_VERSION = 1


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
        kind: estimate or commit.
        local_micro_batches / local_weight: what this rank accumulated during the round.
        global_micro_batches / global_weight: the same summed over all ranks.
        update_weight: the global weight the update divided by (an acco commit covers two
            rounds).
        lane_start / lane_end: when the comm lane started and finished the round.
        phase_seconds: time spent in each lane phase (``totals``: the small all-reduce of
            weights and flags, ``reduce-scatter``, ``update``, ``all-gather``).
        phase_cpu_seconds: CPU time the lane's thread spent in each phase (host time only;
            on CPU the rest of a phase's time is waiting for the network).
        wait_seconds / wait_start / wait_end: how long (and when) the compute lane
            blocked in ``step()`` for this round.
        skipped: the round saw non-finite gradients and, with ``nonfinite="skip"``,
            changed nothing.
        grad_norm: the global 2-norm of the averaged gradient before clipping (only with
            ``max_grad_norm``; a ``grad-norm`` phase then appears in ``phase_seconds``).
        replayed: the round was re-created by ``load_state_dict()`` from a checkpoint's
            round in flight: it only all-gathers its saved result again.
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
    wait_seconds: float = 0.0
    wait_start: float = math.nan
    wait_end: float = math.nan
    grad_norm: float = math.nan
    skipped: bool = False
    replayed: bool = False
    phase_cpu_seconds: dict[str, float] = field(default_factory=dict)
    phase: str = "queued"
    # Filled in by _resolve() once the device has passed them (at once on CPU).
    _stamps: dict[str, Stamp] = field(default_factory=dict, repr=False, compare=False)
    _phases: list[tuple[str, Stamp, Stamp]] = field(default_factory=list, repr=False, compare=False)
    _norm: Callable[[float], Tensor] | None = field(default=None, repr=False, compare=False)

    def _resolve(self, block: bool) -> bool:
        """Turn the lanes' stamps into seconds; False while the device has not passed them."""
        times = {key: stamp.seconds(block) for key, stamp in self._stamps.items()}
        phases = [(name, a.seconds(block), b.seconds(block)) for name, a, b in self._phases]
        if any(t is None for t in times.values()) or any(a is None or b is None for _, a, b in phases):
            return False
        for key, value in times.items():
            setattr(self, key, value)
        if "wait_end" in times:
            self.wait_seconds = self.wait_end - self.wait_start
        self.phase_seconds = {}
        for name, a, b in phases:
            self.phase_seconds[name] = self.phase_seconds.get(name, 0.0) + b - a
        if self._norm is not None:
            self.grad_norm = float(self._norm(math.inf))  # a host copy the lane has finished
        self._stamps, self._phases, self._norm = {}, [], None
        return True

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


@dataclass
class _Round:
    """A round handed to the comm lane: its inputs, and its result once it lands."""

    kind: RoundKind
    grads: list[Tensor]
    update_weights: _Weights
    round_weights: _Weights
    hyperparams: list[dict[str, Any]]
    stats: RoundStats
    future: LaneFuture[RoundStats] | None = None
    finished: bool = False


@dataclass
class _Weights:
    """A sum of ``accumulate()`` weights.

    Numbers add up on the host. CUDA tensors add up on the device, because reading one would
    make the training thread wait for the backward that produced it; with them goes a count
    of invalid ones (negative, NaN, inf), checked on the comm lane. ``device`` is replaced,
    never written in place, so a round handed a copy of this object keeps its own values.
    """

    host: float = 0.0
    device: Tensor | None = None  # float64 [sum, invalid count]
    micro_batches: int = 0

    def add(self, weight: float | Tensor) -> None:
        self.micro_batches += 1
        if isinstance(weight, Tensor):
            value = weight.double()
            part = torch.stack([value, (~torch.isfinite(value) | (value < 0)).double()])
            self.device = part if self.device is None else self.device + part
        else:
            self.host += weight

    def copy(self) -> _Weights:
        return _Weights(self.host, self.device, self.micro_batches)

    def total(self) -> float:
        """The sum on the host (waits for the device part, if any)."""
        return self.host + (0.0 if self.device is None else float(self.device[0]))


class AccoOptimizer(torch.optim.Optimizer):
    """Wraps any torch optimizer: sharded state, communication overlapped with compute.

    Each rank keeps a full-precision master shard of the parameters and the base
    optimizer's state for that shard only (ZeRO-1). The reduce-scatter -> update ->
    all-gather of a round runs on the comm lane (a worker thread on CPU, a CUDA side
    stream on GPU) while the caller computes the next gradients.

    Args:
        params: a module, or an iterable of parameters or of param-group dicts. Parameters
            with ``requires_grad=False`` are left alone; a parameter listed twice (tied) is
            handled once. Each group's parameters must share one dtype and device.
        optimizer_class: the base ``torch.optim.Optimizer`` subclass, built on this rank's
            shard only.
        process_group: the ranks that share the model; default: the default group when
            ``torch.distributed`` is initialised, otherwise a single process.
        mode: ``"acco"`` (estimate + commit rounds, overlapped), ``"dpu"`` (one-round-stale
            update, overlapped) or ``"sync"`` (ZeRO-1, blocking).
        layout: ``"flat"`` (equal contiguous chunks of a flat buffer: element-wise
            optimizers only), ``"tensor"`` (whole tensors per rank) or None to pick ``flat``
            for the element-wise torch optimizers and ``tensor`` otherwise.
        max_grad_norm: clip the averaged gradient to this global 2-norm (as
            ``torch.nn.utils.clip_grad_norm_`` on the full gradient) before each update,
            the acco estimate included; the norm before clipping is in ``round_stats``.
        param_dtype: dtype of the live model parameters (e.g. ``torch.bfloat16``); the
            model is cast at construction. Default: unchanged.
        reduce_dtype: dtype in which gradients are accumulated, reduce-scattered and
            summed. Default: ``param_dtype``. With a 16-bit type, sums over many
            micro-batches lose precision (a warning says so); ``torch.float32`` avoids it.
            The master shard and the optimizer state are always fp32 (fp64 for fp64
            parameters).
        nonfinite: ``"raise"`` (default): a NaN or inf in any rank's gradients makes the
            round fail with ``CommLaneError`` on every rank, before anything is updated;
            ``"skip"``: every rank skips that update (``step()`` returns False,
            ``skipped_updates`` counts it). Detected on the comm lane, folded into the
            round's one small all-reduce.
        timeout: limit for each comm-lane collective and for every wait on the lane
            (default 10 minutes): a dead or stuck rank makes the others raise within it.
        estimate_dtype: ``acco`` mode only: make the estimate rounds lighter on the wire.
            Their reduce-scatter sends the gradients in this dtype and their all-gather
            sends the look-ahead's delta ``theta~(t+1) - theta(t)`` in it (float8 types:
            with one scale per rank's chunk), every rank adding the delta to the committed
            parameters it holds. Commit rounds are unchanged and exact: the committed update
            still uses the full-precision gradients of both rounds; only the point where the
            commit round's gradients are taken moves, by the rounding of the delta. With
            ``torch.bfloat16`` an update moves 1.5x the bytes of a ZeRO-1 update instead of
            2x; with ``torch.float8_e4m3fn`` 1.25x. Default None: estimate rounds travel like
            commit rounds.
        **defaults: hyper-parameters of the base optimizer (``lr=...``), the defaults of
            every param group. A group dict may name its own ``optimizer_class`` (e.g.
            ``torch.optim.Muon`` for hidden matrices) and ``layout``; such a group takes its
            hyper-parameters from the group dict and that class's defaults.

    Raises:
        TypeError / ValueError: bad arguments, raised before any collective runs.
        ValueError: the model differs across ranks (raised on every rank).

    Example::

        >>> opt = AccoOptimizer(model, torch.optim.AdamW, lr=6e-4, weight_decay=0.1)
        >>> for i, (x, y) in enumerate(batches):
        ...     loss_fn(model(x), y).backward()
        ...     opt.accumulate()
        ...     if (i + 1) % micro_batches_per_round == 0:
        ...         opt.step()
        >>> opt.finish()  # the model holds the last committed parameters

    .. warning:: Construction, ``step()`` and ``finish()`` are collective: every rank of
        ``process_group`` must call them, in the same order.
    """

    def __init__(
        self,
        params: nn.Module | Iterable[Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[torch.optim.Optimizer],
        *,
        process_group: dist.ProcessGroup | None = None,
        mode: Mode | str = Mode.ACCO,
        layout: Layout | str | None = None,
        max_grad_norm: float | None = None,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        nonfinite: NonFinite | str = NonFinite.RAISE,
        timeout: datetime.timedelta = _DEFAULT_TIMEOUT,
        estimate_dtype: torch.dtype | None = None,
        **defaults: Any,
    ) -> None:
        # Everything is checked before the first collective, and no state exists until the
        # checks pass, so a bad argument never leaves a half-built optimizer or a hung rank.
        _check_optimizer_class(optimizer_class)
        self.mode = _parse_enum(Mode, mode, "mode")
        self.nonfinite = _parse_enum(NonFinite, nonfinite, "nonfinite")
        self.layout = None if layout is None else _parse_enum(Layout, layout, "layout")
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
            raise ValueError(f"Invalid max_grad_norm: {max_grad_norm!r} (a number > 0, or None)")
        for name, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise TypeError(f"Invalid {name}: {dtype!r} (a floating torch.dtype, or None)")
        if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
            raise ValueError(f"Invalid timeout: {timeout!r} (a positive datetime.timedelta)")
        if estimate_dtype is not None and self.mode is not Mode.ACCO:
            raise ValueError(
                f"estimate_dtype={estimate_dtype} needs mode='acco' (mode {self.mode.value!r} has no estimate rounds)"
            )
        groups = [_with_group_optimizer(g, optimizer_class, self.layout) for g in _trainable_groups(params)]
        base_defaults = _probe_defaults(optimizer_class, defaults)
        if estimate_dtype is not None:
            for g in groups:
                check_estimate_dtype(estimate_dtype, reduce_dtype or param_dtype or g["params"][0].dtype)
        self.estimate_dtype = estimate_dtype
        self.optimizer_class = optimizer_class
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.timeout = timeout
        self._comm = Collectives.from_user_group(process_group)

        self._sealed = False
        super().__init__(groups, base_defaults)
        self._sealed = True
        self._groups = [
            ShardedGroup(
                g["params"],
                plan_layout(g["layout"], [p.shape for p in g["params"]], self._comm.world_size),
                self._comm.rank,
                param_dtype=param_dtype,
                reduce_dtype=reduce_dtype,
                # sync computes nothing while a round runs: the round reduces, updates and
                # gathers in the accumulator itself.
                double_buffered=self.mode is not Mode.SYNC,
                # sync and dpu load each round's result as the committed parameters: with
                # fp32 parameters those hold the master shard (acco's hold estimates).
                master_in_params=self.mode is not Mode.ACCO,
            )
            for g in self.param_groups
        ]
        if any(g.reduce_dtype.itemsize < 4 for g in self._groups):
            warnings.warn(
                "acco accumulates gradients in reduce_dtype, here a 16-bit type: sums over many "
                "micro-batches lose precision; pass reduce_dtype=torch.float32 to accumulate in fp32",
                stacklevel=2,
            )
        self._base = [self._build_base(i, defaults) for i in range(len(self._groups))]

        # Collectives from here on, on the user's group, before the lane exists.
        fingerprint = "|".join(
            [self.mode.value, self.nonfinite.value, str(self.max_grad_norm), str(self.estimate_dtype)]
            + [f"{g['optimizer_class'].__qualname__}:{s.fingerprint()}" for g, s in zip(self.param_groups, self._groups)]
        )
        if not self._comm.same_on_all_ranks(fingerprint):
            raise ValueError(
                "AccoOptimizer: the model, mode, layout or optimizer class differs across ranks "
                f"(this rank: {fingerprint[:200]!r})"
            )
        for group in self._groups:
            initial = group.initial_values()
            self._comm.broadcast_(initial, src=0)
            group.set_initial_values(initial)
        self._lane_comm = self._comm.new_lane_group(timeout)
        self._lane = make_lane(self._groups[0].device)
        # The worker drops the flat buffers only after its stream has finished with them.
        weakref.finalize(self, self._lane.close, 0.0, self._groups)
        self._weights = _WeightPolicy()
        self._hooks = _register_fold_hooks(self)

        # Round state: what the next handover launches, and the round in flight.
        self._next_kind = RoundKind.ESTIMATE if self.mode is Mode.ACCO else RoundKind.COMMIT
        self._in_flight: _Round | None = None
        self._rounds_launched = 0
        self._pending = _Weights()  # since the last commit's hand-over: the next update's
        self._round = _Weights()  # since the last hand-over: this round's
        self._closed = False
        self._failure: BaseException | None = None
        self._failed: _Round | None = None
        self.num_updates = 0
        self.skipped_updates = 0
        self.committed_weight = 0.0
        self._round_stats: collections.deque[RoundStats] = collections.deque(maxlen=1024)
        self._unresolved: collections.deque[RoundStats] = collections.deque()

    # ----------------------------------------------------------------- compute lane

    def accumulate(self, weight: float | Tensor | None = None) -> None:
        """End a micro-batch: fold its gradients into this round's accumulator.

        Without ``weight`` (equal weights), after the first ``accumulate()`` every ``p.grad``
        is a view of the accumulator, so ``backward()`` adds into it in place and no
        gradient copy exists (``p.grad`` then holds the round's running sum). Where
        ``reduce_dtype`` differs from the parameters' dtype a post-accumulate-grad hook folds
        each gradient as soon as backward produces it, and ``p.grad`` stays None. With
        ``weight`` the gradient cannot be weighted before the weight is known: ``p.grad`` is
        kept until this call (one model size more at the end of each backward) and set to
        None. For unequal weights without that cost, declare the weight before ``backward()``
        with :meth:`micro_batch`. Parameters without a gradient count as zero.

        Args:
            weight: how many samples (or tokens) the gradient is a mean over (a number or a
                one-element tensor). The update divides the weighted sum by the total weight
                over all ranks. Default: 1 (equal weights). A CUDA tensor (e.g. a token count
                computed on the GPU) is never read on the host: it scales the gradients on
                the device and is checked on the comm lane.

        Raises:
            ValueError: ``weight`` is negative, NaN or infinite (for a CUDA tensor: the
                round fails with ``CommLaneError`` on every rank, naming the invalid weight);
                or it differs from the weight this micro-batch's gradients were already
                folded at during ``backward()`` (the micro-batch then counts with that
                weight; a CUDA tensor given then always counts as different).
            RuntimeError: no gradient since the last ``accumulate()``, a call inside a
                :meth:`micro_batch` block, or the optimizer is finished.
        """
        self._check_usable("accumulate")
        self._weights.check_outside_block("accumulate()")
        value = 1.0 if weight is None else _checked_weight(weight)
        self._check_params_unchanged()
        self._end_micro_batch(value, explicit=weight is not None)
        if self._weights.decide(explicit=weight is not None):
            # Equal weights: from now on p.grad is a view of the accumulator wherever the
            # dtypes allow (autograd adds into it in place), elsewhere a hook folds it.
            for group in self._groups:
                if group.can_view_grads():
                    group.attach_grad_views()

    @contextmanager
    def micro_batch(self, weight: float | Tensor = 1.0) -> Iterator[None]:
        """A micro-batch whose weight is known before its ``backward()``.

        Its gradients are folded, weighted, into the accumulator during ``backward()`` (no
        ``p.grad`` is kept), and the block's end does what :meth:`accumulate` does::

            with opt.micro_batch(weight=n_tokens):
                loss_fn(model(x), y).backward()

        Args:
            weight: how many samples (or tokens) the block's gradient is a mean over.

        Raises:
            ValueError: ``weight`` is negative, NaN or infinite.
            RuntimeError: blocks nested, gradients of an earlier ``backward()`` not yet
                accumulated, no gradient in the block, or ``accumulate()``/``step()``
                called inside it. An exception inside the block after some gradients were
                folded leaves a partial micro-batch in the accumulator: every later call
                raises ``RuntimeError``.
        """
        self._check_usable("micro_batch")
        value = _checked_weight(weight)
        self._weights.check_outside_block("micro_batch()")
        if self._weights.folded is not None or any(g.holds_grad() for g in self._groups):
            raise RuntimeError(
                "micro_batch(): the gradients of an earlier backward() have not been accumulated: "
                "call accumulate() before the block"
            )
        self._check_params_unchanged()
        # Inside the block every gradient goes through the hooks, which weight it.
        views = [group.grad_views for group in self._groups]
        for group in self._groups:
            group.detach_grad_views()
            group.grad_views = False
        try:
            with self._weights.block(value):
                yield
        finally:
            for group, attached in zip(self._groups, views):
                if attached:
                    group.grad_views = True
        self._end_micro_batch(value, explicit=True)
        for group in self._groups:
            if group.grad_views:
                group.attach_grad_views()

    def _end_micro_batch(self, weight: float | Tensor, explicit: bool) -> None:
        folded_at = self._weights.take_folded()
        if folded_at is not None and explicit and not _same_weight(weight, folded_at):
            self._count_micro_batch(folded_at)
            raise ValueError(
                f"accumulate(weight={weight!r}): this micro-batch's gradients were already folded at weight "
                f"{folded_at!r} during backward() (the first accumulate() had no weight); it counts with "
                f"{folded_at!r}. Declare unequal weights before backward(): "
                "`with opt.micro_batch(weight=w): loss.backward()`"
            )
        with record_function("acco.accumulate"):
            found = [group.accumulate_grads(weight) for group in self._groups]
        if folded_at is None and not any(found):
            raise RuntimeError("accumulate() found no gradient in any parameter: call backward() first")
        self._count_micro_batch(weight)

    def _count_micro_batch(self, weight: float | Tensor) -> None:
        self._pending.add(weight)
        self._round.add(weight)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``; raises ``RuntimeError`` when gradients of a
        ``backward()`` were already folded into the accumulator (they cannot be discarded)."""
        if self._weights.folded is not None:
            raise RuntimeError(
                "zero_grad(): the last backward()'s gradients were folded into acco's accumulator during "
                "backward() and cannot be discarded; call accumulate() (or skip the backward)"
            )
        for group in self._groups:
            group.detach_grad_views()  # zeroing them would zero the accumulated sum
        super().zero_grad(set_to_none=set_to_none)

    def ready(self) -> bool:
        """Whether ``step()`` would return without waiting for the comm lane. Never blocks."""
        return self._in_flight is None or self._in_flight.future.done()

    def step(self, closure: None = None) -> bool:  # type: ignore[override]
        """End the round: land the round in flight, hand this round's gradients over.

        Returns:
            True when the model now holds newly committed parameters (drive LR
            schedulers with ``if opt.step(): scheduler.step()``).

        Raises:
            CommLaneError: the round in flight failed (on every rank).
            TimeoutError: the comm lane did not finish within ``timeout``.

        .. warning:: Collective: every rank must call it once per round.
        """
        if closure is not None:
            raise TypeError("AccoOptimizer.step() takes no closure")
        self._check_usable("step")
        self._weights.check_outside_block("step()")
        if self._rounds_launched == 0 and self._round.micro_batches == 0:
            raise RuntimeError("step() before any accumulate() in the first round: there is nothing to apply")
        self._check_params_unchanged()
        with record_function("acco.step"):
            committed = self._land_in_flight()
            self._launch(self._next_kind)
            if self.mode is Mode.SYNC:
                committed = self._land_in_flight()
        return committed

    def finish(self) -> bool:
        """Drain the comm lane and leave the model at the last committed parameters.

        A commit round in flight is landed; an estimate round in flight is dropped (the
        model already holds the committed parameters it started from). Gradients
        accumulated since the last handover are discarded. Idempotent; the optimizer
        cannot be used afterwards.

        Returns:
            True when landing the last round committed an update.

        .. warning:: Collective: every rank must call it.
        """
        if self._closed:
            return False
        if self._failure is not None:
            self.close()
            self._check_usable("finish")
        try:
            round_ = self._in_flight
            if round_ is not None and round_.kind is RoundKind.ESTIMATE:
                self._in_flight = None
                self._wait(round_)
                committed = False
            else:
                committed = self._land_in_flight()
            self._resolve_stats(block=True)
            return committed
        finally:
            for group in self._groups:  # p.grad no longer points into acco's buffers
                group.detach_grad_views()
            self.close()

    def close(self) -> None:
        """Stop using the optimizer without landing the round in flight (not collective).

        For error paths: the comm lane's thread stops once its current round ends (at the
        latest after ``timeout``, since the other ranks will not join it). Idempotent.
        """
        self._closed = True
        # The worker holds what a dropped round may still read on the device (hand-over
        # buffers, tensor hyper-parameters, optimizer state) until its stream is done.
        self._lane.close(keep=(self._in_flight, self._failed, self._groups, self._base))
        self._in_flight = None

    def __enter__(self) -> AccoOptimizer:
        return self

    def __exit__(self, error_type: type[BaseException] | None, *_: Any) -> None:
        """``finish()`` after a clean exit; after an exception (KeyboardInterrupt included),
        ``close()``, so one rank's failure never blocks it on the others."""
        if error_type is None:
            self.finish()
        else:
            self.close()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._sealed:
            raise RuntimeError("AccoOptimizer shards its param groups at construction; add_param_group is not supported")
        super().add_param_group(param_group)

    @property
    def in_flight(self) -> RoundKind | None:
        """The kind of the round on the comm lane (None in ``sync`` mode or before the
        first ``step()``); the same on every rank. ``num_updates + (in_flight is
        RoundKind.COMMIT)`` is the number of updates there will be once it lands."""
        return None if self._in_flight is None else self._in_flight.kind

    @property
    def world_size(self) -> int:
        return self._comm.world_size

    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def shard_plans(self) -> list[ShardPlan]:
        """Where each param group's parameters sit in its flat buffer, and who owns what."""
        return [group.plan for group in self._groups]

    def buffer_bytes(self) -> list[dict[str, int]]:
        """Bytes of each buffer acco holds now, per param group (see docs/design.md,
        "Buffers and memory"): ``grad_accumulator``, ``grad_handover``, ``gathered``,
        ``master``, ``master_grad``, ``estimate_copy``; a view of another buffer counts 0."""
        return [group.buffer_bytes() for group in self._groups]

    @property
    def base_optimizers(self) -> list[torch.optim.Optimizer | None]:
        """The base optimizer of each param group on this rank's shard (None: owns nothing)."""
        return list(self._base)

    # ------------------------------------- committed parameters (schedule-free convention)

    # (rounds launched when eval() swapped, the live parameters it set aside), or None.
    _eval_stash: tuple[int, list[list[Tensor]]] | None = None

    def eval(self) -> None:
        """Load the committed parameters into the model, to evaluate or save it.

        The convention of schedule-free optimizers, which ``transformers.Trainer`` and
        accelerate already follow (``optimizer.eval()`` before evaluating,
        ``optimizer.train()`` before training). Afterwards the model holds what
        :meth:`finish` would leave: ``num_updates + (in_flight is RoundKind.COMMIT)``
        updates. With a commit round in flight (``acco`` after its estimate has landed,
        ``dpu`` after every ``step()``), this waits for it (not collective: its collectives
        are already under way on every rank), loads its result and sets the live parameters
        (the acco estimate, or the parameters the dpu round computes at) aside until
        :meth:`train`; one copy of the parameters meanwhile. Otherwise the model already
        holds the committed parameters and nothing changes.

        Call :meth:`train` before the next forward pass: gradients must be taken at the live
        parameters. :func:`acco.checkpoint.save` with a model saves what the model holds,
        so call :meth:`train` before it for an exact resume.

        Raises:
            CommLaneError / TimeoutError: the round in flight failed.
        """
        if self._eval_stash is not None and self._eval_stash[0] == self._rounds_launched:
            return  # already holds the committed parameters
        self._eval_stash = None  # set aside before a step(): the model has moved on since
        round_ = self._in_flight
        if round_ is None or round_.kind is not RoundKind.COMMIT:
            return
        self._check_usable("eval")
        self._wait(round_)  # its result still lands at the next step() or finish()
        live = [[p.detach().clone() for p in group.params] for group in self._groups]
        self._eval_stash = (self._rounds_launched, live)
        with record_function("acco.load_params"):
            for group in self._groups:
                group.load_params_from_buffer()

    def train(self) -> None:
        """Put back the live parameters that :meth:`eval` set aside (no-op otherwise).

        If ``step()`` or ``finish()`` ran since :meth:`eval`, the model already holds newer
        parameters and they are kept.
        """
        stash, self._eval_stash = self._eval_stash, None
        if stash is None or stash[0] != self._rounds_launched or self._closed:
            return
        with torch.no_grad():
            for group, values in zip(self._groups, stash[1]):
                torch._foreach_copy_([p.data for p in group.params], values)

    # ------------------------------------------------------------- round boundaries

    def _launch(self, kind: RoundKind) -> None:
        keep_accumulating = kind is RoundKind.ESTIMATE
        grads = [group.hand_over(keep_accumulating) for group in self._groups]
        # The hyper-parameters in param_groups now: a commit round is handed over after the
        # scheduler has stepped for the previous update, so committed updates follow the
        # schedule exactly as in sync mode.
        hyperparams = [_hyperparams(g) for g in self.param_groups]
        stats = RoundStats(self._rounds_launched, kind, self._round.micro_batches, self._round.host)
        round_ = _Round(
            kind=kind,
            grads=grads,
            update_weights=self._pending.copy(),
            round_weights=self._round.copy(),
            hyperparams=hyperparams,
            stats=stats,
        )
        if not keep_accumulating:
            self._pending = _Weights()
        self._round = _Weights()
        self._rounds_launched += 1
        self._next_kind = _next_kind(self.mode, kind)
        round_.future = self._lane.submit(lambda: self._run_round(round_))
        self._in_flight = round_

    def _land_in_flight(self) -> bool:
        """Wait for the round in flight and load its result into the model."""
        round_ = self._in_flight
        if round_ is None:
            return False
        self._in_flight = None
        stats = self._wait(round_)
        with record_function("acco.load_params"):
            for group in self._groups:
                group.load_params_from_buffer()
        if round_.kind is RoundKind.COMMIT and stats.skipped:
            self.skipped_updates += 1
            return False
        if round_.kind is RoundKind.COMMIT:
            self.num_updates += 1
            self.committed_weight += stats.update_weight
            return True
        return False

    def _wait(self, round_: _Round) -> RoundStats:
        if round_.finished:  # already waited for by state_dict()
            return round_.stats
        started = self._lane.hooks.stamp()
        try:
            with record_function("acco.wait"):
                stats = round_.future.result(timeout=_wait_seconds(self.timeout))
        except FutureTimeoutError:
            self._failed = round_  # its device work may still read its tensors: see close()
            self._failure = TimeoutError(
                f"{round_.kind.value} round {round_.stats.index} still running on the comm lane after "
                f"{_wait_seconds(self.timeout):.0f}s (phase: {round_.stats.phase}); another rank may be "
                "dead or no longer calling step()"
            )
            raise self._failure from None
        except BaseException as error:
            self._failed = round_
            self._failure = error
            raise
        stats._stamps.update(wait_start=started, wait_end=self._lane.hooks.stamp())
        round_.finished = True
        self._round_stats.append(stats)
        self._unresolved.append(stats)
        self._resolve_stats(block=False)
        return stats

    def _resolve_stats(self, block: bool) -> None:
        while self._unresolved and self._unresolved[0]._resolve(block):
            self._unresolved.popleft()

    @property
    def round_stats(self) -> collections.deque[RoundStats]:
        """The last 1024 rounds' :class:`RoundStats`, oldest first (times filled in once the
        device has passed them; never blocks)."""
        self._resolve_stats(block=False)
        return self._round_stats

    def _check_params_unchanged(self) -> None:
        for number, group in enumerate(self._groups):
            for index, (param, slot) in enumerate(zip(group.params, group.plan.slots)):
                if param.shape != slot.shape or param.dtype != group.param_dtype:
                    raise RuntimeError(
                        f"parameter {index} of group {number} changed to {tuple(param.shape)} {param.dtype} after "
                        f"construction (was {tuple(slot.shape)} {group.param_dtype}): build a new AccoOptimizer"
                    )

    def _check_usable(self, call: str) -> None:
        if self._failure is not None:
            raise RuntimeError(f"{call}() after the comm lane failed: {self._failure}") from self._failure
        if self._closed:
            raise RuntimeError(f"{call}() after finish() or close(): the optimizer is finished")

    # -------------------------------------------------------------------- comm lane

    def _run_round(self, round_: _Round) -> RoundStats:
        """One round on the comm lane: weights, reduce-scatter, update, all-gather.

        Runs on the lane's worker thread: its host synchronisations (reading the weights,
        the base optimizer's own) block only the worker.
        """
        stats = round_.stats
        hooks = self._lane.hooks
        stats._stamps["lane_start"] = hooks.stamp()
        try:
            with self._phase(stats, "totals"):
                local = self._round_totals(round_)
                read_local = hooks.host_copy(local)
                totals = local.clone()
                self._lane_comm.all_reduce_sum_(totals)
                limit = self.timeout.total_seconds()
                _, stats.local_weight, _, _, _ = read_local(limit).tolist()
                update_weight, global_weight, global_micro_batches, nonfinite, invalid = (
                    hooks.host_copy(totals)(limit).tolist()
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
                if nonfinite and self.nonfinite is NonFinite.RAISE:
                    raise FloatingPointError(f"non-finite gradients on {int(nonfinite)} rank(s)")
            if nonfinite:
                return self._skip_round(stats)
            light = round_.kind is RoundKind.ESTIMATE and self.estimate_dtype is not None
            with self._phase(stats, "reduce-scatter"):
                for group, grads in zip(self._groups, round_.grads):
                    if light:
                        self._lane_comm.reduce_scatter_quantized(group.grad_shard, grads, self.estimate_dtype)
                    else:
                        self._lane_comm.reduce_scatter_sum(group.grad_shard, grads)
                    torch.div(group.grad_shard, update_weight, out=group.master_grad)
            if self.max_grad_norm is not None:
                with self._phase(stats, "grad-norm"):
                    stats._norm = hooks.host_copy(self._clip_master_grads(self.max_grad_norm))
            with self._phase(stats, "update"):
                for group, base, hyperparams in zip(self._groups, self._base, round_.hyperparams):
                    if base is not None:
                        _step_shard(group, base, hyperparams, estimate=round_.kind is RoundKind.ESTIMATE)
                    else:
                        group.gather_input.copy_(group.master)
            with self._phase(stats, "all-gather"):
                for group in self._groups:
                    if light:
                        # The delta from the committed shard, which every rank holds in full.
                        delta = group.gather_input.to(group.master_dtype, copy=True).sub_(group.master)
                        group.gather_from_delta(*self._lane_comm.all_gather_quantized(delta, self.estimate_dtype))
                    else:
                        self._lane_comm.all_gather(group.gathered, group.gather_input)
        except Exception as error:
            raise CommLaneError(
                f"{round_.kind.value} round {stats.index} failed on the comm lane during {stats.phase}: {error}"
            ) from error
        stats._stamps["lane_end"] = hooks.stamp()
        return stats

    def _round_totals(self, round_: _Round) -> Tensor:
        """This rank's [update weight, round weight, round micro-batches, whether its
        gradients look non-finite, invalid weights], float64 on the gradients' device, made
        without reading anything from the device."""
        update, local = round_.update_weights, round_.round_weights
        host = torch.tensor([update.host, local.host, local.micro_batches, 0.0, 0.0], dtype=torch.float64)
        totals = self._lane.hooks.to_device(host)
        if update.device is not None:
            totals[0] += update.device[0]
        if local.device is not None:
            totals[1] += local.device[0]
            totals[4] += local.device[1]
        # A sum is NaN or inf whenever an element is, and costs a thirtieth of an exact
        # scan; _confirm_nonfinite scans only when some rank's sum was not finite.
        sums = torch.stack([grads.sum().double() for grads in round_.grads])
        totals[3] += (~torch.isfinite(sums)).any().double()
        return totals

    def _confirm_nonfinite(self, grads: list[Tensor]) -> int:
        """How many ranks really hold a NaN or inf (a sum may overflow on huge finite values).

        Runs on every rank once the all-reduced flags say some rank's sum was not finite.
        """
        exact = torch.stack([(~torch.isfinite(g)).any() for g in grads]).any().double().reshape(1)
        self._lane_comm.all_reduce_sum_(exact)
        return int(self._lane.hooks.host_copy(exact)(self.timeout.total_seconds()).item())

    def _skip_round(self, stats: RoundStats) -> RoundStats:
        """No update: the round's result is the committed parameters, unchanged."""
        stats.skipped = True
        with self._phase(stats, "all-gather"):
            for group in self._groups:
                group.gather_input.copy_(group.master)
                self._lane_comm.all_gather(group.gathered, group.gather_input)
        stats._stamps["lane_end"] = self._lane.hooks.stamp()
        return stats

    def _clip_master_grads(self, max_norm: float) -> Tensor:
        """Scale the averaged gradient so its global 2-norm is at most ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_`` would on the full gradient; returns the norm
        before clipping, on the device. One all-reduce of the squared shard norms; the scale
        is computed on the device, so nothing waits for the reduce-scatter on the host."""
        squares = torch.stack([g.master_grad.double().square().sum() for g in self._groups]).sum().reshape(1)
        self._lane_comm.all_reduce_sum_(squares)
        norm = squares.sqrt()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for group in self._groups:
            group.master_grad.mul_(scale)
        return norm

    @contextmanager
    def _phase(self, stats: RoundStats, name: str) -> Iterator[None]:
        stats.phase = name
        started, cpu = self._lane.hooks.stamp(), time.thread_time()
        with record_function(f"acco.{name}"):
            yield
        stats._phases.append((name, started, self._lane.hooks.stamp()))
        stats.phase_cpu_seconds[name] = stats.phase_cpu_seconds.get(name, 0.0) + time.thread_time() - cpu

    def _build_base(self, index: int, defaults: dict[str, Any]) -> torch.optim.Optimizer | None:
        views = self._groups[index].master_views
        if not views:
            return None  # tensor layout: this rank owns no tensor of this group
        group = self.param_groups[index]
        cls = group["optimizer_class"]
        # A group naming its own class takes its hyper-parameters from the group only.
        kwargs = defaults if cls is self.optimizer_class else {}
        return cls([{**_hyperparams(group), "params": views}], **kwargs)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of the optimizer's state, at a round boundary.

        Waits for the round in flight (its result is kept and still lands at the next
        ``step()``), so the natural moment is right after a ``step()``. Holds only tensors and
        plain Python values: ``torch.load(path, weights_only=True)`` reads it back.

        Schema::

            {"state": {},                       # the base optimizers' state is per shard, below
             "param_groups": [{hyper-parameters..., "optimizer_class": name, "layout": name,
                               "params": [indices]}],
             "acco": {"version": 1, "mode", "rank", "world_size", "max_grad_norm",
                      "num_updates", "skipped_updates", "committed_weight",
                      "round": {"rounds_launched", "next_kind", "in_flight_kind" (or None),
                                "pending_weight", "pending_micro_batches",
                                "round_weight", "round_micro_batches"},
                      "groups": [{"layout", "optimizer_class", "shapes", "chunk", "param_dtype",
                                  "reduce_dtype",
                                  "master": fp32 shard, "base_state": {local index: {...}},
                                  "in_flight_result": this rank's chunk of the round in
                                      flight's result (or None),
                                  "grad_accumulator": this rank's unreduced gradient sum}]}}
        """
        self._check_usable("state_dict")
        round_ = self._in_flight
        if round_ is not None:
            self._wait(round_)
        groups = []
        for group, sharded, base in zip(self.param_groups, self._groups, self._base):
            groups.append(
                {
                    "layout": sharded.plan.layout.value,
                    "optimizer_class": group["optimizer_class"].__name__,
                    "shapes": [list(slot.shape) for slot in sharded.plan.slots],
                    "chunk": sharded.plan.chunk,
                    "param_dtype": str(sharded.param_dtype),
                    "reduce_dtype": str(sharded.reduce_dtype),
                    "master": sharded.master_values(in_flight=round_ is not None),
                    "base_state": _base_state(sharded, base),
                    "in_flight_result": None if round_ is None else sharded.gather_input.clone(),
                    "grad_accumulator": sharded.grad_accumulator.clone(),
                }
            )
        start = 0
        param_groups = []
        for group in self.param_groups:
            count = len(group["params"])
            param_groups.append(
                {
                    **_hyperparams(group),
                    "optimizer_class": group["optimizer_class"].__name__,
                    "layout": group["layout"].value,
                    "params": list(range(start, start + count)),
                }
            )
            start += count
        return {
            "state": {},
            "param_groups": param_groups,
            "acco": {
                "version": _STATE_VERSION,
                "mode": self.mode.value,
                "rank": self.rank,
                "world_size": self.world_size,
                "max_grad_norm": self.max_grad_norm,
                "num_updates": self.num_updates,
                "skipped_updates": self.skipped_updates,
                "committed_weight": self.committed_weight,
                "round": {
                    "rounds_launched": self._rounds_launched,
                    "next_kind": self._next_kind.value,
                    "in_flight_kind": None if round_ is None else round_.kind.value,
                    "pending_weight": self._pending.total(),
                    "pending_micro_batches": self._pending.micro_batches,
                    "round_weight": self._round.total(),
                    "round_micro_batches": self._round.micro_batches,
                },
                "groups": groups,
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict` with the same world size and layouts.

        Load into a freshly built optimizer (no ``accumulate()`` or ``step()`` yet). Saved
        by another world size or layout: use :func:`acco.checkpoint.load`. Everything is
        checked before anything changes; a mismatch is a ``ValueError``.

        .. warning:: Collective when the saved state has a round in flight (its result is
            all-gathered again on the comm lane): every rank must call it.
        """
        self._check_usable("load_state_dict")
        if self._in_flight is not None or self._rounds_launched or self._pending.micro_batches:
            raise RuntimeError("load_state_dict() must be called on a fresh optimizer, before any accumulate()/step()")
        saved = _check_state_dict(self, state_dict)
        for group, values in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in values.items() if k not in _NOT_HYPERPARAMS})
        for sharded, base, values in zip(self._groups, self._base, saved["groups"]):
            sharded.load_master_values(values["master"], in_flight=saved["round"]["in_flight_kind"] is not None)
            sharded.grad_accumulator.copy_(values["grad_accumulator"])
            if base is not None:
                # On the lane, so the state is allocated on the stream that uses and frees it.
                self._lane.run(
                    lambda: _load_base_state(sharded, base, values["base_state"]), _wait_seconds(self.timeout)
                )
        round_state = saved["round"]
        self.num_updates = int(saved["num_updates"])
        self.skipped_updates = int(saved.get("skipped_updates", 0))
        self.committed_weight = float(saved["committed_weight"])
        self._rounds_launched = int(round_state["rounds_launched"])
        self._next_kind = RoundKind(round_state["next_kind"])
        self._pending = _Weights(float(round_state["pending_weight"]), None, int(round_state["pending_micro_batches"]))
        self._round = _Weights(float(round_state["round_weight"]), None, int(round_state["round_micro_batches"]))
        if round_state["in_flight_kind"] is not None:
            for sharded, values in zip(self._groups, saved["groups"]):
                sharded.gather_input.copy_(values["in_flight_result"])
            self._replay_in_flight(RoundKind(round_state["in_flight_kind"]))

    def _replay_in_flight(self, kind: RoundKind) -> None:
        """Re-create the saved round in flight: its result only needs all-gathering again."""
        stats = RoundStats(self._rounds_launched - 1, kind, 0, 0.0, replayed=True)
        round_ = _Round(kind, [], _Weights(), _Weights(), hyperparams=[], stats=stats)

        def all_gather() -> RoundStats:
            stats._stamps["lane_start"] = self._lane.hooks.stamp()
            with self._phase(stats, "all-gather"):
                for group in self._groups:
                    self._lane_comm.all_gather(group.gathered, group.gather_input)
            stats._stamps["lane_end"] = self._lane.hooks.stamp()
            return stats

        round_.future = self._lane.submit(all_gather)
        self._in_flight = round_


def _base_state(sharded: ShardedGroup, base: torch.optim.Optimizer | None) -> dict[int, dict[str, Any]]:
    if base is None:
        return {}
    return {
        index: {key: _clone(value) for key, value in base.state[view].items()}
        for index, view in enumerate(sharded.master_views)
        if view in base.state
    }


def _load_base_state(sharded: ShardedGroup, base: torch.optim.Optimizer, saved: dict[int, dict[str, Any]]) -> None:
    base.state.clear()
    for index, view in enumerate(sharded.master_views):
        if index in saved:
            base.state[view] = {
                key: value.to(view.device).clone() if isinstance(value, Tensor) and value.dim() else _clone(value)
                for key, value in saved[index].items()
            }


def _check_state_dict(optimizer: AccoOptimizer, state_dict: Any) -> dict[str, Any]:
    """The ``"acco"`` entry of a state dict that fits ``optimizer``; ValueError otherwise."""
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("acco"), dict):
        raise ValueError("not an AccoOptimizer state dict (no 'acco' entry)")
    saved = state_dict["acco"]
    if saved.get("version") != _STATE_VERSION:
        raise ValueError(f"unsupported AccoOptimizer state version {saved.get('version')!r}")
    if saved["mode"] != optimizer.mode.value:
        raise ValueError(f"state saved in mode {saved['mode']!r}, this optimizer is {optimizer.mode.value!r}")
    if saved["world_size"] != optimizer.world_size or saved["rank"] != optimizer.rank:
        raise ValueError(
            f"state saved by rank {saved['rank']} of {saved['world_size']}, loading on rank {optimizer.rank} of "
            f"{optimizer.world_size}: use acco.checkpoint.load to reshard"
        )
    if len(saved["groups"]) != len(optimizer.param_groups) or len(state_dict["param_groups"]) != len(saved["groups"]):
        raise ValueError(f"state has {len(saved['groups'])} param groups, this optimizer {len(optimizer.param_groups)}")
    for number, (values, group, sharded) in enumerate(zip(saved["groups"], optimizer.param_groups, optimizer._groups)):
        expected = {
            "layout": sharded.plan.layout.value,
            "optimizer_class": group["optimizer_class"].__name__,
            "shapes": [list(slot.shape) for slot in sharded.plan.slots],
            "param_dtype": str(sharded.param_dtype),
            "reduce_dtype": str(sharded.reduce_dtype),
        }
        for key, value in expected.items():
            if values[key] != value:
                raise ValueError(f"param group {number}: saved {key} {values[key]!r}, this optimizer has {value!r}")
        for key, length in (("master", sharded.plan.chunk), ("grad_accumulator", sharded.plan.padded_numel)):
            if not isinstance(values[key], Tensor) or values[key].shape != (length,):
                raise ValueError(f"param group {number}: saved {key} is not a tensor of {length} elements")
    return saved


def _step_shard(group: ShardedGroup, base: torch.optim.Optimizer, hyperparams: dict[str, Any], estimate: bool) -> None:
    """Run the base optimizer on this rank's shard; an estimate leaves shard and state as found."""
    master = group.master  # first, so that master_views point at this round's master shard
    base.param_groups[0].update(hyperparams)
    for param, grad in zip(group.master_views, group.shard_views(group.master_grad)):
        param.grad = grad
    if not estimate:
        base.step()
        group.gather_input.copy_(master)
        return
    if group.estimate_copy is None:
        group.estimate_copy = ShardCopy()
    workspace = group.shard_workspace()
    if workspace is None:  # step the real shard, then put it back from the copy
        group.estimate_copy.save(group.master, base.state)
        base.step()
        group.gather_input.copy_(group.master)
        group.estimate_copy.restore(group.master, base.state)
        return
    # Step a working copy of the shard held in a chunk of the round's buffer that was sent
    # already: the master shard itself is never touched, so it needs no copy.
    workspace.copy_(group.master)
    group.point_master_views(workspace)
    try:
        group.estimate_copy.save(None, base.state)
        base.step()
        group.gather_input.copy_(workspace)
        group.estimate_copy.restore(None, base.state)
    finally:
        group.point_master_views(group.master)


def _checked_weight(weight: Any) -> float | Tensor:
    """A valid weight: a number, or a one-element CUDA tensor (0-dim), checked on the lane."""
    if isinstance(weight, Tensor):
        if weight.numel() != 1:
            raise ValueError(f"Invalid weight: a tensor of shape {tuple(weight.shape)} (a number or one element)")
        if weight.is_cuda:
            return weight.detach().reshape(())  # read on the host only by the comm lane
        weight = weight.item()
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
        raise ValueError(f"Invalid weight: {weight!r} (a finite number >= 0)")
    return float(weight)


def _next_kind(mode: Mode, launched: RoundKind) -> RoundKind:
    if mode is Mode.ACCO and launched is RoundKind.ESTIMATE:
        return RoundKind.COMMIT
    if mode is Mode.ACCO:
        return RoundKind.ESTIMATE
    return RoundKind.COMMIT


def _clone(value: Any) -> Any:
    return value.clone() if isinstance(value, Tensor) else copy.deepcopy(value)


_NOT_HYPERPARAMS = ("params", "optimizer_class", "layout")


def _hyperparams(group: dict[str, Any]) -> dict[str, Any]:
    return {k: _clone(v) for k, v in group.items() if k not in _NOT_HYPERPARAMS}


def _with_group_optimizer(
    group: dict[str, Any], optimizer_class: type[torch.optim.Optimizer], layout: Layout | None
) -> dict[str, Any]:
    """The group with its base optimizer class and layout resolved.

    A group may name its own ``optimizer_class`` (e.g. Muon for hidden matrices, AdamW for
    the rest) and ``layout``; it then starts from that class's defaults.
    """
    cls = group.get("optimizer_class", optimizer_class)
    _check_optimizer_class(cls)
    chosen = _choose_layout(group.get("layout", layout), cls)
    if cls is not optimizer_class:
        group = {**_probe_defaults(cls, {}), **group}
    return {**group, "optimizer_class": cls, "layout": chosen}


def _wait_seconds(timeout: datetime.timedelta) -> float:
    # The lane's own collectives time out after `timeout`; wait a little longer so their
    # error (which names the phase) arrives first.
    return timeout.total_seconds() * 1.1 + 5.0


def _parse_enum(enum_type: type[enum.Enum], value: Any, what: str) -> Any:
    try:
        return enum_type(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in enum_type)
        raise ValueError(f"Invalid {what}: {value!r} (choose from {choices})") from None


def _check_optimizer_class(optimizer_class: Any) -> None:
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}")
    closure = inspect.signature(optimizer_class.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(
            f"{optimizer_class.__name__} needs a closure in step(), which a sharded overlapped optimizer "
            "cannot provide"
        )


def _choose_layout(layout: Layout | str | None, optimizer_class: type) -> Layout:
    if layout is None:
        return Layout.FLAT if issubclass(optimizer_class, _ELEMENTWISE) else Layout.TENSOR
    chosen = _parse_enum(Layout, layout, "layout")
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


def _probe_defaults(optimizer_class: type[torch.optim.Optimizer], defaults: dict[str, Any]) -> dict[str, Any]:
    """The base optimizer's full defaults; builds one on a dummy tensor, so bad
    hyper-parameters raise the base optimizer's own error before any collective."""
    probe = optimizer_class([torch.zeros(2, 2, requires_grad=True)], **defaults)
    return dict(probe.defaults)


def _same_weight(a: float | Tensor, b: float | Tensor) -> bool:
    """Whether two weights are known equal without reading a device tensor on the host."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return a is b
    return a == b


class _WeightPolicy:
    """At which weight the post-accumulate-grad hooks fold gradients during backward().

    ``fold_weight`` None: the hooks leave ``p.grad`` for ``accumulate()`` (the weight is
    not known yet). The first ``accumulate()`` decides: without a weight (equal weights)
    every later backward() is folded at weight 1; with one, ``p.grad`` is kept (weights
    given after backward). A :meth:`AccoOptimizer.micro_batch` block folds at its own
    weight whatever was decided.
    """

    def __init__(self) -> None:
        self.fold_weight: float | Tensor | None = None
        self.decided = False
        self.folded: float | Tensor | None = None  # the weight hooks folded this micro-batch's gradients at
        self.in_block = False
        self.torn = False  # a block raised after folding part of its gradients

    def decide(self, explicit: bool) -> bool:
        """Record the first ``accumulate()``; returns True when it chose equal weights."""
        if self.decided:
            return False
        self.decided = True
        self.fold_weight = None if explicit else 1.0
        return not explicit

    def take_folded(self) -> float | Tensor | None:
        """The weight this micro-batch's gradients were folded at (None: none were)."""
        weight, self.folded = self.folded, None
        return weight

    def check_outside_block(self, call: str) -> None:
        if self.torn:
            raise RuntimeError(
                f"{call} after a micro_batch() block raised once some of its gradients were folded: the "
                "accumulator holds a partial micro-batch; build a new AccoOptimizer (or load a checkpoint)"
            )
        if self.in_block:
            raise RuntimeError(f"{call} inside a micro_batch() block (blocks do not nest; the block accumulates when it ends)")

    @contextmanager
    def block(self, weight: float | Tensor) -> Iterator[None]:
        previous = self.fold_weight
        self.fold_weight, self.in_block = weight, True
        try:
            yield
        except BaseException:
            self.torn = self.folded is not None
            self.folded = None
            raise
        finally:
            self.fold_weight, self.in_block = previous, False


def _fold_hook(optimizer_ref: weakref.ReferenceType, group_index: int, index: int, param: Tensor) -> None:
    """Post-accumulate-grad hook: fold ``param.grad`` into the accumulator and free it."""
    optimizer = optimizer_ref()
    if optimizer is None or optimizer._closed:
        return
    weights = optimizer._weights
    if weights.fold_weight is None:
        return  # the weight is given after backward(): accumulate() folds p.grad
    if optimizer._groups[group_index].fold_grad(index, weights.fold_weight):
        weights.folded = weights.fold_weight


def _register_fold_hooks(optimizer: AccoOptimizer) -> list[Any]:
    """One post-accumulate-grad hook per managed parameter, removed with the optimizer."""
    ref = weakref.ref(optimizer)
    handles = [
        param.register_post_accumulate_grad_hook(functools.partial(_fold_hook, ref, g, i))
        for g, group in enumerate(optimizer._groups)
        for i, param in enumerate(group.params)
    ]
    weakref.finalize(optimizer, _remove_hooks, handles)
    return handles


def _remove_hooks(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
