"""Memory per rank: acco's three modes against DDP + ZeRO-1 and plain DDP + AdamW, as
tensor bytes by kind (at rest and at the end of a backward) and as peak resident memory.

    python benchmarks/memory.py            # 2 and 4 ranks, fp32 and bf16, plain torchrun
    python benchmarks/memory.py --quick    # 2 ranks, fp32: a smoke run, into results/scratch/

Each method trains in fresh processes; what is counted: benchmarks/README.md, "Memory".
"""

from __future__ import annotations

import argparse
import gc
import math
import os
from pathlib import Path
from typing import Any

import common
from examples.train_gpt import Dist

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["BENCHMARK", "account", "blocks", "targets"]

METHODS = ("ddp-zero1", "ddp-adamw", "acco-sync", "acco-dpu", "acco")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
KINDS = ("parameters", "gradients", "gradient buffers", "communication buffers", "master shard", "optimizer state",
         "estimate copy")
ACCO_BUFFERS = {"grad_accumulator": "gradient buffers", "grad_handover": "gradient buffers",
                "gathered": "communication buffers", "master": "master shard", "master_grad": "master shard",
                "estimate_copy": "estimate copy"}
# About 25M parameters, short micro-batches: the buffers dominate the activations.
MEMORY_MODEL = common.ModelConfig(n_layer=8, n_embd=512, n_head=8, seq_len=64, batch_size=1)
TARGET_SLACK = 1.1  # model sizes (in the reduce dtype) above ZeRO-1
MiB = 2**20


def arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--ranks", type=int, nargs="+", default=[2, 4])
    add("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    add("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    add("--micro-batches", type=int, default=2, help="per update (acco: half per round)")
    add("--warmup", type=int, default=2, help="updates before measuring")
    add("--updates", type=int, default=1, help="measured updates")
    add("--merge", action="store_true", help="replace the matching runs of --out, keep the others")
    add("--method", default=None, choices=METHODS, help=argparse.SUPPRESS)  # set by the driver for its rank launches
    add("--dtype", default="fp32", choices=list(DTYPES), help=argparse.SUPPRESS)


def proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next((int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":")), 0)


def account(method: common.Method) -> dict[str, Any]:
    """This rank's tensor bytes per kind now (see the module docstring)."""
    sizes, seen = dict.fromkeys(KINDS, 0), set()

    def add(t: Tensor, kind: str) -> None:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen and key[1]:
            seen.add(key)
            sizes[kind] += key[1]

    params = list(method.module.parameters())
    for p in params:
        add(p, "parameters")
    acco = isinstance(method, common.AccoMethod)
    if acco:
        for group in method.opt.buffer_bytes():
            for buffer, nbytes in group.items():
                sizes[ACCO_BUFFERS[buffer]] += nbytes
    for opt in base_optimizers(method):
        for state in opt.state.values():
            for t in state.values():
                if isinstance(t, Tensor):
                    add(t, "optimizer state")
    for p in params:
        if p.grad is not None and not (acco and p.grad.untyped_storage().nbytes() > p.grad.nbytes):
            add(p.grad, "gradients")  # (a view into a larger storage is acco's accumulator, counted above)
    if method.spec.family == "ddp":
        buckets = sum(p.nbytes for p in params if p.requires_grad)
        if not method.model.gradient_as_bucket_view:
            sizes["gradient buffers"] += buckets
        elif all(p.grad is None for p in params):
            sizes["gradients"] += buckets  # p.grad = None between steps; the buckets stay
    return {"bytes": sizes, "total": sum(sizes.values())}


def base_optimizers(method: common.Method) -> list[torch.optim.Optimizer]:
    """The optimizers holding this rank's state (ZeroRedundancyOptimizer wraps its local one)."""
    if isinstance(method, common.AccoMethod):
        return [b for b in method.opt.base_optimizers if b is not None]
    return [getattr(method.opt, "optim", method.opt)]


def rank(args: argparse.Namespace, ctx: Dist) -> dict[str, Any]:
    config = MEMORY_MODEL
    next_batch = common.rank_batches(config, ctx.rank)
    gc.collect()
    rss_before_model = proc_status_bytes("VmRSS")
    result = measure(common.build_method(args.method, config, args.micro_batches, dtype=DTYPES[args.dtype],
                                         bucket_view=args.method == "ddp-zero1"), args, next_batch)
    # measure() let go of DDP / ZeRO / acco while the process group still exists: a gloo-backed
    # object destroyed after destroy_process_group() was seen to hang rank 0 at exit.
    gc.collect()
    result.update(rss_before_model_bytes=rss_before_model,
                  peak_rss_added_bytes=result["peak_rss_bytes"] - rss_before_model - result["param_bytes"],
                  ceil_p_over_n=math.ceil(result["parameters"] / ctx.world_size),
                  reduce_itemsize=DTYPES[args.dtype].itemsize)  # acco reduces in the parameters' dtype by default
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, result)
    return {"method": args.method, "dtype": args.dtype, "ranks": ctx.world_size, "per_rank": gathered}


