"""Lightning behind a slow link: the same LightningModule (the GPT of ``examples/train_gpt.py``
on the standard library's text) trained by the ranks of one machine whose loopback is limited
to 50 Mbit/s (``benchmarks/netns.py``), each strategy for the same wall-clock budget: Lightning's
``strategy="ddp"`` against ``AccoStrategy`` in each mode, the held-out loss side by side.

    sudo $(which python) benchmarks/lightning_slow_link.py             # 5 strategies x 60 s: ~6 min
    sudo $(which python) benchmarks/lightning_slow_link.py --quick     # 10 s each, results/scratch/

Every strategy gets the same Trainer arguments (``accumulate_grad_batches=--accumulate``,
``gradient_clip_val``, the same LightningModule and data): a Trainer step is one committed
update of ``--accumulate`` micro-batches per rank in every mode (``acco``: an estimate round of
half of them, then a commit round; ``local``: an inner update, the replicas averaged every
``--sync-every`` steps). The budget ends at the first step boundary the ranks' agreed clock
reaches it (``time_to_loss.AgreedClock``: no blocking collective per step).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import common
from examples.train_gpt import Dist, eval_batches, evaluate, loss_fn, param_groups
from time_to_loss import AgreedClock

import torch
import torch.distributed as dist

__all__ = ["BENCHMARK", "blocks", "runtimes"]

STRATEGIES = ("ddp", "sync", "dpu", "acco", "local")
DEFAULTS = common.ModelConfig(n_layer=2, n_embd=128, n_head=4, seq_len=128, batch_size=8, lr=1e-3)
EVAL_SEED = 4321


def arguments(parser: argparse.ArgumentParser) -> None:
    common.model_arguments(parser, DEFAULTS)
    add = parser.add_argument
    add("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    add("--strategy", default=None, choices=STRATEGIES, help=argparse.SUPPRESS)  # one launch's
    add("--ranks", type=int, default=2)
    add("--rate", default="50mbit", help="the loopback's rate limit (a tc rate)")
    add("--budget", type=float, default=60.0, help="wall-clock seconds of training per strategy")
    add("--accumulate", type=int, default=4, help="accumulate_grad_batches: micro-batches per rank per update (even)")
    add("--sync-every", type=int, default=8, help="local mode: inner steps per outer round")
    add("--lr", type=float, default=DEFAULTS.lr)
    add("--grad-clip", type=float, default=1.0, help="gradient_clip_val (0: off)")
    add("--eval-batches", type=int, default=16)


def check(args: argparse.Namespace) -> str | None:
    if args.accumulate < 2 or args.accumulate % 2:
        return f"--accumulate must be even and at least 2 (acco splits an update into two rounds), got {args.accumulate}"
    return None


def make_module(config: common.ModelConfig) -> Any:
    """The LightningModule every strategy trains, unchanged between them."""
    import lightning.pytorch as pl

    class LanguageModel(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = common.build_model(config)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return loss_fn(self.model, x, y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(param_groups(self.model, config.weight_decay), lr=config.lr, betas=config.betas)

    return LanguageModel()


class MicroBatches(torch.utils.data.IterableDataset):
    """This rank's endless stream of micro-batches (``common.rank_batches``)."""

    def __init__(self, next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.next_batch = next_batch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()


def budget_callback(budget: float) -> Any:
    """Stops the Trainer at the first step boundary whose agreed clock reaches ``budget``."""
    import lightning.pytorch as pl

    class Budget(pl.Callback):
        def __init__(self) -> None:
            self.clock: AgreedClock | None = None
            self.step = 0
            self.seconds = 0.0

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            dist.barrier()
            self.clock = AgreedClock()

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if self.clock is None or trainer.global_step == self.step:
                return  # inside an accumulation window
            self.step = trainer.global_step
            if self.clock.budget_reached(self.clock.exchange(self.clock.elapsed()), budget):
                trainer.should_stop = True

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if self.clock is not None:
                self.clock.close()
                self.seconds = self.clock.elapsed()

    return Budget()


def strategy_of(name: str, args: argparse.Namespace) -> Any:
    """The Trainer's strategy (the only Trainer argument that differs)."""
    from acco.integrations.lightning import AccoStrategy

    if name == "ddp":
        return "ddp"
    return AccoStrategy(mode=name, **({"sync_every": args.sync_every} if name == "local" else {}))


def rank(args: argparse.Namespace, ctx: Dist) -> dict[str, Any]:
    """One strategy's launch: train for the budget, then the held-out loss (rank 0's)."""
    import lightning.pytorch as pl

    config = common.model_config(args, lr=args.lr)
    train, held_out = common.training_text(config.seq_len)
    evaluation = eval_batches(held_out, args.eval_batches, config.batch_size, config.seq_len, EVAL_SEED, ctx.device)
    module = make_module(config)
    initial = evaluate(module.model, evaluation)
    budget = budget_callback(args.budget)
    pl.seed_everything(config.seed, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=ctx.world_size, strategy=strategy_of(args.strategy, args),
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.grad_clip or None, max_epochs=1, max_steps=-1, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[budget],
        use_distributed_sampler=False,
    )
    loader = torch.utils.data.DataLoader(MicroBatches(common.batches(train, config, config.seed + 1000 * ctx.rank)),
                                         batch_size=None)
    started = time.perf_counter()
    trainer.fit(module, loader)
    fit_s = time.perf_counter() - started
    acco = getattr(trainer.strategy, "acco_optimizer", None)
    steps = trainer.global_step
    return {
        "strategy": args.strategy,
        "accumulate_grad_batches": args.accumulate,
        "steps": steps,
        "updates": steps if acco is None else acco.num_updates,
        "micro_batches_per_rank": steps * args.accumulate,
        "train_s": budget.seconds,
        "fit_s": fit_s,
        "initial_loss": initial,
        "held_out_loss": evaluate(module.model, evaluation),
        "parameters": sum(p.numel() for p in module.parameters()),
    }


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    runs = {}
    for name in args.strategies:
        runs[name] = common.run_ranks(args, args.ranks, "--strategy", name, rate=args.rate, netns=True)
        print(f"{name}: {runs[name]['steps']} steps, held-out loss {runs[name]['held_out_loss']:.4f}", flush=True)
    config = common.model_config(args, lr=args.lr).as_dict()
    return {"config": config, "rate": args.rate, "ranks": args.ranks, "budget_s": args.budget,
            "accumulate": args.accumulate, "sync_every": args.sync_every, "grad_clip": args.grad_clip, "runs": runs}


def table(data: dict[str, Any]) -> str:
    runs = data["runs"]
    first = next(iter(runs.values()))
    intro = (f"{common.describe(data['config'], first['parameters'])}, {data['ranks']} ranks behind "
             f"{common.rate_text(data['rate'])}, {data['budget_s']:.0f} s of training each, the same Trainer "
             f"arguments for every strategy (`accumulate_grad_batches={data['accumulate']}`, "
             f"`gradient_clip_val={data['grad_clip']}`: a Trainer step is one update of {data['accumulate']} "
             f"micro-batches per rank); held-out loss at the start {first['initial_loss']:.3f}. "
             "Command: `sudo $(which python) benchmarks/lightning_slow_link.py`.\n\n")
    names = {"ddp": '`strategy="ddp"`', "sync": '`AccoStrategy(mode="sync")`', "dpu": '`AccoStrategy(mode="dpu")`',
             "acco": '`AccoStrategy(mode="acco")`',
             "local": f'`AccoStrategy(mode="local", sync_every={data["sync_every"]})`'}
    rows = [[names[name], str(run["steps"]), str(run["updates"]), str(run["micro_batches_per_rank"]),
             f"{run['train_s']:.1f}", f"**{run['held_out_loss']:.3f}**"]
            for name, run in runs.items()]
    return intro + common.md_table(["strategy", "Trainer steps", "committed updates", "micro-batches per rank",
                                    "training s", "held-out loss"], rows)


def blocks(results: dict[str, Any], figures: Path) -> dict[str, str]:
    return {"lightning_slow_link": table(results["lightning_slow_link"])}


def runtimes(results: dict[str, Any]) -> list[tuple[str, float]]:
    return [("lightning_slow_link", results["lightning_slow_link"]["runtime_s"])]


BENCHMARK = common.Benchmark("lightning_slow_link", __doc__, arguments, rank, sweep, check=check,
                             quick={"budget": 10.0, "eval_batches": 4})

if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    common.main(BENCHMARK)
