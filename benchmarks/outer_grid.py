"""Local steps' outer optimizer measured longer and larger than the grid behind today's defaults
(issue 57): held-out loss of the global values at equal inner steps, per outer Nesterov lr x
momentum, blocking rounds (``sync_delay=0``), 4-bit rounds, replicas in lockstep; ``mode="sync"``
(ZeRO-1) on the same tokens as the reference. One command per setting, each a launch of real gloo
ranks (one replica a rank) per cell::

    python benchmarks/outer_grid.py small-r2-h30   # the example GPT (0.83M), 2,400 inner steps, the 3x3 grid + sync
    python benchmarks/outer_grid.py large-r2-h30   # a GPT 3.9x larger (3.24M), 1,200 inner steps, the same
    python benchmarks/outer_grid.py small-r4-h30   # R = 4: the best three cells of small-r2-h30, the default, sync
    python benchmarks/outer_grid.py small-r2-h8    # H = 8: the same cells
    python benchmarks/outer_grid.py large-r4-h30   # and the same two at the larger size
    python benchmarks/outer_grid.py large-r2-h8
    python benchmarks/outer_grid.py --report       # the tables, heatmaps, loss curves and decision of docs/loops.md

Results: ``benchmarks/results/outer_grid-SETTING.json`` (a cell already there is not run again:
``--again`` reruns it), figures ``outer_grid-*.png`` beside them. An inner step is one micro-batch
of 8 sequences of 64 bytes per replica (the time-to-loss GPT's micro-batch; the old grid took 4 per
step: 2,400 steps of one cost what 600 of four would, which is what fits two shared cores), AdamW
lr 3e-3 with 10 steps of warm-up then constant, clipping at 1.0, as time_to_loss.py's runs. The
losses are independent of the machine's speed (lockstep pacing, blocking rounds): the lead may
pause the ranks at any time. Before each launch the driver waits while ``/tmp/quiet`` exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common
from examples.train_gpt import Dist, eval_batches, evaluate

import torch
import torch.distributed as dist

import acco

__all__ = ["BENCHMARK", "GRID", "SETTINGS", "Setting", "blocks", "decide", "report", "runtimes"]

LRS = (0.5, 0.7, 1.0)
MOMENTA = (0.3, 0.6, 0.9)
GRID = tuple((lr, mu) for lr in LRS for mu in MOMENTA)
OLD_DEFAULT = (0.5, 0.3)  # the default the old grid chose (benchmarks/outer_defaults.py)
SYNC = "acco-sync"
LINK = "benchmarks/results/"  # the figures, as the top README links them (report.py adapts docs/)
QUIET_FILE = Path("/tmp/quiet")  # the lead's timing windows: no launch starts while it exists
SIZES = {"small": {"n_layer": 4, "n_embd": 128, "n_head": 4},  # the example GPT of time_to_loss.py: 0.83M
         "large": {"n_layer": 4, "n_embd": 256, "n_head": 4}}  # 3.24M


@dataclass(frozen=True)
class Setting:
    """One command's runs: a size, R replicas, H inner steps per outer round, the inner steps per
    replica, and which cells: the whole grid, or (``from_grid``) the best three of that setting's
    grid and the defaults, old and new."""

    size: str
    ranks: int
    sync_every: int
    steps: int
    from_grid: str | None = None
    eval_every: int = 120  # inner steps between evaluations of the global values (the loss curve)

    def config(self, seed: int) -> common.ModelConfig:
        return common.ModelConfig(**SIZES[self.size], seq_len=64, batch_size=8, lr=3e-3, max_grad_norm=1.0, seed=seed)


SETTINGS: dict[str, Setting] = {
    "small-r2-h30": Setting("small", 2, 30, 2400),
    "large-r2-h30": Setting("large", 2, 30, 1200),
    "small-r4-h30": Setting("small", 4, 30, 2400, from_grid="small-r2-h30"),
    "small-r2-h8": Setting("small", 2, 8, 2400, from_grid="small-r2-h30"),
    "large-r4-h30": Setting("large", 4, 30, 1200, from_grid="large-r2-h30"),
    "large-r2-h8": Setting("large", 2, 8, 1200, from_grid="large-r2-h30"),
}


def cell_name(setting: Setting, lr: float, momentum: float) -> str:
    """The method name (benchmarks/common.py, ``LocalSpec``): blocking, 4-bit, lockstep."""
    return f"local-h{setting.sync_every}-d0-b4-lockstep-olr{lr:g}-mom{momentum:g}"


def cell_of(name: str) -> tuple[float, float] | None:
    spec = common.LocalSpec.parse(name)
    return None if spec is None else (spec.outer_lr, spec.outer_momentum)


def results_path(name: str, results_dir: Path = common.RESULTS_DIR) -> Path:
    return results_dir / f"outer_grid-{name}.json"


def final_losses(data: dict[str, Any]) -> dict[tuple[float, float], float]:
    """Per measured cell of one setting's results, its final held-out loss."""
    return {cell: run["final_loss"] for name, run in data.get("methods", {}).items()
            if (cell := cell_of(name)) is not None and "final_loss" in run}


