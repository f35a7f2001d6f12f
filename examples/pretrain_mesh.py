"""Pretrain a GPT on N nodes x G GPUs: FSDP2 inside each node, acco's local steps across nodes.

The recommended layout for slow links between nodes (docs/multinode.md): each node is one
replica group whose G ranks shard the model with FSDP2 (`fully_shard` on the mesh's "shard"
dimension, bf16 compute over an fp32 master through `MixedPrecisionPolicy`), and acco's
`mode="local"` synchronises the replica groups every `sync_every` inner steps across the
"replicate" dimension, the only traffic that leaves a node. On 2 nodes of 8 GPUs, run the same
command on each node (HOST: node 0's address, JOB: any id the nodes share; `--ckpt-dir` on a
filesystem every node sees, since each rank writes its own part of a checkpoint):

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 --rdzv_id=JOB \\
        examples/pretrain_mesh.py --ckpt-dir runs/pretrain --resume

`--mesh` defaults to one replica group per node (nodes x processes per node: 2x8 here). On one
CPU machine, 4 processes as 2 replica groups of 2 ranks (gloo):

    torchrun --standalone --nproc_per_node=4 examples/pretrain_mesh.py --mesh 2x2 --backend gloo --ckpt-dir runs/pretrain-cpu

A checkpoint (`acco.checkpoint`, sharded, atomic) is written every `--ckpt-every` inner steps,
at an outer round; with `--resume` the run continues from the newest complete one in
`--ckpt-dir` and starts afresh when there is none, so one command serves a first start, a
restart and `torchrun --max-restarts=3`. The held-out loss is that of the global values
(`opt.eval()` ... `opt.train()`: each replica's own parameters are set aside meanwhile), every
`--eval-every` inner steps and, after `finish()`, at the end.

At the end every rank prints the bytes acco holds on it (the sum of `opt.buffer_bytes()`)
beside `acco_local_bytes()`'s prediction, the formula of docs/multinode.md, "Memory per rank".

What changes on GPUs (`--device cuda`, the default where CUDA is available): NCCL, one GPU per
rank, and acco's comm lane on a CUDA side stream instead of a thread sharing the CPU cores; the
bf16 compute (`--param-dtype`, bf16 by default) runs on CPUs too, gloo carrying FSDP2's bf16
all-gathers. docs/multinode.md has the NCCL variables for Ethernet between nodes.

The model, the text (Python's standard library's `.py` files, read as bytes) and the schedule
are examples/train_gpt.py's. A distributed launch is required (torchrun sets `RANK`).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as recompute

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import (  # noqa: E402
    GPT,
    Dist,
    GPTConfig,
    WarmupCosine,
    eval_batches,
    evaluate,
    load_corpus,
    loss_fn,
    param_groups,
    print0,
    sample_batch,
    setup_distributed,
    split_corpus,
)

from acco import AccoOptimizer, checkpoint  # noqa: E402

__all__ = ["acco_local_bytes", "main", "parse_args"]


# ------------------------------------------------------------------- memory per rank


def acco_local_bytes(
    local_numels: Sequence[int],
    replicas: int,
    param_bytes: int,
    *,
    sync_delay: int | str,
    overlap: str,
    outer_bits: int,
    error_feedback: bool,
    launched: bool = True,
    landing: str = "fixed",
    outer_common: bool = True,
) -> dict[str, int]:
    """The bytes acco holds on one rank in ``mode="local"``, per buffer, summed over the param
    groups: what ``AccoOptimizer.buffer_bytes()`` reports, term by term (docs/multinode.md,
    "Memory per rank"). The base optimizers' state is not in it (the inner one's is the
    model's, as without acco; the outer one's momentum is ``master``'s size again).

    Each param group's buffers are flat: this rank's elements of it (``local_numels``: its
    FSDP2 shards' local tensors, about P/S for S ranks per replica group), padded to a multiple
    of the ``replicas`` (R) the outer round shards them across.

    Args:
        local_numels: per param group, the elements of its parameters' local tensors.
        replicas: R, the ranks of acco's process group (one per replica group).
        param_bytes: b, the bytes of a value of the (sharded) parameters' dtype: 4 for fp32,
            also under FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``, whose
            sharded parameters stay fp32.
        sync_delay / overlap / outer_bits / error_feedback / landing: the resolved local-mode
            options (``opt.options.local``; ``error_feedback``: a residual kept, ``outer_error_feedback``
            below 16 bits or with ``outer_topk``; ``landing``: ``"block-or-hide"``, the default with ``sync_every="auto"``, lands
            rounds a step late too).
        launched: an outer round has been launched (the round's buffer exists from the first).
        outer_common: the outer step has a part every replica shares other than the global
            values themselves (momentum or weight decay; not plain averaging, the default): the
            estimate rule keeps a copy of it.
    """
    if replicas < 1 or param_bytes not in (2, 4, 8):
        raise ValueError(f"Invalid replicas={replicas} or param_bytes={param_bytes}")
    master_bytes = max(4, param_bytes)  # the global values' shard: fp32, fp64 for fp64 parameters
    overlaps = sync_delay != 0 or landing == "block-or-hide"
    terms = dict.fromkeys(("grad_accumulator", "grad_handover", "gathered", "master", "master_grad",
                           "estimate_copy", "handed_over", "global_values", "outer_residual", "common_term"), 0)  # fmt: skip
    for numel in local_numels:
        chunk = max(1, math.ceil(numel / replicas))  # this rank's 1/R of the group's flat buffer
        padded = chunk * replicas
        model_size = padded * param_bytes
        terms["grad_accumulator"] += model_size
        # The round's buffer: the parameters handed over, then the new global values.
        terms["grad_handover"] += model_size if launched else 0
        terms["global_values"] += model_size  # eval() and global_parameters() at any step
        terms["master"] += chunk * master_bytes
        if replicas == 1 or param_bytes != master_bytes:  # the outer step's gradient, unless in the round's buffer
            terms["master_grad"] += chunk * master_bytes
        if replicas == 1:  # nothing to communicate: the new values land in a buffer of their own
            terms["gathered"] += model_size
        if error_feedback:  # what a round did not send of the pseudo-gradients (rounding, or top-k), fp32
            terms["outer_residual"] += padded * 4
        if overlaps and overlap in ("keep", "estimate") and launched:  # the start of the round in flight
            terms["handed_over"] += model_size
        if overlaps and overlap == "estimate" and outer_common:  # the outer step's common part, every rank's copy
            terms["common_term"] += model_size
    return terms


def local_numels(opt: AccoOptimizer) -> list[int]:
    """Per param group, the elements of this rank's local tensors (FSDP2's shards)."""
    return [sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in group["params"])
            for group in opt.param_groups]  # fmt: skip


def state_bytes(optimizers: Sequence[torch.optim.Optimizer | None]) -> int:
    """The bytes of the tensors in the optimizers' state (DTensors: their local tensors)."""
    total = 0
    for optimizer in optimizers:
        if optimizer is None:
            continue
        for entry in optimizer.state.values():
            for value in entry.values():
                if isinstance(value, Tensor):
                    total += (value.to_local() if hasattr(value, "to_local") else value).nbytes
    return total


def buffer_totals(opt: AccoOptimizer) -> dict[str, int]:
    """``opt.buffer_bytes()`` summed over the param groups, by buffer."""
    measured: dict[str, int] = {}
    for entry in opt.buffer_bytes():
        for name, size in entry.items():
            measured[name] = measured.get(name, 0) + size
    return measured


def memory_line(opt: AccoOptimizer, ctx: Dist, shape: tuple[int, int], launched: bool) -> str:
    """This rank's bytes: acco's buffers measured and predicted, and the optimizers' state."""
    measured = buffer_totals(opt)
    local = opt.options.local
    numels = local_numels(opt)
    param_bytes = next(iter(opt.param_groups[0]["params"])).dtype.itemsize
    predicted = acco_local_bytes(numels, shape[0], param_bytes, sync_delay=local.sync_delay,
                                 overlap=local.overlap.value, outer_bits=local.outer_bits,
                                 error_feedback=local.error_feedback, launched=launched, landing=local.landing,
                                 outer_common=local.estimate is not None and not local.estimate.common_is_values)  # fmt: skip
    differing = [f"{name} {measured.get(name, 0)} vs {size}" for name, size in predicted.items()
                 if measured.get(name, 0) != size]  # fmt: skip
    verdict = "DIFFERENT: " + ", ".join(differing) if differing else "equal"
    return (
        f"memory rank {ctx.rank} (replica {ctx.rank // shape[1]}, shard {ctx.rank % shape[1]}): "
        f"acco holds {sum(measured.values())} bytes (buffer_bytes), formula {sum(predicted.values())} ({verdict}) | "
        f"local values {sum(numels)} x {param_bytes} bytes, R {shape[0]} | "
        f"inner optimizer state {state_bytes(opt.inner_optimizers)} bytes, "
        f"outer {state_bytes(opt.outer_optimizers)} bytes"
    )


# ---------------------------------------------------------------------- arguments


def parse_sync_delay(value: str) -> int | str:
    """An int, or acco's "auto" / "half"."""
    return value if value in ("auto", "half") else int(value)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--mesh", default=None, metavar="RxS",
        help="R replica groups of S ranks (default: one per node, nodes x processes per node)")
    add("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    add("--backend", default=None, help="torch.distributed backend (default: nccl on cuda, gloo on cpu)")
    add("--param-dtype", choices=["bf16", "fp32"], default="bf16",
        help="FSDP2's compute and all-gather dtype; the sharded parameters, acco's master and the optimizers stay fp32")
    add("--activation-checkpointing", action="store_true", help="recompute each block's activations in backward")
    add("--compile", action="store_true", help="torch.compile each block (before fully_shard, as torchtitan does)")
    add("--data", default=None, help="a text file or a directory of text files (default: Python's stdlib)")
    add("--max-bytes", type=int, default=8_000_000, help="read at most this many bytes of text")
    add("--n-layer", type=int, default=4)
    add("--n-embd", type=int, default=128)
    add("--n-head", type=int, default=4)
    add("--seq-len", type=int, default=64)
    add("--batch-size", type=int, default=8, help="sequences per micro-batch, per rank")
    add("--micro-batches", type=int, default=1, help="micro-batches per inner step, per rank")
    add("--steps", type=int, default=400, help="inner steps (the fastest replica's)")
    add("--lr", type=float, default=3e-3, help="the inner optimizer's peak learning rate")
    add("--warmup", type=int, default=20, help="inner steps of linear warm-up before the cosine decay")
    add("--grad-clip", type=float, default=1.0, help="clip each replica's gradient norm (0: off)")
    add("--sync-every", type=int, default=None, help="inner steps per outer round (default: acco's)")
    add("--sync-delay", type=parse_sync_delay, default=None,
        help="inner steps an outer round stays in flight: an int, auto or half (default: acco's)")
    add("--pacing", default=None, help="speed or lockstep (default: acco's)")
    add("--eval-every", type=int, default=100, help="evaluate the global values about every this many inner steps")
    add("--eval-batches", type=int, default=8)
    add("--ckpt-dir", default=None, help="write checkpoints here")
    add("--ckpt-every", type=int, default=100, help="checkpoint about every this many inner steps")
    add("--resume", action="store_true", help="continue from the newest complete checkpoint in --ckpt-dir, if any")
    add("--seed", type=int, default=1337)
    add("--timeout", type=float, default=600, help="seconds before a stuck collective fails")
    args = parser.parse_args(argv)
    if args.n_embd % args.n_head:
        parser.error("--n-embd must be a multiple of --n-head")
    if min(args.steps, args.micro_batches, args.ckpt_every, args.eval_every) < 1:
        parser.error("--steps, --micro-batches, --ckpt-every and --eval-every must be positive")
    if args.resume and args.ckpt_dir is None:
        parser.error("--resume needs --ckpt-dir")
    if args.mesh is not None:
        try:
            args.mesh = tuple(int(n) for n in args.mesh.lower().split("x"))
        except ValueError:
            parser.error(f"--mesh {args.mesh}: expected RxS, e.g. 2x8")
        if len(args.mesh) != 2 or min(args.mesh) < 1:
            parser.error(f"--mesh {args.mesh}: expected RxS with R, S >= 1, e.g. 2x8")
    return args


# ------------------------------------------------------------------------- model


class CheckpointedGPT(GPT):
    """train_gpt's GPT, each block's activations recomputed in backward (same parameters)."""

    def forward(self, idx: Tensor) -> Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = recompute(block, x, use_reentrant=False)
        return self.lm_head(self.ln_f(x))


def build_model(args: argparse.Namespace, ctx: Dist, shape: tuple[int, int]) -> tuple[nn.Module, dist.ProcessGroup]:
    """The model, FSDP2 inside each replica group; returns it and the group acco reduces across."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # Row-major: ranks r*S .. r*S+S-1 (one node under torchrun) form replica group r, so FSDP2's
    # collectives stay inside a node and only acco's outer rounds cross the network.
    mesh = init_device_mesh(ctx.device.type, shape, mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(args.seed)  # the same initial model everywhere (acco also broadcasts rank 0's)
    config = GPTConfig(args.n_layer, args.n_embd, args.n_head, args.seq_len)
    model = (CheckpointedGPT if args.activation_checkpointing else GPT)(config).to(ctx.device)
    # bf16 compute and all-gathers, fp32 gradient reduce-scatter; the sharded parameters, which
    # acco and the inner AdamW update, stay fp32 (casting the model would drop that master).
    compute = torch.bfloat16 if args.param_dtype == "bf16" else torch.float32
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    for block in model.blocks:
        if args.compile:
            block.compile()
        fully_shard(block, mesh=mesh["shard"], mp_policy=policy)  # never the whole mesh: no HSDP
    # The root's output (the logits) in fp32, so the loss is computed in fp32.
    root_policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32, output_dtype=torch.float32)
    fully_shard(model, mesh=mesh["shard"], mp_policy=root_policy)
    return model, mesh["replicate"].get_group()


def mesh_shape(args: argparse.Namespace, ctx: Dist) -> tuple[int, int]:
    if args.mesh is not None:
        shape = args.mesh
    else:  # one replica group per node
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size))
        shape = (ctx.world_size // per_node, per_node)
    if shape[0] * shape[1] != ctx.world_size:
        raise SystemExit(f"--mesh {shape[0]}x{shape[1]} needs {shape[0] * shape[1]} ranks, torchrun started {ctx.world_size}")
    return shape


def evaluate_global(opt: AccoOptimizer, model: nn.Module, batches: list[tuple[Tensor, Tensor]]) -> float:
    """The held-out loss of the global values (the last landed outer round's), on every rank.

    Not collective for acco (``eval()``/``train()`` act on this rank alone), but FSDP2's forward
    is, inside a replica group: every rank of the group must evaluate.
    """
    opt.eval()
    try:
        return evaluate(model, batches)
    finally:
        opt.train()  # the next forward gathers the replica's own values again (acco reshards FSDP2's)


# ---------------------------------------------------------------------- training


def train(args: argparse.Namespace, ctx: Dist) -> None:
    shape = mesh_shape(args, ctx)
    corpus = load_corpus(args.data, args.max_bytes)
    train_data, held_out = split_corpus(corpus, args.seq_len)
    eval_set = eval_batches(held_out, args.eval_batches, args.batch_size, args.seq_len, args.seed, ctx.device)
    generator = torch.Generator().manual_seed(args.seed + ctx.rank)  # every rank its own micro-batches

    model, replicate = build_model(args, ctx, shape)
    local_options = {name: value for name, value in (("sync_every", args.sync_every), ("sync_delay", args.sync_delay),
                                                     ("pacing", args.pacing)) if value is not None}  # fmt: skip
    opt = AccoOptimizer(
        param_groups(model, weight_decay=0.1),
        torch.optim.AdamW,
        process_group=replicate,  # acco across replica groups; FSDP2 inside
        module=model,
        mode="local",
        lr=args.lr,
        betas=(0.9, 0.95),
        max_grad_norm=args.grad_clip or None,
        timeout=datetime.timedelta(seconds=args.timeout),
        **local_options,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(args.warmup, args.steps))
    sync_every = opt.options.local.sync_every
    # Collectives across replicas (checkpoints) happen at outer rounds, which every replica
    # lands, never at inner step counts, which differ between replicas under speed pacing.
    ckpt_rounds, eval_rounds = max(1, args.ckpt_every // sync_every), max(1, args.eval_every // sync_every)

    latest = checkpoint.latest_checkpoint(args.ckpt_dir) if args.resume else None
    if latest is not None:
        extra = checkpoint.load(latest, opt, model)
        scheduler.load_state_dict(extra["scheduler"])
        generator.set_state(extra["generator"])
        print0(ctx, f"resumed from {latest} at outer round {opt.outer_rounds}, inner step {opt.num_updates}")
    first_round = opt.outer_rounds

    parameters = sum(p.numel() for p in model.parameters())
    print0(ctx, f"mesh {shape[0]}x{shape[1]} ({shape[0]} replica groups of {shape[1]} ranks) on {ctx.device} | "
                f"{parameters / 1e6:.2f}M parameters, {args.param_dtype} compute | "
                f"{args.micro_batches} x {args.batch_size} sequences of {args.seq_len} per rank and inner step | "
                f"{args.steps} inner steps | {', '.join(opt.options.local.describe()[:5])}")  # fmt: skip
    if latest is None:
        print0(ctx, f"step    0 | eval loss {evaluate_global(opt, model, eval_set):.4f}")

    opt.stop_after(steps=args.steps)  # every replica stops at the same outer round
    losses: list[Tensor] = []
    rounds = opt.outer_rounds
    while not opt.should_stop:
        for _ in range(args.micro_batches):
            x, y = sample_batch(train_data, args.batch_size, args.seq_len, generator)
            if ctx.device.type == "cuda":
                x, y = x.pin_memory().to(ctx.device, non_blocking=True), y.pin_memory().to(ctx.device, non_blocking=True)
            loss = loss_fn(model, x, y)
            # Weighted by its tokens, declared before backward(): acco folds each gradient FSDP2
            # reduce-scatters into its accumulator as it comes (no p.grad is kept).
            with opt.micro_batch(weight=x.numel()):
                loss.backward()
            losses.append(loss.detach())
        if opt.step():
            scheduler.step()
        if opt.outer_rounds == rounds:
            continue
        rounds = opt.outer_rounds  # an outer round landed: every replica is at this round
        train_loss = torch.stack(losses).mean().item()
        losses.clear()
        line = f"step {opt.num_updates:4d} | outer round {rounds} | train loss (replica {opt.replica}) {train_loss:.4f}"
        if rounds % eval_rounds == 0 and not opt.should_stop:
            line += f" | eval loss (global values) {evaluate_global(opt, model, eval_set):.4f}"
        print0(ctx, line)
        if args.ckpt_dir and rounds % ckpt_rounds == 0 and not opt.should_stop:
            path = Path(args.ckpt_dir) / f"round-{rounds:06d}"
            checkpoint.save(path, opt, model, {"scheduler": scheduler.state_dict(), "generator": generator.get_state()},
                            keep=2)  # fmt: skip
            print0(ctx, f"saved {path}")

    # acco's buffers per rank, before finish() (every rank prints its own line).
    launched = opt.outer_rounds > first_round or opt.in_flight is not None
    print(memory_line(opt, ctx, shape, launched) + "\n", end="", flush=True)  # one write: ranks' lines stay whole
    opt.finish()  # every replica ends at the same global values
    final = evaluate(model, eval_set)
    print0(ctx, f"final eval loss {final:.4f} after {opt.num_updates} inner steps, {opt.outer_rounds} outer rounds")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun (see the commands at the top of examples/pretrain_mesh.py)")
    ctx = setup_distributed(args.device, args.backend, datetime.timedelta(seconds=args.timeout))
    try:
        train(args, ctx)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
