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

Heterogeneous ranks: rank 1 three times slower, the others accumulating more micro-batches
while the round in flight is not done instead of idling:

    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --slowdown 1:3 --accumulate-while-waiting

Slow links, local steps (an outer round every ``--sync-every`` inner updates; each replica
takes as many inner updates per round as its speed allows, and every replica stops at the
outer round after which the fastest could not take another within ``--updates``):

    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --mode local --slowdown 1:3

Large models: FSDP2 (or tensor parallelism) inside each replica group, acco across them.
Four processes as 2 replica groups of 2 ranks (``--mesh RxS``, R*S = the world size):

    torchrun --standalone --nproc_per_node=4 examples/train_gpt.py --mesh 2x2 --inner fsdp
    torchrun --standalone --nproc_per_node=4 examples/train_gpt.py --mesh 2x2 --inner tp

Checkpoints every 50 updates, resumed automatically (also after a rank is killed):

    torchrun --standalone --nproc_per_node=2 --max-restarts=3 examples/train_gpt.py --ckpt-dir runs/ckpt

With no ``--data`` the corpus is the ``.py`` files of Python's standard library, read as
bytes (a vocabulary of 256); the last 5% is held out for evaluation. A distributed launch
is detected from the ``RANK`` environment variable that torchrun sets.

