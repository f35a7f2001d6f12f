"""Time to loss: held-out loss against wall-clock time for every method, each given the same
wall-clock budget behind a rate-limited network, at the rate where one round of
communication takes as long as one round of compute and at three times that.

The whole sweep (calibration, 2 rates x 12 methods x 2 seeds, 30 s of training each; needs
root for the namespace), about 32 minutes on 2 cores:

    sudo $(which python) benchmarks/time_to_loss.py
    sudo $(which python) benchmarks/time_to_loss.py --rates 440mbit 140mbit   # skip calibration
    sudo $(which python) benchmarks/time_to_loss.py --quick    # 1 seed, 6 s each: about 6 minutes

DiLoCo runs through torchft (``python -m pip install torchft==0.2.0 torch==2.13.0``; the
``torch==`` pin keeps pip from replacing the installed torch) when it imports, otherwise
through the plain implementation in ``diloco.py``; ``--diloco plain|torchft`` chooses, and
the JSON records which one ran.

How it measures. Every method trains the example's GPT (``examples/train_gpt.py``: 4
layers, width 128, seq 64, micro-batch 8) from the same initial model, on the same
micro-batch stream per rank, with AdamW at the same learning rate (``--lr``, linear warm-up
over ``--warmup`` optimizer updates, then constant: a schedule tied to a total number of
updates would differ between methods that make different numbers of updates in the same
time), clipping at 1.0, ``--micro-batches`` micro-batches per rank per update (acco: two
rounds of half as many; the ``ready()`` loop: at least that, and more while the round in
flight has not landed). The clock starts at the first micro-batch, after the process group,
the model and the optimizer exist and a barrier; there is no per-method warm-up (the
process warms its kernels up once, before the first method). Each method trains until the
clock reaches ``--budget`` seconds, then drains (acco's ``finish()``) on the clock.

Evaluation is off the clock and off the network: at the first committed boundary after
each ``--eval-every`` seconds of training (acco: a ``step()`` that returned True; DiLoCo: a
synchronisation), every rank copies the committed parameters (the clock is paused for the
copy); all copies, and the parameters after ``finish()``, are evaluated on ``--eval-batches``
fixed held-out batches after the budget, when nothing else runs. Pausing the clock for an
evaluation while training would not do: acco's comm lane would keep communicating during
the pause, for free.

Stopping together. The ranks must end on the same round. At every round boundary each rank
starts a non-blocking all-reduce (MAX) of its clock on the default process group, never on
acco's lane, and reads the one it started at the previous boundary: every rank reads the
same sequence of agreed clocks, so every rank takes the same decisions at the same
boundary, and no rank ever waits on that all-reduce while the link is busy. An evaluation
falls due one boundary after the agreed clock passes its mark; training stops at the first
boundary whose clock, extrapolated from the last two agreed clocks, is at or past the
budget (so it overshoots by a fraction of a round, and every point is timed as it happened).

Time to loss. For each seed, the target is DDP + ZeRO-1's final held-out loss; a method's
time to it is the first time its held-out loss curve reaches it (linear between two
evaluations), as a fraction of the budget; the tables give the median and the range over
the seeds. Bytes per update are the namespace's loopback bytes over the training window
divided by the optimizer updates.

Rates are calibrated as ``throughput.py`` does (its functions, imported), for this model:
``comm~compute`` is the tbf rate at which one acco round of communication (alone) takes as
long as one acco round of compute, ``comm~3x`` three times as long.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import inspect
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
import torch.distributed as dist
from common import (
    ACCO_METHODS,
    RESULTS_DIR,
    AccoMethod,
    ForeignLoad,
    Method,
    ModelConfig,
    all_reduce_sum,
    batches,
    build_method,
    build_model,
    launch,
    lo_tx_bytes,
    read_json,
    start_ranks,
    training_text,
    wait_for_quiet,
    write_json,
)
from diloco import DiLoCoMethod, TorchftDiLoCoMethod, torchft_version
from torch import Tensor

from acco import AccoOptimizer
from examples.train_gpt import eval_batches, evaluate, param_groups

# Every method, in the order tables list them. "-aww": the accumulate-while-communicating
# loop (README's ready() loop); "-bf16" / "-fp8": the light estimate round.
METHODS = (
    "ddp-zero1", "ddp-adamw", "acco-sync", "acco-dpu",
    "acco", "acco-bf16", "acco-fp8",
    "acco-aww", "acco-aww-bf16", "acco-aww-fp8",
    "diloco-h10", "diloco-h50",
)
LIGHT_ESTIMATE = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
RATE_LABELS = ("comm~compute", "comm~3x")
DEFAULT_SEEDS = (1337, 7)
BASELINE = "ddp-zero1"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--rates", nargs="+", default=None, metavar="RATE",
        help="tc rates for comm~compute then comm~3x (e.g. 440mbit 140mbit): skips calibration (driver)")
    add("--methods", nargs="+", default=list(METHODS), type=method_name, metavar="METHOD",
        help=f"from {', '.join(METHODS)}; any diloco-hN (H = N)")
    add("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS))
    add("--budget", type=float, default=30.0, help="seconds of training per method (the clock's budget)")
    add("--eval-every", type=float, default=None, help="seconds between evaluations (default: budget / 8)")
    add("--eval-batches", type=int, default=32)
    add("--micro-batches", type=int, default=4, help="micro-batches per rank per optimizer update (even)")
    add("--lr", type=float, default=3e-3)
    add("--warmup", type=int, default=10, help="optimizer updates (DiLoCo: inner steps) of linear warm-up")
    add("--grad-clip", type=float, default=1.0, help="0: off")
    add("--n-layer", type=int, default=4)
    add("--n-embd", type=int, default=128)
    add("--seq-len", type=int, default=64)
    add("--batch-size", type=int, default=8)
    add("--ranks", type=int, default=2)
    add("--diloco", choices=["auto", "torchft", "plain"], default="auto",
        help="DiLoCo implementation (auto: torchft if it imports, else plain)")
    add("--max-quiet-wait", type=float, default=900.0,
        help="seconds to wait, before each method, for other processes to leave the CPU")
    add("--out", default=None, help="JSON output (default: benchmarks/results/time_to_loss.json)")
    add("--no-report", action="store_true", help="do not regenerate the README tables and plots (driver)")
    add("--quick", action="store_true",
        help="1 seed, 6 s per method, 4 evaluations, results/time_to_loss-quick.json, no report: a smoke run "
             "of about 6 minutes")
    # Set by the driver for its rank launches.
    add("--seed", type=int, default=None, help=argparse.SUPPRESS)
    add("--label", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.budget, args.no_report = args.seeds[:1], 6.0, True
        args.eval_every = args.eval_every or args.budget / 4
        args.out = args.out or str(RESULTS_DIR / "time_to_loss-quick.json")
    if args.micro_batches < 2 or args.micro_batches % 2:
        parser.error("--micro-batches must be even (acco splits an update into two rounds)")
    if args.budget <= 0:
        parser.error(f"--budget must be positive, got {args.budget}")
    if args.eval_every is None:
        args.eval_every = args.budget / 8
    if args.eval_every <= 0:
        parser.error(f"--eval-every must be positive, got {args.eval_every}")
    if args.rates is not None and len(args.rates) > len(RATE_LABELS):
        parser.error(f"--rates takes at most {len(RATE_LABELS)} rates ({', '.join(RATE_LABELS)})")
    if args.diloco == "torchft" and torchft_version() is None:
        parser.error("--diloco torchft: torchft does not import here (python -m pip install torchft torch==2.13.0)")
    return args


def method_name(name: str) -> str:
    if name in METHODS or (name.startswith("diloco-h") and name.removeprefix("diloco-h").isdigit()
                           and int(name.removeprefix("diloco-h")) >= 1):
        return name
    raise argparse.ArgumentTypeError(f"unknown method {name!r} (choose from {', '.join(METHODS)}, or diloco-hN)")


def model_config(args: argparse.Namespace, seed: int) -> ModelConfig:
    return ModelConfig(n_layer=args.n_layer, n_embd=args.n_embd, seq_len=args.seq_len, batch_size=args.batch_size,
                       lr=args.lr, max_grad_norm=args.grad_clip or None, seed=seed)


class WarmupConstant:
    """LambdaLR factor: linear warm-up over ``warmup`` updates, then the peak, constant."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup

    def __call__(self, update: int) -> float:
        return min(1.0, (update + 1) / (self.warmup + 1))


