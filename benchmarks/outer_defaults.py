"""The outer optimizer's grid behind ``mode="local"``'s defaults, from the runs that measured it
(no training here): held-out loss at equal inner steps for each outer lr x momentum, blocking
(``sync_delay=0``) beside the estimate rule with a whole round in flight (``overlap="estimate"``,
``sync_delay=sync_every``).

    python benchmarks/outer_defaults.py       # prints the tables of docs/loops.md, "Local steps that never wait"

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

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import common

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
                if spec is None or spec.outer_lr is None or spec.outer_momentum is None or "final_loss" not in result:
                    continue
                if spec.sync_delay == 0:
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


def main() -> None:
    final, earlier = (sorted(common.RESULTS_DIR.glob(f"equal_steps-{kind}-*.json")) for kind in ("grid", "norecovery"))
    print("## The estimate rule as it is\n\n" + tables(final, earlier))
    print("\n\n## Without the recovery term (the rule as first built: each start from the replica's own "
          "pseudo-gradient alone)\n\n" + tables(earlier))


if __name__ == "__main__":
    main()
