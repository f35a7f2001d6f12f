"""``AccoOptimizersContainer``: torchtitan's optimizer container, with one
:class:`~acco.AccoOptimizer` behind it.

torchtitan builds its container from ``Trainer.Config.optimizer`` and wraps every optimizer
the container iterates over in an LR schedule. This container is built the same way (its
``Config`` is ``OptimizersContainer.Config`` plus acco's arguments, so ``--optimizer.mode`` and
friends work on the command line) and starts as torchtitan's: plain torch optimizers over
the param groups its ``param_groups`` patterns select, which the LR schedules are built on.
:class:`~acco.integrations.torchtitan.AccoTrainer` then calls :meth:`start`, which turns
them into one AccoOptimizer sharing those param groups (their patterns and hyper-parameters
kept; :func:`acco.integrations.schedules.acco_from_optimizer`), across the replicate
dimension of the mesh, so the schedules drive acco's learning rate.

A trainer step is one committed update of the step's micro-batches (K, torchtitan's
gradient accumulation steps) in every mode, as with torchtitan's own container; in ``acco``
mode its two rounds end after K/2 micro-batches and at ``step()``
(:class:`~acco.integrations.schedules.UpdateRounds`); in ``local`` mode a step is one inner
update of this replica and an outer round runs every ``sync_every`` steps.
"""

from __future__ import annotations

import datetime
import functools
import importlib.util
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.optimizer import OptimizersContainer

from acco import AccoOptimizer, Mode
from acco.elastic import TorchFT
from acco.integrations.schedules import (UpdateRounds, acco_from_optimizer, check_acco_kwargs, check_micro_batches,
                                         rounds_per_update)
from acco.options import AUTO, AUTO_EVERY_BOUNDS, DEFAULT_OUTER_BITS, DEFAULT_SYNC_EVERY, LOCKSTEP, default_outer

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["AccoOptimizersContainer", "acco_adamw"]

# The base optimizers torchtitan's param_groups may name, as acco builds them on a shard.
# (DistMuon is refused: it orthogonalises whole matrices, which FSDP2 shards inside a group.)
_BASE_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}
# torchtitan's implementations that acco runs as they are on its shard (bf16 states are refused).
_IMPLEMENTATIONS = ("for-loop", "foreach", "fused")