# ------------------------------------------------------------------------------- methods


class UnsupportedMethod(RuntimeError):
    """This method cannot run with the installed library; the run records why and goes on."""


def estimate_dtype_supported() -> bool:
    return "estimate_dtype" in inspect.signature(AccoOptimizer).parameters


class LightEstimateAcco(AccoMethod):
    """``AccoOptimizer(mode="acco", estimate_dtype=...)``: the estimate round travels in a
    narrower dtype; the commit round is unchanged."""

    def __init__(self, name: str, config: ModelConfig, micro_batches_per_update: int,
                 estimate_dtype: torch.dtype) -> None:
        # Checked before anything collective, identically on every rank.
        if not estimate_dtype_supported():
            raise UnsupportedMethod(
                f"{name}: the installed AccoOptimizer has no estimate_dtype= argument (issue 14's light "
                "estimate round); rerun once it is installed"
            )
        self.name = name
        self.model = build_model(config)
        self.rounds_per_update = 2
        self.micro_batches_per_round = micro_batches_per_update // 2
        try:
            self.opt = AccoOptimizer(
                param_groups(self.model, config.weight_decay),
                torch.optim.AdamW,
                mode="acco",
                lr=config.lr,
                betas=config.betas,
                max_grad_norm=config.max_grad_norm,
                timeout=datetime.timedelta(minutes=5),
                estimate_dtype=estimate_dtype,
            )
        except (TypeError, ValueError) as error:
            # acco checks its arguments before any collective, so every rank raises alike
            # (e.g. a dtype this build does not carry): recorded as not run, with the reason.
            raise UnsupportedMethod(f"{name}: AccoOptimizer(estimate_dtype={estimate_dtype}) refused: {error}") from error


