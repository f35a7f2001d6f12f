"""What the benchmarks share: the example's model and data, the training methods compared,
and how ranks are launched.

The model, the corpus and the loss come from ``examples/train_gpt.py`` (imported, not
copied). Every method is driven by the same loop through :class:`Method`: micro-batches,
then ``end_round()`` at each round boundary, so the only thing that differs between two
methods in a benchmark is the optimizer and its communication.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # for `examples.train_gpt`
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from acco import AccoOptimizer  # noqa: E402
from examples.train_gpt import (  # noqa: E402
    GPT,
    GPTConfig,
    Dist,
    load_corpus,
    loss_fn,
    param_groups,
    sample_batch,
    setup_distributed,
    split_corpus,
)

__all__ = [
    "ACCO_METHODS",
    "BASELINES",
    "METHODS",
    "ModelConfig",
    "Method",
    "build_method",
    "launch",
    "lo_tx_bytes",
    "start_ranks",
]

# Every method the benchmarks know, in the order tables list them.
METHODS = ("roofline", "ddp-zero1", "ddp-adamw", "acco-sync", "acco-dpu", "acco", "acco-aww", "acco-bf16", "acco-fp8")
BASELINES = ("roofline", "ddp-zero1", "ddp-adamw")
ACCO_METHODS = {"acco-sync": "sync", "acco-dpu": "dpu", "acco": "acco", "acco-aww": "acco", "acco-bf16": "acco",
                "acco-fp8": "acco"}
# acco with the light estimate round (AccoOptimizer's estimate_dtype=).
ESTIMATE_DTYPES = {"acco-bf16": torch.bfloat16, "acco-fp8": torch.float8_e4m3fn}
LABELS = {
    "roofline": "compute only (roofline)",
    "ddp-zero1": "DDP + ZeroRedundancyOptimizer (ZeRO-1)",
    "ddp-adamw": "DDP + AdamW",
    "acco-sync": "acco, mode sync",
    "acco-dpu": "acco, mode dpu",
    "acco": "acco, mode acco",
    "acco-aww": "acco, accumulate while communicating",
    "acco-bf16": "acco, mode acco, bf16 estimate round",
    "acco-fp8": "acco, mode acco, float8 estimate round",
}


@dataclass(frozen=True)
class ModelConfig:
    """The GPT of ``examples/train_gpt.py`` and the optimizer settings every method uses."""

    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    seq_len: int = 128
    batch_size: int = 8
    lr: float = 6e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    max_grad_norm: float | None = None
    seed: int = 1337

    def gpt(self) -> GPTConfig:
        return GPTConfig(self.n_layer, self.n_embd, self.n_head, self.seq_len)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_model(config: ModelConfig, dtype: torch.dtype | None = None) -> GPT:
    torch.manual_seed(config.seed)  # the same initial model in every method and on every rank
    model = GPT(config.gpt())
    return model if dtype is None else model.to(dtype)


class Method:
    """One way of training, driven round by round.

    ``micro_batch()`` computes one micro-batch's gradients; ``end_round()`` is the round
    boundary (returns True when the model now holds newly committed parameters);
    ``ready()`` says whether ``end_round()`` would return without waiting for the network.
    One optimizer update is ``rounds_per_update`` rounds of ``micro_batches_per_round``.
    """

    name: str
    model: nn.Module
    rounds_per_update: int = 1
    micro_batches_per_round: int

    def micro_batch(self, x: Tensor, y: Tensor) -> Tensor:
        raise NotImplementedError

    def end_round(self) -> bool:
        raise NotImplementedError

    def ready(self) -> bool:
        return True

    def finish(self) -> bool:
        return False

    def optimizer(self) -> Any:
        return None


class Roofline(Method):
    """Forward and backward only, gradients summed in ``p.grad``: no optimizer, no network."""

    def __init__(self, config: ModelConfig, micro_batches_per_update: int) -> None:
        self.name = "roofline"
        self.model = build_model(config)
        self.micro_batches_per_round = micro_batches_per_update
        self._params = list(self.model.parameters())

    def micro_batch(self, x: Tensor, y: Tensor) -> Tensor:
        loss = loss_fn(self.model, x, y)
        (loss / self.micro_batches_per_round).backward()
        return loss.detach()

    def end_round(self) -> bool:
        for p in self._params:
            p.grad = None
        return True


class DDPMethod(Method):
    """DDP (gradients all-reduced in the last micro-batch's backward, ``no_sync`` before)
    with AdamW on every rank, or with ``ZeroRedundancyOptimizer`` (ZeRO-1)."""

    def __init__(self, config: ModelConfig, micro_batches_per_update: int, zero: bool,
                 dtype: torch.dtype | None = None, bucket_view: bool = False) -> None:
        self.name = "ddp-zero1" if zero else "ddp-adamw"
        # bucket_view: p.grad are views of DDP's buckets (gradient_as_bucket_view=True), the
        # lean setting: no separate copy of the gradients.
        self.model = DDP(build_model(config, dtype), gradient_as_bucket_view=bucket_view)
        self.micro_batches_per_round = micro_batches_per_update
        self.max_grad_norm = config.max_grad_norm
        groups = param_groups(self.model.module, config.weight_decay)
        hyper = {"lr": config.lr, "betas": config.betas}
        if zero:
            self.opt: torch.optim.Optimizer = ZeroRedundancyOptimizer(
                groups, optimizer_class=torch.optim.AdamW, **hyper
            )
        else:
            self.opt = torch.optim.AdamW(groups, **hyper)
        self._count = 0

    def micro_batch(self, x: Tensor, y: Tensor) -> Tensor:
        self._count += 1
        last = self._count % self.micro_batches_per_round == 0
        with contextlib.nullcontext() if last else self.model.no_sync():
            loss = loss_fn(self.model, x, y)
            (loss / self.micro_batches_per_round).backward()
        return loss.detach()

    def end_round(self) -> bool:
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return True

    def optimizer(self) -> Any:
        return self.opt


class AccoMethod(Method):
    """``AccoOptimizer`` in one of its modes; acco's update spans two rounds of half the
    micro-batches, so every method does the same micro-batches per update."""

    def __init__(self, name: str, config: ModelConfig, micro_batches_per_update: int,
                 dtype: torch.dtype | None = None) -> None:
        mode = ACCO_METHODS[name]
        self.name = name
        self.model = build_model(config, dtype)
        self.rounds_per_update = 2 if mode == "acco" else 1
        self.micro_batches_per_round = micro_batches_per_update // self.rounds_per_update
        self.opt = AccoOptimizer(
            param_groups(self.model, config.weight_decay),
            torch.optim.AdamW,
            mode=mode,
            lr=config.lr,
            betas=config.betas,
            max_grad_norm=config.max_grad_norm,
            timeout=datetime.timedelta(minutes=5),
            estimate_dtype=ESTIMATE_DTYPES.get(name),
        )

    def micro_batch(self, x: Tensor, y: Tensor) -> Tensor:
        loss = loss_fn(self.model, x, y)
        loss.backward()
        self.opt.accumulate()
        return loss.detach()

    def end_round(self) -> bool:
        return self.opt.step()

    def ready(self) -> bool:
        return self.opt.ready()

    def finish(self) -> bool:
        return self.opt.finish()

    def optimizer(self) -> Any:
        return self.opt


def build_method(name: str, config: ModelConfig, micro_batches_per_update: int, *,
                 dtype: torch.dtype | None = None, bucket_view: bool = False) -> Method:
    """``dtype``: the parameters' dtype (default fp32); ``bucket_view``: DDP's
    ``gradient_as_bucket_view`` (DDP methods only)."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r} (choose from {', '.join(METHODS)})")
    if name == "roofline":
        return Roofline(config, micro_batches_per_update)
    if name in ("ddp-zero1", "ddp-adamw"):
        return DDPMethod(config, micro_batches_per_update, zero=name == "ddp-zero1", dtype=dtype,
                         bucket_view=bucket_view)
    if micro_batches_per_update % 2 and ACCO_METHODS[name] == "acco":
        raise ValueError(f"{name}: micro-batches per update must be even, got {micro_batches_per_update}")
    return AccoMethod(name, config, micro_batches_per_update, dtype)