def current_default(sync_every: int) -> tuple[float, float]:
    keywords = acco.default_outer(sync_every).keywords
    return keywords["lr"], keywords["momentum"]


def planned_cells(name: str, results_dir: Path = common.RESULTS_DIR) -> list[tuple[float, float]]:
    """The cells a setting runs, most telling first (a run cut short keeps those): the old and
    the current default and DiLoCo's 0.7 / 0.9, then the rest of the grid; or, for a setting
    ``from_grid``, the best three of that grid and the defaults."""
    setting = SETTINGS[name]
    defaults = list(dict.fromkeys([OLD_DEFAULT, current_default(setting.sync_every)]))
    if setting.from_grid is None:
        return list(dict.fromkeys([*defaults, (0.7, 0.9), *GRID]))
    path = results_path(setting.from_grid, results_dir)
    if not path.is_file():
        raise SystemExit(f"{name} runs the best cells of {setting.from_grid}: run that first ({path} is missing)")
    losses = final_losses(common.read_json(path))
    best = sorted(losses, key=losses.get)[:3]
    return list(dict.fromkeys([*best, *defaults]))


# ----------------------------------------------------------------------------- one launch (every rank)


def arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("setting", nargs="?", choices=sorted(SETTINGS), help="which runs (see the module's docstring)")
    add("--report", action="store_true", help="print the tables and decision, write the figures; no training")
    add("--seed", type=int, default=1337)
    add("--steps", type=int, default=None, help="inner steps per replica (default: the setting's)")
    add("--eval-batches", type=int, default=48)
    add("--again", action="store_true", help="rerun the cells already in the results file")
    add("--cells", nargs="+", default=None, metavar="LR/MOMENTUM",
        help="these cells instead of the setting's (e.g. 0.7/0.9); 'sync' for the reference")
    add("--method", default=None, help=argparse.SUPPRESS)  # set by the driver for its rank launches


def check(args: argparse.Namespace) -> str | None:
    args.no_report = True  # report.py's blocks() regenerate docs/loops.md's block from these files
    if args.report:
        return None
    if args.setting is None:
        return "name a setting, or --report"
    setting = SETTINGS[args.setting]
    args.ranks = setting.ranks
    args.steps = args.steps or setting.steps
    return None


def warmup_constant(warmup: int):  # type: ignore[no-untyped-def]
    return lambda update: min(1.0, (update + 1) / (warmup + 1))