def build(name: str, args: argparse.Namespace, config: ModelConfig) -> Method:
    k = args.micro_batches
    if name.startswith("diloco-h"):
        sync_every = int(name.removeprefix("diloco-h"))
        if diloco_implementation(args) == "torchft":
            return TorchftDiLoCoMethod(config, k, sync_every, WarmupConstant(args.warmup))
        return DiLoCoMethod(config, k, sync_every, WarmupConstant(args.warmup))
    suffix = name.rsplit("-", 1)[-1]
    if suffix in LIGHT_ESTIMATE:
        return LightEstimateAcco(name, config, k, LIGHT_ESTIMATE[suffix])
    if name not in ACCO_METHODS and name not in ("ddp-zero1", "ddp-adamw"):
        raise ValueError(f"unknown method {name!r}")
    return build_method(name, config, k)


def diloco_implementation(args: argparse.Namespace) -> str:
    if args.diloco == "auto":
        return "torchft" if torchft_version() is not None else "plain"
    return args.diloco


def accumulates_while_communicating(name: str) -> bool:
    return name.startswith("acco-aww")


# ---------------------------------------------------------------------------- rank side


class Clock:
    """Training seconds since ``start()``, with pauses left out."""

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._paused = 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self._start - self._paused

    def pause(self, seconds: float) -> None:
        self._paused += seconds


class AgreedClock:
    """The ranks' clocks, agreed one round late without blocking (see the module docstring).

    Collective: every rank calls ``exchange()`` at every round boundary and ``close()`` once.
    """

    def __init__(self) -> None:
        self._value = torch.zeros(1, dtype=torch.float64)
        self._work: Any = None
        self.previous = 0.0  # the agreed clock one boundary earlier (every clock starts after a barrier)

    def budget_reached(self, agreed: float | None, budget: float) -> bool:
        """Whether this boundary ends the budget: the first boundary whose clock is expected
        at or past it, from the agreed clocks of the two previous boundaries (the same
        numbers on every rank), so the overshoot is a fraction of a round, not two rounds."""
        if agreed is None:
            return False
        last_round = agreed - self.previous
        self.previous = agreed
        return agreed + last_round >= budget

    def exchange(self, elapsed: float) -> float | None:
        """Start agreeing on ``elapsed``; return the previous boundary's agreed clock (the
        largest over ranks), or None at the first boundary."""
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


def trained_parameters(method: Method) -> list[Tensor]:
    module = getattr(method.model, "module", method.model)  # DDP wraps the model
    return list(module.parameters())


