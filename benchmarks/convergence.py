"""Convergence: the example GPT on the standard library's text, at equal samples, for
acco's modes and DDP + ZeroRedundancyOptimizer; and how far an acco (or dpu) update is from
the synchronous update taken from the same parameters and data (:class:`UpdateDifference`).

    python benchmarks/convergence.py                 # 2 ranks, plain torchrun (no root needed)
    python benchmarks/convergence.py --quick         # 20 updates: a smoke run, into results/scratch/
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
from pathlib import Path
from typing import Any

import common
from examples.train_gpt import Dist, WarmupCosine, eval_batches, evaluate, loss_fn
from examples.train_gpt import parse_args as example_defaults

import torch
import torch.distributed as dist
from torch import Tensor

from acco import RoundKind

__all__ = ["BENCHMARK", "UpdateDifference", "blocks", "targets"]

METHODS = ("acco-sync", "acco", "acco-dpu", "ddp-zero1", "acco-bf16", "acco-fp8")
QUICK = {"updates": 20, "warmup": 4, "eval_every": 10, "eval_batches": 4, "diff_every": 5}


def arguments(parser: argparse.ArgumentParser) -> None:
    example = example_defaults([])  # the example's recipe is the default here
    add = parser.add_argument
    add("--ranks", type=int, default=2)
    add("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    add("--updates", type=int, default=example.updates)
    add("--micro-batches", type=common.even, default=example.micro_batches_per_update, help="per rank per update")
    add("--lr", type=float, default=example.lr)
    add("--warmup", type=int, default=example.warmup)
    add("--grad-clip", type=float, default=example.grad_clip)
    common.model_arguments(parser, common.ModelConfig(example.n_layer, example.n_embd, example.n_head, example.seq_len,
                                                      example.batch_size))
    add("--seed", type=int, default=example.seed)
    add("--eval-every", type=int, default=25)
    add("--eval-batches", type=int, default=32)
    add("--diff-every", type=int, default=10, help="measure the update difference every this many updates (0: off)")
    add("--method", default=None, choices=METHODS, help=argparse.SUPPRESS)  # a rank launch trains this one


class UpdateDifference:
    """``||u - u_sync|| / (||u|| + ||u_sync||)`` every ``every`` updates: acco's (or dpu's)
    update against the synchronous one replayed from the same shard, AdamW state and
    micro-batches (benchmarks/README.md, "The update difference"). Waiting for the lane
    changes the timing, not the arithmetic; in ``sync`` mode it is a control.
    """

    def __init__(self, method: common.AccoMethod, every: int, total: int) -> None:
        self.opt, self.model, self.config = method.opt, method.model, method.config
        self.every, self.total = every, total
        self.scratch = copy.deepcopy(method.model)
        names = {id(p): n for n, p in self.model.named_parameters()}
        scratch = dict(self.scratch.named_parameters())
        # The scratch model's parameters in the order of each group's flat buffer.
        self.group_params = [[scratch[names[id(p)]] for p in g["params"]] for g in self.opt.param_groups]
        self.sync = self.opt.mode.value == "sync"
        self.rounds_per_update = method.rounds_per_update  # rounds an update's data spans
        self.active = self.needs_params = False
        self.pending_rounds = 0
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

    def _masters(self) -> list[Tensor]:
        """This rank's committed master shards, read through ``state_dict()``: in ``sync`` and
        ``dpu`` with fp32 parameters no master shard is kept between rounds (the base
        optimizer's parameter views then point at a reused buffer), so the views would lie."""
        return [group["master"] for group in self.opt.state_dict()["acco"]["groups"]]

    def _wait_idle(self) -> None:
        while not self.opt.ready():
            time.sleep(0.001)

    def before_boundary(self, record: common.RoundRecord) -> None:
        """Right before ``step()``: start or finish a measurement."""
        # The measured update is the one after the commit in flight; it must land in step().
        upcoming = self.opt.num_updates + (1 if self.sync else 2)
        if self.active:
            if self.pending_rounds:  # acco: the commit also uses the next round's micro-batches
                self.data += record.batches
                self.pending_rounds -= 1
                return
            self._wait_idle()
            self._finish()
        if upcoming % self.every or upcoming >= self.total or not (self.sync or self.opt.in_flight is RoundKind.COMMIT):
            return
        self._wait_idle()  # the lane is idle: shard and state are the committed ones
        self.start_shards = self._masters()
        self.start_state = [{k: v.clone() for k, v in base.state[view].items()} for base, view in self._shards()]
        self.data, self.pending_rounds = list(record.batches), self.rounds_per_update - 1
        self.active = self.needs_params = True
        self.update = upcoming
        if self.sync:  # sync updates inside step(): the model holds theta now, not after it
            self.after_boundary()

    def after_boundary(self) -> None:
        """Right after the ``step()`` that started a measurement: the model holds theta."""
        if self.active and self.needs_params:
            with torch.no_grad():
                for p, q in zip(self.scratch.parameters(), self.model.parameters()):
                    p.copy_(q)
            self.needs_params = False

    def _finish(self) -> None:
        self.active = False
        squares = torch.zeros(3, dtype=torch.float64)
        for (base, _), master, start, state, grad in zip(self._shards(), self._masters(), self.start_shards,
                                                         self.start_state, self._sync_gradient()):
            u_acco = master - start
            param = start.clone()
            reference = type(base)([{**{k: v for k, v in base.param_groups[0].items() if k != "params"},
                                     "params": [param]}])
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
            flats = [f * min(1.0, self.config.max_grad_norm / (norm + 1e-6)) for f in flats]
        rank = dist.get_rank()
        return [f[rank * plan.chunk : (rank + 1) * plan.chunk].clone() for f, plan in zip(flats, self.opt.shard_plans)]


def rank(args: argparse.Namespace, ctx: Dist) -> dict[str, Any]:
    if args.method is None:
        raise SystemExit("a rank launch needs --method")
    config = common.model_config(args, seed=args.seed)
    train_data, held_out = common.training_text(config.seq_len)
    next_batch = common.batches(train_data, config, config.seed + ctx.rank)  # the example's per-rank streams
    eval_set = eval_batches(held_out, args.eval_batches, config.batch_size, config.seq_len, config.seed,
                            torch.device("cpu"))
    method = common.build_method(args.method, config, args.micro_batches)
    scheduler = torch.optim.lr_scheduler.LambdaLR(method.opt, WarmupCosine(args.warmup, args.updates))
    diff = (UpdateDifference(method, args.diff_every, args.updates)
            if args.diff_every and isinstance(method, common.AccoMethod) else None)
    losses: list[float] = []
    evals: list[tuple[int, float]] = [(0, evaluate(method.module, eval_set))]
    started, eval_s, updates = time.perf_counter(), 0.0, 0

    def committed() -> None:
        nonlocal eval_s, updates
        updates += 1
        scheduler.step()  # once per committed update
        if updates % args.eval_every == 0 and updates < args.updates:
            t = time.perf_counter()
            evals.append((updates, evaluate(method.module, eval_set)))
            eval_s += time.perf_counter() - t

    for _ in range(args.updates * method.rounds_per_update):
        record = common.train_round(method, next_batch, before_boundary=diff.before_boundary if diff else None)
        losses += [float(loss) for loss in record.losses]
        if record.committed:
            committed()
        if diff is not None:
            diff.after_boundary()
    if method.finish():
        committed()
    train_s = time.perf_counter() - started - eval_s
    if updates != args.updates:
        raise AssertionError(f"{args.method}: {updates} updates, expected {args.updates}")
    final = evaluate(method.module, eval_set)
    evals.append((args.updates, final))
    per_micro_batch = torch.tensor(losses, dtype=torch.float64)  # mean per update over every rank's micro-batches
    dist.all_reduce(per_micro_batch)
    per_update = (per_micro_batch / ctx.world_size).view(args.updates, args.micro_batches).mean(dim=1)
    samples = args.micro_batches * ctx.world_size * config.batch_size
    result = {"method": args.method, "ranks": ctx.world_size, "final_eval_loss": final,
              "eval": [{"update": u, "samples": u * samples, "loss": loss} for u, loss in evals],
              "train_loss_per_update": per_update.tolist(), "train_seconds": train_s,
              "parameters": sum(p.numel() for p in method.module.parameters())}
    if diff is not None:
        result["update_difference"] = {"updates": diff.updates, "ratios": diff.ratios,
                                       "mean": statistics.fmean(diff.ratios) if diff.ratios else None}
    return result


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    config = common.model_config(args, seed=args.seed)
    results: dict[str, Any] = {
        "config": {**config.as_dict(), "ranks": args.ranks, "updates": args.updates,
                   "micro_batches_per_update": args.micro_batches, "warmup": args.warmup,
                   "eval_batches": args.eval_batches, "eval_every": args.eval_every, "diff_every": args.diff_every,
                   "samples": args.updates * args.micro_batches * args.ranks * args.batch_size},
        "methods": {},
    }
    for name in args.methods:
        print(f"convergence: {name}", flush=True)
        run = results["methods"][name] = common.run_ranks(args, args.ranks, "--method", name)
        diff = run.get("update_difference", {}).get("mean")
        print(f"  final eval loss {run['final_eval_loss']:.4f} ({run['runtime_s']:.0f} s)"
              + (f", update difference {diff:.3f}" if diff is not None else ""), flush=True)
    sync = results["methods"].get("acco-sync", {}).get("final_eval_loss")
    for run in results["methods"].values():
        if sync:
            run["gap_vs_sync"] = (run["final_eval_loss"] - sync) / sync
    return results


def table(data: dict[str, Any]) -> str:
    cfg, rows = data["config"], []
    for name, run in data["methods"].items():
        diff = run.get("update_difference")
        rows.append([common.label(name), f"{run['final_eval_loss']:.4f}", f"{run.get('gap_vs_sync', math.nan):+.2%}",
                     f"{diff['mean']:.3f} ({len(diff['ratios'])} updates)" if diff and diff["mean"] is not None else "",
                     f"{statistics.fmean(run['train_loss_per_update'][-20:]):.4f}", common.minutes(run["runtime_s"])])
    parameters = next(iter(data["methods"].values()))["parameters"]
    return (f"{cfg['ranks']} ranks, {common.describe(cfg, parameters)}, {cfg['updates']} updates x "
            f"{cfg['micro_batches_per_update']} micro-batches per rank = {cfg['samples']:,} samples for every method; "
            f"lr {cfg['lr']}, clipping {cfg['max_grad_norm']}; eval on {cfg['eval_batches']} fixed held-out batches."
            "\n\n" + common.md_table(["method", "final eval loss", "vs sync", "update difference (mean)",
                               "train loss, last 20 updates", "runtime"], rows))


def runs_table(results: dict[str, Any]) -> str:
    """One row per run (``convergence.json`` and ``convergence-*.json``): how acco's and dpu's
    gaps to sync move with the seed and the settings."""
    rows = []
    for stem, data in results.items():
        cfg, methods = data["config"], data["methods"]
        if "acco-sync" not in methods:
            continue
        gap = {n: f"{methods[n]['final_eval_loss']:.4f} ({methods[n]['gap_vs_sync']:+.2%})" if n in methods else ""
               for n in ("acco", "acco-dpu")}
        rows.append([f"results/{stem}.json", str(cfg["seed"]), str(cfg["lr"]), str(cfg["updates"]),
                     f"{methods['acco-sync']['final_eval_loss']:.4f}", gap["acco"], gap["acco-dpu"]])
    return common.md_table(["run", "seed", "peak lr", "updates", "sync eval loss", "acco (vs sync)", "dpu (vs sync)"],
                           rows)


def plot(data: dict[str, Any], path: Path) -> str:
    plt = common.pyplot()
    cfg = data["config"]
    per_update = cfg["micro_batches_per_update"] * cfg["ranks"] * cfg["batch_size"]
    fig, (train_ax, eval_ax, diff_ax) = plt.subplots(1, 3, figsize=(17, 4.5))
    for name, run in data["methods"].items():
        spec, losses = common.method_spec(name), run["train_loss_per_update"]
        style = {"label": common.label(name).replace("`", ""), "color": spec.colour, "ls": spec.line}
        smooth = [statistics.fmean(losses[max(0, i - 9) : i + 1]) for i in range(len(losses))]
        train_ax.plot([(i + 1) * per_update for i in range(len(losses))], smooth, **style)
        eval_ax.plot([e["samples"] for e in run["eval"]], [e["loss"] for e in run["eval"]], marker=".", **style)
        diff = run.get("update_difference")
        if diff and diff["ratios"]:
            diff_ax.plot(diff["updates"], diff["ratios"], marker=".", **style)
    train_ax.set(xlabel="samples", ylabel="train loss (10-update mean)", title="training loss")
    eval_ax.set(xlabel="samples", ylabel="held-out loss", title="eval loss")
    diff_ax.set(xlabel="update", ylabel="||u - u_sync|| / (||u|| + ||u_sync||)",
                title="update vs the sync update from the same state")
    for ax in (train_ax, eval_ax):
        ax.set_ylim(top=min(ax.get_ylim()[1], 3.5))
    for ax in (train_ax, eval_ax, diff_ax):
        ax.legend(fontsize=8)
    return common.save_figure(fig, path)


def blocks(results: dict[str, Any], figures: Path) -> dict[str, str]:
    data = results["convergence"]
    return {"convergence-runs": runs_table(results),
            "convergence": table(data) + f"\n\n![convergence](results/{plot(data, figures / 'convergence.png')})"}


def targets(results: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    methods = results["convergence"]["methods"]
    if "acco" not in methods or "acco-sync" not in methods:
        return []
    rows: list[tuple[str, str, bool | None]] = []
    for stem, data in results.items():  # every run, the main one first: no picking
        cfg, found = data["config"], data["methods"]
        if "acco" in found and "acco-sync" in found:
            gap = found["acco"]["gap_vs_sync"]
            rows.append((f"acco's final eval loss within 1% of sync (results/{stem}.json: seed {cfg['seed']}, "
                         f"lr {cfg['lr']}, {cfg['updates']} updates)", f"{gap:+.2%}", abs(gap) <= 0.01))
    acco_gap = methods["acco"]["gap_vs_sync"]
    if "acco-dpu" in methods:
        dpu_gap = methods["acco-dpu"]["gap_vs_sync"]
        rows.append(("dpu's gap larger than acco's", f"{dpu_gap:+.2%} vs {acco_gap:+.2%}",
                     abs(dpu_gap) > abs(acco_gap)))
    diffs = [methods.get(n, {}).get("update_difference", {}).get("mean") for n in ("acco", "acco-dpu")]
    if diffs[0] is not None:
        rows.append(("(for reference) normalised update difference to sync, acco / dpu (paper: 0.07-0.11 for acco)",
                     " / ".join(f"{d:.3f}" for d in diffs if d is not None), None))
    return rows


BENCHMARK = common.Benchmark("convergence", __doc__, arguments, rank, sweep, quick=QUICK)

if __name__ == "__main__":
    common.main(BENCHMARK)
