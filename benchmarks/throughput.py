"""Throughput: samples/s of acco against DDP + ZeRO-1, plain DDP and the compute-only
roofline, at equal micro-batches per optimizer update, behind a rate-limited network.

    sudo $(which python) benchmarks/throughput.py            # calibration, 3 rates x 2 and 4 ranks: ~50 min
    sudo $(which python) benchmarks/throughput.py --quick    # 2 ranks, 1 repeat: a few minutes
    sudo $(which python) benchmarks/throughput.py --quick --rates unlimited --baseline /tmp/acco-352a168
    torchrun --nnodes=2 --nproc-per-node=1 ... benchmarks/throughput.py --out throughput-cluster.json

The window, the calibrated rates and the A/B: benchmarks/README.md, "Throughput".
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import common
from examples.train_gpt import Dist, loss_fn

import acco
import torch
import torch.distributed as dist

__all__ = ["BENCHMARK", "blocks", "calibrate_rates", "runtimes", "targets"]

RATE_LABELS = ("unlimited", "comm~compute", "comm~3x")
COMPUTE_LANE, COMM_LANE, GLOO = "compute lane (main thread)", "acco comm lane (thread)", "gloo I/O threads"
RATE_RATIOS = {"comm~compute": 1.0, "comm~3x": 3.0}
THROUGHPUT_METHODS = [n for n, s in common.METHODS.items() if s.family != "diloco"]
DEFAULT_METHODS = ["roofline", "ddp-zero1", "ddp-adamw", "acco-sync", "acco-dpu", "acco", "acco-aww", "acco-bf16",
                   "acco-fp8"]


def arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--ranks", type=int, nargs="+", default=[2, 4], help="rank counts to sweep")
    add("--rates", nargs="+", default=list(RATE_LABELS), choices=RATE_LABELS, help="rates to sweep")
    add("--methods", nargs="+", default=DEFAULT_METHODS, choices=THROUGHPUT_METHODS)
    add("--micro-batches", type=common.even, default=4, help="micro-batches per rank per optimizer update")
    add("--warmup-updates", type=int, default=1)
    add("--updates", type=int, default=3, help="updates in the timed window")
    add("--repeats", type=int, default=None, help="default 3 (--quick: 1)")
    common.model_arguments(parser, common.ModelConfig())
    add("--baseline", type=Path, default=None, help="another checkout's root: A/B of its acco against this one's")
    add("--calibrate", action="store_true", help=argparse.SUPPRESS)  # set by the driver for its rank launches
    add("--skip-compute", action="store_true", help=argparse.SUPPRESS)


def check(args: argparse.Namespace) -> str | None:
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.baseline is not None:  # an A/B run is printed, not a README figure
        args.no_report = True
        if "--out" not in args.argv:
            args.out = common.SCRATCH_DIR / "throughput-vs-baseline.json"
    if args.warmup_updates < 1 or args.updates < 1:
        return "--warmup-updates and --updates must be at least 1"
    if args.baseline is not None and not (args.baseline / "acco" / "__init__.py").is_file():
        return f"--baseline {args.baseline}: no acco/__init__.py there"
    return None


def run_method(method: common.Method, next_batch: Any, warmup_rounds: int, rounds: int,
               trace: Path | None = None) -> dict[str, Any]:
    """Warm-up, then ``rounds`` rounds in a window between barriers at two round boundaries:
    samples/s over the slowest rank's window, and rank 0's view of where the time went per
    round (profile_lanes.py's table); ``trace``: a torch.profiler trace."""
    window = common.Window()
    for _ in range(warmup_rounds):
        common.train_round(method, next_batch)
    landed_before = len(method.round_stats())
    # The window is global: it opens when every rank has reached this boundary (ranks
    # that share cores would otherwise each time a stretch where the others idle).
    dist.barrier()
    window.open()
    threads0 = thread_times()
    cpu = [torch.profiler.ProfilerActivity.CPU]
    profiler = torch.profiler.profile(activities=cpu) if trace else contextlib.nullcontext()
    with profiler:
        records = [common.train_round(method, next_batch) for _ in range(rounds)]
        threads = {kind: [(a - b) / rounds for a, b in zip(times, threads0.get(kind, (0.0, 0.0)))]
                   for kind, times in thread_times().items()}
        dist.barrier()
        measured = window.close()
    if trace is not None:
        profiler.export_chrome_trace(str(trace))
    lane = common.lane_summary(method.round_stats()[landed_before:])  # the rounds that landed in the window
    method.finish()
    (slowest,) = common.all_reduce([measured.pop("wall_s")], "max")
    micro_batches, compute_s, boundary_s = common.all_reduce(
        [sum(len(r.losses) for r in records), sum(r.compute_s for r in records), sum(r.boundary_s for r in records)])
    world, lo_bytes, updates = dist.get_world_size(), measured.pop("lo_bytes"), rounds / method.rounds_per_update
    mean = statistics.fmean
    return {
        "samples_per_s": micro_batches * method.config.batch_size / slowest, "window_s": slowest,
        "micro_batches_per_update": micro_batches / world / updates,
        "compute_s_per_round": compute_s / world / rounds,
        "compute_s_per_micro_batch": compute_s / max(micro_batches, 1),
        "boundary_s_per_round": boundary_s / world / rounds,
        "lo_bytes_per_update": None if lo_bytes is None else lo_bytes / updates, **measured,
        **({"lane": lane} if lane else {}),
        "round_wall_s": slowest / rounds, "micro_batches_per_round": mean(len(r.losses) for r in records),
        "micro_batch_wall_s": mean(t for r in records for t in r.micro_batch_s),
        "micro_batch_cpu_s": mean(t for r in records for t in r.micro_batch_cpu_s),
        "step_wall_s": mean(r.boundary_s for r in records), "step_cpu_s": mean(r.boundary_cpu_s for r in records),
        "thread_cpu_s_per_round": {kind: t[0] for kind, t in threads.items()},
        "thread_runqueue_wait_s_per_round": {kind: t[1] for kind, t in threads.items()},
    }


def thread_times() -> dict[str, tuple[float, float]]:
    """This process's threads by kind: CPU seconds, and seconds runnable but waiting for a core
    (``/proc/self/task/*/schedstat``): with no free core, the comm lane's CPU is compute's wait."""
    lane = {t.native_id for t in threading.enumerate() if t.name == "acco-comm-lane"}
    out: dict[str, tuple[float, float]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            on_cpu_ns, waiting_ns, _ = (int(v) for v in Path(f"/proc/self/task/{tid}/schedstat").read_text().split())
        except (OSError, ValueError):
            continue
        kind = (COMPUTE_LANE if int(tid) == threading.get_native_id() else COMM_LANE if int(tid) in lane
                else GLOO if name.startswith(("gloo", "pt_gloo")) else "other threads")
        cpu, waited = out.get(kind, (0.0, 0.0))
        out[kind] = (cpu + on_cpu_ns / 1e9, waited + waiting_ns / 1e9)
    return out


def calibrate(args: argparse.Namespace, config: common.ModelConfig, next_batch: Any) -> dict[str, Any]:
    """One acco round's compute time (all ranks computing at once) and its communication
    alone: acco's collectives in sync mode with no compute, and the loopback bytes."""
    result: dict[str, Any] = {}
    model = common.build_model(config)
    if not args.skip_compute:
        times = []
        dist.barrier()
        for _ in range(8):
            x, y = next_batch()
            started = time.perf_counter()
            loss_fn(model, x, y).backward()
            times.append(time.perf_counter() - started)
        (micro_batch_s,) = common.all_reduce([statistics.median(times[2:])], "max")
        result.update(micro_batch_s=micro_batch_s, compute_s_per_round=micro_batch_s * (args.micro_batches // 2))
    opt = acco.AccoOptimizer(model, torch.optim.AdamW, mode="sync", lr=1e-9)
    comm, update, byte_counts = [], [], []
    for i in range(7):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.accumulate()
        before = common.lo_tx_bytes()
        opt.step()
        after = common.lo_tx_bytes()
        if i >= 2:
            seconds = common.phases(opt.round_stats[-1].phase_seconds)
            comm.append(seconds["totals"] + seconds["reduce-scatter"] + seconds["all-gather"])
            update.append(seconds["update"])
            if before is not None and after is not None:
                byte_counts.append(after - before)
    opt.finish()
    (result["comm_s_per_round"],) = common.all_reduce([statistics.median(comm)], "max")
    result["update_s_per_round"] = statistics.median(update)
    result["lo_bytes_per_round"] = statistics.median(byte_counts) if byte_counts else None
    return result


def rank(args: argparse.Namespace, ctx: Dist) -> dict[str, Any]:
    config = common.model_config(args)
    next_batch = common.rank_batches(config, ctx.rank)
    if args.calibrate:
        return calibrate(args, config, next_batch)
    common.warm_up(config, next_batch)
    checkouts: dict[str, common.Checkout | None] = {"this": None}
    if args.baseline is not None:
        checkouts["baseline"] = common.Checkout(args.baseline)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {side: {m: [] for m in args.methods} for side in checkouts}
    for repeat in range(args.repeats):
        for name in common.rotated(args.methods, repeat):
            for side in common.rotated(list(checkouts), repeat):  # A/B interleaved, alternating which goes first
                checkout, started = checkouts[side], time.perf_counter()
                with checkout.active() if checkout else contextlib.nullcontext():
                    acco_module = checkout.acco if checkout else None
                    method = common.build_method(name, config, args.micro_batches, acco_module=acco_module)
                    rounds_per_update = method.rounds_per_update
                    runs[side][name].append(run_method(method, next_batch, args.warmup_updates * rounds_per_update,
                                                       args.updates * rounds_per_update))
                    del method
                    gc.collect()  # the method's model, optimizer and buffers go before the next one
                if ctx.master:
                    print(f"[{args.label}] repeat {repeat} {name:10s}" + (f" {side:8s}" if args.baseline else "") + " "
                          f"{runs[side][name][-1]['samples_per_s']:7.2f} samples/s "
                          f"({time.perf_counter() - started:.1f} s)", flush=True)
    result = summarise(runs["this"])
    if args.baseline is not None:
        base = checkouts["baseline"]
        result["baseline"] = {"path": str(base.root), "commit": base.commit, **summarise(runs["baseline"])}
        for name, entry in result["methods"].items():
            ratios = [a["samples_per_s"] / b["samples_per_s"]
                      for a, b in zip(runs["this"][name], runs["baseline"][name])]
            entry.update(vs_baseline=ratios, median_vs_baseline=statistics.median(ratios))
    result.update(ranks=ctx.world_size, label=args.label, threads_per_rank=torch.get_num_threads(),
                  rate=os.environ.get("ACCO_BENCH_RATE", "not limited by the benchmark"))
    return result


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians over repeats; ratios to ZeRO-1 and to the roofline taken within each repeat."""
    methods: dict[str, Any] = {}
    for name, repeats in runs.items():
        rates = [r["samples_per_s"] for r in repeats]
        entry: dict[str, Any] = {"samples_per_s": rates, "median_samples_per_s": statistics.median(rates),
                                 "foreign_cpu_share": [r["foreign_cpu_share"] for r in repeats]}
        for base, key in (("ddp-zero1", "vs_zero1"), ("roofline", "vs_roofline")):
            if base in runs:
                entry[key] = [a / b["samples_per_s"] for a, b in zip(rates, runs[base])]
                entry[f"median_{key}"] = statistics.median(entry[key])
        for key in ("micro_batches_per_update", "compute_s_per_round", "compute_s_per_micro_batch",
                    "boundary_s_per_round", "lo_bytes_per_update"):
            values = [r[key] for r in repeats if r.get(key) is not None]
            entry[key] = statistics.median(values) if values else None
        lanes = [r["lane"] for r in repeats if r.get("lane")]
        if lanes:
            entry["lane"] = {key: statistics.median(lane[key] for lane in lanes)
                             for key in ("lane_s", "wait_s", "hidden_share")}
            entry["lane"]["phase_s"] = {p: statistics.median(lane["phase_s"].get(p, 0.0) for lane in lanes)
                                        for p in lanes[0]["phase_s"]}
        methods[name] = entry
    return {"repeats": len(next(iter(runs.values()))), "methods": methods}


def bits(rate: float) -> str:
    return f"{int(rate)}bit"


def calibrate_rates(args: argparse.Namespace, ranks: int) -> dict[str, Any]:
    """The tbf rates at which acco's communication per round is 1x and 3x its compute: comm
    time modelled as ``t_unlimited + bytes / rate``, refined by measuring until within 10%."""
    base = common.run_ranks(args, ranks, "--calibrate", "--label", f"calibrate {ranks} ranks", netns=True)
    compute, fixed = base["compute_s_per_round"], base["comm_s_per_round"]
    print(f"calibration, {ranks} ranks: compute {compute:.3f} s per acco round; comm unlimited {fixed:.3f} s, "
          f"{base['lo_bytes_per_round']:.3g} loopback bytes per round", flush=True)
    result: dict[str, Any] = {"unlimited": base, "targets": {}}
    for name, ratio in RATE_RATIOS.items():
        if name not in args.rates:
            continue
        target = ratio * compute
        rate = base["lo_bytes_per_round"] * 8 / max(target - fixed, 1e-3)
        tries = []
        for _ in range(3):
            comm = common.run_ranks(args, ranks, "--calibrate", "--skip-compute", "--label", f"calibrate {name}",
                                    rate=bits(rate), netns=True)["comm_s_per_round"]
            tries.append({"rate": bits(rate), "comm_s_per_round": comm, "ratio": comm / compute})
            print(f"  {name}: rate {bits(rate)} -> comm {comm:.3f} s = {comm / compute:.2f} x compute", flush=True)
            if abs(comm / target - 1) < 0.1:
                break
            rate *= max(comm - fixed, 1e-3) / max(target - fixed, 1e-3)
        best = min(tries, key=lambda t: abs(t["ratio"] / ratio - 1))
        result["targets"][name] = {"target_ratio": ratio, **best, "tries": tries}
    return result


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    started, config = time.perf_counter(), common.model_config(args)
    results: dict[str, Any] = {
        "config": {**config.as_dict(), "micro_batches_per_update": args.micro_batches,
                   "warmup_updates": args.warmup_updates, "timed_updates": args.updates, "repeats": args.repeats,
                   "methods": args.methods,
                   "parameters": sum(p.numel() for p in common.build_model(config).parameters())},
        "calibration": {}, "runs": [],
    }
    for ranks in args.ranks:
        calibration = calibrate_rates(args, ranks) if set(args.rates) - {"unlimited"} else {}
        results["calibration"][str(ranks)] = calibration
        for name in args.rates:
            rate = None if name == "unlimited" else calibration["targets"][name]["rate"]
            print(f"throughput: {ranks} ranks, {name} ({rate or 'no limit'})", flush=True)
            run = common.run_ranks(args, ranks, "--label", f"{ranks} ranks {name}", rate=rate, netns=True)
            run.update(label=name, rate=rate or "unlimited")
            results["runs"].append(run)
            results["runtime_s"] = time.perf_counter() - started
            common.save(args, results)  # after every run, so a long sweep keeps what it has
            if args.baseline is not None:
                print(baseline_table(run))
    return results


def by_ranks(data: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """The sweep's runs by rank count, then by rate label."""
    runs: dict[int, dict[str, Any]] = {}
    for run in data["runs"]:
        runs.setdefault(run["ranks"], {})[run["label"]] = run
    return dict(sorted(runs.items()))


def table(data: dict[str, Any]) -> str:
    cfg, cpus = data["config"], data["machine"]["cpus"]
    out = [f"{common.describe(cfg, cfg['parameters'])}, {cfg['micro_batches_per_update']} micro-batches "
           f"per rank per update, {cfg['timed_updates']} timed updates after {cfg['warmup_updates']} of warm-up, "
           f"median of {cfg['repeats']} repeats; one torch thread per rank on {cpus} cores "
           f"(torch {data['machine']['torch']}). Each cell: samples/s, then the ratio to DDP + ZeRO-1 and to the "
           f"roofline measured side by side in the same repeat (medians).", ""]
    for ranks, runs in by_ranks(data).items():
        rates = [r for r in RATE_LABELS if r in runs]
        rows = [[common.label(name)] + [cell(runs[r]["methods"].get(name)) for r in rates]
                for name in common.METHODS if any(name in runs[r]["methods"] for r in rates)]
        note = " (oversubscribed: 4 ranks on 2 cores)" if ranks > (cpus or 1) else ""
        header = ["method"] + [f"{r} ({common.rate_text(runs[r]['rate'])})" for r in rates]
        out += [f"**{ranks} ranks{note}**", "", common.md_table(header, rows), ""]
    return "\n".join(out)


def cell(m: dict[str, Any] | None) -> str:
    if m is None:
        return ""
    return (f"{m['median_samples_per_s']:.1f} (x{m.get('median_vs_zero1', math.nan):.2f} ZeRO-1, "
            f"x{m.get('median_vs_roofline', math.nan):.2f} roofline)")


def calibration_table(data: dict[str, Any]) -> str:
    rows = []
    for ranks, cal in sorted(data["calibration"].items(), key=lambda kv: int(kv[0])):
        for name, target in (cal or {}).get("targets", {}).items():
            base = cal["unlimited"]
            rows.append([ranks, name, f"{base['compute_s_per_round'] * 1000:.0f} ms",
                         f"{base['lo_bytes_per_round'] / 1e6:.1f} MB", f"{base['comm_s_per_round'] * 1000:.0f} ms",
                         f"{target['rate']} ({common.rate_text(target['rate'])})",
                         f"{target['comm_s_per_round'] * 1000:.0f} ms", f"{target['ratio']:.2f}"])
    return common.md_table(["ranks", "target", "compute per acco round", "loopback bytes per round",
                            "comm per round, unlimited", "tbf rate", "comm per round at that rate", "comm / compute"],
                           rows)


def lane_table(data: dict[str, Any]) -> str:
    """What the lanes did in the timed windows (rank 0, medians over repeats)."""
    lane_phases = ("totals", "reduce-scatter", "update", "all-gather")
    rows = []
    for ranks, runs in by_ranks(data).items():
        for rate in [r for r in RATE_LABELS if r in runs]:
            roof = runs[rate]["methods"].get("roofline")
            for name in [n for n in common.METHODS if n in runs[rate]["methods"]]:
                if name in ("roofline", "ddp-adamw") or common.METHODS[name].estimate_dtype is not None:
                    continue
                m = runs[rate]["methods"][name]
                lane = m.get("lane", {})
                seconds = common.phases(lane.get("phase_s", {}))
                rows.append([
                    str(ranks), rate, common.label(name),
                    f"{m['compute_s_per_micro_batch'] * 1000:.0f}"
                    + (f" ({roof['compute_s_per_micro_batch'] * 1000:.0f})" if roof else ""),
                    f"{m['micro_batches_per_update']:.1f}", f"{m['boundary_s_per_round'] * 1000:.0f}",
                    f"{lane['lane_s'] * 1000:.0f}" if lane else "",
                    " / ".join(f"{seconds.get(p, 0) * 1000:.0f}" for p in lane_phases) if seconds else "",
                    f"{lane['hidden_share']:.0%}" if lane else "",
                    f"{m['lo_bytes_per_update'] / 1e6:.1f}" if m.get("lo_bytes_per_update") else "",
                    f"{max(m['foreign_cpu_share']):.0%}",
                ])
    return common.md_table(["ranks", "rate", "method", "compute ms per micro-batch (roofline)",
                            "micro-batches per update", "step() ms per round", "lane ms per round",
                            " / ".join(lane_phases) + " ms", "comm hidden", "loopback MB per update",
                            "other load (max)"], rows)


def baseline_table(run: dict[str, Any]) -> str:
    """An A/B run (``--baseline``): medians of both checkouts and their ratio per method."""
    base = run["baseline"]
    rows = [[common.label(name), f"{m['median_samples_per_s']:.2f}",
             f"{base['methods'][name]['median_samples_per_s']:.2f}",
             f"{m['median_vs_baseline']:.3f} ({min(m['vs_baseline']):.3f}-{max(m['vs_baseline']):.3f})"]
            for name, m in run["methods"].items()]
    return (f"{run['ranks']} ranks, {run['label']}: this checkout against {base['path']} ({base['commit']}), "
            f"{run['repeats']} interleaved repeats\n\n" + common.md_table(
                ["method", "samples/s, this", "samples/s, baseline", "ratio this / baseline (min-max)"], rows))


def plot(data: dict[str, Any], path: Path) -> str:
    plt = common.pyplot()
    runs = by_ranks(data)
    fig, axes = plt.subplots(1, len(runs), figsize=(7 * len(runs), 4.5), squeeze=False)
    for ax, (ranks, by_rate) in zip(axes[0], runs.items()):
        rates = [r for r in RATE_LABELS if r in by_rate]
        names = [n for n in common.METHODS if any(n in by_rate[r]["methods"] for r in rates)]
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            values = [by_rate[r]["methods"].get(name, {}).get("median_vs_roofline", 0) for r in rates]
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(rates))]
            ax.bar(xs, values, width, label=common.label(name).replace("`", ""), color=common.METHODS[name].colour,
                   hatch={"--": "//", ":": ".."}.get(common.METHODS[name].line, ""), edgecolor="white")
        ax.axhline(0.95, color="k", lw=0.8, ls="--")
        ax.axhline(0.9, color="k", lw=0.8, ls=":")
        ax.set_xticks(range(len(rates)), [f"{r}\n{common.rate_text(by_rate[r]['rate'])}" for r in rates])
        ax.set(ylabel="samples/s / roofline", ylim=(0, 1.1),
               title=f"{ranks} ranks" + (" (oversubscribed)" if ranks > data["machine"]["cpus"] else ""))
    axes[0][0].legend(fontsize=7, loc="lower left")
    return common.save_figure(fig, path)


def blocks(results: dict[str, Any], figures: Path) -> dict[str, str]:
    """README blocks of every sweep: ``throughput.json`` and the ``throughput-NAME.json`` beside it."""
    out = {}
    for stem, data in results.items():
        suffix = stem.removeprefix("throughput")
        out[stem] = table(data) + f"\n![{stem}](results/{plot(data, figures / f'{stem}.png')})"
        out["calibration" + suffix] = calibration_table(data)
        out["lanes" + suffix] = lane_table(data)
        ab = [baseline_table(run) for run in data["runs"] if "baseline" in run]
        if ab:  # an A/B run (--baseline): both checkouts' medians and their ratio
            out["ab" + suffix] = "\n\n".join(ab)
    return out


def targets(results: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    rows: list[tuple[str, str, bool | None]] = []
    for data in results.values():
        k = f"{data['config']['micro_batches_per_update']} micro-batches per update"
        two = by_ranks(data).get(2, {})
        mid, slow, free = (two.get(r, {}).get("methods", {}) for r in ("comm~compute", "comm~3x", "unlimited"))
        if "acco" in mid:
            acco_mid = mid["acco"]
            rows += [(f"2 ranks, {k}, comm ~ compute: acco >= 0.95 x roofline",
                      f"{acco_mid['median_vs_roofline']:.3f}", acco_mid["median_vs_roofline"] >= 0.95),
                     (f"2 ranks, {k}, comm ~ compute: acco >= 2 x DDP + ZeRO-1", f"{acco_mid['median_vs_zero1']:.2f}",
                      acco_mid["median_vs_zero1"] >= 2)]
            if "acco-aww" in mid:
                rows.append((f"(for reference) 2 ranks, {k}, comm ~ compute: `ready()` loop vs roofline / ZeRO-1",
                             f"{mid['acco-aww']['median_vs_roofline']:.3f} / {mid['acco-aww']['median_vs_zero1']:.2f}",
                             None))
        if "acco-aww" in slow:
            ratio = slow["acco-aww"]["median_vs_roofline"]
            rows.append((f"2 ranks, {k}, comm ~ 3x compute: `ready()` loop >= 0.9 x roofline", f"{ratio:.3f}",
                         ratio >= 0.9))
        if "acco" in free:
            ratio = free["acco"]["median_vs_zero1"]
            rows.append((f"2 ranks, {k}, unlimited: acco not slower than DDP + ZeRO-1", f"{ratio:.3f}", ratio >= 1.0))
    return rows


def runtimes(results: dict[str, Any]) -> list[tuple[str, float]]:
    return [row for stem, data in results.items()
            for row in [(stem, data["runtime_s"]), *((f"  {r['ranks']} ranks, {r['label']}", r["runtime_s"])
                                                     for r in data["runs"])]]


BENCHMARK = common.Benchmark("throughput", __doc__, arguments, rank, sweep, check=check,
                             quick={"ranks": [2], "updates": 2})

if __name__ == "__main__":
    common.main(BENCHMARK)
