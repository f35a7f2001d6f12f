"""Time to loss: held-out loss against wall-clock time for every method, each given the same
wall-clock budget behind a rate-limited network, at the rate where one round of
communication takes as long as one round of compute and at three times that.

    sudo $(which python) benchmarks/time_to_loss.py                          # 2 rates x 12 methods x 2 seeds: ~32 min
    sudo $(which python) benchmarks/time_to_loss.py --rates 440mbit 140mbit  # given rates: no calibration
    sudo $(which python) benchmarks/time_to_loss.py --quick    # 1 seed, 1 rate, 6 s per method, results/scratch/
    sudo $(which python) benchmarks/time_to_loss.py --slowdown 1:3 --rates 425mbit --budget 20   # rank 1 3x slower
    sudo $(which python) benchmarks/time_to_loss.py --methods local-h16-b4 --links comm~compute --rates 50mbit \
        --seeds 1337 --local-stop broadcast --cpu-hogs 1    # a per-step collective, beside a busy process
    sudo $(which python) benchmarks/time_to_loss.py --methods local-h8-d0 local-h30-d0 --links comm~compute \
        --rates 500mbit:15,20mbit --budget 45 --seeds 1337   # a link that slows from 500 to 20 Mbit/s after 15 s

DiLoCo runs through torchft (``pip install -e '.[bench]'``). How it measures: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import netns
import throughput
import common
from examples.train_gpt import Dist, eval_batches, evaluate, parse_slowdown

import torch
import torch.distributed as dist

__all__ = ["BENCHMARK", "AgreedClock", "blocks", "mixed_runs", "runtimes", "summary", "targets", "warmup_constant"]

TTL_METHODS = ["ddp-zero1", "ddp-adamw", "acco-sync", "acco-dpu", "acco", "acco-bf16", "acco-fp8", "acco-aww",
               "acco-aww-bf16", "acco-aww-fp8", "diloco-h10", "diloco-h50"]
# With one rank slower (--slowdown): the peers a user would pick, and acco's ready() loop.
MIXED_METHODS = ["ddp-zero1", "acco-sync", "acco-aww", "acco-aww-fp8", "acco-aww-balanced", "acco-aww-fp8-balanced",
                 "diloco-h10"]
UNLIMITED = "unlimited"
RATE_LABELS = ("comm~compute", "comm~3x")  # calibrated rates (throughput.py's calibration)
LINKS = (UNLIMITED, *RATE_LABELS)
BASELINE = "ddp-zero1"
# The issue's bars: the best acco configuration reaches ZeRO-1's final loss within this share
# of the budget; on equal ranks per link, with one rank slower per (ranks, factor, link).
BAR = {"comm~compute": 0.6, "comm~3x": 0.4}
MIXED_BAR = {(2, 3, UNLIMITED): 0.6}
# Two runs of the same arithmetic (acco `sync` and ZeRO-1) differ by float reordering only:
# a loss this close to the target has reached it.
TOLERANCE = 1e-5


def arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--links", nargs="+", default=None, choices=LINKS,
        help=f"networks to run on (default: {' '.join(RATE_LABELS)}; with --slowdown: {UNLIMITED} comm~compute)")
    add("--rates", nargs="+", default=None, metavar="RATE",
        help="tc rates for the rate-limited --links, in their order (e.g. 440mbit 140mbit): skips calibration; a "
             "rate may be a schedule, e.g. 500mbit:15,20mbit (benchmarks/netns.py), started again at each method")
    add("--methods", nargs="+", default=None, type=common.method_name, metavar="METHOD",
        help=f"default: {', '.join(TTL_METHODS)}; with --slowdown: {', '.join(MIXED_METHODS)}; any diloco-hN")
    add("--slowdown", default=None, metavar="RANK:FACTOR",
        help="rank RANK's micro-batches take FACTOR times longer (it sleeps FACTOR - 1 times each one's CPU time)")
    add("--slow", type=int, default=None, metavar="FACTOR", help="the same as --slowdown 1:FACTOR")
    add("--lr-follows-batch", choices=["none", "sqrt", "linear"], default="none",
        help="acco: after each committed update, scale the next update's lr by (its global weight / the "
             "fixed loop's)^0.5 or ^1 (the README's recipe for the ready() loop's larger updates)")
    add("--round-cap", type=int, default=None, metavar="N",
        help="the ready() loop's most micro-batches per round (then step() waits for the round in flight)")
    add("--seeds", type=int, nargs="+", default=[1337, 7])
    add("--budget", type=float, default=30.0, help="seconds of training per method (the clock's budget)")
    add("--steps", type=int, default=None,
        help="stop every method after this many rounds (local and DiLoCo methods: inner steps) instead, at equal "
             "steps; the budget still caps the time")
    add("--eval-every", type=float, default=None, help="seconds between evaluations (default: budget / 8)")
    add("--eval-batches", type=int, default=32)
    add("--micro-batches", type=common.even, default=4, help="micro-batches per rank per optimizer update")
    add("--lr", type=float, default=3e-3)
    add("--warmup", type=int, default=10, help="optimizer updates (DiLoCo: inner steps) of linear warm-up")
    add("--grad-clip", type=float, default=1.0, help="0: off")
    common.model_arguments(parser, common.ModelConfig(n_embd=128, seq_len=64))
    add("--local-stop", choices=["agreement", "broadcast"], default="agreement",
        help="local methods: stop on the optimizer's agreement (stop_after), or on rank 0's clock broadcast at "
             "every inner step (a loop with a collective of its own at every step)")
    add("--cpu-hogs", type=int, default=0, metavar="N",
        help="run beside N busy processes (sh -c 'while :; do :; done'), as on a node where other work shares the "
             "cores; the measurement then does not wait for a quiet machine")
    add("--ranks", type=int, default=2)
    add("--max-quiet-wait", type=float, default=900.0,
        help="seconds to wait, before each method, for other processes to leave the CPU")
    add("--seed", type=int, default=None, help=argparse.SUPPRESS)  # set by the driver for its rank launches


def check(args: argparse.Namespace) -> str | None:
    args.eval_every = args.eval_every or args.budget / (4 if args.quick else 8)
    args.seeds = args.seeds[:1] if args.quick else args.seeds
    if args.slow is not None:
        if args.slowdown is not None:
            return "give --slow or --slowdown, not both"
        args.slowdown = f"1:{args.slow}"
    args.slow = parse_slowdown(args.slowdown)  # (rank, factor) or None
    args.methods = args.methods or (MIXED_METHODS if args.slow else TTL_METHODS)
    args.links = args.links or ([UNLIMITED, RATE_LABELS[0]] if args.slow else list(RATE_LABELS))
    if args.quick:
        args.links = args.links[:1]
    limited = [link for link in args.links if link != UNLIMITED]
    if args.budget <= 0 or args.eval_every <= 0:
        return f"--budget and --eval-every must be positive, got {args.budget} and {args.eval_every}"
    for rate in args.rates or []:
        try:
            netns.parse_rates(rate)
        except ValueError as error:
            return f"--rates: {error}"
    if args.rates is not None and len(args.rates) != len(limited):
        return f"--rates takes one rate per rate-limited link ({', '.join(limited) or 'none'}), got {args.rates}"
    if args.slow is not None and not 0 <= args.slow[0] < args.ranks:
        return f"--slowdown {args.slowdown}: rank {args.slow[0]} is not one of the {args.ranks} ranks"
    if args.cpu_hogs < 0:
        return f"--cpu-hogs must be >= 0, got {args.cpu_hogs}"
    if args.cpu_hogs:
        args.max_quiet_wait = 0.0
    if args.round_cap is not None and args.round_cap < args.micro_batches // 2:
        return f"--round-cap must be at least a round's micro-batches ({args.micro_batches // 2}), got {args.round_cap}"
    if args.slow is not None and "--out" not in args.argv and "RANK" not in os.environ:
        args.out = args.out.with_name(f"time_to_loss-slow{args.slow[1]}x-{args.ranks}ranks.json")
    if any(common.method_spec(m).family == "diloco" for m in args.methods) and common.torchft_version() is None:
        return (f"DiLoCo runs through torchft, which does not import here: {common.TORCHFT_INSTALL} (or leave the "
                "diloco methods out)")
    return None


def warmup_constant(warmup: int) -> Callable[[int], float]:
    """LambdaLR factor: linear warm-up over ``warmup`` updates, then the peak, constant."""
    return lambda update: min(1.0, (update + 1) / (warmup + 1))


class AgreedClock:
    """Training seconds since it was made, pauses left out; and the ranks' clocks, agreed one
    round late by a non-blocking all-reduce on the default group, so every rank takes the
    same decisions at the same boundary and none waits on the busy link. Collective: every
    rank calls ``exchange()`` at every round boundary and ``close()`` once."""

    def __init__(self) -> None:
        self._start, self._paused = time.perf_counter(), 0.0
        self._value = torch.zeros(1, dtype=torch.float64)
        self._work: Any = None
        self.previous = 0.0  # the agreed clock one boundary earlier (every clock starts after a barrier)

    def elapsed(self) -> float:
        return time.perf_counter() - self._start - self._paused

    def pause(self, seconds: float) -> None:
        self._paused += seconds

    def budget_reached(self, agreed: float | None, budget: float) -> bool:
        """Whether this boundary ends the budget: the first boundary whose clock is expected
        at or past it, from the agreed clocks of the two previous boundaries, so the
        overshoot is a fraction of a round, not two rounds."""
        if agreed is None:
            return False
        last_round, self.previous = agreed - self.previous, agreed
        return agreed + last_round >= budget

    def exchange(self, elapsed: float) -> float | None:
        """Start agreeing on ``elapsed``; the previous boundary's agreed clock (the largest
        over ranks), or None at the first boundary."""
        agreed = None
        if self._work is not None:
            self._work.wait()
            agreed = float(self._value.item())
        self._value = torch.tensor([elapsed], dtype=torch.float64)
        self._work = dist.all_reduce(self._value, op=dist.ReduceOp.MAX, async_op=True)
        return agreed

    def close(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None


def follow_batch(method: common.AccoMethod, args: argparse.Namespace, scheduler: torch.optim.lr_scheduler.LambdaLR,
                 weight: float) -> None:
    """``--lr-follows-batch``: the next update's lr is the schedule's times a power of
    ``weight`` (the last committed update's global weight: the step it made in the public
    ``committed_weight``) over a fixed-loop update's."""
    if args.lr_follows_batch == "none":
        return
    fixed = method.micro_batches_per_update * dist.get_world_size() * (
        method.config.batch_size if method.spec.balanced else 1)  # one weight per micro-batch, or per sequence
    scale = (weight / fixed) ** (0.5 if args.lr_follows_batch == "sqrt" else 1.0)
    for group, lr in zip(method.opt.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr * scale


def started_training(name: str) -> None:
    """Rank 0 marks a method's start for a rate schedule (``--rates 500mbit:15,20mbit``:
    benchmarks/netns.py starts it again from its first rate at each method)."""
    path = os.environ.get("ACCO_BENCH_START_FILE")
    if path and dist.get_rank() == 0:
        with open(path, "a", encoding="utf-8") as file:
            file.write(f"{name}\n")


def run_method(name: str, args: argparse.Namespace, config: common.ModelConfig, train_data: torch.Tensor,
               eval_set: list[tuple[torch.Tensor, torch.Tensor]], initial_loss: float) -> dict[str, Any]:
    """Train ``name`` for the budget; its evaluation points and what they cost."""
    rank, world = dist.get_rank(), dist.get_world_size()
    setup_started = time.perf_counter()
    try:
        method = common.build_method(name, config, args.micro_batches, schedule=warmup_constant(args.warmup))
    except common.UnsupportedMethod as error:
        return {"method": name, "skipped": str(error)}
    # DiLoCo schedules its inner steps itself; the others step theirs per committed update.
    scheduler = torch.optim.lr_scheduler.LambdaLR(method.opt, warmup_constant(args.warmup)) if method.opt else None
    slowdown = float(args.slow[1]) if args.slow is not None and args.slow[0] == rank else 1.0
    sized = config
    if slowdown > 1.0 and method.spec.balanced:  # a micro-batch the slow rank computes in a fast one's time
        sized = dataclasses.replace(config, batch_size=max(1, round(config.batch_size / slowdown)))
    next_batch = common.batches(train_data, sized, config.seed + 1000 * rank)  # the same stream in every method
    params = list(method.module.parameters())
    setup_s = time.perf_counter() - setup_started
    window = common.Window(args.max_quiet_wait)
    window.open()
    started_training(name)
    clock = AgreedClock()
    snapshots: list[tuple[dict[str, Any], list[torch.Tensor]]] = []
    computed = rounds = counted = 0
    committed_weight = 0.0
    next_eval, due, last_commit = args.eval_every, False, 0.0

    def snapshot(elapsed: float) -> None:
        started = time.perf_counter()
        samples = round(method.committed_micro_batches(counted)) * args.batch_size
        snapshots.append(({"elapsed_s": elapsed, "updates": method.committed_updates(counted), "samples": samples},
                          method.eval_params(params)))
        clock.pause(time.perf_counter() - started)

    # acco's local steps stop on the optimizer's own agreement, decided at an outer round (the
    # agreed clock's all-reduce at every inner step would put paced replicas back in lockstep), or
    # with --local-stop broadcast on rank 0's clock, broadcast at every inner step.
    local = method.local_opt if method.spec.family == "local" else None
    broadcast = local is not None and args.local_stop == "broadcast"
    rank0_clock = torch.zeros(1, dtype=torch.float64)
    plans: list[list[int]] = []  # local methods: the pacing plan after each landed outer round
    if local is not None and not broadcast:
        local.stop_after(steps=args.steps, seconds=args.budget)
    while True:
        record = common.train_round(method, next_batch, slowdown=slowdown, max_micro_batches=args.round_cap)
        computed, rounds, now = computed + len(record.losses), rounds + 1, clock.elapsed()
        if record.committed:
            counted, last_commit = counted + 1, now
            if scheduler is not None:
                scheduler.step()
            if isinstance(method, common.AccoMethod):
                follow_batch(method, args, scheduler, method.opt.committed_weight - committed_weight)
                committed_weight = method.opt.committed_weight
        if local is not None:
            if record.committed:
                plans.append(local.replica_steps)
            if broadcast:
                rank0_clock.fill_(now)
                dist.broadcast(rank0_clock, 0)
                if rank0_clock.item() >= args.budget or (args.steps is not None and rounds >= args.steps):
                    break
            elif local.should_stop:
                break
            if record.committed and now >= next_eval:  # rank 0's snapshots are the ones evaluated
                snapshot(now)
                next_eval = (math.floor(now / args.eval_every) + 1) * args.eval_every
            continue
        agreed = clock.exchange(now)
        if clock.budget_reached(agreed, args.budget) or (args.steps is not None and rounds >= args.steps):
            break
        if agreed is not None and agreed >= next_eval:  # due at the next committed boundary
            due, next_eval = True, (math.floor(agreed / args.eval_every) + 1) * args.eval_every
        if record.committed and due:
            snapshot(now)
            due = False
    stopped_s = clock.elapsed()
    clock.close()
    if method.finish():  # acco, dpu: the update in flight lands, on the clock
        counted, last_commit = counted + 1, clock.elapsed()
    end_s, measured = clock.elapsed(), window.close()
    if not snapshots or snapshots[-1][0]["elapsed_s"] != last_commit:
        snapshot(last_commit)  # the committed parameters at the end, from when they were committed
    updates = method.committed_updates(counted)

    eval_started = time.perf_counter()  # every copy, each on one rank, nothing else running
    if local is not None:  # every replica lands the same rounds; each took its snapshots on its own clock
        snapshots = snapshots if rank == 0 else []
        count = int(common.all_reduce([len(snapshots)], op="max")[0])
    losses = [0.0] * (len(snapshots) if local is None else count)
    for i, (_, copy) in enumerate(snapshots):
        if local is not None or i % world == rank:
            with torch.no_grad():
                for p, q in zip(params, copy):
                    p.copy_(q)
            losses[i] = evaluate(method.module, eval_set)
    losses = common.all_reduce(losses)
    points = [{"elapsed_s": 0.0, "updates": 0, "samples": 0, "loss": initial_loss}]
    points += [{**info, "loss": loss} for (info, _), loss in zip(snapshots, losses)]
    lo_bytes = measured["lo_bytes"]
    result: dict[str, Any] = {
        "method": name, "points": points, "final_loss": points[-1]["loss"], "stopped_s": stopped_s, "end_s": end_s,
        "updates": updates, "rounds": rounds, "updates_per_s": updates / end_s,
        "samples_per_s": points[-1]["samples"] / end_s, "micro_batches_computed": common.all_reduce([computed])[0],
        "micro_batches_per_update": points[-1]["samples"] / args.batch_size / world / updates if updates else None,
        "lo_bytes": lo_bytes, "foreign_cpu_share": measured["foreign_cpu_share"],
        "waited_for_quiet_s": measured["waited_for_quiet_s"], "setup_s": setup_s,
        "eval_s": time.perf_counter() - eval_started,
    }
    if lo_bytes is not None and updates:
        result["lo_bytes_per_update"] = lo_bytes / updates
    if method.spec.family == "diloco":
        result.update(sync_every=method.sync_every, outer_steps=method.outer_steps, inner_steps=method.inner_steps,
                      implementation=f"torchft {common.torchft_version()}")
        if lo_bytes is not None and method.outer_steps:
            result["lo_bytes_per_sync"] = lo_bytes / method.outer_steps
    if method.spec.family == "local":
        result.update(sync_every=method.sync_every, sync_delay=method.sync_delay, inner_steps=method.inner_steps,
                      outer_steps=method.local_opt.outer_rounds, local_stop=args.local_stop, plans=plans,
                      round_every=method.round_every(),
                      paces=[list(s.replicas.step_seconds) for s in method.local_opt.round_stats
                             if s.replicas is not None and not any(s.replicas.finishing)],
                      pacing=method.local_opt.options.local.pacing, **replica_telemetry(method.local_opt, end_s))
        if lo_bytes is not None and method.local_opt.outer_rounds:
            result["lo_bytes_per_sync"] = lo_bytes / method.local_opt.outer_rounds
    if method.round_stats():
        result["lane"] = common.lane_summary(method.round_stats())
    method.close()
    return result


def replica_telemetry(opt: Any, end_s: float) -> dict[str, Any]:
    """Per replica (by rank, one replica a rank): inner steps, mean inner steps and tokens per
    outer round, and the seconds its step() waited for outer rounds. Collective."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reports = [s.replicas for s in opt.round_stats if s.replicas is not None and not any(s.replicas.finishing)]
    own = [0.0] * (4 * world)
    own[4 * rank: 4 * rank + 4] = [
        float(opt.num_updates + opt.skipped_updates),
        statistics.fmean(r.steps[opt.replica] for r in reports) if reports else 0.0,
        statistics.fmean(r.weights[opt.replica] for r in reports) if reports else 0.0,
        # (the wait for a round, and the wait for the others' hand-overs before a late landing)
        math.fsum(s.wait_seconds + s.patience_seconds for s in opt.round_stats if not math.isnan(s.wait_seconds)),
    ]
    values = common.all_reduce(own)
    by_rank = [values[4 * r: 4 * r + 4] for r in range(world)]
    return {"inner_steps_by_rank": [int(v[0]) for v in by_rank], "steps_per_round_by_rank": [v[1] for v in by_rank],
            "tokens_per_round_by_rank": [v[2] for v in by_rank], "wait_s_by_rank": [v[3] for v in by_rank],
            "wait_share_by_rank": [v[3] / end_s for v in by_rank]}  # fmt: skip


def rank(args: argparse.Namespace, ctx: Dist) -> dict[str, Any]:
    seed = args.seed if args.seed is not None else args.seeds[0]
    config = common.model_config(args, seed=seed)
    train_data, held_out = common.training_text(config.seq_len)
    eval_set = eval_batches(held_out, args.eval_batches, config.batch_size, config.seq_len, seed, torch.device("cpu"))
    initial_loss = evaluate(common.build_model(config), eval_set)  # every method starts from this model
    common.warm_up(config, common.batches(train_data, config, 0))
    runs: dict[str, Any] = {}
    for name in common.rotated(args.methods, args.seeds.index(seed) if seed in args.seeds else 0):
        started = time.perf_counter()
        runs[name] = r = run_method(name, args, config, train_data, eval_set, initial_loss)
        gc.collect()  # the method's model, optimizer and buffers go before the next one
        if ctx.master:
            print(f"[{args.label}] {name:14s} " + (f"skipped: {r['skipped']}" if "skipped" in r else
                  f"final loss {r['final_loss']:.4f} after {r['end_s']:.1f} s, {r['updates']} updates, "
                  f"{r['micro_batches_per_update'] or 0:.1f} micro-batches per update "
                  f"({time.perf_counter() - started:.0f} s in all)"), flush=True)
    return {"label": args.label, "seed": seed, "ranks": ctx.world_size, "initial_loss": initial_loss,
            "rate": os.environ.get("ACCO_BENCH_RATE", "not limited by the benchmark"),
            "threads_per_rank": torch.get_num_threads(), "methods": runs}


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    config = common.model_config(args, seed=args.seeds[0])
    results: dict[str, Any] = {
        "config": {**config.as_dict(), "seeds": args.seeds, "ranks": args.ranks, "budget_s": args.budget,
                   "eval_every_s": args.eval_every, "eval_batches": args.eval_batches,
                   "micro_batches_per_update": args.micro_batches, "warmup_updates": args.warmup,
                   "slowdown": None if args.slow is None else {"rank": args.slow[0], "factor": args.slow[1]},
                   "round_cap": args.round_cap, "lr_follows_batch": args.lr_follows_batch,
                   "local_stop": args.local_stop, "cpu_hogs": args.cpu_hogs,
                   "schedule": "linear warm-up, then constant", "methods": args.methods,
                   "diloco": {"implementation": "torchft", "torchft": common.torchft_version(),
                              "outer_optimizer": "SGD, Nesterov momentum 0.9, lr 0.7"},
                   "parameters": sum(p.numel() for p in common.build_model(config).parameters())},
        "command": " ".join(["benchmarks/time_to_loss.py", *args.argv]),
        "rates": {}, "runs": [],
    }
    limited = [link for link in args.links if link != UNLIMITED]
    if limited and args.rates is None:
        targs = throughput.BENCHMARK.parse([
            "--ranks", str(args.ranks), "--rates", *limited, "--micro-batches", str(args.micro_batches),
            "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--seq-len", str(args.seq_len),
            "--batch-size", str(args.batch_size)])
        results["calibration"] = throughput.calibrate_rates(targs, args.ranks)
        results["calibration_runtime_s"] = time.perf_counter() - started
        rates = {name: results["calibration"]["targets"][name]["rate"] for name in limited}
    else:
        rates, results["calibration"] = dict(zip(limited, args.rates or [])), {"given": True}
    results["rates"] = {link: rates.get(link, UNLIMITED) for link in args.links}
    for name, rate in results["rates"].items():
        for seed in args.seeds:
            print(f"time to loss: {name} ({rate}), seed {seed}", flush=True)
            with common.cpu_hogs(args.cpu_hogs):
                run = common.run_ranks(args, args.ranks, "--seed", str(seed), "--label", f"{name} seed {seed}",
                                       rate=None if rate == UNLIMITED else rate, netns=True)
            run.update(label=name, rate=rate)
            results["runs"].append(run)
            results["runtime_s"] = time.perf_counter() - started
            common.save(args, results)  # after every launch, so a long sweep keeps what it has
    results["summary"] = summary(results)
    print(table(results))
    return results


def first_crossing(points: list[dict[str, Any]], target: float, key: str = "elapsed_s") -> float | None:
    """The first ``key`` (time or updates) at which the loss curve reaches ``target`` (within
    ``TOLERANCE``), linear between the two evaluations around it; None if it never does."""
    for i, point in enumerate(points):
        if point["loss"] > target + TOLERANCE:
            continue
        if i == 0:
            return point[key]
        before = points[i - 1]
        drop = before["loss"] - point["loss"]
        share = (before["loss"] - target - TOLERANCE) / drop if drop > 0 else 1.0
        return before[key] + share * (point[key] - before[key])
    return None


def loss_at(points: list[dict[str, Any]], value: float, key: str = "updates") -> float | None:
    """The loss curve at ``key`` = ``value`` (linear between evaluations); None past its end."""
    for before, point in zip(points, points[1:]):
        if before[key] <= value <= point[key]:
            span = point[key] - before[key]
            share = (value - before[key]) / span if span > 0 else 1.0
            return before["loss"] + share * (point["loss"] - before["loss"])
    return None


def median(values: list[float | None]) -> float | None:
    """Median with None (not reached, not measured) as +infinity; None if that is the answer."""
    if not values:
        return None
    middle = statistics.median(math.inf if v is None else v for v in values)
    return None if math.isinf(middle) else middle


def summary(data: dict[str, Any]) -> dict[str, Any]:
    """Per rate and method: time to DDP + ZeRO-1's final held-out loss (fraction of the
    budget, per seed, median), and what explains it."""
    out: dict[str, Any] = {}
    by_label: dict[str, list[dict[str, Any]]] = {}
    for run in data["runs"]:
        by_label.setdefault(run["label"], []).append(run)
    for rate, runs in by_label.items():
        goals = {str(r["seed"]): {"loss": base["final_loss"], "updates": base["updates"]}
                 for r in runs if "points" in (base := r["methods"].get(BASELINE, {}))}
        methods: dict[str, Any] = {}
        for name in [n for n in dict.fromkeys([*common.METHODS, *(m for r in runs for m in r["methods"])])
                     if any(n in r["methods"] for r in runs)]:
            done = [r for r in runs if "points" in r["methods"].get(name, {})]
            skipped = [r["methods"][name]["skipped"] for r in runs if "skipped" in r["methods"].get(name, {})]
            entry: dict[str, Any] = {"skipped": skipped[0]} if skipped else {}
            methods[name] = entry
            if not done:
                continue
            curves = [(r["methods"][name]["points"], goals[str(r["seed"])]) for r in done if str(r["seed"]) in goals]
            fractions = [None if t is None else t / data["config"]["budget_s"]
                         for t in (first_crossing(points, goal["loss"]) for points, goal in curves)]
            per_seed = {key: [r["methods"][name].get(key) for r in done] for key in (
                "final_loss", "end_s", "updates_per_s", "samples_per_s", "micro_batches_per_update",
                "lo_bytes_per_update", "updates", "foreign_cpu_share")}
            entry.update(seeds=[r["seed"] for r in done], time_fraction=fractions,
                         median_time_fraction=median(fractions),
                         reached=sum(f is not None for f in fractions),
                         updates_to_target=[first_crossing(p, g["loss"], key="updates") for p, g in curves],
                         loss_at_baseline_updates=[loss_at(p, g["updates"]) for p, g in curves],
                         final_loss=per_seed["final_loss"], median_final_loss=median(per_seed["final_loss"]),
                         end_s=per_seed["end_s"])
            for key in ("updates_per_s", "samples_per_s", "micro_batches_per_update", "lo_bytes_per_update",
                        "updates", "foreign_cpu_share"):
                entry[key] = median([v for v in per_seed[key] if v is not None])
            entry.update({k: v for k, v in done[0]["methods"][name].items()
                          if k in ("implementation", "sync_every", "lo_bytes_per_sync")})
        acco = {n: e["median_time_fraction"] for n, e in methods.items()
                if n.startswith("acco") and e.get("median_time_fraction") is not None}
        out[rate] = {"rate": runs[0]["rate"], "targets": goals, "methods": methods,
                     "best_acco": min(acco, key=acco.get) if acco else None}
    return out


def spread(values: list[float | None], fmt: str) -> str:
    """Median (min-max) of the seeds' values."""
    present = [v for v in values if v is not None]
    if len(present) < 2:
        return format(present[0], fmt) if present else "-"
    return f"{format(statistics.median(present), fmt)} ({format(min(present), fmt)}-{format(max(present), fmt)})"


