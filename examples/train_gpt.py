"""Train a small byte-level GPT with acco, data parallel, on text every machine has.

Two processes on CPU (gloo), about two minutes on a 2-core machine:

    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py

Compare the modes (same number of samples and committed updates in each):

    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --mode sync
    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --mode dpu

A single process (no torchrun, no torch.distributed):

    python examples/train_gpt.py --updates 20

Your own text (a file, or every text file under a directory):

    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --data path/to/text

With no ``--data`` the corpus is the ``.py`` files of Python's standard library, read as
bytes (a vocabulary of 256); the last 5% is held out for evaluation. A distributed launch
is detected from the ``RANK`` environment variable that torchrun sets.

One optimizer update covers ``--micro-batches-per-update`` micro-batches per rank in every
mode. ``sync`` and ``dpu`` commit an update every round, so a round is that many
micro-batches; ``acco`` commits every second round (an estimate round, then a commit round
that adds both rounds' gradients), so its rounds are half as long.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from acco import AccoOptimizer

VOCAB_SIZE = 256  # bytes
EVAL_FRACTION = 0.05
SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


# ----------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--mode", choices=["acco", "dpu", "sync"], default="acco", help="how rounds overlap communication")
    add("--device", choices=["cpu", "cuda"], default="cpu")
    add("--backend", default=None, help="torch.distributed backend (default: gloo on cpu, nccl on cuda)")
    add("--data", default=None, help="a text file or a directory of text files (default: Python's stdlib)")
    add("--max-bytes", type=int, default=8_000_000, help="read at most this many bytes of text")
    add("--n-layer", type=int, default=4)
    add("--n-embd", type=int, default=128)
    add("--n-head", type=int, default=4)
    add("--seq-len", type=int, default=64)
    add("--batch-size", type=int, default=8, help="sequences per micro-batch, per rank")
    add("--lr", type=float, default=3e-3)
    add("--updates", type=int, default=400, help="committed optimizer updates to train for")
    add("--micro-batches-per-update", type=int, default=4, help="per rank; must be even for --mode acco")
    add("--eval-every", type=int, default=100, help="evaluate every this many updates (0: only at the end)")
    add("--eval-batches", type=int, default=8)
    add("--log-every", type=int, default=20, help="print progress every this many updates")
    add("--seed", type=int, default=1337)
    args = parser.parse_args(argv)
    if args.mode == "acco" and args.micro_batches_per_update % 2:
        parser.error("--mode acco splits an update into two rounds: --micro-batches-per-update must be even")
    if args.micro_batches_per_update < 1 or args.updates < 1:
        parser.error("--micro-batches-per-update and --updates must be positive")
    if args.n_embd % args.n_head:
        parser.error("--n-embd must be a multiple of --n-head")
    if args.data is not None and not Path(args.data).exists():
        parser.error(f"--data {args.data}: no such file or directory")
    return args


# --------------------------------------------------------------------------- distributed


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    device: torch.device

    @property
    def master(self) -> bool:
        return self.rank == 0


def setup_distributed(device_type: str, backend: str | None) -> Dist:
    """Join the process group when launched by torchrun (``RANK`` is set); else one process."""
    if "RANK" not in os.environ:
        device = torch.device(device_type)
        return Dist(rank=0, world_size=1, device=device)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # Every rank on one machine shares its cores: don't oversubscribe them.
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    dist.init_process_group(backend=backend or ("nccl" if device_type == "cuda" else "gloo"))
    return Dist(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device)


def print0(ctx: Dist, *values: object) -> None:
    if ctx.master:
        print(*values, flush=True)


# ---------------------------------------------------------------------------------- data


def text_files(root: Path) -> list[Path]:
    """Files under ``root`` sorted by path, skipping tests, caches and dot directories."""
    found: list[Path] = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in SKIPPED_DIRS and not d.startswith(".")]
        found += [Path(directory, name) for name in files]
    return sorted(found, key=lambda f: f.relative_to(root).as_posix())


def is_text(data: bytes) -> bool:
    if b"\0" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def load_corpus(path: str | None, max_bytes: int = 8_000_000) -> bytes:
    """The training text, at most ``max_bytes`` of it.

    With no ``path``: the ``.py`` files of Python's standard library (sorted; no
    site-packages, no test suites). With a file: its bytes. With a directory: every text
    file under it, sorted.
    """
    if path is None:
        files = [f for f in text_files(Path(sysconfig.get_paths()["stdlib"])) if f.suffix == ".py"]
    elif Path(path).is_dir():
        files = text_files(Path(path))
    else:
        with open(path, "rb") as file:
            return file.read(max_bytes)
    parts: list[bytes] = []
    total = 0
    for file in files:
        try:
            data = file.read_bytes()
        except OSError:
            continue
        if not is_text(data):
            continue
        parts.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(parts)[:max_bytes]


def split_corpus(corpus: bytes, seq_len: int) -> tuple[Tensor, Tensor]:
    """Bytes as token tensors: the first 95% to train on, the last 5% held out."""
    tokens = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
    cut = int(len(tokens) * (1 - EVAL_FRACTION))
    train, held_out = tokens[:cut], tokens[cut:]
    if len(held_out) <= seq_len + 1:
        raise SystemExit(
            f"the corpus is {len(corpus)} bytes; its held-out 5% must be longer than --seq-len {seq_len}: "
            "give more text or a shorter --seq-len"
        )
    return train, held_out


def sample_batch(data: Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``batch_size`` random windows of ``data``: inputs and next-byte targets."""
    starts = torch.randint(len(data) - seq_len - 1, (batch_size,), generator=generator)
    windows = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]


