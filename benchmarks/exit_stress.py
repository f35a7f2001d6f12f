"""Does a finished job exit cleanly, every time, on a loaded machine?

Runs tests/exit_job.py (2 gloo ranks, a few rounds, then ``finish()`` or not, with or without
``destroy_process_group()``) ``--runs`` times per case beside ``--hogs`` busy processes, and
counts the runs in which a rank aborted ("terminate called", SIGABRT) or exited non-zero.

    python benchmarks/exit_stress.py --runs 100 --hogs 2                        # the sync-finish-no-destroy case
    python benchmarks/exit_stress.py --runs 20 --cases acco:forget:1 dpu:finish:0
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cpu_hogs  # noqa: E402
from tests.ranks import run_script  # noqa: E402

JOB = str(Path(__file__).resolve().parents[1] / "tests" / "exit_job.py")


def run_case(case: str, runs: int, at_once: int = 1) -> list[tuple[int, int, int, str]]:
    """``runs`` jobs of ``case`` (MODE:END:DESTROY, as tests/exit_job.py takes), ``at_once`` at
    a time; per rank that aborted ("terminate called") or exited non-zero: (run, rank, exit
    code, its stderr's tail). Also the stress tier's harness (tests/test_stress.py)."""
    mode, end, destroy = case.split(":")
    with ThreadPoolExecutor(max_workers=at_once) as pool:
        jobs = list(pool.map(lambda _: run_script(JOB, mode, end, destroy), range(runs)))
    return [(run, rank, result.returncode, result.stderr[-400:]) for run, results in enumerate(jobs)
            for rank, result in enumerate(results) if "terminate called" in result.stderr or result.returncode != 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--hogs", type=int, default=2)
    parser.add_argument("--at-once", type=int, default=1, help="jobs at a time")
    parser.add_argument("--cases", nargs="+", default=["sync:finish:0"], help="MODE:END:DESTROY, as tests/exit_job.py takes")
    args = parser.parse_args()
    with cpu_hogs(args.hogs):
        for case in args.cases:
            started = time.monotonic()
            bad = run_case(case, args.runs, args.at_once)
            print(f"{case}: {args.runs - len({b[0] for b in bad})} of {args.runs} runs clean beside {args.hogs} CPU hogs "
                  f"({time.monotonic() - started:.0f} s)", flush=True)
            for run, rank, code, tail in bad:
                print(f"  run {run} rank {rank}: exit {code}\n{tail}")


if __name__ == "__main__":
    main()
