"""mode="local": inner steps on each replica, an outer round across replicas every ``sync_every``.

Each rank (each replica group, on a mesh) trains its own copy of the model with the inner
optimizer, a whole torch optimizer stepped on the training thread at every ``step()`` on this
replica's own gradients; no collective across replicas runs there. Every ``sync_every`` inner
steps an *outer round* starts on the comm lane (:class:`acco.runner.RoundRunner`, kind
``outer``): the replicas' parameters are reduce-scattered, each rank subtracts their mean from
its shard of the *snapshot* (the last global values, kept only as this rank's 1/R master
shard), steps that shard with the outer optimizer (its state 1/R too) and all-gathers the new
global values. ``sync_delay`` inner steps later the round *lands*: the replica takes the new
global values, and what it learnt meanwhile is dropped (``overlap="discard"``, the default)
or kept on top of them (``"keep"``). ``sync_delay=0`` is blocking DiLoCo. The recurrences:
docs/design.md, "Local steps".

:class:`InnerSteps` is the inner update; :class:`LocalClock` says when rounds launch and land.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from acco.folding import WeightSum
from acco.mesh import dtensor_like, is_dtensor
from acco.options import LocalOptions, NonFinite, Overlap, base_hyperparams
from acco.sharding import ShardedGroup

__all__ = ["InnerSteps", "LocalClock"]


class InnerSteps:
    """The inner optimizers (one per param group, on the live parameters) and the inner
    update: this replica's mean gradient from its accumulator, clipped over the replica,
    checked for NaN/inf, stepped.

    Args:
        param_groups: the optimizer's param groups (their hyper-parameters are read at each step).
        groups: their sharded buffers (the accumulators hold this replica's gradient sums).
        optimizer_class / defaults: the inner optimizer, as the base optimizer is given.
    """

    def __init__(
        self,
        param_groups: Sequence[dict[str, Any]],
        groups: Sequence[ShardedGroup],
        optimizer_class: type[torch.optim.Optimizer],
        defaults: dict[str, Any],
    ) -> None:
        self._param_groups = param_groups
        self._groups = list(groups)
        self.optimizers = []
        for group in param_groups:
            cls = group["optimizer_class"]
            kwargs = defaults if cls is optimizer_class else {}
            self.optimizers.append(cls([{**base_hyperparams(group), "params": group["params"]}], **kwargs))

    def step(self, weights: WeightSum, max_grad_norm: float | None, nonfinite: NonFinite, step: int) -> tuple[bool, bool]:
        """One inner update from the accumulators (zeroed after); returns whether it was
        applied, and whether it was skipped for NaN/inf (neither: no micro-batch).

        Raises:
            ValueError: invalid weights. FloatingPointError: NaN or inf in the gradients with
            ``nonfinite="raise"`` (nothing updated; the accumulators hold the gradient sums
            again, up to the rounding of dividing and multiplying by the weight).
        """
        total = weights.total()
        if weights.device is not None and float(weights.device[1]):
            raise ValueError(f"accumulate() got {int(weights.device[1])} invalid weight(s) (negative, NaN or inf)")
        if total == 0:
            self._zero_accumulators()
            return False, False
        params, grads = [], []
        for group in self._groups:
            group.grad_accumulator.div_(total)
            for param, view in zip(group.params, group.accumulator_views()):
                param.grad = dtensor_like(view, param) if is_dtensor(param) else view
                params.append(param)
                grads.append(param.grad)
        try:
            norm = torch.nn.utils.get_total_norm(grads)
            if is_dtensor(norm):  # a replica's DTensor gradients: the norm over the replica group
                norm = norm.full_tensor()
            if not math.isfinite(float(norm)):
                if nonfinite is NonFinite.RAISE:
                    for group in self._groups:
                        group.grad_accumulator.mul_(total)  # back to the sums accumulated
                    raise FloatingPointError(f"non-finite gradients in inner step {step} on this replica")
                self._zero_accumulators()
                return False, True
            if max_grad_norm is not None:
                torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, norm)
            for optimizer, group in zip(self.optimizers, self._param_groups):
                optimizer.param_groups[0].update(base_hyperparams(group))
                optimizer.step()
            self._zero_accumulators()
            return True, False
        finally:
            for param in params:
                param.grad = None

    def _zero_accumulators(self) -> None:
        for group in self._groups:
            group.grad_accumulator.zero_()

    def state_dicts(self) -> list[dict[str, Any]]:
        return [optimizer.state_dict() for optimizer in self.optimizers]

    def load_state_dicts(self, saved: Sequence[dict[str, Any]]) -> None:
        for optimizer, state in zip(self.optimizers, saved):
            optimizer.load_state_dict(state)


@dataclass
class LocalClock:
    """When outer rounds launch and land, counted in inner steps (the same on every rank:
    every rank calls ``step()`` once per inner step, update or not).

    Attributes:
        options: ``sync_every``, ``sync_delay``, ``overlap``.
        inner_steps: ``step()`` calls so far.
        launched_at: the inner step the round in flight was launched after (None: none).
        unsynced: the live parameters hold progress that no outer round has carried yet.
        outer_rounds / skipped_outer_rounds: landed outer rounds, and those that changed
            nothing (NaN/inf in some replica's parameters with ``nonfinite="skip"``).
        handed_over: per param group, the parameters the round in flight was handed
            (``overlap="keep"`` with a delay: what the landing subtracts), or None.
        global_in_buffer: the rounds' buffers still hold the global values last landed.
    """

    options: LocalOptions
    inner_steps: int = 0
    launched_at: int | None = None
    unsynced: bool = False
    outer_rounds: int = 0
    skipped_outer_rounds: int = 0
    handed_over: list[Tensor] | None = field(default=None, repr=False)
    global_in_buffer: bool = False  # the round's buffer holds the last landed global values

    def lands_now(self) -> bool:
        """The round in flight lands at the end of this inner step."""
        return self.lands_after(self.inner_steps)

    def lands_after(self, steps: int) -> bool:
        """Whether the round in flight lands once ``steps`` inner steps are done."""
        return self.launched_at is not None and steps - self.launched_at >= self.options.sync_delay

    def launches_now(self) -> bool:
        return self.inner_steps % self.options.sync_every == 0

    @property
    def keeps_progress(self) -> bool:
        """Whether a landing adds the progress made since the launch to the new global values."""
        return self.options.overlap is Overlap.KEEP and self.options.sync_delay > 0

    def state_dict(self) -> dict[str, Any]:
        """The counters (``handed_over`` is the optimizer's to save, per parameter)."""
        return {
            "inner_steps": self.inner_steps,
            "launched_at": self.launched_at,
            "unsynced": self.unsynced,
            "outer_rounds": self.outer_rounds,
            "skipped_outer_rounds": self.skipped_outer_rounds,
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.inner_steps, self.launched_at = int(saved["inner_steps"]), saved["launched_at"]
        self.unsynced = bool(saved["unsynced"])
        self.outer_rounds, self.skipped_outer_rounds = int(saved["outer_rounds"]), int(saved["skipped_outer_rounds"])
