"""acco on one GPU beside the peers a GPU user would pick (DDP + fused AdamW, DDP + ZeRO-1,
ZeRO-1 overlapped with DDP, FSDP2), same model, data and precision: does step() return at
once, does the round overlap, what does it hold in memory against docs/memory.md's formula?

    python benchmarks/gpu_overlap.py                 # small and large model, world size 1 and 2
    python benchmarks/gpu_overlap.py --models small --world-sizes 1 --rounds 10
    python benchmarks/gpu_overlap.py --quick --device cpu   # a smoke run of the code path, no GPU needed

World size 2 is two ranks on the same GPU, over gloo; what it measures: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import gzip
import itertools
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import common
from examples.train_gpt import Dist

import torch
import torch.distributed as dist

__all__ = ["BENCHMARK", "PRESETS", "Preset", "blocks", "formula_bytes", "table"]


@dataclasses.dataclass(frozen=True)
class Preset:
    """A model size and its precision: ``mixed`` computes in that dtype over an fp32 master
    (:func:`common.build_method`), None is fp32 throughout."""

    config: common.ModelConfig
    mixed: torch.dtype | None = None


PRESETS = {
    "small": Preset(common.ModelConfig(n_layer=6, n_embd=512, n_head=8, seq_len=256, batch_size=16, max_grad_norm=1.0)),
    # GPT-2 medium's shape, a byte vocabulary: 352M parameters; bf16 compute, fp32 master
    "large": Preset(common.ModelConfig(n_layer=28, n_embd=1024, n_head=16, seq_len=512, batch_size=8,
                                       max_grad_norm=1.0), torch.bfloat16),
}
QUICK_CONFIG = common.ModelConfig(n_layer=2, n_embd=128, n_head=4, seq_len=64, batch_size=4, max_grad_norm=1.0)
METHODS = ("roofline", "ddp-adamw", "ddp-zero1", "ddp-zero1-overlap", "fsdp2", "acco-sync", "acco-dpu", "acco",
           "acco-aww")
# Results from before the method registry named the methods by acco's mode.
OLD_NAMES = {"none": "roofline", "sync": "acco-sync", "dpu": "acco-dpu", "acco-ready": "acco-aww"}


def arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--world-sizes", type=int, nargs="+", default=[1, 2])
    add("--models", nargs="+", default=list(PRESETS), choices=list(PRESETS),
        help="small: 19M parameters, fp32; large: 352M, bf16 compute over an fp32 master (--quick: both tiny)")
    add("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    add("--rounds", type=int, default=20, help="measured rounds per method")
    add("--micro-batches", type=int, default=4, help="micro-batches per round (fixed loop)")
    add("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke run of the same code path")
    add("--backend", choices=["nccl", "gloo"], default=None, help=argparse.SUPPRESS)  # set by the driver per launch


def check(args: argparse.Namespace) -> str | None:
    if args.device == "cuda" and not torch.cuda.is_available():
        return "no CUDA GPU here (--device cpu runs the same code path on the CPU)"
    return None


def preset(args: argparse.Namespace, model: str) -> Preset:
    chosen = PRESETS[model]
    return dataclasses.replace(chosen, config=QUICK_CONFIG) if args.quick else chosen


def formula_bytes(mode: str, parameters: int, world_size: int, param_bytes: int, reduce_bytes: int) -> dict[str, int]:
    """docs/memory.md's formula for acco over AdamW: each buffer's bytes, the live
    parameters left out (one flat group; the shard padded to a whole element per rank)."""
    shard, master = math.ceil(parameters / world_size), 4
    every_fp32 = param_bytes == reduce_bytes == master
    rows = {"accumulator": parameters * reduce_bytes}
    if mode != "sync":
        rows["hand-over"] = parameters * reduce_bytes
    if not (mode in ("sync", "dpu") and every_fp32):
        rows["master shard"] = shard * master
    if reduce_bytes != master:
        rows["averaged gradient shard"] = shard * master
    if param_bytes > reduce_bytes:
        rows["all-gather target"] = parameters * param_bytes
    rows["AdamW state"] = 2 * shard * master
    if mode == "acco":
        # the state's copy; the master shard's working copy goes in an already-sent chunk of
        # the round's buffer, which holds it only when that buffer is as wide as the master
        rows["estimate copy"] = (2 if reduce_bytes >= master else 3) * shard * master
    return rows


def acco_accounting(method: common.AccoMethod) -> dict[str, int]:
    """Bytes acco says it holds: its buffers (``buffer_bytes()``, summed over groups) and the
    base optimizers' state."""
    state = sum(t.nbytes for b in method.opt.base_optimizers if b is not None for st in b.state.values()
                for t in st.values() if isinstance(t, torch.Tensor))
    buffers: dict[str, int] = {"optimizer state": state}
    for group in method.opt.buffer_bytes():
        for name, nbytes in group.items():
            buffers[name] = buffers.get(name, 0) + nbytes
    return buffers


