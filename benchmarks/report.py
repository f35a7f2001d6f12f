"""Tables and plots from the benchmarks' JSON, into benchmarks/README.md and results/*.png.

    python benchmarks/report.py

Reads ``results/{throughput,throughput-*,convergence,memory,profile-2ranks,profile-4ranks,
time_to_loss}.json`` (whichever exist),
writes ``results/*.png`` and replaces the blocks between ``<!-- BEGIN GENERATED: name -->``
and ``<!-- END GENERATED: name -->`` in the README. Nothing in those blocks is typed by hand.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
README = BENCH_DIR / "README.md"
REPO_README = BENCH_DIR.parent / "README.md"

ORDER = ("roofline", "ddp-zero1", "ddp-adamw", "acco-sync", "acco-dpu", "acco", "acco-aww")
LABELS = {
    "roofline": "compute only (roofline)",
    "ddp-zero1": "DDP + ZeRO-1 (ZeroRedundancyOptimizer)",
    "ddp-adamw": "DDP + AdamW",
    "acco-sync": "acco `sync`",
    "acco-dpu": "acco `dpu`",
    "acco": "acco `acco`",
    "acco-aww": "acco `acco`, accumulate while communicating",
}
RATE_ORDER = ("unlimited", "comm~compute", "comm~3x")
MiB = 2**20


def load(name: str) -> Any | None:
    path = RESULTS_DIR / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def load_family(base: str) -> dict[str, Any]:
    """``base.json`` and every ``base-NAME.json`` that exist, by file stem, ``base`` first."""
    stems = [base] + sorted(p.stem for p in RESULTS_DIR.glob(f"{base}-*.json"))
    return {stem: data for stem, data in ((stem, load(stem)) for stem in stems) if data}


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def rate_text(rate: str) -> str:
    if rate.endswith("bit") and rate[:-3].isdigit():
        return f"{int(rate[:-3]) / 1e6:.0f} Mbit/s"
    return rate


# ----------------------------------------------------------------------------- throughput


def throughput_runs(data: dict) -> dict[int, dict[str, dict]]:
    runs: dict[int, dict[str, dict]] = {}
    for run in data["runs"]:
        runs.setdefault(run["ranks"], {})[run["label"]] = run
    return runs


def throughput_section(data: dict) -> str:
    cfg = data["config"]
    out = [
        f"GPT of {cfg['parameters'] / 1e6:.2f}M parameters ({cfg['n_layer']} layers, width {cfg['n_embd']}, "
        f"seq {cfg['seq_len']}, micro-batch {cfg['batch_size']}), {cfg['micro_batches_per_update']} micro-batches "
        f"per rank per update, {cfg['timed_updates']} timed updates after {cfg['warmup_updates']} of warm-up, "
        f"median of {cfg['repeats']} repeats; one torch thread per rank on {data['machine']['cpus']} cores "
        f"(torch {data['machine']['torch']}). Each cell: samples/s, then the ratio to DDP + ZeRO-1 and to the "
        f"roofline measured side by side in the same repeat (medians).",
        "",
    ]
    for ranks, by_label in sorted(throughput_runs(data).items()):
        labels = [label for label in RATE_ORDER if label in by_label]
        header = ["method"] + [f"{label} ({rate_text(by_label[label]['rate'])})" for label in labels]
        rows = []
        for name in ORDER:
            if not any(name in by_label[label]["methods"] for label in labels):
                continue
            row = [LABELS[name]]
            for label in labels:
                m = by_label[label]["methods"].get(name)
                if m is None:
                    row.append("")
                    continue
                row.append(f"{m['median_samples_per_s']:.1f} (x{m.get('median_vs_zero1', math.nan):.2f} ZeRO-1, "
                           f"x{m.get('median_vs_roofline', math.nan):.2f} roofline)")
            rows.append(row)
        note = " (oversubscribed: 4 ranks on 2 cores)" if ranks > (data["machine"]["cpus"] or 1) else ""
        out += [f"**{ranks} ranks{note}**", "", table(header, rows), ""]
    return "\n".join(out)


def calibration_section(data: dict) -> str:
    rows = []
    for ranks, cal in sorted(data["calibration"].items(), key=lambda kv: int(kv[0])):
        if not cal:
            continue
        base = cal["unlimited"]
        for label, target in cal["targets"].items():
            rows.append([
                ranks,
                label,
                f"{base['compute_s_per_round'] * 1000:.0f} ms",
                f"{base['lo_bytes_per_round'] / 1e6:.1f} MB",
                f"{base['comm_s_per_round'] * 1000:.0f} ms",
                f"{target['rate']} ({rate_text(target['rate'])})",
                f"{target['comm_s_per_round'] * 1000:.0f} ms",
                f"{target['ratio']:.2f}",
            ])
    header = ["ranks", "target", "compute per acco round", "loopback bytes per round", "comm per round, unlimited",
              "tbf rate", "comm per round at that rate", "comm / compute"]
    return table(header, rows)


def lane_section(data: dict) -> str:
    """What the lanes did in the timed windows (rank 0, medians over repeats)."""
    rows = []
    for ranks, by_label in sorted(throughput_runs(data).items()):
        for label in RATE_ORDER:
            run = by_label.get(label)
            if run is None:
                continue
            roof = run["methods"].get("roofline")
            for name in ("ddp-zero1", "acco-sync", "acco-dpu", "acco", "acco-aww"):
                m = run["methods"].get(name)
                if m is None:
                    continue
                lane = m.get("lane", {})
                phases = lane.get("phase_s", {})
                rows.append([
                    str(ranks), label, LABELS[name],
                    f"{m['compute_s_per_micro_batch'] * 1000:.0f}"
                    + (f" ({roof['compute_s_per_micro_batch'] * 1000:.0f})" if roof else ""),
                    f"{m['micro_batches_per_update']:.1f}",
                    f"{m['boundary_s_per_round'] * 1000:.0f}",
                    f"{lane['lane_s'] * 1000:.0f}" if lane else "",
                    " / ".join(f"{phases.get(p, 0) * 1000:.0f}" for p in ("weights", "reduce-scatter", "update",
                                                                         "all-gather")) if phases else "",
                    f"{lane['hidden_share']:.0%}" if lane else "",
                    f"{m['lo_bytes_per_update'] / 1e6:.1f}" if m.get("lo_bytes_per_update") else "",
                    f"{max(m['foreign_cpu_share']):.0%}",
                ])
    header = ["ranks", "rate", "method", "compute ms per micro-batch (roofline)", "micro-batches per update",
              "step() ms per round", "lane ms per round", "weights / reduce-scatter / update / all-gather ms",
              "comm hidden", "loopback MB per update", "other load (max)"]
    return table(header, rows)


def plot_throughput(data: dict, stem: str = "throughput") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = throughput_runs(data)
    fig, axes = plt.subplots(1, len(runs), figsize=(7 * len(runs), 4.5), squeeze=False)
    for ax, (ranks, by_label) in zip(axes[0], sorted(runs.items())):
        labels = [label for label in RATE_ORDER if label in by_label]
        names = [n for n in ORDER if any(n in by_label[label]["methods"] for label in labels)]
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            values = [by_label[label]["methods"].get(name, {}).get("median_vs_roofline", 0) for label in labels]
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(labels))]
            ax.bar(xs, values, width, label=LABELS[name].replace("`", ""))
        ax.axhline(0.95, color="k", lw=0.8, ls="--")
        ax.axhline(0.9, color="k", lw=0.8, ls=":")
        ax.set_xticks(range(len(labels)), [f"{label}\n{rate_text(by_label[label]['rate'])}" for label in labels])
        ax.set_ylabel("samples/s / roofline")
        ax.set_ylim(0, 1.1)
        ax.set_title(f"{ranks} ranks" + (" (oversubscribed)" if ranks > data["machine"]["cpus"] else ""))
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    path = RESULTS_DIR / f"{stem}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


# ---------------------------------------------------------------------------- convergence


CONVERGENCE_LABELS = {"acco-sync": "acco `sync` (ZeRO-1 in acco)", "acco": "acco `acco`", "acco-dpu": "acco `dpu`",
                      "acco-bf16": "acco `acco`, bf16 estimate round", "acco-fp8": "acco `acco`, float8 estimate round",
                      "ddp-zero1": "DDP + ZeRO-1 (ZeroRedundancyOptimizer)"}


def convergence_section(data: dict) -> str:
    cfg = data["config"]
    rows = []
    for name, run in data["methods"].items():
        diff = run.get("update_difference")
        rows.append([
            CONVERGENCE_LABELS.get(name, name),
            f"{run['final_eval_loss']:.4f}",
            f"{run.get('gap_vs_sync', math.nan):+.2%}",
            f"{diff['mean']:.3f} ({len(diff['ratios'])} updates)" if diff and diff["mean"] is not None else "",
            f"{statistics.fmean(run['train_loss_per_update'][-20:]):.4f}",
            minutes(run["runtime_s"]),
        ])
    intro = (f"{cfg['ranks']} ranks, GPT of {data['methods'][next(iter(data['methods']))]['parameters'] / 1e6:.2f}M "
             f"parameters ({cfg['n_layer']} layers, width {cfg['n_embd']}, seq {cfg['seq_len']}, micro-batch "
             f"{cfg['batch_size']}), {cfg['updates']} updates x {cfg['micro_batches_per_update']} micro-batches per "
             f"rank = {cfg['samples']:,} samples for every method; lr {cfg['lr']}, clipping {cfg['max_grad_norm']}; "
             f"eval on {cfg['eval_batches']} fixed held-out batches.")
    header = ["method", "final eval loss", "vs sync", "update difference (mean)", "train loss, last 20 updates",
              "runtime"]
    return intro + "\n\n" + table(header, rows)


def convergence_runs_section(runs: dict[str, dict]) -> str:
    """One row per convergence run (the main one and ``convergence-*.json``): how acco's
    and dpu's gaps to sync move with the seed and the settings."""
    rows = []
    for name, data in runs.items():
        cfg, methods = data["config"], data["methods"]
        if "acco-sync" not in methods:
            continue
        rows.append([
            f"results/{name}.json", str(cfg["seed"]), str(cfg["lr"]), str(cfg["updates"]),
            f"{methods['acco-sync']['final_eval_loss']:.4f}",
            f"{methods['acco']['final_eval_loss']:.4f} ({methods['acco']['gap_vs_sync']:+.2%})" if "acco" in methods else "",
            f"{methods['acco-dpu']['final_eval_loss']:.4f} ({methods['acco-dpu']['gap_vs_sync']:+.2%})"
            if "acco-dpu" in methods else "",
        ])
    header = ["run", "seed", "peak lr", "updates", "sync eval loss", "acco (vs sync)", "dpu (vs sync)"]
    return table(header, rows)


