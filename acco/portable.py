"""The portable state dict: per parameter, in torch's layout, that any layout can load.

A rank's own state dict (:mod:`acco.state`) holds its chunk of flat buffers; it reloads
only at the same world size and layout. Resharding goes through a *canonical* form: per
parameter, its master values, its base-optimizer state (element-wise for the ``flat``
layout), its share of the in-flight round's result and its pending gradient summed over
the old ranks (their sum is what the next update uses; it goes to the new rank 0).

:func:`to_portable` writes that form in torch's optimizer layout, ``{"state": {pid: {...}},
"param_groups": [...]}``, each per-parameter tensor shaped like its parameter: a DTensor
with the parameter's mesh and placements for a DTensor parameter (so DCP stores it at its
real global offsets and reshards it to any mesh; a plain tensor would be stored once, as one
rank's slice), the whole tensor for a plain one. acco's own values (mode, counters, the
round state) ride in ``param_groups[0]["acco"]``, which torch's
``get_optimizer_state_dict`` keeps. :func:`from_portable` turns it back into this rank's
own state dict. See docs/design.md, "Checkpoints".
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from acco.collectives import Collectives
from acco.mesh import dtensor_like, is_dtensor, local_tensor
from acco.rounds import RoundSchedule
from acco.sharding import Layout, ShardedGroup, ShardPlan, plan_layout
from acco.state import STATE_VERSION

__all__ = ["CanonicalGroup", "LOCAL_PER_PARAM", "LOCAL_SHARED", "canonical", "from_portable", "is_portable",
           "local_from_portable", "local_to_portable", "pending_to_rank_zero", "per_element", "rank_group_state",
           "to_portable"]

# Per-parameter entries acco adds beside the base optimizer's own state.
MASTER, PENDING, IN_FLIGHT = "acco_master", "acco_pending_grad", "acco_in_flight_result"
_ACCO_KEYS = (MASTER, PENDING, IN_FLIGHT)
_WEIGHTS = ("pending_weight", "round_weight", "pending_micro_batches", "round_micro_batches")
# The local loop's per-parameter entries (acco.local.LocalLoop.state_dict: per param group, one
# tensor per parameter shaped like its local tensor, or None), and those identical on every replica.
LOCAL_PER_PARAM = ("live", "global_values", "landing_values", "accumulators", "handed_over", "common_terms")
LOCAL_SHARED = ("global_values", "landing_values", "common_terms")


@dataclass
class CanonicalGroup:
    """One param group per parameter (shaped like each parameter's tensor on this rank)."""

    master: list[Tensor]
    state: list[dict[str, Any]]
    in_flight: list[Tensor] | None
    grad_sum: list[Tensor]


def canonical(saved: Sequence[dict[str, Any]], index: int) -> CanonicalGroup:
    """Param group ``index`` in canonical form, from every rank's own state dict."""
    groups = [s["acco"]["groups"][index] for s in saved]
    first = groups[0]
    plan = plan_layout(Layout(first["layout"]), first["shapes"], len(saved))
    master = per_param(plan, torch.cat([g["master"] for g in groups]))
    in_flight = None
    if first["in_flight_result"] is not None:
        in_flight = per_param(plan, torch.cat([g["in_flight_result"] for g in groups]))
    grad_sum = per_param(plan, torch.stack([g["grad_accumulator"] for g in groups]).sum(0))
    state: list[dict[str, Any]] = [{} for _ in plan.slots]
    if plan.layout is Layout.FLAT:
        for key in {k for g in groups for s in g["base_state"].values() for k in s}:
            values = [g["base_state"].get(0, {}).get(key) for g in groups]
            if all(isinstance(v, Tensor) and v.shape == (plan.chunk,) for v in values):
                for i, value in enumerate(per_param(plan, torch.cat(values))):
                    state[i][key] = value
            else:  # a per-shard scalar such as Adam's step: the same on every rank
                present = next(v for v in values if v is not None)
                for i in range(len(plan.slots)):
                    state[i][key] = present
    else:
        for rank, group in enumerate(groups):
            for local, param_index in enumerate(plan.owned(rank)):
                state[param_index] = dict(group["base_state"].get(local, {}))
    return CanonicalGroup(master, state, in_flight, grad_sum)


def round_sums(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The round state (``acco.round`` of a state dict) with every rank's weights summed
    (what the next update divides by)."""
    round_ = dict(rounds[0])
    for key in _WEIGHTS:
        round_[key] = sum(r[key] for r in rounds)
    return round_


def rank_group_state(
    canonical_group: CanonicalGroup, plan: ShardPlan, rank: int, header: dict[str, Any], dtypes: dict[str, torch.dtype]
) -> dict[str, Any]:
    """One entry of ``acco.groups`` of ``rank``'s own state dict, from canonical form
    (``dtypes``: of ``master``, ``in_flight_result`` and ``grad_accumulator``)."""
    return {
        **header,
        "layout": plan.layout.value,
        "chunk": plan.chunk,
        "master": shard(plan, rank, canonical_group.master, dtypes["master"]),
        "base_state": shard_state(plan, rank, canonical_group.state),
        "in_flight_result": None
        if canonical_group.in_flight is None
        else shard(plan, rank, canonical_group.in_flight, dtypes["in_flight_result"]),
        "grad_accumulator": full(plan, canonical_group.grad_sum, dtypes["grad_accumulator"])
        if rank == 0
        else torch.zeros(plan.padded_numel, dtype=dtypes["grad_accumulator"]),
    }


def pending_to_rank_zero(groups: Sequence[ShardedGroup], schedule: RoundSchedule, comm: Collectives) -> None:
    """Hold the pending gradients and weights as a load of the portable state would: their
    sums on rank 0, nothing elsewhere. Collective (a reduce of the accumulators)."""
    for group in groups:
        comm.reduce_sum_(group.grad_accumulator, dst=0)
        if comm.rank != 0:
            group.grad_accumulator.zero_()
    rounds = comm.all_gather_objects(schedule.state_dict())
    schedule.load_state_dict(rank_round(round_sums(rounds), comm.rank))


def rank_round(round_: dict[str, Any], rank: int) -> dict[str, Any]:
    """Summed round weights as ``rank`` holds them: all on rank 0, none elsewhere."""
    return {**round_, **{key: round_[key] if rank == 0 else type(round_[key])(0) for key in _WEIGHTS}}


# ----------------------------------------------------------------- torch's layout


def is_portable(state_dict: Any) -> bool:
    groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    return bool(groups) and isinstance(groups[0], dict) and isinstance(groups[0].get("acco"), dict)


def to_portable(
    saved: Sequence[dict[str, Any]], params: Sequence[Sequence[Tensor]], replica_size: int = 1
) -> dict[str, Any]:
    """The portable state dict from every rank of acco's group's own state dicts (in rank
    order) and each param group's parameters (DTensors give the mesh and placements).

    Pending gradients and weights are stored as sums over every rank of the mesh: a rank
    of a replica group of ``replica_size`` holds its group's mean gradient and weight, so
    acco's group's sums are multiplied by ``replica_size`` (and divided by the loading
    layout's in :func:`from_portable`)."""
    first = saved[0]["acco"]
    state: dict[int, dict[str, Any]] = {}
    pid = 0
    for index, group_params in enumerate(params):
        values = canonical(saved, index)
        for i, param in enumerate(group_params):
            pending = values.grad_sum[i] * replica_size if replica_size != 1 else values.grad_sum[i]
            entry = {MASTER: _portable(values.master[i], param), PENDING: _portable(pending, param)}
            if values.in_flight is not None:
                entry[IN_FLIGHT] = _portable(values.in_flight[i], param)
            for key, value in values.state[i].items():
                entry[key] = _portable(value, param) if per_element(value) else value
            state[pid] = entry
            pid += 1
    meta = {
        key: value for key, value in first.items() if key not in ("rank", "world_size", "groups", "round", "buffers")
    }
    if first.get("local") is not None:  # a loop's own per-rank state: every rank's, in rank order
        meta["local"] = [s["acco"]["local"] for s in saved]
    meta["round"] = _scaled(round_sums([s["acco"]["round"] for s in saved]), replica_size)
    meta["groups"] = [
        {key: g[key] for key in ("optimizer_class", "param_dtype", "reduce_dtype")} for g in first["groups"]
    ]
    param_groups = copy.deepcopy(saved[0]["param_groups"])
    param_groups[0]["acco"] = meta
    return {"state": state, "param_groups": param_groups}


def from_portable(
    state_dict: dict[str, Any], param_groups: Sequence[dict[str, Any]], groups: Sequence[ShardedGroup], rank: int,
    world_size: int, replica_size: int = 1,
) -> dict[str, Any]:
    """This rank's own state dict (:mod:`acco.state`) from a portable one, for a rank of
    acco's group of ``world_size`` in replica groups of ``replica_size``; ``ValueError``
    when it does not fit (another number of parameters, or other shapes)."""
    meta = state_dict["param_groups"][0]["acco"]
    saved_state = state_dict["state"]
    count = sum(len(g["params"]) for g in param_groups)
    if len(state_dict["param_groups"]) != len(param_groups) or len(saved_state) != count:
        raise ValueError(
            f"portable state with {len(state_dict['param_groups'])} param groups and {len(saved_state)} parameters, "
            f"this optimizer has {len(param_groups)} and {count}"
        )
    out_groups = []
    for index, (group, sharded, saved_group) in enumerate(zip(param_groups, groups, state_dict["param_groups"])):
        if len(saved_group["params"]) != len(group["params"]):
            raise ValueError(f"param group {index}: {len(saved_group['params'])} parameters saved, {len(group['params'])} here")
        master, state, in_flight, grad_sum = [], [], [], []
        # torch's convention: a group's "params" names its parameters' keys in "state", in order.
        for param, key in zip(group["params"], saved_group["params"]):
            entry = saved_state[key]
            shape = local_tensor(param).shape
            master.append(_local(entry[MASTER], shape, param))
            pending = _local(entry[PENDING], shape, param)
            grad_sum.append(pending / replica_size if replica_size != 1 else pending)
            if IN_FLIGHT in entry:
                in_flight.append(_local(entry[IN_FLIGHT], shape, param))
            state.append(
                {
                    key: _local(value, shape, param) if per_element(value) else value
                    for key, value in entry.items()
                    if key not in _ACCO_KEYS
                }
            )
        header = dict(meta["groups"][index])
        header["shapes"] = [list(slot.shape) for slot in sharded.plan.slots]
        values = CanonicalGroup(master, state, in_flight or None, grad_sum)
        dtypes = {"master": sharded.master_dtype, "in_flight_result": sharded.param_dtype,
                  "grad_accumulator": sharded.reduce_dtype}  # fmt: skip
        out_groups.append(rank_group_state(values, sharded.plan, rank, header, dtypes))
    plain_groups = []
    for group in state_dict["param_groups"]:
        plain_groups.append({k: v for k, v in group.items() if k != "acco"})
    start = 0
    for group, live in zip(plain_groups, param_groups):  # indices, whatever torch put there
        group["params"] = list(range(start, start + len(live["params"])))
        start += len(live["params"])
    scalars = {k: v for k, v in meta.items() if k not in ("round", "groups")}
    if isinstance(meta.get("local"), list):  # this rank's own at the saved number of ranks, else rank 0's
        scalars["local"] = meta["local"][rank if len(meta["local"]) == world_size else 0]
    return {
        "state": {},
        "param_groups": plain_groups,
        "acco": {**scalars, "version": STATE_VERSION, "rank": rank, "world_size": world_size,
                 "round": rank_round(_scaled(meta["round"], 1 / replica_size), rank), "buffers": None,
                 "groups": out_groups},
    }  # fmt: skip


def _scaled(round_: dict[str, Any], factor: float) -> dict[str, Any]:
    """The round state with its weights (and micro-batch counts) times ``factor``."""
    if factor == 1:
        return dict(round_)
    out = dict(round_)
    for key in _WEIGHTS:
        out[key] = round(round_[key] * factor) if isinstance(round_[key], int) else round_[key] * factor
    return out


def local_to_portable(local: dict[str, Any], params: Sequence[Sequence[Tensor]]) -> dict[str, Any]:
    """The local loop's own state (one replica's, at this rank's place in its replica group)
    with every per-parameter tensor, the inner optimizers' per-element state included, shaped
    like its parameter: a DTensor block for a DTensor parameter, so DCP stores each replica's
    values at their global offsets and reads them into any other mesh. The residuals stay this
    rank's plain tensors (they belong to its place: docs/checkpoints.md)."""
    out = dict(local)
    for key in LOCAL_PER_PARAM:
        if local.get(key) is not None:
            out[key] = [[_portable(v, p) for v, p in zip(values, group)] for values, group in zip(local[key], params)]
    out["inner"] = [
        {**saved, "state": {i: {k: _portable(v, group[i]) if per_element(v) and not is_dtensor(v) else v
                                for k, v in entry.items()} for i, entry in saved["state"].items()}}
        for saved, group in zip(local["inner"], params)
    ]  # fmt: skip
    return out


def local_from_portable(portable: dict[str, Any], params: Sequence[Sequence[Tensor]]) -> dict[str, Any]:
    """:func:`local_to_portable` undone for this rank's parameters: per-parameter entries as
    local tensors; the inner optimizers' state as their parameters hold it (DTensors for DTensor
    parameters, which ``Optimizer.load_state_dict`` keeps)."""
    out = dict(portable)
    for key in LOCAL_PER_PARAM:
        if portable.get(key) is not None:
            out[key] = [[_local(v, local_tensor(p).shape, p) for v, p in zip(values, group)]
                        for values, group in zip(portable[key], params)]  # fmt: skip
    out["inner"] = [
        {**saved, "state": {int(i): {k: _inner_value(v, group[int(i)]) for k, v in entry.items()}
                            for i, entry in saved["state"].items()}}
        for saved, group in zip(portable["inner"], params)
    ]  # fmt: skip
    return out


def _inner_value(value: Any, param: Tensor) -> Any:
    if per_element(value) and is_dtensor(param) and not is_dtensor(value):
        return dtensor_like(_local(value, local_tensor(param).shape, param), param)
    return value


def per_element(value: Any) -> bool:
    """Whether a state value is per element (Adam's moments), not a scalar (its step)."""
    return isinstance(value, Tensor) and value.dim() > 0


def _portable(value: Tensor, param: Tensor) -> Tensor:
    """``value`` (shaped like ``param``'s local tensor) shaped like ``param`` itself."""
    if not is_dtensor(param):
        return value.reshape(param.shape)
    return dtensor_like(value.reshape(local_tensor(param).shape), param)


def _local(value: Any, shape: torch.Size, param: Tensor) -> Tensor:
    """A portable entry as ``param``'s local tensor (a whole tensor is cut to this rank's
    block of a DTensor parameter, without communication)."""
    if is_dtensor(value):
        local = value.to_local()
    elif is_dtensor(param):
        from torch.distributed.tensor import distribute_tensor

        local = distribute_tensor(value.reshape(param.shape), param.device_mesh, param.placements,
                                  src_data_rank=None).to_local()  # fmt: skip
    else:
        local = value
    if local.numel() != shape.numel():
        raise ValueError(f"a saved per-parameter tensor has {local.numel()} elements here, the parameter {shape.numel()}")
    return local.reshape(shape)


def per_param(plan: ShardPlan, flat: Tensor) -> list[Tensor]:
    return [flat[s.offset : s.offset + s.numel].view(s.shape).clone() for s in plan.slots]


def full(plan: ShardPlan, values: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
    out = torch.zeros(plan.padded_numel, dtype=dtype)
    for slot, value in zip(plan.slots, values):
        out[slot.offset : slot.offset + slot.numel] = value.reshape(-1)
    return out


def shard(plan: ShardPlan, rank: int, values: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
    start, stop = plan.rank_range(rank)
    return full(plan, values, dtype)[start:stop].clone()


def shard_state(plan: ShardPlan, rank: int, state: Sequence[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    if plan.layout is Layout.TENSOR:
        return {local: dict(state[i]) for local, i in enumerate(plan.owned(rank)) if state[i]}
    keys = {k for s in state for k in s}
    if not keys:
        return {}
    out: dict[str, Any] = {}
    for key in keys:
        values = [s.get(key) for s in state]
        if all(isinstance(v, Tensor) and v.shape == slot.shape for v, slot in zip(values, plan.slots)):
            out[key] = shard(plan, rank, values, values[0].dtype)
        else:
            out[key] = next(v for v in values if v is not None)
    return {0: out}