def fraction_cell(entry: dict[str, Any]) -> str:
    fractions = entry.get("time_fraction", [])
    if not fractions:
        return ""
    if entry["median_time_fraction"] is None:
        shown = ", ".join("not reached" if f is None else f"{f:.2f}" for f in fractions)
        return f"not reached ({shown})" if len(fractions) > 1 else "not reached"
    if len(fractions) == 1:
        return f"{fractions[0]:.2f}"
    reached = [f for f in fractions if f is not None]
    missed = f", {len(fractions) - len(reached)} not reached" if len(reached) < len(fractions) else ""
    return f"**{entry['median_time_fraction']:.2f}** ({min(reached):.2f}-{max(reached):.2f}{missed})"


def table(data: dict[str, Any]) -> str:
    """One table per rate: time to ZeRO-1's final loss and what explains it."""
    out = []
    for rate, s in (data.get("summary") or summary(data)).items():
        rows = []
        for name, e in s["methods"].items():
            if "final_loss" not in e:
                continue  # not run: listed under the tables, with the reason
            per_byte = f"{e['lo_bytes_per_update'] / 1e6:.2f}" if e.get("lo_bytes_per_update") else "-"
            if e.get("lo_bytes_per_sync"):
                per_byte += f" ({e['lo_bytes_per_sync'] / 1e6:.1f} per sync)"
            rows.append([method_label(data, name), fraction_cell(e), spread(e["final_loss"], ".3f"),
                         f"{e['updates_per_s']:.2f}" if e.get("updates_per_s") is not None else "-",
                         f"{e['micro_batches_per_update']:.1f}" if e.get("micro_batches_per_update") else "-",
                         spread(e["updates_to_target"], ".0f"), spread(e["loss_at_baseline_updates"], ".3f"),
                         f"{e['samples_per_s']:.1f}" if e.get("samples_per_s") is not None else "-", per_byte])
        goals = ", ".join(f"seed {seed}: {t['loss']:.3f} after {t['updates']} updates"
                          for seed, t in s["targets"].items())
        out += [f"**{rate} ({common.rate_text(s['rate'])})**: ZeRO-1's final held-out loss {goals}.", "",
                common.md_table(
            ["method", "time to ZeRO-1's final loss (fraction of the budget)", "final held-out loss", "updates/s",
             "micro-batches per update", "updates to ZeRO-1's final loss", "loss at ZeRO-1's update count",
             "samples/s", "loopback MB per update"], rows), ""]
    return "\n".join(out)


