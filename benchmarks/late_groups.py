"""Late replica groups: the grace window's rule, and held-out loss at equal time under stalls.

Runs examples/elastic_local.py (3 replica groups of one process, ``--step-seconds 0.05``, one
micro-batch a step, ``sync_every`` 10) and reads its round records (``counted``, ``spread``,
``participants``). Parts:

- ``window``: how the grace window's rule behaves. 3 groups, 300 inner steps, in three settings:
  quiet, beside four CPU hogs (noisy hand-over times), and group 2 stalled (``--stall 2:50:8``),
  for each rule (``--graces``: ``adaptive``, fixed seconds, ``lockstep``). Per run: the spread of
  hand-over times in rounds with every group (median, 90th percentile, max), the rounds that left a
  group out, the others' inner steps per second, and whether group 2's steps all counted.
- ``equal-time``: 3 groups for ``--seconds`` (60) each, group 2 stalled twice for 8 s
  (``--stall 2:K1:8 --stall 2:K2:8``), per seed (``--seeds``): the held-out loss of the final global
  values with quorum + grace rounds (acco's default), lockstep elastic rounds (the lighthouse waits
  for every live group: ``--grace lockstep``) and torchft's own DiLoCo (``--trainer
  torchft-diloco``) at the same ``sync_every``, beside acco without stalls; medians over seeds.
- ``cost``: what counting a late group's steps one round later costs, at equal inner steps
  (``--steps``, no time limit): quorum + grace against lockstep rounds (which count every group's
  steps on time, the others waiting), both with group 2 stalled twice, per seed.

    pip install -e '.[ft]'
    python benchmarks/late_groups.py window --out benchmarks/results/late_groups-window.json
    python benchmarks/late_groups.py equal-time --seeds 1 2 3 --out benchmarks/results/late_groups-equal-time.json
    python benchmarks/late_groups.py cost --seeds 1 2 3 --out benchmarks/results/late_groups-cost.json

Runs one at a time (timings: nothing else should run on the machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import cpu_hogs
from elastic_stress import EXAMPLE, records

BASE = ["--replicas", "3", "--step-seconds", "0.05", "--micro-batches", "1", "--sync-every", "10",
        "--timeout", "10", "--quorum-timeout", "120", "--pacing", "lockstep"]  # fmt: skip
HOGS = 4


LAUNCHER: list[str] = []  # --launcher's options, after every run's own


def run(directory: Path, extra: list[str], hogs: int = 0) -> dict[str, Any]:
    """One launch of examples/elastic_local.py (its exit code and wall seconds)."""
    command = [sys.executable, str(EXAMPLE), *BASE, *extra, *LAUNCHER, "--log-dir", str(directory)]
    with cpu_hogs(hogs), open(directory.with_suffix(".out"), "w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=600).returncode
    return {"exit": code}


def summary(directory: Path, steps: int | None = None) -> dict[str, Any]:
    """What a run's records say: per group its rate, rounds without some group, counted steps."""
    groups = []
    spreads = []
    for index in range(3):
        written = records(directory, index)
        rounds = [r for r in written if not r.get("final") and not r.get("dropped")]
        final = written[-1] if written else {}
        regular = [r for r in rounds if steps is None or r["inner_step"] < steps]
        rate = None
        if len(regular) > 3:
            first, last = regular[2], regular[-1]
            rate = (last["inner_step"] - first["inner_step"]) / max(1e-9, last["time"] - first["time"])
        if index == 0:
            spreads = [r["spread"] for r in rounds[1:] if r.get("spread") is not None and r["participants"] == 3]
        groups.append({
            "inner_steps": final.get("inner_step"), "eval_loss": final.get("eval_loss"), "rate": rate,
            "counted": sum(r.get("counted") or 0 for r in rounds),
            "rounds": len(rounds), "rounds_without_a_group": sum(1 for r in rounds[1:] if r["participants"] < 3),
        })  # fmt: skip
    finals = {(directory / f"replica-{i}.final").read_text() for i in range(3) if (directory / f"replica-{i}.final").exists()}
    spreads.sort()
    return {
        "groups": groups, "identical": len(finals) == 1,
        "spread": None if not spreads else {"median": statistics.median(spreads),
                                            "p90": spreads[int(0.9 * (len(spreads) - 1))], "max": spreads[-1]},
    }  # fmt: skip


def grace_args(grace: str) -> list[str]:
    return ["--grace", grace]


