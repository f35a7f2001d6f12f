"""Two emulated nodes: FSDP2 inside each node and acco across them, against FSDP2's own HSDP,
behind a rate-limited link between the nodes; and acco's memory per rank on 2-D meshes.

    sudo $(which python) benchmarks/two_nodes.py            # the two-node run, then the memory table
    sudo $(which python) benchmarks/two_nodes.py --quick    # a smoke run of both, into results/scratch/
    python benchmarks/two_nodes.py --memory-only            # the memory table alone: plain torchrun, no root

The two-node run: 4 ranks, 2 per node, each node a network namespace whose loopback is the
fast link inside it, the nodes joined by a veth pair carrying a tbf (benchmarks/netns.py).
The mesh is ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))``:
``shard`` inside a node, ``replicate`` across the link (checked at start). Every method
trains the same GPT on the same micro-batches for the same wall-clock budget:

- ``hsdp``: ``fully_shard(block, mesh=mesh)`` per block and on the root (HSDP: reduce-scatter
  inside the node, all-reduce across in the last micro-batch's backward) + ``torch.optim.AdamW``;
- ``fsdp-acco-sync`` / ``fsdp-acco`` / ``fsdp-acco-aww``: ``fully_shard(..., mesh=mesh["shard"])``
  + ``AccoOptimizer(model, AdamW, process_group=mesh["replicate"].get_group())`` in mode
  ``sync``, ``acco`` with the fixed loop, ``acco`` with the ``ready()`` loop;
- ``flat-acco``: no FSDP2, flat acco (mode ``acco``) on the 4 ranks.

What it reports and how: benchmarks/README.md, "Two nodes".
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common
import memory
from time_to_loss import AgreedClock, warmup_constant
from examples.train_gpt import Dist, eval_batches, evaluate, param_groups

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import acco

__all__ = ["BENCHMARK", "METHODS", "account", "blocks", "runtimes", "targets"]


@dataclass(frozen=True)
class Spec:
    """A method of this benchmark: how tables name it, what shards the model inside a
    replica group, and acco's mode (None: FSDP2's HSDP with AdamW)."""

    label: str
    inner: str  # "hsdp": FSDP2 on the 2-D mesh; "fsdp": FSDP2 on mesh["shard"]; "none": plain model
    mode: str | None = None
    ready_loop: bool = False  # common.train_round keeps computing while not ready()
    local: dict[str, Any] | None = None  # mode="local": sync_every, sync_delay, outer_bits (absent: the library's default)


METHODS: dict[str, Spec] = {
    "hsdp": Spec("FSDP2 HSDP (2-D mesh, all-reduce across nodes) + AdamW", "hsdp"),
    "fsdp-acco-sync": Spec("FSDP2 inside + acco `sync` across", "fsdp", "sync"),
    "fsdp-acco": Spec("FSDP2 inside + acco `acco` across", "fsdp", "acco"),
    "fsdp-acco-aww": Spec("FSDP2 inside + acco `acco` across, `ready()` loop", "fsdp", "acco", ready_loop=True),
    "flat-acco": Spec("flat acco `acco` on 4 ranks (no FSDP2)", "none", "acco"),
    "fsdp-local": Spec("FSDP2 inside + acco `local` across, H = 16, default delay and bits", "fsdp", "local",
                       local={"sync_every": 16}),
    "fsdp-local-blocking": Spec("FSDP2 inside + acco `local` across, H = 16, blocking", "fsdp", "local",
                                local={"sync_every": 16, "sync_delay": 0}),
    # H = 8, where the outer defaults were measured: the estimate rule with auto landing, and blocking.
    "fsdp-local-h8-estimate": Spec("FSDP2 inside + acco `local` across, H = 8, estimate, auto", "fsdp", "local",
                                   local={"sync_every": 8, "sync_delay": "auto", "overlap": "estimate"}),
    "fsdp-local-h8-blocking": Spec("FSDP2 inside + acco `local` across, H = 8, blocking", "fsdp", "local",
                                   local={"sync_every": 8, "sync_delay": 0}),
    "fsdp-local-b32": Spec("FSDP2 inside + acco `local` across, H = 16, default delay, 32 bits", "fsdp", "local",
                           local={"sync_every": 16, "outer_bits": 32}),
    # The default before the estimate rule: half a round in flight, those steps dropped, DiLoCo's outer SGD.
    "fsdp-local-discard": Spec("FSDP2 inside + acco `local` across, H = 8, delay 4, discard, outer (0.7, 0.9)",
                               "fsdp", "local", local={"sync_every": 8, "sync_delay": 4, "overlap": "discard",
                                                       "outer_optimizer": functools.partial(
                                                           torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)}),
    # Nodes of different speeds (--slow-node): every replica sync_every steps (each waits for the
    # slowest), or each in proportion to its speed (the library's default pacing).
    "fsdp-local-h8-lockstep": Spec("FSDP2 inside + acco `local` across, H = 8, blocking, lockstep", "fsdp", "local",
                                   local={"sync_every": 8, "sync_delay": 0, "pacing": "lockstep"}),
    "fsdp-local-h8-speed": Spec("FSDP2 inside + acco `local` across, H = 8, blocking, paced by speed", "fsdp",
                                "local", local={"sync_every": 8, "sync_delay": 0, "pacing": "speed"}),
    # Issue 58: H chosen from the link and the step time, against the library's defaults.
    "fsdp-local-defaults": Spec("FSDP2 inside + acco `local` across, the library's defaults", "fsdp", "local",
                                local={}),
    "fsdp-local-auto": Spec("FSDP2 inside + acco `local` across, sync_every=\"auto\"", "fsdp", "local",
                            local={"sync_every": "auto"}),
    # No outer round before finish(): the inner steps' rate with nothing crossing the link.
    "fsdp-local-compute-only": Spec("FSDP2 inside, inner steps only (no outer round until the end)", "fsdp", "local",
                                    local={"sync_every": 10**9, "sync_delay": 0}),
}
# The bar's comparison of inner-step rates: acco local's against the compute-only rate.
COMPUTE_ONLY = "fsdp-local-compute-only"
MESHES = ((1, 4), (2, 2), (4, 1))  # (R, S) of the memory table, on 4 ranks
# The memory table's model: large enough that buffers dwarf the activations and the padding.
MEMORY_MODEL = common.ModelConfig(n_layer=4, n_embd=256, n_head=4, seq_len=64, batch_size=1)
KINDS = ("parameters", "gradients", "accumulator", "hand-over", "all-gather buffer", "master shard",
         "master gradient", "optimizer state", "estimate copy", "handed over", "global values", "outer residual",
         "outer common term", "outer state")
ACCO_BUFFERS = {"grad_accumulator": "accumulator", "grad_handover": "hand-over", "gathered": "all-gather buffer",
                "master": "master shard", "master_grad": "master gradient", "estimate_copy": "estimate copy",
                "handed_over": "handed over", "global_values": "global values", "outer_residual": "outer residual",
                "common_term": "outer common term"}
MiB = 2**20


def label(name: str) -> str:
    return METHODS[name].label if name in METHODS else name


def arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--rate", default="60mbit", help="tc rate of the link between the two nodes (each direction)")
    add("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    add("--budget", type=float, default=60.0, help="seconds of training per method (the same for all)")
    add("--slow-node", type=int, default=1, metavar="FACTOR",
        help="node 1's ranks take FACTOR times longer per micro-batch (they sleep FACTOR - 1 times its CPU time)")
    add("--repeats", type=int, default=2, help="runs of every method, in rotated order; the table shows medians")
    add("--micro-batches", type=common.even, default=4, help="micro-batches per rank per optimizer update")
    add("--lr", type=float, default=3e-3)
    add("--warmup", type=int, default=10, help="optimizer updates of linear warm-up, then constant")
    add("--grad-clip", type=float, default=1.0, help="0: off")
    add("--eval-batches", type=int, default=32)
    add("--link-mb", type=float, default=8.0, help="MB all-reduced to measure the links inside and across")
    common.model_arguments(parser, common.ModelConfig(n_embd=192, seq_len=64))
    add("--nproc-per-node", type=int, default=2, help="ranks per node (S); the nodes are 2 (R)")
    add("--memory-only", action="store_true", help="only the memory table (plain torchrun, no root needed)")
    add("--skip-memory", action="store_true", help="only the two-node run")
    add("--memory-updates", type=int, default=2, help="updates trained before measuring one, in the memory table")
    add("--max-quiet-wait", type=float, default=120.0,
        help="seconds to wait, before each method, for other processes to leave the CPU")
    add("--phase", choices=["nodes", "memory"], default=None, help=argparse.SUPPRESS)  # set for the rank launches
    add("--mesh", default="flat", help=argparse.SUPPRESS)  # the memory launch's (R, S): RxS or flat


def check(args: argparse.Namespace) -> str | None:
    if args.budget <= 0:
        return f"--budget must be positive, got {args.budget}"
    if args.memory_only and args.skip_memory:
        return "--memory-only and --skip-memory leave nothing to run"
    return None


# ------------------------------------------------------------------------------ methods


class MeshMethod(common.Method):
    """A method of this benchmark, driven by ``common.train_round`` like every benchmark's:
    ``backward()`` / ``fold()`` per micro-batch, ``end_round()`` at the boundary."""

    def __init__(self, name: str, config: common.ModelConfig, micro_batches_per_update: int, model: nn.Module,
                 rounds_per_update: int = 1) -> None:
        # common.Method's attributes, with this benchmark's Spec (the registry there lists the flat methods)
        self.name, self.spec, self.config, self.model = name, METHODS[name], config, model
        self.rounds_per_update = rounds_per_update
        self.micro_batches_per_update = micro_batches_per_update
        self.micro_batches_per_round = micro_batches_per_update // rounds_per_update
        self.loss_scale = 1.0 / self.micro_batches_per_round


class HSDPMethod(MeshMethod):
    """FSDP2 HSDP on the 2-D mesh and AdamW on its DTensor parameters: every micro-batch's
    backward reduce-scatters inside the node; only the last one of an update all-reduces
    across nodes (``set_requires_all_reduce``: the others add into FSDP's partial output)."""

    def __init__(self, name: str, config: common.ModelConfig, micro_batches_per_update: int, mesh: DeviceMesh) -> None:
        model = common.build_model(config)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        super().__init__(name, config, micro_batches_per_update, model)
        self.opt = torch.optim.AdamW(param_groups(model, config.weight_decay), lr=config.lr, betas=config.betas)
        self._backwards = 0

    def backward(self, x: Tensor, y: Tensor) -> Tensor:
        self._backwards += 1
        self.model.set_requires_all_reduce(self._backwards % self.micro_batches_per_round == 0)
        return super().backward(x, y)

    def end_round(self) -> bool:
        if self.config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return True

    def base_optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.opt]