def section(data: dict[str, Any]) -> str:
    cfg, s = data["config"], data.get("summary") or summary(data)
    intro = (f"{cfg['ranks']} ranks, {common.describe(cfg, cfg['parameters'])}, {cfg['micro_batches_per_update']} "
             f"micro-batches per rank per update, AdamW lr {cfg['lr']} ({cfg['schedule']}, {cfg['warmup_updates']} "
             f"updates of warm-up), clipping {cfg['max_grad_norm']}; **{cfg['budget_s']:.0f} s of training per "
             f"method**, held-out loss on {cfg['eval_batches']} fixed batches every {cfg['eval_every_s']:.2f} s of "
             f"training and at the end; seeds {', '.join(map(str, cfg['seeds']))}; DiLoCo: torchft "
             f"{cfg['diloco']['torchft']}'s `DiLoCo`. Cells with a range: median (min-max) over the seeds.")
    calibration = data.get("calibration", {})
    if calibration.get("targets"):
        base = calibration["unlimited"]
        rates = "; ".join(f"{name}: {common.rate_text(t['rate'])} (communication alone "
                          f"{t['comm_s_per_round'] * 1000:.0f} ms per round, {t['ratio']:.2f} x compute)"
                          for name, t in calibration["targets"].items())
        intro += (f" Calibration: one acco round computes in {base['compute_s_per_round'] * 1000:.0f} ms and moves "
                  f"{base['lo_bytes_per_round'] / 1e6:.1f} MB on the loopback; {rates}.")
    elif data.get("rates"):
        intro += " Rates given on the command line: " + ", ".join(
            f"{name} {common.rate_text(rate)}" for name, rate in data["rates"].items()) + "."
    if cfg.get("slowdown"):
        intro = f"{slowdown_text(cfg)}; {intro[0].lower()}{intro[1:]}"
    if cfg.get("lr_follows_batch", "none") != "none":
        intro += (f" acco's lr follows the committed batch: times (the last update's global weight / a fixed-loop "
                  f"update's)^{'0.5' if cfg['lr_follows_batch'] == 'sqrt' else '1'}.")
    lines = [f"- {rate}: the best acco configuration, {method_label(data, row[0])}, reaches ZeRO-1's final loss in "
             f"{row[1]:.2f} of the budget (bar: <= {bar(data, rate)}): "
             f"{'met' if row[1] <= bar(data, rate) else '**not met**'}."
             for rate, row in best_acco(data).items() if row is not None]
    skipped = {n: e["skipped"] for r in s.values() for n, e in r["methods"].items() if "final_loss" not in e}
    lines += [f"- Not run: {common.label(name)}: {reason}." for name, reason in skipped.items()]
    return "\n".join([intro, "", table(data)] + lines)


