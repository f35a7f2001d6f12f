"""Replicas of different speeds: the tables and the picture of docs/loops.md, "Replicas of
different speeds" (no training here; it reads time_to_loss.py's runs).

    python benchmarks/replicas_report.py      # tables on stdout, docs/replicas_slow3.png

The runs it reads were made by (about 45 minutes in all, as root for the rate-limited loopback;
rank 1 sleeps twice each micro-batch's CPU time with --slow 3, nothing with --slow 1)::

    M="local-h16-lockstep local-h16 diloco-h16 acco-aww-balanced"
    S="--seeds 1337 7 42 --budget 60 --no-report"
    sudo $(which python) benchmarks/time_to_loss.py --slow 3 --links comm~compute --rates 50mbit --methods $M $S \\
        --out benchmarks/results/replicas-slow3-50mbit.json
    sudo $(which python) benchmarks/time_to_loss.py --slow 3 --links comm~compute --rates 500mbit --methods $M $S \\
        --out benchmarks/results/replicas-slow3-500mbit.json
    sudo $(which python) benchmarks/time_to_loss.py --slow 1 --links comm~compute --rates 500mbit \\
        --methods local-h16-lockstep local-h16 $S --out benchmarks/results/replicas-slow1-500mbit.json
    sudo $(which python) benchmarks/time_to_loss.py --slow 1 --links comm~compute --rates 50mbit \\
        --methods local-h16-lockstep local-h16 $S --out benchmarks/results/replicas-slow1-50mbit.json

and the other rules and runs of the last table::

    sudo $(which python) benchmarks/time_to_loss.py --slow 3 --links comm~compute --rates 50mbit \\
        --methods local-h16 local-h16-normalized $S --out benchmarks/results/replicas-slow3-50mbit-weighting.json
    sudo $(which python) benchmarks/time_to_loss.py --slow 3 --links comm~compute --rates 50mbit \\
        --methods local-h16-normalized local-h16-equal local-h16-dauto-estimate $S \\
        --out benchmarks/results/replicas-slow3-50mbit-rules.json
    sudo $(which python) benchmarks/time_to_loss.py --slow 3 --links comm~compute --rates 50mbit \\
        --methods local-h16-lockstep-dauto-estimate $S --out benchmarks/results/replicas-slow3-50mbit-keep-computing.json
    sudo $(which python) benchmarks/time_to_loss.py --slow 2 --links comm~compute --rates 50mbit \\
        --methods local-h16-lockstep local-h16 diloco-h16 $S --out benchmarks/results/replicas-slow2-50mbit.json
    sudo $(which python) benchmarks/two_nodes.py --skip-memory --rate 60mbit --slow-node 3 --repeats 3 \\
        --methods hsdp fsdp-local-h8-lockstep fsdp-local-h8-speed --out benchmarks/results/two_nodes-slow3-60mbit.json

``replicas-slow1-500mbit-rounding.json`` is the --slow 1, 500 Mbit/s run made before the speed plan's
one-step dead band (plain rounding), kept for the comparison in docs/loops.md.

The default after pacing's rule changed (issue 48: the median pace, a 20% dead band, the first
round in lockstep), ``replicas-slow{3,1}-{50,500}mbit-pacing.json``, the last table::

    for rate in 50mbit 500mbit; do for slow in 3 1; do
        sudo $(which python) benchmarks/time_to_loss.py --slow $slow --links comm~compute --rates $rate \
            --methods local-h16 $S --out benchmarks/results/replicas-slow$slow-$rate-pacing.json
    done; done

and at 100 Mbit/s on the code of issue 54 (the pace over blocks of steps, two reports, a replica
that hands over first going on)::

    for slow in 3 1; do
        sudo $(which python) benchmarks/time_to_loss.py --slow $slow --links comm~compute --rates 100mbit \
            --methods local-h16 $S --out benchmarks/results/replicas-slow$slow-100mbit-pacing.json
    done
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import common

RATES = ("50mbit", "500mbit")
PACING_RATES = ("50mbit", "100mbit", "500mbit")  # pacing_table's links
FIGURE = common.REPO_ROOT / "docs" / "replicas_slow3.png"
LABELS = {
    "local-h16-lockstep": "acco local, H = 16, lockstep (every replica 16 steps: the fast one waits)",
    "local-h16": "acco local, H = 16, the defaults of 2026-11-26: paced by speed, token-weighted",
    "diloco-h16": "DiLoCo (torchft), H = 16",
    "acco-aww-balanced": "acco `ready()` loop, slow rank's micro-batches 1/3",
}


def load(slow: int, rate: str) -> dict[str, Any] | None:
    path = common.RESULTS_DIR / f"replicas-slow{slow}-{rate}.json"
    return json.loads(path.read_text()) if path.exists() else None


def per_method(data: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Each method's results, one per seed."""
    out: dict[str, list[dict[str, Any]]] = {}
    for run in data["runs"]:
        for name, result in run["methods"].items():
            if "final_loss" in result:
                out.setdefault(name, []).append(result)
    return out