def rank(args: argparse.Namespace, ctx: Dist) -> dict[str, Any]:
    """One cell (``--method``): ``args.steps`` inner steps per replica, every ``eval_every`` the
    global values kept, evaluated at the end (split over the ranks)."""
    setting = SETTINGS[args.setting]
    config = setting.config(args.seed)
    train_data, held_out = common.training_text(config.seq_len)
    eval_set = eval_batches(held_out, args.eval_batches, config.batch_size, config.seq_len, args.seed,
                            torch.device("cpu"))
    started, cpu_started = time.perf_counter(), time.process_time()
    method = common.build_method(args.method, config, 1, schedule=warmup_constant(10))
    scheduler = torch.optim.lr_scheduler.LambdaLR(method.opt, warmup_constant(10)) if method.opt else None
    next_batch = common.batches(train_data, config, config.seed + 1000 * ctx.rank)  # the same tokens in every cell
    params = list(method.module.parameters())
    local = method.local_opt if method.spec.family == "local" else None
    snapshots: list[tuple[int, list[torch.Tensor]]] = [(0, method.eval_params(params))]
    train_losses: list[float] = []
    window: list[torch.Tensor] = []
    for step in range(1, args.steps + 1):
        record = common.train_round(method, next_batch)
        window += record.losses
        if scheduler is not None and record.committed:
            scheduler.step()
        merged = local.outer_rounds * setting.sync_every if local is not None else step  # inner steps in the global values
        if record.committed and merged >= snapshots[-1][0] + setting.eval_every:
            snapshots.append((merged, method.eval_params(params)))
        if step % setting.eval_every == 0:
            train_losses.append(float(torch.stack(window).mean()))
            window = []
    method.finish()
    merged = local.outer_rounds * setting.sync_every if local is not None else args.steps
    if snapshots[-1][0] != merged or local is not None:  # finish() may land a last round
        snapshots = [s for s in snapshots if s[0] < merged] + [(merged, method.eval_params(params))]
    train_s, train_cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
    losses = [0.0] * len(snapshots)
    for i, (_, values) in enumerate(snapshots):
        if i % ctx.world_size == ctx.rank:
            with torch.no_grad():
                for p, value in zip(params, values):
                    p.copy_(value)
            losses[i] = evaluate(method.module, eval_set)
    losses = common.all_reduce(losses)
    train_losses = [v / ctx.world_size for v in common.all_reduce(train_losses)]
    result: dict[str, Any] = {
        "method": args.method, "label": common.label(args.method),
        "points": [{"inner_steps": n, "loss": loss} for (n, _), loss in zip(snapshots, losses)],
        "final_loss": losses[-1], "train_loss": {"every": setting.eval_every, "mean_over_replicas": train_losses},
        "inner_steps": args.steps, "train_s": train_s,
        "train_cpu_s_by_rank": common.all_reduce([train_cpu_s if r == ctx.rank else 0.0 for r in range(ctx.world_size)]),
    }
    if local is not None:
        result.update(outer_rounds=local.outer_rounds, outer_optimizer=repr(local.options.local.outer_optimizer),
                      outer_bits=local.options.local.outer_bits, sync_delay=local.options.local.sync_delay,
                      pacing=str(local.options.local.pacing))
    method.close()
    return result


# ----------------------------------------------------------------------------- the driver


def wait_for_quiet() -> None:
    announced = False
    while QUIET_FILE.exists():
        if not announced:
            print(f"{QUIET_FILE} exists: waiting", flush=True)
            announced = True
        time.sleep(30)


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    setting = SETTINGS[args.setting]
    path = args.out
    results: dict[str, Any] = common.read_json(path) if path.is_file() else {}
    config = setting.config(args.seed)
    results.update({
        "setting": {**dataclasses.asdict(setting), "name": args.setting, "steps": args.steps, "seed": args.seed,
                    "eval_batches": args.eval_batches, "micro_batches_per_inner_step": 1,
                    "schedule": "linear warm-up over 10 inner steps, then constant",
                    "parameters": sum(p.numel() for p in common.build_model(config).parameters())},
        "model": config.as_dict(),
        "command": f"python benchmarks/outer_grid.py {args.setting}",
    })
    results.setdefault("methods", {})
    if args.cells:
        cells = [c for c in args.cells if c != "sync"]
        names = [cell_name(setting, *map(float, c.split("/"))) for c in cells] + ([SYNC] if "sync" in args.cells else [])
    else:
        planned = planned_cells(args.setting)
        names = [cell_name(setting, lr, mu) for lr, mu in planned[:3]] + [SYNC] + \
                [cell_name(setting, lr, mu) for lr, mu in planned[3:]]
    results["planned"] = list(dict.fromkeys([*results.get("planned", []), *names]))
    started = time.perf_counter()
    for name in names:
        if name in results["methods"] and not args.again:
            continue
        wait_for_quiet()
        print(f"outer grid {args.setting}: {name}", flush=True)
        env_threads = os.environ.setdefault("OMP_NUM_THREADS", "1")
        run = common.run_ranks(args, setting.ranks, "--method", name)
        run["threads_per_rank"] = int(env_threads)
        results["methods"][name] = run
        print(f"  final held-out loss {run['final_loss']:.4f} ({run['runtime_s']:.0f} s)", flush=True)
        results["runtime_s"] = results.get("runtime_s", 0.0) + run["runtime_s"]
        common.save(args, results)
    results.setdefault("runtime_s", time.perf_counter() - started)
    return results


