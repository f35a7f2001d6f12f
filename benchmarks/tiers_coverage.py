"""The two test tiers side by side: each one's wall time and its line coverage of ``acco/``.

Runs ``python -m pytest -q`` (the fast tier, the README's command) and ``python -m pytest -q
-m stress`` (the stress tier) under coverage, each its own data, the spawned ranks included (setup.cfg's ``[coverage:run]``: ``parallel``, ``concurrency = multiprocessing``
and ``patch = subprocess``, so forked, spawned and ``subprocess``-started Python processes all
record; a rank killed with SIGKILL records nothing, as in any coverage run); the full suite's
coverage is the union of the two. Per tier it prints the exit status, the minutes and the
percentage, and writes them to ``results/tiers_coverage.json``:

    pip install coverage
    python benchmarks/tiers_coverage.py                 # both tiers and their union
    python benchmarks/tiers_coverage.py --tiers fast    # the fast tier again (the union with the last stress data)

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
TIERS = {"fast": [], "stress": ["-m", "stress"]}


def data_file(tier: str) -> Path:
    return REPO_ROOT / f".coverage-{tier}"


def coverage(tier: str, *args: str, **kwargs: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coverage", *args], cwd=REPO_ROOT, check=True,
                          env={**os.environ, "COVERAGE_FILE": str(data_file(tier))}, **kwargs)  # fmt: skip


def percent(tier: str) -> dict[str, object]:
    """The line coverage of acco/ in ``tier``'s combined data."""
    report = coverage(tier, "report", "--include", "acco/*", capture_output=True, text=True).stdout
    total = re.search(r"^TOTAL\s+(\d+)\s+(\d+)\s+\d+%", report, flags=re.M)
    statements, missed = int(total.group(1)), int(total.group(2))
    return {"statements": statements, "missed": missed, "percent": round(100 * (statements - missed) / statements, 2),
            "report": report}  # fmt: skip


def covered(tier: str) -> dict[str, object]:
    """One tier under coverage: its exit status, minutes and line coverage of acco/."""
    coverage(tier, "erase")
    started = time.monotonic()
    code = subprocess.run([sys.executable, "-m", "coverage", "run", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *TIERS[tier]], cwd=REPO_ROOT, env={**os.environ, "COVERAGE_FILE": str(data_file(tier))}
                          ).returncode  # fmt: skip
    minutes = (time.monotonic() - started) / 60
    coverage(tier, "combine", "-q")
    return {"tier": tier, "exit": code, "minutes": round(minutes, 2), **percent(tier)}


def full() -> dict[str, object]:
    """The whole suite: the union of the two tiers' data."""
    coverage("full", "erase")
    coverage("full", "combine", "-q", "--keep", str(data_file("fast")), str(data_file("stress")))
    return {"tier": "full", **percent("full")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiers", nargs="+", default=list(TIERS), choices=list(TIERS))
    args = parser.parse_args()
    results = [covered(tier) for tier in args.tiers]
    if all(data_file(tier).exists() for tier in TIERS):
        results.append(full())
    for result in results:
        timing = f"exit {result['exit']}, {result['minutes']:.1f} min under coverage, " if "exit" in result else ""
        print(f"{result['tier']:6s}: {timing}{result['percent']:.2f}% of acco/'s {result['statements']} lines")
    RESULTS.write_text(json.dumps({"benchmark": "tiers_coverage", "tiers": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
