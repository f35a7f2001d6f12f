"""LR schedules that follow committed updates, and a torch optimizer turned into an
:class:`~acco.AccoOptimizer` (shared by the framework integrations; no framework import).

- :class:`CommitScheduler`: steps a schedule once per committed update, however often the
  framework calls ``step()`` (once per round in Lightning, once per update in the Hugging
  Face Trainer).
- :func:`acco_from_optimizer`: the ``AccoOptimizer`` over the param groups and
  hyper-parameters of a plain torch optimizer a user built (Lightning's
  ``configure_optimizers``, a Fabric script), sharing those groups so that schedules built on
  the user's optimizer drive acco's.
- :func:`check_acco_kwargs`, :func:`check_precision`, :func:`require_lockstep`: the checks a
  strategy or trainer runs before any collective.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from acco import AccoOptimizer, Mode
from acco.options import LOCKSTEP, Options

__all__ = ["CommitScheduler", "acco_from_optimizer", "check_acco_kwargs", "check_precision", "require_lockstep"]

_ACCO_SIGNATURE = inspect.signature(AccoOptimizer.__init__).parameters
# AccoOptimizer keywords the strategy sets itself: the mode, the clip (gradient_clip_val), the
# model, its process group (the world, or the mesh's replicate dimension).
_SET_BY_STRATEGY = ("params", "optimizer_class", "mode", "max_grad_norm", "module", "process_group", "membership")
_ACCO_KWARGS = tuple(
    name for name, p in _ACCO_SIGNATURE.items() if p.kind is p.KEYWORD_ONLY and name not in _SET_BY_STRATEGY
)

# What torch.optim.lr_scheduler warns when the optimizer it was built on is never stepped
# (acco steps in its place): true here and harmless.
_NEVER_STEPPED = r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"


class CommitScheduler:
    """Steps an LR schedule once per committed update of an :class:`AccoOptimizer`.

    Frameworks call ``lr_scheduler.step()`` after every ``optimizer.step()``; this one
    advances the wrapped schedule only up to ``optimizer.num_updates``, so estimate rounds
    and skipped updates do not move it, and calling it twice for one update is harmless.
    Called right after the ``step()`` that landed a commit, this is the order of ``if
    opt.step(): scheduler.step()``: every commit is handed over with the learning rate a
    synchronous run would use for it.

    Args:
        scheduler: the schedule to follow, built on ``optimizer`` (or on an optimizer whose
            param groups it shares: :func:`acco_from_optimizer`), counting updates.
        optimizer: the AccoOptimizer whose committed updates drive it.

    Example::

        >>> schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
        >>> scheduler = CommitScheduler(schedule, opt)
        >>> opt.step(); scheduler.step()  # advances only if step() committed
    """

    def __init__(self, scheduler: Any, optimizer: AccoOptimizer) -> None:
        self.scheduler = scheduler
        self.optimizer = optimizer
        self.updates = 0  # committed updates the schedule has stepped for

    def step(self, *args: Any, **kwargs: Any) -> None:
        while self.updates < self.optimizer.num_updates:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_NEVER_STEPPED, category=UserWarning)
                self.scheduler.step(*args, **kwargs)
            self.updates += 1

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    @property
    def last_epoch(self) -> int:
        return self.scheduler.last_epoch

    def state_dict(self) -> dict[str, Any]:
        """``{"scheduler": the wrapped schedule's state dict, "updates": int}``."""
        return {"scheduler": self.scheduler.state_dict(), "updates": self.updates}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict["scheduler"])
        self.updates = int(state_dict["updates"])