def committed_samples(method: Method, args: argparse.Namespace, updates: int) -> int:
    """Samples (sequences) of every rank whose gradients are in the committed parameters."""
    world = dist.get_world_size()
    if isinstance(method, (DiLoCoMethod, TorchftDiLoCoMethod)):
        return method.outer_steps * method.sync_every * args.micro_batches * world * args.batch_size
    opt = method.optimizer()
    if isinstance(opt, AccoOptimizer):
        return round(opt.committed_weight) * args.batch_size  # weight 1 per micro-batch, every rank
    return updates * args.micro_batches * world * args.batch_size


def committed_updates(method: Method, counted: int) -> int:
    """Optimizer updates in the committed parameters (DiLoCo: inner steps merged)."""
    if isinstance(method, (DiLoCoMethod, TorchftDiLoCoMethod)):
        return method.outer_steps * method.sync_every
    opt = method.optimizer()
    return opt.num_updates if isinstance(opt, AccoOptimizer) else counted


def run_method(name: str, args: argparse.Namespace, config: ModelConfig, train_data: Tensor,
               eval_set: list[tuple[Tensor, Tensor]], initial_loss: float) -> dict[str, Any]:
    """Train ``name`` for the budget; its evaluation points and what they cost."""
    rank, world = dist.get_rank(), dist.get_world_size()
    setup_started = time.perf_counter()
    try:
        method = build(name, args, config)
    except UnsupportedMethod as error:
        return {"method": name, "skipped": str(error)}
    opt = method.optimizer()
    # DiLoCo schedules its inner steps itself; the others step theirs per committed update.
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, WarmupConstant(args.warmup)) if opt is not None else None
    next_batch = batches(train_data, config, config.seed + 1000 * rank)  # the same stream in every method
    aww = accumulates_while_communicating(name)
    params = trained_parameters(method)
    setup_s = time.perf_counter() - setup_started
    waited = wait_for_quiet(max_wait_s=args.max_quiet_wait)
    foreign = ForeignLoad()
    dist.barrier()

    agreed_clock = AgreedClock()
    foreign.start()
    bytes0 = lo_tx_bytes()
    clock = Clock()
    snapshots: list[tuple[dict[str, Any], list[Tensor]]] = []
    computed = rounds = counted_updates = 0
    next_eval, due, last_commit = args.eval_every, False, 0.0

    def snapshot(elapsed: float) -> None:
        started = time.perf_counter()
        copy = [p.detach().clone() for p in params]
        updates = committed_updates(method, counted_updates)
        snapshots.append(({"elapsed_s": elapsed, "updates": updates,
                           "samples": committed_samples(method, args, counted_updates)}, copy))
        clock.pause(time.perf_counter() - started)

    while True:
        for _ in range(method.micro_batches_per_round):
            method.micro_batch(*next_batch())
            computed += 1
        while aww and not method.ready():  # the README's loop: keep accumulating while the round is in flight
            method.micro_batch(*next_batch())
            computed += 1
        committed = method.end_round()
        rounds += 1
        now = clock.elapsed()
        if committed:
            counted_updates += 1
            last_commit = now
            if scheduler is not None:
                scheduler.step()
        agreed = agreed_clock.exchange(now)
        if agreed_clock.budget_reached(agreed, args.budget):
            break
        if agreed is not None and agreed >= next_eval:
            due = True
            next_eval = (math.floor(agreed / args.eval_every) + 1) * args.eval_every
        if committed and due:
            snapshot(now)
            due = False
    stopped_s = clock.elapsed()
    agreed_clock.close()
    if method.finish():  # acco, dpu: the update in flight lands, on the clock
        counted_updates += 1
        last_commit = clock.elapsed()
    end_s = clock.elapsed()
    bytes1 = lo_tx_bytes()
    foreign_share = foreign.stop()
    if not snapshots or snapshots[-1][0]["elapsed_s"] != last_commit:
        snapshot(last_commit)  # the committed parameters at the end, from when they were committed
    final_updates = committed_updates(method, counted_updates)

    # Evaluate every copy, each on one rank, nothing else running.
    eval_started = time.perf_counter()
    module = getattr(method.model, "module", method.model)
    losses = [0.0] * len(snapshots)
    for i, (_, copy) in enumerate(snapshots):
        if i % world == rank:
            with torch.no_grad():
                for p, q in zip(params, copy):
                    p.copy_(q)
            losses[i] = evaluate(module, eval_set)
    losses = all_reduce_sum(losses)
    eval_s = time.perf_counter() - eval_started

    (micro_batches,) = all_reduce_sum([computed])
    points = [{"elapsed_s": 0.0, "updates": 0, "samples": 0, "loss": initial_loss}]
    points += [{**info, "loss": loss} for (info, _), loss in zip(snapshots, losses)]
    committed_mb = points[-1]["samples"] / args.batch_size
    result: dict[str, Any] = {
        "method": name,
        "points": points,
        "final_loss": points[-1]["loss"],
        "stopped_s": stopped_s,
        "end_s": end_s,
        "updates": final_updates,
        "rounds": rounds,
        "updates_per_s": final_updates / end_s,
        "samples_per_s": points[-1]["samples"] / end_s,
        "micro_batches_computed": micro_batches,
        "micro_batches_per_update": committed_mb / world / final_updates if final_updates else None,
        "lo_bytes": None if bytes0 is None or bytes1 is None else bytes1 - bytes0,
        "foreign_cpu_share": foreign_share,
        "waited_for_quiet_s": waited,
        "setup_s": setup_s,
        "eval_s": eval_s,
    }
    if result["lo_bytes"] is not None and final_updates:
        result["lo_bytes_per_update"] = result["lo_bytes"] / final_updates
    if isinstance(method, (DiLoCoMethod, TorchftDiLoCoMethod)):
        result.update(sync_every=method.sync_every, outer_steps=method.outer_steps, inner_steps=method.inner_steps,
                      implementation=("torchft " + (torchft_version() or "")).strip()
                      if isinstance(method, TorchftDiLoCoMethod) else "plain (diloco.py)")
        if result["lo_bytes"] is not None and method.outer_steps:
            result["lo_bytes_per_sync"] = result["lo_bytes"] / method.outer_steps
    if isinstance(opt, AccoOptimizer):
        stats = list(opt.round_stats)
        if stats:
            result["lane"] = {"hidden_share": statistics.fmean(s.hidden_share for s in stats),
                              "lane_s": statistics.fmean(s.lane_seconds for s in stats),
                              "wait_s": statistics.fmean(s.wait_seconds for s in stats)}
    if isinstance(method, TorchftDiLoCoMethod):
        method.close()
    return result


