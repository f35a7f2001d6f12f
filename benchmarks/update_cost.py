"""What one update costs on the training thread: acco's ``step()`` in each mode against torch's
fused and foreach AdamW with ``clip_grad_norm_`` and against ``ZeroRedundancyOptimizer``, on the
CPU, measured as a new user would: a stack of ``Linear(width, width)`` layers (18 of 1024: 18.9M
parameters), one micro-batch per update, the update timed from the end of the backward to the
end of ``step()`` (torch: ``clip_grad_norm_`` + ``step()`` + ``zero_grad()``; acco: ``step()``).

    python benchmarks/update_cost.py                      # world size 1 (no process group) and 2
    python benchmarks/update_cost.py --world-sizes 1 --repeats 5
    python benchmarks/update_cost.py --quick              # a smoke run, into results/scratch/

World size 1 runs in this process with 2 threads (ZeRO-1 in a one-rank gloo group made for it
alone; acco with none, as a user without torch.distributed); world size 2 is two ranks under
``torchrun`` over gloo, a thread each, the torch baselines inside DDP. Every method runs once per
repeat, in a rotated order; a figure is the median over repeats of the median of steps
``--skip``.. of one run, and each ratio is taken within a repeat (against ``adamw-fused``, side
by side) before its median. ``copies`` counts the model-size tensors that ``aten::copy_`` wrote
during one ``accumulate()`` + ``step()`` and the comm lane's round it launched (profiled on every
thread), per parameter of the model (``acco``: one of the two rounds of an update).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import common
from examples.train_gpt import Dist

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import acco

__all__ = ["BENCHMARK", "METHODS", "UpdateMethod", "blocks", "table", "targets"]


@dataclasses.dataclass(frozen=True)
class UpdateMethod:
    """``family``: ``torch`` (AdamW, ``impl`` fused or foreach), ``zero1`` (torch's defaults) or an
    acco ``mode``; ``fused``: acco given ``fused=True`` (else its defaults); ``clip``: a
    max-norm of 1.0."""

    family: str
    impl: str | None = None
    fused: bool = False
    clip: bool = True

    @property
    def name(self) -> str:
        if self.family == "torch":
            return f"adamw-{self.impl}" + ("" if self.clip else "-noclip")
        return self.family + ("-fused" if self.fused else "") + ("" if self.clip else "-noclip")


METHODS: dict[str, UpdateMethod] = {m.name: m for m in [
    UpdateMethod("torch", "fused"), UpdateMethod("torch", "foreach"), UpdateMethod("zero1"),
    *(UpdateMethod(mode, fused=fused, clip=clip) for mode in ("sync", "dpu", "acco")
      for clip in (True, False) for fused in (False, True)),
]}
BASELINE = "adamw-fused"


def arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--world-sizes", type=int, nargs="+", default=[1, 2])
    add("--layers", type=int, default=18)
    add("--width", type=int, default=1024)
    add("--batch", type=int, default=8, help="rows of the one micro-batch per update")
    add("--steps", type=int, default=9, help="updates per run")
    add("--skip", type=int, default=3, help="updates left out of each run's median (warm-up)")
    add("--repeats", type=int, default=3, help="runs of every method, interleaved")
    add("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    add("--threads", type=int, default=2, help="torch threads in all (world size 2: half each)")


def check(args: argparse.Namespace) -> str | None:
    if BASELINE not in args.methods:
        return f"--methods must include {BASELINE}, the baseline of every ratio"
    if not 0 <= args.skip < args.steps:
        return f"--skip must be in [0, --steps), got {args.skip}"
    return None


def build_model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])


def make_optimizer(method: UpdateMethod, model: nn.Module, world_size: int) -> tuple[nn.Module, Any]:
    """The model as trained (DDP around it for torch's methods past one rank) and its optimizer."""
    if method.family in ("torch", "zero1"):
        trained = DDP(model) if world_size > 1 else model
        if method.family == "zero1":
            return trained, ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
        return trained, torch.optim.AdamW(model.parameters(), lr=1e-3, **{method.impl: True})
    extra = {"fused": True} if method.fused else {}
    return model, acco.AccoOptimizer(model, torch.optim.AdamW, mode=method.family, lr=1e-3,
                                     max_grad_norm=1.0 if method.clip else None, **extra)


def update_step(method: UpdateMethod, model: nn.Module, opt: Any) -> Callable[[], None]:
    if method.family in ("torch", "zero1"):
        def update() -> None:
            if method.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return update
    return opt.step


def copies_per_update(method: UpdateMethod, fold: Callable[[], None], update: Callable[[], None], opt: Any,
                      parameters: int) -> float:
    """Model-size tensors that ``aten::copy_`` wrote in one update (every thread: the comm lane's
    round included), per parameter."""
    acco_opt = method.family not in ("torch", "zero1")

    def settle() -> None:  # the round in flight done, so the profile holds whole rounds
        while acco_opt and not opt.ready():
            time.sleep(0.001)

    settle()
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True,
                                experimental_config=config) as profile:
        fold()
        update()
        settle()
    written = 0
    for event in profile.events():
        if event.name == "aten::copy_" and event.input_shapes and event.input_shapes[0]:
            written += int(torch.Size(event.input_shapes[0]).numel())
    return written / parameters


def foreign_share(busy: float, own: float, wall: float) -> float:
    """The CPU share other processes took over ``wall`` seconds (``own``: this job's CPU seconds)."""
    return max(0.0, busy - own) / (wall * (os.cpu_count() or 1))


def run_method(method: UpdateMethod, args: argparse.Namespace, ctx: Dist) -> dict[str, Any]:
    """One run of ``method`` on this rank: every update's seconds, and the copies in one more."""
    model = build_model(args)
    parameters = sum(p.numel() for p in model.parameters())
    trained, opt = make_optimizer(method, model, ctx.world_size)
    fold = opt.accumulate if method.family not in ("torch", "zero1") else (lambda: None)
    update = update_step(method, trained, opt)
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(ctx.rank))
    updates, iterations = [], []
    busy, own, wall = common.cpu_busy_seconds(), time.process_time(), time.perf_counter()
    for _ in range(args.steps):
        started = time.perf_counter()
        trained(x).square().mean().backward()
        fold()
        ended_backward = time.perf_counter()
        update()
        ended = time.perf_counter()
        updates.append(ended - ended_backward)
        iterations.append(ended - started)
    (own,) = common.all_reduce([time.process_time() - own])
    share = foreign_share(common.cpu_busy_seconds() - busy, own, time.perf_counter() - wall)
    trained(x).square().mean().backward()
    copies = copies_per_update(method, fold, update, opt, parameters)
    if hasattr(opt, "finish"):
        opt.finish()
    return {"update_s": updates, "iteration_s": iterations, "copies": copies, "foreign_cpu_share": share,
            "parameters": parameters}