# ----------------------------------------------------------------------------- tables, figures, decision


def load_all(results_dir: Path = common.RESULTS_DIR) -> dict[str, dict[str, Any]]:
    return {name: common.read_json(results_path(name, results_dir)) for name in SETTINGS
            if results_path(name, results_dir).is_file()}


def sync_loss(data: dict[str, Any]) -> float | None:
    run = data.get("methods", {}).get(SYNC)
    return None if run is None else run["final_loss"]


BAR = 1.0  # percent: a default within this of the best measured cell in every setting (issue 57)


def decide(data: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per cell measured anywhere, its gap (%) to each setting's best measured cell (None where
    it was not measured); the choice: among the cells measured in every setting, the one whose
    largest gap is smallest, if that is within ``BAR`` (else None, and why)."""
    per_setting = {name: losses for name, d in data.items() if (losses := final_losses(d))}
    cells = list(dict.fromkeys(cell for losses in per_setting.values() for cell in sorted(losses, key=losses.get)))
    gaps = {cell: {name: (100 * (losses[cell] / min(losses.values()) - 1) if cell in losses else None)
                   for name, losses in per_setting.items()} for cell in cells}
    everywhere = [cell for cell in cells if all(g is not None for g in gaps[cell].values())]
    ranked = sorted(everywhere, key=lambda cell: (max(gaps[cell].values()), sum(gaps[cell].values())))
    choice = ranked[0] if ranked and max(gaps[ranked[0]].values()) <= BAR else None
    if choice is not None:
        why = f"within {BAR:g}% of the best measured cell in every setting"
    elif ranked:
        why = (f"no cell measured in every setting is within {BAR:g}% of each one's best: the closest, "
               f"{ranked[0][0]:g} / {ranked[0][1]:g}, is {max(gaps[ranked[0]].values()):.2f}% from it")
    else:
        why = "no cell is measured in every setting"
    return {"choice": choice, "why": why, "gaps": gaps, "everywhere": ranked,
            "best": {name: min(losses, key=losses.get) for name, losses in per_setting.items()}}


def describe_setting(name: str, data: dict[str, Any]) -> str:
    s = data["setting"]
    return (f"`{name}`: {common.describe(data['model'], s['parameters'])}, R = {s['ranks']}, H = {s['sync_every']}, "
            f"{s['steps']} inner steps per replica, seed {s['seed']}")


def grid_table(name: str, data: dict[str, Any]) -> str:
    """Rows outer lr, columns momentum: final held-out loss (gap to the best), best bold."""
    losses = final_losses(data)
    best = min(losses.values())
    lrs, moms = sorted({lr for lr, _ in losses}), sorted({mu for _, mu in losses})
    rows = []
    for lr in lrs:
        row = [f"{lr:g}"]
        for mu in moms:
            if (lr, mu) not in losses:
                row.append("-")
                continue
            value = f"{losses[lr, mu]:.4f}"
            row.append((f"**{value}**" if losses[lr, mu] == best else value) + f" ({100 * (losses[lr, mu] / best - 1):+.2f}%)")
        rows.append(row)
    ref = sync_loss(data)
    tail = f"\n\n`mode=\"sync\"` on the same tokens: {ref:.4f} (best cell {100 * (best / ref - 1):+.2f}% against it)." \
        if ref is not None else ""
    return (describe_setting(name, data) + "; final held-out loss (gap to the setting's best); rows: outer lr, columns: "
            "Nesterov momentum\n\n" + common.md_table(["lr \\ momentum", *(f"{mu:g}" for mu in moms)], rows) + tail)


def flattening(data: dict[str, Any]) -> dict[str, Any]:
    """The length argument, from the best cell's curve: the share of the total drop in each
    quarter of the run, and the cells' order at half the run against at its end."""
    losses = final_losses(data)
    best = min(losses, key=losses.get)
    points = next(run["points"] for name, run in data["methods"].items() if cell_of(name) == best)
    steps = [p["inner_steps"] for p in points]

    def at(n: float) -> float:
        for a, b in zip(points, points[1:]):
            if a["inner_steps"] <= n <= b["inner_steps"]:
                share = (n - a["inner_steps"]) / max(1, b["inner_steps"] - a["inner_steps"])
                return a["loss"] + share * (b["loss"] - a["loss"])
        return points[-1]["loss"]

    end = steps[-1]
    quarters = [at(end * q / 4) for q in range(5)]
    drop = quarters[0] - quarters[-1]
    half = {cell_of(name): at_half for name, run in data["methods"].items()
            if cell_of(name) is not None and (at_half := _loss_at(run["points"], end / 2)) is not None}
    order_half = sorted(half, key=half.get)
    order_end = sorted(losses, key=losses.get)
    return {"best": best, "quarter_drop_share": [(quarters[q] - quarters[q + 1]) / drop for q in range(4)],
            "last_quarter_drop_percent": 100 * (quarters[3] - quarters[4]) / quarters[3],
            "order_at_half": order_half, "order_at_end": order_end,
            "gap_at_half": {cell: 100 * (half[cell] / min(half.values()) - 1) for cell in order_half},
            "gap_at_end": {cell: 100 * (losses[cell] / min(losses.values()) - 1) for cell in order_end}}


