"""Local steps against data-parallel at equal tokens (issue 67): held-out loss of ``mode="local"``
(R replicas, each its own inner AdamW on 1/R of the global batch, an outer round every H inner
steps) against data-parallel (``mode="sync"``, ZeRO-1: the R replicas' micro-batches in one step),
the same recipe (inner lr, warm-up, cosine, clipping) and the same tokens, as the DiLoCo
scaling-law study compares them. One command per setting, each cell a launch of real gloo ranks
(one replica a rank)::

    python benchmarks/local_quality.py tiny-r2     # 0.45M parameters, 20 tokens per parameter, R = 2
    python benchmarks/local_quality.py tiny-r4     # the same tokens over R = 4 replicas
    python benchmarks/local_quality.py small-r2    # the example GPT (0.83M)
    python benchmarks/local_quality.py large-r2    # the 3.24M GPT
    python benchmarks/local_quality.py tiny-r2 --cells sync local-h8-olr0.7-mom0.9 'local-h8@ilr0.5'
    python benchmarks/local_quality.py gpt85m-r2 --device cuda   # on one GPU: 2 ranks share it over gloo
    python benchmarks/local_quality.py --report    # docs/loops.md's table and figure

A cell is ``sync`` (data-parallel) or a local-steps method name (benchmarks/common.py,
``LocalSpec``: ``local-hdefault`` is the library's defaults, ``local-h8-olr1-mom0.6`` H = 8 with
that outer Nesterov SGD), always in lockstep (``pacing="lockstep"``: equal replicas, the losses
are the machine's speed's no matter); ``@ilrF`` multiplies the inner lr by F. Results:
``benchmarks/results/local_quality-SETTING.json`` (a cell already there is not run again:
``--again`` reruns it), the figure ``local_quality.png``. Before each launch the driver waits
while ``/tmp/quiet`` exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common
from examples.train_gpt import Dist, WarmupCosine, eval_batches, evaluate

import torch

import acco

__all__ = ["BENCHMARK", "SETTINGS", "SIZES", "Setting", "Size", "blocks", "compare", "report"]

SYNC = "sync"  # data-parallel: acco mode="sync" (ZeRO-1), every replica's micro-batch in one step
DEFAULTS = "local-hdefault"  # the library's defaults for mode="local"
LINK = "benchmarks/results/"
QUIET_FILE = Path("/tmp/quiet")  # a timing window elsewhere on the machine: no launch starts while it exists
DEFAULTS_BAR = {"vs_data_parallel": 1.5, "vs_best": 2.0}  # percent (issue 67)


@dataclass(frozen=True)
class Size:
    """A model and its recipe: the GPT of examples/train_gpt.py, micro-batch ``batch_size``
    sequences per replica per inner step, AdamW ``lr`` with ``warmup`` steps then cosine to a
    tenth, clipping at 1, and ``steps`` inner steps per replica (data-parallel takes as many)."""

    n_layer: int
    n_embd: int
    n_head: int
    seq_len: int
    batch_size: int
    lr: float
    warmup: int
    steps: int
    device: str = "cpu"
    mixed: bool = False  # bf16 compute over fp32 parameters (the GPU sizes)

    def config(self, seed: int) -> common.ModelConfig:
        return common.ModelConfig(n_layer=self.n_layer, n_embd=self.n_embd, n_head=self.n_head, seq_len=self.seq_len,
                                  batch_size=self.batch_size, lr=self.lr, max_grad_norm=1.0, seed=seed)


SIZES: dict[str, Size] = {
    # 0.45M: 4,300 steps x 2 replicas x 8 x 128 tokens = 8.8M tokens, 19.7 per parameter (on 2 cores)
    "tiny": Size(2, 128, 4, 128, 8, 3e-3, 100, 4300),
    # the example GPT of time_to_loss.py (0.83M) and the 3.24M GPT, as long as the old outer grid ran them
    "small": Size(4, 128, 4, 64, 8, 3e-3, 100, 2400),
    "large": Size(4, 256, 4, 64, 8, 3e-3, 100, 1200),
    "gpt85m": Size(12, 768, 12, 256, 16, 6e-4, 60, 900, device="cuda", mixed=True),  # issue 67's H200 runs
    "gpt125m": Size(18, 768, 12, 256, 16, 6e-4, 60, 900, device="cuda", mixed=True),  # GPT-2 small's size
}


@dataclass(frozen=True)
class Setting:
    size: str
    ranks: int  # R: replicas, one a rank; data-parallel's global batch is R micro-batches
    cells: tuple[str, ...]  # what a plain command runs, most telling first

    @property
    def model(self) -> Size:
        return SIZES[self.size]


_SWEEP = (SYNC, DEFAULTS, "local-h8-olr0.7-mom0.9", "local-h8-olr1-mom0.6", "local-h4-olr0.7-mom0.9",
          "local-h8-olr1.4-mom0", "local-h30-olr0.7-mom0.9", "local-h8-olr0.5-mom0.3", "local-h8-olr0.7-mom0.9@ilr0.5",
          "local-hauto")
SETTINGS: dict[str, Setting] = {
    "tiny-r2": Setting("tiny", 2, _SWEEP),
    "tiny-r4": Setting("tiny", 4, _SWEEP[:5]),
    "small-r2": Setting("small", 2, _SWEEP[:5]),
    "large-r2": Setting("large", 2, _SWEEP[:5]),
    "gpt85m-r2": Setting("gpt85m", 2, _SWEEP[:5]),
    "gpt125m-r2": Setting("gpt125m", 2, _SWEEP[:3]),
}


def parse_cell(cell: str) -> tuple[str, float]:
    """A cell's method name and inner lr factor (``NAME@ilrF``)."""
    name, _, tail = cell.partition("@")
    if tail and not tail.startswith("ilr"):
        raise ValueError(f"{cell!r}: expected NAME or NAME@ilrF")
    factor = float(tail[3:]) if tail else 1.0
    if name != SYNC:
        common.method_spec(name)
    return name, factor


