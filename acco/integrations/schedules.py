"""LR schedules that follow committed updates, and a torch optimizer turned into an
:class:`~acco.AccoOptimizer` (shared by the framework integrations; no framework import).

- :class:`CommitScheduler`: steps a schedule once per committed update that lands, however
  often the framework calls ``step()`` (the Hugging Face Trainer's).
- :class:`HandOverScheduler`: steps a schedule at each call, as the framework makes it once
  per step, which is one update handed to acco (Lightning's Trainer).
- :func:`rounds_per_update`, :func:`round_ends`, :class:`UpdateRounds`: a framework step is
  one committed update of K micro-batches per rank in every mode (the Hugging Face Trainer,
  Lightning's Trainer, Fabric); in ``acco`` mode that update is two rounds, the estimate
  round ending after the first K/2 micro-batches and the commit round at the step.
- :func:`acco_from_optimizer`: the ``AccoOptimizer`` over the param groups and
  hyper-parameters of a plain torch optimizer a user built (Lightning's
  ``configure_optimizers``, a Fabric script), sharing those groups so that schedules built on
  the user's optimizer drive acco's.
- :func:`check_acco_kwargs`, :func:`check_micro_batches`, :func:`check_precision`,
  :func:`require_lockstep`: the checks a strategy or trainer runs before any collective.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from acco import AccoOptimizer, Mode
from acco.optim import LOOPS
from acco.options import LOCKSTEP, Options

# mode="local" under a framework's Trainer: its logging, evaluation and checkpoints run collectives
# at step counts, which meet every replica only when replicas take equal steps.
FRAMEWORK_PACING = LOCKSTEP

__all__ = ["FRAMEWORK_PACING", "CommitScheduler", "HandOverScheduler", "UpdateRounds", "acco_from_optimizer", "check_acco_kwargs", "check_micro_batches",
           "check_precision", "require_lockstep", "round_ends", "rounds_per_update"]

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
            _step_quietly(self.scheduler, *args, **kwargs)
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


class HandOverScheduler:
    """An LR schedule built on an optimizer that acco replaced, stepped at each call: the
    framework steps it once per step, and each step hands one update to acco with the
    learning rate a synchronous run uses for it (in ``acco`` and ``dpu`` mode the update then
    lands during the next step). Its state is the schedule's own, so a checkpoint holds what
    it would without acco.

    Only silences the warning torch gives at a schedule's first step when the optimizer it
    was built on was never stepped (:func:`acco_from_optimizer`: acco steps in its place);
    every other attribute is the schedule's.

    Args:
        scheduler: the schedule (``torch.optim.lr_scheduler``), built on the user's optimizer.
    """

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        _step_quietly(self.scheduler, *args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.scheduler, name)


def _step_quietly(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NEVER_STEPPED, category=UserWarning)
        scheduler.step(*args, **kwargs)


def rounds_per_update(mode: Mode) -> int:
    """The rounds (``step()`` calls) one committed update spans when a framework step is one
    update: 2 in ``acco`` mode (the estimate round, then the commit round, which applies both
    rounds' gradients), 1 in the others (``local``: one inner update). Read from the mode's
    loop (``Loop.rounds_per_update``), before any optimizer exists."""
    return LOOPS[mode].rounds_per_update


def round_ends(rounds: int, micro_batches: int) -> tuple[int, ...]:
    """After which of an update's micro-batches (counted from 1) the rounds before its last
    end; the last ends at the framework's step.

    The micro-batches are split as evenly as they go, an earlier round taking the larger
    share: ``acco`` mode's estimate round ends after ``ceil(n/2)`` of ``n`` (K/2 of an even
    K; 1 of 1, the commit round then computing none). One round: ``()``.
    """
    return tuple(-(-micro_batches * i // rounds) for i in range(1, rounds))


class UpdateRounds:
    """Ends the rounds of each committed update for a framework whose step is one update of
    K micro-batches per rank (Lightning's Trainer and Fabric; the Hugging Face Trainer applies
    :func:`round_ends` to the micro-batches it has fetched).

    The rounds before an update's last end inside it, each after its share of the update's
    micro-batches (:func:`round_ends`: ``acco`` mode's estimate round after the first K/2);
    the last ends at the framework's step. An update shorter than announced (a window cut
    short) ends the rounds it has not reached at the step, one after the other. The state
    lives between two steps only: checkpoints taken at a step boundary need none of it.

    Args:
        end_round: the round boundary (``AccoOptimizer.step``, collective).
        rounds: the rounds one update spans (:func:`rounds_per_update`).
        micro_batches: K, this rank's micro-batches per update (:meth:`expect` announces a
            shorter update).

    Example::

        >>> rounds = UpdateRounds(opt.step, rounds_per_update(opt.mode), micro_batches=4)
        >>> for micro in range(4):
        ...     with opt.micro_batch():
        ...         loss_fn(model, next(batches)).backward()
        ...     rounds.micro_batch_ended()    # acco: the estimate round ends after the 2nd
        >>> rounds.end_update()               # the commit round; True if an update landed
    """

    def __init__(self, end_round: Callable[[], bool], rounds: int, micro_batches: int) -> None:
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"Invalid micro_batches: {micro_batches!r} (a positive int)")
        self._end_round = end_round
        self.rounds = rounds
        self.micro_batches = micro_batches
        self._ends = round_ends(rounds, micro_batches)  # of the update under way
        self._seen = 0  # micro-batches of the update under way
        self._ended = 0  # its rounds ended so far (the last excepted)
        self._committed = False  # one of them landed a committed update

    def expect(self, micro_batches: int) -> None:
        """The update starting now has ``micro_batches`` instead of K (an epoch's last window,
        cut short; a K that Lightning's ``GradientAccumulationScheduler`` changed); call
        before its first micro-batch."""
        self._ends = round_ends(self.rounds, micro_batches)

    def micro_batch_ended(self) -> None:
        """After each micro-batch (its gradients accumulated): ends the round whose share of
        the update it completes.

        .. warning:: Collective where it ends a round: every rank calls it at the same
            micro-batches of an update.
        """
        self._seen += 1
        self._end_rounds(through=self._seen)

    def end_update(self) -> bool:
        """The framework's step: the rounds of the update not ended yet, then its last.

        Returns:
            True when one of them landed a committed update (in ``acco`` and ``dpu`` mode
            the previous update, which the comm lane applied meanwhile).

        .. warning:: Collective: every rank calls it once per update.
        """
        self._end_rounds(through=None)
        committed = self._end_round()
        committed = committed or self._committed
        self._ends = round_ends(self.rounds, self.micro_batches)
        self._seen, self._ended, self._committed = 0, 0, False
        return committed

    def _end_rounds(self, through: int | None) -> None:
        """End the rounds due after ``through`` micro-batches (None: all but the last)."""
        while self._ended < len(self._ends) and (through is None or self._ends[self._ended] <= through):
            self._ended += 1
            if self._end_round():
                self._committed = True


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


def check_acco_kwargs(mode: Mode, acco_kwargs: Mapping[str, Any], *, membership: Any = None) -> dict[str, Any]:
    """AccoOptimizer's own checks of the keywords a strategy passes on (``ValueError`` /
    ``TypeError`` naming the bad value), run when the strategy is made, long before the
    optimizer exists, with the ``membership`` the strategy will pass (unconnected: what
    ``mode="local"`` asks of elastic rounds is checked too). Returns them as a dict."""
    kwargs = dict(acco_kwargs)
    unknown = sorted(set(kwargs) - set(_ACCO_KWARGS))
    if unknown:
        raise ValueError(
            f"Invalid acco keywords {unknown}: the strategy passes {list(_ACCO_KWARGS)}; the mode is its own "
            "argument, max_grad_norm comes from gradient clipping, the base optimizer from your code"
        )
    checked = inspect.signature(Options.check).parameters
    given = {name: p.default for name, p in _ACCO_SIGNATURE.items() if p.kind is p.KEYWORD_ONLY}
    every = {**given, **kwargs, "mode": mode, "membership": membership}
    Options.check(**{name: v for name, v in every.items() if name in checked})
    return kwargs


def check_micro_batches(mode: Mode, micro_batches: int, setting: str, fix: str) -> None:
    """``ValueError`` unless ``micro_batches`` (K, per rank per committed update) splits into
    the rounds of one update in ``mode``: an even K in ``acco`` mode (its estimate round and
    its commit round take K/2 each), any positive K otherwise.

    Args:
        setting: the framework's name for K (``accumulate_grad_batches``, ...), in the message.
        fix: what else to change (ends the message, after the even K).
    """
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"Invalid {setting}={micro_batches!r}: a positive int")
    rounds = rounds_per_update(mode)
    if micro_batches % rounds:
        raise ValueError(
            f"Invalid {setting}={micro_batches} for mode={mode.value!r}: one step is one committed update of "
            f"K={micro_batches} micro-batches per rank, in {mode.value} mode an estimate round and then a commit round "
            f"of K/{rounds} each, so K must be even: use {setting}={micro_batches + rounds - micro_batches % rounds}, "
            f"{fix}"
        )


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
    pacing = acco_kwargs.setdefault("pacing", FRAMEWORK_PACING)
    if pacing != LOCKSTEP and not (isinstance(pacing, (list, tuple)) and len(set(pacing)) == 1):
        raise ValueError(refusal.format(pacing=pacing))