# ------------------------------------------------------------------------- ranks and data


def start_ranks(timeout_s: float = 600) -> Dist:
    """Join the torchrun process group (one torch thread per rank when ranks share cores)."""
    if "RANK" not in os.environ:
        raise SystemExit("this is a rank's entry point: start it with torchrun (or let the driver do it)")
    return setup_distributed("cpu", None, datetime.timedelta(seconds=timeout_s))


def training_text(seq_len: int) -> tuple[Tensor, Tensor]:
    """The example's corpus (the standard library's .py files) as train / held-out tokens."""
    return split_corpus(load_corpus(None), seq_len)


def batches(data: Tensor, config: ModelConfig, seed: int) -> Callable[[], tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return lambda: sample_batch(data, config.batch_size, config.seq_len, generator)


def lo_tx_bytes() -> int | None:
    """Bytes sent on the namespace's loopback so far (every rank's traffic), or None outside
    the benchmark's namespace (on a real cluster each node has its own counters)."""
    if "ACCO_BENCH_NETNS" not in os.environ:
        return None
    try:
        return int(Path("/sys/class/net/lo/statistics/tx_bytes").read_text())
    except OSError:
        return None


def all_reduce_sum(values: Sequence[float]) -> list[float]:
    t = torch.tensor(list(values), dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def all_reduce_max(values: Sequence[float]) -> list[float]:
    t = torch.tensor(list(values), dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


# ------------------------------------------------------------------------------ launching


def launch(nproc: int, script_and_args: Sequence[str], rate: str | None = None, netns: bool = True) -> None:
    """Run a rank entry point on ``nproc`` local ranks: inside a namespace whose loopback
    is limited to ``rate`` (``netns``), or under plain ``torchrun --standalone``."""
    env = {"TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONWARNINGS": "ignore"}
    if netns:
        from netns import run_ranks

        code = run_ranks(nproc, script_and_args, rate, env=env)
    else:
        if rate is not None:
            raise ValueError("a rate limit needs the network namespace")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                   *script_and_args]
        code = subprocess.run(command, env={**os.environ, **env}).returncode
    if code:
        raise SystemExit(f"ranks failed (exit {code}): {' '.join(script_and_args)}")


# ------------------------------------------------------------------- other load on the host


def cpu_busy_seconds() -> float:
    """Busy CPU seconds of the whole machine so far (every core, every process)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU seconds of this process, all its threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class ForeignLoad:
    """CPU used on this machine by processes other than the ranks, over a window.

    Benchmarks on a shared machine are disturbed by other jobs; this measures by how much,
    so a disturbed repeat can be seen in the results. Collective: every rank calls
    ``start()`` and ``stop()``.
    """

    def start(self) -> None:
        self._busy, self._own, self._wall = cpu_busy_seconds(), own_cpu_seconds(), time.perf_counter()

    def stop(self) -> float:
        """The other processes' share of the machine's CPU capacity during the window."""
        busy = cpu_busy_seconds() - self._busy
        (own,) = all_reduce_sum([own_cpu_seconds() - self._own])
        wall = time.perf_counter() - self._wall
        if not dist.is_initialized() or dist.get_rank() == 0:
            share = max(0.0, busy - own) / (wall * (os.cpu_count() or 1))
        else:
            share = 0.0
        (share,) = all_reduce_sum([share])
        return share


def wait_for_quiet(threshold: float = 0.1, sample_s: float = 0.5, max_wait_s: float = 900.0) -> float:
    """Wait (collectively) until the other processes use less than ``threshold`` of the
    machine's CPU while the ranks sleep; returns the seconds waited (gives up after
    ``max_wait_s``, and says so)."""
    started = time.perf_counter()
    announced = False
    while True:
        busy0 = cpu_busy_seconds()
        time.sleep(sample_s)
        share = (cpu_busy_seconds() - busy0) / (sample_s * (os.cpu_count() or 1))
        (share,) = all_reduce_max([share])
        waited = time.perf_counter() - started
        if share < threshold or waited > max_wait_s:
            if share >= threshold:
                print(f"the machine is still {share:.0%} busy with other work after {waited:.0f} s: measuring anyway",
                      flush=True)
            return waited
        if not announced and (not dist.is_initialized() or dist.get_rank() == 0):
            print(f"other processes use {share:.0%} of the CPU: waiting for a quiet machine", flush=True)
            announced = True


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    tmp.replace(path)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())