def method_of(cell: str) -> str:
    """The benchmark's method for a cell: data-parallel is acco's ``sync``; local cells in lockstep."""
    name, _ = parse_cell(cell)
    return "acco-sync" if name == SYNC else name + "-lockstep"


SEED = 1337  # a cell's key is its name at this seed; at another, NAME~sSEED
SEED_MARK = "~s"


def cell_key(cell: str, seed: int) -> str:
    """Where a cell run at ``seed`` is kept in the results file."""
    return cell if seed == SEED else f"{cell}{SEED_MARK}{seed}"


def split_key(key: str) -> tuple[str, int]:
    """A results key's cell and seed."""
    cell, mark, seed = key.partition(SEED_MARK)
    return cell, int(seed) if mark else SEED


def results_path(setting: str, results_dir: Path = common.RESULTS_DIR) -> Path:
    return results_dir / f"local_quality-{setting}.json"


# ----------------------------------------------------------------------------- one launch (every rank)


def arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("setting", nargs="?", choices=sorted(SETTINGS), help="which runs (see the module's docstring)")
    add("--cells", nargs="+", default=None, help="these cells instead of the setting's")
    add("--report", action="store_true", help="print the tables, write the figure; no training")
    add("--seed", type=int, default=SEED, help=f"the model's initial values, the data's order and the held-out "
        f"set; a cell run at another seed than {SEED} is kept as CELL{SEED_MARK}SEED")
    add("--steps", type=int, default=None, help="inner steps per replica (default: the size's)")
    add("--eval-batches", type=int, default=48)
    add("--device", choices=("cpu", "cuda"), default=None, help="default: the size's")
    add("--again", action="store_true", help="rerun the cells already in the results file")
    add("--cell", default=None, help=argparse.SUPPRESS)  # set by the driver for its rank launches


def check(args: argparse.Namespace) -> str | None:
    args.no_report = True  # --report regenerates docs/loops.md's block from every setting's file
    if args.report:
        return None
    if args.setting is None:
        return "name a setting, or --report"
    setting = SETTINGS[args.setting]
    args.ranks = setting.ranks
    args.steps = args.steps or setting.model.steps
    args.device = args.device or setting.model.device
    try:
        for cell in args.cells or ():
            parse_cell(cell)
    except ValueError as error:
        return str(error)
    return None