def run_method(name: str, rounds: int, args: argparse.Namespace, ctx: Dist, model: str,
               trace: Path | None = None) -> dict[str, Any]:
    chosen = preset(args, model)
    config = chosen.config
    rounds_per_update = 2 if common.method_spec(name).mode == "acco" else 1  # --micro-batches per round in every mode
    try:
        method = common.build_method(name, config, args.micro_batches * rounds_per_update, device=ctx.device,
                                     mixed=chosen.mixed, bucket_view=True)
    except common.UnsupportedMethod as error:
        return {"method": name, "world_size": ctx.world_size, "skipped": str(error)}
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
    module_params = list({id(p): p for p in method.module.parameters()}.values())
    result: dict[str, Any] = {
        "method": name, "world_size": ctx.world_size, "micro_batches": micro_batches,
        "samples_per_s": micro_batches * config.batch_size * ctx.world_size / elapsed,
        "max_memory_allocated_mb": torch.cuda.max_memory_allocated(ctx.device) / 2**20 if cuda else None,
        "parameters_m": sum(p.numel() for p in method.module.parameters()) / 1e6,
        "step_ms_median": 1000 * statistics.median(r.boundary_s for r in records),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in module_params),
    }
    if isinstance(method, common.AccoMethod):
        parameters = sum(p.numel() for p in module_params)  # unique: a tied parameter once
        param_bytes = module_params[0].element_size()
        reduce_bytes = torch.empty((), dtype=method.opt.options.reduce_dtype or module_params[0].dtype).element_size()
        formula = formula_bytes(common.method_spec(name).mode, parameters, ctx.world_size, param_bytes, reduce_bytes)
        result.update(formula_bytes=formula, acco_accounting_bytes=acco_accounting(method))
        method.finish()
        lane = common.lane_summary(method.round_stats()[-rounds:])
        busy = [r.boundary_s * 1000 for r in records if not r.landed]
        result.update(step_ms_in_flight_median=statistics.median(busy) if busy else None,
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
    models = []
    for model in args.models:
        methods = []
        for name in args.methods:
            methods.append(run_method(name, args.rounds, args, ctx, model))
            gc.collect()  # the method's model, optimizer and buffers go before the next one
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
        chosen = preset(args, model)
        models.append({"model": model, "config": chosen.config.as_dict(),
                       "mixed": None if chosen.mixed is None else str(chosen.mixed), "methods": methods})
    raw = Path(tempfile.mkdtemp()) / "trace.json"
    profiled = run_method("acco", 6, args, ctx, args.models[0], raw if ctx.master else None)
    if not ctx.master:
        return {}
    trace = (common.SCRATCH_DIR if args.quick else common.RESULTS_DIR) / f"gpu_overlap-trace-ws{ctx.world_size}.json.gz"
    trace.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(trace, "wb") as target:
        target.write(raw.read_bytes())
    device = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "CPU"
    return {"world_size": ctx.world_size, "device": device, "torch": torch.__version__,
            "backend": dist.get_backend(), "rounds": args.rounds,
            "micro_batches_per_round": args.micro_batches, "models": models, "profiled": profiled,
            "profiled_model": args.models[0], "trace": trace.name, "streams": stream_overlap(raw)}


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    # NCCL where every rank has its own GPU (world size 1 here); two ranks on one GPU need gloo,
    # NCCL refuses them.
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    runs = [common.run_ranks(args, world_size, "--label", f"ws{world_size}", "--backend",
                             "nccl" if world_size <= gpus else "gloo") for world_size in args.world_sizes]
    print(table(runs))
    return {"runs": runs}


def models_of(run: dict[str, Any]) -> list[dict[str, Any]]:
    """A run's models; results from before the presets held one model, the small one."""
    if "models" in run:
        return run["models"]
    return [{"model": "small", "config": run["config"], "mixed": None, "methods": run["methods"]}]


def mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def table(runs: list[dict[str, Any]]) -> str:
    """One row per model, world size and method."""
    rows = []
    for run in runs:
        for model in models_of(run):
            methods = [{**r, "method": OLD_NAMES.get(r["method"], r["method"])} for r in model["methods"]]
            done = {r["method"]: r for r in methods if "skipped" not in r}
            base = done["roofline"]
            zero1 = done.get("ddp-zero1")
            for r in methods:
                head = [model["model"], str(run["world_size"]), common.label(r["method"])
                        if r["method"] != "roofline" else "no optimizer (forward + backward only)"]
                if "skipped" in r:
                    rows.append(head + [f"not run: {r['skipped']}"] + [""] * 9)
                    continue
                allocated = r.get("max_memory_allocated_mb")
                busy = r.get("step_ms_in_flight_median")
                in_flight = "-" if busy is None else (
                    f"{busy:.2f} / {r['step_ms_in_flight_max']:.2f} ({r['steps_with_round_in_flight']} steps)")
                formula = sum(r["formula_bytes"].values()) if "formula_bytes" in r else None
                # The roofline's peak holds the parameters, their gradients and the activations;
                # acco holds its accumulator (the formula) instead of the gradients.
                predicted = None
                if formula is not None and base.get("max_memory_allocated_mb") is not None:
                    predicted = base["max_memory_allocated_mb"] * 2**20 - base["parameter_bytes"] + formula
                versus = "-" if predicted is None or allocated is None else f"{allocated * 2**20 / predicted:.3f}"
                step = "-" if r["method"] == "roofline" else f"{r['step_ms_median']:.2f}"
                hidden = "-" if r.get("hidden_share") is None else f"{r['hidden_share']:.2f}"
                rows.append(head + [
                    f"{r['samples_per_s']:.0f}", f"{r['samples_per_s'] / base['samples_per_s']:.2f}",
                    "-" if zero1 is None else f"{r['samples_per_s'] / zero1['samples_per_s']:.2f}", step, in_flight,
                    hidden, "-" if allocated is None else f"{allocated:.0f}", mib(predicted), versus,
                    "-" if formula is None else f"{mib(formula)} / {mib(sum(r['acco_accounting_bytes'].values()))}"])
    return common.md_table(["model", "world size", "method", "samples/s", "vs no optimizer", "vs DDP + ZeRO-1",
                            "step() ms, median", "step() ms with the round in flight, median / max",
                            "hidden share (GPU time)", "max allocated MiB", "formula (docs/memory.md): peak MiB",
                            "measured / formula", "acco's buffers + state MiB: formula / acco's accounting"], rows)


def section(data: dict[str, Any]) -> str:
    run, lines = data["runs"][0], []
    for r in data["runs"]:
        info = r["streams"]
        for stream, v in info.get("streams", {}).items():
            if int(stream) != info["compute_stream"] and v["kernels"] > 10:
                lines.append(f"- world size {r['world_size']}: the lane's stream ran {v['kernels']} kernels for "
                             f"{1000 * v['busy_s']:.1f} ms in the profiled rounds, "
                             f"{1000 * v['overlapped_with_compute_s']:.1f} ms of it while the compute stream was busy "
                             f"(compute stream: {1000 * info['streams'][str(info['compute_stream'])]['busy_s']:.0f} "
                             f"ms); trace: [results/{r['trace']}](results/{r['trace']})")
    models = []
    for model in models_of(run):
        config = model["config"]
        precision = f"{model['mixed']} compute over an fp32 master" if model["mixed"] else "fp32"
        models.append(f"{model['model']}: the example's GPT ({config['n_layer']} layers, width {config['n_embd']}, "
                      f"{model['methods'][0]['parameters_m']:.1f}M parameters, {precision}), {config['batch_size']} x "
                      f"{config['seq_len']} tokens per micro-batch")
    return (f"{run['device']}, torch {run['torch']}; {'; '.join(models)}; {run['micro_batches_per_round']} "
            "micro-batches per round (the `ready()` loop: and more while the round is in flight), AdamW, clipping at "
            f"{config['max_grad_norm']}, {run['rounds']} measured rounds; process groups: "
            + ", ".join(f"world size {r['world_size']} {r.get('backend', 'gloo')}" for r in data["runs"])
            + " (world size 2 = two ranks on the one GPU, gloo on CUDA tensors).\n\n" + table(data["runs"]) + "\n\n"
            + "\n".join(lines))


def blocks(results: dict[str, Any], figures: Path) -> dict[str, str]:
    return {"gpu": section(results["gpu_overlap"])}


BENCHMARK = common.Benchmark("gpu_overlap", __doc__, arguments, rank, sweep, check=check,
                             quick={"world_sizes": [1, 2], "rounds": 3, "micro_batches": 2})

if __name__ == "__main__":
    common.main(BENCHMARK)
