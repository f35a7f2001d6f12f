"""DTensor parameters: FSDP2 or tensor parallelism inside a replica group, acco across.

On a mesh ``("replicate", "shard")`` (or ``(..., "tp")``) FSDP2 and tensor parallelism own
every dimension but ``replicate``; acco reduces and shards across ``replicate`` only
(docs/design.md, "Meshes"). It never sees a whole parameter, only each DTensor's *local*
tensor:

- its gradient is the local tensor of ``p.grad``, which FSDP2 has already reduced inside
  the replica group (the mean over its ranks, or the sum over a gradient divide factor,
  which :class:`MeshParam` undoes) and tensor parallelism has computed for the local block;
- its values are written in place into ``p.to_local()``, the tensor FSDP2's next all-gather
  reads (never rebound);
- its share of the global gradient norm counts a dimension it is replicated over once.

:class:`InnerMesh` describes the ranks beside this one: how many ranks of a replica group
there are (their weights count once) and a private group over every rank of the mesh for the
comm lane's global sums (weights, the non-finite flag, the gradient norm). With plain
parameters none of this exists and acco is the flat ZeRO-1 of the rest of the package.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from acco.collectives import Collectives

__all__ = ["InnerMesh", "MeshParam", "dtensor_like", "is_dtensor", "local_tensor", "placeholder_state"]


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor. A DTensor exists only once ``torch.distributed.tensor``
    was imported (FSDP2 and tensor parallelism import it), so acco does not import it for a
    flat job: a second off every process start."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_tensor(param: Tensor) -> Tensor:
    """The tensor acco reads and writes for ``param``: its local tensor for a DTensor (the
    very tensor FSDP2's all-gather reads), the parameter itself otherwise."""
    if is_dtensor(param):
        with torch.no_grad():
            return param.to_local()
    return param


def dtensor_like(local: Tensor, param: Tensor) -> Tensor:
    """``local`` (shaped like this rank's block of DTensor ``param``) as a DTensor with
    ``param``'s mesh, placements, global shape and stride."""
    from torch.distributed.tensor import DTensor  # imported: ``param`` is one

    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())  # fmt: skip


class MeshParam:
    """How acco reads one DTensor parameter's gradient and counts it in the norm.

    Args:
        param: the DTensor parameter.
        fsdp_group: the FSDP2 param group holding it, if FSDP2 shards it (its gradient
            divide factor is read at each fold, so a factor set later is honoured).
    """

    def __init__(self, param: Tensor, fsdp_group: Any | None) -> None:
        self.param = param
        self._fsdp_group = fsdp_group
        mesh, placements = param.device_mesh, param.placements
        replicated = 1
        for dim, placement in enumerate(placements):
            if placement.is_replicate():
                replicated *= mesh.size(dim)
        # Every rank of a dimension it is replicated over holds the same gradient: counted once.
        self.norm_weight = 1.0 / replicated
        self.sharded = any(p.is_shard() for p in placements)

    def grad_scale(self) -> float:
        """What turns the local gradient into the mean over the replica group.

        FSDP2 reduce-scatters ``sum(g) / f`` with ``f`` its gradient divide factor (the
        replica group's size when none is set): the mean is that times ``f / size``."""
        group = self._fsdp_group
        if group is None or getattr(group, "gradient_divide_factor", None) is None:
            return 1.0
        size = group.mesh_info.shard_mesh_size
        return float(group.gradient_divide_factor) / size

    def local_grad(self) -> Tensor | None:
        """The local tensor of ``p.grad`` in the parameter's placements (a partial sum,
        which tensor parallelism may leave, is reduced first: a collective on the training
        thread, on the parameter's own mesh), or None."""
        grad = self.param.grad
        if grad is None:
            return None
        with torch.no_grad():
            if is_dtensor(grad):
                if tuple(grad.placements) != tuple(self.param.placements):
                    grad = grad.redistribute(self.param.device_mesh, self.param.placements)
                return grad.to_local()
            return grad


def _fsdp_groups(module: nn.Module | None) -> dict[int, Any]:
    """The FSDP2 param group of each parameter ``fully_shard`` manages in ``module``, by id."""
    if module is None:
        return {}
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return {}
    found: dict[int, Any] = {}
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        group = sub._get_fsdp_state()._fsdp_param_group
        if group is None:
            continue
        for fsdp_param in group.fsdp_params:
            found[id(fsdp_param.sharded_param)] = group
    return found