class AccoOnMesh(common.AccoRounds, MeshMethod):
    """acco across ``process_group`` (the replicate dimension, or every rank for flat acco),
    on a model that FSDP2 shards over ``shard_mesh`` (None: a plain model), with the
    issue's API: ``AccoOptimizer(model, AdamW, process_group=...)`` (param groups: no decay
    on biases, LayerNorms and embeddings, as every method). Weight 1 per micro-batch."""

    def __init__(self, name: str, config: common.ModelConfig, micro_batches_per_update: int,
                 shard_mesh: DeviceMesh | None, process_group: dist.ProcessGroup | None) -> None:
        model = common.build_model(config)
        if shard_mesh is not None:
            for block in model.blocks:
                fully_shard(block, mesh=shard_mesh)
            fully_shard(model, mesh=shard_mesh)
        spec = METHODS[name]
        super().__init__(name, config, micro_batches_per_update, model, 2 if spec.mode == "acco" else 1)
        self.loss_scale = 1.0  # accumulate() averages over micro-batches itself
        self.opt = acco.AccoOptimizer(param_groups(model, config.weight_decay), torch.optim.AdamW,
                                      process_group=process_group, mode=spec.mode, lr=config.lr, betas=config.betas,
                                      max_grad_norm=config.max_grad_norm, timeout=datetime.timedelta(minutes=5),
                                      **(spec.local or {}))
        # acco's committed weight counts the micro-batches of its group's ranks; each of them
        # stands for a replica group of opt.replica_size ranks (FSDP2 averaged over them already)

    def fold(self) -> None:
        self.opt.accumulate()

    def committed_micro_batches(self, counted: int) -> float:
        return self.opt.committed_weight * self.opt.replica_size

    def inner_optimizers(self) -> list[torch.optim.Optimizer]:
        return self.opt.inner_optimizers

    def base_optimizers(self) -> list[torch.optim.Optimizer]:
        return [b for b in self.opt.base_optimizers if b is not None]

    def close(self) -> None:
        self.opt.close()