def run_world(args: argparse.Namespace, ctx: Dist) -> dict[str, Any]:
    """Every method ``--repeats`` times on this rank (every rank in the same order)."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.methods}
    for repeat in range(args.repeats):
        for name in common.rotated(args.methods, repeat):
            method = METHODS[name]
            one_rank_group = method.family == "zero1" and ctx.world_size == 1
            if one_rank_group:  # ZeroRedundancyOptimizer needs a process group; acco's runs have none
                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            try:
                runs[name].append(run_method(method, args, ctx))
            finally:
                if one_rank_group:
                    dist.destroy_process_group()
            if dist.is_initialized():
                dist.barrier()
    return {"world_size": ctx.world_size, "threads": torch.get_num_threads(), "runs": runs,
            "summary": summarise(runs, args.skip)}


def summarise(runs: dict[str, list[dict[str, Any]]], skip: int) -> dict[str, dict[str, float]]:
    """Per method: the median over repeats of each run's median update (and iteration), the
    median of the per-repeat ratios to the baseline's update, the copies and the load."""
    median = statistics.median
    summary = {}
    for name, repeats in runs.items():
        updates = [median(r["update_s"][skip:]) for r in repeats]
        baseline = [median(r["update_s"][skip:]) for r in runs[BASELINE]]
        summary[name] = {
            "update_ms": 1e3 * median(updates),
            "iteration_ms": 1e3 * median(median(r["iteration_s"][skip:]) for r in repeats),
            "ratio": median(u / b for u, b in zip(updates, baseline)),
            "copies": median(r["copies"] for r in repeats),
            "foreign_cpu_share": max(r["foreign_cpu_share"] for r in repeats),
        }
    return summary


def rank(args: argparse.Namespace, ctx: Dist) -> dict[str, Any]:
    """One launch's work on every rank (world size 2, under torchrun)."""
    return run_world(args, ctx)


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    worlds = []
    for world_size in args.world_sizes:
        if world_size == 1:
            torch.set_num_threads(args.threads)
            worlds.append(run_world(args, Dist(rank=0, world_size=1, device=torch.device("cpu"))))
        else:
            worlds.append(common.run_ranks(args, world_size))
        print(table([worlds[-1]]), flush=True)
    return {"args": {k: v for k, v in vars(args).items() if k in ("layers", "width", "batch", "steps", "skip",
                                                                    "repeats", "threads")},
            "load_average": os.getloadavg(), "worlds": worlds}


def table(worlds: list[dict[str, Any]]) -> str:
    rows = []
    for world in worlds:
        for name, row in world["summary"].items():
            rows.append([str(world["world_size"]), name, f"{row['update_ms']:.1f}", f"{row['ratio']:.2f}",
                         f"{row['iteration_ms']:.1f}", f"{row['copies']:.1f}", f"{row['foreign_cpu_share']:.0%}"])
    return common.md_table(["ranks", "method", "update (ms)", "/ adamw-fused", "iteration (ms)",
                            "copies per step()", "other load (max)"], rows)


# The bar (world size 1, CPU): each acco update against torch's fused AdamW + clip_grad_norm_.
BAR = (("sync", 1.5), ("sync-fused", 1.3), ("dpu", 1.3))


def targets(results: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    found = results.get(BENCHMARK.name)
    if not found:
        return []
    rows = []
    for world in found["worlds"]:
        if world["world_size"] != 1:
            continue
        for name, limit in BAR:
            if name in world["summary"]:
                ratio = world["summary"][name]["ratio"]
                rows.append((f"update_cost: `{name}` step() within {limit}x of fused AdamW + clip_grad_norm_ "
                             "(1 rank, CPU)", f"{ratio:.2f}x", ratio <= limit))
    return rows


def blocks(results: dict[str, Any], results_dir: Path) -> dict[str, str]:
    found = results.get(BENCHMARK.name)
    return {"update_cost": table(found["worlds"])} if found else {}


BENCHMARK = common.Benchmark("update_cost", __doc__, arguments, rank, sweep, check=check,
                             quick={"layers": 2, "width": 256, "steps": 4, "skip": 1, "repeats": 1})

if __name__ == "__main__":
    common.main(BENCHMARK)
