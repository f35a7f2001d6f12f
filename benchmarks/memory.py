"""Memory per rank: acco's three modes against DDP + ZeRO-1 and plain DDP + AdamW, as
tensor bytes by kind (at rest and at the end of a backward) and as peak resident memory.

    python benchmarks/memory.py            # 2 and 4 ranks, fp32 and bf16, plain torchrun

Each method trains in fresh processes: ``--warmup`` updates (so every lazily allocated
buffer exists), then ``--updates`` measured updates. Two figures per rank:

- **tensor bytes by kind**, at rest (after ``step()``) and at the end of the last backward
  of every measured round (the gradients of the round all exist; activations are freed),
  the larger of the latter reported. Every rank walks the tensors its optimizer holds
  (attributes, lists, dicts, the base optimizer's state), then the ``p.grad`` of every
  parameter; each storage is counted once, under the first name it is found by, so views
  (acco's ``p.grad`` views of its accumulator, the round's in-place reduce-scatter and
  all-gather) cost nothing. Anything unrecognised is listed under "other" with its path.
  DDP's buckets are not reachable from Python: without ``gradient_as_bucket_view`` they are
  taken from DDP's own ``bucket_sizes``; with it they are the ``p.grad`` storages.
- **peak resident memory added by training**: ``VmHWM`` over the measured updates (reset
  by writing 5 to ``/proc/self/clear_refs`` once the warm-up is done) minus the resident
  memory before the model was built, minus the parameters. The ranks run with
  ``MALLOC_MMAP_THRESHOLD_=65536``, so every tensor larger than 64 KiB is its own mapping
  and freed memory leaves the resident set at once: the peak is the true high-water mark of
  what is allocated (activations and the base optimizer's temporaries included), on every
  thread (the comm lane's too).

DDP + ZeRO-1 uses ``gradient_as_bucket_view=True`` (the lean setting its users pick); plain
DDP uses DDP's defaults. The model is the example's GPT at about 25M parameters with short
micro-batches, so the buffers, not the activations, dominate.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from common import RESULTS_DIR, ModelConfig, batches, build_method, launch, read_json, start_ranks, training_text, write_json
from torch import Tensor

from acco import AccoOptimizer

METHODS = ("ddp-zero1", "ddp-adamw", "acco-sync", "acco-dpu", "acco")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CATEGORIES = ("parameters", "gradients", "gradient buffers", "communication buffers", "master shard",
              "optimizer state", "estimate copy", "other")
MALLOC_MMAP_THRESHOLD = "65536"
# About 25M parameters, short micro-batches: the buffers dominate the activations.
MEMORY_MODEL = ModelConfig(n_layer=8, n_embd=512, n_head=8, seq_len=64, batch_size=1)

# Where a tensor held by an optimizer belongs, by the attribute it is held under.
ATTRIBUTE_CATEGORY = {
    "grad_accumulator": "gradient buffers",
    "grad_handover": "gradient buffers",
    "grads": "gradient buffers",
    "gathered": "communication buffers",
    "_gathered": "communication buffers",
    "gather_input": "communication buffers",
    "grad_shard": "communication buffers",
    "_scratch": "communication buffers",
    "_buckets": "communication buffers",
    "master": "master shard",
    "_master": "master shard",
    "master_grad": "master shard",
    "_master_grad": "master shard",
    "master_views": "master shard",
    "estimate_copy": "estimate copy",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--ranks", type=int, nargs="+", default=[2, 4])
    add("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    add("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    add("--micro-batches", type=int, default=2, help="per update (acco: half per round)")
    add("--warmup", type=int, default=2, help="updates before measuring")
    add("--updates", type=int, default=1, help="measured updates")
    add("--out", default=None)
    add("--merge", action="store_true", help="replace the matching runs of --out, keep the others")
    add("--no-report", action="store_true")
    add("--method", default=None, help=argparse.SUPPRESS)
    add("--dtype", default="fp32", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size (Linux >= 4.0)


def storage_key(t: Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class Accounting:
    """Bytes per category, each storage counted once, under the first name it is found by."""

    def __init__(self) -> None:
        self.bytes = dict.fromkeys(CATEGORIES, 0)
        self.seen: set[tuple[int, int]] = set()
        self.other: list[str] = []

    def add(self, t: Tensor, category: str, path: str = "") -> None:
        key = storage_key(t)
        if key in self.seen or key[1] == 0:
            return
        self.seen.add(key)
        self.bytes[category] += key[1]
        if category == "other":
            self.other.append(f"{path}: {tuple(t.shape)} {t.dtype}")

    def walk(self, obj: Any, path: str, category: str | None, visited: set[int]) -> None:
        """Every tensor reachable from ``obj`` through containers, optimizers and acco's objects."""
        if isinstance(obj, Tensor):
            self.add(obj, category or "other", path)
            return
        if id(obj) in visited:
            return
        visited.add(id(obj))
        if isinstance(obj, dict):
            for key, value in obj.items():
                if isinstance(key, Tensor):  # optimizer state is keyed by its parameter
                    self.walk(key, f"{path}[key]", category, visited)
                name = key if isinstance(key, str) else "[]"
                self.walk(value, f"{path}.{name}", ATTRIBUTE_CATEGORY.get(name, category), visited)
        elif isinstance(obj, (list, tuple, set, deque)):
            for i, value in enumerate(obj):
                self.walk(value, f"{path}[{i}]", category, visited)
        elif isinstance(obj, torch.optim.Optimizer) or type(obj).__module__.startswith("acco"):
            for name, value in vars(obj).items():
                sub = ATTRIBUTE_CATEGORY.get(name, category)
                if name == "state" and isinstance(obj, torch.optim.Optimizer):
                    sub = "optimizer state"
                self.walk(value, f"{path}.{name}", sub, visited)


