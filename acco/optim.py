"""AccoOptimizer, the public face: a sharded optimizer whose communication overlaps the
next gradients.

A *round* is the time between two :meth:`AccoOptimizer.step` calls. During a round the
compute lane (the caller's loop) folds micro-batch gradients into a local accumulator while
the comm lane runs the previous round's reduce-scatter -> sharded update -> all-gather into a
buffer the model does not read. ``step()`` is the round boundary: it lands the round in
flight (waits for it and loads its result into the model), hands the new gradients over
and launches the next round. Each concern lives in its own module: docs/design.md,
"Map of the modules".
"""

from __future__ import annotations

import atexit
import collections
import datetime
import functools
import logging
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.profiler import record_function

from acco.amp import inverse_scale
from acco.collectives import Collectives, destroy_drained_groups
from acco.folding import GradFolder, checked_weight
from acco.local import LocalLoop
from acco.loops import Loop, LoopParts, UpdateCounts, loop_classes
from acco.mesh import InnerMesh, placeholder_state
from acco.module_buffers import BufferPolicy, buffer_sync_for
from acco.options import (
    DEFAULT_OUTER_BITS,
    DEFAULT_OUTER_ERROR_FEEDBACK,
    DEFAULT_OUTER_TOPK,
    DEFAULT_OUTER_WEIGHTING,
    DEFAULT_PACING,
    DEFAULT_SYNC_DELAY,
    DEFAULT_SYNC_EVERY,
    DEFAULT_TIMEOUT,
    Mode,
    NonFinite,
    Options,
    RoundKind,
    check_estimate_dtypes,
    probe_defaults,
    resolve_groups,
)
from acco.portable import from_portable, is_portable, pending_to_rank_zero, to_portable
from acco.rounds import CommLaneError, LaneRound, RoundSchedule
from acco.sharding import Layout, ShardedGroup, ShardPlan
from acco.startup import build_groups, open_groups, start_identical
from acco.state import build_state_dict, check_state_dict, restore_groups
from acco.streams import ThreadLane, make_lane
from acco.telemetry import RoundStats, StatsRecorder

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["AccoOptimizer", "CommLaneError", "Mode", "NonFinite", "RoundKind", "RoundStats"]

# Under the "acco" logger: rank 0 logs the resolved options at construction (INFO).
_log = logging.getLogger(__name__)

# The longest the exit hook waits for the last round of an optimizer never finished (at
# most its timeout): it normally lands at once (every rank's lane runs it); a dead peer fails it sooner.
EXIT_WAIT_SECONDS = 60.0

# Each mode's loop, by the mode it declares: the one place a mode is chosen (STYLE rule 12).
LOOPS: dict[Mode, type[Loop]] = loop_classes([LocalLoop])


class _Started:
    """What an optimizer started and gives back: the comm lane's thread, the process groups
    acco made (``owned``) and its reference to the user's group (``borrowed``).

    Kept apart from the optimizer, so that the exit hook can reach it without keeping the
    optimizer alive. The lane's thread goes first (a round may still use the groups), then
    the groups, drained or destroyed (:meth:`Collectives.drain` says why) and dropped.
    """

    def __init__(self, lane: ThreadLane, owned: list[Collectives], borrowed: Collectives, exit_wait: float,
                 schedule: RoundSchedule) -> None:
        self._lane = lane
        self._owned = owned
        self._borrowed = borrowed
        self.exit_wait = exit_wait
        self._schedule = schedule
        _NOT_GIVEN_BACK.add(self)

    def finish(self, wait: float, keep: Any) -> None:
        """Every rank, the lane drained (``finish()``): join the lane's thread, drain and drop
        the groups (torch destroys them in ``destroy_process_group()`` or at exit)."""
        if self._give_back(wait, keep):
            for comm in self._owned:
                comm.drain()
                comm.release()

    def close(self, keep: Any) -> None:
        """This rank alone (``close()``, collection): stop the lane's thread once its round ends;
        the groups stay for the exit hook (another rank may still be using them)."""
        self._lane.close(0.0, keep)

    def at_exit(self, wait: float) -> None:
        """Interpreter exit without ``finish()``: wait up to ``wait`` s for the lane's last
        round (not at all once a wait for it failed: it waits for peers that will not come),
        then destroy and drop the groups. A lane still busy (a peer gone) keeps them."""
        if self._give_back(0.0 if self._schedule.failure is not None else wait, None):
            for comm in self._owned:
                comm.destroy()

    def _give_back(self, wait: float, keep: Any) -> bool:
        """Whether the lane's thread has ended (then this object leaves the exit hook's set
        and drops the user's group; the caller deals with the owned ones)."""
        if self not in _NOT_GIVEN_BACK or not self._lane.close(wait, keep):
            return False
        _NOT_GIVEN_BACK.discard(self)
        self._borrowed.release()
        return True


