"""The optimizer's state dict: its schema, its checks, and restoring a param group from it.

Schema of :meth:`acco.AccoOptimizer.state_dict` (version 1; tensors and plain Python values
only, so ``torch.load(path, weights_only=True)`` reads it back)::

    {"state": {},                       # the base optimizers' state is per shard, below
     "param_groups": [{hyper-parameters..., "optimizer_class": name, "layout": name,
                       "params": [indices]}],
     "acco": {"version": 1, "mode", "rank", "world_size", "max_grad_norm",
              "num_updates", "skipped_updates", "committed_weight",
              "round": {"rounds_launched", "next_kind", "in_flight_kind" (or None),
                        "pending_weight", "pending_micro_batches",
                        "round_weight", "round_micro_batches"},
              "buffers": None, or {"names", "live": this rank's module buffers,
                        "snapshot" / "synced": the round in flight's (or None)},
              "groups": [{"layout", "optimizer_class", "shapes", "chunk", "param_dtype",
                          "reduce_dtype",
                          "master": fp32 shard, "base_state": {local index: {...}},
                          "in_flight_result": this rank's chunk of the round in
                              flight's result (or None),
                          "grad_accumulator": this rank's unreduced gradient sum}]}}

A state saved with a round in flight is restored by all-gathering that round's saved result
again (a *replayed* round). See docs/design.md, "Checkpoints".
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from acco.sharding import ShardedGroup
from acco.module_buffers import BufferSnapshot, BufferSync
from acco.options import Options, base_hyperparams

__all__ = ["STATE_VERSION", "build_state_dict", "check_state_dict", "restore_groups"]

STATE_VERSION = 1


def build_state_dict(
    param_groups: Sequence[dict[str, Any]],
    groups: Sequence[ShardedGroup],
    base_optimizers: Sequence[torch.optim.Optimizer | None],
    *,
    options: Options,
    rank: int,
    world_size: int,
    round_state: dict[str, Any],
    counts: dict[str, Any],
    buffers: dict[str, Any] | None = None,
    masters: Sequence[Tensor] | None = None,
) -> dict[str, Any]:
    """The state dict above, at a round boundary (a round in flight has been waited for);
    ``masters``: each group's master shard where the groups keep none (the loop's)."""
    result_pending = round_state["in_flight_kind"] is not None
    return {
        "state": {},
        "param_groups": _param_groups_state(param_groups),
        "acco": {
            "version": STATE_VERSION,
            "mode": options.mode.value,
            "rank": rank,
            "world_size": world_size,
            "max_grad_norm": options.max_grad_norm,
            **counts,
            "round": round_state,
            "buffers": buffers,
            "groups": [_group_state(g, s, b, result_pending, None if masters is None else masters[number])
                       for number, (g, s, b) in enumerate(zip(param_groups, groups, base_optimizers))],  # fmt: skip
        },
    }


def restore_groups(
    state_dict: dict[str, Any],
    param_groups: Sequence[dict[str, Any]],
    groups: Sequence[ShardedGroup],
    base_optimizers: Sequence[torch.optim.Optimizer | None],
    buffer_sync: BufferSync | None,
    run_on_lane: Callable[[Callable[[], None]], None],
) -> BufferSnapshot | None:
    """Load a checked state dict's hyper-parameters, shards, accumulators, base optimizer
    state (through ``run_on_lane``), module buffers and, with a round in flight, its saved
    result into ``gather_input`` for the replayed round to all-gather; returns that round's
    buffer snapshot (None: no buffers kept, or no round in flight)."""
    saved = state_dict["acco"]
    result_pending = saved["round"]["in_flight_kind"] is not None
    for group, values in zip(param_groups, state_dict["param_groups"]):
        fused = group.get("fused")
        group.update(base_hyperparams(values))
        if values.get("fused") is None and values.get("foreach") is None and fused:
            group["fused"] = fused  # a state that chose no kernel (saved before acco chose one) keeps this run's
    for group, sharded, base, values in zip(param_groups, groups, base_optimizers, saved["groups"]):
        sharded.load_master_values(values["master"], result_pending=result_pending)
        sharded.grad_accumulator.copy_(values["grad_accumulator"])
        if base is not None:
            steps_on_device = bool(group.get("fused") or group.get("capturable"))
            run_on_lane(functools.partial(_load_base_state, sharded, base, values["base_state"], steps_on_device))
        if result_pending:
            sharded.gather_input.copy_(values["in_flight_result"])
    if buffer_sync is None or saved.get("buffers") is None:
        return None
    return buffer_sync.load_state_dict(saved["buffers"])


def _param_groups_state(param_groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``param_groups`` entry: hyper-parameters, class and layout names, param indices."""
    start, out = 0, []
    for group in param_groups:
        count = len(group["params"])
        out.append(
            {
                **base_hyperparams(group),
                "optimizer_class": group["optimizer_class"].__name__,
                "layout": group["layout"].value,
                "params": list(range(start, start + count)),
            }
        )
        start += count
    return out


