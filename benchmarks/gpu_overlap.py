"""The CUDA comm lane on one GPU: does step() return at once, and does the round overlap?

    python benchmarks/gpu_overlap.py                 # world size 1 and 2, about 2 minutes
    python benchmarks/gpu_overlap.py --world-sizes 1 --rounds 10

World size 1 runs in this process; world size 2 runs two ranks on the same GPU under
torchrun with gloo on CUDA tensors (torch stages them through pinned host memory), the way
ranks talk over plain TCP. For each of sync, dpu and acco (fixed loop) and the ``ready()``
loop, on the example's GPT (6 layers, width 512) with AdamW and clipping at 1.0:

- ``step()``'s wall time on the training thread while a round is in flight (median, p90);
- the hidden share in GPU time (``RoundStats.hidden_share`` from the lane's CUDA events);
- samples/s against the same loop with no optimizer at all (forward and backward only);
- ``torch.cuda.max_memory_allocated()`` per rank.

Then a few acco rounds under ``torch.profiler`` (rank 0): a chrome trace in
``results/gpu_overlap-trace-ws{N}.json.gz`` (open it in Perfetto) and, from it, each
stream's kernel time and how much of the other streams' work ran while the compute stream
was busy. Results: ``results/gpu_overlap.json``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, ModelConfig, build_model, launch, read_json, write_json  # noqa: E402
from report import gpu_table  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from acco import AccoOptimizer  # noqa: E402
from examples.train_gpt import loss_fn, param_groups, setup_distributed, split_corpus, load_corpus  # noqa: E402

CONFIG = ModelConfig(n_layer=6, n_embd=512, n_head=8, seq_len=256, batch_size=16, max_grad_norm=1.0)
METHODS = ("none", "sync", "dpu", "acco", "acco-ready")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=20, help="measured rounds per method")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per round (fixed loop)")
    parser.add_argument("--rank-entry", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "gpu_overlap.json")
    return parser.parse_args(argv)


def device_batches(count: int, seed: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A pool of micro-batches already on the GPU, so no host copy sits in the loop."""
    train, _ = split_corpus(load_corpus(None, 4_000_000), CONFIG.seq_len)
    generator = torch.Generator().manual_seed(seed)
    pool = []
    for _ in range(count):
        starts = torch.randint(0, len(train) - CONFIG.seq_len - 1, (CONFIG.batch_size,), generator=generator)
        windows = torch.stack([train[s : s + CONFIG.seq_len + 1] for s in starts.tolist()]).long().to(device)
        pool.append((windows[:, :-1], windows[:, 1:]))
    return pool