def rank_main(args: argparse.Namespace) -> None:
    ctx = start_ranks()
    seed = args.seed if args.seed is not None else args.seeds[0]
    config = model_config(args, seed)
    train_data, held_out = training_text(config.seq_len)
    eval_set = eval_batches(held_out, args.eval_batches, config.batch_size, config.seq_len, seed, torch.device("cpu"))
    initial_loss = evaluate(build_model(config), eval_set)  # every method starts from this model
    # Warm the allocator and kernels up once, so the first method is not penalised.
    warm = build_method("roofline", config, args.micro_batches)
    next_warm = batches(train_data, config, 0)
    for _ in range(2):
        warm.micro_batch(*next_warm())
    del warm
    # The methods in an order rotated by the seed's index, so no method is always first.
    shift = args.seeds.index(seed) % len(args.methods) if seed in args.seeds else 0
    runs: dict[str, Any] = {}
    for name in args.methods[shift:] + args.methods[:shift]:
        started = time.perf_counter()
        runs[name] = run_method(name, args, config, train_data, eval_set, initial_loss)
        gc.collect()  # the method's model, optimizer and buffers go before the next one
        r = runs[name]
        if ctx.master:
            if "skipped" in r:
                print(f"[{args.label}] {name:14s} skipped: {r['skipped']}", flush=True)
            else:
                print(f"[{args.label}] {name:14s} final loss {r['final_loss']:.4f} after {r['end_s']:.1f} s, "
                      f"{r['updates']} updates, {r['micro_batches_per_update'] or 0:.1f} micro-batches per update "
                      f"({time.perf_counter() - started:.0f} s in all)", flush=True)
    if ctx.master:
        write_json(Path(args.out), {
            "label": args.label, "seed": seed, "ranks": ctx.world_size, "initial_loss": initial_loss,
            "rate": os.environ.get("ACCO_BENCH_RATE", "not limited by the benchmark"),
            "threads_per_rank": torch.get_num_threads(), "methods": runs,
        })
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- driver side


