"""The defaults of ``mode="local"`` (``sync_every="auto"`` and the default landing: each round
blocking, or hidden behind one inner step; 4-bit rounds) against fixed blocking H at equal wall
time (issues 58 and 71): 2 ranks, the time-to-loss GPT, 45 s per method, behind a rate-limited
loopback (or a link that changes speed a third into each run), with rank 0's share of the wall
time spent waiting for outer rounds. Each setting is one ``time_to_loss.py``
launch (every method, seeds 1337, 7 and 42, the methods in turn within each seed)::

    sudo $(which python) benchmarks/auto_every.py 20mbit 200mbit 500mbit unlimited   # the issue's links
    sudo $(which python) benchmarks/auto_every.py 500to20mbit  # 500 Mbit/s for 15 s, then 20 (and 20to500mbit)
    sudo $(which python) benchmarks/auto_every.py 20mbit --methods local-hdefault   # some methods again
    python benchmarks/auto_every.py --report                   # docs/loops.md's and the README's tables

Results: ``benchmarks/results/auto_every-SETTING.json`` (time_to_loss.py's format; with
``--methods``, the runs of those methods replace theirs in the file, the others kept), the figure
``auto_every.png`` beside them. A setting takes about 15 minutes on 2 cores.
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

import common

__all__ = ["FIXED", "SETTINGS", "blocks", "compare", "readme", "report"]

AUTO = "local-hdefault"  # the library's defaults: sync_every="auto", the default landing
FIXED = (4, 8, 16, 30)
METHODS = (AUTO, *(f"local-h{h}" for h in FIXED))  # (a fixed H's rounds block: the default landing's rule)
TODAY = "local-h4"  # the default H of 2026-11-28
SEEDS = ("1337", "7", "42")
BUDGET_S = 45
# The link of each setting: time_to_loss.py's --links and --rates.
SETTINGS: dict[str, list[str]] = {
    "20mbit": ["--links", "comm~compute", "--rates", "20mbit"],
    "100mbit": ["--links", "comm~compute", "--rates", "100mbit"],
    "200mbit": ["--links", "comm~compute", "--rates", "200mbit"],
    "500mbit": ["--links", "comm~compute", "--rates", "500mbit"],
    "unlimited": ["--links", "unlimited"],
    "500to20mbit": ["--links", "comm~compute", "--rates", "500mbit:15,20mbit"],
    "20to500mbit": ["--links", "comm~compute", "--rates", "20mbit:15,500mbit"],
}
CHANGING = ("500to20mbit", "20to500mbit")
# Issue 71's bar: the defaults' median final loss at most 2% above the best fixed H's, and rank 0
# waiting for outer rounds at most 5% of the wall time.
WITHIN, MOST_WAITING = 0.02, 0.05


def path_of(setting: str, results_dir: Path = common.RESULTS_DIR) -> Path:
    return results_dir / f"auto_every-{setting}.json"


def run(setting: str, methods: list[str]) -> None:
    """One time_to_loss.py launch; with a subset of the methods, merged into the file."""
    out = path_of(setting)
    partial = sorted(methods) != sorted(METHODS) and out.exists()
    target = Path(tempfile.mkdtemp()) / out.name if partial else out
    command = [sys.executable, str(common.BENCH_DIR / "time_to_loss.py"), *SETTINGS[setting], "--methods", *methods,
               "--seeds", *SEEDS, "--budget", str(BUDGET_S), "--no-report", "--max-quiet-wait", "120",
               "--out", str(target)]
    subprocess.run(command, check=True)
    if partial:
        new, old = json.loads(target.read_text()), json.loads(out.read_text())
        replaced: dict[str, dict[str, Any]] = {}
        for run_old in old["runs"]:
            for run_new in new["runs"]:
                if run_new["seed"] == run_old["seed"]:
                    replaced[str(run_old["seed"])] = {n: summary_of(run_old["methods"][n])
                                                      for n in run_new["methods"] if n in run_old["methods"]}
                    run_old["methods"].update(run_new["methods"])
        old.setdefault("reruns", []).append({"methods": methods, "command": new.get("command"), "replaced": replaced})
        out.write_text(json.dumps(old, indent=1))


def summary_of(method: dict[str, Any]) -> dict[str, Any]:
    """What a rerun keeps of the run it replaces: its final loss, each round's H, its steps."""
    return {key: method.get(key) for key in ("final_loss", "round_every", "inner_steps", "end_s")}


