"""The README's example commands, run as written: final eval loss, samples/s and wall time.

    python benchmarks/example_runs.py                 # the 3 modes (~2 min each) and the 2 meshes (~5 min each)
    python benchmarks/example_runs.py --runs sync acco
    python benchmarks/example_runs.py --quick         # 20 updates each, into results/scratch/

Each run is ``torchrun --standalone --nproc_per_node=N examples/train_gpt.py ...`` exactly as
the README gives it (``--quick`` adds ``--updates 20``); the figures are what the example
prints at its end. Results: ``results/example_runs.json``; the table: the README's
``example-runs`` block.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from typing import Any

import common
from common import REPO_ROOT, md_table, minutes

__all__ = ["BENCHMARK", "RUNS", "blocks", "runtimes"]

# name -> (ranks, the example's arguments), in the README's order.
RUNS: dict[str, tuple[int, list[str]]] = {
    "sync": (2, ["--mode", "sync"]),
    "acco": (2, ["--mode", "acco"]),
    "dpu": (2, ["--mode", "dpu"]),
    "mesh 2x2, fsdp inside": (4, ["--mesh", "2x2", "--inner", "fsdp"]),
    "mesh 2x2, tp inside": (4, ["--mesh", "2x2", "--inner", "tp"]),
}


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS), metavar="RUN",
                        help=f"which commands to run: {', '.join(RUNS)}")
    parser.add_argument("--updates", type=int, default=None, help="override the example's --updates")


def command(name: str, updates: int | None) -> list[str]:
    ranks, extra = RUNS[name]
    return ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
             str(REPO_ROOT / "examples" / "train_gpt.py"), *extra]
            + ([] if updates is None else ["--updates", str(updates)]))


def parse(output: str) -> dict[str, Any]:
    """What the example prints at its end: final eval loss, samples/s and the header."""
    loss = re.search(r"final eval loss (\S+)", output)
    rate = re.search(r"(\S+) samples/s over (\S+) s", output)
    header = re.search(r"^(mode .*)$", output, flags=re.M)
    if not (loss and rate and header):
        raise RuntimeError(f"the example did not finish:\n{output[-3000:]}")
    return {"final_eval_loss": float(loss.group(1)), "samples_per_s": float(rate.group(1)),
            "train_seconds": float(rate.group(2)), "header": header.group(1)}


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    runs = {}
    for name in args.runs:
        started = time.perf_counter()
        done = subprocess.run(command(name, args.updates), capture_output=True, text=True, cwd=REPO_ROOT)
        if done.returncode != 0:
            raise RuntimeError(f"{name}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        runs[name] = {**parse(done.stdout), "wall_seconds": time.perf_counter() - started,
                      "command": "torchrun --standalone " + " ".join(command(name, args.updates)[4:]).replace(
                          str(REPO_ROOT) + "/", "")}
        print(f"{name}: {runs[name]['final_eval_loss']:.4f}, {runs[name]['samples_per_s']:.0f} samples/s, "
              f"{minutes(runs[name]['wall_seconds'])}")
    return {"runs": runs}  # save() adds the benchmark and the machine


def rank(args: argparse.Namespace, ctx: Any) -> dict[str, Any]:
    raise RuntimeError("example_runs launches the README's torchrun commands itself: run it without torchrun")


def blocks(results: dict[str, Any], figures: Any) -> dict[str, str]:
    data = results.get("example_runs")
    if not data:
        return {}
    rows = [[f"`{' '.join(RUNS[name][1])}`", str(RUNS[name][0]), f"{r['final_eval_loss']:.4f}",
             f"{r['samples_per_s']:.0f}", minutes(r["wall_seconds"])] for name, r in data["runs"].items()]
    return {"example-runs": md_table(["examples/train_gpt.py", "ranks", "final eval loss", "samples/s (training)",
                                      "wall time, launch included"], rows)}


def runtimes(results: dict[str, Any]) -> list[tuple[str, float]]:
    data = results.get("example_runs")
    return [("example_runs", data["runtime_s"])] if data and "runtime_s" in data else []


BENCHMARK = common.Benchmark("example_runs", __doc__, arguments, rank, sweep, quick={"updates": 20})

if __name__ == "__main__":
    common.main(BENCHMARK)