class AccoOptimizersContainer(OptimizersContainer):
    """torchtitan's optimizer container, training with one :class:`~acco.AccoOptimizer`.

    Before :meth:`start` it is torchtitan's container (plain optimizers, never stepped: the
    LR schedules are built on them); afterwards it iterates over the AccoOptimizer alone,
    whose ``param_groups`` are theirs, and every call goes to acco:

    - ``step()`` ends the trainer step's update: in ``acco`` mode the commit round (and the
      estimate round, if :meth:`micro_batch` has not ended it); one round otherwise.
      Returns whether a committed update landed.
    - :meth:`micro_batch`: one micro-batch's backward, folded into acco's accumulator.
    - ``zero_grad()``: acco's (``p.grad`` stays None under acco).
    - ``state_dict()``: a pointer to acco's own checkpoint, which
      :class:`~acco.integrations.torchtitan.AccoCheckpointManager` writes beside
      torchtitan's in the same step folder (``acco/``; docs/torchtitan.md says why).

    Args:
        config: torchtitan's optimizer config plus acco's fields (:class:`Config`).
        model_parts: the model (one part: pipeline parallelism is refused).

    Raises:
        ValueError: an acco setting torchtitan cannot honour, before any collective.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        mode: Literal["acco", "dpu", "sync", "local"] = "acco"
        """acco's mode: 'acco' (estimate and commit rounds, overlapped), 'dpu' (one round
        stale, overlapped), 'sync' (ZeRO-1, blocking) or 'local' (inner steps on each replica
        group, an outer round every sync_every steps)."""

        max_grad_norm: float | None = None
        """Clip the averaged gradient to this global 2-norm on acco's comm lane; None:
        training.max_norm (torchtitan's own clipping would see local, unreduced gradients)."""

        nonfinite: Literal["raise", "skip"] = "raise"
        """NaN or inf in any rank's gradients: raise on every rank, or skip the update everywhere."""

        timeout_seconds: float = 600.0
        """Limit of each comm-lane collective and wait."""

        sync_every: int | Literal["auto"] = DEFAULT_SYNC_EVERY
        """mode='local': inner steps between outer rounds, or 'auto' (the default): chosen before
        each round from the measured inner step time and the round's own time, within
        sync_every_bounds, with when each round lands (blocking, or a step after its launch), so that
        waiting for rounds costs at most 4% of the time."""

        sync_every_bounds: tuple[int, int] = AUTO_EVERY_BOUNDS
        """mode='local' with sync_every='auto': the least and the most inner steps per round."""

        sync_delay: int | None = None
        """mode='local': inner steps from an outer round's launch to its landing (0: blocking
        DiLoCo); None (the default): with sync_every 'auto' chosen with H each round (blocking, or
        one step after the launch), else 0."""

        outer_bits: int = DEFAULT_OUTER_BITS
        """mode='local': bits per value an outer round sends (4, 8, 16 or 32; with outer_topk
        per value kept: 2, 4, 8, 16 or 32)."""

        outer_topk: float | None = None
        """mode='local': the share of each block of 4096 values an outer round sends, the
        largest (e.g. 0.015625 for 1/64); None (the default): every value."""

        outer_lr: float | None = None
        """mode='local': the outer SGD's learning rate (None: acco's default)."""

        outer_momentum: float | None = None
        """mode='local': its momentum, Nesterov's when above 0 (None: acco's default)."""

        elastic: bool = False
        """mode='local': this torchrun job is one replica group of an elastic job; torchft's
        lighthouse decides which groups take part in each outer round
        (:meth:`acco.elastic.TorchFT.connect`), and a group lost goes on without stopping the
        others (docs/torchtitan.md, "Elastic replica groups")."""

        lighthouse: str | None = None
        """elastic: the lighthouse's address (None: $TORCHFT_LIGHTHOUSE)."""

        hostname: str | None = None
        """elastic: this machine's address as the other groups reach it (None: its name)."""

        replica_group: int = 0
        """elastic: this job's index among the replica groups (its torchft replica id
        ``replica-<index>`` and its part of the data)."""

        replica_groups: int = 1
        """elastic: the replica groups of the job: the data is split into that many parts, and a
        fresh job's first outer round waits for them all."""

        min_replicas: int = 1
        """elastic: a round lands only with at least this many groups (torchft's ``min_replica_size``)."""

        quorum_timeout_seconds: float = 120.0
        """elastic: how long an outer round waits for torchft's quorum (longer than a group's
        inner steps of a round; below timeout_seconds)."""

        collective_timeout_seconds: float = 30.0
        """elastic: the most one collective between groups, or a commit vote, waits (a hung peer)."""

        def acco_kwargs(self) -> dict[str, Any]:
            """The AccoOptimizer keywords these fields give (checked by ``AccoOptimizer``'s own
            checks; the mode's own ones only in that mode, so every mode runs from one config)."""
            mode = Mode(self.mode)
            kwargs: dict[str, Any] = {"nonfinite": self.nonfinite,
                                      "timeout": datetime.timedelta(seconds=self.timeout_seconds)}
            if mode is Mode.LOCAL:
                # torchtitan's loop logs, checkpoints and validates with collectives at step
                # counts: every replica takes sync_every inner steps per outer round.
                every = self.sync_every
                if every == AUTO:
                    every = (AUTO, *self.sync_every_bounds)
                kwargs.update(sync_every=every, sync_delay=self.sync_delay, outer_bits=self.outer_bits,
                              outer_topk=self.outer_topk, pacing=LOCKSTEP)
                if self.outer_lr is not None or self.outer_momentum is not None:  # the rest from acco's default
                    outer = default_outer(self.sync_every, elastic=self.elastic).keywords
                    momentum = outer["momentum"] if self.outer_momentum is None else self.outer_momentum
                    kwargs["outer_optimizer"] = functools.partial(  # torch's SGD: Nesterov needs a momentum
                        torch.optim.SGD, nesterov=momentum > 0, momentum=momentum,
                        lr=outer["lr"] if self.outer_lr is None else self.outer_lr)
            return kwargs

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        check_container_config(config)
        if len(model_parts) != 1:
            raise ValueError(f"AccoOptimizersContainer trains one model part, not {len(model_parts)} "
                             "(pipeline parallelism is not supported)")
        super().__init__(config, model_parts=model_parts)
        if len(self.optimizers) != 1:
            names = sorted({type(o).__name__ for o in self.optimizers})
            raise ValueError(f"AccoOptimizersContainer needs every param group on one optimizer class, not {names}")
        # The plain optimizer the LR schedules are built on; acco takes over its param groups.
        self._plain = self.optimizers[0]
        self.mode = Mode(config.mode)
        self.max_grad_norm = config.max_grad_norm
        self._acco_kwargs = config.acco_kwargs()
        self._elastic = config if config.elastic else None
        self.membership: TorchFT | None = None
        self.acco: AccoOptimizer | None = None
        self._start: dict[str, Any] = {}
        self.update_rounds: UpdateRounds | None = None
        self._finished = False

    def start(self, *, process_group: ProcessGroup | None, micro_batches: int, max_norm: float,
              healed: dict[str, Stateful] | None = None) -> None:
        """Build the AccoOptimizer over the plain optimizer's param groups, across
        ``process_group`` (the mesh's replicate dimension), ``micro_batches`` (K) per update
        and rank, clipping to ``max_grad_norm`` or else ``max_norm`` (``training.max_norm``).

        With ``elastic`` it first connects this replica group to torchft's lighthouse
        (:meth:`acco.elastic.TorchFT.connect`); a group torchrun has restarted
        (``TORCHELASTIC_RESTART_COUNT`` > 0) must heal from a peer, and takes with acco's state
        the peer's ``healed`` states (the trainer's step, the LR schedules), so it steps in
        line with the others.

        .. warning:: Collective (acco's construction broadcasts rank 0's parameters; elastic:
            its first outer round): every rank calls it.
        """
        check_micro_batches(self.mode, micro_batches, "gradient accumulation steps (global_batch_size / "
                            "(local_batch_size x data-parallel degree))", "or --optimizer.mode dpu")
        plain = self._plain
        for group in plain.param_groups:
            # FQNs torchtitan records for its own checkpoints: acco's base optimizer sees a shard.
            group.pop("param_names", None)
        self._start = {"process_group": process_group, "micro_batches": micro_batches, "max_norm": max_norm}
        clip = self.max_grad_norm if self.max_grad_norm is not None else max_norm
        kwargs = dict(self._acco_kwargs)
        if self._elastic is not None:
            kwargs["membership"] = self.membership = _connect(self._elastic, healed or {})
        try:
            self.acco = acco_from_optimizer(plain, module=self.model_parts[0], mode=self.mode,
                                            max_grad_norm=float(clip) if clip else None,
                                            process_group=process_group, **kwargs)  # fmt: skip
        except BaseException:
            self._close_membership()
            raise
        self.update_rounds = UpdateRounds(self.acco.step, rounds_per_update(self.mode), micro_batches)
        self.optimizers = [self.acco]  # type: ignore[list-item]

    def restart_from_model(self) -> None:
        """Build the AccoOptimizer again from the model's parameters as they are now: after a
        model-only load before the first step (``checkpoint.initial_load_path``, Hugging Face
        weights, a seed checkpoint), which changed the parameters the master shards were read
        from (``sync`` and ``dpu`` mode reread theirs, ``acco`` and ``local`` mode keep their own).

        .. warning:: Collective (acco's construction): every rank calls it.
        """
        acco = self.require_acco()
        if acco.num_updates or acco.in_flight is not None or self._finished:
            raise RuntimeError("restart_from_model() before the first step only")
        if self._elastic is not None:
            raise RuntimeError("restart_from_model() with optimizer.elastic: refused by the trainer's checks")
        acco.close()
        self.acco = None
        self.start(healed=None, **self._start)

    def require_acco(self) -> AccoOptimizer:
        if self.acco is None:
            raise RuntimeError("AccoOptimizersContainer: start() builds the AccoOptimizer (AccoTrainer calls it)")
        return self.acco

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.optimizers)

    @contextmanager
    def micro_batch(self, weight: float | Tensor) -> Iterator[None]:
        """One micro-batch: its backward inside, folded into acco's accumulator with
        ``weight`` (the tokens its gradient is a mean over); in ``acco`` mode the estimate
        round ends after the first half of the step's micro-batches (collective then)."""
        acco = self.require_acco()
        with acco.micro_batch(weight):
            yield
        assert self.update_rounds is not None
        self.update_rounds.micro_batch_ended()

    def step(self, closure: Callable[[], float] | None = None) -> bool:  # type: ignore[override]
        """End the trainer step's update (collective). Returns whether a committed update
        landed (in ``acco`` and ``dpu`` mode the previous step's)."""
        if closure is not None:
            raise ValueError("AccoOptimizersContainer.step() takes no closure")
        self.require_acco()
        assert self.update_rounds is not None
        return self.update_rounds.end_update()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.acco is not None:
            self.acco.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """What torchtitan's checkpoint keeps under ``"optimizer"``: where acco's state is
        (``acco/`` in the same step folder, written by ``AccoCheckpointManager``)."""
        return {"acco_checkpoint": ACCO_CHECKPOINT_DIR}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing: ``AccoCheckpointManager`` reads acco's state from ``acco/`` once torchtitan's
        checkpoint is loaded."""

    @property
    def grad_norm(self) -> float:
        """The global gradient norm of the last landed round that measured one (acco's
        round telemetry), nan before."""
        if self.acco is not None:
            for stats in reversed(self.acco.round_stats):
                if stats.grad_norm is not None:
                    return float(stats.grad_norm)
        return float("nan")

    def eval(self) -> None:
        """The committed parameters into the model (``local`` mode: the global values)."""
        if self.acco is not None and not self._finished:
            self.acco.eval()

    def train(self) -> None:
        """The live parameters back, after :meth:`eval`."""
        if self.acco is not None and not self._finished:
            self.acco.train()

    def finish(self) -> None:
        """Land the last update: the model holds the last committed parameters (``local``: the
        same global values on every replica; elastic: on every group of the last round).
        Collective; idempotent."""
        if self.acco is not None and not self._finished:
            self._finished = True
            try:
                self.acco.finish()
            finally:
                self._close_membership()

    def close(self) -> None:
        """Stop acco with no collective (after an error); idempotent."""
        if self.acco is not None and not self._finished:
            self._finished = True
            try:
                self.acco.close()
            finally:
                self._close_membership()

    def _close_membership(self) -> None:
        if self.membership is not None:
            self.membership.close()
            self.membership = None


# Inside a step folder of torchtitan's checkpoint: acco's own DCP checkpoint (acco.checkpoint).
ACCO_CHECKPOINT_DIR = "acco"
# Set by torchrun in the processes it restarts (--max-restarts): how many times it has.
_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"


def _restarted() -> bool:
    """Whether torchrun has restarted this job (an elastic replica group that must heal)."""
    return int(os.environ.get(_RESTART_COUNT, "0") or 0) > 0


def _connect(config: AccoOptimizersContainer.Config, healed: dict[str, Stateful]) -> TorchFT:
    """This replica group's torchft membership (every rank of the job calls it), with the
    states a group that heals takes from its peer besides acco's."""
    again = _restarted()
    membership = TorchFT.connect(
        f"replica-{config.replica_group}", lighthouse=config.lighthouse, min_replicas=config.min_replicas,
        start_with=1 if again else config.replica_groups, must_heal=again,
        timeout=datetime.timedelta(seconds=config.collective_timeout_seconds),
        quorum_timeout=datetime.timedelta(seconds=config.quorum_timeout_seconds), hostname=config.hostname,
    )  # fmt: skip
    for name, state in healed.items():
        # torchft calls these when this group heals from a peer (before acco's first round).
        membership.manager.register_state_dict_fn(f"torchtitan.{name}", state.load_state_dict, state.state_dict)
    return membership


