"""Lightning Fabric with acco: :class:`AccoFabricStrategy`.

Replace ``strategy="ddp"`` with ``strategy=AccoFabricStrategy(mode="acco", max_grad_norm=1.0)``
and make the loop's three changes (docs/lightning.md, "Fabric")::

    fabric = Fabric(accelerator="cpu", devices=2, strategy=AccoFabricStrategy(mode="acco", max_grad_norm=1.0))
    fabric.launch()
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=6e-4))
    for step, batch in enumerate(batches):
        with fabric.no_backward_sync(model, enabled=not end_of_round):   # a no-op: nothing syncs in backward
            fabric.backward(loss_fn(model, batch))      # 1. not divided by the micro-batches per round
        if end_of_round:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)   # 2. checked: acco clips on its lane
            optimizer.step()                            # the round boundary; True when an update landed
            optimizer.zero_grad()
    optimizer.finish()                                  # 3. land the last update (collective)

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
  consolidated on rank 0 (a round in flight and pending gradients included): a load into a fresh
  setup resumes exactly. The committed parameters (for export) are what ``optimizer.eval()``
  loads, or the model after ``optimizer.finish()``.

Refused with a ``ValueError`` before any collective: ``precision="16-mixed"``'s GradScaler,
precision plugins other than 32/64-bit, ``bf16-mixed`` and the ``-true`` half types, value
clipping, a ``max_norm`` other than ``max_grad_norm``.
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
from acco.integrations.schedules import acco_from_optimizer, check_acco_kwargs, check_precision
from acco.options import LOCKSTEP, parse_enum

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
            ``optimizer.step()`` is one round; ``acco`` commits every second round.
        max_grad_norm: clip the averaged gradient to this global norm (None: no clipping);
            ``fabric.clip_gradients`` must name the same value.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision,
            process_group_backend, timeout, start_method: as Fabric's ``DDPStrategy``'s.
        **acco_kwargs: further ``AccoOptimizer`` keywords, checked here.

    Raises:
        ValueError: an invalid mode or acco keyword, or a precision acco cannot honour.

    Example::

        >>> fabric = Fabric(devices=2, strategy=AccoFabricStrategy(mode="acco", max_grad_norm=1.0))
    """

    def __init__(
        self,
        mode: Mode | str = Mode.ACCO,
        *,
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
        if self.mode is Mode.LOCAL:
            self.acco_kwargs.setdefault("pacing", LOCKSTEP)
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision=precision, process_group_backend=process_group_backend,
            timeout=timeout, start_method=start_method,
        )  # fmt: skip
        self._backward_sync_control = _NothingToBlock()
        self._module: nn.Module | None = None
        self._acco: AccoOptimizer | None = None

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
        return self._acco

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[torch.optim.Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[torch.optim.Optimizer], Any]:
        module = self.setup_module(module)
        return module, [self.setup_optimizer(optimizer) for optimizer in optimizers], scheduler

    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """One micro-batch: its backward, folded into acco's accumulator as it runs."""
        with self._require_acco().micro_batch():
            super().backward(tensor, module, *args, **kwargs)

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

