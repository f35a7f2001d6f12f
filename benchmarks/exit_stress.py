"""Does a finished job exit cleanly, every time, on a loaded machine?

Runs tests/exit_job.py (2 gloo ranks, a few rounds, then ``finish()`` or not, with or without
``destroy_process_group()``) ``--runs`` times per case beside ``--hogs`` busy processes, and
counts the runs in which a rank aborted ("terminate called", SIGABRT) or exited non-zero.

    python benchmarks/exit_stress.py --runs 100 --hogs 2                        # the sync-finish-no-destroy case
    python benchmarks/exit_stress.py --runs 20 --cases acco:forget:1 dpu:finish:0
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.ranks import run_script  # noqa: E402

JOB = str(Path(__file__).resolve().parents[1] / "tests" / "exit_job.py")


def hog(stop) -> None:  # type: ignore[no-untyped-def]
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--hogs", type=int, default=2)
    parser.add_argument("--cases", nargs="+", default=["sync:finish:0"], help="MODE:END:DESTROY, as tests/exit_job.py takes")
    args = parser.parse_args()
    context = multiprocessing.get_context("fork")
    stop = context.Event()
    hogs = [context.Process(target=hog, args=(stop,), daemon=True) for _ in range(args.hogs)]
    for process in hogs:
        process.start()
    try:
        for case in args.cases:
            mode, end, destroy = case.split(":")
            bad, started = [], time.monotonic()
            for run in range(args.runs):
                results = run_script(JOB, mode, end, destroy)
                for rank, result in enumerate(results):
                    if "terminate called" in result.stderr or result.returncode != 0:
                        bad.append((run, rank, result.returncode, result.stderr[-400:]))
            print(f"{case}: {args.runs - len({b[0] for b in bad})} of {args.runs} runs clean beside {args.hogs} CPU hogs "
                  f"({time.monotonic() - started:.0f} s)", flush=True)
            for run, rank, code, tail in bad:
                print(f"  run {run} rank {rank}: exit {code}\n{tail}")
    finally:
        stop.set()
        for process in hogs:
            process.join(timeout=5)


if __name__ == "__main__":
    main()
