"""Where the time goes: the compute lane and the comm lane of each method, per round.

    sudo $(which python) benchmarks/profile_lanes.py                  # 2 ranks, unlimited and the calibrated rates
    sudo $(which python) benchmarks/profile_lanes.py --rate 300mbit --methods acco ddp-zero1
    sudo $(which python) benchmarks/profile_lanes.py --trace acco     # + a torch.profiler trace in results/
    sudo $(which python) benchmarks/profile_lanes.py --quick          # unlimited only, 4 rounds, results/scratch/

Rounds in throughput.py's timed window as rank 0 sees them, then the CPU cost of each piece of a round, alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import common
import throughput
from examples.train_gpt import Dist

import torch
import torch.distributed as dist

__all__ = ["BENCHMARK", "blocks", "runtimes", "table"]

PROFILE_METHODS = [n for n, s in common.METHODS.items() if s.family != "diloco"]


def arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--ranks", type=int, default=2)
    add("--rate", nargs="*", default=None, help="tc rates (or 'unlimited') to profile at (default: unlimited and "
        "the calibrated rates in results/throughput.json)")
    add("--methods", nargs="+", default=["roofline", "ddp-zero1", "acco-sync", "acco-dpu", "acco", "acco-aww"],
        choices=PROFILE_METHODS)
    add("--micro-batches", type=int, default=2)
    add("--rounds", type=int, default=8, help="rounds measured per method (after 2 updates of warm-up)")
    add("--trace", default=None, choices=PROFILE_METHODS, help="also write a torch.profiler trace of this method")


def piece_costs(config: common.ModelConfig, world_size: int) -> dict[str, float]:
    """Single-thread CPU ms of each piece of work a round puts on a rank, at the model's buffer
    sizes, timed alone: what each costs the compute lane when no core is free."""
    numel = sum(p.numel() for p in common.build_model(config).parameters())
    chunk = -(-numel // world_size)
    full, other, shard = torch.randn(chunk * world_size), torch.randn(chunk * world_size), torch.randn(chunk)
    state = [torch.randn(chunk), torch.rand(chunk)]
    param = torch.randn(chunk)
    adamw = torch.optim.AdamW([param], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    param.grad = torch.randn(chunk)
    fused_param = param.clone()
    fused = torch.optim.AdamW([fused_param], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    fused_param.grad = param.grad

    def clone_and_restore() -> None:
        saved = [t.clone() for t in (shard, *state)]
        for t, copy in zip((shard, *state), saved):
            t.copy_(copy)

    def timed(fn: Any) -> float:
        samples = []
        for _ in range(12):
            started = time.thread_time()
            fn()
            samples.append(time.thread_time() - started)
        return statistics.median(samples[2:]) * 1000

    return {
        "non-finite check, exact scan of the full gradient: torch.isfinite(g).all() (acco before this sweep)": timed(
            lambda: bool(torch.isfinite(full).all())),
        "non-finite check from the sum: torch.isfinite(g.sum()) (acco now; the exact scan only if not finite)": timed(
            lambda: bool(torch.isfinite(full.sum()))),
        "AdamW step on the shard (torch's default, foreach)": timed(adamw.step),
        "AdamW step on the shard, fused=True": timed(fused.step),
        "estimate round: clone master + AdamW state, restore": timed(clone_and_restore),
        "sum of the all-to-all's chunks (reduce-scatter on gloo)": timed(
            lambda: torch.sum(other.view(world_size, -1), dim=0, out=shard)),
        "copy of one full flat buffer (hand-over / load into the model)": timed(lambda: full.copy_(other)),
        "fold one micro-batch's p.grad into the accumulator": timed(lambda: full.add_(other, alpha=1.0)),
    }


def rank(args: argparse.Namespace, ctx: Dist) -> dict[str, Any]:
    config = common.ModelConfig()
    next_batch = common.rank_batches(config, ctx.rank)
    common.warm_up(config, next_batch)
    results = {}
    for name in args.methods:
        method = common.build_method(name, config, args.micro_batches)
        trace = common.RESULTS_DIR / f"trace-{name}-{args.label}.json" if args.trace == name else None
        results[name] = r = throughput.run_method(method, next_batch, 2 * method.rounds_per_update, args.rounds, trace)
        lane = r.pop("lane", {})
        r["lane_phases"] = {p: {"wall_s": seconds, "cpu_s": lane["phase_cpu_s"].get(p, 0.0)}
                            for p, seconds in lane.get("phase_s", {}).items()}
        if ctx.master:
            print(f"[{args.label}] {name}: {r['round_wall_s']:.3f} s per round", flush=True)
    costs = piece_costs(config, ctx.world_size) if ctx.master else {}
    dist.barrier()  # the other ranks wait while rank 0 times the pieces alone
    return {"ranks": ctx.world_size, "label": args.label, "rate": os.environ.get("ACCO_BENCH_RATE", "unlimited"),
            "methods": results, "piece_costs_ms": costs}


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    if args.rate is None:
        rates: list[tuple[str, str | None]] = [("unlimited", None)]
        calibrated = common.RESULTS_DIR / "throughput.json"
        if calibrated.exists() and not args.quick:  # --quick: unlimited only
            targets = common.read_json(calibrated)["calibration"].get(str(args.ranks), {}).get("targets", {})
            rates += [(name, t["rate"]) for name, t in targets.items()]
    else:
        rates = [(r, None if r == "unlimited" else r) for r in args.rate]
    results = {"ranks": args.ranks, "micro_batches_per_update": args.micro_batches, "profiles": []}
    for name, rate in rates:
        profile = common.run_ranks(args, args.ranks, "--label", name, rate=rate, netns=True)
        results["profiles"].append({**profile, "label": name})
        print(table({**results, "profiles": [profile]}))
    return results


def table(data: dict[str, Any]) -> str:
    rows = []
    for profile in data["profiles"]:
        for name, p in profile["methods"].items():
            cpu, wait = p["thread_cpu_s_per_round"], p.get("thread_runqueue_wait_s_per_round")
            rows.append([profile["label"], common.label(name), f"{p['round_wall_s'] * 1000:.0f}",
                         f"{p['micro_batches_per_round']:.1f}",
                         f"{p['micro_batch_wall_s'] * 1000:.0f} / {p['micro_batch_cpu_s'] * 1000:.0f}",
                         f"{wait.get(throughput.COMPUTE_LANE, 0) * 1000:.0f}" if wait else "",
                         f"{p['step_wall_s'] * 1000:.0f}",
                         f"{cpu.get(throughput.COMM_LANE, 0) * 1000:.0f}", f"{cpu.get(throughput.GLOO, 0) * 1000:.0f}",
                         ", ".join(f"{k} {v['wall_s'] * 1000:.0f}/{v['cpu_s'] * 1000:.0f}"
                                   for k, v in common.phases(p["lane_phases"]).items())])
    text = (f"{data['ranks']} ranks, {data['micro_batches_per_update']} micro-batches per update, rank 0, per round:"
            "\n\n" + common.md_table(["rate", "method", "round ms", "micro-batches per round",
                                      "micro-batch wall / CPU ms", "compute lane waiting for a core, ms", "step() ms",
                                      "comm lane CPU ms", "gloo threads CPU ms", "lane phases wall/CPU ms"], rows))
    costs = next((p["piece_costs_ms"] for p in data["profiles"] if p.get("piece_costs_ms")), None)
    if costs:
        text += ("\n\nCPU cost of the pieces of a round, each timed alone on one thread (rank 0, the model's buffer "
                 "sizes):\n\n" + common.md_table(["piece", "CPU ms"], [[k, f"{v:.1f}"] for k, v in costs.items()]))
    return text


def blocks(results: dict[str, Any], figures: Path) -> dict[str, str]:
    found = [results[s] for s in ("profile-2ranks", "profile-4ranks") if s in results]
    return {"profile": "\n\n".join(table(data) for data in found)} if found else {}


def runtimes(results: dict[str, Any]) -> list[tuple[str, float]]:
    return [(f"profile_lanes ({results[s]['ranks']} ranks)", results[s]["runtime_s"])
            for s in ("profile-2ranks", "profile-4ranks") if s in results]


BENCHMARK = common.Benchmark("profile", __doc__, arguments, rank, sweep, quick={"rounds": 4},
                             stem="profile-{ranks}ranks")

if __name__ == "__main__":
    common.main(BENCHMARK)