def plot_convergence(data: dict) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = data["config"]
    per_update = cfg["micro_batches_per_update"] * cfg["ranks"] * cfg["batch_size"]
    fig, (train_ax, eval_ax, diff_ax) = plt.subplots(1, 3, figsize=(17, 4.5))
    for name, run in data["methods"].items():
        label = CONVERGENCE_LABELS.get(name, name).replace("`", "")
        losses = run["train_loss_per_update"]
        window = 10
        smooth = [statistics.fmean(losses[max(0, i - window + 1) : i + 1]) for i in range(len(losses))]
        style = "--" if name == "ddp-zero1" else "-"
        train_ax.plot([(i + 1) * per_update for i in range(len(losses))], smooth, style, label=label)
        eval_ax.plot([e["samples"] for e in run["eval"]], [e["loss"] for e in run["eval"]], style, marker=".",
                     label=label)
        diff = run.get("update_difference")
        if diff and diff["ratios"]:
            diff_ax.plot(diff["updates"], diff["ratios"], marker=".", label=label)
    train_ax.set(xlabel="samples", ylabel="train loss (10-update mean)", title="training loss")
    eval_ax.set(xlabel="samples", ylabel="held-out loss", title="eval loss")
    diff_ax.set(xlabel="update", ylabel="||u - u_sync|| / (||u|| + ||u_sync||)",
                title="update vs the sync update from the same state")
    for ax in (train_ax, eval_ax):
        ax.set_ylim(top=min(ax.get_ylim()[1], 3.5))
    for ax in (train_ax, eval_ax, diff_ax):
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = RESULTS_DIR / "convergence.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


