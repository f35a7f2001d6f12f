"""Throughput: samples/s of acco against DDP + ZeRO-1, plain DDP and the compute-only
roofline, at equal micro-batches per optimizer update, behind a rate-limited network.

The whole sweep (calibration, every rate, 2 and 4 ranks; needs root for the namespace):

    sudo $(which python) benchmarks/throughput.py            # about 50 min on 2 cores
    sudo $(which python) benchmarks/throughput.py --quick    # 2 ranks, 1 repeat: a few minutes

One configuration on a real cluster (no namespace, the network you have), every method
side by side, results on rank 0:

    torchrun --nnodes=2 --nproc-per-node=1 ... benchmarks/throughput.py --out throughput-cluster.json

How it measures. Every method trains the same GPT on the same micro-batches; one update is
``--micro-batches`` micro-batches per rank (acco: two rounds of half as many). After
``--warmup-updates`` the clock runs from one round boundary to the last one
``--updates`` later (steady state: a pipeline's fill and drain happen once per training
run and are left out); samples/s is every rank's micro-batches in that window times the
micro-batch size over the window, which opens and closes with a barrier at those two round
boundaries. The methods run one after another in one process group, in a rotated order,
``--repeats`` times; the tables give medians and ratios taken within a repeat (side by
side). Before each method the ranks wait until other processes leave the CPU idle, and
the JSON records the CPU share other processes took during each window. The accumulate-while-communicating loop
(``acco-aww``) keeps computing micro-batches while the round in flight has not landed, so
its micro-batches per update are not fixed: that is the point of it.

Rates. ``comm~compute`` is the tbf rate at which one round of acco's communication (the
reduce-scatter and all-gather of one round, measured alone) takes as long as one acco
round of compute (``--micro-batches``/2 micro-batches, all ranks computing at once);
``comm~3x`` makes it three times longer. The driver calibrates both per rank count by
measuring, and records the rates and the measured ratios in the JSON.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
import torch.distributed as dist
from common import (
    METHODS,
    ForeignLoad,
    RESULTS_DIR,
    ModelConfig,
    all_reduce_max,
    all_reduce_sum,
    batches,
    build_method,
    launch,
    lo_tx_bytes,
    read_json,
    start_ranks,
    training_text,
    wait_for_quiet,
    write_json,
)
from examples.train_gpt import loss_fn

from acco import AccoOptimizer, RoundKind

RATE_LABELS = ("unlimited", "comm~compute", "comm~3x")
RATE_RATIOS = {"comm~compute": 1.0, "comm~3x": 3.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--ranks", type=int, nargs="+", default=[2, 4], help="rank counts to sweep (driver)")
    add("--rates", nargs="+", default=list(RATE_LABELS), choices=RATE_LABELS, help="rates to sweep (driver)")
    add("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    add("--micro-batches", type=int, default=4, help="micro-batches per rank per optimizer update (even)")
    add("--warmup-updates", type=int, default=1)
    add("--updates", type=int, default=3, help="updates in the timed window")
    add("--repeats", type=int, default=3)
    add("--n-layer", type=int, default=4)
    add("--n-embd", type=int, default=256)
    add("--seq-len", type=int, default=128)
    add("--batch-size", type=int, default=8)
    add("--out", default=None, help="JSON output (default: benchmarks/results/throughput.json)")
    add("--no-report", action="store_true", help="do not regenerate the README tables and plots (driver)")
    add("--quick", action="store_true", help="2 ranks, 1 repeat, 2 timed updates: a smoke run of a few minutes")
    # Set by the driver for its rank launches.
    add("--calibrate", action="store_true", help=argparse.SUPPRESS)
    add("--skip-compute", action="store_true", help=argparse.SUPPRESS)
    add("--label", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.warmup_updates < 1 or args.updates < 1:
        parser.error("--warmup-updates and --updates must be at least 1")
    if args.quick:
        args.ranks, args.repeats, args.updates = [2], 1, 2
    if args.micro_batches < 2 or args.micro_batches % 2:
        parser.error("--micro-batches must be even (acco splits an update into two rounds)")
    return args


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(n_layer=args.n_layer, n_embd=args.n_embd, seq_len=args.seq_len, batch_size=args.batch_size)


# ---------------------------------------------------------------------------- rank side


def run_method(name: str, args: argparse.Namespace, config: ModelConfig, next_batch: Any) -> dict[str, Any]:
    """Train ``name`` for warm-up + timed updates; the timed window's figures."""
    method = build_method(name, config, args.micro_batches)
    aww = name == "acco-aww"
    per_round, per_update = method.micro_batches_per_round, method.rounds_per_update
    total_updates = args.warmup_updates + args.updates
    start_round = args.warmup_updates * per_update
    computed = 0  # micro-batches this rank computed in the window
    landed_before = 0
    compute_s = boundary_s = 0.0
    t0 = math.nan
    bytes0: int | None = None
    foreign = ForeignLoad()
    waited = wait_for_quiet()
    dist.barrier()

    def one_round(round_number: int) -> None:
        nonlocal computed, compute_s, boundary_s, t0, bytes0, landed_before
        started = time.perf_counter()
        count = 0
        for _ in range(per_round):
            method.micro_batch(*next_batch())
            count += 1
        while aww and not method.ready():  # keep accumulating while the network works
            method.micro_batch(*next_batch())
            count += 1
        computed_at = time.perf_counter()
        method.end_round()
        ended = time.perf_counter()
        if round_number > start_round:
            computed += count
            compute_s += computed_at - started
            boundary_s += ended - computed_at
        if round_number == start_round:
            landed_before = len(stats_of(method))
            # The window is global: it opens when every rank has reached this boundary (ranks
            # that share cores would otherwise each time a stretch where the others idle).
            dist.barrier()
            t0, bytes0 = time.perf_counter(), lo_tx_bytes()
            foreign.start()

    if aww:
        # The documented loop: it ends on the same round on every rank.
        opt: AccoOptimizer = method.optimizer()
        round_number = 0
        while opt.num_updates + (opt.in_flight is RoundKind.COMMIT) < total_updates:
            round_number += 1
            one_round(round_number)
    else:
        round_number = total_updates * per_update
        for r in range(1, round_number + 1):
            one_round(r)
    landed = stats_of(method)[landed_before:]  # the rounds that landed inside the window
    dist.barrier()
    t1 = time.perf_counter()
    bytes1 = lo_tx_bytes()
    foreign_share = foreign.stop()
    method.finish()
    window = t1 - t0
    rounds_in_window = round_number - start_round
    (slowest,) = all_reduce_max([window])
    total_mb, total_compute, total_boundary = all_reduce_sum([computed, compute_s, boundary_s])
    world = dist.get_world_size()
    result: dict[str, Any] = {
        "samples_per_s": total_mb * config.batch_size / slowest,
        "window_s": slowest,
        "micro_batches_per_update": total_mb / world / args.updates,
        "compute_s_per_round": total_compute / world / rounds_in_window,
        "compute_s_per_micro_batch": total_compute / max(total_mb, 1),
        "boundary_s_per_round": total_boundary / world / rounds_in_window,
        "lo_bytes_per_update": None if bytes0 is None or bytes1 is None else (bytes1 - bytes0) / args.updates,
        "foreign_cpu_share": foreign_share,
        "waited_for_quiet_s": waited,
    }
    if landed:
        result["lane"] = lane_telemetry(landed)
    return result


