"""Memory per rank: parameters, gradient buffers, communication buffers, master shard and
optimizer state of acco's modes against DDP + ZeRO-1 and plain DDP + AdamW, from tensor
accounting, plus each rank's peak RSS.

    python benchmarks/memory.py            # 2 and 4 ranks, plain torchrun (no root needed)

Each method trains a few updates in fresh processes (so peak RSS is its own), then, in the
middle of a round (gradients of a micro-batch just computed, before they are folded into
acco's buffers), every rank walks the tensors its optimizer holds: attributes, lists and
dicts, the base optimizer's state, deduplicated by storage, so views are counted once and
a tensor shared with the model is counted as a parameter. Each tensor goes into a
category by the name it is held under; anything not recognised is listed under "other"
with its path, so nothing is hidden. Two things are not reachable from Python and come
from the libraries' own figures: DDP's gradient buckets (``bucket_sizes`` of
``DistributedDataParallel._get_ddp_logging_data()``), and acco's estimate-round copies
(master shard and optimizer state, cloned on the comm lane during an estimate round's
update; computed from the shard size).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import resource
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

METHODS = ("ddp-adamw", "ddp-zero1", "acco-sync", "acco-dpu", "acco")
CATEGORIES = ("parameters", "gradients", "gradient buffers", "communication buffers", "master shard",
              "optimizer state", "other")

# Where a tensor held by an optimizer belongs, by the attribute it is held under.
ATTRIBUTE_CATEGORY = {
    "grad_accumulator": "gradient buffers",
    "grad_handover": "gradient buffers",
    "grads": "gradient buffers",
    "gathered": "communication buffers",
    "gather_input": "communication buffers",
    "grad_shard": "communication buffers",
    "_scratch": "communication buffers",
    "_buckets": "communication buffers",
    "master": "master shard",
    "master_grad": "master shard",
    "master_views": "master shard",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--ranks", type=int, nargs="+", default=[2, 4])
    add("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    add("--micro-batches", type=int, default=4)
    add("--updates", type=int, default=3)
    add("--out", default=None)
    add("--no-report", action="store_true")
    add("--method", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


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
    """This rank's bytes per category, mid-round (after a backward, before step)."""
    model = getattr(method.model, "module", method.model)
    acc = Accounting()
    params = list(model.parameters())
    for p in params:
        acc.add(p, "parameters")
    for p in params:
        if p.grad is not None:
            acc.add(p.grad, "gradients")
    opt = method.optimizer()
    derived: dict[str, int] = {}
    if opt is not None:
        acc.walk(opt, "opt", None, set())
    if hasattr(method.model, "_get_ddp_logging_data"):
        data = method.model._get_ddp_logging_data()
        if not data.get("gradient_as_bucket_view"):
            derived["communication buffers"] = sum(int(s) for s in str(data["bucket_sizes"]).split(", ") if s)
    state_elements = 0
    numel = sum(p.numel() for p in params)
    if isinstance(opt, AccoOptimizer):
        bases = [b for b in opt.base_optimizers if b is not None]
        state_elements = sum(s["exp_avg"].numel() for b in bases for s in b.state.values())
        if opt.mode.value == "acco":
            chunk_bytes = sum(plan.chunk for plan in opt.shard_plans) * 4
            derived["estimate copies (transient, on the lane)"] = 3 * chunk_bytes  # master + exp_avg + exp_avg_sq
    elif opt is not None:
        inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer wraps the local optimizer
        state_elements = sum(s["exp_avg"].numel() for s in inner.state.values() if "exp_avg" in s)
    world = dist.get_world_size()
    return {
        "bytes": acc.bytes,
        "derived_bytes": derived,
        "other_tensors": acc.other,
        "parameters": numel,
        "state_elements_per_tensor": state_elements,  # elements of exp_avg on this rank
        "ceil_p_over_n": math.ceil(numel / world),
    }


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    baseline_rss = rss_bytes()
    ctx = start_ranks()
    config = ModelConfig()
    train_data, _ = training_text(config.seq_len)
    next_batch = batches(train_data, config, config.seed + 1000 * ctx.rank)
    method = build_method(name, config, args.micro_batches)
    rounds = args.updates * method.rounds_per_update
    for _ in range(rounds):
        for _ in range(method.micro_batches_per_round):
            method.micro_batch(*next_batch())
        method.end_round()
    # Mid-round: gradients of one micro-batch still in p.grad (acco folds them at accumulate()).
    from examples.train_gpt import loss_fn

    x, y = next_batch()
    model = method.model
    if hasattr(model, "no_sync"):
        with model.no_sync():
            loss_fn(model, x, y).backward()
    else:
        loss_fn(model, x, y).backward()
    accounting = account(method)
    if isinstance(method.optimizer(), AccoOptimizer):
        method.optimizer().accumulate()
    method.end_round()
    method.finish()
    accounting["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    accounting["rss_at_start_bytes"] = baseline_rss
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, accounting)
    # Tear down DDP / ZeRO / acco while the process group still exists: a gloo-backed
    # object destroyed after destroy_process_group() was seen to hang rank 0 at exit.
    del method, model
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return {"method": name, "ranks": ctx.world_size, "per_rank": gathered}


def driver(args: argparse.Namespace) -> None:
    out = Path(args.out) if args.out else RESULTS_DIR / "memory.json"
    started = time.perf_counter()
    results: dict[str, Any] = {"benchmark": "memory", "config": {**ModelConfig().as_dict(),
                                                                  "micro_batches_per_update": args.micro_batches},
                               "runs": []}
    for ranks in args.ranks:
        for name in args.methods:
            print(f"memory: {ranks} ranks, {name}", flush=True)
            with tempfile.TemporaryDirectory() as tmp:
                rank_out = Path(tmp) / "run.json"
                launch(ranks, [str(Path(__file__).resolve()), "--micro-batches", str(args.micro_batches),
                               "--updates", str(args.updates), "--method", name, "--out", str(rank_out)], netns=False)
                results["runs"].append(read_json(rank_out))
    results["runtime_s"] = time.perf_counter() - started
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
        result = measure(args.method, args)
        if int(os.environ["RANK"]) == 0:
            write_json(Path(args.out or RESULTS_DIR / f"memory-{args.method}.json"), result)
    else:
        driver(args)


if __name__ == "__main__":
    sys.exit(main())