def finals(data: dict[str, Any]) -> dict[str, list[float]]:
    """Per method, the final held-out loss of each seed."""
    out: dict[str, list[float]] = {}
    for r in data["runs"]:
        for name, m in r["methods"].items():
            if "final_loss" in m:
                out.setdefault(name, []).append(m["final_loss"])
    return out


def waiting(data: dict[str, Any], name: str = AUTO) -> list[float]:
    """Per seed, rank 0's share of the wall time its ``step()`` spent waiting for outer rounds
    (``RoundStats.wait_seconds`` and ``patience_seconds``, summed)."""
    return [r["methods"][name]["wait_share_by_rank"][0] for r in data["runs"]
            if "wait_share_by_rank" in r["methods"].get(name, {})]


def loss_at(points: list[dict[str, Any]], updates: float) -> float | None:
    """The held-out loss at ``updates`` inner updates, linear between a run's evaluations."""
    pairs = [(p["updates"], p["loss"]) for p in points]
    for (u0, l0), (u1, l1) in zip(pairs, pairs[1:]):
        if u0 <= updates <= u1:
            return l0 + (l1 - l0) * (updates - u0) / max(1, u1 - u0)
    return None


def per_update(data: dict[str, Any], name: str) -> list[float]:
    """Per seed, the defaults' held-out loss over ``name``'s at the same number of inner updates
    (the fewer of the two runs'), less 1: what they train per update, their speed left out (a
    fixed H's run is the same trajectory at every link, its loss a function of its updates)."""
    gaps = []
    for r in data["runs"]:
        mine, other = r["methods"].get(AUTO), r["methods"].get(name)
        if not mine or not other or "points" not in mine or "points" not in other:
            continue
        updates = min(mine["updates"], other["updates"])
        a, b = loss_at(mine["points"], updates), loss_at(other["points"], updates)
        if a is not None and b:
            gaps.append(a / b - 1)
    return gaps


def compare(data: dict[str, Any]) -> dict[str, Any]:
    """Medians over the seeds; the best fixed H; the defaults' gap to it and to H = 4; the H they
    chose; rank 0's waiting."""
    losses = finals(data)
    median = {name: statistics.median(v) for name, v in losses.items()}
    fixed = {name: median[name] for name in METHODS[1:] if name in median}
    best = min(fixed, key=fixed.get) if fixed else None
    out: dict[str, Any] = {"median": median, "seeds": {n: len(v) for n, v in losses.items()}, "best_fixed": best}
    if AUTO in median and best is not None:
        out["gap_to_best"] = median[AUTO] / fixed[best] - 1
        out["gap_to_today"] = median[AUTO] / median[TODAY] - 1 if TODAY in median else None
        out["ahead_of_every_fixed"] = all(median[AUTO] < v for v in fixed.values())
        out["chosen"] = [r["methods"][AUTO].get("round_every", []) for r in data["runs"] if AUTO in r["methods"]]
        out["waiting"] = {name: waiting(data, name) for name in METHODS if name in median}
        out["per_update"] = {name: per_update(data, name) for name in METHODS[1:] if name in median}
        waits = out["waiting"][AUTO]
        out["met"] = out["gap_to_best"] <= WITHIN and bool(waits) and statistics.median(waits) <= MOST_WAITING
    return out


