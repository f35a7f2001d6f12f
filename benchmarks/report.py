"""Puts the benchmarks' tables and plots (each module's ``blocks()``, ``targets()`` and
``runtimes()``, from its ``results/NAME.json`` and ``results/NAME-*.json``) between
``<!-- BEGIN GENERATED: name -->`` and ``<!-- END GENERATED: name -->`` in the READMEs and docs/.

    python benchmarks/report.py                                   # results/ -> the READMEs
    python benchmarks/report.py --results benchmarks/results/scratch --print   # a smoke run's, printed
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import auto_every
import common
import convergence
import example_runs
import gpu_overlap
import lightning_slow_link
import local_quality
import memory
import profile_lanes
import sparse_rounds
import throughput
import time_to_loss
import two_nodes
import update_cost
from common import BENCH_DIR, RESULTS_DIR, md_table, minutes

__all__ = ["main", "place"]

READMES = (BENCH_DIR / "README.md", common.REPO_ROOT / "README.md", *sorted((common.REPO_ROOT / "docs").glob("*.md")))
# In the order of the runtimes table; results files are named after each one's Benchmark.
BENCHMARKS: tuple[ModuleType, ...] = (throughput, convergence, memory, time_to_loss, profile_lanes, gpu_overlap,
                                      two_nodes, example_runs, lightning_slow_link, local_quality, update_cost)


def generate(results_dir: Path) -> dict[str, str]:
    """Every block the results in ``results_dir`` make (plots written there too)."""
    blocks: dict[str, str] = {}
    target_rows: list[tuple[str, str, bool | None]] = []
    runtime_rows: list[tuple[str, float]] = []
    for module in BENCHMARKS:
        stem = module.BENCHMARK.name  # STEM.json first, then every STEM-NAME.json, by file stem
        paths = [results_dir / f"{stem}.json"] + sorted(results_dir.glob(f"{stem}-*.json"))
        results: dict[str, Any] = {p.stem: json.loads(p.read_text()) for p in paths if p.is_file()}
        if stem not in results and not module.BENCHMARK.stem:
            continue  # the module reads its main results file (one whose files are named by ``stem`` has none)
        blocks.update(module.blocks(results, results_dir))
        target_rows += getattr(module, "targets", lambda r: [])(results)
        # by default, the main results file's runtime
        default = [(stem, results[stem]["runtime_s"])] if "runtime_s" in results.get(stem, {}) else []
        runtime_rows += module.runtimes(results) if hasattr(module, "runtimes") else default
    blocks.update(auto_every.blocks(results_dir))  # time_to_loss.py's launches, its files named apart
    blocks.update(sparse_rounds.blocks(results_dir))
    if target_rows:
        blocks["targets"] = md_table(["target", "measured", ""], [
            [t, m, "n/a" if met is None else ("met" if met else "**not met**")] for t, m, met in target_rows])
    if runtime_rows:
        blocks["runtimes"] = md_table(["benchmark", "runtime (this machine, 2 cores)"],
                                      [[name, minutes(seconds)] for name, seconds in runtime_rows])
    return blocks


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="where the results JSON are")
    parser.add_argument("--print", action="store_true", help="print the blocks instead of writing the READMEs")
    args = parser.parse_args(argv)
    blocks = generate(args.results)
    if args.print:
        for name, body in blocks.items():
            print(f"<!-- {name} -->\n{body}\n")
        return
    place(blocks)


def place(blocks: dict[str, str]) -> None:
    """Each block between its markers, in every README and docs page that has them."""
    texts = {path: path.read_text() for path in READMES}
    for name, body in blocks.items():
        marker = re.escape(name)
        pattern = re.compile(rf"(<!-- BEGIN GENERATED: {marker} -->\n).*?(<!-- END GENERATED: {marker} -->)", re.S)
        placed = [path for path, text in texts.items() if pattern.search(text)]
        for path in placed:
            here = _relative_to(path, body)
            texts[path] = pattern.sub(lambda m: m.group(1) + here.rstrip() + "\n" + m.group(2), texts[path])
        if not placed:
            print(f"report: no block {name!r} in the READMEs; skipped", file=sys.stderr)
    for path, text in texts.items():
        path.write_text(text)
    print(f"report: updated {', '.join(str(p) for p in READMES)} ({', '.join(blocks)})")


def _relative_to(path: Path, body: str) -> str:
    """A block written for the top README (links from the repository's root), as a page in
    docs/ links to the same files."""
    return body.replace("](benchmarks/", "](../benchmarks/") if path.parent.name == "docs" else body


if __name__ == "__main__":
    main()
