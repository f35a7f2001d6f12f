"""The outer step split for ``overlap="estimate"``: a part every replica shares and a part
linear in the pseudo-gradient (docs/design.md, "The estimate rule").

torch's SGD with dampening 0 steps ``x`` with gradient ``g`` and momentum buffer ``m`` to::

    x' = x - lr * (a * (g + wd * x) + b * m)      a = 1 + momentum, b = momentum**2 (Nesterov)
                                                   a = 1,            b = momentum    (heavy ball)
       = common(x, m) - coefficient * g           common = x * (1 - lr * a * wd) - lr * b * m

(on its first step ``m`` is absent, which is ``m = 0``). Every replica starts the next round
from ``common - coefficient * Delta_r``, its own pseudo-gradient in place of the mean: their
mean is the outer step on the mean. An optimizer whose step is not linear in its gradient
(Adam, or SGD with dampening, whose first step differs from the others) has no such split:
:meth:`LinearOuterStep.of` refuses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["RECOVERY_FEEDBACK", "LinearOuterStep"]

# The most of a start offset the inner steps leave alone that the next estimate may feed back
# (coefficient x recovery): measured at equal inner steps with H = 8 (docs/loops.md), full
# recovery was best at coefficient 0.65 and diverged at 1.05, where half of it was best.
RECOVERY_FEEDBACK = 0.7


@dataclass(frozen=True)
class LinearOuterStep:
    """An SGD outer step as ``common(x, m) - coefficient * g``.

    Attributes:
        coefficient: what multiplies the gradient (``lr * a``).
        decay_factor: what multiplies ``x`` in the common part (``1 - lr * a * weight_decay``).
        momentum_coefficient: what multiplies the momentum buffer (``lr * b``).

    The hyper-parameters are the outer optimizer's at construction: a schedule that changes
    its lr later changes the commit, not the estimate (docs/design.md, "The estimate rule").
    """

    coefficient: float
    decay_factor: float
    momentum_coefficient: float

    @property
    def common_is_values(self) -> bool:
        """The common part is ``x`` itself (no momentum, no weight decay: plain averaging among
        them), so every rank's copy of the global values serves as it: no copy, no leg."""
        return self.decay_factor == 1.0 and self.momentum_coefficient == 0.0

    @property
    def recovery(self) -> float:
        """How much of a replica's own start offset (its last start minus the commit) its next
        estimate takes out of its pseudo-gradient, for a whole round of steps from that start:
        all of it (the inner steps undo an offset along the directions that matter), but never
        so much that the estimate feeds more than ``RECOVERY_FEEDBACK`` of an offset the steps
        did not undo back into the next start (docs/design.md, "The estimate rule")."""
        return min(1.0, RECOVERY_FEEDBACK / self.coefficient) if self.coefficient > 0 else 1.0

    @classmethod
    def of(cls, outer: torch.optim.Optimizer) -> LinearOuterStep:
        """The split of ``outer``'s step, from its first param group.

        Raises:
            ValueError: ``outer`` is not a torch.optim.SGD with dampening 0 and maximize off.
        """
        if not isinstance(outer, torch.optim.SGD):
            raise ValueError(
                f"overlap='estimate' needs an outer optimizer whose step is linear in its gradient (torch.optim.SGD, "
                f"with or without (Nesterov) momentum), got {type(outer).__name__}: use overlap='discard' or 'keep'"
            )
        group = outer.param_groups[0]
        if group.get("dampening", 0) or group.get("maximize", False):
            raise ValueError(
                f"overlap='estimate' needs SGD with dampening=0 and maximize=False as outer optimizer, got "
                f"dampening={group.get('dampening')}, maximize={group.get('maximize')} (its first step would differ "
                "from the others)"
            )
        lr, momentum, decay = float(group["lr"]), float(group["momentum"]), float(group["weight_decay"])
        nesterov = bool(group["nesterov"]) and momentum != 0
        a = 1.0 + momentum if nesterov else 1.0
        b = momentum * momentum if nesterov else momentum
        return cls(coefficient=lr * a, decay_factor=1.0 - lr * a * decay, momentum_coefficient=lr * b)

    def common(self, out: Tensor, x: Tensor, momenta: Sequence[Tensor | None], out_views: Sequence[Tensor]) -> Tensor:
        """``out = decay_factor * x - momentum_coefficient * m``: ``x`` flat, ``momenta`` the
        momentum buffers of the pieces ``out_views`` (views of ``out``) hold (None: none yet;
        none given: the common part before the first outer step)."""
        torch.mul(x, self.decay_factor, out=out)
        for view, momentum in zip(out_views, momenta):
            if momentum is not None:
                view.sub_(momentum.to(view.dtype), alpha=self.momentum_coefficient)
        return out

    def start(self, out: Tensor, common: Tensor, global_values: Tensor, params: Tensor, offset_weight: float = 0.0,
              rows: int = 1) -> Tensor:
        """A replica's start point, ``common - coefficient * (global_values - params - offset_weight
        * out)``, into ``out`` (flat, like the round's buffer; what it holds on entry is the offset,
        read only with a nonzero ``offset_weight``); ``params`` is read, not written. ``rows``:
        the pieces the difference is formed in (a temporary of one piece)."""
        if offset_weight:
            out.mul_(self.coefficient * offset_weight)
        else:
            out.zero_()
        for target, values, own, shared in zip(out.view(rows, -1), global_values.view(rows, -1), params.view(rows, -1),
                                               common.view(rows, -1)):  # fmt: skip
            target.sub_(torch.sub(values, own), alpha=self.coefficient).add_(shared)
        return out