def _loss_at(points: list[dict[str, Any]], n: float) -> float | None:
    for a, b in zip(points, points[1:]):
        if a["inner_steps"] <= n <= b["inner_steps"]:
            share = (n - a["inner_steps"]) / max(1, b["inner_steps"] - a["inner_steps"])
            return a["loss"] + share * (b["loss"] - a["loss"])
    return None


def heatmap(name: str, data: dict[str, Any], out_dir: Path) -> str:
    plt = common.pyplot()
    losses = final_losses(data)
    best = min(losses.values())
    fig, ax = plt.subplots(figsize=(4.2, 3.4))
    grid = [[100 * (losses[lr, mu] / best - 1) if (lr, mu) in losses else math.nan for mu in MOMENTA] for lr in LRS]
    image = ax.imshow(grid, cmap="viridis_r", origin="lower", aspect="auto")
    for i, lr in enumerate(LRS):
        for j, mu in enumerate(MOMENTA):
            if (lr, mu) in losses:
                ax.text(j, i, f"{losses[lr, mu]:.3f}\n{grid[i][j]:+.1f}%", ha="center", va="center", fontsize=7,
                        color="white" if grid[i][j] > 0.6 * max(v for row in grid for v in row if v == v) else "black")
    ax.set_xticks(range(len(MOMENTA)), [f"{mu:g}" for mu in MOMENTA])
    ax.set_yticks(range(len(LRS)), [f"{lr:g}" for lr in LRS])
    ax.set_xlabel("outer Nesterov momentum")
    ax.set_ylabel("outer lr")
    s = data["setting"]
    ax.set_title(f"{name}: {s['parameters'] / 1e6:.2f}M, {s['steps']} steps", fontsize=9)
    fig.colorbar(image, ax=ax, label="% above the best cell")
    return common.save_figure(fig, out_dir / f"outer_grid-heatmap-{name}.png")