def chosen_text(rounds: list[list[int]]) -> str:
    """The H auto chose, per seed: its runs of equal H, e.g. 4, 26x9."""
    def runs(hs: list[int]) -> str:
        parts, i = [], 0
        while i < len(hs):
            j = i
            while j < len(hs) and hs[j] == hs[i]:
                j += 1
            parts.append(f"{hs[i]}" + (f"x{j - i}" if j - i > 1 else ""))
            i = j
        return ", ".join(parts)
    return "; ".join(runs(hs) for hs in rounds)


def figure(data: dict[str, dict[str, Any]], out_dir: Path) -> str | None:
    """For each link measured: each round's H (the defaults) against its launch time, and every
    method's held-out loss against time, seed 1337."""
    shown = [s for s in SETTINGS if s in data]
    if not shown:
        return None
    plt = common.pyplot()
    fig, axes = plt.subplots(2, len(shown), figsize=(5.5 * len(shown), 6.5), squeeze=False, sharex=True)
    for col, setting in enumerate(shown):
        run = next(r for r in data[setting]["runs"] if str(r["seed"]) == SEEDS[0])
        top, bottom = axes[0][col], axes[1][col]
        for name in METHODS:
            m = run["methods"].get(name)
            if not m or "points" not in m:
                continue
            xs, ys = [p["elapsed_s"] for p in m["points"]], [p["loss"] for p in m["points"]]
            bottom.plot(xs, ys, label="defaults" if name == AUTO else f"H = {name.removeprefix('local-h')}",
                        lw=2.2 if name == AUTO else 1.0, color="k" if name == AUTO else None)
            if name == AUTO and m.get("round_every"):
                per_step = m["end_s"] / max(1, m["inner_steps"])  # launch times from the steps before each
                starts = [per_step * sum(m["round_every"][:i]) for i in range(len(m["round_every"]))]
                top.step(starts, m["round_every"], where="post", color="k")
        if setting in CHANGING:
            top.axvline(BUDGET_S / 3, color="grey", ls=":")
            bottom.axvline(BUDGET_S / 3, color="grey", ls=":")
        top.set_title(setting + (f" (the rate changes at {BUDGET_S // 3} s)" if setting in CHANGING else ""))
        top.set_ylabel("H the defaults chose (steps per round)")
        bottom.set_ylabel("held-out loss")
        bottom.set_xlabel("seconds of training (launch times approximate)")
        finals_ = [m["final_loss"] for m in run["methods"].values() if "final_loss" in m]
        bottom.set_ylim(min(finals_) - 0.05, min(finals_) + 1.0)
        bottom.legend(fontsize=7)
    return common.save_figure(fig, out_dir / "auto_every.png")


