"""A LitGPT-style pretraining loop on Lightning Fabric, with acco as the strategy.

The shape of LitGPT's ``pretrain.py`` loop (``fabric.setup``, a learning rate written into the
param groups every iteration, ``no_backward_sync`` while accumulating, ``fabric.backward``,
``fabric.clip_gradients``, ``optimizer.step()``, ``fabric.save``) on the byte-level GPT of
examples/train_gpt.py and the text of Python's standard library. Two processes on CPU:

    python examples/fabric_pretrain.py --devices 2                 # Fabric launches the ranks
    torchrun --standalone --nproc_per_node=2 examples/fabric_pretrain.py --devices 2
    python examples/fabric_pretrain.py --devices 2 --strategy ddp  # the same loop on DDP

The three edits a LitGPT-style script needs (marked ``# acco:`` below): the strategy (told the
micro-batches per step), the loss not divided by the accumulation steps (acco averages the
micro-batches), and ``finish()`` at the end. An optimizer step is one committed update of
``--micro-batches`` per rank in every mode, as on DDP (in ``acco`` mode an estimate round of
half of them, then a commit round: ``--micro-batches`` must be even there).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import GPT, GPTConfig, eval_batches, load_corpus, param_groups, sample_batch, split_corpus  # noqa: E402

from lightning.fabric import Fabric  # noqa: E402

from acco.integrations.fabric import AccoFabricStrategy  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--strategy", default="acco", choices=["acco", "dpu", "sync", "local", "ddp"])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (committed updates)")
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step and rank")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--max-bytes", type=int, default=2_000_000)
    parser.add_argument("--seconds", type=float, default=None, help="stop after this much training time")
    parser.add_argument("--out", default=None, help="save the final checkpoint here (fabric.save)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    strategy = "ddp" if args.strategy == "ddp" else AccoFabricStrategy(  # acco: 1
        args.strategy, accumulate_grad_batches=args.micro_batches, max_grad_norm=args.max_norm)
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(1337)
    train_data, held_out = split_corpus(load_corpus(None, args.max_bytes), args.seq_len)
    held_out_batches = eval_batches(held_out, 8, args.batch_size, args.seq_len, seed=0, device=fabric.device)
    generator = torch.Generator().manual_seed(1337 + fabric.global_rank)

    model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, seq_len=args.seq_len))
    model = fabric.setup(model)
    optimizer = torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=args.lr, betas=(0.9, 0.95))
    optimizer = fabric.setup_optimizers(optimizer)

    started = time.perf_counter()
    for step in range(args.steps):
        lr = args.lr * 0.5 * (1 + math.cos(math.pi * step / args.steps))  # cosine, as LitGPT's get_lr
        for group in optimizer.param_groups:
            group["lr"] = lr
        for micro in range(args.micro_batches):
            is_accumulating = micro < args.micro_batches - 1
            x, y = sample_batch(train_data, args.batch_size, args.seq_len, generator)
            with fabric.no_backward_sync(model, enabled=is_accumulating):
                logits = model(x.to(fabric.device))
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.to(fabric.device).reshape(-1))
                fabric.backward(loss if args.strategy != "ddp" else loss / args.micro_batches)  # acco: 2
        fabric.clip_gradients(model, optimizer, max_norm=args.max_norm)
        optimizer.step()
        optimizer.zero_grad()
        if step % 20 == 0 or step == args.steps - 1:
            fabric.print(f"step {step}: loss {loss.item():.4f}, lr {lr:.2e}")
        if args.seconds is not None and fabric.broadcast(time.perf_counter() - started > args.seconds):
            break
    if args.strategy != "ddp":
        optimizer.finish()  # acco: 3 (collective): the model holds the last committed parameters
    with torch.no_grad():
        losses = [F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item() for x, y in held_out_batches]
    fabric.print(f"held-out loss {sum(losses) / len(losses):.4f} after {step + 1} steps, "
                 f"{time.perf_counter() - started:.1f}s ({args.strategy})")
    if args.out is not None:
        fabric.save(args.out, {"model": model, "step": step + 1})


if __name__ == "__main__":
    main()
