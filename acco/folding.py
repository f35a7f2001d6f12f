"""Folding micro-batch gradients into the accumulator, and the weights they count with.

The compute lane's side of a round (docs/design.md, "Folding and weights"). A micro-batch's
gradient reaches the accumulator in one of three ways, chosen by the *fold policy*:

- equal weights (the first ``accumulate()`` had no weight): ``p.grad`` is a view of its
  slot of the accumulator, so autograd adds into it in place and no gradient copy exists;
  where the dtypes forbid a view (``reduce_dtype`` differs from the parameters') a
  post-accumulate-grad hook folds each gradient as soon as backward produces it;
- weights given after backward (``accumulate(weight=w)``): ``p.grad`` is kept until
  ``accumulate()`` scales and folds it;
- a ``micro_batch(weight)`` block: the hooks fold every gradient at the block's weight.

:class:`GradFolder` owns all of it: the hooks, the views, the policy and the checks that a
gradient is never lost (un-accumulated ``p.grad`` at ``step()``, ``zero_grad()`` after a
fold). :class:`WeightSum` is a sum of weights; :func:`checked_weight` validates one.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.profiler import record_function

from acco.sharding import ShardedGroup
from acco.mesh import is_dtensor

__all__ = ["GradFolder", "WeightSum", "checked_weight", "fold_grads"]


@dataclass
class WeightSum:
    """A sum of ``accumulate()`` weights and the number of micro-batches in it.

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

    def copy(self) -> WeightSum:
        return WeightSum(self.host, self.device, self.micro_batches)

    def total(self) -> float:
        """The sum on the host (waits for the device part, if any)."""
        return self.host + (0.0 if self.device is None else float(self.device[0]))


def checked_weight(weight: Any) -> float | Tensor:
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


def _same_weight(a: float | Tensor, b: float | Tensor) -> bool:
    """Whether two weights are known equal without reading a device tensor on the host."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return a is b
    return a == b


def _same_memory(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` is ``b`` or ``b``'s memory (a gradient view of the accumulator)."""
    if a is b:
        return True  # also an empty view, whose memory cannot be told apart
    if is_dtensor(a):
        return False  # a DTensor's gradient is FSDP2's or autograd's, never acco's view
    if a.is_sparse or a.numel() == 0:
        return False  # empty tensors may all share one null pointer
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype


def _scale_for(grad: Tensor, weight: Tensor) -> Tensor:
    """A device weight in the dtype to scale ``grad`` by: at least fp32, so a bf16 gradient
    is not multiplied by a rounded weight."""
    return weight.to(torch.promote_types(grad.dtype, torch.float32))


