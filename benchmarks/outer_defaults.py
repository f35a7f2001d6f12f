"""The outer optimizer's grid behind ``mode="local"``'s defaults, from the runs that measured it
(no training here): held-out loss at equal inner steps for each outer lr x momentum, blocking
(``sync_delay=0``) beside the estimate rule with a whole round in flight (``overlap="estimate"``,
``sync_delay=sync_every``).

    python benchmarks/outer_defaults.py       # prints the tables of docs/loops.md, "Local steps that never wait"

It also prints the equal-time runs of that section when their files are there
(``slow_links-20mbit.json``, ``local_default-500mbit.json``: time_to_loss.py with three seeds;
``two_nodes-estimate-RATE[-more].json``: two_nodes.py; the commands are in the files and in
docs/loops.md).

Reads ``benchmarks/results/equal_steps-grid-*.json`` (the rule as it is) and
``equal_steps-norecovery-*.json`` (the estimate rule before its recovery term; their blocking
runs count for both), each made by one command of this form (2
ranks, the time-to-loss GPT, 240 inner steps, the library's 4-bit rounds; no root needed)::

    python benchmarks/time_to_loss.py --links unlimited --steps 240 --budget 900 --max-quiet-wait 0 \\
        --seeds 1337 --methods local-h8-d0-olr0.5-mom0.3 local-h8-d8-estimate-olr0.5-mom0.3 ... \\
        --out benchmarks/results/equal_steps-grid-h8-seed1337.json --no-report

(the exact command of each file is in its ``command`` field). Method names:
``local-hH-dD[-estimate]-olrLR-momMU[-hb]`` (benchmarks/common.py, ``LocalSpec``).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import acco
import common
from slow_links_figure import LABELS

__all__ = ["grid", "tables"]


def grid(paths: list[Path], blocking_only: list[Path] = ()) -> dict[tuple[int, int, bool], dict[tuple[float, float], dict[str, float]]]:
    """Per (H, seed, Nesterov): per (outer lr, momentum): {"blocking": loss, "estimate": loss,
    "estimate, delay D": loss for other delays}; from ``blocking_only`` the blocking runs alone
    (runs of another version of the estimate rule: blocking does not depend on it)."""
    out: dict[tuple[int, int, bool], dict[tuple[float, float], dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for path in [*paths, *blocking_only]:
        data = json.loads(path.read_text())
        for run in data["runs"]:
            for name, result in run["methods"].items():
                spec = common.LocalSpec.parse(name)
                if spec is None or "final_loss" not in result:
                    continue
                if spec.sync_delay is None and spec.overlap is None and spec.outer_lr is None and spec.outer_momentum is None:
                    if path in blocking_only:
                        continue
                    outer = acco.default_outer(spec.sync_every).keywords  # the library's defaults: their cell
                    spec = dataclasses.replace(spec, outer_lr=outer["lr"], outer_momentum=outer["momentum"],
                                               sync_delay="library default")
                if spec.outer_lr is None or spec.outer_momentum is None:
                    continue
                if spec.sync_delay == "library default":
                    rule = "library defaults (estimate, auto)"
                elif spec.sync_delay == 0:
                    rule = "blocking"
                elif path in blocking_only:
                    continue
                elif spec.overlap == "estimate" and spec.sync_delay == spec.sync_every:
                    rule = "estimate"
                else:
                    rule = f"{spec.overlap or 'default'}, delay {spec.sync_delay}"
                out[(spec.sync_every, run["seed"], spec.nesterov)][(spec.outer_lr, spec.outer_momentum)][rule] = \
                    result["final_loss"]
    return out


def tables(paths: list[Path], blocking_only: list[Path] = ()) -> str:
    """One table per (H, seed, momentum kind): blocking / estimate (gap) per cell, the best of each bold."""
    parts = []
    for (h, seed, nesterov), cells in sorted(grid(paths, blocking_only).items()):
        lrs = sorted({lr for lr, _ in cells})
        moms = sorted({mu for _, mu in cells})
        best = {rule: min((c[rule], key) for key, c in cells.items() if rule in c)
                for rule in ("blocking", "estimate") if any(rule in c for c in cells.values())}
        rows = []
        for lr in lrs:
            row = [f"{lr:g}"]
            for mu in moms:
                cell = cells.get((lr, mu), {})
                text = []
                for rule in ("blocking", "estimate"):
                    if rule in cell:
                        value = f"{cell[rule]:.4f}"
                        text.append(f"**{value}**" if best[rule][1] == (lr, mu) else value)
                if "blocking" in cell and "estimate" in cell:
                    text.append(f"({100 * (cell['estimate'] / cell['blocking'] - 1):+.2f}%)")
                others = [f"{rule}: {loss:.4f}" for rule, loss in cell.items() if rule not in ("blocking", "estimate")]
                row.append(" / ".join(text[:2]) + (f" {text[2]}" if len(text) > 2 else "") +
                           ("; " + "; ".join(others) if others else ""))
            rows.append(row)
        kind = "Nesterov" if nesterov else "heavy ball"
        summary = ""
        if len(best) == 2:
            (b, b_at), (e, e_at) = best["blocking"], best["estimate"]
            summary = (f"\n\nBest blocking {b:.4f} at {b_at}; best estimate {e:.4f} at {e_at} "
                       f"({100 * (e / b - 1):+.2f}%).")
        parts.append(f"H = {h}, seed {seed}, {kind} momentum; blocking / estimate with a whole round in flight "
                     f"(gap), held-out loss after 240 inner steps; rows: outer lr, columns: momentum\n\n"
                     + common.md_table(["lr \\ momentum", *(f"{mu:g}" for mu in moms)], rows) + summary)
    return "\n\n".join(parts)


def flat_table(path: Path) -> str:
    """A time_to_loss.py run with several seeds: per method, the median (min-max) held-out loss
    and the median inner steps (updates) and MB per outer round."""
    data = json.loads(path.read_text())
    runs = data["runs"]
    rows = []
    for name in runs[0]["methods"]:
        results = [r["methods"][name] for r in runs if "final_loss" in r["methods"].get(name, {})]
        losses = [m["final_loss"] for m in results]
        steps = statistics.median(m.get("inner_steps", m["updates"]) for m in results)
        per_sync = [m["lo_bytes_per_sync"] / 1e6 for m in results if m.get("lo_bytes_per_sync")]
        rows.append([LABELS.get(name, common.label(name)), f"{statistics.median(losses):.4f} ({min(losses):.4f}-{max(losses):.4f})",
                     " / ".join(f"{x:.4f}" for x in losses), f"{steps:g}",
                     f"{statistics.median(per_sync):.3f}" if per_sync else "-"])
    rate = common.rate_text(next(iter(data["rates"].values())))
    seeds = ", ".join(str(r["seed"]) for r in runs)
    return (f"`{path.name}`: 2 ranks behind {rate}, {data['config']['budget_s']:g} s each, seeds {seeds}\n\n"
            + common.md_table(["method", "held-out loss, median (min-max)", "per seed", "inner steps (median)",
                               "MB per outer round"], rows))


def two_nodes_table(*paths: Path) -> str:
    """two_nodes.py runs (repeats): per method, the median held-out loss and inner steps per
    second, and that rate against compute-only's (within the same file's repeats)."""
    rows, rate = [], None
    for path in paths:
        nodes = json.loads(path.read_text())["nodes"]
        rate = nodes["rate"]
        for name in nodes["repeats"][0]:
            runs = [r[name] for r in nodes["repeats"] if "final_loss" in r.get(name, {})]
            losses = [r["final_loss"] for r in runs]
            speed = statistics.median(r.get("inner_steps_per_s") or r["updates"] / r["end_s"] for r in runs)
            per_update = statistics.median(r["link_bytes_per_update"] for r in runs) / 1e6
            rows.append([name, f"{statistics.median(losses):.4f}", " / ".join(f"{x:.4f}" for x in losses),
                         f"{speed:.3f}", f"{per_update:.3f}", path.name])
    only = [float(r[3]) for r in rows if r[0] == "fsdp-local-compute-only"]
    for row in rows:
        row.insert(4, f"{float(row[3]) / only[0]:.2f}" if only and row[0].startswith("fsdp-local") else "-")
    return (f"Two emulated nodes behind {common.rate_text(rate)} (FSDP2 inside each, 4 ranks)\n\n"
            + common.md_table(["method", "held-out loss (median)", "per repeat", "updates (inner steps) / s",
                               "x compute-only", "MB across per update", "results"], rows))


def main() -> None:
    final, earlier = (sorted(common.RESULTS_DIR.glob(f"equal_steps-{kind}-*.json")) for kind in ("grid", "norecovery"))
    print("## The estimate rule as it is\n\n" + tables(final, earlier))
    print("\n\n## Without the recovery term (the rule as first built: each start from the replica's own "
          "pseudo-gradient alone)\n\n" + tables(earlier))
    results = common.RESULTS_DIR
    for name in ("slow_links-20mbit.json", "local_default-500mbit.json"):
        if (results / name).exists():
            print("\n\n## Equal time\n\n" + flat_table(results / name))
    for rate in ("20mbit", "60mbit"):
        files = [results / f"two_nodes-estimate-{rate}{more}.json" for more in ("", "-more")]
        if all(f.exists() for f in files):
            print("\n\n## Two nodes\n\n" + two_nodes_table(*files))


if __name__ == "__main__":
    main()