# --------------------------------------------------------------------------------- memory

MEMORY_LABELS = {"ddp-zero1": "DDP + ZeRO-1 (bucket view)", "ddp-adamw": "DDP + AdamW", "acco-sync": "acco `sync`",
                 "acco-dpu": "acco `dpu`", "acco": "acco `acco`"}
MEMORY_KINDS = ["parameters", "gradients", "gradient buffers", "communication buffers", "master shard",
                "optimizer state", "estimate copy", "other"]
TARGET_SLACK = 1.1  # model sizes (in the reduce dtype) above ZeRO-1


def memory_worst(run: dict) -> dict:
    """The rank with the most tensor bytes at the end of a backward (shards differ a little)."""
    return max(run["per_rank"], key=lambda r: r["end_of_backward"]["total"])


def memory_targets(data: dict) -> list[dict]:
    """Per run: acco's bytes above DDP + ZeRO-1 in model sizes (reduce dtype), and the target."""
    zero = {(r["ranks"], r["dtype"]): r for r in data["runs"] if r["method"] == "ddp-zero1"}
    out = []
    for run in data["runs"]:
        zero_run = zero.get((run["ranks"], run["dtype"]))
        if zero_run is None or not run["method"].startswith("acco"):
            continue
        base, worst = memory_worst(zero_run), memory_worst(run)
        model = worst["parameters"] * worst["reduce_itemsize"]
        target = TARGET_SLACK
        if run["method"] == "acco":  # plus one copy of this rank's master shard and optimizer state
            copy = 4 * worst["state_elements_per_tensor"] + worst["end_of_backward"]["bytes"]["optimizer state"]
            target += copy / model
        rss_base = max(r["peak_rss_added_bytes"] for r in zero_run["per_rank"])
        # acco keeps an fp32 master shard and fp32 optimizer state whatever the parameters'
        # dtype; ZeRO-1 steps bf16 parameters with bf16 state. What that precision costs:
        kinds, zero_kinds = worst["end_of_backward"]["bytes"], base["end_of_backward"]["bytes"]
        precision = kinds["master shard"] + kinds["optimizer state"] - zero_kinds["optimizer state"]
        out.append({
            "run": run, "worst": worst, "model": model, "target": target, "precision": precision / model,
            "tensors": (worst["end_of_backward"]["total"] - base["end_of_backward"]["total"]) / model,
            "rss": (max(r["peak_rss_added_bytes"] for r in run["per_rank"]) - rss_base) / model,
        })
    return out


def memory_section(data: dict, baseline: dict | None = None) -> str:
    out = []
    cell = lambda v: f"{v / MiB:.1f}"  # noqa: E731
    targets = {(t["run"]["ranks"], t["run"]["dtype"], t["run"]["method"]): t for t in memory_targets(data)}
    groups: dict[tuple[int, str], list] = {}
    for run in data["runs"]:
        groups.setdefault((run["ranks"], run["dtype"]), []).append(run)
    for (ranks, dtype), runs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] != "fp32")):
        rows = []
        for run in runs:
            worst = memory_worst(run)
            b = worst["end_of_backward"]["bytes"]
            model = worst["parameters"] * worst["reduce_itemsize"]
            rss = max(r["peak_rss_added_bytes"] for r in run["per_rank"])
            t = targets.get((ranks, dtype, run["method"]))
            rows.append([
                MEMORY_LABELS[run["method"]], *[cell(b[k]) for k in MEMORY_KINDS],
                f"**{cell(worst['end_of_backward']['total'])}** ({worst['end_of_backward']['total'] / model:.2f})",
                cell(worst["at_rest"]["total"]),
                f"{rss / MiB:.0f} ({rss / model:.2f})",
                "" if t is None else f"{t['tensors']:+.2f} / {t['rss']:+.2f} (<= {t['target']:.2f}: "
                + ("met" if max(t["tensors"], t["rss"]) <= t["target"] else "**not met**") + ")"
                + ("" if dtype == "fp32" else
                   f"; of which fp32 master/state over ZeRO-1's bf16 state {t['precision']:+.2f}, the rest "
                   f"{t['tensors'] - t['precision']:+.2f}: " + ("met" if t["tensors"] - t["precision"] <= t["target"]
                                                                 else "**not met**")),
            ])
        note = " (oversubscribed: 4 ranks on 2 cores)" if ranks > 2 else ""
        out += [f"**{ranks} ranks, {dtype} parameters{note}**: MiB per rank (the largest rank); in brackets, model "
                "sizes (P x bytes of the reduce dtype)", "",
                table(["method", *MEMORY_KINDS, "total, end of a backward", "total at rest",
                       "peak RSS added", "above ZeRO-1: tensors / RSS, model sizes (target)"], rows), ""]
    if baseline:
        rows = []
        before = {(r["ranks"], r["dtype"], r["method"]): r for r in baseline["runs"]}
        for run in data["runs"]:
            old = before.get((run["ranks"], run["dtype"], run["method"]))
            if old is None:
                continue
            new_w, old_w = memory_worst(run), memory_worst(old)
            rows.append([f"{run['ranks']}", run["dtype"], MEMORY_LABELS[run["method"]],
                         f"{cell(old_w['end_of_backward']['total'])} -> {cell(new_w['end_of_backward']['total'])}",
                         f"{max(r['peak_rss_added_bytes'] for r in old['per_rank']) / MiB:.0f} -> "
                         f"{max(r['peak_rss_added_bytes'] for r in run['per_rank']) / MiB:.0f}"])
        out += ["Before (commit 999678c, `results/memory-baseline.json`) -> after, MiB per rank:", "",
                table(["ranks", "params", "method", "tensors, end of a backward", "peak RSS added"], rows), ""]
    return "\n".join(out)