def rank_arguments(args: argparse.Namespace) -> list[str]:
    return [
        "--methods", *args.methods, "--seeds", *map(str, args.seeds), "--budget", str(args.budget),
        "--eval-every", str(args.eval_every), "--eval-batches", str(args.eval_batches),
        "--micro-batches", str(args.micro_batches), "--lr", str(args.lr), "--warmup", str(args.warmup),
        "--grad-clip", str(args.grad_clip), "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd),
        "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--diloco", args.diloco,
        "--max-quiet-wait", str(args.max_quiet_wait),
    ]


def calibrate(args: argparse.Namespace) -> dict[str, Any]:
    """throughput.py's calibration, for this model and micro-batches per update."""
    import throughput

    targs = throughput.parse_args([
        "--ranks", str(args.ranks), "--rates", *RATE_LABELS, "--micro-batches", str(args.micro_batches),
        "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--seq-len", str(args.seq_len),
        "--batch-size", str(args.batch_size),
    ])
    return throughput.calibrate_rates(targs, args.ranks)


def driver(args: argparse.Namespace) -> None:
    out = Path(args.out) if args.out else RESULTS_DIR / "time_to_loss.json"
    started = time.perf_counter()
    implementation = diloco_implementation(args)
    results: dict[str, Any] = {
        "benchmark": "time_to_loss",
        "config": {
            **model_config(args, args.seeds[0]).as_dict(),
            "seeds": args.seeds,
            "ranks": args.ranks,
            "budget_s": args.budget,
            "eval_every_s": args.eval_every,
            "eval_batches": args.eval_batches,
            "micro_batches_per_update": args.micro_batches,
            "warmup_updates": args.warmup,
            "schedule": "linear warm-up, then constant",
            "methods": args.methods,
            "diloco": {"implementation": implementation, "torchft": torchft_version(),
                       "outer_optimizer": "SGD, Nesterov momentum 0.9, lr 0.7"},
            "estimate_dtype_supported": estimate_dtype_supported(),
            "parameters": sum(p.numel() for p in build_model(model_config(args, args.seeds[0])).parameters()),
        },
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "python": platform.python_version()},
        "command": " ".join(["benchmarks/time_to_loss.py", *(sys.argv[1:] if sys.argv[1:] else [])]),
        "rates": {},
        "runs": [],
    }
    if args.rates is None:
        calibration_started = time.perf_counter()
        calibration = calibrate(args)
        results["calibration"] = calibration
        results["calibration_runtime_s"] = time.perf_counter() - calibration_started
        results["rates"] = {label: calibration["targets"][label]["rate"] for label in RATE_LABELS}
    else:
        results["rates"] = dict(zip(RATE_LABELS, args.rates))
        results["calibration"] = {"given": True}
    write_json(out, results)
    for label, rate in results["rates"].items():
        for seed in args.seeds:
            print(f"time to loss: {label} ({rate}), seed {seed}", flush=True)
            run_started = time.perf_counter()
            with tempfile.TemporaryDirectory() as tmp:
                rank_out = Path(tmp) / "run.json"
                launch(args.ranks, [str(Path(__file__).resolve()), *rank_arguments(args), "--seed", str(seed),
                                    "--label", f"{label} seed {seed}", "--out", str(rank_out)], rate)
                run = read_json(rank_out)
            run.update(label=label, rate=rate, runtime_s=time.perf_counter() - run_started)
            results["runs"].append(run)
            results["runtime_s"] = time.perf_counter() - started
            write_json(out, results)  # after every launch, so a long sweep keeps what it has
    import report

    results["summary"] = report.time_to_loss_summary(results)
    results["runtime_s"] = time.perf_counter() - started
    write_json(out, results)
    print(report.time_to_loss_table(results))
    print(f"wrote {out} ({results['runtime_s'] / 60:.1f} min)")
    if not args.no_report:
        report.main([])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:  # started by torchrun: a rank
        if args.out is None:
            args.out = str(RESULTS_DIR / "time_to_loss-torchrun.json")
        if args.label is None:
            args.label = "torchrun"
        rank_main(args)
    else:
        driver(args)


if __name__ == "__main__":
    sys.exit(main())
