"""Lightning Fabric with acco: :class:`AccoFabricStrategy`.

Replace ``strategy="ddp"`` with ``strategy=AccoFabricStrategy(mode="acco", accumulate_grad_batches=K,
max_grad_norm=1.0)`` and make the loop's three changes (docs/lightning.md, "Fabric")::

    fabric = Fabric(accelerator="cpu", devices=2,
                    strategy=AccoFabricStrategy(mode="acco", accumulate_grad_batches=K, max_grad_norm=1.0))
    fabric.launch()
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=6e-4))
    for step in range(steps):
        for micro in range(K):
            with fabric.no_backward_sync(model, enabled=micro < K - 1):   # a no-op: nothing syncs in backward
                fabric.backward(loss_fn(model, next(batches)))   # 1. not divided by K
        fabric.clip_gradients(model, optimizer, max_norm=1.0)   # 2. checked: acco clips on its lane
        optimizer.step()                                # one committed update; True when an update landed
        optimizer.zero_grad()
    optimizer.finish()                                  # 3. land the last update (collective)

One ``optimizer.step()`` is one committed update of this rank's K micro-batches in every
mode, as with DDP. In ``sync`` and ``dpu`` mode it is one round; in ``acco`` mode two
(:class:`~acco.integrations.schedules.UpdateRounds`): the estimate round ends inside
``fabric.backward`` after the first K/2 micro-batches, and the commit round at
``optimizer.step()`` (an update with fewer micro-batches ends both there). So ``acco`` mode
needs K (``accumulate_grad_batches``, even); a learning rate written into the param groups
before an update's first micro-batch applies to both of its rounds. In ``local`` mode a step
is one inner update of this replica.

What the strategy does:

- ``setup_module`` leaves the module unwrapped (no DDP: acco reduces the gradients itself);
- ``setup_optimizer`` turns the plain torch optimizer into an :class:`~acco.AccoOptimizer` over
  the same param groups and hyper-parameters, sharing its ``param_groups`` (an LR schedule
  built on it, or ``param_group["lr"] = ...`` as LitGPT writes, drives acco's). Through
  Fabric's optimizer wrapper ``step()`` is acco's round boundary and acco's own methods
  (``finish()``, ``eval()``, ``train()``, ``num_updates``) are reachable;
- ``backward`` ends a micro-batch (``AccoOptimizer.micro_batch()``); the update is the mean
  gradient over the micro-batches of all ranks, so the loss is not divided by their number;
- ``clip_gradients(max_norm=...)`` must name the strategy's ``max_grad_norm`` (acco clips the
  global averaged gradient on its comm lane) and returns the pre-clip norm of the last update
  that landed; value clipping is refused;
- ``no_backward_sync`` is a no-op;
- ``fabric.save`` / ``fabric.load`` hold the model's live parameters and acco's whole state,
  consolidated on rank 0 (a round in flight and pending gradients included): saved after an
  ``optimizer.step()`` and loaded into a fresh setup, it resumes exactly. The committed
  parameters (for export) are what ``optimizer.eval()`` loads, or the model after
  ``optimizer.finish()``.

Refused with a ``ValueError`` before any collective: ``mode="acco"`` without an even
``accumulate_grad_batches``, ``precision="16-mixed"``'s GradScaler, precision plugins other than
32/64-bit, ``bf16-mixed`` and the ``-true`` half types, value clipping, a ``max_norm`` other than
``max_grad_norm``.
"""

from __future__ import annotations

import contextlib
import datetime
import math
from typing import Any

import torch
from torch import Tensor, nn

try:
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
    from lightning.fabric.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
    from lightning.fabric.strategies import DDPStrategy
    from lightning.fabric.strategies.strategy import _BackwardSyncControl
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("acco.integrations.fabric needs lightning: pip install 'acco[lightning]'") from error

from acco import AccoOptimizer, Mode, RoundKind
from acco.integrations.schedules import (FRAMEWORK_PACING, UpdateRounds, acco_from_optimizer, check_acco_kwargs,
                                         check_micro_batches, check_precision, rounds_per_update)