def check_container_config(config: AccoOptimizersContainer.Config) -> None:
    """``ValueError`` for an optimizer config acco cannot honour, naming the field; runs
    before any collective (``AccoTrainer`` calls it first)."""
    try:
        mode = Mode(config.mode)
    except ValueError:
        raise ValueError(f"Invalid optimizer.mode: {config.mode!r} ('acco', 'dpu', 'sync' or 'local')") from None
    if config.implementation not in _IMPLEMENTATIONS:
        raise ValueError(f"Invalid optimizer.implementation={config.implementation!r} for acco: one of "
                         f"{list(_IMPLEMENTATIONS)} (acco keeps its master shard and state in fp32)")
    for group in config.param_groups:
        if group.optimizer_name not in _BASE_OPTIMIZERS:
            raise ValueError(f"Invalid optimizer_name={group.optimizer_name!r} in param_groups (pattern "
                             f"{group.pattern!r}) for acco: one of {sorted(_BASE_OPTIMIZERS)}")
    if config.max_grad_norm is not None and config.max_grad_norm < 0:
        raise ValueError(f"Invalid optimizer.max_grad_norm: {config.max_grad_norm}")
    if config.timeout_seconds <= 0:
        raise ValueError(f"Invalid optimizer.timeout_seconds: {config.timeout_seconds}")
    membership = None
    if config.elastic:
        _check_elastic(config, mode)
        # What TorchFT.connect() will make, unconnected: acco checks it as it will check that one.
        membership = TorchFT(None, None, start_with=config.replica_groups)
        membership.quorum_timeout = datetime.timedelta(seconds=config.quorum_timeout_seconds)
    check_acco_kwargs(mode, config.acco_kwargs(), membership=membership)