def slowdown_text(cfg: dict[str, Any]) -> str:
    slow = cfg["slowdown"]
    cap = f", the `ready()` loop capped at {cfg['round_cap']} micro-batches per round" if cfg.get("round_cap") else ""
    return (f"**rank {slow['rank']} {slow['factor']}x slower** (it sleeps {slow['factor'] - 1} x each micro-batch's "
            f"CPU time after it){cap}")


def method_label(data: dict[str, Any], name: str) -> str:
    """The registry's label, with the run's slowdown factor where it says FACTOR."""
    slow = data["config"].get("slowdown")
    return common.label(name).replace("FACTOR", str(slow["factor"]) if slow else "FACTOR")


def bar(data: dict[str, Any], rate: str) -> float | None:
    """The issue's bar for this run's link (and slowdown), if it sets one."""
    cfg = data["config"]
    if not cfg.get("slowdown"):
        return BAR.get(rate)
    return MIXED_BAR.get((cfg["ranks"], cfg["slowdown"]["factor"], rate))


def best_acco(data: dict[str, Any]) -> dict[str, tuple[str, float] | None]:
    """Per rate with a bar: the acco configuration that reaches ZeRO-1's loss soonest."""
    s = data.get("summary") or summary(data)
    return {rate: (r["best_acco"], r["methods"][r["best_acco"]]["median_time_fraction"]) if r.get("best_acco") else None
            for rate, r in s.items() if bar(data, rate) is not None}


