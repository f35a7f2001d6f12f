"""Speed pacing under a loop's own collective at every inner step: time_to_loss.py's loop with
rank 0's clock broadcast at every inner step deciding the stop (``--local-stop broadcast``, the
shape of a time budget or a logged all-reduce of the loss), the library's defaults but
``sync_every=16`` (``local-h16-b32`` / ``local-h16-b4``), 30 s, behind each link rate, quiet and
beside one CPU-bound process (``--cpu-hogs 1``); then rank 1 three times slower (``--slow 3``)
with the default pacing and with ``pacing="lockstep"``.

    sudo $(which python) benchmarks/pacing_loops.py             # 16 + 2 runs: ~18 min (docs/loops.md)
    sudo $(which python) benchmarks/pacing_loops.py --quick     # 2 runs of 10 s
    python benchmarks/pacing_loops.py --table                   # the tables, from results/pacing_loops/

Each run is one ``benchmarks/time_to_loss.py`` launch, its JSON in ``results/pacing_loops/``.
The table: whether the run ended with a result, each replica's inner steps, every plan the
pacing held after a landed round (equal replicas: ``[16, 16]`` only), the largest gap between
the replicas' reported paces over the rounds after the first (1 - the slower's speed as a share
of the faster's; pacing engages past 0.2 in two successive rounds), and the held-out loss of the
global values at the end.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import common

__all__ = ["EQUAL_RUNS", "SLOW_RUNS", "table"]

HERE = Path(__file__).resolve().parent
OUT = common.RESULTS_DIR / "pacing_loops"
RATES = ("20mbit", "50mbit", "100mbit", "200mbit")
# (name, rate, method, cpu hogs, --slow)
EQUAL_RUNS = [(f"{rate}-b{bits}-{'hog' if hogs else 'quiet'}", rate, f"local-h16-b{bits}", hogs, 1)
              for hogs in (0, 1) for rate in RATES for bits in (32, 4)]
SLOW_RUNS = [("50mbit-b4-slow3", "50mbit", "local-h16-b4", 0, 3),
             ("50mbit-b4-slow3-lockstep", "50mbit", "local-h16-b4-lockstep", 0, 3)]
QUICK_RUNS = ["50mbit-b4-hog", "50mbit-b4-slow3"]


def launch(name: str, rate: str, method: str, hogs: int, slow: int, budget: float) -> None:
    """One time_to_loss.py run, its JSON at ``OUT/name.json``."""
    command = [sys.executable, str(HERE / "time_to_loss.py"), "--methods", method, "--links", "comm~compute",
               "--rates", rate, "--seeds", "1337", "--local-stop", "broadcast", "--budget", str(budget),
               "--cpu-hogs", str(hogs), "--no-report", "--out", str(OUT / f"{name}.json")]
    if slow > 1:
        command += ["--slowdown", f"1:{slow}"]
    started = time.perf_counter()
    code = subprocess.run(command).returncode
    print(f"{name}: exit {code} after {time.perf_counter() - started:.0f} s", flush=True)


def result(name: str) -> dict[str, Any] | None:
    path = OUT / f"{name}.json"
    if not path.exists():
        return None
    data = common.read_json(path)
    methods = data["runs"][0]["methods"] if data.get("runs") else {}
    return next(iter(methods.values()), None)


def table(names: list[str]) -> str:
    rows = []
    for name in names:
        run = result(name)
        if run is None or "final_loss" not in run:
            rows.append([name, "no", "-", "-", "-", "-", "-"])
            continue
        plans = []
        for plan in run["plans"]:
            if plan not in plans:
                plans.append(plan)
        gaps = [1.0 - min(p) / max(p) for p in run.get("paces", [])[1:] if p and min(p) > 0]  # (the first: start-up)
        rows.append([name, "yes", " / ".join(str(s) for s in run["inner_steps_by_rank"]), str(len(run["plans"])),
                     " ".join(str(p) for p in plans), f"{max(gaps):.3f}" if gaps else "-", f"{run['final_loss']:.4f}"])
    return common.md_table(["run", "ended with a result", "inner steps (rank 0 / rank 1)", "rounds landed",
                            "plans held", "largest pace gap", "held-out loss"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", action="store_true", help="print the tables from results/pacing_loops/ only")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--runs", nargs="+", default=None, choices=[r[0] for r in EQUAL_RUNS + SLOW_RUNS])
    parser.add_argument("--budget", type=float, default=30.0)
    args = parser.parse_args()
    runs = EQUAL_RUNS + SLOW_RUNS
    chosen = args.runs or (QUICK_RUNS if args.quick else [r[0] for r in runs])
    if not args.table:
        for name, rate, method, hogs, slow in runs:
            if name in chosen:
                launch(name, rate, method, hogs, slow, 10.0 if args.quick else args.budget)
    equal = [r[0] for r in EQUAL_RUNS if r[0] in chosen or args.table]
    slow = [r[0] for r in SLOW_RUNS if r[0] in chosen or args.table]
    print("Equal replicas, rank 0's clock broadcast at every inner step:\n")
    print(table(equal))
    print("\nRank 1 three times slower (--slow 3), the same loop:\n")
    print(table(slow))


if __name__ == "__main__":
    main()
