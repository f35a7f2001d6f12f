"""Convergence: the example GPT on the standard library's text, at equal samples, for
acco's three modes and DDP + ZeroRedundancyOptimizer; and how far an acco (or dpu) update
is from the synchronous update taken from the same parameters and data.

    python benchmarks/convergence.py                 # 2 ranks, plain torchrun (no root needed)

Every method sees exactly the same micro-batches (each rank draws its own stream, the same
in every method), the example's recipe (AdamW, no decay on biases / LayerNorms /
embeddings, clipping at 1.0, linear warm-up then cosine, stepped once per committed
update) and the same number of updates and micro-batches per update. The loss curves
are the training loss (mean over every rank's micro-batches of an update) and the eval
loss on fixed held-out batches; the final eval loss is taken on the committed parameters
after the last update.

The update difference. Every ``--diff-every`` updates, in the acco and dpu runs, the
benchmark waits for the comm lane to be idle and records this rank's master shard and
AdamW state (theta, S) just before the optimizer starts its next update, and the
micro-batches that update will use. When the update has landed (``u_acco``: the new shard
minus the old), it replays the synchronous update from the same place: gradients of the
same micro-batches all taken at theta, averaged over ranks, clipped, one AdamW step from
S (``u_sync``). It reports ``||u_acco - u_sync|| / (||u_acco|| + ||u_sync||)`` over all
shards. Waiting for the lane changes the timing, not the arithmetic.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from common import (
    RESULTS_DIR,
    AccoMethod,
    Method,
    ModelConfig,
    batches,
    build_method,
    launch,
    read_json,
    start_ranks,
    training_text,
    write_json,
)
from torch import Tensor

from acco import AccoOptimizer, RoundKind
from examples.train_gpt import WarmupCosine, eval_batches, evaluate, loss_fn
from examples.train_gpt import parse_args as example_defaults

METHODS = ("acco-sync", "acco", "acco-dpu", "ddp-zero1", "acco-bf16", "acco-fp8")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    example = example_defaults([])  # the example's recipe is the default here
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--ranks", type=int, default=2)
    add("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    add("--updates", type=int, default=example.updates)
    add("--micro-batches", type=int, default=example.micro_batches_per_update, help="per rank per update (even)")
    add("--lr", type=float, default=example.lr)
    add("--warmup", type=int, default=example.warmup)
    add("--grad-clip", type=float, default=example.grad_clip)
    add("--n-layer", type=int, default=example.n_layer)
    add("--n-embd", type=int, default=example.n_embd)
    add("--n-head", type=int, default=example.n_head)
    add("--seq-len", type=int, default=example.seq_len)
    add("--batch-size", type=int, default=example.batch_size)
    add("--seed", type=int, default=example.seed)
    add("--eval-every", type=int, default=25)
    add("--eval-batches", type=int, default=32)
    add("--diff-every", type=int, default=10, help="measure the update difference every this many updates (0: off)")
    add("--out", default=None)
    add("--no-report", action="store_true")
    add("--method", default=None, help=argparse.SUPPRESS)  # a rank launch trains this one
    args = parser.parse_args(argv)
    if args.micro_batches % 2:
        parser.error("--micro-batches must be even (acco splits an update into two rounds)")
    return args


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, seq_len=args.seq_len,
                       batch_size=args.batch_size, lr=args.lr, max_grad_norm=args.grad_clip or None, seed=args.seed)


# ------------------------------------------------------------------ the update difference


class UpdateDifference:
    """Compares each measured acco / dpu update with the synchronous update from the same
    parameters, optimizer state and micro-batches (see the module docstring)."""

    def __init__(self, method: AccoMethod, config: ModelConfig) -> None:
        self.opt: AccoOptimizer = method.opt
        self.model = method.model
        self.config = config
        self.scratch = copy.deepcopy(method.model)
        names = {id(p): n for n, p in self.model.named_parameters()}
        scratch = dict(self.scratch.named_parameters())
        # The scratch model's parameters in the order of each group's flat buffer.
        self.group_params = [[scratch[names[id(p)]] for p in g["params"]] for g in self.opt.param_groups]
        self.rounds_per_update = 2 if self.opt.mode.value == "acco" else 1  # rounds an update's data spans
        self.active = False
        self.ratios: list[float] = []
        self.updates: list[int] = []

    def _shards(self) -> list[tuple[torch.optim.Optimizer, Tensor]]:
        out = []
        for base, plan in zip(self.opt.base_optimizers, self.opt.shard_plans):
            if base is None or plan.layout.value != "flat":
                raise AssertionError("the update difference needs the flat layout (AdamW's default)")
            (view,) = base.param_groups[0]["params"]
            out.append((base, view))
        return out

    def _wait_idle(self) -> None:
        while not self.opt.ready():
            time.sleep(0.001)

    def before_step(self, round_batches: list[tuple[Tensor, Tensor]], due: bool) -> None:
        """At a round boundary, before ``step()``: start or finish a measurement."""
        if self.active:
            if self.pending_rounds:  # acco: the commit also uses the next round's micro-batches
                self.data += round_batches
                self.pending_rounds -= 1
                return
            self._wait_idle()
            self._finish()
        sync = self.opt.mode.value == "sync"
        if due and (sync or self.opt.in_flight is RoundKind.COMMIT):
            self._wait_idle()  # the lane is idle: shard and state are the committed ones
            self.start_shards = [view.detach().clone() for _, view in self._shards()]
            self.start_state = [{k: v.clone() for k, v in base.state[view].items()} for base, view in self._shards()]
            self.data = list(round_batches)
            self.pending_rounds = self.rounds_per_update - 1
            self.active = True
            self.needs_params = True
            if sync:  # sync updates inside step(): the model holds theta now, not after it
                self.after_step()
            self.update = self.opt.num_updates + (1 if sync else 2)  # the update measured

    def after_step(self) -> None:
        """Right after the ``step()`` that started a measurement: the model holds theta."""
        if self.active and self.needs_params:
            with torch.no_grad():
                for p, q in zip(self.scratch.parameters(), self.model.parameters()):
                    p.copy_(q)
            self.needs_params = False

    def _finish(self) -> None:
        self.active = False
        grads = self._sync_gradient()
        squares = torch.zeros(3, dtype=torch.float64)
        for (base, view), start, state, grad in zip(self._shards(), self.start_shards, self.start_state, grads):
            u_acco = view.detach() - start
            param = start.clone()
            hyper = {k: v for k, v in base.param_groups[0].items() if k != "params"}
            reference = type(base)([{**hyper, "params": [param]}])
            reference.state[param] = {k: v.clone() for k, v in state.items()}
            param.grad = grad
            reference.step()
            u_sync = param.detach() - start
            squares += torch.stack([(u_acco - u_sync).double().square().sum(), u_acco.double().square().sum(),
                                    u_sync.double().square().sum()])
        dist.all_reduce(squares)
        diff, acco, sync = squares.sqrt().tolist()
        self.ratios.append(diff / (acco + sync) if acco + sync > 0 else 0.0)
        self.updates.append(self.update)

    def _sync_gradient(self) -> list[Tensor]:
        """This rank's shard of the synchronous gradient: every rank's micro-batches at
        theta, averaged, clipped as acco clips."""
        for p in self.scratch.parameters():
            p.grad = None
        for x, y in self.data:
            loss_fn(self.scratch, x, y).backward()
        count = torch.tensor([float(len(self.data))])
        dist.all_reduce(count)
        flats = []
        for params, plan in zip(self.group_params, self.opt.shard_plans):
            flat = torch.zeros(plan.padded_numel)
            for p, slot in zip(params, plan.slots):
                if p.grad is not None:
                    flat[slot.offset : slot.offset + slot.numel] = p.grad.reshape(-1)
            dist.all_reduce(flat)
            flats.append(flat / count)
        if self.config.max_grad_norm is not None:
            norm = math.sqrt(sum(float(f.double().square().sum()) for f in flats))
            scale = min(1.0, self.config.max_grad_norm / (norm + 1e-6))
            flats = [f * scale for f in flats]
        rank = dist.get_rank()
        return [f[rank * plan.chunk : (rank + 1) * plan.chunk].clone()
                for f, plan in zip(flats, self.opt.shard_plans)]


# ----------------------------------------------------------------------------- training


def train(name: str, args: argparse.Namespace) -> dict[str, Any]:
    ctx = start_ranks()
    config = model_config(args)
    train_data, held_out = training_text(config.seq_len)
    next_batch = batches(train_data, config, config.seed + ctx.rank)  # the example's per-rank streams
    eval_set = eval_batches(held_out, args.eval_batches, config.batch_size, config.seq_len, config.seed,
                            torch.device("cpu"))
    method: Method = build_method(name, config, args.micro_batches)
    opt = method.optimizer()
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(args.warmup, args.updates))
    model = getattr(method.model, "module", method.model)
    # In sync mode the measurement is a control: it must find (almost) no difference.
    diff = UpdateDifference(method, config) if args.diff_every and isinstance(opt, AccoOptimizer) else None
    losses: list[float] = []
    evals: list[tuple[int, float]] = [(0, evaluate(model, eval_set))]
    started = time.perf_counter()
    eval_time = 0.0
    updates = 0

    def committed() -> None:
        nonlocal eval_time, updates
        updates += 1
        scheduler.step()  # once per committed update
        if updates % args.eval_every == 0 and updates < args.updates:
            t = time.perf_counter()
            evals.append((updates, evaluate(model, eval_set)))
            eval_time += time.perf_counter() - t

    for _ in range(args.updates * method.rounds_per_update):
        round_batches = [next_batch() for _ in range(method.micro_batches_per_round)]
        for x, y in round_batches:
            losses.append(float(method.micro_batch(x, y)))
        if diff is not None:
            # The measured update is the one after the commit in flight; it must land in step().
            upcoming = opt.num_updates + (1 if opt.mode.value == "sync" else 2)
            due = upcoming % args.diff_every == 0 and upcoming < args.updates
            diff.before_step(round_batches, due)
        if method.end_round():
            committed()
        if diff is not None:
            diff.after_step()
    if method.finish():
        updates += 1
        scheduler.step()
    train_s = time.perf_counter() - started - eval_time
    if updates != args.updates:
        raise AssertionError(f"{name}: {updates} updates, expected {args.updates}")
    final = evaluate(model, eval_set)
    evals.append((args.updates, final))
    # Mean training loss per update over every rank's micro-batches.
    per_micro_batch = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(per_micro_batch)
    per_update = (per_micro_batch / ctx.world_size).view(args.updates, args.micro_batches).mean(dim=1)
    result = {
        "method": name,
        "ranks": ctx.world_size,
        "final_eval_loss": final,
        "eval": [{"update": u, "samples": u * args.micro_batches * ctx.world_size * config.batch_size, "loss": loss}
                 for u, loss in evals],
        "train_loss_per_update": per_update.tolist(),
        "train_seconds": train_s,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    if diff is not None:
        result["update_difference"] = {"updates": diff.updates, "ratios": diff.ratios,
                                       "mean": statistics.fmean(diff.ratios) if diff.ratios else None}
    dist.barrier()
    dist.destroy_process_group()
    return result


def driver(args: argparse.Namespace) -> None:
    out = Path(args.out) if args.out else RESULTS_DIR / "convergence.json"
    started = time.perf_counter()
    config = model_config(args)
    results: dict[str, Any] = {
        "benchmark": "convergence",
        "config": {**config.as_dict(), "ranks": args.ranks, "updates": args.updates,
                   "micro_batches_per_update": args.micro_batches, "warmup": args.warmup,
                   "eval_batches": args.eval_batches, "eval_every": args.eval_every, "diff_every": args.diff_every,
                   "samples": args.updates * args.micro_batches * args.ranks * args.batch_size},
        "methods": {},
    }
    for name in args.methods:
        print(f"convergence: {name}", flush=True)
        t = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            rank_out = Path(tmp) / "run.json"
            launch(args.ranks, [str(Path(__file__).resolve()), *sys.argv[1:], "--method", name, "--out", str(rank_out)],
                   netns=False)
            run = read_json(rank_out)
        run["runtime_s"] = time.perf_counter() - t
        results["methods"][name] = run
        message = f"  final eval loss {run['final_eval_loss']:.4f} ({run['runtime_s']:.0f} s)"
        if "update_difference" in run:
            message += f", update difference {run['update_difference']['mean']:.3f}"
        print(message, flush=True)
    sync = results["methods"].get("acco-sync", {}).get("final_eval_loss")
    if sync:
        for run in results["methods"].values():
            run["gap_vs_sync"] = (run["final_eval_loss"] - sync) / sync
    results["runtime_s"] = time.perf_counter() - started
    write_json(out, results)
    print(f"wrote {out} ({results['runtime_s'] / 60:.1f} min)")
    if not args.no_report:
        import report

        report.main([])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:
        if args.method is None:
            raise SystemExit("a rank launch needs --method")
        result = train(args.method, args)
        if int(os.environ["RANK"]) == 0:
            write_json(Path(args.out or RESULTS_DIR / f"convergence-{args.method}.json"), result)
    else:
        driver(args)


if __name__ == "__main__":
    sys.exit(main())
