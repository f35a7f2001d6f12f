"""Speed pacing's rule, measured: how far apart two replicas' measured paces are when the
replicas are equally fast, and how long a replica waits for the others' hand-overs of a round,
behind a rate-limited link, at 32 and 4 bits, with the loop shapes users write.

    sudo $(which python) benchmarks/pacing_noise.py                  # 11 runs of 45 s: ~10 min (docs/loops.md)
    sudo $(which python) benchmarks/pacing_noise.py --quick          # 3 runs of 8 s
    python benchmarks/pacing_noise.py --table      # the table of docs/loops.md, from results/pacing_noise.json

Each run is two ranks of mode="local" with the library's defaults (sync_every=30, blocking
rounds, speed pacing) on the GPT of examples/train_gpt.py (0.8M parameters: a 32-bit round moves
about 3.3 MB, 1.5 s at 20 Mbit/s). The loop shapes:

- ``plain``: stops on ``opt.should_stop`` (``stop_after(seconds=...)``), no collective of its own;
- ``broadcast``: rank 0's clock broadcast at every inner step decides the stop (the shape of a time
  budget, a logged all-reduce of the loss, an evaluation's broadcast);
- ``eval``: ``plain``, and rank 0 alone spends 1 s outside ``step()`` every 25 inner steps (an
  evaluation, a checkpoint on one replica).

Per landed round it records each replica's pace two ways, from the same step-to-step times
(each less the time ``step()`` waited for a round): the mean over the round (what speed pacing
used before) and the median (what it uses now: acco's own report, ``RoundStats.replicas``);
the plan; and the seconds the comm lane waited for the other replicas' hand-overs (the round's
``totals`` phase) against the longest planned round at the last paces (``Pacing.stall_bound``'s
measure). The table: per run, the largest gap between the replicas' paces (1 - the slower's
speed as a share of the faster's), over the rounds after the first; whether every plan was equal;
and the longest hand-over wait in planned rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import common
from examples.train_gpt import Dist

__all__ = ["BENCHMARK", "RUNS", "table"]

# (name, link rate or None, outer bits, loop, rank 1's slowdown)
RUNS = [
    ("20mbit-b32-broadcast", "20mbit", 32, "broadcast", 1.0),
    ("20mbit-b32-plain", "20mbit", 32, "plain", 1.0),
    ("20mbit-b32-eval", "20mbit", 32, "eval", 1.0),
    ("20mbit-b4-broadcast", "20mbit", 4, "broadcast", 1.0),
    ("20mbit-b4-plain", "20mbit", 4, "plain", 1.0),
    ("unlimited-b32-broadcast", None, 32, "broadcast", 1.0),
    ("unlimited-b4-plain", None, 4, "plain", 1.0),
    ("unlimited-b4-eval", None, 4, "eval", 1.0),
    ("20mbit-b4-plain-slow3", "20mbit", 4, "plain", 3.0),
    ("20mbit-b32-plain-slow3", "20mbit", 32, "plain", 3.0),
    ("unlimited-b4-plain-slow1.5", None, 4, "plain", 1.5),
]
QUICK_RUNS = ["20mbit-b32-broadcast", "20mbit-b4-plain-slow3", "unlimited-b4-eval"]
EVAL_EVERY, EVAL_SECONDS = 25, 1.0


def arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--runs", nargs="+", default=None, choices=[r[0] for r in RUNS], help="default: all")
    add("--budget", type=float, default=45.0, help="seconds of training per run")
    add("--micro-batches", type=int, default=4, help="micro-batches per inner step")
    add("--case", default=None, help=argparse.SUPPRESS)  # the run a rank launch does
    add("--table", action="store_true", help="print docs/loops.md's table from results/pacing_noise.json; no runs")
    common.model_arguments(parser, common.ModelConfig(n_embd=128, seq_len=64))


def rank(args: argparse.Namespace, ctx: Dist) -> dict[str, Any]:
    """One run on every rank: train for the budget, record every step's time and every round."""
    name, rate, bits, loop, slow = next(r for r in RUNS if r[0] == args.case)
    config = common.model_config(args, seed=1337)
    method = common.build_method(f"local-h30-b{bits}", config, args.micro_batches)
    opt = method.local_opt
    train, _ = common.training_text(config.seq_len)
    next_batch = common.batches(train, config, config.seed + 1000 * ctx.rank)
    slowdown = slow if ctx.rank == 1 else 1.0
    if loop != "broadcast":
        opt.stop_after(seconds=args.budget)
    dist.barrier()
    start = last = time.perf_counter()
    steps: list[tuple[int, float]] = []  # (the round the step belongs to, its time less its wait for a round)
    clock = torch.zeros(1, dtype=torch.float64)
    while True:
        round_index, landed_before = opt.outer_rounds, len(opt.round_stats)
        common.train_round(method, next_batch, slowdown=slowdown)
        now = time.perf_counter()
        waited = sum(s.wait_seconds for s in list(opt.round_stats)[landed_before:])
        steps.append((round_index, now - last - waited))
        last = now
        if loop == "eval" and ctx.rank == 0 and len(steps) % EVAL_EVERY == 0:
            time.sleep(EVAL_SECONDS)
            last = time.perf_counter()
            steps[-1] = (round_index, steps[-1][1] + EVAL_SECONDS)  # the next step's time holds it
        if loop == "broadcast":
            clock.fill_(time.perf_counter() - start)
            dist.broadcast(clock, 0)
            if clock.item() > args.budget:
                break
        elif opt.should_stop:
            break
    elapsed = time.perf_counter() - start
    opt.finish()
    per_round: dict[int, list[float]] = {}
    for index, seconds in steps[1:]:  # the first step's time holds the start
        per_round.setdefault(index, []).append(seconds)
    own = {index: (statistics.fmean(t), statistics.median(t)) for index, t in per_round.items()}
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, own)
    rounds = []
    for stats in opt.round_stats:
        if stats.replicas is None:
            continue
        report = stats.replicas
        paces = [everyone[r].get(stats.index) for r in range(ctx.world_size)]
        rounds.append({"index": stats.index, "steps": list(report.steps), "acco_seconds": list(report.step_seconds),
                       "mean": [None if p is None else p[0] for p in paces],
                       "median": [None if p is None else p[1] for p in paces],
                       "totals_s": stats.phase_seconds.get("totals", 0.0), "lane_s": stats.lane_seconds})
    return {"run": name, "rate": rate, "bits": bits, "loop": loop,
            "slowdown": slow, "elapsed_s": elapsed, "inner_steps": len(steps), "rounds": rounds,
            "config": config.as_dict()}