# Everything not given back yet; the exit hook gives it back before the interpreter
# finalises (a job that never calls finish(): an exception, a forgotten call).
_NOT_GIVEN_BACK: set[_Started] = set()


@atexit.register
def _give_back_at_exit() -> None:
    for started in list(_NOT_GIVEN_BACK):
        started.at_exit(started.exit_wait)
    destroy_drained_groups()


class AccoOptimizer(torch.optim.Optimizer):
    """Wraps any torch optimizer: sharded state, communication overlapped with compute.

    Each rank keeps a full-precision master shard of the parameters and the base
    optimizer's state for that shard only (ZeRO-1). The reduce-scatter -> update ->
    all-gather of a round runs on the comm lane (a worker thread on CPU, a CUDA side
    stream on GPU) while the caller computes the next gradients.

    Args:
        params: a module, or an iterable of parameters or of param-group dicts; frozen
            parameters are left alone, tied ones handled once; one dtype and device a group.
        optimizer_class: the base ``torch.optim.Optimizer`` subclass, built on this rank's shard.
        process_group: the ranks that share the model (default: the default group when
            ``torch.distributed`` is initialised, otherwise a single process).
        mode: ``"acco"`` (estimate + commit rounds, overlapped), ``"dpu"`` (one-round-stale
            update, overlapped), ``"sync"`` (ZeRO-1, blocking) or ``"local"`` (each rank of
            ``process_group`` takes inner steps alone; an outer round every ``sync_every``
            steps, overlapped: :mod:`acco.local`).
        layout: ``"flat"`` (equal chunks of a flat buffer: element-wise optimizers only),
            ``"tensor"`` (whole tensors per rank) or None (``flat`` where it is exact).
        max_grad_norm: clip the averaged gradient to this global 2-norm before each update
            (the estimate's included), as ``clip_grad_norm_`` would; the norm is in ``round_stats``.
            None or 0 (nanoGPT's ``grad_clip=0.0``): no clipping.
        param_dtype / reduce_dtype: the live parameters' dtype (the model is cast at
            construction) / the dtype gradients are accumulated and reduced in (default
            ``param_dtype``; 16-bit warns). Master shard and state: fp32 (fp64 for fp64).
        nonfinite: NaN or inf in any rank's gradients: ``"raise"`` (default; ``CommLaneError``
            on every rank, nothing updated) or ``"skip"`` the update on every rank.
        timeout: limit for each comm-lane collective and wait (default 10 minutes).
        estimate_dtype: ``acco`` only: lighter estimate rounds, commit rounds exact
            (1.5x a ZeRO-1 update's bytes with bf16, 1.25x with float8, instead of 2x).
        buffers: the module's persistent buffers (BatchNorm statistics) across ranks:
            ``"broadcast"`` (rank 0's, as DDP; default), ``"average"`` or None (left alone);
            one round behind, identical after ``finish()`` (:mod:`acco.module_buffers`).
        module: the model whose buffers those are (default: ``params`` if a module).
        sync_every: ``local`` only: ``"auto"`` (the default, bounds 4-128) or ``("auto", lo,
            hi)``: inner steps between outer rounds chosen before each round from the measured
            inner step time and the round's own time (:func:`acco.replicas.plan_sync_every`), the
            same on every replica, starting at ``lo``, so that waiting for rounds costs at most 4%
            of the wall time (on a fast link 4); or an int, a fixed H (bit-for-bit reproducible).
        sync_delay: ``local`` only: when an outer round lands. The default (None): with
            ``sync_every="auto"`` chosen with H each round, at once (blocking, at the H where that
            waits at most 4% of the time) unless one inner step after its launch needs an H more
            than 4 steps smaller (the round hides behind that step, kept by the estimate rule), a round waiting for the
            link and not for a replica a little behind (that one lands it a step later); with a fixed
            ``sync_every``, or elastic groups, 0: blocking DiLoCo. ``"auto"``: at the first inner
            step at which the comm lane has finished it (at the latest ``sync_every`` steps after
            its launch, waiting then if it must); or after a fixed number of inner steps in
            ``[0, sync_every]`` or ``"half"`` (bit-for-bit reproducible).
        outer_optimizer: ``local`` only: the outer optimizer, a class or a partial of one
            (default :func:`acco.default_outer`: ``partial(SGD, lr=1.0, momentum=0.0)``,
            measured against data-parallel at ``sync_every`` 4-30; with ``membership=``,
            Nesterov lr 0.5 / momentum 0.3, measured under killed groups), stepped on this rank's 1/R
            shard of the global values with the mean pseudo-gradient.
        overlap: ``local`` only: what the inner steps taken while an outer round is in flight
            start from and become: ``"estimate"`` (the default where the outer optimizer's step
            is linear in its gradient, i.e. SGD: each replica starts from the outer step its own
            pseudo-gradient would give, and the landing corrects that start to the commit,
            keeping the steps), ``"keep"`` (started from the replica's own parameters, added on
            top of the new global values) or ``"discard"`` (dropped: every replica takes the new
            global values; the default with any other outer optimizer).
        outer_bits / outer_error_feedback: ``local`` only: bits per value an outer round sends (4, the
            default; 8, 16, 32; with ``outer_topk`` per value kept: 2, 4, 8, 16, 32), and below 16
            (or with ``outer_topk``) whether what it drops goes with the next (default True).
        outer_topk: ``local`` only: None (default: every value), or the share of each block of
            4096 values of a parameter an outer round sends, the largest in magnitude (e.g.
            ``1/64``): both legs sparse, still a reduce to each chunk's owner and a gather of
            its change (docs/design.md, "Sparse outer rounds").
        pacing: ``local`` only: how many inner steps each replica takes per outer round:
            ``"speed"`` (default: in proportion to its measured speed, the fastest
            ``sync_every``, so no replica waits for another; replicas within 20% of the fastest
            stay in lockstep, and rank 0 warns when plans first differ), ``"lockstep"``
            (``sync_every`` each: every replica waits for the slowest), or a list of ints, one
            per replica (reproducible). Replicas that take different numbers stop together on
            ``should_stop`` (``stop_after()``, ``request_stop()``); a loop with collectives of its
            own at step counts gets :class:`acco.PacingStall` (docs/loops.md, "Loops
            with collectives of their own").
        outer_weighting: ``local`` only: each replica's pseudo-gradient's weight in the outer
            round's mean: ``"tokens"`` (default: the ``accumulate()`` weights it trained on since
            its last hand-over), ``"equal"`` (once each) or ``"normalized"`` (FedNova: each over
            its inner steps, times their weighted mean).
        membership: ``local`` only: an :class:`acco.elastic.TorchFT`: each replica group is its
            own job (``process_group=None``; FSDP2 or TP inside a group of several ranks: the
            one-rank ``mesh["replicate"]`` group), torchft decides who takes part in each outer round,
            a lost replica group's peers go on without it and a restarted one heals from a peer
            (docs/elastic.md). Needs ``sync_delay=0``, ``pacing`` ``"speed"`` or ``"lockstep"``,
            ``outer_bits`` below 32.
        **defaults: the base optimizer's hyper-parameters (``lr=...``). A group dict may name
            its own ``optimizer_class`` (e.g. Muon) and ``layout``, and then takes its
            hyper-parameters from the group and that class's defaults.

    An ``acco``-only or ``local``-only argument given in another mode is ignored, with one
    ``UserWarning`` naming it, so a configurator's typed defaults serve every mode.
    ``repr(opt)`` shows the mode and its resolved settings (and rank 0 logs them at INFO on
    the ``"acco"`` logger).

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


    # torch.amp.GradScaler's contract for an optimizer that unscales its own gradients:
    # scaler.step(opt) calls step() directly, with grad_scale and found_inf set (acco.amp).
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: nn.Module | Iterable[Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[torch.optim.Optimizer],
        *,
        process_group: ProcessGroup | None = None,
        mode: Mode | str = "acco",
        layout: Layout | str | None = None,
        max_grad_norm: float | None = None,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        nonfinite: NonFinite | str = NonFinite.RAISE,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
        estimate_dtype: torch.dtype | None = None,
        buffers: BufferPolicy | str | None = BufferPolicy.BROADCAST,
        module: nn.Module | None = None,
        sync_every: int | str | tuple[str, int, int] = DEFAULT_SYNC_EVERY,
        sync_delay: int | str | None = DEFAULT_SYNC_DELAY,
        outer_optimizer: Any = None,
        overlap: str | None = None,
        outer_bits: int = DEFAULT_OUTER_BITS,
        outer_error_feedback: bool = DEFAULT_OUTER_ERROR_FEEDBACK,
        pacing: str | Sequence[int] = DEFAULT_PACING,
        outer_weighting: str = DEFAULT_OUTER_WEIGHTING,
        membership: Any = None,
        outer_topk: float | None = DEFAULT_OUTER_TOPK,
        **defaults: Any,
    ) -> None:
        # Everything is checked before the first collective, and no state exists until the
        # checks pass, so a bad argument never leaves a half-built optimizer or a hung rank.
        options = Options.check(
            mode=mode, nonfinite=nonfinite, layout=layout, max_grad_norm=max_grad_norm, param_dtype=param_dtype,
            reduce_dtype=reduce_dtype, timeout=timeout, estimate_dtype=estimate_dtype, buffers=buffers, module=module,
            sync_every=sync_every, sync_delay=sync_delay, overlap=overlap, outer_optimizer=outer_optimizer,
            outer_bits=outer_bits, outer_error_feedback=outer_error_feedback, pacing=pacing,
            outer_weighting=outer_weighting, membership=membership, outer_topk=outer_topk)  # fmt: skip
        loop_class = LOOPS[options.mode]
        groups = resolve_groups(params, optimizer_class, options.layout, loop_class.sharded_class(options))
        base_defaults = probe_defaults(optimizer_class, defaults)
        check_estimate_dtypes(options.estimate_dtype, options, groups)
        self.options, self.optimizer_class = options, optimizer_class
        self.mode, self.nonfinite, self.layout = options.mode, options.nonfinite, options.layout
        self.max_grad_norm, self.timeout, self.estimate_dtype = options.max_grad_norm, timeout, options.estimate_dtype
        self._comm = Collectives.from_user_group(process_group)
        self.rank, self.world_size = self._comm.rank, self._comm.world_size
        if isinstance(params, nn.Module) and module is not None and module is not params:
            raise ValueError("module= names another model than params: pass the model once, as params or as module")
        module = params if isinstance(params, nn.Module) else module
        inner = InnerMesh([p for g in groups for p in g["params"]], module, self._comm)
        inner.check(groups, param_dtype)
        if options.local is not None and options.local.membership is not None and self.world_size > 1:
            raise ValueError(
                f"membership= with a process group of {self.world_size} ranks: torchft's process group connects the "
                "replica groups, and acco's own group is this rank alone: process_group=None in a replica group of one "
                "process; with FSDP2 or tensor parallelism inside a group of several, mesh['replicate'].get_group() of "
                "a mesh whose replicate dimension is 1 (docs/elastic.md)"
            )
        self._sealed = False
        super().__init__(groups, base_defaults)
        self._sealed = True
        self._mesh = inner.active
        self.replica_size = inner.replica_size  # ranks of a replica group (FSDP2 / TP inside), 1 if flat
        self._groups = build_groups(
            self.param_groups, options, self.rank, self.world_size, inner if self._mesh else None,
            double_buffered=loop_class.double_buffered, master_in_params=loop_class.master_in_params,
            master=loop_class.keeps_master(options), gather_into_params=loop_class.gathers_into_params,
        )  # fmt: skip
        if self._mesh:  # DCP's get_optimizer_state_dict needs an entry per parameter
            self.state.update(placeholder_state(self.param_groups))
        self._buffer_sync = buffer_sync_for(module, options.buffer_policy, self.rank, self.world_size)
        # Collectives from here on, on the user's group, before the lane exists.
        names = [g["optimizer_class"].__qualname__ for g in self.param_groups]
        start_identical(self._groups, self._comm, options, names, self._buffer_sync)
        made = open_groups(self._comm, inner, timeout)
        self._lane_comm, self._replica_comm = made.lane, made.replica
        self._lane = make_lane(self._groups[0].device)
        self._recorder = StatsRecorder(self._lane.device_hooks)
        self._schedule = RoundSchedule(loop_class.round_kinds, self._recorder, options.wait_seconds)
        self._started = _Started(self._lane, made.owned(), self._comm, min(options.wait_seconds, EXIT_WAIT_SECONDS),
                                 self._schedule)
        # Collected unfinished: the lane's thread stops (the exit hook gives the groups back).
        # The worker drops the flat buffers only after its stream has finished with them.
        weakref.finalize(self, self._started.close, self._groups)
        self._folder = GradFolder(self._groups, self._schedule.count)
        self._counts = UpdateCounts()
        # The mode's loop: what step(), ready(), finish() and its state mean (acco.loops).
        self._loop: Loop = loop_class(LoopParts(
            self.param_groups, self._groups, self._schedule, self._folder, self._counts, self._lane,
            self._lane_comm, self._recorder, options, self._buffer_sync, made.mesh, inner.replica_size,
            optimizer_class, defaults,
        ))  # fmt: skip
        self._consolidated: dict[str, Any] | None = None  # consolidate_state_dict()'s, on its rank
        self._warned_zero_grad = False
        if self.rank == 0:
            _log.info("AccoOptimizer, world size %d: %s", self.world_size, ", ".join(options.describe()))

    def __repr__(self) -> str:
        """As torch optimizers' (the class, then each param group), with the mode and its
        resolved settings first (``sync_delay``, the outer optimizer, ... in ``mode="local"``)."""
        lines = [f"{type(self).__name__} (", "Options", *(f"    {line}" for line in self.options.describe())]
        for number, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {number}")
            lines += [f"    {key}: {group[key]}" for key in sorted(group) if key != "params"]
        return "\n".join(lines) + "\n)"

    @property
    def num_updates(self) -> int:
        """Updates applied on this rank: committed rounds (``mode="local"``: inner updates)."""
        return self._counts.num_updates

    @property
    def skipped_updates(self) -> int:
        """Updates skipped for NaN/inf with ``nonfinite="skip"``."""
        return self._counts.skipped_updates

    @property
    def committed_weight(self) -> float:
        """The weights of the micro-batches the applied updates covered (over all ranks;
        ``mode="local"``: this replica's)."""
        return self._counts.committed_weight

    def accumulate(self, weight: float | Tensor | None = None) -> None:
        """End a micro-batch: fold its gradients into this round's accumulator.

        Without ``weight`` (equal weights) ``p.grad`` becomes a view of the accumulator after
        the first call (the round's running sum; no gradient copy), or, where ``reduce_dtype``
        differs from the parameters' dtype, a hook folds it and ``p.grad`` stays None.
        With ``weight``, ``p.grad`` is kept until this call and set to None (one model size
        more at the end of each backward): declare unequal weights before ``backward()``
        with :meth:`micro_batch` to avoid that. See :mod:`acco.folding`. Parameters without
        a gradient count as zero.

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
        self._check_call("accumulate")
        self._folder.accumulate(1.0 if weight is None else checked_weight(weight), explicit=weight is not None)

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
            RuntimeError: blocks nested, an earlier ``backward()`` not accumulated, no
                gradient in the block, or ``accumulate()``/``step()`` inside it. An exception
                in the block after some gradients were folded leaves a partial micro-batch:
                every later call raises ``RuntimeError``.
        """
        self._check_call("micro_batch")
        with self._folder.micro_batch(checked_weight(weight)):
            yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``: drops ``p.grad`` (a ``backward()`` not yet
        accumulated), never what ``accumulate()`` has folded into this round's accumulator,
        which the next ``step()`` uses. Called between ``accumulate()`` and ``step()`` (where a
        DDP loop would discard those gradients) it warns once; after ``step()`` it is silent.

        Raises:
            RuntimeError: gradients of a ``backward()`` were already folded into the
                accumulator during ``backward()`` (they cannot be discarded).
        """
        self._folder.before_zero_grad()  # p.grad views released: zeroing them would zero the sum
        if self._schedule.current.micro_batches and not self._warned_zero_grad:
            self._warned_zero_grad = True
            warnings.warn(
                f"zero_grad() after accumulate() discards nothing: the {self._schedule.current.micro_batches} "
                "micro-batch(es) accumulated since the last step() stay in acco's accumulator and count at the "
                "next step(). To leave a micro-batch out, do not call accumulate() for it (zero_grad() then "
                "drops its p.grad). Warned once.",
                stacklevel=2,
            )
        super().zero_grad(set_to_none=set_to_none)

    def ready(self) -> bool:
        """Whether ``step()`` would return without waiting for the comm lane. Never blocks
        on the lane.

        On a mesh with several ranks per replica group (FSDP2 or TP inside) it answers for
        the whole group, through one small all-reduce over it on the training thread:
        those ranks must run the same number of micro-batches.
        """
        done = self._loop.ready()
        if self._replica_comm is None:
            return done
        waiting = torch.tensor([0.0 if done else 1.0], device=self._groups[0].device)
        self._replica_comm.all_reduce_max_(waiting)
        return not bool(waiting.item())

    def step(self, closure: None = None) -> bool:  # type: ignore[override]
        """End the round: land the round in flight, hand this round's gradients over.

        Returns:
            True when the model now holds newly committed parameters (drive LR
            schedulers with ``if opt.step(): scheduler.step()``).

        Raises:
            RuntimeError: gradients of a ``backward()`` not yet ended by ``accumulate()``
                (raised on this rank before any collective; nothing is lost, call
                ``accumulate()`` and ``step()`` again), or nothing accumulated before the
                first ``step()``.
            CommLaneError: the round in flight failed (on every rank).
            TimeoutError: the comm lane did not finish within ``timeout``.

        .. warning:: Collective: every rank must call it once per round.
        """
        if closure is not None:
            raise TypeError("AccoOptimizer.step() takes no closure")
        self._check_call("step")
        self._folder.check_all_accumulated("step()")
        if self._schedule.launched == 0 and self._schedule.current.micro_batches == 0:
            raise RuntimeError("step() before any accumulate() in the first round: there is nothing to apply")
        inv_scale = inverse_scale(self, self._loop.grad_scaler_refusal, self._folder.grads_in_views)  # scaler.step(opt)
        with record_function("acco.step"):
            return self._loop.step(inv_scale)

    @property
    def outer_rounds(self) -> int:
        """``mode="local"``: outer rounds landed so far (0 in other modes)."""
        return self._loop.outer_rounds

    @property
    def skipped_outer_rounds(self) -> int:
        """``mode="local"``: landed outer rounds that changed nothing (NaN/inf in some replica's
        parameters with ``nonfinite="skip"``)."""
        return self._loop.skipped_outer_rounds

    def request_stop(self) -> None:
        """``mode="local"``: ask every replica to stop. The request travels with this replica's
        next outer round; once that round has landed :attr:`should_stop` is True on every
        replica (the same round on each). Not collective.

        Raises:
            RuntimeError: another mode (every rank takes the same updates: stop at a count).
        """
        self._loop.request_stop()

    def stop_after(self, steps: int | None = None, seconds: float | None = None) -> None:
        """``mode="local"``: a budget this replica enforces with :meth:`request_stop`: it asks
        at the launch after which one more round would take it past ``steps`` inner steps
        (counted as the fastest replica's, ``sync_every`` a round), or at the launch nearest
        ``seconds`` from now (within half a round, the last round's time as the measure).
        With ``pacing="lockstep"`` and ``steps`` a multiple of ``sync_every`` every replica
        stops after exactly ``steps``. Loop on ``while not opt.should_stop``; every replica may
        call it, with its own budget.

        Raises:
            RuntimeError: another mode. ValueError: a budget that is not positive.
        """
        self._loop.stop_after(steps, seconds)

    @property
    def should_stop(self) -> bool:
        """``mode="local"``: some replica asked to stop (or finished) in an outer round that has
        landed: True on every replica from the same round on (False in other modes)."""
        return self._loop.should_stop

    @property
    def replica(self) -> int:
        """``mode="local"``: this rank's replica, numbered as in :attr:`replica_steps` and in
        each outer round's ``RoundStats.replicas`` (its rank among the replicas); 0 in other
        modes."""
        return self._loop.replica

    @property
    def replica_steps(self) -> list[int]:
        """``mode="local"``: each replica's inner steps in the current outer round (``pacing``),
        by replica; empty in other modes."""
        return self._loop.replica_steps

    def global_parameters(self) -> list[list[Tensor]]:
        """``mode="local"``: copies of the global values the last outer round landed (the
        initial parameters before the first), per param group and parameter (local tensors on
        a mesh): the model the replicas agree on. At any step, on this rank alone.

        Raises:
            RuntimeError: another mode.
        """
        return self._loop.global_parameters()

    @property
    def inner_optimizers(self) -> list[torch.optim.Optimizer]:
        """``mode="local"``: each param group's inner optimizer, on the live parameters."""
        return self._loop.inner_optimizers

    @property
    def outer_optimizers(self) -> list[torch.optim.Optimizer | None]:
        """``mode="local"``: each param group's outer optimizer, on this rank's shard of the
        global values (None: owns nothing of the group; empty in other modes)."""
        return self._loop.outer_optimizers

    def finish(self) -> bool:
        """Drain the comm lane and leave the model at the last committed parameters (the
        loop's ``finish()``: a commit round in flight lands, an estimate round is dropped;
        ``mode="local"`` ends every replica at the same, global parameters). Gradients
        accumulated since the last hand-over are dropped. Idempotent; the optimizer cannot be
        used afterwards.

        Returns:
            True when landing the last round committed an update.

        .. warning:: Collective: every rank must call it.
        """
        if self._schedule.closed:
            return False
        if self._schedule.failure is not None:
            self.close()
            self._check_usable("finish")
        landed = False
        try:
            committed = self._loop.finish()
            self._loop.synchronise_buffers_now()
            self._recorder.resolve(block=True)
            landed = True
            return committed
        finally:
            self._folder.release_views()  # p.grad no longer points into acco's buffers
            self._stop(collective=landed)

    def close(self) -> None:
        """Stop without landing the round in flight (not collective; for error paths): the comm
        lane's thread stops once its current round ends, at the latest after ``timeout``, and
        the process groups acco made are given back then (or at interpreter exit)."""
        self._stop(collective=False)

    def _stop(self, collective: bool) -> None:
        """Close the optimizer and give back what it started (:class:`_Started`).
        ``collective``: every rank is here with the lane drained (``finish()``)."""
        self._schedule.closed = True
        self._folder.close()
        # The worker holds what a dropped round may still read on the device until its stream is done.
        keep = (self._schedule.take_in_flight(), self._schedule.failed, self._groups, self._loop.shard_optimizers,
                self._loop.lane_work)  # fmt: skip
        if collective:
            self._started.finish(self.options.wait_seconds, keep)
        else:
            self._started.close(keep)

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
        """The kind of the round on the comm lane (None in ``sync`` mode or before the first
        ``step()``), the same on every rank; a commit adds one to ``num_updates`` once it lands."""
        return None if self._schedule.in_flight is None else self._schedule.in_flight.kind

    @property
    def on_mesh(self) -> bool:
        """Whether parameters are DTensors (FSDP2 or tensor parallelism inside a replica
        group): ``state_dict()`` is then the portable form (:mod:`acco.portable`)."""
        return self._mesh

    @property
    def collectives(self) -> Collectives:
        """The collectives on the user's process group (for :mod:`acco.checkpoint`; every rank
        must call them in the same order)."""
        return self._comm

    @property
    def lane_collectives(self) -> Collectives:
        """Test hook (docs/design.md, "Test hooks"): the comm lane's own collectives."""
        return self._lane_comm

    @property
    def sharded_groups(self) -> list[ShardedGroup]:
        """Test hook (docs/design.md, "Test hooks"): each param group's buffers, to read."""
        return list(self._groups)

    @property
    def accumulated(self) -> tuple[int, float]:
        """The micro-batches accumulated on this rank since the last ``step()`` and their
        total weight (a CUDA weight is read on the host: a synchronisation)."""
        return self._schedule.current.micro_batches, self._schedule.current.total()

    @property
    def shard_plans(self) -> list[ShardPlan]:
        """Where each param group's parameters sit in its flat buffer, and who owns what."""
        return [group.plan for group in self._groups]

    @property
    def base_optimizers(self) -> list[torch.optim.Optimizer | None]:
        """The base optimizer of each param group on this rank's shard (None: owns nothing;
        empty in ``mode="local"``, whose base optimizer runs whole on the live parameters:
        :attr:`inner_optimizers`)."""
        return self._loop.base_optimizers

    def buffer_bytes(self) -> list[dict[str, int]]:
        """Bytes of each buffer acco holds now, per param group (see docs/design.md,
        "Buffers and memory"): ``grad_accumulator``, ``grad_handover``, ``gathered``,
        ``master``, ``master_grad``, ``estimate_copy``; a view of another buffer counts 0.
        ``mode="local"`` adds ``handed_over`` (the parameters the round in flight was handed,
        with ``overlap="keep"``; the replica's start with ``"estimate"``; a blocking round that a
        paced replica lands late), ``global_values`` (the last landed round's, whole),
        ``outer_residual`` (error feedback below 16 bits) and ``common_term`` (``"estimate"``);
        ``master`` is the global values' shard there (:meth:`acco.local.LocalLoop.buffer_bytes`)."""
        return self._loop.buffer_bytes()

    @property
    def round_stats(self) -> collections.deque[RoundStats]:
        """The last 1024 rounds' :class:`RoundStats`, oldest first (times filled in once the
        device has passed them; never blocks)."""
        return self._recorder.history

    def eval(self) -> None:
        """Load the committed parameters into the model, to evaluate or save it (the
        schedule-free convention that ``transformers.Trainer`` and accelerate follow).

        Afterwards the model holds the parameters :meth:`finish` would leave: a commit round in
        flight is waited for (not collective) and loaded, the live parameters set aside until
        :meth:`train` (:meth:`acco.loops.UpdateLoop.eval`). Call :meth:`train` before the next
        forward pass. Raises ``CommLaneError``/``TimeoutError`` as ``step()``.
        """
        self._loop.eval()

    def train(self) -> None:
        """Put back the live parameters that :meth:`eval` set aside (no-op otherwise, or when
        ``step()`` or ``finish()`` has loaded newer parameters since)."""
        self._loop.train(restore=not self._schedule.closed)

    def _check_call(self, call: str) -> None:
        """The checks every compute-lane call starts with (before any collective)."""
        self._consolidated = None  # the state changes from here on
        self._check_usable(call)
        self._folder.check_outside_block(f"{call}()")
        for number, group in enumerate(self._groups):
            group.check_params_unchanged(number)

    def _check_usable(self, call: str) -> None:
        self._schedule.check_usable(call)

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of the optimizer's state (schema: :mod:`acco.state`), tensors and
        plain values only. Waits for the round in flight, whose result is saved and still lands
        at the next ``step()``: the natural moment is right after a ``step()``.

        On the rank that :meth:`consolidate_state_dict` sent the state to, until the next
        ``accumulate()`` or ``step()``: the whole state, which any world size loads."""
        self._check_usable("state_dict")
        if self._consolidated is not None:
            return self._consolidated
        if not self._mesh:
            return self._own_state_dict()
        # DTensor parameters: the portable form, which DCP reshards to any mesh. Collective.
        return to_portable(self._every_rank_state(None), [g["params"] for g in self.param_groups], self.replica_size)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole optimizer state on rank ``to``, as ``ZeroRedundancyOptimizer`` does:
        its next ``state_dict()`` (before any ``accumulate()`` or ``step()``) returns every
        rank's part in one dict, which ``load_state_dict()`` on every rank of a fresh optimizer,
        at any world size, turns into that rank's part. For loops that save one optimizer
        state from rank 0 (nanoGPT, Lightning)::

            opt.consolidate_state_dict(to=0)          # every rank
            if rank == 0:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)

        Waits for the round in flight (whose result is saved). The pending gradients (an acco
        estimate round's, kept for its commit) are summed onto rank 0, where a loading run puts
        them too, so the saving run and a resumed one continue bit for bit alike. Rank ``to``
        holds every rank's state meanwhile (the optimizer state once, plus one model-size
        pending gradient per rank). Flat ranks only: with DTensor parameters ``state_dict()``
        is already the portable whole (save it with ``torch.distributed.checkpoint`` or
        :func:`acco.checkpoint.save`).

        Raises:
            ValueError: ``to`` is not a rank of the group, or the parameters are DTensors
                (before any collective).
            RuntimeError: gradients of a ``backward()`` not yet accumulated.

        .. warning:: Collective: every rank must call it.
        """
        if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < self.world_size:
            raise ValueError(f"Invalid rank to consolidate on: {to!r} (0 <= to < {self.world_size})")
        if self._mesh:
            raise ValueError(
                "consolidate_state_dict(): with DTensor parameters state_dict() is already the whole (portable) "
                "state on every rank; save it with torch.distributed.checkpoint or acco.checkpoint.save"
            )
        self._check_usable("consolidate_state_dict")
        self._folder.check_all_accumulated("consolidate_state_dict()")
        saved = self._every_rank_state(to)
        if saved is not None:
            self._consolidated = to_portable(saved, [g["params"] for g in self.param_groups])

    def _own_state_dict(self) -> dict[str, Any]:
        """This rank's own state dict, once the round in flight has finished."""
        round_ = self._wait_in_flight()
        return build_state_dict(
            self.param_groups, self._groups, self._loop.shard_optimizers, options=self.options, rank=self.rank,
            world_size=self.world_size, round_state=self._schedule.state_dict(),
            counts={"num_updates": self.num_updates, "skipped_updates": self.skipped_updates,
                    "committed_weight": self.committed_weight, "local": self._loop.state_dict()},
            buffers=None if self._buffer_sync is None else self._buffer_sync.state_dict(round_ and round_.buffer_snapshot),
            masters=self._loop.saved_masters(),
        )  # fmt: skip

    def _wait_in_flight(self) -> LaneRound | None:
        """The round in flight, once the comm lane has finished it (it still lands at the
        next ``step()``)."""
        round_ = self._schedule.in_flight
        if round_ is not None:
            self._schedule.wait(round_)
        return round_

    def _every_rank_state(self, dst: int | None) -> list[dict[str, Any]] | None:
        """Every rank's own state dict, on rank ``dst`` (None: on every rank), the pending
        gradients held first as a load of the portable state holds them (their sums on rank
        0), so a run that saved and a run that loaded continue bit for bit alike. Collective."""
        self._wait_in_flight()  # the lane no longer reads what is moved next
        if self._loop.pending_sums_across_ranks:
            pending_to_rank_zero(self._groups, self._schedule, self._comm)
        own = self._own_state_dict()
        return self._comm.all_gather_objects(own) if dst is None else self._comm.gather_objects(own, dst=dst)

    def check_state_dict(self, state_dict: Any) -> None:
        """``ValueError`` naming the first mismatch when ``state_dict`` does not fit this
        optimizer (mode, rank and world size, layouts, shapes, dtypes); changes nothing."""
        check_state_dict(
            self._own_form(state_dict), mode=self.mode.value, rank=self.rank, world_size=self.world_size,
            param_groups=self.param_groups, groups=self._groups,
            buffer_sync=self._buffer_sync,
        )  # fmt: skip

    def _own_form(self, state_dict: Any) -> Any:
        """This rank's own state dict, from a portable one (any layout) or as given."""
        if not is_portable(state_dict):
            return state_dict
        return from_portable(state_dict, self.param_groups, self._groups, self.rank, self.world_size, self.replica_size)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict` with the same world size and layouts.

        Into a fresh optimizer (no ``accumulate()`` or ``step()`` yet), after the model's own
        ``load_state_dict`` (this writes this rank's module buffers). A consolidated state
        (:meth:`consolidate_state_dict`) or a portable one loads at any world size and layout,
        every rank taking its part; for a rank's own state at another world size use
        :func:`acco.checkpoint.load`. A mismatch is a ``ValueError``, before any change.

        .. warning:: In the per-update modes, collective when the saved state has a round in
            flight (its result is all-gathered again on the comm lane): every rank must call
            it. In ``mode="local"`` it is never collective: a round in flight lands from the
            result the state holds (with ``sync_delay="auto"`` one replica may have landed a
            round that another saved in flight); replicas resumed from states of different
            outer rounds fail at their next round, on every rank, naming it.
        """
        self._check_usable("load_state_dict")
        state_dict = self._own_form(state_dict)
        if (self._schedule.in_flight is not None or self._schedule.launched > self._loop.rounds_before_training
                or self._schedule.pending.micro_batches):  # fmt: skip
            raise RuntimeError("load_state_dict() must be called on a fresh optimizer, before any accumulate()/step()")
        self.check_state_dict(state_dict)
        saved = state_dict["acco"]
        # On the lane, so the base optimizers' state is allocated on the stream that uses it.
        run_on_lane = functools.partial(self._lane.run, timeout=self.options.wait_seconds)
        snapshot = restore_groups(state_dict, self.param_groups, self._groups, self._loop.shard_optimizers,
                                  self._buffer_sync, run_on_lane)  # fmt: skip
        self._counts.num_updates = int(saved["num_updates"])
        self._counts.skipped_updates = int(saved.get("skipped_updates", 0))
        self._counts.committed_weight = float(saved["committed_weight"])
        self._schedule.load_state_dict(saved["round"])
        self._loop.load_state_dict(saved, snapshot)  # its own state, and the round in flight