def plot(data: dict[str, Any], path: Path) -> str:
    plt = common.pyplot()
    s, budget = data.get("summary") or summary(data), data["config"]["budget_s"]
    rates = list(s)
    names = [n for n in s[rates[0]]["methods"] if any("final_loss" in r["methods"].get(n, {}) for r in s.values())]
    fig = plt.figure(figsize=(7 * max(2, len(rates)), 10))
    grid = fig.add_gridspec(2, max(2, len(rates)), height_ratios=[3, 2])
    initial = max(r["initial_loss"] for r in data["runs"])
    for column, rate in enumerate(rates):
        ax = fig.add_subplot(grid[0, column])
        runs = [r for r in data["runs"] if r["label"] == rate]
        for name in names:
            spec = common.method_spec(name)
            for i, run in enumerate(r for r in runs if "points" in r["methods"].get(name, {})):
                points = run["methods"][name]["points"]
                ax.plot([p["elapsed_s"] for p in points], [p["loss"] for p in points], color=spec.colour,
                        ls=spec.line, lw=2 if name == BASELINE else 1.3, alpha=1.0 if i == 0 else 0.35,
                        marker="." if i == 0 else None,
                        label=method_label(data, name).replace("`", "") if i == 0 else None)
        for goal in s[rate]["targets"].values():
            ax.axhline(goal["loss"], color="gray", lw=0.7, ls="--")
        ax.axvline(budget, color="gray", lw=0.7)
        losses = [p["loss"] for r in runs for m in r["methods"].values() for p in m.get("points", [])]
        ax.set_ylim(min(losses) - 0.05, initial + 0.05)
        slow = data["config"].get("slowdown")
        title = f"{rate} ({common.rate_text(s[rate]['rate'])})" + (
            f", {data['config']['ranks']} ranks, rank {slow['rank']} {slow['factor']}x slower" if slow else "")
        ax.set(xlabel="training seconds (evaluation excluded)", ylabel="held-out loss",
               title=f"{title}; faint: other seeds; dashed: ZeRO-1's final loss")
        if column == 0:
            ax.legend(fontsize=7, loc="upper right")
    bars = fig.add_subplot(grid[1, :])
    width = 0.8 / len(rates)
    for j, rate in enumerate(rates):
        values = [s[rate]["methods"].get(n, {}).get("median_time_fraction") for n in names]
        xs = [i + (j - (len(rates) - 1) / 2) * width for i in range(len(names))]
        bars.bar(xs, [v or 0 for v in values], width, color=f"C{j}", label=rate)
        for x, v in zip(xs, values):
            if v is None:
                bars.text(x, 0.02, "not reached", rotation=90, fontsize=7, ha="center", va="bottom")
        if bar(data, rate) is not None:
            bars.axhline(bar(data, rate), color=f"C{j}", lw=0.8, ls="--")
    bars.axhline(1.0, color="gray", lw=0.7)
    bars.set_xticks(range(len(names)), [method_label(data, n).replace("`", "") for n in names], rotation=20,
                    ha="right", fontsize=8)
    bars.set(ylabel="fraction of the budget (median over seeds)",
             title="time to DDP + ZeRO-1's final held-out loss (dashed: the issue's bar at each rate)")
    bars.legend(fontsize=8)
    return common.save_figure(fig, path, dpi=100)