def gap(paces: list[float | None]) -> float | None:
    """1 - the slowest replica's speed as a share of the fastest's."""
    if any(p is None or p <= 0 for p in paces):
        return None
    return 1.0 - min(paces) / max(paces)


def summary(run: dict[str, Any]) -> dict[str, Any]:
    rounds = run["rounds"]
    later = rounds[1:-1]  # the first round holds the start-up; finish()'s last round carries nothing
    mean_gaps = [g for g in (gap(r["mean"]) for r in later) if g is not None]
    median_gaps = [g for g in (gap(r["acco_seconds"]) for r in later) if g is not None]
    planned = []
    for previous, current in zip(rounds, rounds[1:-1]):
        longest = max(steps * s for steps, s in zip(current["steps"], previous["acco_seconds"]))
        if longest > 0:
            planned.append(current["totals_s"] / longest)
    return {
        "rounds": len(rounds),
        "equal_plans": all(len(set(r["steps"])) == 1 for r in rounds[:-1]),
        "plans": sorted({tuple(r["steps"]) for r in rounds[:-1]}),
        "mean_gap_max": max(mean_gaps, default=None),
        "median_gap_max": max(median_gaps, default=None),
        "handover_wait_max_rounds": max(planned, default=None),
        "round_s": statistics.median(r["lane_s"] for r in rounds) if rounds else None,
    }


def table(results: dict[str, Any]) -> str:
    rows = []
    for run in results["runs"]:
        s = summary(run)
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        plans = "equal" if s["equal_plans"] else " ".join(str(list(p)) for p in s["plans"])
        rows.append([run["run"], f"{run['elapsed_s']:.1f}", str(s["rounds"]), fmt(s["round_s"]), fmt(s["mean_gap_max"]),
                     fmt(s["median_gap_max"]), plans, fmt(s["handover_wait_max_rounds"])])
    return common.md_table(["run", "ended after (s)", "rounds", "round on the lane (s, median)",
                            "largest pace gap, mean of a round's steps (before)",
                            "largest pace gap, median (now)", "plans", "longest wait for hand-overs (planned rounds)"],
                           rows)


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    names = args.runs or (QUICK_RUNS if args.quick else [r[0] for r in RUNS])
    runs = []
    for name in names:
        rate = next(r[1] for r in RUNS if r[0] == name)
        started = time.perf_counter()
        result = common.run_ranks(args, 2, "--case", name, rate=rate, netns=True)
        print(f"{name}: {time.perf_counter() - started:.0f} s", flush=True)
        runs.append(result)
    results = {"runs": runs, "budget_s": args.budget}
    print(table(results))
    return results


BENCHMARK = common.Benchmark(name="pacing_noise", doc=__doc__, arguments=arguments, rank=rank, sweep=sweep,
                             quick={"budget": 8.0})

if __name__ == "__main__":
    if "--table" in sys.argv[1:]:
        print(table(common.read_json(common.RESULTS_DIR / "pacing_noise.json")))
    else:
        common.main(BENCHMARK, None)
