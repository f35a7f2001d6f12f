"""Where the time goes: the compute lane and the comm lane of each method, per round.

    sudo $(which python) benchmarks/profile_lanes.py                  # 2 ranks, unlimited and the calibrated rates
    sudo $(which python) benchmarks/profile_lanes.py --rate 300mbit --methods acco ddp-zero1
    sudo $(which python) benchmarks/profile_lanes.py --trace acco     # + a torch.profiler trace in results/
    sudo $(which python) benchmarks/profile_lanes.py --quick          # unlimited only, 4 rounds, results/scratch/

For every method it runs a few rounds and reads, on rank 0, the CPU time of every thread
of the rank and the time it spent runnable but waiting for a core
(``/proc/self/task/*/schedstat``): the compute lane (the main thread), acco's comm lane (a
worker thread), gloo's I/O threads. That decides whether communication can hide behind
compute on a CPU: when the ranks' compute threads already fill every core, each CPU-second
the comm lane (or the kernel's loopback TCP, accounted to the sending and receiving
threads) spends is a second the compute lane waits for its core. Per phase of acco's comm
lane it gives the phase's wall time next to the lane thread's CPU time (``RoundStats``'s
``phase_seconds`` and ``phase_cpu_seconds``: a phase waiting on the network costs wall time,
not CPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import common
from examples.train_gpt import Dist, loss_fn

import torch
import torch.distributed as dist

__all__ = ["BENCHMARK", "blocks", "runtimes", "table"]

PROFILE_METHODS = [n for n, s in common.METHODS.items() if s.family != "diloco"]
COMPUTE_LANE, COMM_LANE, GLOO = "compute lane (main thread)", "acco comm lane (thread)", "gloo I/O threads"


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


def quick(args: argparse.Namespace) -> None:
    args.rate, args.rounds = args.rate or ["unlimited"], 4


def check(args: argparse.Namespace) -> str | None:
    args.out = args.out or common.RESULTS_DIR / f"profile-{args.ranks}ranks.json"
    return None


def thread_cpu() -> dict[int, tuple[str, float, float]]:
    """Per thread of this process, by native thread id: its name, CPU seconds, and seconds
    spent runnable but waiting for a core (the scheduler's run-queue delay)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            on_cpu_ns, waiting_ns, _ = (int(v) for v in Path(f"/proc/self/task/{tid}/schedstat").read_text().split())
        except (OSError, ValueError):
            continue
        out[int(tid)] = (name, on_cpu_ns / 1e9, waiting_ns / 1e9)
    return out


def thread_kind(tid: int, name: str, main_tid: int, lane_tids: set[int]) -> str:
    if tid == main_tid:
        return COMPUTE_LANE
    if tid in lane_tids:
        return COMM_LANE
    return GLOO if name.startswith(("gloo", "pt_gloo")) else "other threads"


def profile_method(name: str, args: argparse.Namespace, config: common.ModelConfig, next_batch: Any) -> dict[str, Any]:
    method = common.build_method(name, config, args.micro_batches)
    common.wait_for_quiet()
    dist.barrier()
    for _ in range(2 * method.rounds_per_update):
        common.train_round(method, next_batch)
    landed_before = len(method.round_stats())
    dist.barrier()  # a global window (see throughput.py)
    before, wall0, main_tid = thread_cpu(), time.perf_counter(), threading.get_native_id()
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if args.trace == name else None
    if profiler is not None:
        profiler.__enter__()
    rounds = [common.train_round(method, next_batch) for _ in range(args.rounds)]
    after = thread_cpu()
    dist.barrier()
    wall = time.perf_counter() - wall0
    if profiler is not None:
        profiler.__exit__(None, None, None)
        profiler.export_chrome_trace(str(common.RESULTS_DIR / f"trace-{name}-{args.label}.json"))
    lane_tids = {t.native_id for t in threading.enumerate() if t.name == "acco-comm-lane"}
    stats = method.round_stats()[landed_before:]
    method.finish()
    cpu: dict[str, float] = {}
    runqueue: dict[str, float] = {}
    for tid, (thread_name, seconds, waited) in after.items():
        _, seconds0, waited0 = before.get(tid, (thread_name, 0.0, 0.0))
        kind = thread_kind(tid, thread_name, main_tid, lane_tids)
        cpu[kind] = cpu.get(kind, 0.0) + (seconds - seconds0) / args.rounds
        runqueue[kind] = runqueue.get(kind, 0.0) + (waited - waited0) / args.rounds
    mean = statistics.fmean
    return {
        "round_wall_s": common.all_reduce([wall], "max")[0] / args.rounds,
        "micro_batches_per_round": mean(len(r.losses) for r in rounds),
        "micro_batch_wall_s": mean(t for r in rounds for t in r.micro_batch_s),
        "micro_batch_cpu_s": mean(t for r in rounds for t in r.micro_batch_cpu_s),
        "step_wall_s": mean(r.boundary_s for r in rounds),
        "step_cpu_s": mean(r.boundary_cpu_s for r in rounds),
        "thread_cpu_s_per_round": cpu,
        "thread_runqueue_wait_s_per_round": runqueue,
        "lane_phases": {p: {"wall_s": mean(s.phase_seconds.get(p, 0.0) for s in stats),
                            "cpu_s": mean(s.phase_cpu_seconds.get(p, 0.0) for s in stats)}
                        for p in dict.fromkeys(p for s in stats for p in s.phase_seconds)},
    }


def piece_costs(config: common.ModelConfig, world_size: int) -> dict[str, float]:
    """Single-thread CPU milliseconds of the pieces of work a round puts on a rank, timed
    alone (this rank only, the others wait): what each would cost the compute lane when
    no core is free. Sizes are those of the model's flat buffers and shards."""
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
    train_data, _ = common.training_text(config.seq_len)
    next_batch = common.batches(train_data, config, config.seed + 1000 * ctx.rank)
    warm = common.build_model(config)
    for _ in range(2):  # warm the allocator and kernels up once, so the first method is not penalised
        loss_fn(warm, *next_batch()).backward()
    results = {}
    for name in args.methods:
        results[name] = profile_method(name, args, config, next_batch)
        if ctx.master:
            print(f"[{args.label}] {name}: {results[name]['round_wall_s']:.3f} s per round", flush=True)
    costs = piece_costs(config, ctx.world_size) if ctx.master else {}
    dist.barrier()  # the other ranks wait while rank 0 times the pieces alone
    return {"ranks": ctx.world_size, "label": args.label, "rate": os.environ.get("ACCO_BENCH_RATE", "unlimited"),
            "methods": results, "piece_costs_ms": costs}


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    if args.rate is None:
        rates: list[tuple[str, str | None]] = [("unlimited", None)]
        calibrated = common.RESULTS_DIR / "throughput.json"
        if calibrated.exists():
            targets = common.read_json(calibrated)["calibration"].get(str(args.ranks), {}).get("targets", {})
            rates += [(name, t["rate"]) for name, t in targets.items()]
    else:
        rates = [(r, None if r == "unlimited" else r) for r in args.rate]
    results = {"benchmark": "profile", "ranks": args.ranks, "micro_batches_per_update": args.micro_batches,
               "profiles": []}
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
                         f"{wait.get(COMPUTE_LANE, 0) * 1000:.0f}" if wait else "", f"{p['step_wall_s'] * 1000:.0f}",
                         f"{cpu.get(COMM_LANE, 0) * 1000:.0f}", f"{cpu.get(GLOO, 0) * 1000:.0f}",
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


BENCHMARK = common.Benchmark("profile_lanes", __doc__, arguments, rank, sweep, quick, check)

if __name__ == "__main__":
    common.main(BENCHMARK)
