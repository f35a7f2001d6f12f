"""The two test tiers side by side: each one's wall time and its line coverage of ``acco/``.

Runs ``python -m pytest -q`` (the fast tier, the README's command) and the whole suite
(``-m "stress or not stress"``: the fast tier and the stress tier) under coverage, the spawned
ranks included (setup.cfg's ``[coverage:run]``: ``parallel``, ``concurrency = multiprocessing``
and ``patch = subprocess``, so forked, spawned and ``subprocess``-started Python processes all
record; a rank killed with SIGKILL records nothing, as in any coverage run). Per tier it prints
the exit status, the minutes and the percentage, and writes them to
``results/tiers_coverage.json``:

    pip install coverage
    python benchmarks/tiers_coverage.py                 # both tiers, ~35 min on 2 cores
    python benchmarks/tiers_coverage.py --tiers fast    # the fast tier only

Coverage slows the run; the tiers' wall times without it come from ``python -m pytest -q``
itself (README).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "benchmarks" / "results" / "tiers_coverage.json"
TIERS = {"fast": [], "full": ["-m", "stress or not stress"]}


def covered(tier: str) -> dict[str, object]:
    """One tier under coverage: its exit status, minutes and the line coverage of acco/."""
    data = REPO_ROOT / f".coverage-{tier}"
    env = {**os.environ, "COVERAGE_FILE": str(data)}
    subprocess.run([sys.executable, "-m", "coverage", "erase"], cwd=REPO_ROOT, env=env, check=True)
    started = time.monotonic()
    code = subprocess.run([sys.executable, "-m", "coverage", "run", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *TIERS[tier]], cwd=REPO_ROOT, env=env).returncode  # fmt: skip
    minutes = (time.monotonic() - started) / 60
    subprocess.run([sys.executable, "-m", "coverage", "combine", "-q"], cwd=REPO_ROOT, env=env, check=True)
    report = subprocess.run([sys.executable, "-m", "coverage", "report", "--include", "acco/*"], cwd=REPO_ROOT,
                            env=env, check=True, capture_output=True, text=True).stdout  # fmt: skip
    total = re.search(r"^TOTAL\s+(\d+)\s+(\d+)\s+(\d+)%", report, flags=re.M)
    statements, missed = int(total.group(1)), int(total.group(2))
    return {"tier": tier, "exit": code, "minutes": round(minutes, 2), "statements": statements, "missed": missed,
            "percent": round(100 * (statements - missed) / statements, 2), "report": report}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiers", nargs="+", default=list(TIERS), choices=list(TIERS))
    args = parser.parse_args()
    results = [covered(tier) for tier in args.tiers]
    for result in results:
        print(f"{result['tier']:4s}: exit {result['exit']}, {result['minutes']:.1f} min under coverage, "
              f"{result['percent']:.2f}% of acco/'s {result['statements']} lines")
    RESULTS.write_text(json.dumps({"benchmark": "tiers_coverage", "tiers": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