def memory_summary(data: dict, baseline: dict | None) -> str:
    """The repository README's figures: tensors per rank before and after, against ZeRO-1."""
    before = {(r["ranks"], r["dtype"], r["method"]): r for r in (baseline or {}).get("runs", [])}
    targets = {(t["run"]["ranks"], t["run"]["dtype"], t["run"]["method"]): t for t in memory_targets(data)}
    rows = []
    for run in data["runs"]:
        key = (run["ranks"], run["dtype"], run["method"])
        worst = memory_worst(run)
        model = worst["parameters"] * worst["reduce_itemsize"]
        old = before.get(key)
        t = targets.get(key)
        rows.append([
            str(run["ranks"]), run["dtype"], MEMORY_LABELS[run["method"]],
            "" if old is None else f"{memory_worst(old)['end_of_backward']['total'] / model:.2f}",
            f"{worst['end_of_backward']['total'] / model:.2f}",
            f"{max(r['peak_rss_added_bytes'] for r in run['per_rank']) / model:.2f}",
            "" if t is None else f"{t['tensors']:+.2f} (target <= {t['target']:.2f}: "
            + ("met" if max(t["tensors"], t["rss"]) <= t["target"] else "not met") + ")",
        ])
    return ("In model sizes (P x bytes of the reduce dtype), per rank, the largest rank; P = "
            f"{memory_worst(data['runs'][0])['parameters'] / 1e6:.1f}M; before = commit 999678c:\n\n"
            + table(["ranks", "params", "method", "tensors before", "tensors after (end of a backward)",
                     "peak RSS added", "above ZeRO-1"], rows))


# -------------------------------------------------------------------------------- profile


def profile_section(data: dict) -> str:
    rows = []
    for profile in data["profiles"]:
        for name, p in profile["methods"].items():
            cpu = p["thread_cpu_s_per_round"]
            phases = p["lane_phases"]
            rows.append([
                profile["label"], LABELS.get(name, name),
                f"{p['round_wall_s'] * 1000:.0f}", f"{p['micro_batches_per_round']:.1f}",
                f"{p['micro_batch_wall_s'] * 1000:.0f} / {p['micro_batch_cpu_s'] * 1000:.0f}",
                (f"{p['thread_runqueue_wait_s_per_round'].get('compute lane (main thread)', 0) * 1000:.0f}"
                 if "thread_runqueue_wait_s_per_round" in p else ""),
                f"{p['step_wall_s'] * 1000:.0f}",
                f"{cpu.get('acco comm lane (thread)', 0) * 1000:.0f}",
                f"{cpu.get('gloo I/O threads', 0) * 1000:.0f}",
                ", ".join(f"{k} {v['wall_s'] * 1000:.0f}/{v['cpu_s'] * 1000:.0f}" for k, v in phases.items()),
            ])
    header = ["rate", "method", "round ms", "micro-batches per round", "micro-batch wall / CPU ms",
              "compute lane waiting for a core, ms", "step() ms",
              "comm lane CPU ms", "gloo threads CPU ms", "lane phases wall/CPU ms"]
    text = (f"{data['ranks']} ranks, {data['micro_batches_per_update']} micro-batches per update, rank 0, "
            "per round:\n\n" + table(header, rows))
    costs = next((p["piece_costs_ms"] for p in data["profiles"] if p.get("piece_costs_ms")), None)
    if costs:
        text += ("\n\nCPU cost of the pieces of a round, each timed alone on one thread (rank 0, the model's buffer "
                 "sizes):\n\n" + table(["piece", "CPU ms"], [[k, f"{v:.1f}"] for k, v in costs.items()]))
    return text


# --------------------------------------------------------------------------- time to loss

TTL_ORDER = ("ddp-zero1", "ddp-adamw", "acco-sync", "acco-dpu", "acco", "acco-bf16", "acco-fp8", "acco-aww",
             "acco-aww-bf16", "acco-aww-fp8", "diloco-h10", "diloco-h50")
TTL_LABELS = {
    "ddp-zero1": "DDP + ZeRO-1 (ZeroRedundancyOptimizer)",
    "ddp-adamw": "DDP + AdamW",
    "acco-sync": "acco `sync`",
    "acco-dpu": "acco `dpu`",
    "acco": "acco `acco`, fixed loop",
    "acco-bf16": "acco `acco`, fixed loop, bf16 estimate",
    "acco-fp8": "acco `acco`, fixed loop, fp8 (e4m3) estimate",
    "acco-aww": "acco `acco`, `ready()` loop",
    "acco-aww-bf16": "acco `acco`, `ready()` loop, bf16 estimate",
    "acco-aww-fp8": "acco `acco`, `ready()` loop, fp8 (e4m3) estimate",
    "diloco-h10": "DiLoCo, H = 10",
    "diloco-h50": "DiLoCo, H = 50",
}
TTL_BASELINE = "ddp-zero1"
# The issue's bar: the best acco configuration reaches ZeRO-1's final loss within this share
# of the budget.
TTL_BAR = {"comm~compute": 0.6, "comm~3x": 0.4}


# Two runs of the same arithmetic (acco `sync` and ZeRO-1) differ by float reordering only:
# a loss this close to the target has reached it.
TTL_TOLERANCE = 1e-5


def first_crossing(points: list[dict], target: float, key: str = "elapsed_s") -> float | None:
    """The first ``key`` (time or updates) at which the loss curve reaches ``target`` (within
    ``TTL_TOLERANCE``): linear between the two evaluations around the crossing; None if it
    never does."""
    target += TTL_TOLERANCE
    for i, point in enumerate(points):
        if point["loss"] > target:
            continue
        if i == 0:
            return point[key]
        before = points[i - 1]
        drop = before["loss"] - point["loss"]
        share = (before["loss"] - target) / drop if drop > 0 else 1.0
        return before[key] + share * (point[key] - before[key])
    return None


def loss_at(points: list[dict], value: float, key: str = "updates") -> float | None:
    """The loss curve at ``key`` = ``value`` (linear between evaluations); None past its end."""
    for before, point in zip(points, points[1:]):
        if before[key] <= value <= point[key]:
            span = point[key] - before[key]
            share = (value - before[key]) / span if span > 0 else 1.0
            return before["loss"] + share * (point["loss"] - before["loss"])
    return None