def train_batches(
    data: Tensor, batch_size: int, seq_len: int, seed: int, device: torch.device
) -> Iterator[tuple[Tensor, Tensor]]:
    """An endless stream of training batches; ``seed`` differs per rank, so does the data."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        x, y = sample_batch(data, batch_size, seq_len, generator)
        yield x.to(device), y.to(device)


def eval_batches(
    data: Tensor, count: int, batch_size: int, seq_len: int, seed: int, device: torch.device
) -> list[tuple[Tensor, Tensor]]:
    """A fixed set of held-out batches, the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        x, y = sample_batch(data, batch_size, seq_len, generator)
        batches.append((x.to(device), y.to(device)))
    return batches


# --------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_embd: int
    n_head: int
    seq_len: int
    vocab_size: int = VOCAB_SIZE


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        batch, time_, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        q, k, v = (t.view(batch, time_, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time_, channels))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """A pre-LayerNorm transformer block."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.seq_len, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):  # residual projections, as in GPT-2
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: Tensor) -> Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def loss_fn(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    logits = model(x)
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[Tensor, Tensor]]) -> float:
    """Mean loss over the fixed held-out batches (the parameters are the same on every rank)."""
    model.eval()
    loss = statistics.fmean(loss_fn(model, x, y).item() for x, y in batches)
    model.train()
    return loss


# ------------------------------------------------------------------------------ training


def micro_batches_per_round(mode: str, micro_batches_per_update: int) -> int:
    """acco commits every second round, so its rounds carry half an update's micro-batches."""
    return micro_batches_per_update // 2 if mode == "acco" else micro_batches_per_update


def rounds_per_update(mode: str) -> int:
    return 2 if mode == "acco" else 1


def recent_hidden_share(opt: AccoOptimizer, since_round: int) -> float:
    """Mean share of the comm lane's time hidden behind compute, over rounds >= since_round."""
    shares = [s.hidden_share for s in opt.round_stats if s.index >= since_round]
    return statistics.fmean(shares) if shares else math.nan