def measure(method: common.Method, args: argparse.Namespace, next_batch: Any) -> dict[str, Any]:
    """Warm-up, then the measured updates: tensors at rest, at the end of each round's last
    backward (before acco folds it or DDP's step frees it), and the peak resident memory."""
    at_backward: list[dict[str, Any]] = []

    def after_backward(index: int) -> None:
        if index == method.micro_batches_per_round - 1:
            at_backward.append(account(method))

    for _ in range(args.warmup * method.rounds_per_update):
        common.train_round(method, next_batch)
    gc.collect()
    dist.barrier()
    at_rest = account(method)
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size (Linux >= 4.0)
    for _ in range(args.updates * method.rounds_per_update):
        common.train_round(method, next_batch, after_backward=after_backward)
    result = {"at_rest": at_rest, "end_of_backward": max(at_backward, key=lambda a: a["total"]),
              "peak_rss_bytes": proc_status_bytes("VmHWM"),
              "parameters": sum(p.numel() for p in method.module.parameters()),
              "param_bytes": sum(p.nbytes for p in method.module.parameters()),
              "state_elements_per_tensor": sum(s["exp_avg"].numel() for b in base_optimizers(method)
                                               for s in b.state.values() if "exp_avg" in s)}
    if isinstance(method, common.AccoMethod):
        result["buffer_bytes"] = method.opt.buffer_bytes()
    method.finish()
    return result


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {
        "benchmark": "memory", "torch": torch.__version__, "runs": [],
        "config": {**MEMORY_MODEL.as_dict(), "micro_batches_per_update": args.micro_batches,
                   "warmup_updates": args.warmup, "measured_updates": args.updates},
    }
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the ranks
    for ranks in args.ranks:
        for dtype in args.dtypes:
            for name in args.methods:
                print(f"memory: {ranks} ranks, {dtype}, {name}", flush=True)
                results["runs"].append(common.run_ranks(args, ranks, "--method", name, "--dtype", dtype))
    if args.merge and args.out.exists():
        previous = common.read_json(args.out)
        order = {(r["method"], r["dtype"], r["ranks"]): i for i, r in enumerate(previous["runs"])}
        measured = {(r["method"], r["dtype"], r["ranks"]) for r in results["runs"]}
        runs = [r for r in previous["runs"] if (r["method"], r["dtype"], r["ranks"]) not in measured] + results["runs"]
        runs.sort(key=lambda r: order.get((r["method"], r["dtype"], r["ranks"]), 1 << 30))
        results = {**previous, "runs": runs}
    return results


def worst(run: dict[str, Any]) -> dict[str, Any]:
    """The rank with the most tensor bytes at the end of a backward (shards differ a little)."""
    return max(run["per_rank"], key=lambda r: r["end_of_backward"]["total"])


def tensor_bytes(run: dict[str, Any]) -> int:
    return worst(run)["end_of_backward"]["total"]


def peak_rss(run: dict[str, Any]) -> int:
    return max(r["peak_rss_added_bytes"] for r in run["per_rank"])


def model_size(run: dict[str, Any]) -> int:
    """P x bytes of the reduce dtype: the unit of the targets."""
    return worst(run)["parameters"] * worst(run)["reduce_itemsize"]


def above_zero1(data: dict[str, Any]) -> dict[tuple[int, str, str], dict[str, Any]]:
    """Per acco run: its bytes above DDP + ZeRO-1 in model sizes, and the target."""
    zero = {(r["ranks"], r["dtype"]): r for r in data["runs"] if r["method"] == "ddp-zero1"}
    out = {}
    for run in data["runs"]:
        base = zero.get((run["ranks"], run["dtype"]))
        if base is None or not run["method"].startswith("acco"):
            continue
        kinds, zero_kinds = worst(run)["end_of_backward"]["bytes"], worst(base)["end_of_backward"]["bytes"]
        model, rss = model_size(run), (peak_rss(run) - peak_rss(base)) / model_size(run)
        target = TARGET_SLACK
        if run["method"] == "acco":  # plus one copy of this rank's master shard and optimizer state
            target += (4 * worst(run)["state_elements_per_tensor"] + kinds["optimizer state"]) / model
        # acco keeps an fp32 master shard and fp32 optimizer state whatever the parameters'
        # dtype; ZeRO-1 steps bf16 parameters with bf16 state. What that precision costs:
        precision = kinds["master shard"] + kinds["optimizer state"] - zero_kinds["optimizer state"]
        tensors = (tensor_bytes(run) - tensor_bytes(base)) / model
        out[(run["ranks"], run["dtype"], run["method"])] = {"target": target, "precision": precision / model,
                                                            "tensors": tensors, "rss": rss,
                                                            "met": max(tensors, rss) <= target}
    return out


