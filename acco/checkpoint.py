"""Checkpoints: sharded save/load through torch.distributed.checkpoint, resharding to
another world size or layout, atomic directories, and a full state dict for export.

Every rank writes its own shard (``acco.rank{r}.*`` keys); the model's parameters are
saved once. A checkpoint holds tensors only (non-tensor values are JSON inside a uint8
tensor), and DCP's metadata is read with an unpickler that only admits DCP's own classes,
so loading never runs code from the file.

Resharding (N ranks -> M ranks, flat <-> tensor layout) goes through a *canonical* form:
per parameter, its master values, its base-optimizer state (element-wise for the ``flat``
layout) and its share of the in-flight round's result; pending gradients are summed over
the old ranks (their sum is what the next update uses) and given to the new rank 0.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from acco.collectives import Collectives
from acco.mesh import dtensor_like, is_dtensor, local_tensor
from acco.optim import AccoOptimizer
from acco.portable import (LOCAL_PER_PARAM, LOCAL_SHARED, canonical, local_from_portable, local_to_portable,
                           per_element, rank_group_state, rank_round, round_sums, to_portable)

__all__ = ["full_state_dict", "latest_checkpoint", "load", "reshard", "save"]

_LATEST = "latest"
_PARTIAL = ".partial"


# ----------------------------------------------------------------- save and load


def save(
    directory: str | os.PathLike,
    optimizer: AccoOptimizer,
    model: nn.Module | None = None,
    extra: Mapping[str, Any] | None = None,
    keep: int | None = None,
) -> Path:
    """Write a sharded checkpoint to ``directory``, atomically.

    The checkpoint is written to ``directory.partial`` and renamed once every rank has
    finished, then ``latest`` in the parent folder names it; a crash mid-save never leaves a
    half-written checkpoint as the latest.

    Args:
        directory: the checkpoint's folder (e.g. ``runs/ckpt/step-000100``).
        optimizer: its ``state_dict()`` is saved, one shard per rank.
        model: its ``state_dict()`` is saved once, from rank 0 (parameters are identical on all ranks).
        extra: this rank's own values (tensors, numbers, strings, lists, dicts), e.g. the
            data position; returned by :func:`load` on the same rank.
        keep: if given, then once this checkpoint is complete only the ``keep`` newest
            complete checkpoints beside it are kept.

    .. warning:: Collective: every rank must call it with the same ``directory``.
    """
    final = Path(directory)
    partial = final.with_name(final.name + _PARTIAL)
    # On a mesh every rank of it writes (DCP stores each DTensor block once); otherwise
    # acco's group, each rank its own shard.
    mesh = optimizer.on_mesh
    comm = _writers(optimizer)
    rank, barrier = comm.rank, comm.barrier
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.parent.mkdir(parents=True, exist_ok=True)
    barrier()
    if mesh:
        state = _portable_entries(optimizer, model, extra, rank)
    else:
        state = _own_entries(optimizer, model, extra, rank)
    import torch.distributed.checkpoint as dcp  # here, not at import: a second off every process start

    with _quiet_single_process():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(partial), **_dcp_group(optimizer))
    barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        _write_atomically(final.parent / _LATEST, final.name)
        if keep is not None:
            _prune(final.parent, keep, final)
    barrier()
    return final


def _own_entries(
    optimizer: AccoOptimizer, model: nn.Module | None, extra: Mapping[str, Any] | None, rank: int
) -> dict[str, Tensor]:
    """What a rank of acco's group writes: its own state dict, its extra values, the model
    (from rank 0 only) and the digests of all of it."""
    state: dict[str, Tensor] = {}
    _flatten_into(state, f"acco.rank{rank}", optimizer.state_dict())
    if extra is not None:
        _flatten_into(state, f"extra.rank{rank}", dict(extra))
    if model is not None and rank == 0:
        # Once, from rank 0: parameters are identical on every rank, module buffers may not be
        # (each rank's own are in its acco shard), and DCP would keep any one rank's copy.
        for name, value in model.state_dict().items():
            state[f"model.{name}"] = value.detach().cpu()
    # DCP keeps no checksums: each rank records the digests of what it writes.
    digests = {key: _digest(value) for key, value in state.items()}
    state[f"acco.rank{rank}.digests"] = _json_tensor(digests)
    return state


def load(
    directory: str | os.PathLike,
    optimizer: AccoOptimizer,
    model: nn.Module | None = None,
) -> dict[str, Any]:
    """Restore ``optimizer`` (and ``model``) from a checkpoint written by :func:`save`.

    The checkpoint may come from another world size or layout: master parameters,
    optimizer state, the round in flight and pending gradients are re-partitioned. Load
    into a freshly built optimizer. Everything is read and checked before anything
    changes; a checkpoint that does not fit raises ``ValueError`` on every rank.

    Returns:
        this rank's ``extra`` values (those of rank 0 when this rank did not exist).

    .. warning:: Collective: every rank must call it.
    """
    import torch.distributed.checkpoint as dcp  # here, not at import: a second off every process start
    from torch.distributed.checkpoint.api import CheckpointException

    from acco.safe_reader import SafeFileSystemReader

    path = Path(directory)
    reader = SafeFileSystemReader(path)
    try:
        metadata = reader.read_metadata()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError) as error:
        raise ValueError(f"{path} is not a readable acco checkpoint: {error}") from error
    entries = metadata.state_dict_metadata
    if f"{_PORTABLE}.skeleton" in entries:
        return _load_portable(path, entries, optimizer, model)
    ranks = sorted(int(k.split(".")[1][4:]) for k in entries if k.startswith("acco.rank") and k.endswith(".skeleton"))
    if not ranks or ranks != list(range(len(ranks))):
        raise ValueError(f"{path} holds no complete acco optimizer state (ranks found: {ranks})")

    # Allocate every tensor entry we need (never the pickled "bytes" entries), then read.
    wanted = [k for k in entries if k.startswith(("acco.", "extra.")) or (model is not None and k.startswith("model."))]
    state: dict[str, Tensor] = {}
    # A model with DTensor parameters reads the whole saved tensors into its own blocks.
    dtensors = {f"model.{k}": v for k, v in (model.state_dict() if model is not None else {}).items() if is_dtensor(v)}
    for key in wanted:
        entry = entries[key]
        if not isinstance(entry, dcp.metadata.TensorStorageMetadata):
            raise ValueError(f"{path}: entry {key!r} is not a tensor; refusing to unpickle it")
        if key in dtensors and tuple(dtensors[key].shape) == tuple(entry.size):
            state[key] = dtensors[key].detach().clone()
        else:
            state[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
    try:
        with _quiet_single_process():
            dcp.load(state, storage_reader=SafeFileSystemReader(path), **_dcp_group(optimizer))
    except (Exception, CheckpointException) as error:  # DCP's own exception is a BaseException
        raise ValueError(f"{path}: reading the checkpoint failed: {error}") from error
    for r in ranks:
        for key, digest in json.loads(bytes(state[f"acco.rank{r}.digests"].tolist()).decode()).items():
            if key in state and not is_dtensor(state[key]) and _digest(state[key]) != digest:
                raise ValueError(f"{path}: entry {key!r} is corrupted (checksum mismatch)")

    saved = [_unflatten(state, f"acco.rank{r}") for r in ranks]
    if optimizer.on_mesh:  # whole tensors from flat ranks, cut to this rank's DTensor blocks
        shapes = [[torch.empty(shape, device="meta") for shape in g["shapes"]] for g in saved[0]["acco"]["groups"]]
        target = to_portable(saved, shapes)
        meta = target["param_groups"][0]["acco"]
        if isinstance(meta.get("local"), list):  # whole tensors from flat ranks, cut to this rank's blocks
            local = meta["local"][optimizer.rank if len(meta["local"]) == optimizer.world_size else 0]
            groups = [group["params"] for group in optimizer.param_groups]
            meta["local"] = local_from_portable({**local, "residuals": None}, groups)
    else:
        target = reshard(saved, optimizer) if _needs_reshard(saved, optimizer) else saved[optimizer.rank]
    optimizer.check_state_dict(target)  # the checks load_state_dict runs, before the model changes
    model_state = None
    if model is not None:
        model_state = {k[len("model.") :]: v for k, v in state.items() if k.startswith("model.")}
        expected = model.state_dict()
        if set(model_state) != set(expected) or any(model_state[k].shape != expected[k].shape for k in expected):
            raise ValueError(f"{path}: the saved model does not match this model's parameters")
        model.load_state_dict(model_state)
    optimizer.load_state_dict(target)
    own = f"extra.rank{optimizer.rank}"
    prefix = own if any(k.startswith(own + ".") for k in state) else "extra.rank0"
    return _unflatten(state, prefix) if any(k.startswith(prefix + ".") for k in state) else {}


_PORTABLE = "acco.portable"


def _portable_entries(
    optimizer: AccoOptimizer, model: nn.Module | None, extra: Mapping[str, Any] | None, rank: int
) -> dict[str, Any]:
    """What a rank of a mesh writes: the portable state dict (one DTensor per parameter and
    state entry, at its global offsets; scalars in a JSON skeleton), the model's state dict
    and its extra values. Collective (``state_dict()`` gathers over acco's group)."""
    portable = optimizer.state_dict()
    state: dict[str, Any] = {}
    # mode="local": every replica's own state, in replica order; this rank writes its own.
    local = portable["param_groups"][0]["acco"].pop("local", None)
    if local is not None:
        params = [group["params"] for group in optimizer.param_groups]
        _local_entries(state, local_to_portable(local[optimizer.rank], params), optimizer.rank, rank)
    skeleton: dict[str, Any] = {"param_groups": portable["param_groups"], "state": {}}
    for pid, entry in portable["state"].items():
        skeleton["state"][str(pid)] = {}
        for key, value in entry.items():
            if per_element(value):
                state[f"{_PORTABLE}.{pid}.{key}"] = value
                skeleton["state"][str(pid)][key] = {"tensor": True}
            else:  # a scalar (Adam's step): the same on every rank
                skeleton["state"][str(pid)][key] = {"value": value.item() if isinstance(value, Tensor) else value,
                                                    "dtype": str(value.dtype) if isinstance(value, Tensor) else None}
    state[f"{_PORTABLE}.skeleton"] = _json_tensor(skeleton)
    if model is not None:
        for name, value in model.state_dict().items():
            state[f"model.{name}"] = value.detach()
    if extra is not None:
        _flatten_into(state, f"extra.rank{rank}", dict(extra))
    return state


_LOCAL = "acco.local"
_STORED = "<a DCP entry>"  # where a per-parameter value of the local loop's state was stored


def _local_entries(state: dict[str, Any], local: dict[str, Any], replica: int, rank: int) -> None:
    """One replica's local-loop state as this rank holds it (:func:`acco.portable.local_to_portable`):
    its per-parameter values under ``acco.local.replica{r}`` (DTensor blocks, which the ranks
    of the replica group write together; the global values and the estimate's common part,
    identical on every replica, under ``acco.local.shared``), the rest (counters, the plan,
    this rank's residuals and place) under ``acco.local.replica{r}.rank{g}``."""
    rest = dict(local)
    for key in LOCAL_PER_PARAM:
        if local.get(key) is None:
            continue
        scope = "shared" if key in LOCAL_SHARED else f"replica{replica}"
        for pid, value in enumerate(v for group in local[key] for v in group):
            state[f"{_LOCAL}.{scope}.{key}.{pid}"] = value
        rest[key] = _STORED
    rest["inner"], offset = [], 0
    for saved, group in zip(local["inner"], local["live"]):
        kept: dict[Any, dict[str, Any]] = {}
        for i, entry in saved["state"].items():
            kept[i] = {}
            for name, value in entry.items():
                if per_element(value):
                    state[f"{_LOCAL}.replica{replica}.inner.{offset + int(i)}.{name}"] = value
                    value = _STORED
                kept[i][name] = value
        rest["inner"].append({**saved, "state": kept})
        offset += len(group)
    _flatten_into(state, f"{_LOCAL}.replica{replica}.rank{rank}", rest)


def _local_source(entries: Mapping[str, Any], replicas: int, replica: int, rank: int) -> tuple[int, int, bool] | None:
    """Which saved local-loop state this rank loads: ``(replica, rank, own)``. Its own replica's
    at the same number of replicas, replica 0's otherwise (docs/checkpoints.md); the skeleton of
    this very rank where it was saved, else the replica's first rank's; ``own``: the same rank
    at the same number of replicas (only then are its residuals this rank's). None: no local state saved."""
    saved: dict[int, list[int]] = {}
    for key in entries:
        parts = key.split(".")
        if key.startswith(f"{_LOCAL}.replica") and key.endswith(".skeleton") and len(parts) == 5:
            saved.setdefault(int(parts[2][len("replica"):]), []).append(int(parts[3][len("rank"):]))
    if not saved:
        return None
    source = replica if len(saved) == replicas and replica in saved else 0
    if source not in saved:
        raise ValueError(f"the checkpoint's local-mode state has no replica {source} (replicas: {sorted(saved)})")
    own = len(saved) == replicas and source == replica and rank in saved[source]
    return source, rank if rank in saved[source] else min(saved[source]), own


def _local_templates(entries: Mapping[str, Any], source: tuple[int, int, bool], params: list[Tensor],
                     path: Path) -> dict[str, Tensor]:
    """Where DCP reads the local-loop state this rank loads: per-parameter values shaped like
    this rank's parameters (DCP reshards them from the saved mesh), the rest whole."""
    replica, rank, _ = source
    state: dict[str, Tensor] = {}
    for key, entry in entries.items():
        parts = key.split(".")
        if key.startswith(f"{_LOCAL}.replica{replica}.rank{rank}."):
            state[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
        elif key.startswith((f"{_LOCAL}.shared.", f"{_LOCAL}.replica{replica}.")) and not parts[3].startswith("rank"):
            pid = int(parts[4])
            if pid >= len(params):
                raise ValueError(f"{path}: the checkpoint holds more parameters than this optimizer ({len(params)})")
            state[key] = _template(params[pid], entry, key, path)
    return state


def _local_state(state: Mapping[str, Tensor], source: tuple[int, int, bool], params: list[list[Tensor]]) -> dict[str, Any]:
    """The local-loop state read by :func:`_local_templates`, as this rank's own."""
    replica, rank, own = source
    rest = _unflatten(state, f"{_LOCAL}.replica{replica}.rank{rank}")
    counts = [len(group) for group in params]
    for key in LOCAL_PER_PARAM:
        if _stored(rest.get(key)):
            scope = "shared" if key in LOCAL_SHARED else f"replica{replica}"
            values = [state[f"{_LOCAL}.{scope}.{key}.{pid}"] for pid in range(sum(counts))]
            rest[key] = [values[sum(counts[:g]) : sum(counts[: g + 1])] for g in range(len(counts))]
    offset = 0
    for saved, count in zip(rest["inner"], counts):
        for i, entry in saved["state"].items():
            for name, value in entry.items():
                if _stored(value):
                    entry[name] = state[f"{_LOCAL}.replica{replica}.inner.{offset + int(i)}.{name}"]
        offset += count
    if not own:  # another rank's residuals would be counted twice (docs/checkpoints.md)
        rest["residuals"] = None
    return local_from_portable(rest, params)


def _stored(value: Any) -> bool:
    return isinstance(value, str) and value == _STORED


def _load_portable(path: Path, entries: Mapping[str, Any], optimizer: AccoOptimizer, model: nn.Module | None) -> dict[str, Any]:
    """:func:`load` of a checkpoint written on a mesh (:func:`_portable_entries`), into any layout: each
    entry is read into a tensor shaped like this rank's parameter (a DTensor with its mesh
    and placements, or the whole tensor), DCP resharding it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from acco.safe_reader import SafeFileSystemReader

    params = [p for group in optimizer.param_groups for p in group["params"]]
    head = torch.empty(entries[f"{_PORTABLE}.skeleton"].size, dtype=torch.uint8)
    state: dict[str, Any] = {f"{_PORTABLE}.skeleton": head}
    local = _local_source(entries, optimizer.world_size, optimizer.rank, Collectives.global_rank())
    if local is not None:
        state.update(_local_templates(entries, local, params, path))
    for key, entry in entries.items():
        if not isinstance(entry, dcp.metadata.TensorStorageMetadata):
            raise ValueError(f"{path}: entry {key!r} is not a tensor; refusing to unpickle it")
        if key.startswith(f"{_PORTABLE}.") and not key.endswith(".skeleton"):
            pid = int(key.split(".")[2])
            if pid >= len(params):
                raise ValueError(f"{path}: the checkpoint holds more parameters than this optimizer ({len(params)})")
            state[key] = _template(params[pid], entry, key, path)
        elif key.startswith("extra."):
            state[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
    model_keys: dict[str, str] = {}
    if model is not None:
        for name, value in model.state_dict().items():
            key = f"model.{name}"
            if key not in entries or tuple(entries[key].size) != tuple(value.shape):
                raise ValueError(f"{path}: the saved model does not match this model ({name})")
            state[key] = value.detach().clone()
            model_keys[key] = name
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(path), **_dcp_group(optimizer))
    except (Exception, CheckpointException) as error:  # DCP's own exception is a BaseException
        raise ValueError(f"{path}: reading the checkpoint failed: {error}") from error
    skeleton = json.loads(bytes(state[f"{_PORTABLE}.skeleton"].tolist()).decode())
    portable: dict[str, Any] = {"param_groups": skeleton["param_groups"], "state": {}}
    if local is not None:
        groups = [group["params"] for group in optimizer.param_groups]
        portable["param_groups"][0]["acco"]["local"] = _local_state(state, local, groups)
    for pid, keys in skeleton["state"].items():
        entry = {}
        for key, how in keys.items():
            if how.get("tensor"):
                entry[key] = state[f"{_PORTABLE}.{pid}.{key}"]
            elif how["dtype"] is not None:
                entry[key] = torch.tensor(how["value"], dtype=getattr(torch, how["dtype"].removeprefix("torch.")))
            else:
                entry[key] = how["value"]
        portable["state"][int(pid)] = entry
    target = portable
    optimizer.check_state_dict(target)
    if model is not None:
        model.load_state_dict({name: state[key] for key, name in model_keys.items()})
    optimizer.load_state_dict(target)
    own = f"extra.rank{Collectives.global_rank()}"
    prefix = own if any(k.startswith(own + ".") for k in state) else "extra.rank0"
    return _unflatten(state, prefix) if any(k.startswith(prefix + ".") for k in state) else {}


def _template(param: Tensor, entry: Any, key: str, path: Path) -> Tensor:
    """Where DCP reads one per-parameter entry: shaped like ``param`` (a DTensor's block)."""
    if tuple(entry.size) != tuple(param.shape):
        raise ValueError(f"{path}: {key} has shape {tuple(entry.size)}, this parameter {tuple(param.shape)}")
    if is_dtensor(param):
        return dtensor_like(torch.empty(local_tensor(param).shape, dtype=entry.properties.dtype, device=param.device),
                            param)  # fmt: skip
    return torch.empty(entry.size, dtype=entry.properties.dtype)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root`` (as named by ``root/latest``), or None."""
    root = Path(root)
    try:
        name = (root / _LATEST).read_text().strip()
    except OSError:
        return None
    candidate = root / name
    return candidate if (candidate / ".metadata").is_file() else None


def full_state_dict(optimizer: AccoOptimizer) -> dict[str, Any] | None:
    """The whole optimizer state in plain per-parameter form, on rank 0 (None elsewhere).

    ``{"param_groups": [...], "groups": [{"master": [tensor per parameter],
    "state": [dict per parameter], "pending_grad": [...]}], "num_updates": n}``: for export,
    inspection, or loading into an unsharded optimizer.

    .. warning:: Collective: every rank must call it.
    """
    local = optimizer.state_dict()
    buffer = io.BytesIO()
    torch.save(local, buffer)
    gathered = optimizer.collectives.gather_bytes(buffer.getvalue())
    if gathered is None:
        return None
    saved = [torch.load(io.BytesIO(b), weights_only=True) for b in gathered]
    groups = [canonical(saved, index) for index in range(len(saved[0]["acco"]["groups"]))]
    return {
        "param_groups": saved[0]["param_groups"],
        "num_updates": saved[0]["acco"]["num_updates"],
        "groups": [{"master": g.master, "state": g.state, "pending_grad": g.grad_sum} for g in groups],
    }


# --------------------------------------------------------------------- resharding


def reshard(saved: list[dict[str, Any]], optimizer: AccoOptimizer) -> dict[str, Any]:
    """``optimizer``'s own state dict, re-partitioned from every old rank's state dict."""
    first = saved[0]["acco"]
    if len(first["groups"]) != len(optimizer.param_groups):
        raise ValueError(
            f"checkpoint has {len(first['groups'])} param groups, this optimizer {len(optimizer.param_groups)}"
        )
    rank = optimizer.rank
    groups = []
    for index, plan in enumerate(optimizer.shard_plans):
        old = first["groups"][index]
        if [list(s.shape) for s in plan.slots] != old["shapes"]:
            raise ValueError(f"param group {index}: the checkpoint's parameter shapes differ from this model's")
        header = {k: old[k] for k in ("optimizer_class", "param_dtype", "reduce_dtype", "shapes")}
        dtypes = {"master": old["master"].dtype, "grad_accumulator": old["grad_accumulator"].dtype,
                  "in_flight_result": None if old["in_flight_result"] is None else old["in_flight_result"].dtype}
        groups.append(rank_group_state(canonical(saved, index), plan, rank, header, dtypes))
    round_ = rank_round(round_sums([s["acco"]["round"] for s in saved]), rank)
    return {
        "state": {},
        "param_groups": saved[0]["param_groups"],
        "acco": {**first, "rank": rank, "world_size": optimizer.world_size, "round": round_, "groups": groups},
    }


def _needs_reshard(saved: list[dict[str, Any]], optimizer: AccoOptimizer) -> bool:
    first = saved[0]["acco"]
    layouts = [g["layout"] for g in first["groups"]]
    return len(saved) != optimizer.world_size or layouts != [p.layout.value for p in optimizer.shard_plans]


# ------------------------------------------------------------ tensors-only storage


def _flatten_into(out: dict[str, Tensor], prefix: str, value: Any) -> None:
    """Tensors to ``out[prefix.tN]``; everything else to JSON in ``out[prefix.skeleton]``."""
    tensors: list[Tensor] = []

    def encode(v: Any) -> Any:
        if isinstance(v, Tensor):
            tensors.append(v.detach().cpu())
            return {"tensor": len(tensors) - 1}
        if isinstance(v, dict):
            return {"dict": [[encode(k), encode(x)] for k, x in v.items()]}
        if isinstance(v, tuple):
            return {"tuple": [encode(x) for x in v]}
        if isinstance(v, list):
            return {"list": [encode(x) for x in v]}
        if v is None or isinstance(v, (bool, int, float, str)):
            return {"value": v}
        raise TypeError(f"cannot store a {type(v).__name__} in an acco checkpoint")

    out[f"{prefix}.skeleton"] = _json_tensor(encode(value))
    for number, tensor in enumerate(tensors):
        out[f"{prefix}.t{number}"] = tensor


def _unflatten(state: Mapping[str, Tensor], prefix: str) -> Any:
    skeleton = json.loads(bytes(state[f"{prefix}.skeleton"].tolist()).decode())

    def decode(v: dict[str, Any]) -> Any:
        (kind, content), = v.items()
        if kind == "tensor":
            return state[f"{prefix}.t{content}"]
        if kind == "dict":
            return {decode(k): decode(x) for k, x in content}
        if kind == "tuple":
            return tuple(decode(x) for x in content)
        if kind == "list":
            return [decode(x) for x in content]
        return content

    return decode(skeleton)


def _prune(root: Path, keep: int, newest: Path) -> None:
    complete = [d for d in root.iterdir() if (d / ".metadata").is_file() and d != newest]
    complete.sort(key=lambda d: d.stat().st_mtime)
    for old in complete[: max(0, len(complete) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)


def _write_atomically(path: Path, text: str) -> None:
    # A name of this process's own: jobs that save beside each other (elastic replica groups
    # in one folder) never write the same temporary file; the last rename wins, whole.
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _writers(optimizer: AccoOptimizer) -> Collectives:
    """The ranks that write and read a checkpoint: every rank of the mesh (the default
    group) with DTensor parameters, acco's group otherwise."""
    return Collectives.from_user_group(None) if optimizer.on_mesh else optimizer.collectives


def _dcp_group(optimizer: AccoOptimizer) -> dict[str, Any]:
    comm = _writers(optimizer)
    if comm.active:
        return {"process_group": comm.group}
    return {"no_dist": True}


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    # DCP warns that it assumes a single process even when told so with no_dist=True.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _digest(tensor: Tensor) -> str:
    """A position-weighted byte sum: catches flipped, shifted or zeroed bytes (not forgery)."""
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
    weights = torch.arange(data.numel(), dtype=torch.int64) % 65521 + 1
    return f"{data.numel()}:{int(data.sum())}:{int(((data + 1) * weights).sum())}"


def _json_tensor(value: Any) -> Tensor:
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
