"""Sparse outer rounds (``outer_topk``, issue 73) against dense ones: bytes per round on the
wire, held-out loss at equal inner steps, and time to loss behind a slow link. Each setting is
one ``time_to_loss.py`` launch (2 ranks, the time-to-loss GPT)::

    python benchmarks/sparse_rounds.py steps          # equal inner steps, unlimited loopback (not timed)
    sudo $(which python) benchmarks/sparse_rounds.py 20mbit 50mbit   # 45 s per method, 3 seeds (timed: alone)
    python benchmarks/sparse_rounds.py --report       # docs/loops.md's tables

``steps``: blocking rounds (``sync_delay=0``), H = 8, lockstep, 240 inner steps, seed 1337 (or
``--seeds 7 42``: their runs join the results file's): the 32-bit dense round, the default dense 4-bit one, and ``outer_topk`` 1/16,
1/64 and 1/256 at 2 and 4 bits; the loopback's byte counter gives each round's bytes (every
collective of the run, per outer round). ``20mbit`` / ``50mbit``: the dense 4-bit round and
``outer_topk=1/64`` at 2 bits, each at blocking H of 4, 8, 16 and 30, 45 s per method, seeds
1337, 7 and 42. Results: ``benchmarks/results/sparse_rounds-SETTING.json`` (time_to_loss.py's
format).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import common

__all__ = ["SETTINGS", "blocks", "report"]

FIXED = (4, 8, 16, 30)
DENSE32, DENSE4 = "local-h8-d0-lockstep-b32", "local-h8-d0-lockstep-b4"
SPARSE = [f"local-h8-d0-lockstep-b{bits}-k{n}" for n in (16, 64, 256) for bits in (2, 4)]
CHOSEN = "b2-k64"  # the bar's sparse round: outer_topk=1/64, outer_bits=2
STEPS_METHODS = [DENSE32, DENSE4, *SPARSE]
TIMED_METHODS = [f"local-h{h}-d0-lockstep-b4" for h in FIXED] + [f"local-h{h}-d0-lockstep-{CHOSEN}" for h in FIXED]
SETTINGS: dict[str, list[str]] = {
    "steps": ["--links", "unlimited", "--steps", "240", "--budget", "900", "--max-quiet-wait", "0",
              "--methods", *STEPS_METHODS],
    "20mbit": ["--links", "comm~compute", "--rates", "20mbit", "--budget", "45", "--max-quiet-wait", "120",
               "--seeds", "1337", "7", "42", "--methods", *TIMED_METHODS],
    "50mbit": ["--links", "comm~compute", "--rates", "50mbit", "--budget", "45", "--max-quiet-wait", "120",
               "--seeds", "1337", "7", "42", "--methods", *TIMED_METHODS],
}
# Issue 73's bar: 1/64 at 2 bits at most 0.03 of the 32-bit round's bytes, within 1% of the dense
# 4-bit round's loss at equal inner steps.
MOST_BYTES, WITHIN = 0.03, 0.01


def path_of(setting: str, results_dir: Path = common.RESULTS_DIR) -> Path:
    return results_dir / f"sparse_rounds-{setting}.json"


def run(setting: str, seeds: list[str] | None) -> None:
    """One ``time_to_loss.py`` launch; runs of other seeds already in the results file are kept."""
    out = path_of(setting)
    fresh = out.with_suffix(".part.json")
    command = [sys.executable, str(common.BENCH_DIR / "time_to_loss.py"), *SETTINGS[setting], "--no-report",
               "--out", str(fresh)]
    if seeds:
        command += ["--seeds", *seeds]
    subprocess.run(command, check=True)
    data = json.loads(fresh.read_text())
    if out.exists():
        ran = {r["seed"] for r in data["runs"]}
        kept = [r for r in json.loads(out.read_text())["runs"] if r["seed"] not in ran]
        data["runs"] = sorted(kept + data["runs"], key=lambda r: r["seed"] != 1337)
        data["config"]["seeds"] = [r["seed"] for r in data["runs"]]
    out.write_text(json.dumps(data, indent=1) + "\n")
    fresh.unlink()


def name_of(method: str) -> str:
    """``dense 4-bit`` / ``top 1/64, 2-bit`` from a method name."""
    bits = method.split("-b")[-1]
    if "-k" not in bits:
        return f"dense {bits}-bit"
    value, _, share = bits.partition("-k")
    return f"top 1/{share}, {value}-bit"


def steps_table(data: dict[str, Any]) -> str:
    rows = []
    gaps: dict[str, list[float]] = {}  # each round's gap to dense 4-bit, by seed (the summary's)
    for run_ in data["runs"]:
        methods = run_["methods"]
        full, dense = methods.get(DENSE32, {}), methods.get(DENSE4, {})
        for method in STEPS_METHODS:
            m = methods.get(method)
            if not m or "final_loss" not in m:
                continue
            per_round = m.get("lo_bytes_per_sync")
            share = per_round / full["lo_bytes_per_sync"] if per_round and full.get("lo_bytes_per_sync") else None
            gap = m["final_loss"] / dense["final_loss"] - 1 if dense.get("final_loss") else None
            if gap is not None and method != DENSE4:
                gaps.setdefault(method, []).append(gap)
            rows.append([str(run_["seed"]), name_of(method), f"{m['final_loss']:.4f}",
                         "-" if gap is None else f"{100 * gap:+.2f}%",
                         "-" if per_round is None else f"{per_round / 1e6:.3f}",
                         "-" if share is None else f"{share:.4f}"])
    table = common.md_table(["seed", "round", "held-out loss at 240 inner steps", "vs dense 4-bit",
                             "loopback MB per outer round", "vs dense 32-bit"], rows)
    if len(data["runs"]) < 2:
        return table
    summary = common.md_table(
        ["round", f"vs dense 4-bit, mean of {len(data['runs'])} seeds", "median", "range"],
        [[name_of(m), f"{100 * statistics.mean(g):+.2f}%", f"{100 * statistics.median(g):+.2f}%",
          f"{100 * min(g):+.2f}% to {100 * max(g):+.2f}%"] for m, g in gaps.items()])
    return f"{table}\n\n{summary}"


def timed_table(data: dict[str, Any]) -> str:
    finals: dict[str, list[float]] = {}
    for run_ in data["runs"]:
        for method, m in run_["methods"].items():
            if "final_loss" in m:
                finals.setdefault(method, []).append(m["final_loss"])
    median = {k: statistics.median(v) for k, v in finals.items()}
    rows = []
    for kind in ("b4", CHOSEN):
        cells = [median.get(f"local-h{h}-d0-lockstep-{kind}") for h in FIXED]
        best = min((c for c in cells if c is not None), default=None)
        rows.append([name_of(f"x-{kind}"), *("-" if c is None else (f"**{c:.4f}**" if c == best else f"{c:.4f}")
                                             for c in cells)])
    return common.md_table(["round", *(f"H = {h}" for h in FIXED)], rows)


def report(results_dir: Path = common.RESULTS_DIR) -> str:
    parts = []
    if (p := path_of("steps", results_dir)).exists():
        parts.append("Equal inner steps (2 ranks, the time-to-loss GPT, blocking H = 8, lockstep, "
                     f"`python benchmarks/sparse_rounds.py steps`):\n\n{steps_table(json.loads(p.read_text()))}")
    for setting in ("20mbit", "50mbit"):
        if (p := path_of(setting, results_dir)).exists():
            parts.append(f"Behind {setting[:-4]} Mbit/s, 45 s per method, median final held-out loss over seeds "
                         f"1337, 7, 42 (`sudo $(which python) benchmarks/sparse_rounds.py {setting}`; best H in "
                         f"bold):\n\n{timed_table(json.loads(p.read_text()))}")
    return "\n\n".join(parts)


def blocks(results_dir: Path) -> dict[str, str]:
    text = report(results_dir)
    return {"sparse-rounds": text} if text else {}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("settings", nargs="*", metavar="SETTING", help=f"one or more of {', '.join(SETTINGS)}")
    parser.add_argument("--seeds", nargs="+", default=None, help="the steps setting's seeds (default 1337)")
    parser.add_argument("--report", action="store_true", help="print the tables from the results")
    args = parser.parse_args(argv)
    if args.report:
        print(report())
        return
    if not args.settings or set(args.settings) - set(SETTINGS):
        parser.error(f"name one or more of {', '.join(SETTINGS)} (or --report)")
    for setting in args.settings:
        run(setting, args.seeds if setting == "steps" else None)


if __name__ == "__main__":
    main(sys.argv[1:])