def mixed_runs(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The results files of runs with one rank slower (``--slowdown``), by file stem."""
    return {stem: data for stem, data in sorted(results.items()) if data.get("config", {}).get("slowdown")}


def mixed_overview(results: dict[str, Any]) -> str:
    """One row per mixed-speed run and link: each method's time to ZeRO-1's final loss."""
    runs = mixed_runs(results)
    names = list(dict.fromkeys(n for data in runs.values() for r in summary_of(data).values() for n in r["methods"]))
    rows = []
    for stem, data in runs.items():
        cfg = data["config"]
        for rate, r in summary_of(data).items():
            settings = [f"cap {cfg['round_cap']}" if cfg.get("round_cap") else "",
                        "lr x (batch ratio)^0.5" if cfg.get("lr_follows_batch") == "sqrt" else "",
                        "lr x batch ratio" if cfg.get("lr_follows_batch") == "linear" else ""]
            rows.append([f"{cfg['slowdown']['factor']}x", str(cfg["ranks"]), f"{rate} ({common.rate_text(r['rate'])})",
                         ", ".join(str(seed) for seed in cfg["seeds"]), ", ".join(x for x in settings if x) or "-",
                         *(fraction_cell(r["methods"][n]) if "final_loss" in r["methods"].get(n, {}) else "-"
                           for n in names), f"[{stem}.json](benchmarks/results/{stem}.json)"])
    header = ["one rank slower by", "ranks", "network", "seeds", "ready() loop settings",
              *(method_label({"config": {}}, n) for n in names), "results"]
    return ("Time to DDP + ZeRO-1's final held-out loss, as a share of the same wall-clock budget (median over "
            "seeds, min-max in brackets; \"not reached\": not within the budget); FACTOR is the slow rank's factor.\n\n"
            + common.md_table(header, rows))


def which_loop(data: dict[str, Any]) -> str:
    """docs/loops.md's table: per network speed, each method's time to ZeRO-1's final loss."""
    per_rate = summary_of(data)
    names = list(dict.fromkeys(n for r in per_rate.values() for n in r["methods"]))
    rows = [[f"{rate} ({common.rate_text(r['rate'])})",
             *(fraction_cell(r["methods"][n]) if n in r["methods"] else "-" for n in names)]
            for rate, r in per_rate.items()]
    seeds = ", ".join(str(seed) for seed in data["config"]["seeds"])
    return (f"Time to DDP + ZeRO-1's final held-out loss, as a share of the same {data['config']['budget_s']:g} s "
            f"budget ({data['config']['ranks']} ranks, seeds {seeds}: median, min-max in brackets; \"not reached\": "
            "not within the budget):\n\n" + common.md_table(["network", *(method_label(data, n) for n in names)], rows))


def summary_of(data: dict[str, Any]) -> dict[str, Any]:
    return data.get("summary") or summary(data)


def blocks(results: dict[str, Any], figures: Path) -> dict[str, str]:
    data = results["time_to_loss"]
    out = {"time_to_loss": section(data) + f"\n\n![time to loss](results/{plot(data, figures / 'time_to_loss.png')})",
           "which-loop": which_loop(data)}
    mixed = mixed_runs(results)
    if mixed:
        out["time_to_loss-mixed"] = "\n\n".join(
            f"`{data['command']}`\n\n{section(data)}\n\n![{stem}](results/{plot(data, figures / f'{stem}.png')})"
            for stem, data in mixed.items())
        out["which-loop-mixed"] = mixed_overview(results)
    return out


def targets(results: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    rows = []
    for data in [results["time_to_loss"], *mixed_runs(results).values()]:
        cfg = data["config"]
        where = f"{slowdown_text(cfg)}, {cfg['ranks']} ranks, " if cfg.get("slowdown") else ""
        rows += [(f"{where}{rate}: the best acco configuration reaches DDP + ZeRO-1's final held-out loss in <= "
                  f"{bar(data, rate)} of the same wall-clock budget (time_to_loss.py, median over seeds)",
                  f"{row[1]:.2f} ({method_label(data, row[0])})" if row else "not reached",
                  row is not None and row[1] <= bar(data, rate))
                 for rate, row in best_acco(data).items()]
    return rows


def runtimes(results: dict[str, Any]) -> list[tuple[str, float]]:
    rows = []
    for stem, data in [("time_to_loss", results["time_to_loss"]), *mixed_runs(results).items()]:
        rows.append((stem, data["runtime_s"]))
        if data.get("calibration_runtime_s"):
            rows.append(("  calibration", data["calibration_runtime_s"]))
        rows += [(f"  {r['label']}, seed {r['seed']}", r["runtime_s"]) for r in data["runs"]]
    return rows


BENCHMARK = common.Benchmark("time_to_loss", __doc__, arguments, rank, sweep, check=check, quick={"budget": 6.0})

if __name__ == "__main__":
    common.main(BENCHMARK)