def fast_steps(result: dict[str, Any]) -> float:
    """The fast replica's (rank 0's) inner steps (local, DiLoCo) or updates (the ready() loop)."""
    if "inner_steps_by_rank" in result:
        return result["inner_steps_by_rank"][0]
    return result.get("inner_steps", result["updates"])


def spread(values: list[float], digits: int = 4) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def slow_table() -> str:
    rows, header = [], ["method"]
    columns = [(rate, load(3, rate), load(1, rate)) for rate in RATES]
    for rate, _, _ in columns:
        header += [f"{rate}: held-out loss", f"{rate}: fast replica's steps (x --slow 1)"]
    names = list(LABELS)
    for name in names:
        row = [LABELS[name]]
        for rate, slow, equal in columns:
            results = per_method(slow).get(name, []) if slow else []
            if not results:
                row += ["-", "-"]
                continue
            row.append(spread([r["final_loss"] for r in results]))
            steps = statistics.median(fast_steps(r) for r in results)
            base = per_method(equal).get(name, []) if equal else []
            ratio = f" (x{steps / statistics.median(fast_steps(r) for r in base):.2f})" if base else ""
            row.append(f"{steps:.0f}{ratio}" if "inner_steps" in results[0] or "inner_steps_by_rank" in results[0]
                       else f"{steps:.0f} updates")
        rows.append(row)
    return common.md_table(header, rows)


def equal_table() -> str:
    rows = []
    for rate in RATES:
        data = load(1, rate)
        if data is None:
            continue
        for name, results in per_method(data).items():
            rows.append([rate, LABELS.get(name, name), spread([r["final_loss"] for r in results]),
                         f"{statistics.median(fast_steps(r) for r in results):.0f}",
                         f"{statistics.median(statistics.fmean(r.get('steps_per_round_by_rank', [0])) for r in results):.1f}"])
    return common.md_table(["link", "method", "held-out loss", "rank 0's inner steps", "steps per round"], rows)


def telemetry_table() -> str:
    """The --slow 3 runs' per-replica telemetry of acco's local methods (medians over seeds)."""
    rows = []
    for rate in RATES:
        data = load(3, rate)
        if data is None:
            continue
        for name, results in per_method(data).items():
            if "steps_per_round_by_rank" not in results[0]:
                continue
            for rank in range(len(results[0]["steps_per_round_by_rank"])):
                rows.append([rate, name, str(rank), f"{statistics.median(r['inner_steps_by_rank'][rank] for r in results):.0f}",
                             f"{statistics.median(r['steps_per_round_by_rank'][rank] for r in results):.1f}",
                             f"{statistics.median(r['wait_share_by_rank'][rank] for r in results):.2f}"])
    return common.md_table(["link", "method", "rank", "inner steps", "steps per round", "share of time waiting"], rows)