def window(args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    settings = {"quiet": ([], 0), "hogs": ([], HOGS), "stall": (["--stall", "2:50:8"], 0)}
    rows = []
    for setting, (extra, hogs) in settings.items():
        for grace in args.graces:
            directory = root / f"window-{setting}-{grace}"
            outcome = run(directory, ["--steps", "300", *extra, *grace_args(grace)], hogs)
            row = {"setting": setting, "grace": grace, **outcome, **summary(directory, 300)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def methods(stalls: list[str]) -> dict[str, list[str]]:
    return {
        "quorum + grace": stalls,
        "lockstep": [*stalls, "--grace", "lockstep"],
        "torchft DiLoCo": [*stalls, "--trainer", "torchft-diloco"],
        # (torchft has no grace window: a longer join timeout leaves groups out of fewer rounds)
        "torchft DiLoCo, join 500 ms": [*stalls, "--trainer", "torchft-diloco", "--join-ms", "500"],
        "no stall": [],
    }


def equal_time(args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    stalls = [arg for k in args.stall_steps for arg in ("--stall", f"2:{k}:8")]
    rows = []
    for seed in args.seeds:
        for method, extra in methods(stalls).items():
            if method not in args.methods:
                continue
            directory = root / f"equal-time-{method.replace(' ', '_').replace('+', '')}-{seed}"
            outcome = run(directory, ["--seconds", str(args.seconds), "--steps", str(args.schedule_steps),
                                      "--seed", str(seed), *extra])  # fmt: skip
            row = {"method": method, "seed": seed, **outcome, **summary(directory)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def cost(args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    stalls = [arg for k in args.stall_steps for arg in ("--stall", f"2:{k}:8")]
    rows = []
    for seed in args.seeds:
        for method in ("quorum + grace", "lockstep"):
            extra = methods(stalls)[method]
            directory = root / f"cost-{method.replace(' ', '_').replace('+', '')}-{seed}"
            outcome = run(directory, ["--steps", str(args.schedule_steps), "--seed", str(seed), *extra])
            row = {"method": method, "seed": seed, **outcome, **summary(directory)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def report(part: str, rows: list[dict[str, Any]]) -> None:
    if part == "window":
        print("| setting | grace | spread median / p90 / max (s) | rounds without a group (group 0) | "
              "group 0 steps/s | group 2 counted / inner steps | identical | exit |")
        print("|---|---|---|---|---|---|---|---|")
        for row in rows:
            s, g0, g2 = row["spread"], row["groups"][0], row["groups"][2]
            spread = "-" if s is None else f"{s['median']:.3f} / {s['p90']:.3f} / {s['max']:.3f}"
            print(f"| {row['setting']} | {row['grace']} | {spread} | {g0['rounds_without_a_group']} | "
                  f"{g0['rate']:.2f} | {g2['counted']} / {g2['inner_steps']} | {row['identical']} | {row['exit']} |")
        return
    by_method: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_method.setdefault(row["method"], []).append(row)
    base = "no stall" if part == "equal-time" else "lockstep"  # cost: against counting every step on time
    reference = {r["seed"]: r["groups"][0]["eval_loss"] for r in by_method.get(base, [])}
    print(f"| method | held-out loss per seed | vs {base}, same seed | median of those | group 0 inner steps "
          "(median) | group 2 inner steps / counted (median) | identical ends |")
    print("|---|---|---|---|---|---|---|")
    for method, group in by_method.items():
        losses = [r["groups"][0]["eval_loss"] for r in group]
        ratios = [r["groups"][0]["eval_loss"] / reference[r["seed"]] - 1 for r in group if r["seed"] in reference]
        versus = "-" if not ratios else ", ".join(f"{100 * x:+.2f}%" for x in ratios)
        median = "-" if not ratios else f"{100 * statistics.median(ratios):+.2f}%"
        steps0 = statistics.median(r["groups"][0]["inner_steps"] for r in group)
        late = statistics.median(r["groups"][2]["inner_steps"] or 0 for r in group)
        counted = statistics.median(r["groups"][2]["counted"] for r in group)
        print(f"| {method} | {', '.join(f'{x:.4f}' for x in losses)} | {versus} | {median} | {steps0:.0f} | "
              f"{late:.0f} / {counted:.0f} | {sum(r['identical'] for r in group)} of {len(group)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=["window", "equal-time", "cost"])
    parser.add_argument("--graces", nargs="+", default=["adaptive", "0", "0.5", "lockstep"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--schedule-steps", type=int, default=900, help="the learning-rate schedule's length")
    parser.add_argument("--stall-steps", type=int, nargs="+", default=[250, 550], help="group 2's stalls (8 s each)")
    parser.add_argument("--methods", nargs="+", default=list(methods([])))
    parser.add_argument("--launcher", nargs=argparse.REMAINDER, default=[],
                        help="the rest: options for examples/elastic_local.py (e.g. --join-ms 100)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs' directories here")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--report", type=Path, nargs="+", default=None, help="print the table of these --out files")
    args = parser.parse_args()
    LAUNCHER.extend(args.launcher)
    if args.report:
        saved = [json.loads(path.read_text()) for path in args.report]
        report(saved[0]["part"], [row for one in saved for row in one["rows"]])
        return
    with tempfile.TemporaryDirectory() as scratch:
        root = args.keep or Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        rows = {"window": window, "equal-time": equal_time, "cost": cost}[args.part](args, root)
    report(args.part, rows)
    if args.out:
        args.out.write_text(json.dumps({"part": args.part, "argv": sys.argv[1:], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