class Progress:
    """Rank 0's running tally between progress lines; eval time is left out of samples/s."""

    def __init__(self, samples_per_micro_batch: int) -> None:
        self.samples_per_micro_batch = samples_per_micro_batch
        self.start = time.perf_counter()
        self.paused = 0.0  # seconds spent evaluating
        self.total_micro_batches = 0
        self.window_start = self.start
        self.window_paused = 0.0
        self.window_micro_batches = 0
        self.window_losses: list[float] = []
        self.next_round = 0

    def micro_batch(self, loss: float) -> None:
        self.total_micro_batches += 1
        self.window_micro_batches += 1
        self.window_losses.append(loss)

    def pause(self, seconds: float) -> None:
        self.paused += seconds
        self.window_paused += seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def total_samples_per_second(self) -> float:
        return self.total_micro_batches * self.samples_per_micro_batch / (self.elapsed() - self.paused)

    def line(self, update: int, updates: int, opt: AccoOptimizer) -> str:
        now = time.perf_counter()
        rate = self.window_micro_batches * self.samples_per_micro_batch / (now - self.window_start - self.window_paused)
        loss = statistics.fmean(self.window_losses) if self.window_losses else math.nan
        hidden = recent_hidden_share(opt, self.next_round)
        self.next_round = opt.round_stats[-1].index + 1 if opt.round_stats else 0
        self.window_start, self.window_paused, self.window_micro_batches = now, 0.0, 0
        self.window_losses = []
        return (
            f"update {update:4d}/{updates} | train loss (rank 0) {loss:.4f} | {rate:7.1f} samples/s | "
            f"{now - self.start:6.1f} s | comm hidden {hidden:4.0%}"
        )


def timed_eval(model: nn.Module, batches: list[tuple[Tensor, Tensor]], progress: Progress) -> float:
    started = time.perf_counter()
    loss = evaluate(model, batches)
    progress.pause(time.perf_counter() - started)
    return loss


def train(args: argparse.Namespace, ctx: Dist) -> None:
    corpus = load_corpus(args.data, args.max_bytes)
    train_data, held_out = split_corpus(corpus, args.seq_len)
    batches = train_batches(train_data, args.batch_size, args.seq_len, args.seed + ctx.rank, ctx.device)
    eval_set = eval_batches(held_out, args.eval_batches, args.batch_size, args.seq_len, args.seed, ctx.device)

    torch.manual_seed(args.seed)  # the same initial model on every rank (acco also broadcasts rank 0's)
    config = GPTConfig(args.n_layer, args.n_embd, args.n_head, args.seq_len)
    model = GPT(config).to(ctx.device)
    opt = AccoOptimizer(
        model, torch.optim.AdamW, mode=args.mode, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1
    )

    per_round = micro_batches_per_round(args.mode, args.micro_batches_per_update)
    rounds = args.updates * rounds_per_update(args.mode)
    print0(
        ctx,
        f"mode {args.mode} | {ctx.world_size} rank(s) on {ctx.device} | "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters | "
        f"corpus {len(train_data):,} train + {len(held_out):,} held-out bytes | "
        f"{args.updates} updates x {args.micro_batches_per_update} micro-batches x {args.batch_size} sequences "
        f"x {ctx.world_size} rank(s) | {per_round} micro-batches per round",
    )
    progress = Progress(args.batch_size * ctx.world_size)
    print0(ctx, f"update    0 | eval loss {timed_eval(model, eval_set, progress):.4f}")

    # Every round ends with step(); the last round's update lands in finish(), so every
    # mode computes exactly updates * micro_batches_per_update micro-batches per rank.
    for _ in range(rounds):
        for _ in range(per_round):
            x, y = next(batches)
            loss = loss_fn(model, x, y)
            loss.backward()
            opt.accumulate(weight=x.numel())  # the loss is a mean over this many tokens
            progress.micro_batch(loss.item())
        if opt.step():  # the model now holds a newly committed update
            update = opt.num_updates
            if update % args.log_every == 0:
                print0(ctx, progress.line(update, args.updates, opt))
            if args.eval_every and update % args.eval_every == 0 and update < args.updates:
                print0(ctx, f"update {update:4d} | eval loss {timed_eval(model, eval_set, progress):.4f}")
    landed = opt.finish()  # acco and dpu: the last round's update lands here
    if progress.window_micro_batches and (landed or opt.num_updates % args.log_every):
        print0(ctx, progress.line(opt.num_updates, args.updates, opt))
    assert opt.num_updates == args.updates, (opt.num_updates, args.updates)

    final = timed_eval(model, eval_set, progress)
    print0(ctx, f"{progress.total_samples_per_second():.1f} samples/s over {progress.elapsed():.1f} s")
    print0(ctx, f"final eval loss {final:.4f}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ctx = setup_distributed(args.device, args.backend)
    try:
        train(args, ctx)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