def extra_table() -> str:
    """The other measured rules and runs: other weightings and landings beside the default
    (each file its own run), --slow 2, and two emulated nodes with one three times slower."""
    rows = []
    sources = [("replicas-slow3-50mbit-weighting.json", "--slow 3, 50 Mbit/s, side by side"),
               ("replicas-slow3-50mbit-rules.json", "--slow 3, 50 Mbit/s"),
               ("replicas-slow3-50mbit-keep-computing.json", "--slow 3, 50 Mbit/s"),
               ("replicas-slow2-50mbit.json", "--slow 2, 50 Mbit/s")]
    for file, what in sources:
        path = common.RESULTS_DIR / file
        if not path.exists():
            continue
        for name, results in per_method(json.loads(path.read_text())).items():
            steps = [r["inner_steps_by_rank"] for r in results if "inner_steps_by_rank" in r]
            shown = " / ".join(f"{statistics.median(s[rank] for s in steps):.0f}" for rank in range(2)) if steps else "-"
            rows.append([what, f"`{name}`", spread([r["final_loss"] for r in results]), shown])
    path = common.RESULTS_DIR / "two_nodes-slow3-60mbit.json"
    if path.exists():
        repeats = json.loads(path.read_text())["nodes"]["repeats"]
        for name in repeats[0]:
            results = [repeat[name] for repeat in repeats]
            steps = [r["inner_steps_by_rank"] for r in results if "inner_steps_by_rank" in r]
            shown = (" / ".join(f"{statistics.median(s[rank] for s in steps):.0f}" for rank in (0, 2)) if steps
                     else f"{statistics.median(r['updates'] for r in results):.0f} updates")
            rows.append(["two nodes (FSDP2 inside), node 1 3x slower, 60 Mbit/s", f"`{name}`",
                         spread([r["final_loss"] for r in results]), shown])
    return common.md_table(["run", "method", "held-out loss", "inner steps, fast / slow replica"], rows)


def pacing_table() -> str:
    """The default (``local-h16``) after pacing's rule changed: the fast replica's steps beside one
    3x slower against beside an equal one, per link (medians of 3 seeds)."""
    rows = []
    for rate in PACING_RATES:
        paths = [common.RESULTS_DIR / f"replicas-slow{slow}-{rate}-pacing.json" for slow in (3, 1)]
        if not all(path.exists() for path in paths):
            continue
        slow, equal = (per_method(json.loads(path.read_text()))["local-h16"] for path in paths)
        fast, alone = (statistics.median(fast_steps(r) for r in runs) for runs in (slow, equal))
        rows.append([rate, spread([r["final_loss"] for r in slow]), spread([r["final_loss"] for r in equal]),
                     f"{fast:.0f}", f"{alone:.0f}", f"{fast / alone:.2f}",
                     f"{statistics.median(r['steps_per_round_by_rank'][1] for r in slow):.1f}"])
    return common.md_table(["link", "held-out loss, --slow 3", "held-out loss, --slow 1", "fast replica's steps, --slow 3",
                            "rank 0's steps, --slow 1", "fast replica's rate (x --slow 1)",
                            "slow replica's steps per round"], rows)


def draw(path: Path) -> str:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, len(RATES), figsize=(13, 5), sharey=True)
    for ax, rate in zip(axes, RATES):
        data = load(3, rate)
        if data is None:
            continue
        for number, (name, label) in enumerate(LABELS.items()):
            runs = [[(p["elapsed_s"], p["loss"]) for p in r["points"]] for r in per_method(data).get(name, [])]
            if runs:
                common.plot_seeds(ax, runs, f"C{number}", label)
        ax.set(xlabel="training seconds (evaluations excluded)", title=f"{rate.replace('mbit', ' Mbit/s')}")
        ax.set_ylim(top=min(5.0, ax.get_ylim()[1]))
        ax.legend(fontsize=7)
    axes[0].set_ylabel("held-out loss")
    fig.suptitle("2 ranks, rank 1 three times slower, 60 s each; thin: seeds 1337, 7, 42, thick: their median "
                 "(final in the legend)", fontsize=10)
    return common.save_figure(fig, path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=FIGURE)
    parser.add_argument("--no-figure", action="store_true")
    args = parser.parse_args()
    print("rank 1 three times slower (--slow 3); medians of 3 seeds (min-max):\n")
    print(slow_table())
    print("\nequal speeds (--slow 1):\n")
    print(equal_table())
    print("\nper replica, --slow 3:\n")
    print(telemetry_table())
    print("\nother rules and runs (medians of 3 seeds or repeats, min-max):\n")
    print(extra_table())
    print("\nthe default after pacing's rule changed (the median pace, a 20% dead band, the first round in lockstep):\n")
    print(pacing_table())
    if not args.no_figure:
        print(f"\nwrote {args.out.parent / draw(args.out)}")


if __name__ == "__main__":
    main()