def account(method: Any) -> dict[str, Any]:
    """This rank's tensor bytes per category now."""
    model = getattr(method.model, "module", method.model)
    acc = Accounting()
    params = list(model.parameters())
    for p in params:
        acc.add(p, "parameters")
    opt = method.optimizer()
    if opt is not None:
        acc.walk(opt, "opt", None, set())
    for p in params:
        if p.grad is not None:  # after the optimizer: acco's p.grad views are its accumulator
            acc.add(p.grad, "gradients")
    if hasattr(method.model, "_get_ddp_logging_data"):
        data = method.model._get_ddp_logging_data()
        buckets = sum(int(s) for s in str(data["bucket_sizes"]).split(", ") if s)
        if not data.get("gradient_as_bucket_view"):
            acc.bytes["gradient buffers"] += buckets
        elif not any(p.grad is not None for p in params):
            acc.bytes["gradients"] += buckets  # p.grad = None between steps; the buckets stay
    return {"bytes": dict(acc.bytes), "total": sum(acc.bytes.values()), "other_tensors": acc.other}


def state_elements(opt: Any) -> int:
    """Elements of one AdamW moment (``exp_avg``) on this rank."""
    if isinstance(opt, AccoOptimizer):
        return sum(s["exp_avg"].numel() for b in opt.base_optimizers if b is not None for s in b.state.values())
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer wraps the local optimizer
    return sum(s["exp_avg"].numel() for s in inner.state.values() if "exp_avg" in s)