class GradFolder:
    """Moves each micro-batch's gradients into the groups' accumulators, weighted.

    Args:
        groups: the param groups' buffers (their ``accumulator_views()`` are the targets).
        count: called with each finished micro-batch's weight (the round's weight sums).
    """

    def __init__(self, groups: Sequence[ShardedGroup], count: Callable[[float | Tensor], None]) -> None:
        self._groups = list(groups)
        self._count = count
        # The fold policy: the weight the hooks fold at during backward(); None leaves p.grad
        # for accumulate() (weights given after backward, or not decided yet).
        self._fold_weight: float | Tensor | None = None
        self._decided = False
        self._folded: float | Tensor | None = None  # the weight this micro-batch was folded at
        self._in_block = False
        self._torn = False  # a block raised after folding part of its gradients
        self._views = [False] * len(self._groups)  # whether p.grad is the accumulator's view
        self._closed = False
        ref = weakref.ref(self)
        self._hook_handles = [
            param.register_post_accumulate_grad_hook(functools.partial(_fold_hook, ref, g, i))
            for g, group in enumerate(self._groups)
            for i, param in enumerate(group.params)
        ]
        weakref.finalize(self, _remove_handles, self._hook_handles)

    # ------------------------------------------------------------------ micro-batches

    def accumulate(self, weight: float | Tensor, explicit: bool) -> None:
        """End a micro-batch (``explicit``: the caller gave its weight); see
        :meth:`acco.AccoOptimizer.accumulate`."""
        self._end_micro_batch(weight, explicit)
        if not self._decided:
            self._decided = True
            self._fold_weight = None if explicit else 1.0
            if not explicit:  # equal weights: p.grad becomes a view where the dtypes allow
                for g, group in enumerate(self._groups):
                    # Autograd needs p.grad in the param dtype; a DTensor's gradient is made by
                    # FSDP2 or DTensor's autograd, never a view: the hooks fold those.
                    if group.reduce_dtype == group.param_dtype and not group.has_dtensors:
                        self._attach(g)

    @contextmanager
    def micro_batch(self, weight: float | Tensor) -> Iterator[None]:
        """The body of :meth:`acco.AccoOptimizer.micro_batch`: fold at ``weight`` during
        backward, then end the micro-batch."""
        if self._backward_unaccumulated():
            raise RuntimeError(
                "micro_batch(): the gradients of an earlier backward() have not been accumulated: "
                "call accumulate() before the block"
            )
        # Inside the block every gradient goes through the hooks, which weight it.
        attached = list(self._views)
        for g in range(len(self._groups)):
            self._detach(g)
        previous, self._fold_weight, self._in_block = self._fold_weight, weight, True
        try:
            yield
        except BaseException:
            self._torn = self._folded is not None
            self._folded = None
            raise
        finally:
            self._fold_weight, self._in_block = previous, False
            self._views = attached
        self._end_micro_batch(weight, explicit=True)
        for g, on in enumerate(self._views):
            if on:
                self._attach(g)

    def _end_micro_batch(self, weight: float | Tensor, explicit: bool) -> None:
        folded_at, self._folded = self._folded, None
        if folded_at is not None and explicit and not _same_weight(weight, folded_at):
            self._count(folded_at)
            raise ValueError(
                f"accumulate(weight={weight!r}): this micro-batch's gradients were already folded at weight "
                f"{folded_at!r} during backward() (the first accumulate() had no weight); it counts with "
                f"{folded_at!r}. Declare unequal weights before backward(): "
                "`with opt.micro_batch(weight=w): loss.backward()`"
            )
        with record_function("acco.accumulate"):
            found = [fold_grads(group, weight) for group in self._groups]
        if folded_at is None and not any(found):
            raise RuntimeError("accumulate() found no gradient in any parameter: call backward() first")
        self._count(weight)

    # --------------------------------------------------------------------- checks

    def check_outside_block(self, call: str) -> None:
        if self._torn:
            raise RuntimeError(
                f"{call} after a micro_batch() block raised once some of its gradients were folded: the "
                "accumulator holds a partial micro-batch; build a new AccoOptimizer (or load a checkpoint)"
            )
        if self._in_block:
            raise RuntimeError(f"{call} inside a micro_batch() block (blocks do not nest; the block accumulates when it ends)")

    def check_all_accumulated(self, call: str) -> None:
        """RuntimeError when a backward()'s gradients were not ended by ``accumulate()``:
        ``p.grad`` set since, or gradients folded during backward() (which only
        ``accumulate()`` counts). Nothing is lost: the call can be retried after it."""
        if self._backward_unaccumulated():
            raise RuntimeError(
                f"{call}: the gradients of the last backward() were not accumulated; call opt.accumulate() "
                "after each backward() (acco folds p.grad into its accumulator there), then step()"
            )

    def _backward_unaccumulated(self) -> bool:
        """A backward() ran since the last accumulate(): its gradients were folded by the
        hooks (only accumulate() counts them), or some p.grad holds them."""
        return self._folded is not None or self.holds_unfolded_grads()

    @property
    def grads_in_views(self) -> bool:
        """Whether every group's ``p.grad`` is a view of its accumulator (equal weights, and
        dtypes that allow it), so that a scan of ``p.grad`` sees the round's gradients."""
        return all(self._views)

    def holds_unfolded_grads(self) -> bool:
        """Whether some ``p.grad`` holds a gradient not yet in the accumulator."""
        return any(
            p.grad is not None and not _same_memory(p.grad, view)
            for group in self._groups
            for p, view in zip(group.params, group.accumulator_views())
        )

    def before_zero_grad(self) -> None:
        """``zero_grad()`` must not zero the accumulated sum nor drop folded gradients."""
        if self._folded is not None:
            raise RuntimeError(
                "zero_grad(): the last backward()'s gradients were folded into acco's accumulator during "
                "backward() and cannot be discarded; call accumulate() (or skip the backward)"
            )
        for group in self._groups:
            self._release(group)

    # ------------------------------------------------------------------- hand-over

    @contextmanager
    def views_released(self) -> Iterator[None]:
        """Around a hand-over: ``p.grad`` views of the accumulator are dropped (the round
        reads that buffer now) and pointed at the new accumulator afterwards."""
        for group in self._groups:
            self._release(group)
        yield
        for g, on in enumerate(self._views):
            if on:
                self._attach(g)

    def release_views(self) -> None:
        """``p.grad`` no longer points into acco's buffers (at ``finish()``)."""
        for group in self._groups:
            self._release(group)

    def close(self) -> None:
        """The hooks stop folding (the optimizer is finished)."""
        self._closed = True

    # ------------------------------------------------------------------ internals

    def _attach(self, g: int) -> None:
        self._views[g] = True
        group = self._groups[g]
        for param, view in zip(group.params, group.accumulator_views()):
            param.grad = view

    def _detach(self, g: int) -> None:
        self._release(self._groups[g])
        self._views[g] = False

    @staticmethod
    def _release(group: ShardedGroup) -> None:
        """``p.grad`` = None where it is an accumulator view (the sum stays accumulated)."""
        for param, view in zip(group.params, group.accumulator_views()):
            if param.grad is not None and _same_memory(param.grad, view):
                param.grad = None

    def _fold_one(self, g: int, index: int) -> None:
        """Post-accumulate-grad hook body: fold one parameter's ``p.grad`` as soon as
        backward has produced it, at the policy's weight."""
        weight = self._fold_weight
        if self._closed or weight is None:
            return  # finished, or the weight is given after backward(): accumulate() folds p.grad
        group = self._groups[g]
        param, view = group.params[index], group.accumulator_views()[index]
        grad = param.grad
        if grad is None:
            return
        if not _same_memory(grad, view):  # else autograd already added into the view
            if grad.is_sparse:
                raise TypeError("acco does not support sparse gradients")
            grad, scale = _local_grad(group, index)
            if isinstance(weight, Tensor):  # a weight on the device: never read on the host
                grad = grad.detach().mul_(_scale_for(grad, weight))
                view.add_(grad, alpha=scale)
            else:
                view.add_(grad.detach(), alpha=weight * scale)
            param.grad = view if self._views[g] else None
        self._folded = weight