def stats_of(method: Any) -> list:
    opt = method.optimizer()
    return list(opt.round_stats) if isinstance(opt, AccoOptimizer) else []


def lane_telemetry(rounds: list) -> dict[str, Any]:
    """Means over the window's rounds (rank 0) of what the comm lane and the wait cost."""
    if not rounds:
        return {}
    phases = sorted({p for r in rounds for p in r.phase_seconds})
    return {
        "rounds": len(rounds),
        "lane_s": statistics.fmean(r.lane_seconds for r in rounds),
        "wait_s": statistics.fmean(r.wait_seconds for r in rounds),
        "hidden_share": statistics.fmean(r.hidden_share for r in rounds),
        "phase_s": {p: statistics.fmean(r.phase_seconds.get(p, 0.0) for r in rounds) for p in phases},
    }


def calibrate(args: argparse.Namespace, config: ModelConfig, next_batch: Any) -> dict[str, Any]:
    """One acco round's compute time (all ranks computing at once) and its communication
    alone: acco's collectives in sync mode with no compute, and the loopback bytes."""
    result: dict[str, Any] = {}
    model = build_method("roofline", config, args.micro_batches).model
    if not args.skip_compute:
        times = []
        dist.barrier()
        for i in range(8):
            x, y = next_batch()
            started = time.perf_counter()
            loss_fn(model, x, y).backward()
            if i >= 2:
                times.append(time.perf_counter() - started)
        (micro_batch_s,) = all_reduce_max([statistics.median(times)])
        result["micro_batch_s"] = micro_batch_s
        result["compute_s_per_round"] = micro_batch_s * (args.micro_batches // 2)
    opt = AccoOptimizer(model, torch.optim.AdamW, mode="sync", lr=1e-9)
    params = [p for p in model.parameters() if p.requires_grad]
    comm, update, byte_counts = [], [], []
    for i in range(7):
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.accumulate()
        before = lo_tx_bytes()
        opt.step()
        after = lo_tx_bytes()
        stats = opt.round_stats[-1]
        if i >= 2:
            phases = stats.phase_seconds
            comm.append(phases["weights"] + phases["reduce-scatter"] + phases["all-gather"])
            update.append(phases["update"])
            if before is not None and after is not None:
                byte_counts.append(after - before)
    opt.finish()
    (comm_s,) = all_reduce_max([statistics.median(comm)])
    result["comm_s_per_round"] = comm_s
    result["update_s_per_round"] = statistics.median(update)
    result["lo_bytes_per_round"] = statistics.median(byte_counts) if byte_counts else None
    return result


def rank_main(args: argparse.Namespace) -> None:
    ctx = start_ranks()
    config = model_config(args)
    train_data, _ = training_text(config.seq_len)
    next_batch = batches(train_data, config, config.seed + 1000 * ctx.rank)
    if args.calibrate:
        result: dict[str, Any] = calibrate(args, config, next_batch)
    else:
        # Warm the allocator and kernels up once, so the first method is not penalised.
        warm = build_method("roofline", config, args.micro_batches)
        for _ in range(2):
            warm.micro_batch(*next_batch())
        del warm
        per_repeat: dict[str, list[dict[str, Any]]] = {m: [] for m in args.methods}
        for repeat in range(args.repeats):
            shift = repeat % len(args.methods)
            for name in args.methods[shift:] + args.methods[:shift]:
                started = time.perf_counter()
                per_repeat[name].append(run_method(name, args, config, next_batch))
                gc.collect()  # the method's model, optimizer and buffers go before the next one
                if ctx.master:
                    r = per_repeat[name][-1]
                    print(f"[{args.label}] repeat {repeat} {name:10s} {r['samples_per_s']:7.2f} samples/s "
                          f"({time.perf_counter() - started:.1f} s)", flush=True)
        result = summarise(per_repeat)
    if ctx.master:
        result.update(
            ranks=ctx.world_size,
            label=args.label,
            rate=os.environ.get("ACCO_BENCH_RATE", "not limited by the benchmark"),
            threads_per_rank=torch.get_num_threads(),
        )
        write_json(Path(args.out), result)
    dist.barrier()
    dist.destroy_process_group()


def summarise(per_repeat: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians over repeats; ratios to ZeRO-1 and to the roofline taken within each repeat."""
    methods: dict[str, Any] = {}
    repeats = len(next(iter(per_repeat.values())))
    for name, runs in per_repeat.items():
        rates = [r["samples_per_s"] for r in runs]
        entry: dict[str, Any] = {"samples_per_s": rates, "median_samples_per_s": statistics.median(rates)}
        for base, key in (("ddp-zero1", "vs_zero1"), ("roofline", "vs_roofline")):
            if base in per_repeat:
                ratios = [rates[i] / per_repeat[base][i]["samples_per_s"] for i in range(repeats)]
                entry[key] = ratios
                entry[f"median_{key}"] = statistics.median(ratios)
        entry["foreign_cpu_share"] = [r["foreign_cpu_share"] for r in runs]
        for key in ("micro_batches_per_update", "compute_s_per_round", "compute_s_per_micro_batch",
                    "boundary_s_per_round", "lo_bytes_per_update"):
            values = [r[key] for r in runs if r.get(key) is not None]
            entry[key] = statistics.median(values) if values else None
        lanes = [r["lane"] for r in runs if r.get("lane")]
        if lanes:
            entry["lane"] = {
                "lane_s": statistics.median(lane["lane_s"] for lane in lanes),
                "wait_s": statistics.median(lane["wait_s"] for lane in lanes),
                "hidden_share": statistics.median(lane["hidden_share"] for lane in lanes),
                "phase_s": {p: statistics.median(lane["phase_s"][p] for lane in lanes) for p in lanes[0]["phase_s"]},
            }
        methods[name] = entry
    return {"repeats": repeats, "methods": methods}


# --------------------------------------------------------------------------- driver side


def run_ranks(args: argparse.Namespace, ranks: int, rate: str | None, extra: list[str], label: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        passthrough = [
            "--micro-batches", str(args.micro_batches), "--warmup-updates", str(args.warmup_updates),
            "--updates", str(args.updates), "--repeats", str(args.repeats), "--methods", *args.methods,
            "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--seq-len", str(args.seq_len),
            "--batch-size", str(args.batch_size), "--label", label, "--out", str(out),
        ]
        launch(ranks, [str(Path(__file__).resolve()), *passthrough, *extra], rate)
        return read_json(out)


def bits(rate_bits: float) -> str:
    return f"{int(rate_bits)}bit"


def calibrate_rates(args: argparse.Namespace, ranks: int) -> dict[str, Any]:
    """Find the tbf rates at which acco's communication per round is 1x and 3x its compute.

    The comm time is modelled as ``t(rate) = t_unlimited + bytes_eff / rate`` and the rate
    refined by measuring until it is within 10% of the target.
    """
    base = run_ranks(args, ranks, None, ["--calibrate"], f"calibrate {ranks} ranks unlimited")
    compute = base["compute_s_per_round"]
    fixed = base["comm_s_per_round"]
    print(f"calibration, {ranks} ranks: compute {compute:.3f} s per acco round; comm unlimited {fixed:.3f} s, "
          f"{base['lo_bytes_per_round']:.3g} loopback bytes per round", flush=True)
    result: dict[str, Any] = {"unlimited": base, "targets": {}}
    for label, ratio in RATE_RATIOS.items():
        if label not in args.rates:
            continue
        target = ratio * compute
        rate = base["lo_bytes_per_round"] * 8 / max(target - fixed, 1e-3)
        tries = []
        for _ in range(3):
            measured = run_ranks(args, ranks, bits(rate), ["--calibrate", "--skip-compute"],
                                 f"calibrate {ranks} ranks {label}")
            comm = measured["comm_s_per_round"]
            tries.append({"rate": bits(rate), "comm_s_per_round": comm, "ratio": comm / compute})
            print(f"  {label}: rate {bits(rate)} -> comm {comm:.3f} s = {comm / compute:.2f} x compute", flush=True)
            if abs(comm / target - 1) < 0.1:
                break
            rate *= max(comm - fixed, 1e-3) / max(target - fixed, 1e-3)
        best = min(tries, key=lambda t: abs(t["ratio"] / ratio - 1))
        result["targets"][label] = {"target_ratio": ratio, **best, "tries": tries}
    return result


def driver(args: argparse.Namespace) -> None:
    out = Path(args.out) if args.out else RESULTS_DIR / "throughput.json"
    started = time.perf_counter()
    results: dict[str, Any] = {
        "benchmark": "throughput",
        "config": {
            **model_config(args).as_dict(),
            "micro_batches_per_update": args.micro_batches,
            "warmup_updates": args.warmup_updates,
            "timed_updates": args.updates,
            "repeats": args.repeats,
            "methods": args.methods,
            "parameters": sum(p.numel() for p in common.build_model(model_config(args)).parameters()),
        },
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "python": platform.python_version()},
        "calibration": {},
        "runs": [],
    }
    for ranks in args.ranks:
        calibration = calibrate_rates(args, ranks) if set(args.rates) - {"unlimited"} else {}
        results["calibration"][str(ranks)] = calibration
        for label in args.rates:
            rate = None if label == "unlimited" else calibration["targets"][label]["rate"]
            print(f"throughput: {ranks} ranks, {label} ({rate or 'no limit'})", flush=True)
            run_started = time.perf_counter()
            run = run_ranks(args, ranks, rate, [], f"{ranks} ranks {label}")
            run["label"], run["rate"] = label, rate or "unlimited"
            run["runtime_s"] = time.perf_counter() - run_started
            results["runs"].append(run)
            results["runtime_s"] = time.perf_counter() - started
            write_json(out, results)  # after every run, so a long sweep keeps what it has
    results["runtime_s"] = time.perf_counter() - started
    write_json(out, results)
    print(f"wrote {out} ({results['runtime_s'] / 60:.1f} min)")
    if not args.no_report:
        import report

        report.main([])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:  # started by torchrun: a rank
        if args.out is None:
            args.out = str(RESULTS_DIR / "throughput-torchrun.json")
        if args.label is None:
            args.label = "torchrun"
        rank_main(args)
    else:
        driver(args)


if __name__ == "__main__":
    sys.exit(main())