def _median(values: list[float | None]) -> float | None:
    """Median with None (not reached, not measured) as +infinity; None if that is the answer."""
    if not values:
        return None
    finite = sorted(math.inf if v is None else v for v in values)
    middle = statistics.median(finite)
    return None if math.isinf(middle) else middle


def time_to_loss_summary(data: dict) -> dict[str, Any]:
    """Per rate and method: time to DDP + ZeRO-1's final held-out loss (fraction of the
    budget, per seed, median), and what explains it (updates/s, micro-batches per update,
    updates needed, loss at ZeRO-1's update count, bytes per update)."""
    budget = data["config"]["budget_s"]
    summary: dict[str, Any] = {}
    by_label: dict[str, list[dict]] = {}
    for run in data["runs"]:
        by_label.setdefault(run["label"], []).append(run)
    for label, runs in by_label.items():
        targets = {}
        for run in runs:
            base = run["methods"].get(TTL_BASELINE, {})
            if "points" in base:
                targets[str(run["seed"])] = {"loss": base["final_loss"], "updates": base["updates"]}
        methods: dict[str, Any] = {}
        names = [n for n in TTL_ORDER if any(n in run["methods"] for run in runs)]
        for name in names:
            done = [run for run in runs if "points" in run["methods"].get(name, {})]
            skipped = [run["methods"][name]["skipped"] for run in runs if "skipped" in run["methods"].get(name, {})]
            entry: dict[str, Any] = {}
            if skipped:
                entry["skipped"] = skipped[0]
            if not done:
                methods[name] = entry
                continue
            fractions, updates_needed, loss_at_updates = [], [], []
            for run in done:
                m, target = run["methods"][name], targets.get(str(run["seed"]))
                if target is None:
                    continue
                t = first_crossing(m["points"], target["loss"])
                fractions.append(None if t is None else t / budget)
                updates_needed.append(first_crossing(m["points"], target["loss"], key="updates"))
                loss_at_updates.append(loss_at(m["points"], target["updates"]))

            def per_seed(key: str) -> list[Any]:
                return [run["methods"][name].get(key) for run in done]

            entry.update(
                seeds=[run["seed"] for run in done],
                time_fraction=fractions,
                median_time_fraction=_median(fractions),
                reached=sum(f is not None for f in fractions),
                updates_to_target=updates_needed,
                loss_at_baseline_updates=loss_at_updates,
                final_loss=per_seed("final_loss"),
                median_final_loss=_median(per_seed("final_loss")),
                end_s=per_seed("end_s"),
            )
            for key in ("updates_per_s", "samples_per_s", "micro_batches_per_update", "lo_bytes_per_update",
                        "updates", "foreign_cpu_share"):
                entry[key] = _median([v for v in per_seed(key) if v is not None])
            first = done[0]["methods"][name]
            for key in ("implementation", "sync_every", "lo_bytes_per_sync"):
                if key in first:
                    entry[key] = first[key]
            methods[name] = entry
        acco = {n: e for n, e in methods.items() if n.startswith("acco") and e.get("median_time_fraction") is not None}
        best = min(acco, key=lambda n: acco[n]["median_time_fraction"]) if acco else None
        summary[label] = {"rate": runs[0]["rate"], "targets": targets, "methods": methods, "best_acco": best}
    return summary


def _fraction_cell(entry: dict) -> str:
    fractions = entry.get("time_fraction", [])
    if not fractions:
        return ""
    shown = ["not reached" if f is None else f"{f:.2f}" for f in fractions]
    if entry["median_time_fraction"] is None:
        return f"not reached ({', '.join(shown)})" if len(shown) > 1 else "not reached"
    if len(fractions) == 1:
        return f"{fractions[0]:.2f}"
    return f"**{entry['median_time_fraction']:.2f}** ({min(fractions):.2f}-{max(fractions):.2f})"


def _spread(values: list[float | None], fmt: str) -> str:
    present = [v for v in values if v is not None]
    if not present:
        return "-"
    if len(present) == 1:
        return format(present[0], fmt)
    return f"{format(statistics.median(present), fmt)} ({format(min(present), fmt)}-{format(max(present), fmt)})"


def time_to_loss_table(data: dict) -> str:
    """One table per rate: time to ZeRO-1's final loss and what explains it."""
    summary = data.get("summary") or time_to_loss_summary(data)
    out = []
    for label, s in summary.items():
        header = ["method", "time to ZeRO-1's final loss (fraction of the budget)", "final held-out loss",
                  "updates/s", "micro-batches per update", "updates to ZeRO-1's final loss",
                  "loss at ZeRO-1's update count", "samples/s", "loopback MB per update"]
        rows = []
        for name, e in s["methods"].items():
            if "final_loss" not in e:
                continue  # not run: listed under the tables, with the reason
            bytes_cell = f"{e['lo_bytes_per_update'] / 1e6:.2f}" if e.get("lo_bytes_per_update") else "-"
            if e.get("lo_bytes_per_sync"):
                bytes_cell += f" ({e['lo_bytes_per_sync'] / 1e6:.1f} per sync)"
            rows.append([
                TTL_LABELS.get(name, name),
                _fraction_cell(e),
                _spread(e["final_loss"], ".3f"),
                f"{e['updates_per_s']:.2f}" if e.get("updates_per_s") is not None else "-",
                f"{e['micro_batches_per_update']:.1f}" if e.get("micro_batches_per_update") else "-",
                _spread(e["updates_to_target"], ".0f"),
                _spread(e["loss_at_baseline_updates"], ".3f"),
                f"{e['samples_per_s']:.1f}" if e.get("samples_per_s") is not None else "-",
                bytes_cell,
            ])
        targets = ", ".join(f"seed {seed}: {t['loss']:.3f} after {t['updates']} updates"
                            for seed, t in s["targets"].items())
        out += [f"**{label} ({rate_text(s['rate'])})**: ZeRO-1's final held-out loss {targets}.", "",
                table(header, rows), ""]
    return "\n".join(out)