def acco_from_optimizer(
    optimizer: torch.optim.Optimizer,
    *,
    module: nn.Module | None = None,
    acco_class: type[AccoOptimizer] = AccoOptimizer,
    **acco_kwargs: Any,
) -> AccoOptimizer:
    """An :class:`AccoOptimizer` over ``optimizer``'s param groups, with its class and
    hyper-parameters as the base optimizer.

    ``optimizer`` is never stepped: its ``param_groups`` become the AccoOptimizer's, so an LR
    schedule built on it, or code that sets ``param_group["lr"]`` on it, drives acco's
    learning rate. It must be fresh (no state yet).

    Args:
        optimizer: a plain ``torch.optim.Optimizer`` (AdamW, SGD, ...), built on the model's
            parameters, with any param groups.
        module: the model (its buffers stay identical across ranks).
        acco_class: ``AccoOptimizer`` or a subclass of it (Lightning's steps with a closure).
        **acco_kwargs: ``AccoOptimizer`` keywords (``mode``, ``max_grad_norm``, ...).

    Raises:
        ValueError: ``optimizer`` is not a ``torch.optim.Optimizer`` (an AccoOptimizer, a
            wrapper, LBFGS that needs a closure), or has state already.

    .. warning:: Collective (the AccoOptimizer's construction): every rank must call it.
    """
    cls = type(optimizer)
    if isinstance(optimizer, AccoOptimizer):
        raise ValueError("Invalid optimizer: already an AccoOptimizer; return the plain torch optimizer")
    if not isinstance(optimizer, torch.optim.Optimizer) or cls.__module__.startswith("torch.distributed"):
        raise ValueError(
            f"Invalid optimizer {cls.__qualname__}: acco shards a plain torch.optim.Optimizer subclass "
            "(AdamW, SGD, ...), not a wrapper of one"
        )
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("Invalid optimizer LBFGS: it re-evaluates a closure inside step(), which acco cannot shard")
    if any(optimizer.state.values()):
        raise ValueError(f"Invalid optimizer {cls.__qualname__}: it has state already; pass a fresh one")
    accepted = inspect.signature(cls.__init__).parameters
    # Defaults the constructor does not take (AdamW's decoupled_weight_decay) are set by it.
    defaults = {name: value for name, value in optimizer.defaults.items() if name in accepted and name != "params"}
    groups = [dict(group) for group in optimizer.param_groups]
    acco = acco_class(groups, cls, module=module, **acco_kwargs, **defaults)
    optimizer.param_groups = acco.param_groups  # schedules built on it now drive acco's groups
    return acco


def check_acco_kwargs(mode: Mode, acco_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """AccoOptimizer's own checks of the keywords a strategy passes on (``ValueError`` /
    ``TypeError`` naming the bad value), run when the strategy is made, long before the
    optimizer exists. Returns them as a dict."""
    kwargs = dict(acco_kwargs)
    unknown = sorted(set(kwargs) - set(_ACCO_KWARGS))
    if unknown:
        raise ValueError(
            f"Invalid acco keywords {unknown}: the strategy passes {list(_ACCO_KWARGS)}; the mode is its own "
            "argument, max_grad_norm comes from gradient clipping, the base optimizer from your code"
        )
    checked = inspect.signature(Options.check).parameters
    given = {name: p.default for name, p in _ACCO_SIGNATURE.items() if p.kind is p.KEYWORD_ONLY}
    Options.check(**{name: v for name, v in {**given, **kwargs, "mode": mode}.items() if name in checked})
    return kwargs


def check_precision(plugin: Any, accepted: tuple[type, ...]) -> None:
    """``ValueError`` for a precision plugin acco cannot honour; ``accepted``: the framework's
    plugin classes whose work acco leaves intact (Lightning's Trainer and Fabric each have
    theirs).

    Raises:
        ValueError: a GradScaler (``16-mixed``) or a plugin other than 32/64-bit,
            ``bf16-mixed`` and the ``-true`` half types.
    """
    name = getattr(plugin, "precision", type(plugin).__name__)
    if getattr(plugin, "scaler", None) is not None:
        raise ValueError(
            f"Invalid precision {name!r} for acco: its GradScaler unscales each rank's p.grad to clip and skips "
            "steps on overflow, while acco's gradients live in its accumulator and are unscaled and clipped on its "
            "comm lane; use precision='bf16-mixed' (no scaler needed)"
        )
    if type(plugin) not in accepted:
        raise ValueError(
            f"Invalid precision plugin {type(plugin).__qualname__} ({name!r}) for acco: it accepts '32-true', "
            "'64-true', 'bf16-mixed', 'bf16-true' and '16-true'"
        )


def require_lockstep(acco_kwargs: dict[str, Any], refusal: str) -> None:
    """``mode="local"`` under a framework whose loop runs collectives at step counts (logging,
    evaluation, checkpoints, epoch ends): ``pacing`` in lockstep, the default set here.

    Raises:
        ValueError: ``refusal`` formatted with ``pacing``, for any pacing that gives replicas
            different numbers of inner steps.
    """
    pacing = acco_kwargs.setdefault("pacing", LOCKSTEP)
    if pacing != LOCKSTEP and not (isinstance(pacing, (list, tuple)) and len(set(pacing)) == 1):
        raise ValueError(refusal.format(pacing=pacing))