def rank(args: argparse.Namespace, ctx: Dist) -> dict[str, Any]:
    """One cell (``--cell``): ``args.steps`` inner steps per replica; about ten times in the run
    the global values are kept, and evaluated at the end (split over the ranks)."""
    setting = SETTINGS[args.setting]
    size, (name, lr_factor) = setting.model, parse_cell(args.cell)
    config = dataclasses.replace(size.config(args.seed), lr=size.lr * lr_factor)
    device = torch.device(args.device, ctx.rank % torch.cuda.device_count()) if args.device == "cuda" else None
    train_data, held_out = common.training_text(config.seq_len)
    eval_set = eval_batches(held_out, args.eval_batches, config.batch_size, config.seq_len, args.seed,
                            device or torch.device("cpu"))
    schedule = WarmupCosine(size.warmup, args.steps)
    started = time.perf_counter()
    method = common.build_method(method_of(args.cell), config, 1, schedule=schedule, device=device,
                                 mixed=torch.bfloat16 if size.mixed else None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(method.opt, schedule) if method.opt else None
    batches = common.batches(train_data, config, config.seed + 1000 * ctx.rank)  # the same tokens in every cell
    next_batch = (lambda: tuple(t.to(device) for t in batches())) if device is not None else batches
    params = list(method.module.parameters())
    local = method.local_opt if method.spec.family == "local" else None
    every = max(1, args.steps // 10)
    snapshots: list[tuple[int, list[torch.Tensor]]] = [(0, method.eval_params(params))]
    for step in range(1, args.steps + 1):
        record = common.train_round(method, next_batch)
        if scheduler is not None and record.committed:
            scheduler.step()
        merged = method.committed_updates(step) if local is not None else step  # inner steps in the global values
        if record.committed and merged >= snapshots[-1][0] + every:
            snapshots.append((merged, method.eval_params(params)))
    method.finish()
    # finish() lands the last, shorter round: its H is counted whole
    merged = min(args.steps, method.committed_updates(args.steps)) if local is not None else args.steps
    snapshots = [s for s in snapshots if s[0] < merged] + [(merged, method.eval_params(params))]
    train_s = time.perf_counter() - started
    losses = [0.0] * len(snapshots)
    for i, (_, values) in enumerate(snapshots):
        if i % ctx.world_size == ctx.rank:
            with torch.no_grad():
                for p, value in zip(params, values):
                    p.copy_(value)
            losses[i] = evaluate(method.module, eval_set)
    losses = common.all_reduce(losses)
    result: dict[str, Any] = {
        "cell": args.cell, "label": common.label(method_of(args.cell)) + (f", inner lr x{lr_factor:g}" if lr_factor != 1 else ""),
        "points": [{"inner_steps": n, "loss": loss} for (n, _), loss in zip(snapshots, losses)],
        "final_loss": losses[-1], "inner_steps": args.steps, "train_s": train_s, "inner_lr": config.lr,
    }
    if local is not None:
        options = local.options.local
        result.update(outer_rounds=local.outer_rounds, sync_every=sorted(set(method.round_every())),
                      outer_optimizer=repr(options.outer_optimizer), outer_bits=options.outer_bits,
                      sync_delay=options.sync_delay, pacing=str(options.pacing))
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
    config = setting.model.config(args.seed)
    parameters = sum(p.numel() for p in common.build_model(config).parameters())
    tokens = args.steps * setting.ranks * config.batch_size * config.seq_len
    results.update({
        "setting": {"name": args.setting, "size": args.setting.split("-")[0], **dataclasses.asdict(setting.model),
                    "ranks": setting.ranks, "steps": args.steps, "seed": SEED, "eval_batches": args.eval_batches,
                    "parameters": parameters, "tokens": tokens, "tokens_per_parameter": tokens / parameters,
                    "default_sync_every": acco.options.DEFAULT_SYNC_EVERY},
        "command": f"python benchmarks/local_quality.py {args.setting}",
    })
    results.setdefault("cells", {})
    for cell in args.cells or setting.cells:
        key = cell_key(cell, args.seed)
        if key in results["cells"] and not args.again:
            continue
        wait_for_quiet()
        print(f"local quality {args.setting}: {cell}, seed {args.seed}", flush=True)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        run = common.run_ranks(args, setting.ranks, "--cell", cell, "--seed", str(args.seed))
        run["seed"] = args.seed
        results["cells"][key] = run
        print(f"  final held-out loss {run['final_loss']:.4f} ({run['runtime_s']:.0f} s)", flush=True)
        results["runtime_s"] = results.get("runtime_s", 0.0) + run["runtime_s"]
        common.save(args, results)
    results.setdefault("runtime_s", 0.0)
    return results


# ----------------------------------------------------------------------------- tables, figure


def load_all(results_dir: Path = common.RESULTS_DIR) -> dict[str, dict[str, Any]]:
    return {name: common.read_json(results_path(name, results_dir)) for name in SETTINGS
            if results_path(name, results_dir).is_file()}


def compare(data: dict[str, Any]) -> dict[str, Any]:
    """One setting's cells against data-parallel and against the best local cell (percent of
    held-out loss), and whether the library's defaults meet the bar there."""
    losses = {cell: run["final_loss"] for cell, run in data["cells"].items() if split_key(cell)[1] == SEED}
    dp = losses.get(SYNC)
    local = {cell: loss for cell, loss in losses.items() if cell != SYNC}
    best = min(local, key=local.get) if local else None
    rows = {cell: {"loss": loss, "vs_data_parallel": None if dp is None else 100 * (loss / dp - 1),
                   "vs_best": None if best is None or cell == SYNC else 100 * (loss / local[best] - 1)}
            for cell, loss in sorted(losses.items(), key=lambda kv: kv[1])}
    return {"rows": rows, "best": best, "data_parallel": dp, "defaults": rows.get(DEFAULTS)}


def cell_text(cell: str, run: dict[str, Any]) -> str:
    if cell == SYNC:
        return "data-parallel (`sync`)"
    if cell.startswith(DEFAULTS):  # what the defaults were when it ran: H and the outer optimizer's keywords
        outer = re.search(r"<class '[\w.]+\.(\w+)'>, (.*)\)$", run.get("outer_optimizer", ""))
        return f"the library's defaults: H = {run['sync_every'][0]}, " + (f"{outer[1]}({outer[2]})" if outer else "")
    return run.get("label") or cell


def table(name: str, data: dict[str, Any]) -> str:
    s, result = data["setting"], compare(data)
    rows = []
    for cell, row in result["rows"].items():
        run = data["cells"][cell]
        h = "-" if cell == SYNC else ", ".join(map(str, run.get("sync_every", []))) or "-"
        fmt = lambda v: "-" if v is None else f"{v:+.2f}%"  # noqa: E731
        loss = f"**{row['loss']:.4f}**" if cell == result["best"] else f"{row['loss']:.4f}"
        rows.append([f"`{cell}`", cell_text(cell, run), h, str(run.get("outer_rounds", "-")), loss,
                     fmt(row["vs_data_parallel"]), fmt(row["vs_best"])])
    head = (f"`{name}`: {common.describe(s, s['parameters'])}, R = {s['ranks']}, {s['steps']} inner steps per replica, "
            f"{s['tokens'] / 1e6:.1f}M tokens = {s['tokens_per_parameter']:.1f} tokens per parameter, inner AdamW "
            f"lr {s['lr']:g} ({s['warmup']} warm-up steps, cosine to a tenth), seed {s['seed']}")
    text = head + "\n\n" + common.md_table(
        ["cell", "what", "H", "outer rounds", "held-out loss", "vs data-parallel", "vs best local"], rows)
    seeds = seeds_table(name, data)
    return text + ("\n\n" + seeds if seeds else "")


def by_seed(data: dict[str, Any]) -> dict[str, dict[int, float]]:
    """Each cell's final held-out loss at every seed it ran."""
    out: dict[str, dict[int, float]] = {}
    for key, run in data["cells"].items():
        cell, seed = split_key(key)
        out.setdefault(cell, {})[seed] = run["final_loss"]
    return out


def seed_gaps(data: dict[str, Any], cell: str) -> dict[int, float]:
    """``cell`` against data-parallel at each seed both ran (percent of held-out loss)."""
    losses = by_seed(data)
    dp, own = losses.get(SYNC, {}), losses.get(cell, {})
    return {seed: 100 * (own[seed] / dp[seed] - 1) for seed in sorted(own) if seed in dp}


def seeds_table(name: str, data: dict[str, Any]) -> str:
    """The cells run at more than one seed: each seed's loss and its gap to data-parallel at
    that seed, their mean and spread."""
    rows = []
    for cell, losses in sorted(by_seed(data).items()):
        if len(losses) < 2:
            continue
        gaps = seed_gaps(data, cell) if cell != SYNC else {}
        per_seed = ", ".join(f"{seed}: {loss:.4f}" + (f" ({gaps[seed]:+.2f}%)" if seed in gaps else "")
                             for seed, loss in sorted(losses.items()))
        mean_gap = f"{statistics.fmean(gaps.values()):+.2f}%" if gaps else "-"
        spread = f"{min(gaps.values()):+.2f}% to {max(gaps.values()):+.2f}%" if gaps else "-"
        rows.append([f"`{cell}`", per_seed, f"{statistics.fmean(losses.values()):.4f}", mean_gap, spread])
    if not rows:
        return ""
    return (f"`{name}` over seeds (each seed its own initial model, data order and held-out set; the gap to "
            "data-parallel at the same seed):\n\n" + common.md_table(
                ["cell", "held-out loss by seed (vs data-parallel)", "mean loss", "mean gap", "spread of the gap"], rows))


def figure(data: dict[str, dict[str, Any]], out_dir: Path) -> str:
    """Held-out loss against tokens per setting: data-parallel dashed, the defaults thick."""
    plt = common.pyplot()
    names = list(data)
    fig, axes = plt.subplots(1, len(names), figsize=(4.8 * len(names), 3.8), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for ax, name in zip(axes.flat, names):
        s = data[name]["setting"]
        per_step = s["ranks"] * s["batch_size"] * s["seq_len"]
        for i, (cell, run) in enumerate(sorted(data[name]["cells"].items())):
            if split_key(cell)[1] != SEED:  # (the other seeds: the seeds table)
                continue
            points = [(p["inner_steps"] * per_step / 1e6, p["loss"]) for p in run["points"] if p["inner_steps"] > 0]
            style = dict(color="black", ls="--") if cell == SYNC else dict(color=cmap(i % 10), ls="-")
            ax.plot(*zip(*points), lw=2.2 if cell == DEFAULTS else 1.0, label=f"{cell}: {run['final_loss']:.3f}", **style)
        finals = [run["final_loss"] for run in data[name]["cells"].values()]
        ax.set_ylim(min(finals) - 0.05, min(finals) + 0.6)
        ax.set_title(f"{name}: {s['parameters'] / 1e6:.2f}M, R = {s['ranks']}, {s['tokens_per_parameter']:.1f} tok/param",
                     fontsize=9)
        ax.set_xlabel("tokens (millions)")
        ax.set_ylabel("held-out loss")
        ax.legend(fontsize=6)
    return common.save_figure(fig, out_dir / "local_quality.png")


def report(results_dir: Path = common.RESULTS_DIR) -> str:
    data = {name: d for name, d in load_all(results_dir).items() if d.get("cells")}
    if not data:
        return ""
    parts = [table(name, d) for name, d in data.items()]
    parts.append(f"![held-out loss against tokens]({LINK}{figure(data, results_dir)})")
    return "\n\n".join(parts)


# The projection's inputs (docs/loops.md, "What the default chooses at scale"): a round is a
# reduce-scatter and an all-gather of the model, each replica sending (R - 1) / R of it on each leg;
# 4-bit rounds send 0.134 of fp32's bytes (int4 blocks of 64 values with a bf16 scale each, measured
# on the wire: docs/loops.md, "Lighter outer rounds"). Inner steps: a 1B model on one replica of 8
# H100s takes about 1.9 s a step (the step of issue 71's example: 1M tokens a step at ~40% of the
# GPUs' bf16 peak); an 8B model on the same replica 8 times that (the FLOPs per token scale with
# the parameters, the tokens per step are the same).
WIRE_SHARE = {32: 1.0, 4: 0.134}
PROJECTED = ((1e9, 1.9), (8e9, 8 * 1.9))  # (parameters, seconds per inner step)
PROJECTED_REPLICAS = (2, 8)
PROJECTED_LINKS_GBIT = (1, 10, 100)


def round_seconds(parameters: float, replicas: int, link_gbit: float, bits: int = 4) -> float:
    """Seconds one outer round's traffic takes on a replica's link (each byte sent once)."""
    sent = 2 * (replicas - 1) / replicas * parameters * 4 * WIRE_SHARE[bits]
    return sent * 8 / (link_gbit * 1e9)


def chosen_every(step_seconds: float, round_time: float, bounds: tuple[int, int] = acco.options.AUTO_EVERY_BOUNDS,
                 rounds: int = 32) -> tuple[int, int]:
    """The H and the landing (steps after the launch) the default settles on for these
    measures: the library's own planner (the default landing), from the lower bound, round
    after round until it stops moving."""
    every, delay = bounds[0], acco.replicas.HIDDEN_STEPS
    for _ in range(rounds):
        choice = acco.replicas.plan_sync_every(every, bounds, step_seconds, round_time, acco.options.BLOCK_OR_HIDE,
                                               current_delay=delay)  # fmt: skip
        if (choice.sync_every, choice.sync_delay) == (every, delay):
            break
        every, delay = choice.sync_every, choice.sync_delay
    return every, delay


def projection() -> str:
    """docs/loops.md's projection: the H and landing the default chooses and the share of the
    wall time a replica then waits for rounds, for 1B and 8B parameters, 2 and 8 replicas, at
    1, 10 and 100 Gbit/s."""
    rows = []
    for parameters, step in PROJECTED:
        for replicas in PROJECTED_REPLICAS:
            cells = []
            for gbit in PROJECTED_LINKS_GBIT:
                t_round = round_seconds(parameters, replicas, gbit)
                every, delay = chosen_every(step, t_round)
                waited = max(0.0, t_round - delay * step)
                landing = "blocking" if delay == 0 else f"{delay} step late"
                cells.append(f"T {t_round:.3g} s: H = {every}, {landing}, waits "
                             f"{100 * waited / (every * step + waited):.1f}% "
                             f"(blocking H = 4: {100 * t_round / (4 * step + t_round):.0f}%)")
            sent = 2 * (replicas - 1) / replicas * parameters * 4 * WIRE_SHARE[4] / 1e9
            rows.append([f"{parameters / 1e9:g}B", str(replicas), f"{step:.3g} s", f"{sent:.2f} GB", *cells])
    bounds = acco.options.AUTO_EVERY_BOUNDS
    return ("What the defaults (`sync_every=\"auto\"` between "
            f"{bounds[0]} and {bounds[1]}, the default landing, 4-bit rounds) choose, by the library's own planner "
            "(`acco.replicas.plan_sync_every`, run round after round until it stops moving: "
            "`local_quality.chosen_every`), and the share of the wall time a replica then waits for rounds, "
            "`max(0, T - d t) / (H t + max(0, T - d t))` for a round landing `d` steps after its launch, beside blocking "
            "at H = 4. T: a round's bytes per replica (a ring reduce-scatter and all-gather of the model at 4 bits, "
            "0.134 of fp32's bytes) over the link, latency and the codec's own time left out; t: an inner step, "
            "1.9 s for 1B parameters on a replica of 8 H100s, 8 times that for 8B on the same replica:\n\n"
            + common.md_table(["parameters", "replicas", "inner step t", "sent per round and replica",
                               *(f"{g} Gbit/s" for g in PROJECTED_LINKS_GBIT)], rows))


def blocks(results: dict[str, Any], results_dir: Path) -> dict[str, str]:
    """docs/loops.md's blocks (report.py): the quality table from every setting's file in
    ``results_dir``, and the projection of what the default chooses at scale."""
    text = report(results_dir)
    return {"local-sizing": projection(), **({"local-quality": text} if text else {})}


def runtimes(results: dict[str, Any]) -> list[tuple[str, float]]:
    return [(f"local_quality {name.removeprefix('local_quality-')}", data["runtime_s"])
            for name, data in sorted(results.items()) if data.get("runtime_s")]


BENCHMARK = common.Benchmark("local_quality", __doc__, arguments, rank, sweep=sweep, check=check,
                             quick={"steps": 40}, stem="local_quality-{setting}")

if __name__ == "__main__":
    if "--report" in sys.argv[1:]:  # report.py (which imports this module) places every benchmark's blocks
        print(report())
        subprocess.run([sys.executable, str(common.BENCH_DIR / "report.py")], check=True)
    else:
        common.main(BENCHMARK)