def _check_elastic(config: AccoOptimizersContainer.Config, mode: Mode) -> None:
    if mode is not Mode.LOCAL:
        raise ValueError(f"Invalid optimizer.elastic with optimizer.mode={config.mode!r}: elastic replica groups "
                         "take part in local mode's outer rounds ('local')")
    if importlib.util.find_spec("torchft") is None:
        raise ValueError("Invalid optimizer.elastic: torchft is not installed (pip install 'acco[ft]')")
    if not isinstance(config.replica_groups, int) or config.replica_groups < 1:
        raise ValueError(f"Invalid optimizer.replica_groups: {config.replica_groups!r} (an int >= 1)")
    if not isinstance(config.replica_group, int) or not 0 <= config.replica_group < config.replica_groups:
        raise ValueError(f"Invalid optimizer.replica_group: {config.replica_group!r} (0 to replica_groups - 1 = "
                         f"{config.replica_groups - 1})")
    if not isinstance(config.min_replicas, int) or config.min_replicas < 1:
        raise ValueError(f"Invalid optimizer.min_replicas: {config.min_replicas!r} (an int >= 1)")
    for name in ("quorum_timeout_seconds", "collective_timeout_seconds"):
        if not getattr(config, name) > 0:
            raise ValueError(f"Invalid optimizer.{name}: {getattr(config, name)!r} (seconds, > 0)")


def acco_adamw(mode: str = "acco", lr: float = 8e-4, **kwargs: Any) -> AccoOptimizersContainer.Config:
    """torchtitan's ``default_adamw`` (one catch-all AdamW group: betas (0.9, 0.95), eps 1e-8,
    weight decay 0.1) as an :class:`AccoOptimizersContainer` config in ``mode``; ``kwargs``:
    the container's other fields."""
    from torchtitan.components.optimizer import default_adamw

    stock = default_adamw(lr=lr)
    return AccoOptimizersContainer.Config(param_groups=stock.param_groups, mode=mode, **kwargs)