def run_method(method: str, rounds: int, per_round: int, device: torch.device, world_size: int,
               profile: Path | None = None) -> dict[str, Any]:
    model = build_model(CONFIG).to(device)
    opt = None
    if method != "none":
        opt = AccoOptimizer(
            param_groups(model, CONFIG.weight_decay), torch.optim.AdamW, mode=method.removesuffix("-ready"),
            lr=CONFIG.lr, betas=CONFIG.betas, max_grad_norm=CONFIG.max_grad_norm,
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    data = device_batches(8, 1000 + rank, device)
    micro = 0

    def micro_batch() -> None:
        nonlocal micro
        x, y = data[micro % len(data)]
        loss_fn(model, x, y).backward()
        micro += 1
        if opt is None:
            for p in model.parameters():
                p.grad = None
        else:
            opt.accumulate(weight=x.numel())

    def one_round(step_times: list[float] | None) -> None:
        for _ in range(per_round):
            micro_batch()
        if method.endswith("-ready"):
            while not opt.ready():
                micro_batch()
        if opt is not None:
            in_flight = not opt.ready()
            started = time.perf_counter()
            opt.step()
            if step_times is not None:
                step_times.append((time.perf_counter() - started, in_flight))

    for _ in range(3):  # warm-up: kernels, the lane thread, optimizer state
        one_round(None)
    torch.cuda.synchronize(device)
    if dist.is_initialized():
        dist.barrier()
    torch.cuda.reset_peak_memory_stats(device)
    micro, step_times = 0, []
    started = time.perf_counter()
    if profile is not None:
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(rounds):
                one_round(step_times)
            torch.cuda.synchronize(device)
        prof.export_chrome_trace(str(profile))
    else:
        for _ in range(rounds):
            one_round(step_times)
    torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - started
    result: dict[str, Any] = {
        "method": method,
        "world_size": world_size,
        "micro_batches": micro,
        "samples_per_s": micro * CONFIG.batch_size * world_size / elapsed,
        "max_memory_allocated_mb": torch.cuda.max_memory_allocated(device) / 2**20,
        "parameters_m": sum(p.numel() for p in model.parameters()) / 1e6,
    }
    if opt is not None:
        opt.finish()
        stats = list(opt.round_stats)[-rounds:]
        busy = [t for t, in_flight in step_times if in_flight]
        result.update(
            step_ms_median=1000 * statistics.median(t for t, _ in step_times),
            step_ms_in_flight_median=1000 * statistics.median(busy) if busy else None,
            step_ms_in_flight_max=1000 * max(busy) if busy else None,
            steps_with_round_in_flight=len(busy),
            hidden_share=statistics.fmean(s.hidden_share for s in stats),
            lane_ms=1000 * statistics.median(s.lane_seconds for s in stats),
            gpu_wait_ms=1000 * statistics.median(s.wait_seconds for s in stats),
            phases_ms={k: 1000 * statistics.median(s.phase_seconds.get(k, 0.0) for s in stats)
                       for k in stats[-1].phase_seconds},
            micro_batches_per_round=statistics.fmean(s.local_micro_batches for s in stats),
        )
    return result


def stream_overlap(trace: Path) -> dict[str, Any]:
    """Per CUDA stream: kernel and copy time; and the other streams' time that ran while the
    busiest (the compute) stream was busy."""
    events = json.loads(trace.read_text())["traceEvents"]
    spans: dict[int, list[tuple[float, float]]] = {}
    names: dict[int, set[str]] = {}
    for event in events:
        if event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "stream" in event.get("args", {}):
            stream = int(event["args"]["stream"])
            spans.setdefault(stream, []).append((event["ts"], event["ts"] + event["dur"]))
            names.setdefault(stream, set()).add(event["name"][:60])
    busy = {s: sum(b - a for a, b in v) / 1e6 for s, v in spans.items()}
    if not busy:
        return {}
    compute = max(busy, key=busy.get)
    compute_spans = sorted(spans[compute])

    def covered(a: float, b: float) -> float:
        return sum(max(0.0, min(b, d) - max(a, c)) for c, d in compute_spans if c < b and d > a)

    return {
        "compute_stream": compute,
        "streams": {
            str(s): {
                "busy_s": busy[s],
                "overlapped_with_compute_s": None if s == compute else sum(covered(a, b) for a, b in spans[s]) / 1e6,
                "kernels": len(spans[s]),
                "examples": sorted(names[s])[:6],
            }
            for s in sorted(spans)
        },
    }


def rank_main(args: argparse.Namespace) -> None:
    distributed = "RANK" in os.environ
    if distributed:
        ctx = setup_distributed("cuda", "gloo", __import__("datetime").timedelta(minutes=5))
        device, world_size, rank = ctx.device, ctx.world_size, ctx.rank
    else:
        device, world_size, rank = torch.device("cuda", 0), 1, 0
    results = [run_method(m, args.rounds, args.micro_batches, device, world_size) for m in METHODS]
    raw = Path(tempfile.mkdtemp()) / "trace.json"
    profiled = run_method("acco", 6, args.micro_batches, device, world_size, raw if rank == 0 else None)
    if rank == 0:
        trace = RESULTS_DIR / f"gpu_overlap-trace-ws{world_size}.json.gz"
        with raw.open("rb") as source, gzip.open(trace, "wb") as target:
            shutil.copyfileobj(source, target)
        write_json(RESULTS_DIR / f"gpu_overlap-ws{world_size}.json", {
            "world_size": world_size, "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "config": CONFIG.as_dict(), "rounds": args.rounds, "micro_batches_per_round": args.micro_batches,
            "methods": results, "profiled": profiled, "trace": trace.name, "streams": stream_overlap(raw),
        })
    if distributed:
        dist.destroy_process_group()


def table(runs: list[dict[str, Any]]) -> str:
    return gpu_table(runs)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.rank_entry:
        rank_main(args)
        return
    if not torch.cuda.is_available():
        raise SystemExit("gpu_overlap.py needs a CUDA GPU")
    runs = []
    for world_size in args.world_sizes:
        forwarded = ["--rounds", str(args.rounds), "--micro-batches", str(args.micro_batches), "--rank-entry"]
        if world_size == 1:
            rank_main(parse_args(forwarded))
        else:
            launch(world_size, [str(Path(__file__).resolve()), *forwarded], netns=False)
        runs.append(read_json(RESULTS_DIR / f"gpu_overlap-ws{world_size}.json"))
    write_json(args.out, {"runs": runs})
    print(table(runs))
    for run in runs:
        print(f"world size {run['world_size']} streams:", json.dumps(run["streams"], indent=1))


if __name__ == "__main__":
    main()