def build(name: str, config: common.ModelConfig, micro_batches_per_update: int, mesh: DeviceMesh) -> MeshMethod:
    """``name`` on ``mesh`` (("replicate", "shard")) with a fresh model, the same initial
    parameters every time.

    Raises:
        common.UnsupportedMethod: the installed acco refuses DTensor parameters (before any
            collective, so on every rank alike).
    """
    spec = METHODS[name]
    if spec.inner == "hsdp":
        return HSDPMethod(name, config, micro_batches_per_update, mesh)
    try:
        if spec.inner == "fsdp":
            return AccoOnMesh(name, config, micro_batches_per_update, mesh["shard"], mesh["replicate"].get_group())
        return AccoOnMesh(name, config, micro_batches_per_update, None, None)
    except (TypeError, ValueError, NotImplementedError) as error:
        raise common.UnsupportedMethod(f"{name}: {type(error).__name__}: {error}") from error


# ------------------------------------------------------------------------------- memory


def local(t: Tensor) -> Tensor:
    """A DTensor's local tensor (what this rank holds), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def account(method: MeshMethod) -> dict[str, Any]:
    """This rank's tensor bytes per kind now: parameters (local shards), gradients (local
    shards; a ``p.grad`` that is a view into a larger storage is acco's accumulator, counted
    from ``buffer_bytes()``), acco's buffers, and the base optimizer's state."""
    sizes, seen = dict.fromkeys(KINDS, 0), set()
    is_acco = isinstance(method, AccoOnMesh)

    def add(t: Tensor, kind: str) -> None:
        t = local(t)
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen and key[1]:
            seen.add(key)
            sizes[kind] += key[1]

    params = list(method.model.parameters())
    for p in params:
        add(p, "parameters")
    if is_acco:
        for group in method.opt.buffer_bytes():
            for buffer, nbytes in group.items():
                sizes[ACCO_BUFFERS[buffer]] += nbytes
    local_mode = is_acco and method.spec.mode == "local"  # base optimizers: the outer one, on 1/R shards
    for opt in method.base_optimizers():
        for state in opt.state.values():
            for t in state.values():
                if isinstance(t, Tensor):
                    add(t, "outer state" if local_mode else "optimizer state")
    for opt in method.inner_optimizers() if local_mode else []:
        for state in opt.state.values():
            for t in state.values():
                if isinstance(t, Tensor):
                    add(t, "optimizer state")
    for p in params:
        if p.grad is not None:
            g = local(p.grad)
            if not (is_acco and g.untyped_storage().nbytes() > g.nbytes):
                add(g, "gradients")
    return {"bytes": sizes, "total": sum(sizes.values())}


def largest(accounts: list[dict[str, Any]]) -> dict[str, Any]:
    return max(accounts, key=lambda a: a["total"])


def peak_rss_reset() -> int:
    """Resets the peak resident size to the current one; returns the current one (bytes)."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # Linux >= 4.0
    return memory.proc_status_bytes("VmRSS")