def measure(name: str, dtype_name: str, args: argparse.Namespace) -> dict[str, Any]:
    ctx = start_ranks()
    config = MEMORY_MODEL
    train_data, _ = training_text(config.seq_len)
    next_batch = batches(train_data, config, config.seed + 1000 * ctx.rank)
    from examples.train_gpt import loss_fn

    gc.collect()
    rss_before_model = proc_status_kib("VmRSS")
    method = build_method(name, config, args.micro_batches, dtype=DTYPES[dtype_name], bucket_view=name == "ddp-zero1")
    model = getattr(method.model, "module", method.model)
    numel = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.nbytes for p in model.parameters())

    def micro_batch(last: bool) -> None:
        # The methods' own micro_batch(), except that the accounting looks at the tensors
        # right after the round's last backward (before acco folds or DDP's step frees).
        if not last:
            method.micro_batch(*next_batch())
            return
        x, y = next_batch()
        ddp = hasattr(method.model, "no_sync")
        if ddp:
            method._count += 1
        loss = loss_fn(method.model, x, y)
        (loss / method.micro_batches_per_round if ddp else loss).backward()
        backward_peaks.append(account(method))
        if isinstance(method.optimizer(), AccoOptimizer):
            method.optimizer().accumulate()

    backward_peaks: list[dict[str, Any]] = []
    rounds_warmup = args.warmup * method.rounds_per_update
    for r in range(rounds_warmup + args.updates * method.rounds_per_update):
        if r == rounds_warmup:
            backward_peaks.clear()
            gc.collect()
            dist.barrier()
            at_rest = account(method)
            reset_peak_rss()
        for i in range(method.micro_batches_per_round):
            micro_batch(last=i == method.micro_batches_per_round - 1)
        method.end_round()
    peak_rss = proc_status_kib("VmHWM")
    opt = method.optimizer()
    result = {
        "at_rest": at_rest,
        "end_of_backward": max(backward_peaks, key=lambda a: a["total"]),
        "parameters": numel,
        "param_bytes": param_bytes,
        "peak_rss_added_bytes": peak_rss - rss_before_model - param_bytes,
        "peak_rss_bytes": peak_rss,
        "rss_before_model_bytes": rss_before_model,
        "state_elements_per_tensor": state_elements(opt),
        "ceil_p_over_n": math.ceil(numel / ctx.world_size),
    }
    if isinstance(opt, AccoOptimizer):
        if hasattr(opt._groups[0], "buffer_bytes"):  # absent before the memory work
            result["buffer_bytes"] = [g.buffer_bytes() for g in opt._groups]
        result["reduce_itemsize"] = opt._groups[0].reduce_dtype.itemsize
    else:
        result["reduce_itemsize"] = DTYPES[dtype_name].itemsize
    method.finish()
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, result)
    # Tear down DDP / ZeRO / acco while the process group still exists: a gloo-backed
    # object destroyed after destroy_process_group() was seen to hang rank 0 at exit.
    del method, model, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return {"method": name, "dtype": dtype_name, "ranks": ctx.world_size, "per_rank": gathered}


def driver(args: argparse.Namespace) -> None:
    out = Path(args.out) if args.out else RESULTS_DIR / "memory.json"
    started = time.perf_counter()
    results: dict[str, Any] = {
        "benchmark": "memory",
        "config": {**MEMORY_MODEL.as_dict(), "micro_batches_per_update": args.micro_batches,
                   "warmup_updates": args.warmup, "measured_updates": args.updates},
        "torch": torch.__version__,
        "runs": [],
    }
    os.environ["MALLOC_MMAP_THRESHOLD_"] = MALLOC_MMAP_THRESHOLD  # inherited by the ranks
    for ranks in args.ranks:
        for dtype_name in args.dtypes:
            for name in args.methods:
                print(f"memory: {ranks} ranks, {dtype_name}, {name}", flush=True)
                with tempfile.TemporaryDirectory() as tmp:
                    rank_out = Path(tmp) / "run.json"
                    launch(ranks, [str(Path(__file__).resolve()), "--micro-batches", str(args.micro_batches),
                                   "--warmup", str(args.warmup), "--updates", str(args.updates),
                                   "--method", name, "--dtype", dtype_name, "--out", str(rank_out)], netns=False)
                    results["runs"].append(read_json(rank_out))
    results["runtime_s"] = time.perf_counter() - started
    if args.merge and out.exists():
        previous = read_json(out)
        measured = {(r["method"], r["dtype"], r["ranks"]) for r in results["runs"]}
        kept = [r for r in previous["runs"] if (r["method"], r["dtype"], r["ranks"]) not in measured]
        order = {(r["method"], r["dtype"], r["ranks"]): i for i, r in enumerate(previous["runs"])}
        runs = sorted(kept + results["runs"], key=lambda r: order.get((r["method"], r["dtype"], r["ranks"]), 1 << 30))
        results = {**previous, "runs": runs, "runtime_s": previous["runtime_s"]}
    write_json(out, results)
    print(f"wrote {out} ({results['runtime_s']:.0f} s)")
    if not args.no_report:
        import report

        report.main([])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:
        if args.method is None:
            raise SystemExit("a rank launch needs --method")
        result = measure(args.method, args.dtype, args)
        if int(os.environ["RANK"]) == 0:
            write_json(Path(args.out or RESULTS_DIR / f"memory-{args.method}.json"), result)
    else:
        driver(args)


if __name__ == "__main__":
    sys.exit(main())