def fold_grads(group: ShardedGroup, weight: float | Tensor) -> bool:
    """Add ``weight * p.grad`` into the accumulator and drop ``p.grad``; returns whether
    any parameter had a gradient. ``weight`` may be a 0-dim device tensor."""
    targets, grads, scales = [], [], []
    for index, (param, view) in enumerate(zip(group.params, group.accumulator_views())):
        if param.grad is None or _same_memory(param.grad, view):
            continue  # unused in this micro-batch (contributes zero), or already in place
        if param.grad.is_sparse:
            raise TypeError("acco does not support sparse gradients")
        grad, scale = _local_grad(group, index)
        targets.append(view)
        grads.append(grad)
        scales.append(scale)
        param.grad = None
    if any(scale != 1.0 for scale in scales):  # FSDP2 with a gradient divide factor
        torch._foreach_mul_(grads, scales)
    if targets and isinstance(weight, Tensor):
        # p.grad is consumed anyway: scale it in place, in fp32 at least.
        torch._foreach_mul_(grads, _scale_for(grads[0], weight))
        torch._foreach_add_(targets, grads)
    elif targets:
        torch._foreach_add_(targets, grads, alpha=weight)
    return bool(targets)


def _local_grad(group: ShardedGroup, index: int) -> tuple[Tensor, float]:
    """Parameter ``index``'s gradient as acco folds it (a DTensor's local tensor) and the
    factor that makes it the replica group's mean."""
    mesh = group.mesh_params[index]
    if mesh is None:
        return group.params[index].grad, 1.0
    return mesh.local_grad(), mesh.grad_scale()


def _fold_hook(folder_ref: weakref.ReferenceType, g: int, index: int, param: Tensor) -> None:
    # A weak reference: the hooks must not keep the folder (and its buffers) alive.
    folder = folder_ref()
    if folder is not None:
        folder._fold_one(g, index)


def _remove_handles(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