# ----------------------------------------------------------------------------- the ranks


def node_of_rank() -> str:
    """This rank's node: its network namespace in the two-node run, else its host."""
    return os.environ.get("ACCO_BENCH_NETNS") or os.uname().nodename


def mesh_layout(mesh: DeviceMesh) -> dict[str, Any]:
    """Which ranks share each mesh dimension's group, and whether ``shard`` stays inside a
    node and ``replicate`` spans the nodes (gathered on every rank)."""
    nodes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, node_of_rank())
    groups = {dim: dist.get_process_group_ranks(mesh[dim].get_group()) for dim in ("replicate", "shard")}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, groups)
    shard_groups = sorted({tuple(g["shard"]) for g in everyone})
    replicate_groups = sorted({tuple(g["replicate"]) for g in everyone})
    names = {n: f"node {'AB'[i] if i < 2 else i}" for i, n in enumerate(dict.fromkeys(nodes))}
    return {"mesh": [list(row) for row in mesh.mesh.tolist()], "nodes": [names[n] for n in nodes],
            "shard_groups": shard_groups, "replicate_groups": replicate_groups,
            "shard_inside_nodes": all(len({nodes[r] for r in g}) == 1 for g in shard_groups),
            "replicate_across_nodes": all(len({nodes[r] for r in g}) == len(g) for g in replicate_groups)}


def link_check(mesh: DeviceMesh, megabytes: float) -> dict[str, Any]:
    """An all-reduce of ``megabytes`` on the ``shard`` groups (inside a node) and on the
    ``replicate`` groups (across the link), every group at once; the slowest rank's time and
    the bus bandwidth 2 (n-1)/n x bytes / time (what each rank sends through its link)."""
    t = torch.ones(int(megabytes * 1e6) // 4)
    out = {}
    for dim in ("shard", "replicate"):
        group = mesh[dim].get_group()
        n = dist.get_world_size(group)
        dist.all_reduce(t, group=group)  # connections made, buffers allocated
        times = []
        for _ in range(3):
            dist.barrier()
            started = time.perf_counter()
            dist.all_reduce(t, group=group)
            (elapsed,) = common.all_reduce([time.perf_counter() - started], "max")
            times.append(elapsed)
        best = min(times)
        out["inside" if dim == "shard" else "across"] = {
            "group_size": n, "seconds": best, "bus_mbit_s": 2 * (n - 1) / n * t.nbytes * 8 / best / 1e6}
    return out


def link_bytes() -> int:
    """Bytes sent so far by this node on its end of the link between the nodes (local rank 0
    of each node reads its counter, summed over the ranks); 0 outside the two-node run."""
    interface = os.environ.get("ACCO_BENCH_LINK")
    sent = 0
    if interface and int(os.environ.get("LOCAL_RANK", 0)) == 0:
        sent = int(Path(f"/sys/class/net/{interface}/statistics/tx_bytes").read_text())
    return int(common.all_reduce([sent])[0])


def held_out_loss(method: MeshMethod, config: common.ModelConfig, eval_set: list[tuple[Tensor, Tensor]]) -> float:
    """The held-out loss of the method's (committed) parameters: gathered into a plain model
    on every rank (DTensor ``full_tensor()``, collective), each rank evaluating a share of
    the batches."""
    state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in method.model.state_dict().items()}
    plain = common.build_model(config)
    plain.load_state_dict(state)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = [b for i, b in enumerate(eval_set) if i % world == rank]
    total = evaluate(plain, mine) * len(mine) if mine else 0.0
    return common.all_reduce([total])[0] / len(eval_set)


def replicas_agree(method: MeshMethod) -> float:
    """The largest difference between the ranks' full parameters (0: every replica holds
    the same model)."""
    full = torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach().reshape(-1)
                      for p in method.model.parameters()])
    low, high = full.clone(), full.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return float((high - low).abs().max())