class InnerMesh:
    """The dimensions inside a replica group that this rank's DTensor parameters span.

    Attributes:
        params: a :class:`MeshParam` per DTensor parameter, by ``id``.
        ranks: every rank of the mesh (acco's group times the inner dimensions), sorted.
        replica_ranks: the ranks of this rank's replica group (the inner dimensions).
        replica_size: ranks per replica group (``len(ranks) / world size of acco's group``);
            each passes the same weights, which the comm lane's sums count once.
    """

    def __init__(self, params: Iterable[Tensor], module: nn.Module | None, comm: Collectives) -> None:
        fsdp = _fsdp_groups(module)
        self.params: dict[int, MeshParam] = {}
        inner: set[int] = set()
        for param in params:
            if not is_dtensor(param):
                continue
            group = fsdp.get(id(param))
            if group is not None and hasattr(group.mesh_info, "replicate_process_group"):
                raise ValueError(
                    "AccoOptimizer: FSDP2 was given a mesh with a replicate dimension (HSDP): it would "
                    "all-reduce across replicas in every backward. Shard inside a replica group only, "
                    "fully_shard(m, mesh=mesh['shard']), and pass acco process_group=mesh['replicate'].get_group()"
                )
            self.params[id(param)] = MeshParam(param, group)
            inner.update(int(r) for r in param.device_mesh.mesh.flatten().tolist())
        self.active = bool(self.params)
        acco_ranks = comm.group_ranks()
        if self.active:
            own = comm.global_rank()
            overlap = sorted(inner & set(acco_ranks) - {own})
            if overlap:
                raise ValueError(
                    f"AccoOptimizer: process_group {acco_ranks} shares ranks {overlap} with a DTensor parameter's "
                    "mesh: acco reduces across replicas, FSDP2 / tensor parallelism inside one; pass "
                    "process_group=mesh['replicate'].get_group() and give the parameters the other dimensions"
                )
        self.replica_ranks = sorted(inner) if inner else [comm.global_rank()]
        self.replica_size = len(self.replica_ranks)
        self.ranks: list[int] = []

    def check(self, param_groups: Sequence[dict[str, Any]], param_dtype: torch.dtype | None) -> None:
        """``ValueError`` for what acco cannot do exactly on DTensor parameters (before any
        collective)."""
        for number, group in enumerate(param_groups):
            for param in group["params"]:
                mesh = self.params.get(id(param))
                if mesh is None:
                    continue
                if param_dtype is not None and param_dtype != param.dtype:
                    raise ValueError(
                        f"param_dtype={param_dtype} with DTensor parameters ({param.dtype}): acco writes their local "
                        "tensors in place and cannot change their dtype; give FSDP2 a "
                        "MixedPrecisionPolicy(param_dtype=...) instead"
                    )
                if mesh.sharded and str(getattr(group.get("layout"), "value", group.get("layout"))) == "tensor":
                    raise ValueError(
                        f"param group {number}: {group['optimizer_class'].__name__} updates whole tensors "
                        "(layout='tensor'), but a DTensor parameter sharded by FSDP2 or tensor parallelism holds "
                        "only a block of its tensor here: use an element-wise optimizer (SGD, Adam, AdamW, ...) "
                        "for sharded parameters"
                    )

    def gather_ranks(self, comm: Collectives) -> None:
        """Every rank of the mesh: each rank's inner ranks, gathered over acco's group.
        Collective on ``comm``; every rank's replica group must have the same size."""
        sizes = comm.all_gather_ints([self.replica_size])
        if len({s[0] for s in sizes}) != 1:
            raise ValueError(
                f"AccoOptimizer: replica groups of different sizes across process_group ({[s[0] for s in sizes]}): "
                "every rank's DTensor parameters must span the same number of ranks"
            )
        every = comm.all_gather_ints(self.replica_ranks)
        self.ranks = sorted({r for ranks in every for r in ranks})

    def norm_weights(self, params: Sequence[Tensor]) -> list[float] | None:
        """Each parameter's weight in the squared gradient norm; None when all are 1."""
        # A plain parameter beside DTensor ones (outside a tensor-parallel plan) is the same
        # on every rank of its replica group: counted once.
        plain = 1.0 / self.replica_size
        weights = [self.params[id(p)].norm_weight if id(p) in self.params else plain for p in params]
        return None if all(w == 1.0 for w in weights) else weights

    def mesh_param(self, param: Tensor) -> MeshParam | None:
        return self.params.get(id(param))


def placeholder_state(param_groups: Sequence[dict[str, Any]]) -> dict[Tensor, dict[str, str]]:
    """An entry per parameter for ``Optimizer.state``: torch's ``get_optimizer_state_dict``
    steps an optimizer whose ``state`` is empty to create it, and acco's state lives in its
    shards (the portable state dict carries it)."""
    return {param: {"sharded_by": "acco"} for group in param_groups for param in group["params"]}