from acco.options import parse_enum

__all__ = ["AccoFabricStrategy"]

_ACCEPTED_PRECISION = (Precision, MixedPrecision, HalfPrecision, DoublePrecision)


class _NothingToBlock(_BackwardSyncControl):
    """``fabric.no_backward_sync``: nothing is synchronised in backward with acco."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class AccoFabricStrategy(DDPStrategy):
    """A Fabric strategy that trains with :class:`~acco.AccoOptimizer`, without DDP.

    Args:
        mode: ``"acco"`` (default), ``"dpu"``, ``"sync"`` (ZeRO-1) or ``"local"``. One
            ``optimizer.step()`` is one committed update in each (``local``: an inner update).
        accumulate_grad_batches: K, the micro-batches (``fabric.backward`` calls) per rank of
            one update; required in ``acco`` mode, where it must be even (the estimate round
            ends after K/2 of them). Other modes: optional, one round per step whatever K.
        max_grad_norm: clip the averaged gradient to this global norm (None: no clipping);
            ``fabric.clip_gradients`` must name the same value.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision,
            process_group_backend, timeout, start_method: as Fabric's ``DDPStrategy``'s.
        **acco_kwargs: further ``AccoOptimizer`` keywords, checked here.

    Raises:
        ValueError: an invalid mode or acco keyword, ``accumulate_grad_batches`` missing or odd
            in ``acco`` mode, or a precision acco cannot honour.

    Example::

        >>> strategy = AccoFabricStrategy(mode="acco", accumulate_grad_batches=4, max_grad_norm=1.0)
        >>> fabric = Fabric(devices=2, strategy=strategy)
    """

    def __init__(
        self,
        mode: Mode | str = Mode.ACCO,
        *,
        accumulate_grad_batches: int | None = None,
        max_grad_norm: float | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: datetime.timedelta | None = default_pg_timeout,
        start_method: str = "popen",
        **acco_kwargs: Any,
    ) -> None:
        self.mode: Mode = parse_enum(Mode, mode, "mode")
        self.acco_kwargs = check_acco_kwargs(self.mode, acco_kwargs)
        if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
                                          or not max_grad_norm >= 0):
            raise ValueError(f"Invalid max_grad_norm: {max_grad_norm!r} (a number >= 0, or None)")
        self.max_grad_norm = float(max_grad_norm) if max_grad_norm else None
        self.rounds_per_update = rounds_per_update(self.mode)
        if accumulate_grad_batches is None and self.rounds_per_update > 1:
            raise ValueError(
                f"AccoFabricStrategy(mode={self.mode.value!r}) needs accumulate_grad_batches=K, the micro-batches "
                "(fabric.backward calls) per rank of one optimizer.step(): one step is one committed update, whose "
                "estimate round ends after K/2 of them; pass an even K, or use mode='dpu'"
            )
        if accumulate_grad_batches is not None:
            check_micro_batches(self.mode, accumulate_grad_batches, "accumulate_grad_batches", "or mode='dpu'")
        self.accumulate_grad_batches = 1 if accumulate_grad_batches is None else accumulate_grad_batches
        if self.mode is Mode.LOCAL:
            self.acco_kwargs.setdefault("pacing", FRAMEWORK_PACING)
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision=precision, process_group_backend=process_group_backend,
            timeout=timeout, start_method=start_method,
        )  # fmt: skip
        self._backward_sync_control = _NothingToBlock()
        self._module: nn.Module | None = None
        self._acco: AccoOptimizer | None = None
        self._update_rounds: UpdateRounds | None = None

    @property
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    def precision(self, precision: Precision | None) -> None:
        if precision is not None:
            check_precision(precision, _ACCEPTED_PRECISION)
        self._precision = precision

    @property
    def acco_optimizer(self) -> AccoOptimizer | None:
        """The AccoOptimizer (after ``setup_optimizers``; None before)."""
        return self._acco

    def setup_module(self, module: nn.Module) -> nn.Module:
        """The module itself: no DDP wrapper (acco broadcasts rank 0's parameters when the
        optimizer is set up, as DDP does here)."""
        self._module = module
        return module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> AccoOptimizer:
        """The :class:`AccoOptimizer` over ``optimizer``'s groups and hyper-parameters.

        .. warning:: Collective (acco's construction): every rank must call it.
        """
        if self._acco is not None:
            raise ValueError("AccoFabricStrategy trains one optimizer; setup_optimizers was called before")
        self._acco = acco_from_optimizer(optimizer, module=self._module, mode=self.mode,
                                         max_grad_norm=self.max_grad_norm, **self.acco_kwargs)
        self._update_rounds = UpdateRounds(self._acco.step, self.rounds_per_update, self.accumulate_grad_batches)
        return self._acco

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[torch.optim.Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[torch.optim.Optimizer], Any]:
        module = self.setup_module(module)
        return module, [self.setup_optimizer(optimizer) for optimizer in optimizers], scheduler

    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """One micro-batch: its backward, folded into acco's accumulator as it runs; in
        ``acco`` mode the estimate round ends after the first K/2 micro-batches of an update
        (collective)."""
        with self._require_acco().micro_batch():
            super().backward(tensor, module, *args, **kwargs)
        self._require_update_rounds().micro_batch_ended()

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> bool:
        """One committed update: the rounds of the update not ended yet, then its last
        (``AccoOptimizer.step()``, collective). True when an update landed meanwhile.

        Raises:
            TypeError: arguments for ``step()`` (a closure): acco's takes none.
        """
        if kwargs:
            raise TypeError(f"AccoOptimizer.step() takes no arguments (no closure); got {sorted(kwargs)}")
        return self._require_update_rounds().end_update()

    def clip_gradients_norm(self, module: nn.Module, optimizer: Any, max_norm: float | int,
                            norm_type: float | int = 2.0, error_if_nonfinite: bool = True) -> Tensor:
        """Checks that acco clips at ``max_norm`` (it clips the averaged gradient on its comm
        lane, before each update); returns the pre-clip norm of the last committed update
        (NaN before the first).

        Raises:
            ValueError: ``max_norm`` is not the strategy's ``max_grad_norm``, or ``norm_type`` is not 2.
        """
        if float(norm_type) != 2.0:
            raise ValueError(f"Invalid norm_type={norm_type!r} for acco: it clips the global 2-norm")
        if self.max_grad_norm is None or not math.isclose(float(max_norm), self.max_grad_norm):
            raise ValueError(
                f"Invalid clip_gradients(max_norm={max_norm}) with AccoFabricStrategy(max_grad_norm="
                f"{self.max_grad_norm}): acco clips the averaged gradient on its comm lane, at the norm the strategy "
                f"was given; pass AccoFabricStrategy(max_grad_norm={max_norm})"
            )
        norms = [s.grad_norm for s in self._require_acco().round_stats if s.kind is not RoundKind.ESTIMATE]
        return torch.tensor(norms[-1] if norms else math.nan)

    def clip_gradients_value(self, module: nn.Module, optimizer: Any, clip_val: float | int) -> None:
        raise ValueError(
            f"Invalid clip_gradients(clip_val={clip_val}) for acco: value clipping acts on one rank's whole gradient, "
            "which acco never holds; clip by norm with AccoFabricStrategy(max_grad_norm=...)"
        )

    def _require_acco(self) -> AccoOptimizer:
        if self._acco is None:
            raise RuntimeError("AccoFabricStrategy: set the optimizer up first (fabric.setup_optimizers)")
        return self._acco

    def _require_update_rounds(self) -> UpdateRounds:
        if self._update_rounds is None:
            raise RuntimeError("AccoFabricStrategy: set the optimizer up first (fabric.setup_optimizers)")
        return self._update_rounds

