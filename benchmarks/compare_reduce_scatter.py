"""gloo reduce-scatter + all-gather of acco's ``Collectives``: another checkout's (e.g. before
issue 13: an all-to-all into a model-size receive buffer) against this one's (pairwise, in
place), interleaved repeats, medians. ``throughput.py --baseline`` is the same A/B for the
whole optimizer.

    git worktree add /tmp/acco-999678c 999678c
    python benchmarks/compare_reduce_scatter.py --baseline /tmp/acco-999678c
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import common
from examples.train_gpt import Dist

import torch
import torch.distributed as dist

__all__ = ["BENCHMARK"]


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--baseline", type=Path, required=True, help="the other checkout's root")
    parser.add_argument("--sizes", type=float, nargs="+", default=[3.26, 25.4], help="millions of fp32 elements")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--ranks", type=int, default=2)


def collectives(load: Callable[[str], ModuleType]) -> type:
    """A checkout's ``Collectives``: in ``acco.collectives``, or ``acco.sharding`` before the package split."""
    for name in ("acco.collectives", "acco.sharding"):
        try:
            return load(name).Collectives
        except (ImportError, AttributeError):
            continue
    raise ImportError("no acco.collectives.Collectives nor acco.sharding.Collectives")


def rank(args: argparse.Namespace, ctx: Dist) -> dict[str, Any]:
    torch.set_num_threads(1)
    old = collectives(common.Checkout(args.baseline).module)(dist.new_group())
    new = collectives(importlib.import_module)(dist.new_group())
    results = []
    for millions in args.sizes:
        chunk = -(-int(millions * 1e6) // ctx.world_size)
        grads = torch.randn(chunk * ctx.world_size, generator=torch.Generator().manual_seed(ctx.rank))
        own = slice(ctx.rank * chunk, (ctx.rank + 1) * chunk)
        out = torch.empty(chunk)
        times: dict[str, list[float]] = {"baseline": [], "this": []}
        for _ in range(args.repeats):
            for side in times:
                buffer = grads.clone()
                dist.barrier()
                started = time.perf_counter()
                if side == "baseline":
                    old.reduce_scatter_sum(out, buffer)
                    old.all_gather(buffer, out)
                else:
                    new.reduce_scatter_sum(buffer[own], buffer)
                    new.all_gather(buffer, buffer[own])
                times[side].append(time.perf_counter() - started)
        a, b = grads.clone(), grads.clone()
        old.reduce_scatter_sum(out, a)
        new.reduce_scatter_sum(b[own], b)
        base, this = statistics.median(times["baseline"]), statistics.median(times["this"])
        results.append({"millions": millions, "baseline_s": base, "this_s": this, "ratio": this / base,
                        "same_sums": torch.allclose(out, b[own], rtol=1e-6, atol=1e-5)})
        if ctx.master:
            print(f"{ctx.world_size} ranks, {millions:.2f}M fp32: reduce-scatter + all-gather, median of "
                  f"{args.repeats}: baseline {base * 1e3:.1f} ms, this {this * 1e3:.1f} ms, ratio {this / base:.3f}, "
                  f"same sums {results[-1]['same_sums']}", flush=True)
    return {"benchmark": "compare_reduce_scatter", "baseline": str(args.baseline), "ranks": ctx.world_size,
            "repeats": args.repeats, "sizes": results}


BENCHMARK = common.Benchmark("compare_reduce_scatter", __doc__, arguments, rank,
                             quick={"sizes": [1.0], "repeats": 3})

if __name__ == "__main__":
    common.main(BENCHMARK)
