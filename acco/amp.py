"""torch.amp.GradScaler driving an AccoOptimizer (fp16 training on V100s and T4s).

:class:`~acco.AccoOptimizer` sets ``_step_supports_amp_scaling``, torch's contract for an
optimizer that unscales its own gradients: ``scaler.step(opt)`` then never touches
``p.grad`` (which is acco's accumulator, or nothing), always calls ``opt.step()`` (so every
rank reaches the round boundary, overflow or not) and sets two attributes for that call:
``grad_scale``, the scale the round's gradients carry, and ``found_inf``, this rank's scan
of ``p.grad`` (which ``scaler.update()`` reads to back the scale off).

acco hands the round the inverse of that scale: the comm lane multiplies this rank's
gradients by it before they are summed across ranks, so each rank's gradients are unscaled
exactly once and by their own scale (a rank's scaler follows its own gradients: after an
overflow on one rank, only that rank's scale backs off), and a power-of-two scale makes the
result bit for bit the run without a scaler. NaN or inf on any rank skips that update on
every rank (``nonfinite="skip"`` for the round), as GradScaler skips ``step()``.

``acco`` mode refuses it (its loop's ``grad_scaler_refusal``, :mod:`acco.loops`): a commit round sums the estimate round's gradients, kept in the
accumulator, and its own, and the scale may change between the two (``scaler.update()``
grows it every ``growth_interval`` steps), so the sum could not be unscaled exactly.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

__all__ = ["inverse_scale"]


def inverse_scale(optimizer: Any, refusal: str | None, holds_grad_views: bool) -> Tensor | None:
    """The inverse of the GradScaler scale of the round ``step()`` is ending, on the
    scale's device (no host synchronisation), or None without a GradScaler.

    Args:
        optimizer: the optimizer ``scaler.step()`` set ``found_inf`` and ``grad_scale`` on.
        refusal: why the optimizer's loop cannot take a GradScaler (its
            ``grad_scaler_refusal``: acco and local mode), or None.
        holds_grad_views: ``p.grad`` holds the gradients GradScaler scanned.

    Raises:
        ValueError: the loop refuses a GradScaler; after ``scaler.unscale_(opt)``; or where
            ``p.grad`` holds no gradient for GradScaler's overflow scan (weighted
            micro-batches, a ``reduce_dtype`` other than the parameters', DTensor
            parameters). Raised before anything is landed or launched.
    """
    found_inf = getattr(optimizer, "found_inf", None)
    if found_inf is None:
        return None
    if refusal is not None:
        raise ValueError(refusal)
    grad_scale = getattr(optimizer, "grad_scale", None)
    if grad_scale is None:
        raise ValueError(
            "scaler.unscale_(opt) before scaler.step(opt): acco unscales the gradients itself on the comm "
            "lane; drop the unscale_ call and clip with AccoOptimizer(max_grad_norm=...)"
        )
    if not isinstance(found_inf, Tensor) or not holds_grad_views:
        raise ValueError(
            "torch.amp.GradScaler found no p.grad to scan for overflow: acco folded the gradients away "
            "(weighted micro-batches, micro_batch() blocks, a reduce_dtype other than the parameters', or "
            "DTensor parameters). GradScaler works with equal-weight accumulate() calls only"
        )
    # 0-dim: a 1-element tensor would be broadcast, a slower pass over the gradients on CPU.
    return grad_scale.double().reciprocal().float().reshape(())
