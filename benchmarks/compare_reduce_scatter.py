"""gloo reduce-scatter + all-gather of acco's Collectives: another checkout's (e.g. before
issue 13: an all-to-all into a model-size receive buffer) against this one's (pairwise, in
place), interleaved repeats, medians.

    git worktree add /tmp/acco-999678c 999678c
    torchrun --standalone --nproc-per-node 2 benchmarks/compare_reduce_scatter.py --baseline /tmp/acco-999678c
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent.parent


def load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="the other checkout's root")
    parser.add_argument("--sizes", type=float, nargs="+", default=[3.26, 25.4], help="millions of fp32 elements")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    old = load("baseline_sharding", Path(args.baseline) / "acco" / "sharding.py")
    new = load("this_sharding", HERE / "acco" / "sharding.py")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    old_comm, new_comm = old.Collectives(dist.new_group()), new.Collectives(dist.new_group())
    for millions in args.sizes:
        chunk = -(-int(millions * 1e6) // world)
        grads = torch.randn(chunk * world, generator=torch.Generator().manual_seed(rank))
        own = slice(rank * chunk, (rank + 1) * chunk)
        out = torch.empty(chunk)
        times: dict[str, list[float]] = {"baseline": [], "this": []}
        for _ in range(args.repeats):
            for name in times:
                buffer = grads.clone()
                dist.barrier()
                started = time.perf_counter()
                if name == "baseline":
                    old_comm.reduce_scatter_sum(out, buffer)
                    old_comm.all_gather(buffer, out)
                else:
                    new_comm.reduce_scatter_sum(buffer[own], buffer)
                    new_comm.all_gather(buffer, buffer[own])
                times[name].append(time.perf_counter() - started)
        a, b = grads.clone(), grads.clone()
        old_comm.reduce_scatter_sum(out, a)
        new_comm.reduce_scatter_sum(b[own], b)
        same = torch.allclose(out, b[own], rtol=1e-6, atol=1e-5)
        if rank == 0:
            base, this = statistics.median(times["baseline"]), statistics.median(times["this"])
            print(f"{world} ranks, {millions:.2f}M fp32: reduce-scatter + all-gather, median of {args.repeats}: "
                  f"baseline {base * 1e3:.1f} ms, this {this * 1e3:.1f} ms, ratio {this / base:.3f}, same sums {same}",
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