def train_for_budget(name: str, args: argparse.Namespace, config: common.ModelConfig, mesh: DeviceMesh,
                     next_batch: Callable[[], tuple[Tensor, Tensor]],
                     eval_set: list[tuple[Tensor, Tensor]]) -> dict[str, Any]:
    """``name`` trained for the budget on the agreed clock; then its held-out loss, its
    throughput, the bytes it sent across the link and its memory per rank."""
    rss_before = peak_rss_reset()
    setup_started = time.perf_counter()
    try:
        method = build(name, config, args.micro_batches, mesh)
    except common.UnsupportedMethod as error:
        return {"method": name, "skipped": str(error)}
    scheduler = torch.optim.lr_scheduler.LambdaLR(method.opt, warmup_constant(args.warmup))
    setup_s = time.perf_counter() - setup_started
    accounts: list[dict[str, Any]] = []
    window = common.Window(args.max_quiet_wait)
    sent_before = link_bytes()
    window.open()
    clock = AgreedClock()
    # Node 1's ranks (the second replica group) emulate slower devices with --slow-node.
    slowdown = float(args.slow_node) if dist.get_rank() // (dist.get_world_size() // 2) == 1 else 1.0
    # acco's local steps stop on the optimizer's own agreement, at an outer round: the agreed
    # clock's all-reduce at every inner step would hold paced replicas in lockstep.
    local_opt = method.opt if method.spec.mode == "local" else None
    if local_opt is not None:
        local_opt.stop_after(seconds=args.budget)
    computed = rounds = counted = 0
    while True:
        record = common.train_round(method, next_batch, before_boundary=lambda _: accounts.append(account(method)),
                                    slowdown=slowdown)  # fmt: skip
        accounts.append(account(method))  # and after the boundary (acco: a round in flight)
        computed, rounds = computed + len(record.losses), rounds + 1
        if record.committed:
            counted += 1
            scheduler.step()
        if local_opt is not None:
            if local_opt.should_stop:
                break
        elif clock.budget_reached(clock.exchange(clock.elapsed()), args.budget):
            break
    clock.close()
    if method.finish():  # acco: the update in flight lands, on the clock
        counted += 1
    end_s, measured = clock.elapsed(), window.close()
    sent = link_bytes() - sent_before
    peak_rss_added = memory.proc_status_bytes("VmHWM") - rss_before
    updates = method.committed_updates(counted)
    mine = largest(accounts)
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, {"tensors": mine, "peak_rss_added_bytes": peak_rss_added})
    eval_started = time.perf_counter()
    result: dict[str, Any] = {
        "method": name, "final_loss": held_out_loss(method, config, eval_set), "end_s": end_s, "updates": updates,
        "rounds": rounds, "micro_batches_computed": common.all_reduce([computed])[0],
        "committed_micro_batches": method.committed_micro_batches(counted),
        "link_bytes": sent, "link_bytes_per_update": sent / updates if updates else None,
        "replicas_max_difference": replicas_agree(method), "per_rank_memory": per_rank,
        "foreign_cpu_share": measured["foreign_cpu_share"], "waited_for_quiet_s": measured["waited_for_quiet_s"],
        "setup_s": setup_s, "eval_s": time.perf_counter() - eval_started,
        "local_parameters": sum(local(p).numel() for p in method.model.parameters()),
    }
    result["samples_per_s"] = result["micro_batches_computed"] * config.batch_size / end_s
    result["committed_samples_per_s"] = result["committed_micro_batches"] * config.batch_size / end_s
    result["micro_batches_per_update"] = result["committed_micro_batches"] / dist.get_world_size() / max(1, updates)
    if method.round_stats():
        result["lane"] = common.lane_summary(method.round_stats())
    if method.spec.mode == "local":  # an update is an inner step; outer rounds apart
        steps = [0.0] * dist.get_world_size()
        steps[dist.get_rank()] = float(method.opt.num_updates + method.opt.skipped_updates)
        result.update(outer_rounds=method.opt.outer_rounds, inner_steps_per_s=updates / end_s,
                      sync_delay=method.opt.options.local.sync_delay,
                      round_every=[s.sync_every for s in method.round_stats() if s.sync_every is not None],
                      inner_steps_by_rank=[int(v) for v in common.all_reduce(steps)])
    method.close()
    return result