def _group_state(
    group: dict[str, Any], sharded: ShardedGroup, base: torch.optim.Optimizer | None, result_pending: bool,
    master: Tensor | None = None,
) -> dict[str, Any]:
    """One entry of ``acco.groups``, at a round boundary (``result_pending``: a finished round's
    result has not been loaded yet; ``master``: the master shard, where the group keeps none)."""
    return {
        **_group_header(group, sharded),
        "chunk": sharded.plan.chunk,
        "master": sharded.master_values(result_pending=result_pending) if master is None else master,
        "base_state": _base_state(sharded, base),
        "in_flight_result": sharded.gather_input.clone() if result_pending else None,
        "grad_accumulator": sharded.grad_accumulator.clone(),
    }


def check_state_dict(
    state_dict: Any,
    *,
    mode: str,
    rank: int,
    world_size: int,
    param_groups: Sequence[dict[str, Any]],
    groups: Sequence[ShardedGroup],
    buffer_sync: BufferSync | None = None,
) -> dict[str, Any]:
    """The ``"acco"`` entry of a state dict that fits this optimizer; ``ValueError`` naming
    the first mismatch otherwise."""
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("acco"), dict):
        raise ValueError("not an AccoOptimizer state dict (no 'acco' entry)")
    saved = state_dict["acco"]
    if saved.get("version") != STATE_VERSION:
        raise ValueError(f"unsupported AccoOptimizer state version {saved.get('version')!r}")
    if saved["mode"] != mode:
        raise ValueError(f"state saved in mode {saved['mode']!r}, this optimizer is {mode!r}")
    if saved["world_size"] != world_size or saved["rank"] != rank:
        raise ValueError(
            f"state saved by rank {saved['rank']} of {saved['world_size']}, loading on rank {rank} of "
            f"{world_size}: this is one rank's shard. To save one file that every rank loads, call "
            "opt.consolidate_state_dict(to=0) on every rank, then save opt.state_dict() on rank 0; or save "
            "and load with acco.checkpoint.save / acco.checkpoint.load"
        )
    if len(saved["groups"]) != len(param_groups) or len(state_dict["param_groups"]) != len(saved["groups"]):
        raise ValueError(f"state has {len(saved['groups'])} param groups, this optimizer {len(param_groups)}")
    for number, (values, group, sharded) in enumerate(zip(saved["groups"], param_groups, groups)):
        for key, value in _group_header(group, sharded).items():
            if values[key] != value:
                raise ValueError(f"param group {number}: saved {key} {values[key]!r}, this optimizer has {value!r}")
        # (Elastic rounds keep their outer state elsewhere: the master saved is the global
        # values' chunk, or nothing in a state saved before it was.)
        masters = (sharded.plan.chunk,) if sharded.keeps_master else (sharded.plan.chunk, 0)
        for key, lengths in (("master", masters), ("grad_accumulator", (sharded.plan.padded_numel,))):
            if not isinstance(values[key], Tensor) or tuple(values[key].shape) not in [(n,) for n in lengths]:
                raise ValueError(f"param group {number}: saved {key} is not a tensor of {lengths[0]} elements")
    if saved.get("buffers") is not None and buffer_sync is not None:
        buffer_sync.check_state_dict(saved["buffers"])
    return saved


def _load_base_state(
    sharded: ShardedGroup, base: torch.optim.Optimizer, saved: dict[int, dict[str, Any]], steps_on_device: bool
) -> None:
    """Restore a base optimizer's state, keyed by the shard's views (run it on the comm lane,
    so the state is allocated on the stream that uses and frees it). ``steps_on_device``: a
    fused or capturable optimizer's ``step`` counts are float32 on the shard's device, as
    ``torch.optim.Optimizer.load_state_dict`` puts them (a state saved by a ``foreach`` one
    holds them on the host)."""
    base.state.clear()
    for index, view in enumerate(sharded.master_views):
        if index in saved:
            base.state[view] = {key: _state_value(key, value, view, steps_on_device) for key, value in saved[index].items()}


def _state_value(key: str, value: Any, view: Tensor, steps_on_device: bool) -> Any:
    if not isinstance(value, Tensor):
        return copy.deepcopy(value)
    if key == "step" and steps_on_device:
        return value.to(device=view.device, dtype=torch.float32, copy=True)
    return value.to(view.device).clone() if value.dim() else value.clone()


def _group_header(group: dict[str, Any], sharded: ShardedGroup) -> dict[str, Any]:
    """What a saved group must match to be loaded: layout, class, shapes and dtypes."""
    return {
        "layout": sharded.plan.layout.value,
        "optimizer_class": group["optimizer_class"].__name__,
        "shapes": [list(slot.shape) for slot in sharded.plan.slots],
        "param_dtype": str(sharded.param_dtype),
        "reduce_dtype": str(sharded.reduce_dtype),
    }


def _base_state(sharded: ShardedGroup, base: torch.optim.Optimizer | None) -> dict[int, dict[str, Any]]:
    if base is None:
        return {}
    return {
        index: {key: _clone(value) for key, value in base.state[view].items()}
        for index, view in enumerate(sharded.master_views)
        if view in base.state
    }


def _clone(value: Any) -> Any:
    return value.clone() if isinstance(value, Tensor) else copy.deepcopy(value)