def report(results_dir: Path = common.RESULTS_DIR) -> str:
    data = {s: json.loads(p.read_text()) for s in SETTINGS if (p := path_of(s, results_dir)).exists()}
    data = {s: d for s, d in data.items() if AUTO in finals(d)}  # (a file of fixed H alone predates the defaults)
    if not data:
        return ""
    rows = []
    for setting, d in data.items():
        c = compare(d)
        m = c["median"]
        cells = [f"{m[n]:.4f}" + (f" ({c['seeds'][n]})" if c["seeds"][n] != len(SEEDS) else "") if n in m else "-"
                 for n in METHODS]
        best = c["best_fixed"]
        cells[METHODS.index(best)] = f"**{cells[METHODS.index(best)]}**"
        gap = "-" if "gap_to_best" not in c else f"{100 * c['gap_to_best']:+.2f}%"
        today = "-" if c.get("gap_to_today") is None else f"{100 * c['gap_to_today']:+.2f}%"
        waits = c.get("waiting", {})
        def shares(name: str) -> str:
            values = waits.get(name, [])
            if not values:
                return "-"
            return f"{100 * statistics.median(values):.1f} ({'/'.join(f'{100 * w:.1f}' for w in values)})"

        same = c.get("per_update", {}).get(TODAY, [])
        equal = "-" if not same else (f"{100 * statistics.median(same):+.1f}% "
                                      f"({'/'.join(f'{100 * g:+.1f}' for g in same)})")
        rows.append([setting, *cells, gap, today, equal, shares(AUTO), shares(TODAY),
                     chosen_text(c.get("chosen", [])[:1])])
    header = ["link", "defaults", *(f"H = {h}" for h in FIXED), "defaults vs best fixed", "defaults vs H = 4",
              "defaults vs H = 4 at equal updates: median (per seed)", "rank 0 waiting, defaults: % median (per seed)",
              "rank 0 waiting, H = 4", "H the defaults chose (seed 1337)"]
    text = (f"Median final held-out loss over seeds {', '.join(SEEDS)} (fewer: their number in brackets), "
            f"{BUDGET_S} s per method, 2 ranks, the time-to-loss GPT (0.83M); `defaults` is `mode=\"local\"` as "
            "it comes (`sync_every=\"auto\"`, the default landing, 4-bit rounds, plain averaging), `H = N` the same at a fixed "
            "H (blocking); best fixed H in bold; rank 0's share of the wall time its `step()` waited for outer "
            "rounds (`RoundStats.wait_seconds` and `patience_seconds`); at equal updates: the defaults' held-out loss over "
            "H = 4's at the fewer of the two runs' inner updates, per seed (a fixed H's trajectory is the same at "
            "every link: its loss is a function of its updates). Commands: `sudo $(which python) "
            "benchmarks/auto_every.py SETTING`.\n\n" + common.md_table(header, rows))
    fig = figure(data, results_dir)
    if fig:
        text += f"\n\n![auto_every](results/{fig})"
    return text


def readme(results_dir: Path = common.RESULTS_DIR) -> str:
    """The README's table: per link of the issue's, the defaults against the best fixed H and
    rank 0's waiting."""
    rows = []
    for setting in SETTINGS:
        if setting in CHANGING or not (p := path_of(setting, results_dir)).exists():
            continue
        c = compare(json.loads(p.read_text()))
        if "gap_to_best" not in c:
            continue
        best = c["best_fixed"]
        waits = c["waiting"][AUTO]
        rows.append([setting, f"{c['median'][AUTO]:.4f}", f"{c['median'][best]:.4f} (H = {best.removeprefix('local-h')})",
                     f"{100 * c['gap_to_best']:+.2f}%", f"{100 * statistics.median(waits):.1f}%" if waits else "-",
                     f"{100 * statistics.median(c['waiting'][TODAY]):.1f}%" if c["waiting"].get(TODAY) else "-",
                     chosen_text(c.get("chosen", [])[:1])])
    if not rows:
        return ""
    return common.md_table(["link", "defaults: final held-out loss", "best fixed H", "defaults vs best",
                            "rank 0 waiting, defaults", "rank 0 waiting, H = 4", "H the defaults chose (seed 1337)"], rows)


def blocks(results_dir: Path) -> dict[str, str]:
    text, table = report(results_dir), readme(results_dir)
    return {**({"auto-every": text} if text else {}), **({"auto-every-readme": table} if table else {})}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("settings", nargs="*", metavar="SETTING", help=f"one or more of {', '.join(SETTINGS)}")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--report", action="store_true", help="docs/loops.md's block from the results")
    args = parser.parse_args(argv)
    if args.report:  # report.py (which imports this module) places every benchmark's blocks
        print(report())
        subprocess.run([sys.executable, str(common.BENCH_DIR / "report.py")], check=True)
        return
    if not args.settings or set(args.settings) - set(SETTINGS):
        parser.error(f"name one or more of {', '.join(SETTINGS)} (or --report)")
    for setting in args.settings:
        run(setting, args.methods)


if __name__ == "__main__":
    main(sys.argv[1:])
