"""The CUDA comm lane on one GPU: does step() return at once, and does the round overlap?

    python benchmarks/gpu_overlap.py                 # world size 1 and 2, about 2 minutes
    python benchmarks/gpu_overlap.py --world-sizes 1 --rounds 10
    python benchmarks/gpu_overlap.py --quick --device cpu   # a smoke run of the code path, no GPU needed

World size 2 is two ranks on the same GPU, over gloo; what it measures: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import common
from examples.train_gpt import Dist

import torch
import torch.distributed as dist

__all__ = ["BENCHMARK", "blocks", "table"]

CONFIG = common.ModelConfig(n_layer=6, n_embd=512, n_head=8, seq_len=256, batch_size=16, max_grad_norm=1.0)
QUICK_CONFIG = common.ModelConfig(n_layer=2, n_embd=128, n_head=4, seq_len=64, batch_size=4, max_grad_norm=1.0)
METHODS = ("roofline", "acco-sync", "acco-dpu", "acco", "acco-aww")
# Results from before the method registry named the methods by acco's mode.
OLD_NAMES = {"none": "roofline", "sync": "acco-sync", "dpu": "acco-dpu", "acco-ready": "acco-aww"}


def arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--world-sizes", type=int, nargs="+", default=[1, 2])
    add("--rounds", type=int, default=20, help="measured rounds per method")
    add("--micro-batches", type=int, default=4, help="micro-batches per round (fixed loop)")
    add("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke run of the same code path")


def check(args: argparse.Namespace) -> str | None:
    if args.device == "cuda" and not torch.cuda.is_available():
        return "no CUDA GPU here (--device cpu runs the same code path on the CPU)"
    return None


def run_method(name: str, rounds: int, args: argparse.Namespace, ctx: Dist,
               trace: Path | None = None) -> dict[str, Any]:
    config = QUICK_CONFIG if args.quick else CONFIG
    rounds_per_update = 2 if common.method_spec(name).mode == "acco" else 1  # --micro-batches per round in every mode
    method = common.build_method(name, config, args.micro_batches * rounds_per_update, device=ctx.device)
    stream = common.batches(common.training_text(config.seq_len)[0], config, 1000 + ctx.rank)
    # 8 micro-batches already on the device, cycled: no host copy in the loop
    next_batch = itertools.cycle([tuple(t.to(ctx.device) for t in stream()) for _ in range(8)]).__next__
    cuda = ctx.device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(ctx.device)) if cuda else (lambda: None)
    for _ in range(3):  # warm-up: kernels, the lane thread, optimizer state
        common.train_round(method, next_batch)
    sync()
    dist.barrier()
    if cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    profiler = torch.profiler.profile(activities=activities) if trace else contextlib.nullcontext()
    started = time.perf_counter()
    with profiler:
        records = [common.train_round(method, next_batch) for _ in range(rounds)]
        sync()
    elapsed = time.perf_counter() - started
    if trace:
        profiler.export_chrome_trace(str(trace))
    micro_batches = sum(len(r.losses) for r in records)
    result: dict[str, Any] = {
        "method": name, "world_size": ctx.world_size, "micro_batches": micro_batches,
        "samples_per_s": micro_batches * config.batch_size * ctx.world_size / elapsed,
        "max_memory_allocated_mb": torch.cuda.max_memory_allocated(ctx.device) / 2**20 if cuda else None,
        "parameters_m": sum(p.numel() for p in method.module.parameters()) / 1e6,
    }
    if isinstance(method, common.AccoMethod):
        method.finish()
        lane = common.lane_summary(method.round_stats()[-rounds:])
        busy = [r.boundary_s * 1000 for r in records if not r.landed]
        result.update(step_ms_median=1000 * statistics.median(r.boundary_s for r in records),
                      step_ms_in_flight_median=statistics.median(busy) if busy else None,
                      step_ms_in_flight_max=max(busy) if busy else None, steps_with_round_in_flight=len(busy),
                      hidden_share=lane["hidden_share"], lane=lane,
                      micro_batches_per_round=micro_batches / len(records))
    return result


def stream_overlap(trace: Path) -> dict[str, Any]:
    """Per CUDA stream: kernel and copy time; and the other streams' time that ran while the
    busiest (the compute) stream was busy."""
    spans: dict[int, list[tuple[float, float]]] = {}
    names: dict[int, set[str]] = {}
    for event in json.loads(trace.read_text())["traceEvents"]:
        if event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "stream" in event.get("args", {}):
            stream = int(event["args"]["stream"])
            spans.setdefault(stream, []).append((event["ts"], event["ts"] + event["dur"]))
            names.setdefault(stream, set()).add(event["name"][:60])
    busy = {s: sum(b - a for a, b in v) / 1e6 for s, v in spans.items()}
    if not busy:
        return {}
    compute = max(busy, key=busy.get)

    def covered(a: float, b: float) -> float:
        return sum(max(0.0, min(b, d) - max(a, c)) for c, d in spans[compute] if c < b and d > a)

    return {"compute_stream": compute, "streams": {str(s): {
        "busy_s": busy[s], "kernels": len(spans[s]), "examples": sorted(names[s])[:6],
        "overlapped_with_compute_s": None if s == compute else sum(covered(a, b) for a, b in spans[s]) / 1e6,
    } for s in sorted(spans)}}


def rank(args: argparse.Namespace, ctx: Dist) -> dict[str, Any]:
    results = [run_method(name, args.rounds, args, ctx) for name in METHODS]
    raw = Path(tempfile.mkdtemp()) / "trace.json"
    profiled = run_method("acco", 6, args, ctx, raw if ctx.master else None)
    if not ctx.master:
        return {}
    trace = (common.SCRATCH_DIR if args.quick else common.RESULTS_DIR) / f"gpu_overlap-trace-ws{ctx.world_size}.json.gz"
    trace.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(trace, "wb") as target:
        target.write(raw.read_bytes())
    device = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "CPU"
    return {"world_size": ctx.world_size, "device": device, "torch": torch.__version__,
            "config": (QUICK_CONFIG if args.quick else CONFIG).as_dict(), "rounds": args.rounds,
            "micro_batches_per_round": args.micro_batches, "methods": results, "profiled": profiled,
            "trace": trace.name, "streams": stream_overlap(raw)}


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    runs = [common.run_ranks(args, world_size, "--label", f"ws{world_size}") for world_size in args.world_sizes]
    print(table(runs))
    return {"runs": runs}


def table(runs: list[dict[str, Any]]) -> str:
    """One row per world size and method."""
    rows = []
    for run in runs:
        methods = [{**r, "method": OLD_NAMES.get(r["method"], r["method"])} for r in run["methods"]]
        base = next(r for r in methods if r["method"] == "roofline")["samples_per_s"]
        for r in methods:
            memory = "-" if r.get("max_memory_allocated_mb") is None else f"{r['max_memory_allocated_mb']:.0f}"
            if r["method"] == "roofline":
                rows.append([str(run["world_size"]), "no optimizer (forward + backward only)",
                             f"{r['samples_per_s']:.0f}", "1.00", "-", "-", "-", memory])
                continue
            busy = r.get("step_ms_in_flight_median")
            in_flight = "-" if busy is None else (
                f"{busy:.2f} / {r['step_ms_in_flight_max']:.2f} ({r['steps_with_round_in_flight']} steps)")
            rows.append([str(run["world_size"]), common.label(r["method"]), f"{r['samples_per_s']:.0f}",
                         f"{r['samples_per_s'] / base:.2f}", f"{r['step_ms_median']:.2f}", in_flight,
                         f"{r['hidden_share']:.2f}", memory])
    return common.md_table(["world size", "method", "samples/s", "vs no optimizer", "step() ms, median",
                     "step() ms with the round in flight, median / max", "hidden share (GPU time)",
                     "max allocated MiB"], rows)


def section(data: dict[str, Any]) -> str:
    run, lines = data["runs"][0], []
    config = run["config"]
    for r in data["runs"]:
        info = r["streams"]
        for stream, v in info.get("streams", {}).items():
            if int(stream) != info["compute_stream"] and v["kernels"] > 10:
                lines.append(f"- world size {r['world_size']}: the lane's stream ran {v['kernels']} kernels for "
                             f"{1000 * v['busy_s']:.1f} ms in the profiled rounds, "
                             f"{1000 * v['overlapped_with_compute_s']:.1f} ms of it while the compute stream was busy "
                             f"(compute stream: {1000 * info['streams'][str(info['compute_stream'])]['busy_s']:.0f} "
                             f"ms); trace: [results/{r['trace']}](results/{r['trace']})")
    return (f"{run['device']}, torch {run['torch']}; the example's GPT ({config['n_layer']} layers, width "
            f"{config['n_embd']}, {run['methods'][0]['parameters_m']:.1f}M parameters), {config['batch_size']} x "
            f"{config['seq_len']} tokens per micro-batch, {run['micro_batches_per_round']} micro-batches per round "
            "(the `ready()` loop: and more while the round is in flight), AdamW, clipping at "
            f"{config['max_grad_norm']}, "
            f"{run['rounds']} measured rounds. World size 2 = two ranks on the one GPU, gloo on CUDA tensors.\n\n"
            + table(data["runs"]) + "\n\n" + "\n".join(lines))


def blocks(results: dict[str, Any], figures: Path) -> dict[str, str]:
    return {"gpu": section(results["gpu_overlap"])}


BENCHMARK = common.Benchmark("gpu_overlap", __doc__, arguments, rank, sweep, check=check,
                             quick={"world_sizes": [1], "rounds": 3, "micro_batches": 2})

if __name__ == "__main__":
    common.main(BENCHMARK)