def nodes_rank(args: argparse.Namespace, ctx: Dist) -> dict[str, Any]:
    """The two-node run, on every rank."""
    shard = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size))
    mesh = init_device_mesh("cpu", (ctx.world_size // shard, shard), mesh_dim_names=("replicate", "shard"))
    layout = mesh_layout(mesh)
    if not (layout["shard_inside_nodes"] and layout["replicate_across_nodes"]):
        raise RuntimeError(f"the mesh does not lie on the nodes as intended: {layout}")
    if ctx.master:
        print(f"two nodes: mesh {layout['mesh']}, shard groups {layout['shard_groups']} (inside a node: "
              f"{layout['shard_inside_nodes']}), replicate groups {layout['replicate_groups']} (across the nodes: "
              f"{layout['replicate_across_nodes']})", flush=True)
    links = link_check(mesh, args.link_mb)
    if ctx.master:
        print("links: " + ", ".join(f"{k} {v['bus_mbit_s']:.0f} Mbit/s ({v['seconds'] * 1e3:.0f} ms for "
                                    f"{args.link_mb:g} MB)" for k, v in links.items()), flush=True)
    config = common.model_config(args)
    train_data, held_out = common.training_text(config.seq_len)
    eval_set = eval_batches(held_out, args.eval_batches, config.batch_size, config.seq_len, config.seed,
                            torch.device("cpu"))
    initial_loss = evaluate(common.build_model(config), eval_set)
    common.warm_up(config, common.batches(train_data, config, 0))
    repeats: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        runs: dict[str, Any] = {}
        for name in common.rotated(args.methods, repeat):  # no method always first
            next_batch = common.batches(train_data, config, config.seed + 1000 * ctx.rank)  # the same in every method
            started = time.perf_counter()
            runs[name] = r = train_for_budget(name, args, config, mesh, next_batch, eval_set)
            gc.collect()
            if ctx.master:
                print(f"[two nodes, repeat {repeat + 1}] {name:15s} " + (
                      f"skipped: {r['skipped']}" if "skipped" in r else
                      f"held-out loss {r['final_loss']:.4f} after {r['end_s']:.1f} s, {r['updates']} updates, "
                      f"{r['samples_per_s']:.1f} samples/s ({time.perf_counter() - started:.0f} s in all)"), flush=True)
        repeats.append({name: runs[name] for name in args.methods})
    return {"layout": layout, "links": links, "initial_loss": initial_loss, "ranks": ctx.world_size,
            "rate": os.environ.get("ACCO_BENCH_RATE", "not limited by the benchmark"),
            "threads_per_rank": torch.get_num_threads(), "repeats": repeats}


def memory_rank(args: argparse.Namespace, ctx: Dist) -> dict[str, Any]:
    """acco (mode ``acco``, the most buffers) on the ``--mesh`` (R, S) of the ranks, or flat:
    the largest bytes per kind before or after a round boundary of the update after
    ``--memory-updates`` updates, and the peak resident memory this process added."""
    config = MEMORY_MODEL
    next_batch = common.rank_batches(config, ctx.rank)
    shape = None if args.mesh == "flat" else tuple(int(n) for n in args.mesh.split("x"))
    name = "flat-acco" if shape is None else "fsdp-acco"
    mesh = init_device_mesh("cpu", shape or (1, ctx.world_size), mesh_dim_names=("replicate", "shard"))
    rss_before = peak_rss_reset()
    try:
        method = build(name, config, args.micro_batches, mesh)
    except common.UnsupportedMethod as error:
        return {"mesh": shape, "method": name, "skipped": str(error)}
    accounts: list[dict[str, Any]] = []
    for _ in range(args.memory_updates * method.rounds_per_update):
        common.train_round(method, next_batch)
    for _ in range(method.rounds_per_update):  # one update measured, before and after each boundary
        common.train_round(method, next_batch, before_boundary=lambda _: accounts.append(account(method)))
        accounts.append(account(method))
    method.finish()
    mine = {"tensors": largest(accounts), "peak_rss_added_bytes": memory.proc_status_bytes("VmHWM") - rss_before,
            "local_parameters": sum(local(p).numel() for p in method.model.parameters()),
            "state_elements": sum(local(s["exp_avg"]).numel() for b in method.base_optimizers()
                                  for s in b.state.values() if "exp_avg" in s)}
    method.close()
    per_rank: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(per_rank, mine)
    return {"mesh": shape, "method": name, "per_rank": per_rank,
            "parameters": sum(p.numel() for p in common.build_model(config).parameters())}


def rank(args: argparse.Namespace, ctx: Dist) -> dict[str, Any]:
    return memory_rank(args, ctx) if args.phase == "memory" else nodes_rank(args, ctx)


# ---------------------------------------------------------------------------- the driver


def run_two_nodes(args: argparse.Namespace) -> dict[str, Any]:
    """Rank 0's JSON of the two-node launch (benchmarks/netns.py's ``run_nodes``)."""
    from netns import run_nodes

    env = {"TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONWARNINGS": "ignore", "MALLOC_MMAP_THRESHOLD_": "65536"}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        code = run_nodes(args.nproc_per_node, [str(args.script), *args.argv, "--phase", "nodes", "--out", str(out)],
                         args.rate, env=env)
        if code:
            raise SystemExit(f"two-node ranks failed (exit {code})")
        return {**common.read_json(out), "runtime_s": time.perf_counter() - started}


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    previous = common.read_json(args.out) if args.out.exists() and (args.memory_only or args.skip_memory) else {}
    config = common.model_config(args)
    results: dict[str, Any] = {
        "config": {**config.as_dict(), "budget_s": args.budget, "micro_batches_per_update": args.micro_batches,
                   "warmup_updates": args.warmup, "schedule": "linear warm-up, then constant",
                   "eval_batches": args.eval_batches, "rate": args.rate, "repeats": args.repeats,
                   "nproc_per_node": args.nproc_per_node, "methods": args.methods, "slow_node": args.slow_node,
                   "parameters": sum(p.numel() for p in common.build_model(config).parameters())},
        "command": " ".join(["benchmarks/two_nodes.py", *args.argv]),
    }
    if not args.memory_only:
        print(f"two nodes: {args.nproc_per_node} ranks per node, {args.rate} between the nodes", flush=True)
        results["nodes"] = run_two_nodes(args)
    elif "nodes" in previous:
        results.update(config=previous["config"], command=previous["command"], nodes=previous["nodes"])
    if not args.skip_memory:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the ranks: freed buffers leave the RSS
        memory_started = time.perf_counter()
        runs = []
        for shape in ["%dx%d" % m for m in MESHES] + ["flat"]:  # fresh processes each: their own peak RSS
            print(f"memory: {shape}, 4 ranks", flush=True)
            runs.append(common.run_ranks(args, 4, "--phase", "memory", "--mesh", shape))
        results["memory"] = {"ranks": 4, "parameters": runs[0]["parameters"], "config": MEMORY_MODEL.as_dict(),
                             "runs": runs, "runtime_s": time.perf_counter() - memory_started}
    elif "memory" in previous:
        results["memory"] = previous["memory"]
    results["runtime_s"] = time.perf_counter() - started
    common.save(args, results)  # before the tables: a long run keeps its figures whatever happens next
    print(nodes_table(results) if "nodes" in results else "", memory_table(results["memory"])
          if "memory" in results else "", sep="\n\n")
    return results


# ------------------------------------------------------------------------------ the report


def worst(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    return max(per_rank, key=lambda r: r["tensors"]["total"])


def nodes_table(results: dict[str, Any]) -> str:
    """Per method, medians over the repeats; ratios are taken within each repeat (side by
    side), then their median."""
    data, config = results["nodes"], results["config"]
    repeats = data.get("repeats") or [data["methods"]]  # (a run from before --repeats: one)
    median = statistics.median
    rows = []
    for name in repeats[0]:
        done = [r for r in repeats if "skipped" not in r[name]]
        if not done:
            rows.append([label(name), f"skipped: {repeats[0][name]['skipped']}"] + [""] * 8)
            continue

        def ratio(key: str, base: str) -> str:
            pairs = [r[name][key] / r[base][key] for r in done if "skipped" not in r.get(base, {"skipped": 1})]
            return f" (x{median(pairs):.2f})" if pairs else ""

        def tensors(run: dict[str, Any]) -> float:
            return worst(run["per_rank_memory"])["tensors"]["total"]

        def rss(run: dict[str, Any]) -> float:
            return max(r["peak_rss_added_bytes"] for r in run["per_rank_memory"])

        flat = [r["flat-acco"] for r in done if "per_rank_memory" in r.get("flat-acco", {})]
        runs = [r[name] for r in done]
        sent = [r["link_bytes_per_update"] for r in runs if r.get("link_bytes_per_update")]
        rows.append([
            label(name), f"{median(r['final_loss'] for r in runs):.4f}",
            f"{median(r['samples_per_s'] for r in runs):.1f}{ratio('samples_per_s', 'hsdp')}",
            f"{median(r['updates'] for r in runs):g}", f"{median(r['micro_batches_per_update'] for r in runs):.1f}",
            f"{median(sent) / 1e6:.1f}" if sent else "",
            f"{median(tensors(r) for r in runs) / MiB:.1f}"
            + (f" (x{median(tensors(r) for r in runs) / median(tensors(f) for f in flat):.2f})" if flat else ""),
            f"{median(rss(r) for r in runs) / MiB:.0f}"
            + (f" (x{median(rss(r) for r in runs) / median(rss(f) for f in flat):.2f})" if flat else ""),
            f"{max(r['replicas_max_difference'] for r in runs):.1e}",
            f"{max(r['foreign_cpu_share'] for r in runs):.0%}"])
    layout, links = data["layout"], data["links"]
    head = (f"{common.describe(config, config['parameters'])}, {config['micro_batches_per_update']} micro-batches per "
            f"rank per update, AdamW lr {config['lr']:g} ({config['warmup_updates']} updates of warm-up, then "
            f"constant), clipping at {config['max_grad_norm']}, {config['budget_s']:g} s of training per method; "
            f"{data['ranks']} ranks ({data['threads_per_rank']} torch thread each on a 2-core machine): mesh "
            f"{layout['mesh']}, `shard` groups {layout['shard_groups']} inside a node "
            f"({'checked' if layout['shard_inside_nodes'] else '**not**'}), `replicate` groups "
            f"{layout['replicate_groups']} across the link "
            f"({'checked' if layout['replicate_across_nodes'] else '**not**'}). Link between the nodes: tbf "
            f"{common.rate_text(data['rate'])} each way, measured {links['across']['bus_mbit_s']:.0f} Mbit/s "
            "(all-reduce bus bandwidth, both replicate groups at once); inside a node (loopback) "
            f"{links['inside']['bus_mbit_s']:.0f} Mbit/s. Initial held-out loss "
            f"{data['initial_loss']:.4f}. Medians of {len(repeats)} repeat(s), methods in rotated order; ratios "
            "within each repeat, then their median; other load: the most CPU other processes took in a run.")
    return head + "\n\n" + common.md_table(
        ["method", "held-out loss after the budget", "samples/s (x HSDP)", "updates", "micro-batches per update",
         "MB across the link per update", "tensors per rank, MiB (x flat acco)", "peak RSS added, MiB (x flat acco)",
         "replicas differ by", "other load"], rows)


def memory_table(data: dict[str, Any]) -> str:
    """Per-rank MiB per kind on each mesh, and each kind times S (or R*S): constant when it
    falls as 1/S (1/(R*S))."""
    rows, scaled = [], []
    for run in data["runs"]:
        shape = run["mesh"]
        name = "flat, 4 ranks" if shape is None else f"R={shape[0]}, S={shape[1]}"
        if "skipped" in run:
            rows.append([name, f"skipped: {run['skipped']}"] + [""] * (len(KINDS) + 1))
            continue
        w = worst(run["per_rank"])
        kinds = dict.fromkeys(KINDS, 0) | w["tensors"]["bytes"]  # runs saved before a kind existed hold none of it
        rows.append([name, *[f"{kinds[k] / MiB:.2f}" for k in KINDS], f"**{w['tensors']['total'] / MiB:.2f}**",
                     f"{max(r['peak_rss_added_bytes'] for r in run['per_rank']) / MiB:.0f}"])
        r, s = shape or (data["ranks"], 1)
        p = data["parameters"]
        scaled.append([name, *[f"{kinds[k] * s / (4 * p):.3f}" for k in ("parameters", "accumulator", "hand-over",
                                                                           "all-gather buffer")],
                       *[f"{kinds[k] * r * s / (4 * p):.3f}" for k in ("master shard", "master gradient",
                                                                        "optimizer state", "estimate copy")]])
    return (f"GPT of {data['parameters'] / 1e6:.2f}M parameters (P), fp32, acco mode `acco`, {data['ranks']} ranks; "
            "MiB per rank (the largest rank), the most just before or after a round boundary:\n\n"
            + common.md_table(["mesh", *KINDS, "tensors", "peak RSS added"], rows)
            + "\n\nThe same bytes divided by 4P/S (per-replica-group kinds) or by 4P/(R S) (sharded across every "
              "rank): a kind that falls as 1/S (or 1/(R S)) reads the same on every row (flat acco: R = 4, S = 1):\n\n"
            + common.md_table(["mesh", "parameters x S", "accumulator x S", "hand-over x S", "all-gather buffer x S",
                               "master shard x RS", "master gradient x RS", "optimizer state x RS",
                               "estimate copy x RS"], scaled))


def blocks(results: dict[str, Any], figures: Path) -> dict[str, str]:
    data = results["two_nodes"]
    out = {}
    if "nodes" in data:
        out["two_nodes"] = nodes_table(data)
    if "memory" in data:
        out["two_nodes-memory"] = memory_table(data["memory"])
    others = [(stem, run) for stem, run in sorted(results.items()) if stem != "two_nodes" and "nodes" in run]
    if others:  # the same run at other rates (--out results/two_nodes-RATE.json)
        out["two_nodes-rates"] = "\n\n".join(f"**{common.rate_text(run['nodes']['rate'])}** "
                                              f"(`results/{stem}.json`): {nodes_table(run)}" for stem, run in others)
    return out


def targets(results: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    return []


def runtimes(results: dict[str, Any]) -> list[tuple[str, float]]:
    data = results["two_nodes"]
    rows = [("two_nodes", data["runtime_s"])]
    if "nodes" in data:
        rows.append(("  two nodes, 4 ranks", data["nodes"]["runtime_s"]))
    if "memory" in data:
        rows.append(("  memory table", data["memory"]["runtime_s"]))
    return rows


BENCHMARK = common.Benchmark("two_nodes", __doc__, arguments, rank, sweep, check=check,
                             quick={"budget": 10.0, "n_embd": 128, "eval_batches": 8, "link_mb": 2.0,
                                    "max_quiet_wait": 5.0, "memory_updates": 1, "repeats": 1})

if __name__ == "__main__":
    if "RANK" not in os.environ:  # the driver: on SIGTERM, an exception, so the namespaces' `finally` runs
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    if "--memory-only" not in sys.argv and "RANK" not in os.environ:
        from netns import NetnsError, check_requirements

        try:
            check_requirements()
        except NetnsError as error:
            raise SystemExit(f"two_nodes.py: {error}; or run `python benchmarks/two_nodes.py --memory-only`")
    common.main(BENCHMARK)
