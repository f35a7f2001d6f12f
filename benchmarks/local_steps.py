"""The local-steps tables, from the results of the runs that measured them (no training here).

    python benchmarks/local_steps.py          # prints the tables of docs/loops.md, "Slow links: local steps"

Reads benchmarks/results/:

- ``time_to_loss-50mbit.json``: ``time_to_loss.py --links comm~compute --rates 50mbit --methods ddp-zero1
  acco-aww local-h16 local-h16-d0 diloco-h16 sdiloco-h16-f2-d1 --budget 60 --seeds 1337``: each
  method's held-out loss against time; the bar's two times (to DDP + ZeRO-1's 60 s loss, to acco's
  ``ready()`` loop's 60 s loss) are where a method's curve first reaches them;
- ``time_to_loss-50mbit-grid-*.json``: the 20 s grids (delay and rule; H) behind the defaults;
- ``two_nodes-local.json``: ``two_nodes.py --skip-memory --rate 60mbit --methods hsdp fsdp-acco-aww
  fsdp-local fsdp-local-blocking fsdp-local-compute-only``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import common
from time_to_loss import first_crossing

RESULTS = common.RESULTS_DIR


def _methods(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each method's result on the first run (one seed, one rate)."""
    return data["runs"][0]["methods"]


def flat_table(path: Path = RESULTS / "time_to_loss-50mbit.json") -> str:
    data = json.loads(path.read_text())
    methods = _methods(data)
    budget = data["config"]["budget_s"]
    zero1, ready = methods["ddp-zero1"]["final_loss"], methods["acco-aww"]["final_loss"]
    rows = [f"2 ranks, {data['rates']['comm~compute']} (the rate-limited loopback), {budget:.0f} s of training "
            f"each, seed {data['config']['seeds'][0]}; DDP + ZeRO-1 ends at {zero1:.4f}, acco's `ready()` loop at "
            f"{ready:.4f}.", "",
            "| method | held-out loss at the end | time to ZeRO-1's final loss (share of the budget) | time to the "
            "`ready()` loop's final loss | inner steps (updates) | outer rounds | MB on the loopback |",
            "|---|---|---|---|---|---|---|"]
    for name, m in methods.items():
        if "points" not in m:
            continue
        to_zero1 = first_crossing(m["points"], zero1)
        to_ready = first_crossing(m["points"], ready)
        steps = m.get("inner_steps", m["updates"])
        mb = "-" if m.get("lo_bytes") is None else f"{m['lo_bytes'] / 1e6:.0f}"
        rows.append(f"| {common.label(name)} | {m['final_loss']:.4f} | "
                    f"{'-' if to_zero1 is None else f'{to_zero1:.1f} s ({to_zero1 / budget:.2f})'} | "
                    f"{'-' if to_ready is None else f'{to_ready:.1f} s'} | {steps} | {m.get('outer_steps', '-')} | "
                    f"{mb} |")
    return "\n".join(rows)


def grid_table() -> str:
    rows = ["| grid run | seed | method | held-out loss after 20 s |", "|---|---|---|---|"]
    for path in sorted(RESULTS.glob("time_to_loss-50mbit-grid-*.json")):
        data = json.loads(path.read_text())
        for run in data["runs"]:
            for name, m in run["methods"].items():
                if "final_loss" in m:
                    # The grids ran while "keep" was the default rule: a name without a rule is "keep".
                    explicit = name if name.endswith(("-discard", "-keep", "-d0")) else name + "-keep"
                    rows.append(f"| {path.stem.removeprefix('time_to_loss-50mbit-grid-')} | {run['seed']} | "
                                f"{common.label(explicit)} | {m['final_loss']:.4f} |")
    return "\n".join(rows)


def nodes_table(path: Path = RESULTS / "two_nodes-local.json") -> str:
    if not path.exists():
        return "(two_nodes-local.json not measured)"
    data = json.loads(path.read_text())
    repeats = data["nodes"]["repeats"]
    names = list(repeats[0])
    compute = statistics.median(r["fsdp-local-compute-only"]["inner_steps_per_s"] for r in repeats
                                if "fsdp-local-compute-only" in r) if "fsdp-local-compute-only" in names else None
    rows = [f"2 nodes x 2 ranks, {data['nodes']['rate']} between the nodes, {data['config']['budget_s']:.0f} s each "
            f"(medians of {len(repeats)} repeat(s)).", "",
            "| method | held-out loss after equal time | updates (inner steps) / s | vs compute only | outer rounds | "
            "MB across the link |", "|---|---|---|---|---|---|"]
    for name in names:
        runs = [r[name] for r in repeats if "final_loss" in r.get(name, {})]
        if not runs:
            continue
        rate = statistics.median(r["updates"] / r["end_s"] for r in runs)
        share = f"{rate / compute:.2f}" if compute and runs[0].get("outer_rounds") is not None else "-"
        rows.append(f"| {name} | {statistics.median(r['final_loss'] for r in runs):.4f} | {rate:.2f} | {share} | "
                    f"{runs[0].get('outer_rounds', '-')} | {statistics.median(r['link_bytes'] for r in runs) / 1e6:.0f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(flat_table(), "", grid_table(), "", nodes_table(), sep="\n")