def time_to_loss_section(data: dict) -> str:
    cfg = data["config"]
    summary = data.get("summary") or time_to_loss_summary(data)
    diloco = cfg["diloco"]
    implementation = (f"torchft {diloco['torchft']}'s `DiLoCo`" if diloco["implementation"] == "torchft"
                      else "a plain implementation of DiLoCo (Douillard et al. 2023), not torchft")
    intro = (
        f"{cfg['ranks']} ranks, GPT of {cfg['parameters'] / 1e6:.2f}M parameters ({cfg['n_layer']} layers, width "
        f"{cfg['n_embd']}, seq {cfg['seq_len']}, micro-batch {cfg['batch_size']}), {cfg['micro_batches_per_update']} "
        f"micro-batches per rank per update, AdamW lr {cfg['lr']} ({cfg['schedule']}, {cfg['warmup_updates']} "
        f"updates of warm-up), clipping {cfg['max_grad_norm']}; **{cfg['budget_s']:.0f} s of training per method**, "
        f"held-out loss on {cfg['eval_batches']} fixed batches every {cfg['eval_every_s']:.2f} s of training and at "
        f"the end; seeds {', '.join(map(str, cfg['seeds']))}; DiLoCo: {implementation}. "
        f"Cells with a range: median (min-max) over the seeds."
    )
    calibration = data.get("calibration", {})
    if calibration.get("targets"):
        base = calibration["unlimited"]
        rates = "; ".join(f"{label}: {rate_text(t['rate'])} (communication alone {t['comm_s_per_round'] * 1000:.0f} ms "
                          f"per round, {t['ratio']:.2f} x compute)" for label, t in calibration["targets"].items())
        intro += (f" Calibration: one acco round computes in {base['compute_s_per_round'] * 1000:.0f} ms and moves "
                  f"{base['lo_bytes_per_round'] / 1e6:.1f} MB on the loopback; {rates}.")
    elif data.get("rates"):
        intro += " Rates given on the command line: " + ", ".join(
            f"{label} {rate_text(rate)}" for label, rate in data["rates"].items()) + "."
    out = [intro, "", time_to_loss_table(data)]
    bar = []
    for label, s in summary.items():
        best = s.get("best_acco")
        limit = TTL_BAR.get(label)
        if best is None or limit is None:
            continue
        value = s["methods"][best]["median_time_fraction"]
        bar.append(f"- {label}: the best acco configuration, {TTL_LABELS.get(best, best)}, reaches ZeRO-1's final "
                   f"loss in {value:.2f} of the budget (bar: <= {limit}): {'met' if value <= limit else '**not met**'}.")
    skipped = {n: e["skipped"] for s in summary.values() for n, e in s["methods"].items() if "final_loss" not in e}
    for name, reason in skipped.items():
        bar.append(f"- Not run: {TTL_LABELS.get(name, name)}: {reason}.")
    return "\n".join(out + bar)


# Colour by family, line style by what travels in the estimate round.
TTL_STYLES = {
    "ddp-zero1": ("black", "-"), "ddp-adamw": ("0.55", "-"), "acco-sync": ("C0", "-"), "acco-dpu": ("C1", "-"),
    "acco": ("C3", "-"), "acco-bf16": ("C3", "--"), "acco-fp8": ("C3", ":"),
    "acco-aww": ("C2", "-"), "acco-aww-bf16": ("C2", "--"), "acco-aww-fp8": ("C2", ":"),
    "diloco-h10": ("C4", "-"), "diloco-h50": ("C5", "-"),
}


def plot_time_to_loss(data: dict, stem: str = "time_to_loss") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = data.get("summary") or time_to_loss_summary(data)
    budget = data["config"]["budget_s"]
    labels = list(summary)
    names = [n for n in TTL_ORDER if any("final_loss" in s["methods"].get(n, {}) for s in summary.values())]
    fig = plt.figure(figsize=(7 * max(2, len(labels)), 10))
    grid = fig.add_gridspec(2, max(2, len(labels)), height_ratios=[3, 2])
    initial = max(r["initial_loss"] for r in data["runs"])
    for column, label in enumerate(labels):
        ax = fig.add_subplot(grid[0, column])
        runs = [r for r in data["runs"] if r["label"] == label]
        for name in names:
            color, style = TTL_STYLES.get(name, ("C9", "-"))
            for i, run in enumerate(runs):
                m = run["methods"].get(name, {})
                if "points" not in m:
                    continue
                ax.plot([p["elapsed_s"] for p in m["points"]], [p["loss"] for p in m["points"]], color=color, ls=style,
                        lw=2 if name == TTL_BASELINE else 1.3, alpha=1.0 if i == 0 else 0.35,
                        marker="." if i == 0 else None,
                        label=TTL_LABELS.get(name, name).replace("`", "") if i == 0 else None)
        for target in summary[label]["targets"].values():
            ax.axhline(target["loss"], color="gray", lw=0.7, ls="--")
        ax.axvline(budget, color="gray", lw=0.7)
        losses = [p["loss"] for r in runs for m in r["methods"].values() if "points" in m for p in m["points"]]
        ax.set_ylim(min(losses) - 0.05, initial + 0.05)
        ax.set(xlabel="training seconds (evaluation excluded)", ylabel="held-out loss",
               title=f"{label} ({rate_text(summary[label]['rate'])}); faint: other seeds; dashed: ZeRO-1's final loss")
        if column == 0:
            ax.legend(fontsize=7, loc="upper right")
    bars = fig.add_subplot(grid[1, :])
    width = 0.8 / max(1, len(labels))
    for j, label in enumerate(labels):
        values = [summary[label]["methods"].get(n, {}).get("median_time_fraction") for n in names]
        xs = [i + (j - (len(labels) - 1) / 2) * width for i in range(len(names))]
        bars.bar(xs, [v if v is not None else 0 for v in values], width, color=f"C{j}", label=label)
        for x, v in zip(xs, values):
            if v is None:
                bars.text(x, 0.02, "not reached", rotation=90, fontsize=7, ha="center", va="bottom")
        if label in TTL_BAR:
            bars.axhline(TTL_BAR[label], color=f"C{j}", lw=0.8, ls="--")
    bars.axhline(1.0, color="gray", lw=0.7)
    bars.set_xticks(range(len(names)), [TTL_LABELS.get(n, n).replace("`", "") for n in names], rotation=20,
                    ha="right", fontsize=8)
    bars.set(ylabel="fraction of the budget (median over seeds)",
             title="time to DDP + ZeRO-1's final held-out loss (dashed: the issue's bar at each rate)")
    bars.legend(fontsize=8)
    fig.tight_layout()
    path = RESULTS_DIR / f"{stem}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.name