def table(data: dict[str, Any], baseline: dict[str, Any] | None = None) -> str:
    out, found = [], above_zero1(data)
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for run in data["runs"]:
        groups.setdefault((run["ranks"], run["dtype"]), []).append(run)
    for (ranks, dtype), runs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] != "fp32")):
        rows = []
        for run in runs:
            end, model, t = worst(run)["end_of_backward"], model_size(run), found.get((ranks, dtype, run["method"]))
            verdict = "" if t is None else (
                f"{t['tensors']:+.2f} / {t['rss']:+.2f} (<= {t['target']:.2f}: {'met' if t['met'] else '**not met**'})"
                + ("" if dtype == "fp32" else
                   f"; of which fp32 master/state over ZeRO-1's bf16 state {t['precision']:+.2f}, the rest "
                   f"{t['tensors'] - t['precision']:+.2f}: "
                   + ("met" if t["tensors"] - t["precision"] <= t["target"] else "**not met**")))
            rows.append([common.label(run["method"]), *[f"{end['bytes'].get(k, 0) / MiB:.1f}" for k in KINDS],
                         f"**{end['total'] / MiB:.1f}** ({end['total'] / model:.2f})",
                         f"{worst(run)['at_rest']['total'] / MiB:.1f}",
                         f"{peak_rss(run) / MiB:.0f} ({peak_rss(run) / model:.2f})", verdict])
        note = " (oversubscribed: 4 ranks on 2 cores)" if ranks > 2 else ""
        out += [f"**{ranks} ranks, {dtype} parameters{note}**: MiB per rank (the largest rank); in brackets, model "
                "sizes (P x bytes of the reduce dtype)", "",
                common.md_table(["method", *KINDS, "total, end of a backward", "total at rest", "peak RSS added",
                                 "above ZeRO-1: tensors / RSS, model sizes (target)"], rows), ""]
    if baseline:
        before = {(r["ranks"], r["dtype"], r["method"]): r for r in baseline["runs"]}
        rows = [[str(run["ranks"]), run["dtype"], common.label(run["method"]),
                 f"{tensor_bytes(old) / MiB:.1f} -> {tensor_bytes(run) / MiB:.1f}",
                 f"{peak_rss(old) / MiB:.0f} -> {peak_rss(run) / MiB:.0f}"]
                for run in data["runs"] if (old := before.get((run["ranks"], run["dtype"], run["method"])))]
        out += ["Before (commit 999678c, `results/memory-baseline.json`) -> after, MiB per rank:", "",
                common.md_table(["ranks", "params", "method", "tensors, end of a backward", "peak RSS added"], rows),
                ""]
    return "\n".join(out)


def summary(data: dict[str, Any]) -> str:
    """The user-facing figures (docs/memory.md): tensors per rank at the end of a backward
    and peak RSS, in model sizes, against DDP + ZeRO-1 measured in the same run. The change
    history (the baseline commit) stays in benchmarks/README.md's table."""
    found, rows = above_zero1(data), []
    for run in data["runs"]:
        key, model = (run["ranks"], run["dtype"], run["method"]), model_size(run)
        t = found.get(key)
        rows.append([str(run["ranks"]), run["dtype"], common.label(run["method"]),
                     f"{tensor_bytes(run) / model:.2f}", f"{peak_rss(run) / model:.2f}",
                     "" if t is None else f"{t['tensors']:+.2f} (target <= {t['target']:.2f}: "
                     + ("met" if t["met"] else "**not met**") + ")"])
    return ("In model sizes (P x bytes of the reduce dtype), per rank, the largest rank; P = "
            f"{worst(data['runs'][0])['parameters'] / 1e6:.1f}M; baseline: DDP + ZeRO-1 in the same run:\n\n"
            + common.md_table(["ranks", "params", "method", "tensors (end of a backward)", "peak RSS added",
                               "above ZeRO-1 (target)"], rows))


def blocks(results: dict[str, Any], figures: Path) -> dict[str, str]:
    return {"memory": table(results["memory"], results.get("memory-baseline")),
            "memory-summary": summary(results["memory"])}


def targets(results: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    data = results["memory"]
    rows: list[tuple[str, str, bool | None]] = [
        (f"{ranks} ranks, {dtype}: {common.label(method)} peak per rank <= ZeRO-1 + {t['target']:.2f} model sizes "
         "(tensors at the end of a backward / peak RSS)", f"{t['tensors']:+.2f} / {t['rss']:+.2f}", t["met"])
        for (ranks, dtype, method), t in above_zero1(data).items()]
    for run in data["runs"]:
        if run["method"] == "acco" and run["dtype"] == "fp32":
            most = max(r["state_elements_per_tensor"] for r in run["per_rank"])
            ceil = run["per_rank"][0]["ceil_p_over_n"]
            rows.append((f"{run['ranks']} ranks: acco's optimizer state per rank = ceil(P/N) + padding",
                         f"{most:,} elements per moment, ceil(P/N) = {ceil:,} (padding {most - ceil:+,})",
                         0 <= most - ceil < 2 * run["ranks"]))
    return rows


BENCHMARK = common.Benchmark("memory", __doc__, arguments, rank, sweep, quick={"ranks": [2], "dtypes": ["fp32"]})

if __name__ == "__main__":
    common.main(BENCHMARK)
