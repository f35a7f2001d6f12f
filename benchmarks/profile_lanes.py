"""Where the time goes: the compute lane and the comm lane of each method, per round.

    sudo python benchmarks/profile_lanes.py                          # 2 ranks, the calibrated rates
    sudo python benchmarks/profile_lanes.py --rate 300mbit --methods acco ddp-zero1
    sudo python benchmarks/profile_lanes.py --trace acco             # + a torch.profiler trace

For every method it runs a few rounds and reads, on rank 0, the CPU time of every thread
of the rank and the time it spent runnable but waiting for a core
(``/proc/self/task/*/schedstat``): the compute lane (the main thread), acco's comm lane (a
Python worker thread), gloo's I/O threads. Next to the wall time of a round this shows the
one thing that decides whether communication can hide behind compute on a CPU: whether
there is a core free for it. Wall time of the compute lane = its CPU time + its run-queue
wait (a core was busy with another thread) + the time it was blocked (the GIL, a lock, a
collective). When the ranks' compute threads already fill every core, each
CPU-second that the comm lane (or the kernel's loopback TCP, accounted to the sending and
receiving threads) spends is a second the compute lane waits for its core: the compute
lane's wall time per micro-batch rises above its CPU time.

Per phase of acco's comm lane it also gives the lane thread's CPU time next to the wall
time (a phase that waits on the network costs wall time, not CPU). These hooks wrap a
private method (``AccoOptimizer._phase``) and are diagnostics only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from common import (
    METHODS,
    RESULTS_DIR,
    ModelConfig,
    all_reduce_max,
    batches,
    build_method,
    launch,
    read_json,
    start_ranks,
    training_text,
    wait_for_quiet,
    write_json,
)

from acco import AccoOptimizer

DEFAULT_METHODS = ["roofline", "ddp-zero1", "acco-sync", "acco-dpu", "acco", "acco-aww"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--ranks", type=int, default=2)
    add("--rate", nargs="*", default=None,
        help="tc rates (or 'unlimited') to profile at (default: unlimited and the calibrated rates in "
        "results/throughput.json)")
    add("--methods", nargs="+", default=DEFAULT_METHODS, choices=METHODS)
    add("--micro-batches", type=int, default=2)
    add("--rounds", type=int, default=8, help="rounds measured per method (after 2 updates of warm-up)")
    add("--trace", default=None, choices=METHODS, help="also write a torch.profiler chrome trace of this method")
    add("--out", default=None)
    add("--label", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def thread_cpu() -> dict[int, tuple[str, float, float]]:
    """Per thread of this process, by native thread id: its name, CPU seconds, and seconds
    spent runnable but waiting for a core (the scheduler's run-queue delay)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                on_cpu_ns, waiting_ns, _ = (int(v) for v in f.read().split())
        except (OSError, ValueError):
            continue
        out[int(tid)] = (name, on_cpu_ns / 1e9, waiting_ns / 1e9)
    return out


def classify(tid: int, name: str, main_tid: int, lane_tids: set[int]) -> str:
    if tid == main_tid:
        return "compute lane (main thread)"
    if tid in lane_tids:
        return "acco comm lane (thread)"
    if name.startswith("gloo") or name.startswith("pt_gloo"):
        return "gloo I/O threads"
    return "other threads"


def hook_lane_phases(opt: AccoOptimizer, record: dict[str, list[tuple[float, float]]]) -> None:
    """Record each comm-lane phase's wall and lane-thread CPU time (diagnostics only)."""
    original = opt._phase

    @contextmanager
    def phase(stats: Any, name: str):  # type: ignore[no-untyped-def]
        wall, cpu = time.perf_counter(), time.thread_time()
        with original(stats, name):
            yield
        record.setdefault(name, []).append((time.perf_counter() - wall, time.thread_time() - cpu))

    opt._phase = phase  # type: ignore[method-assign]


def profile_method(name: str, args: argparse.Namespace, config: ModelConfig, next_batch: Any) -> dict[str, Any]:
    method = build_method(name, config, args.micro_batches)
    aww = name == "acco-aww"
    opt = method.optimizer()
    phases: dict[str, list[tuple[float, float]]] = {}
    if isinstance(opt, AccoOptimizer):
        hook_lane_phases(opt, phases)
    warm_rounds = 2 * method.rounds_per_update
    mb_wall, mb_cpu, step_wall, step_cpu = [], [], [], []
    micro_batches = 0
    wait_for_quiet()
    dist.barrier()
    main_tid = threading.get_native_id()
    profiler = None
    for r in range(warm_rounds + args.rounds):
        if r == warm_rounds:
            dist.barrier()  # a global window (see throughput.py)
            phases.clear()
            before, wall0 = thread_cpu(), time.perf_counter()
            if args.trace == name:
                profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                profiler.__enter__()
        count = 0
        while count < method.micro_batches_per_round or (aww and not method.ready()):
            w, c = time.perf_counter(), time.thread_time()
            method.micro_batch(*next_batch())
            if r >= warm_rounds:
                mb_wall.append(time.perf_counter() - w)
                mb_cpu.append(time.thread_time() - c)
            count += 1
        w, c = time.perf_counter(), time.thread_time()
        method.end_round()
        if r >= warm_rounds:
            step_wall.append(time.perf_counter() - w)
            step_cpu.append(time.thread_time() - c)
            micro_batches += count
    after = thread_cpu()
    dist.barrier()
    wall = time.perf_counter() - wall0
    if profiler is not None:
        profiler.__exit__(None, None, None)
        trace = Path(args.out).with_name(f"trace-{name}-{args.label}.json")
        profiler.export_chrome_trace(str(trace))
    lane_tids = {t.native_id for t in threading.enumerate() if t.name == "acco-comm-lane"}
    method.finish()
    cpu: dict[str, float] = {}
    runqueue: dict[str, float] = {}
    for tid, (thread_name, seconds, waited) in after.items():
        _, seconds0, waited0 = before.get(tid, (thread_name, 0.0, 0.0))
        key = classify(tid, thread_name, main_tid, lane_tids)
        cpu[key] = cpu.get(key, 0.0) + (seconds - seconds0) / args.rounds
        runqueue[key] = runqueue.get(key, 0.0) + (waited - waited0) / args.rounds
    (slowest,) = all_reduce_max([wall])
    return {
        "round_wall_s": slowest / args.rounds,
        "micro_batches_per_round": micro_batches / args.rounds,
        "micro_batch_wall_s": statistics.fmean(mb_wall),
        "micro_batch_cpu_s": statistics.fmean(mb_cpu),
        "step_wall_s": statistics.fmean(step_wall),
        "step_cpu_s": statistics.fmean(step_cpu),
        "thread_cpu_s_per_round": cpu,
        "thread_runqueue_wait_s_per_round": runqueue,
        "lane_phases": {
            p: {"wall_s": statistics.fmean(v[0] for v in vals), "cpu_s": statistics.fmean(v[1] for v in vals)}
            for p, vals in phases.items()
        },
    }


def piece_costs(config: ModelConfig, world_size: int) -> dict[str, float]:
    """Single-thread CPU milliseconds of the pieces of work a round puts on a rank, timed
    alone (this rank only, the others wait): what each would cost the compute lane when
    no core is free. Sizes are those of the model's flat buffers and shards."""
    model = build_method("roofline", config, 2).model
    numel = sum(p.numel() for p in model.parameters())
    padded = -(-numel // world_size) * world_size
    chunk = padded // world_size
    full = torch.randn(padded)
    other = torch.randn(padded)
    shard = torch.randn(chunk)
    state = [torch.randn(chunk), torch.rand(chunk)]
    param = torch.randn(chunk)
    adamw = torch.optim.AdamW([param], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    param.grad = torch.randn(chunk)
    adamw.step()
    fused_param = param.clone()
    fused = torch.optim.AdamW([fused_param], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    fused_param.grad = param.grad
    fused.step()

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


def rank_main(args: argparse.Namespace) -> None:
    ctx = start_ranks()
    config = ModelConfig()
    train_data, _ = training_text(config.seq_len)
    next_batch = batches(train_data, config, config.seed + 1000 * ctx.rank)
    warm = build_method("roofline", config, args.micro_batches)
    for _ in range(2):
        warm.micro_batch(*next_batch())
    results = {}
    for name in args.methods:
        results[name] = profile_method(name, args, config, next_batch)
        if ctx.master:
            print(f"[{args.label}] {name}: {results[name]['round_wall_s']:.3f} s per round", flush=True)
    costs = piece_costs(config, ctx.world_size) if ctx.master else {}
    dist.barrier()  # the other ranks wait while rank 0 times the pieces alone
    if ctx.master:
        write_json(Path(args.out), {"ranks": ctx.world_size, "label": args.label,
                                    "rate": os.environ.get("ACCO_BENCH_RATE", "unlimited"), "methods": results,
                                    "piece_costs_ms": costs})
    dist.barrier()
    dist.destroy_process_group()


def driver(args: argparse.Namespace) -> None:
    rates: list[tuple[str, str | None]]
    if args.rate is None:
        rates = [("unlimited", None)]
        calibrated = RESULTS_DIR / "throughput.json"
        if calibrated.exists():
            targets = read_json(calibrated)["calibration"].get(str(args.ranks), {}).get("targets", {})
            rates += [(label, t["rate"]) for label, t in targets.items()]
    else:
        rates = [(r, None if r == "unlimited" else r) for r in args.rate]
    out = Path(args.out) if args.out else RESULTS_DIR / f"profile-{args.ranks}ranks.json"
    started = time.perf_counter()
    profiles = []
    for label, rate in rates:
        with tempfile.TemporaryDirectory() as tmp:
            rank_out = Path(tmp) / "profile.json"
            passthrough = ["--methods", *args.methods, "--micro-batches", str(args.micro_batches),
                           "--rounds", str(args.rounds), "--label", label, "--out", str(rank_out)]
            if args.trace:
                passthrough += ["--trace", args.trace]
            launch(args.ranks, [str(Path(__file__).resolve()), *passthrough], rate)
            profile = read_json(rank_out)
            for trace in Path(tmp).glob("trace-*.json"):
                trace.replace(out.parent / trace.name)
        profile["label"] = label
        profiles.append(profile)
        print_table(profile)
    write_json(out, {"benchmark": "profile", "ranks": args.ranks, "micro_batches_per_update": args.micro_batches,
                     "runtime_s": time.perf_counter() - started, "profiles": profiles})
    print(f"wrote {out} ({time.perf_counter() - started:.0f} s)")


def print_table(profile: dict[str, Any]) -> None:
    print(f"\n{profile['ranks']} ranks, {profile['label']} ({profile['rate']}), rank 0, per round:")
    for name, p in profile["methods"].items():
        threads = ", ".join(f"{k} {v * 1000:.0f}" for k, v in sorted(p["thread_cpu_s_per_round"].items()) if v > 0)
        phases = ", ".join(f"{k} {v['wall_s'] * 1000:.0f}/{v['cpu_s'] * 1000:.0f}" for k, v in p["lane_phases"].items())
        print(f"  {name:10s} round {p['round_wall_s'] * 1000:6.0f} ms | micro-batch wall {p['micro_batch_wall_s'] * 1000:4.0f}"
              f" cpu {p['micro_batch_cpu_s'] * 1000:4.0f} ms | step {p['step_wall_s'] * 1000:4.0f} ms | CPU ms: {threads}"
              + (f" | lane wall/cpu ms: {phases}" if phases else ""))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:
        if args.out is None:
            args.out = str(RESULTS_DIR / "profile-torchrun.json")
        args.label = args.label or "torchrun"
        rank_main(args)
    else:
        driver(args)


if __name__ == "__main__":
    sys.exit(main())