# ---------------------------------------------------------------------------------- targets


def targets_section(throughputs: list[dict], convergence_runs: dict[str, dict], memory: dict | None,
                    time_to_loss: dict | None = None) -> str:
    rows = []

    def add(target: str, measured: str, met: bool | None) -> None:
        rows.append([target, measured, "n/a" if met is None else ("met" if met else "**not met**")])

    for sweep in throughputs:
        k = f"{sweep['config']['micro_batches_per_update']} micro-batches per update"
        two = throughput_runs(sweep).get(2, {})
        mid, slow, free = two.get("comm~compute"), two.get("comm~3x"), two.get("unlimited")
        if mid:
            acco = mid["methods"]["acco"]
            add(f"2 ranks, {k}, comm ~ compute: acco >= 0.95 x roofline", f"{acco['median_vs_roofline']:.3f}",
                acco["median_vs_roofline"] >= 0.95)
            add(f"2 ranks, {k}, comm ~ compute: acco >= 2 x DDP + ZeRO-1", f"{acco['median_vs_zero1']:.2f}",
                acco["median_vs_zero1"] >= 2)
            if "acco-aww" in mid["methods"]:
                aww = mid["methods"]["acco-aww"]
                add(f"(for reference) 2 ranks, {k}, comm ~ compute: accumulate-while-communicating vs roofline / "
                    "ZeRO-1", f"{aww['median_vs_roofline']:.3f} / {aww['median_vs_zero1']:.2f}", None)
        if slow and "acco-aww" in slow["methods"]:
            aww = slow["methods"]["acco-aww"]
            add(f"2 ranks, {k}, comm ~ 3x compute: accumulate-while-communicating >= 0.9 x roofline",
                f"{aww['median_vs_roofline']:.3f}", aww["median_vs_roofline"] >= 0.9)
        if free:
            acco = free["methods"]["acco"]
            add(f"2 ranks, {k}, unlimited: acco not slower than DDP + ZeRO-1", f"{acco['median_vs_zero1']:.3f}",
                acco["median_vs_zero1"] >= 1.0)
    convergence = convergence_runs.get("convergence")
    if convergence:
        methods = convergence["methods"]
        if "acco" in methods and "acco-sync" in methods:
            gap = abs(methods["acco"]["gap_vs_sync"])
            for name, run in convergence_runs.items():  # every run, the main one first: no picking
                cfg, found = run["config"], run["methods"]
                if "acco" in found and "acco-sync" in found:
                    add(f"acco's final eval loss within 1% of sync (results/{name}.json: seed {cfg['seed']}, "
                        f"lr {cfg['lr']}, {cfg['updates']} updates)", f"{found['acco']['gap_vs_sync']:+.2%}",
                        abs(found["acco"]["gap_vs_sync"]) <= 0.01)
            if "acco-dpu" in methods:
                dpu = abs(methods["acco-dpu"]["gap_vs_sync"])
                add("dpu's gap larger than acco's", f"{methods['acco-dpu']['gap_vs_sync']:+.2%} vs "
                    f"{methods['acco']['gap_vs_sync']:+.2%}", dpu > gap)
            diff = methods["acco"].get("update_difference")
            if diff and diff["mean"] is not None:
                dpu_diff = methods.get("acco-dpu", {}).get("update_difference", {}).get("mean")
                add("(for reference) normalised update difference to sync, acco / dpu (paper: 0.07-0.11 for acco)",
                    f"{diff['mean']:.3f} / {dpu_diff:.3f}" if dpu_diff is not None else f"{diff['mean']:.3f}", None)
    if memory:
        for t in memory_targets(memory):
            run = t["run"]
            add(f"{run['ranks']} ranks, {run['dtype']}: {MEMORY_LABELS[run['method']]} peak per rank <= ZeRO-1 + "
                f"{t['target']:.2f} model sizes (tensors at the end of a backward / peak RSS)",
                f"{t['tensors']:+.2f} / {t['rss']:+.2f}", max(t["tensors"], t["rss"]) <= t["target"])
        for run in memory["runs"]:
            if run["method"] != "acco" or run.get("dtype", "fp32") != "fp32":
                continue
            worst = max(r["state_elements_per_tensor"] for r in run["per_rank"])
            ceil = run["per_rank"][0]["ceil_p_over_n"]
            add(f"{run['ranks']} ranks: acco's optimizer state per rank = ceil(P/N) + padding",
                f"{worst:,} elements per moment, ceil(P/N) = {ceil:,} (padding {worst - ceil:+,})",
                0 <= worst - ceil < 2 * run["ranks"])
    if time_to_loss:
        summary = time_to_loss.get("summary") or time_to_loss_summary(time_to_loss)
        for label, limit in TTL_BAR.items():
            s = summary.get(label)
            if s is None:
                continue
            best = s.get("best_acco")
            value = s["methods"][best]["median_time_fraction"] if best else None
            add(f"{label}: the best acco configuration reaches DDP + ZeRO-1's final held-out loss in <= {limit} of "
                "the same wall-clock budget (time_to_loss.py, median over seeds)",
                f"{value:.2f} ({TTL_LABELS.get(best, best)})" if value is not None else "not reached",
                value is not None and value <= limit)
    return table(["target", "measured", ""], rows)