One optimizer update covers ``--micro-batches-per-update`` micro-batches per rank in every
mode. ``sync`` and ``dpu`` commit an update every round, so a round is that many
micro-batches; ``acco`` commits every second round (an estimate round, then a commit round
that adds both rounds' gradients), so its rounds are half as long. AdamW with no weight
decay on biases, LayerNorms and embeddings, gradient clipping at 1.0 and a cosine schedule
with warm-up, stepped once per committed update (``if opt.step(): scheduler.step()``).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from acco import AccoOptimizer, RoundKind, checkpoint

VOCAB_SIZE = 256  # bytes
EVAL_FRACTION = 0.05
SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


# ----------------------------------------------------------------------------- arguments


def sync_delay(text: str) -> int | str:
    """``--sync-delay``: an int, or acco's ``"auto"`` / ``"half"``."""
    if text in ("auto", "half"):
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: an int, 'auto' or 'half'") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--mode", choices=["acco", "dpu", "sync", "local"], default="acco", help="how rounds overlap communication")
    add("--sync-every", type=int, default=None, help="--mode local: inner updates per outer round (default: acco's)")
    add("--sync-delay", type=sync_delay, default=None,
        help="--mode local: inner updates an outer round stays in flight, 'auto' or 'half' (default: acco's, 0: blocking)")
    add("--pacing", default=None, help="--mode local: speed or lockstep (default: acco's, speed)")
    add("--device", choices=["cpu", "cuda"], default="cpu")
    add("--backend", default=None, help="torch.distributed backend (default: gloo on cpu, nccl on cuda)")
    add("--data", default=None, help="a text file or a directory of text files (default: Python's stdlib)")
    add("--max-bytes", type=int, default=8_000_000, help="read at most this many bytes of text")
    add("--n-layer", type=int, default=4)
    add("--n-embd", type=int, default=128)
    add("--n-head", type=int, default=4)
    add("--seq-len", type=int, default=64)
    add("--batch-size", type=int, default=8, help="sequences per micro-batch, per rank")
    add("--lr", type=float, default=3e-3, help="peak learning rate")
    add("--warmup", type=int, default=20, help="updates of linear warm-up before the cosine decay")
    add("--grad-clip", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    add("--updates", type=int, default=400, help="committed optimizer updates to train for")
    add("--micro-batches-per-update", type=int, default=4, help="per rank; must be even for --mode acco")
    add("--eval-every", type=int, default=100, help="evaluate every this many updates (0: only at the end)")
    add("--eval-batches", type=int, default=8)
    add("--log-every", type=int, default=20, help="print progress every this many updates")
    add("--seed", type=int, default=1337)
    add("--timeout", type=float, default=300, help="seconds before a stuck collective fails (and torchrun restarts)")
    add("--accumulate-while-waiting", action="store_true",
        help="keep accumulating micro-batches until the round in flight has landed (heterogeneous ranks)")
    add("--slowdown", default=None, metavar="RANK:FACTOR", help="make one rank FACTOR times slower, e.g. 1:3")
    add("--mesh", default=None, metavar="RxS",
        help="R replica groups of S ranks: --inner inside each group, acco across groups (R*S = world size)")
    add("--inner", choices=["fsdp", "tp"], default="fsdp",
        help="with --mesh: FSDP2 fully_shard per block, or tensor parallelism of each block's MLP")
    add("--ckpt-dir", default=None, help="save checkpoints here and resume from the newest one")
    add("--ckpt-every", type=int, default=50, help="checkpoint every this many updates")
    add("--save-final", default=None, help="rank 0 saves the final model state dict here")
    args = parser.parse_args(argv)
    if args.mode == "acco" and args.micro_batches_per_update % 2:
        parser.error("--mode acco splits an update into two rounds: --micro-batches-per-update must be even")
    if args.mode != "local" and (args.sync_every is not None or args.sync_delay is not None or args.pacing is not None):
        parser.error("--sync-every, --sync-delay and --pacing need --mode local")
    if args.mode == "local" and args.accumulate_while_waiting:
        parser.error("--accumulate-while-waiting is for the per-update modes: --mode local paces its replicas itself")
    if args.micro_batches_per_update < 1 or args.updates < 1:
        parser.error("--micro-batches-per-update and --updates must be positive")
    if args.n_embd % args.n_head:
        parser.error("--n-embd must be a multiple of --n-head")
    if args.mesh is not None:
        try:
            args.mesh = tuple(int(n) for n in args.mesh.lower().split("x"))
        except ValueError:
            parser.error(f"--mesh {args.mesh}: expected RxS, e.g. 2x2")
        if len(args.mesh) != 2 or min(args.mesh) < 1:
            parser.error(f"--mesh {args.mesh}: expected RxS with R, S >= 1, e.g. 2x2")
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


def setup_distributed(device_type: str, backend: str | None, timeout: datetime.timedelta) -> Dist:
    """Join the process group when launched by torchrun (``RANK`` is set); else one process."""
    if "RANK" not in os.environ:
        device = torch.device(device_type)
        return Dist(rank=0, world_size=1, device=device)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        # Ranks beyond the GPU count share GPUs (e.g. 2 ranks on one GPU with --backend gloo;
        # NCCL refuses two ranks on one device).
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # Every rank on one machine shares its cores: don't oversubscribe them.
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    # Under `torchrun --max-restarts`, a restarted group must not read the addresses its
    # dead predecessors left in the store: prefix the keys with the restart count.
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        backend=backend or ("nccl" if device_type == "cuda" else "gloo"),
        store=dist.PrefixStore(f"attempt-{attempt}", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
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


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only; none on biases, LayerNorms and embeddings."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        is_matrix = param.dim() >= 2 and "emb" not in name
        (decay if is_matrix else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class WarmupCosine:
    """LambdaLR factor: linear warm-up, then cosine decay to ``floor`` of the peak."""

    def __init__(self, warmup: int, total: int, floor: float = 0.1) -> None:
        self.warmup, self.total, self.floor = warmup, total, floor

    def __call__(self, update: int) -> float:
        if update < self.warmup:
            return (update + 1) / (self.warmup + 1)
        progress = min(1.0, (update - self.warmup) / max(1, self.total - self.warmup))
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))


def micro_batches_per_round(mode: str, micro_batches_per_update: int) -> int:
    """acco commits every second round, so its rounds carry half an update's micro-batches."""
    return micro_batches_per_update // 2 if mode == "acco" else micro_batches_per_update


def rounds_per_update(mode: str) -> int:
    return 2 if mode == "acco" else 1


def parse_slowdown(spec: str | None) -> tuple[int, int] | None:
    if spec is None:
        return None
    rank, _, factor = spec.partition(":")
    if not (rank.isdigit() and factor.isdigit() and int(factor) >= 1):
        raise SystemExit(f"--slowdown {spec!r}: expected RANK:FACTOR with a whole FACTOR >= 1, e.g. 1:3")
    return int(rank), int(factor)


class Progress:
    """Rank 0's running tally between progress lines, from the optimizer's round telemetry.

    Samples/s counts every rank's micro-batches in the landed rounds (global, from
    ``round_stats``) over the wall time, leaving evaluation and checkpoint time out.
    """

    def __init__(self, opt: AccoOptimizer, sequences_per_micro_batch: int, ranks_per_counted: int = 1,
                 seq_len: int = 1) -> None:
        self.opt = opt
        self.sequences = sequences_per_micro_batch
        self.seq_len = seq_len  # tokens per sequence: an outer round counts tokens (the micro-batches' weights)
        # acco counts a replica group's micro-batches once (its ranks reduce one mean
        # gradient); under FSDP each of the group's ranks computed micro-batches of its own.
        self.ranks_per_counted = ranks_per_counted
        self.start = self.window_start = time.perf_counter()
        self.paused = self.window_paused = 0.0
        self.samples = 0
        self.window_losses: list[Tensor] = []
        self.next_round = 0

    def micro_batch(self, loss: Tensor) -> None:
        # Kept on the device and read at the next progress line: a .item() per micro-batch
        # would make the training thread wait for the GPU every time.
        self.window_losses.append(loss.detach())

    def pause(self, seconds: float) -> None:
        self.paused += seconds
        self.window_paused += seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def total_samples_per_second(self) -> float:
        self._collect([])
        return self.samples / (self.elapsed() - self.paused)

    def _collect(self, rounds: list) -> None:
        for stats in self.opt.round_stats:
            if stats.index >= self.next_round:
                rounds.append(stats)
                if getattr(stats, "replicas", None) is not None:  # an outer round: the replicas' tokens since their last one
                    self.samples += round(stats.global_weight * self.ranks_per_counted / self.seq_len)
                else:
                    self.samples += stats.global_micro_batches * self.ranks_per_counted * self.sequences
        if rounds:
            self.next_round = rounds[-1].index + 1

    def line(self, update: int, updates: int, lr: float) -> str:
        samples_before = self.samples
        rounds: list = []
        self._collect(rounds)
        now = time.perf_counter()
        rate = (self.samples - samples_before) / (now - self.window_start - self.window_paused)
        loss = torch.stack(self.window_losses).float().mean().item() if self.window_losses else math.nan
        hidden = statistics.fmean(r.hidden_share for r in rounds) if rounds else math.nan
        local = statistics.fmean(r.local_micro_batches for r in rounds) if rounds else math.nan
        total = statistics.fmean(r.global_micro_batches * self.ranks_per_counted for r in rounds) if rounds else math.nan
        norms = [r.grad_norm for r in rounds if r.kind is RoundKind.COMMIT and not math.isnan(r.grad_norm)]
        norm = norms[-1] if norms else math.nan
        self.window_start, self.window_paused, self.window_losses = now, 0.0, []
        reports = [r.replicas for r in rounds if getattr(r, "replicas", None) is not None]
        if reports:  # mode="local": per replica, inner updates and tokens per outer round; rank 0's waits
            steps = [statistics.fmean(r.steps[m] for r in reports) for m in range(len(reports[0].steps))]
            tokens = [statistics.fmean(r.weights[m] for r in reports) for m in range(len(reports[0].steps))]
            waited = math.fsum(r.wait_seconds for r in rounds if not math.isnan(r.wait_seconds))
            return (
                f"update {update:4d}/{updates} | train loss (rank 0) {loss:.4f} | lr {lr:.2e} | {rate:7.1f} samples/s | "
                f"steps/round per replica {' '.join(f'{s:.1f}' for s in steps)} | tokens/round "
                f"{' '.join(f'{t:.0f}' for t in tokens)} | rank 0 waited {waited:.1f} s | {now - self.start:6.1f} s"
            )
        return (
            f"update {update:4d}/{updates} | train loss (rank 0) {loss:.4f} | lr {lr:.2e} | grad norm {norm:.3f} | "
            f"{rate:7.1f} samples/s | micro-batches/round rank 0 {local:.1f} all {total:.1f} | "
            f"comm hidden {hidden:4.0%} | {now - self.start:6.1f} s"
        )


def most_in_flight(opt: AccoOptimizer) -> int:
    """mode="local": the inner updates past ``--updates`` a replica may take while the last
    round is in flight (``sync_delay``, as ``repr(opt)`` states it resolved)."""
    resolved = dict(line.strip().split(": ", 1) for line in repr(opt).splitlines() if ": " in line)
    delay, every = resolved.get("sync_delay", "0"), int(resolved.get("sync_every", "0"))
    return every if delay == "auto" else int(delay)


def gathered_updates(opt: AccoOptimizer, ctx: Dist) -> list[float]:
    """Every rank's inner updates (mode="local"), on every rank."""
    counts = torch.zeros(ctx.world_size, dtype=torch.float64)
    counts[ctx.rank] = opt.num_updates
    if dist.is_initialized():
        dist.all_reduce(counts)
    return counts.tolist()


def data_parallel_ranks(args: argparse.Namespace, world_size: int) -> tuple[int, int]:
    """(ranks drawing micro-batches of their own, micro-batches computed per one that acco
    counts). Flat: every rank, 1. ``--mesh RxS --inner fsdp``: every rank, S (acco counts a
    replica group's micro-batches once). ``--inner tp``: R (a group's S ranks share theirs), 1."""
    if not args.mesh:
        return world_size, 1
    if args.inner == "tp":
        return world_size // args.mesh[1], 1
    return world_size, args.mesh[1]


def timed(progress: Progress, fn, *args):  # type: ignore[no-untyped-def]
    """Run ``fn`` with the clock paused (evaluation, checkpoints)."""
    started = time.perf_counter()
    result = fn(*args)
    progress.pause(time.perf_counter() - started)
    return result


def shard_inside(model: GPT, shape: tuple[int, int], inner: str, ctx: Dist) -> dist.ProcessGroup:
    """FSDP2 or tensor parallelism inside each of R replica groups of S ranks; returns the
    group acco reduces across (``mesh["replicate"]``: one rank of each replica group)."""
    from torch.distributed.device_mesh import init_device_mesh

    if shape[0] * shape[1] != ctx.world_size:
        raise SystemExit(f"--mesh {shape[0]}x{shape[1]} needs {shape[0] * shape[1]} ranks, torchrun started {ctx.world_size}")
    mesh = init_device_mesh(ctx.device.type, shape, mesh_dim_names=("replicate", "shard"))
    if inner == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
    else:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        for block in model.blocks:  # each MLP split in S column / row blocks; the rest replicated
            parallelize_module(block.mlp, mesh["shard"], {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
    return mesh["replicate"].get_group()


def train(args: argparse.Namespace, ctx: Dist) -> None:
    corpus = load_corpus(args.data, args.max_bytes)
    train_data, held_out = split_corpus(corpus, args.seq_len)
    # Each rank its own data; under tensor parallelism a replica group's ranks share theirs.
    data_rank = ctx.rank // args.mesh[1] if args.mesh and args.inner == "tp" else ctx.rank
    data_ranks, ranks_per_counted = data_parallel_ranks(args, ctx.world_size)
    generator = torch.Generator().manual_seed(args.seed + data_rank)
    eval_set = eval_batches(held_out, args.eval_batches, args.batch_size, args.seq_len, args.seed, ctx.device)
    slowdown = parse_slowdown(args.slowdown)

    torch.manual_seed(args.seed)  # the same initial model on every rank (acco also broadcasts rank 0's)
    config = GPTConfig(args.n_layer, args.n_embd, args.n_head, args.seq_len)
    model = GPT(config).to(ctx.device)
    group = None  # acco across every rank
    if args.mesh is not None:
        group = shard_inside(model, args.mesh, args.inner, ctx)
    opt = AccoOptimizer(
        param_groups(model, weight_decay=0.1),
        torch.optim.AdamW,
        process_group=group,
        module=model,
        mode=args.mode,
        lr=args.lr,
        betas=(0.9, 0.95),
        max_grad_norm=args.grad_clip,
        timeout=datetime.timedelta(seconds=args.timeout),
        **({name: value for name, value in (("sync_every", args.sync_every), ("sync_delay", args.sync_delay),
                                            ("pacing", args.pacing)) if value is not None}
           if args.mode == "local" else {}),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(args.warmup, args.updates))

    # Resume from the newest complete checkpoint: model, optimizer shards, the round in
    # flight, the schedule and this rank's data position.
    first_round = 0
    latest = checkpoint.latest_checkpoint(args.ckpt_dir) if args.ckpt_dir else None
    if latest is not None:
        extra = checkpoint.load(latest, opt, model)
        scheduler.load_state_dict(extra["scheduler"])
        generator.set_state(extra["generator"])
        first_round = extra["next_round"]
        print0(ctx, f"resumed from {latest} at update {opt.num_updates}")

    def save_checkpoint(next_round: int) -> None:
        extra = {"scheduler": scheduler.state_dict(), "generator": generator.get_state(), "next_round": next_round}
        checkpoint.save(Path(args.ckpt_dir) / f"update-{opt.num_updates:06d}", opt, model, extra, keep=2)

    per_round = micro_batches_per_round(args.mode, args.micro_batches_per_update)
    print0(
        ctx,
        f"mode {args.mode} | {ctx.world_size} rank(s) on {ctx.device} | "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters | "
        f"corpus {len(train_data):,} train + {len(held_out):,} held-out bytes | "
        f"{args.updates} updates x {args.micro_batches_per_update} micro-batches x {args.batch_size} sequences "
        f"x {data_ranks} data-parallel rank(s) | {per_round} micro-batches per round"
        + (f" | mesh {args.mesh[0]}x{args.mesh[1]}, {args.inner} inside" if args.mesh else "")
        + (" (or more, while the round in flight is not done)" if args.accumulate_while_waiting else ""),
    )
    progress = Progress(opt, args.batch_size, ranks_per_counted, args.seq_len)
    if first_round == 0:
        print0(ctx, f"update    0 | eval loss {timed(progress, evaluate, model, eval_set):.4f}")

    def micro_batch() -> None:
        x, y = sample_batch(train_data, args.batch_size, args.seq_len, generator)
        if ctx.device.type == "cuda":  # pinned and non-blocking: no wait for the GPU
            x, y = x.pin_memory().to(ctx.device, non_blocking=True), y.pin_memory().to(ctx.device, non_blocking=True)
        if slowdown is not None and slowdown[0] == ctx.rank:
            for _ in range(slowdown[1] - 1):  # a slower device: the same work, repeated
                loss_fn(model, x, y).backward()
                opt.zero_grad()
        loss = loss_fn(model, x, y)
        # The loss is a mean over this many tokens. Declared before backward(), the weight
        # lets acco fold each gradient into its accumulator as backward() produces it (no
        # p.grad is kept); the block's end does what opt.accumulate(weight=...) does.
        with opt.micro_batch(weight=x.numel()):
            loss.backward()
        progress.micro_batch(loss)

    def end_round(next_round: int) -> None:
        rounds_before = opt.outer_rounds
        if not opt.step():
            return
        scheduler.step()  # once per committed update
        update = opt.num_updates
        if update % args.log_every == 0:
            print0(ctx, progress.line(update, args.updates, scheduler.get_last_lr()[0]))
        if args.eval_every and update % args.eval_every == 0 and update < args.updates:
            print0(ctx, f"update {update:4d} | eval loss {timed(progress, evaluate_committed, model, eval_set):.4f}")
        if not (args.ckpt_dir and args.ckpt_every):
            return
        if args.mode == "local":
            # Replicas may take different numbers of inner updates (pacing): a checkpoint, which is
            # collective, is taken at an outer round, which every replica lands.
            every = max(1, args.ckpt_every // opt.options.local.sync_every)
            if opt.outer_rounds != rounds_before and opt.outer_rounds % every == 0 and not opt.should_stop:
                timed(progress, save_checkpoint, next_round)
        elif update % args.ckpt_every == 0 and update < args.updates:
            timed(progress, save_checkpoint, next_round)

    def evaluate_committed(model: nn.Module, eval_set: list[tuple[Tensor, Tensor]]) -> float:
        """The held-out loss; in local mode of the global values (this replica's own parameters
        set aside meanwhile: eval() and train() are not collective)."""
        if args.mode != "local":
            return evaluate(model, eval_set)
        opt.eval()
        try:
            return evaluate(model, eval_set)
        finally:
            opt.train()

    if args.mode == "local":
        # Each replica its own number of inner updates per outer round; every replica stops at
        # the same round (opt.should_stop), decided at an outer round, never at a step count.
        opt.stop_after(steps=args.updates)
        round_index = first_round
        while not opt.should_stop:
            for _ in range(per_round):
                micro_batch()
            round_index += 1
            end_round(round_index)
    elif args.accumulate_while_waiting:
        # Heterogeneous ranks: after the usual micro-batches, keep accumulating until the
        # round in flight has landed. Every rank stops on the same round: the number of
        # updates, counting the one in flight, is the same everywhere at every boundary.
        round_index = first_round
        while opt.num_updates + (opt.in_flight is RoundKind.COMMIT) < args.updates:
            for _ in range(per_round):
                micro_batch()
            while not opt.ready():
                micro_batch()
            round_index += 1
            end_round(round_index)
    else:
        # Every round ends with step(); the last round's update lands in finish(), so every
        # mode computes exactly updates * micro_batches_per_update micro-batches per rank.
        for round_index in range(first_round, args.updates * rounds_per_update(args.mode)):
            for _ in range(per_round):
                micro_batch()
            end_round(round_index + 1)
    if opt.finish():  # acco and dpu: the last update lands here
        scheduler.step()
    if progress.window_losses:
        print0(ctx, progress.line(opt.num_updates, args.updates, scheduler.get_last_lr()[0]))
    if args.mode == "local":
        print0(ctx, f"local steps: {opt.outer_rounds} outer rounds; inner updates per replica "
                    f"{[int(n) for n in gathered_updates(opt, ctx)]} (at most {args.updates + most_in_flight(opt)}); "
                    f"last plan "
                    f"{opt.replica_steps} steps per round")
    elif opt.num_updates != args.updates:
        raise AssertionError(f"trained {opt.num_updates} updates, expected {args.updates}")

    final = timed(progress, evaluate, model, eval_set)
    print0(ctx, f"{progress.total_samples_per_second():.1f} samples/s over {progress.elapsed():.1f} s")
    print0(ctx, f"final eval loss {final:.4f}")
    if args.save_final:
        # Whole tensors (on a mesh each rank holds blocks of DTensors: full_tensor() is collective).
        state = {name: value.full_tensor() if hasattr(value, "full_tensor") else value
                 for name, value in model.state_dict().items()}  # fmt: skip
        if ctx.master:
            torch.save(state, args.save_final)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ctx = setup_distributed(args.device, args.backend, datetime.timedelta(seconds=args.timeout))
    try:
        train(args, ctx)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