def curves(data: dict[str, dict[str, Any]], out_dir: Path) -> str:
    """Held-out loss against inner steps per setting: every cell, sync dashed; log x."""
    plt = common.pyplot()
    names = list(data)
    fig, axes = plt.subplots(2, math.ceil(len(names) / 2), figsize=(4.5 * math.ceil(len(names) / 2), 7), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for ax, name in zip(axes.T.flat, names):
        for i, (method, run) in enumerate(sorted(data[name]["methods"].items())):
            points = [(p["inner_steps"], p["loss"]) for p in run["points"] if p["inner_steps"] > 0]
            cell = cell_of(method)
            label = "sync" if cell is None else f"{cell[0]:g} / {cell[1]:g}"
            ax.plot(*zip(*points), color="black" if cell is None else cmap(i % 10), ls="--" if cell is None else "-",
                    lw=1.0, label=f"{label}: {run['final_loss']:.3f}")
        ax.set_xscale("log")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("inner steps per replica")
        ax.set_ylabel("held-out loss")
        finals = [run["final_loss"] for run in data[name]["methods"].values()]
        ax.set_ylim(min(finals) - 0.05, min(finals) + 0.9)
        ax.legend(fontsize=6, title="outer lr / momentum", title_fontsize=6)
    for ax in list(axes.T.flat)[len(names):]:
        ax.axis("off")
    return common.save_figure(fig, out_dir / "outer_grid-curves.png")


def report(results_dir: Path = common.RESULTS_DIR) -> str:
    data = load_all(results_dir)
    parts = []
    for name, d in data.items():
        if final_losses(d):
            parts.append(f"**{name}**: " + grid_table(name, d) + f"\n\n![{name}]({LINK}{heatmap(name, d, results_dir)})")
    if data:
        parts.append(f"Held-out loss against inner steps, every setting:\n\n![curves]({LINK}{curves(data, results_dir)})")
    for name, d in data.items():
        if d["setting"]["from_grid"] is None and final_losses(d):
            f = flattening(d)
            parts.append(
                f"Length ({name}, best cell {f['best']}): share of the run's drop in each quarter "
                + ", ".join(f"{100 * v:.1f}%" for v in f["quarter_drop_share"])
                + f"; the last quarter lowered the loss by {f['last_quarter_drop_percent']:.2f}%; cells' order (gap to the best) at half the run "
                + ", ".join(f"{lr:g}/{mu:g} ({f['gap_at_half'][lr, mu]:+.1f}%)" for lr, mu in f["order_at_half"])
                + "; at the end " + ", ".join(f"{lr:g}/{mu:g} ({f['gap_at_end'][lr, mu]:+.1f}%)" for lr, mu in f["order_at_end"]))
    decision = decide(data)
    if decision["gaps"]:
        rows = [[f"{cell[0]:g} / {cell[1]:g}" + (" (chosen)" if cell == decision["choice"] else ""),
                 *("-" if (g := gaps[name]) is None else f"{g:+.2f}%" for name in decision["best"]),
                 f"{max(v for v in gaps.values() if v is not None):+.2f}%"]
                for cell, gaps in decision["gaps"].items()]
        parts.append("Gap to each setting's best measured cell (-: not measured there)\n\n" + common.md_table(
            ["outer lr / momentum", *decision["best"], "largest measured"], rows) + "\n\nBest per setting: " +
            ", ".join(f"{name} {lr:g} / {mu:g}" for name, (lr, mu) in decision["best"].items()) +
            f". Decision rule (`outer_grid.decide`): {decision['why']}.")
    return "\n\n".join(parts)


def blocks(results: dict[str, Any], results_dir: Path) -> dict[str, str]:
    """docs/loops.md's block (report.py), from every setting's file in ``results_dir``."""
    return {"outer-grid": report(results_dir)} if load_all(results_dir) else {}


def runtimes(results: dict[str, Any]) -> list[tuple[str, float]]:
    return [(f"outer_grid {name.removeprefix('outer_grid-')}", data["runtime_s"]) for name, data in sorted(results.items())
            if "runtime_s" in data]


BENCHMARK = common.Benchmark("outer_grid", __doc__, arguments, rank, sweep=sweep, check=check,
                             quick={"steps": 60}, stem="outer_grid-{setting}")

if __name__ == "__main__":
    if "--report" in sys.argv[1:]:  # this block alone (report.py writes every benchmark's)
        import report as readmes

        text = report()
        print(text)
        readmes.place({"outer-grid": text})
    else:
        common.main(BENCHMARK)