def gpu_table(runs: list[dict[str, Any]]) -> str:
    """``gpu_overlap.py``'s figures: one row per world size and method."""
    rows = []
    for run in runs:
        base = next(r for r in run["methods"] if r["method"] == "none")["samples_per_s"]
        for r in run["methods"]:
            if r["method"] == "none":
                rows.append([str(run["world_size"]), "no optimizer (forward + backward only)", f"{r['samples_per_s']:.0f}",
                             "1.00", "-", "-", "-", f"{r['max_memory_allocated_mb']:.0f}"])
                continue
            busy = r.get("step_ms_in_flight_median")
            in_flight = "-" if busy is None else (
                f"{busy:.2f} / {r['step_ms_in_flight_max']:.2f} ({r['steps_with_round_in_flight']} steps)")
            rows.append([
                str(run["world_size"]), r["method"], f"{r['samples_per_s']:.0f}", f"{r['samples_per_s'] / base:.2f}",
                f"{r['step_ms_median']:.2f}", in_flight, f"{r['hidden_share']:.2f}", f"{r['max_memory_allocated_mb']:.0f}",
            ])
    return table(["world size", "method", "samples/s", "vs no optimizer", "step() ms, median",
                  "step() ms with the round in flight, median / max", "hidden share (GPU time)",
                  "max allocated MiB"], rows)


def gpu_section(data: dict) -> str:
    run = data["runs"][0]
    config = run["config"]
    streams = []
    for r in data["runs"]:
        info = r["streams"]
        lane = {s: v for s, v in info["streams"].items() if int(s) != info["compute_stream"] and v["kernels"] > 10}
        for stream, v in lane.items():
            streams.append(f"world size {r['world_size']}: the lane's stream ran {v['kernels']} kernels for "
                           f"{1000 * v['busy_s']:.1f} ms in the profiled rounds, {1000 * v['overlapped_with_compute_s']:.1f} ms "
                           f"of it while the compute stream was busy (compute stream: "
                           f"{1000 * info['streams'][str(info['compute_stream'])]['busy_s']:.0f} ms); trace: "
                           f"[results/{r['trace']}](results/{r['trace']})")
    return (
        f"{run['device']}, torch {run['torch']}; the example's GPT ({config['n_layer']} layers, width "
        f"{config['n_embd']}, {run['methods'][0]['parameters_m']:.1f}M parameters), {config['batch_size']} x "
        f"{config['seq_len']} tokens per micro-batch, {run['micro_batches_per_round']} micro-batches per round "
        f"(`acco-ready`: and more while the round is in flight), AdamW, clipping at {config['max_grad_norm']}, "
        f"{run['rounds']} measured rounds. World size 2 = two ranks on the one GPU, gloo on CUDA tensors.\n\n"
        + gpu_table(data["runs"]) + "\n\n" + "\n".join(f"- {line}" for line in streams)
    )


def runtimes_section(**datas: Any) -> str:
    rows = []
    for name, data in datas.items():
        if data is None:
            continue
        rows.append([name, minutes(data["runtime_s"])])
        if name.startswith("throughput"):
            for run in data["runs"]:
                rows.append([f"  {run['ranks']} ranks, {run['label']}", minutes(run["runtime_s"])])
        if name == "time_to_loss":
            if data.get("calibration_runtime_s"):
                rows.append(["  calibration", minutes(data["calibration_runtime_s"])])
            for run in data["runs"]:
                rows.append([f"  {run['label']}, seed {run['seed']}", minutes(run["runtime_s"])])
    return table(["benchmark", "runtime (this machine, 2 cores)"], rows)


# ------------------------------------------------------------------------------------ main


def replace_block(text: str, name: str, body: str) -> str:
    pattern = re.compile(rf"(<!-- BEGIN GENERATED: {re.escape(name)} -->\n).*?(<!-- END GENERATED: {re.escape(name)} -->)",
                         re.S)
    if not pattern.search(text):
        print(f"report: no block {name!r} in {README.name}; skipped", file=sys.stderr)
        return text
    return pattern.sub(lambda m: m.group(1) + body.rstrip() + "\n" + m.group(2), text)


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    memory = load("memory")
    # throughput.json is the main sweep; throughput-NAME.json are further sweeps (other settings);
    # likewise convergence.json and further convergence runs.
    sweeps, convergence_runs = load_family("throughput"), load_family("convergence")
    convergence = convergence_runs.get("convergence")
    profiles = [p for p in (load("profile-2ranks"), load("profile-4ranks")) if p]
    blocks: dict[str, str] = {}
    for name, data in sweeps.items():
        blocks[name] = throughput_section(data) + f"\n![{name}](results/{plot_throughput(data, name)})"
        blocks["calibration" + name[len("throughput"):]] = calibration_section(data)
        blocks["lanes" + name[len("throughput"):]] = lane_section(data)
    if convergence_runs:
        blocks["convergence-runs"] = convergence_runs_section(convergence_runs)
    if convergence:
        blocks["convergence"] = convergence_section(convergence) + f"\n\n![convergence](results/{plot_convergence(convergence)})"
    if memory:
        blocks["memory"] = memory_section(memory, load("memory-baseline"))
    if profiles:
        blocks["profile"] = "\n\n".join(profile_section(p) for p in profiles)
    gpu = load("gpu_overlap")
    if gpu:
        blocks["gpu"] = gpu_section(gpu)
    time_to_loss = load("time_to_loss")
    if time_to_loss:
        blocks["time_to_loss"] = (time_to_loss_section(time_to_loss)
                                  + f"\n\n![time to loss](results/{plot_time_to_loss(time_to_loss)})")
    blocks["targets"] = targets_section(list(sweeps.values()), convergence_runs, memory, time_to_loss)
    blocks["runtimes"] = runtimes_section(**sweeps, convergence=convergence, memory=memory, time_to_loss=time_to_loss,
                                          **{f"profile_lanes ({p['ranks']} ranks)": p for p in profiles})
    text = README.read_text()
    for name, body in blocks.items():
        text = replace_block(text, name, body)
    README.write_text(text)
    if memory:  # the repository README's memory figures
        root = REPO_README.read_text()
        REPO_README.write_text(replace_block(root, "memory-summary", memory_summary(memory, load("memory-baseline"))))
    print(f"report: updated {README} ({', '.join(blocks)})")


if __name__ == "__main__":
    main()
