"""What every benchmark shares: one method registry (:data:`METHODS`, :func:`build_method`),
one round loop (:func:`train_round`) and one entry point (:class:`Benchmark`, :func:`main`),
so that two methods differ only in the optimizer and its communication. The model, corpus
and loss are ``examples/train_gpt.py``'s (imported, not copied).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import importlib
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
SCRATCH_DIR = RESULTS_DIR / "scratch"  # smoke runs and A/B runs: the report never reads them
for _path in (REPO_ROOT, BENCH_DIR):  # `examples.train_gpt`, and the benchmarks as modules
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import acco  # noqa: E402
from examples.train_gpt import (  # noqa: E402
    GPT, Dist, GPTConfig, load_corpus, loss_fn, param_groups, sample_batch, setup_distributed, split_corpus,
)

__all__ = [
    "BENCH_DIR", "METHODS", "OUTER_LR", "OUTER_MOMENTUM", "REPO_ROOT", "RESULTS_DIR", "SCRATCH_DIR", "TORCHFT_INSTALL",
    "AccoMethod", "Benchmark", "Checkout", "FSDPMethod", "Method", "MethodSpec", "ModelConfig", "RoundRecord",
    "TorchftDiLoCoMethod", "UnsupportedMethod", "Window", "all_reduce", "batches", "build_method", "build_model",
    "describe", "even", "label",
    "lane_summary", "lo_tx_bytes", "main", "md_table", "method_name", "method_spec", "minutes", "model_arguments",
    "model_config", "phases", "pyplot", "rank_batches", "rate_text", "read_json", "rotated", "run_ranks", "save",
    "plot_seeds", "save_figure", "torchft_version", "train_round", "training_text", "warm_up", "write_json",
]


@dataclass(frozen=True)
class MethodSpec:
    """What a method name means, once for every benchmark, table and plot."""

    label: str
    colour: str
    line: str = "-"  # line style in plots: what travels in the estimate round
    family: str = "acco"  # roofline, ddp, acco, local (acco mode="local") or diloco: which class trains it
    mode: str | None = None  # AccoOptimizer's mode
    estimate_dtype: torch.dtype | None = None  # acco's light estimate round
    ready_loop: bool = False  # keep computing micro-batches while the round in flight has not landed
    # A slow rank (time_to_loss.py --slowdown) runs micro-batches of 1/FACTOR the sequences, so
    # one takes as long as a fast rank's; every micro-batch is weighted by its sequences.
    balanced: bool = False


_BF16, _FP8 = torch.bfloat16, torch.float8_e4m3fn
# Every method, in the order tables and plots list them.
METHODS: dict[str, MethodSpec] = {
    "roofline": MethodSpec("compute only (roofline)", "0.3", ":", family="roofline"),
    "ddp-zero1": MethodSpec("DDP + ZeRO-1 (ZeroRedundancyOptimizer)", "black", family="ddp"),
    "ddp-adamw": MethodSpec("DDP + AdamW", "0.55", family="ddp"),
    "acco-sync": MethodSpec("acco `sync`", "C0", mode="sync"),
    "acco-dpu": MethodSpec("acco `dpu`", "C1", mode="dpu"),
    "acco": MethodSpec("acco `acco`", "C3", mode="acco"),
    "acco-bf16": MethodSpec("acco `acco`, bf16 estimate", "C3", "--", mode="acco", estimate_dtype=_BF16),
    "acco-fp8": MethodSpec("acco `acco`, fp8 (e4m3) estimate", "C3", ":", mode="acco", estimate_dtype=_FP8),
    "acco-aww": MethodSpec("acco `acco`, `ready()` loop", "C2", mode="acco", ready_loop=True),
    "acco-aww-bf16": MethodSpec("acco `acco`, `ready()` loop, bf16 estimate", "C2", "--", mode="acco",
                                estimate_dtype=_BF16, ready_loop=True),
    "acco-aww-fp8": MethodSpec("acco `acco`, `ready()` loop, fp8 (e4m3) estimate", "C2", ":", mode="acco",
                               estimate_dtype=_FP8, ready_loop=True),
    "acco-aww-balanced": MethodSpec("acco `acco`, `ready()` loop, slow rank's micro-batches 1/FACTOR", "C8",
                                    mode="acco", ready_loop=True, balanced=True),
    "acco-aww-fp8-balanced": MethodSpec("acco `acco`, `ready()` loop, fp8 (e4m3) estimate, slow rank's micro-batches "
                                        "1/FACTOR", "C8", ":", mode="acco", estimate_dtype=_FP8, ready_loop=True,
                                        balanced=True),
    "ddp-zero1-overlap": MethodSpec("DDP + ZeRO-1, `overlap_with_ddp` (`hook_with_zero_step`)", "0.3", "--",
                                    family="ddp"),
    "fsdp2": MethodSpec("FSDP2 (`fully_shard`)", "C9", family="fsdp"),
    "diloco-h10": MethodSpec("DiLoCo, H = 10", "C4", family="diloco"),
    "diloco-h50": MethodSpec("DiLoCo, H = 50", "C5", family="diloco"),
}


@dataclass(frozen=True)
class LocalSpec:
    """A local-steps method's name, parsed:
    ``local-hH[-dD|-dauto][-discard|-keep|-estimate][-bB][-kN][-noef][-olrX][-momX][-hb][-lockstep|-speed]
    [-tokens|-equal|-normalized]`` (acco ``mode="local"``, library defaults for what is not named;
    ``H`` may be ``auto``: ``sync_every="auto"``, H chosen from the link and the step time, or
    ``default``: the library's default ``sync_every`` (and its outer optimizer for it);
    ``-lockstep`` / ``-speed``: ``pacing``; ``-tokens`` etc.: ``outer_weighting``; ``-bB``: ``outer_bits=B``,
    ``-kN``: ``outer_topk=1/N`` (sparse rounds), ``-noef``: ``outer_error_feedback=False``; ``-olrX`` / ``-momX``: the outer Nesterov SGD's lr
    and momentum, the other from the library's default; ``-hb``: heavy-ball momentum, not Nesterov's),
    ``diloco-hH[-olrX]`` (torchft's
    DiLoCo) or ``sdiloco-hH[-fP][-dD][-olrX]`` (torchft's Streaming DiLoCo: P fragments, each
    synchronised every H / P steps with a delay of D inner steps, mixing alpha 0)."""

    kind: str  # local, diloco or sdiloco
    # "auto" (acco only): chosen by the planner, round by round; None (``-hdefault``): the library's default
    sync_every: int | str | None
    sync_delay: int | str | None = None  # None: the library's default (acco), 0 (torchft); "auto"
    overlap: str | None = None  # acco: discard, keep or estimate (None: the library's default)
    outer_lr: float | None = None  # None: the library's default (acco), DiLoCo's 0.7 (torchft)
    outer_momentum: float | None = None
    nesterov: bool = True  # -hb: heavy-ball momentum instead (acco)
    fragments: int = 2
    outer_bits: int | None = None  # acco: None is the library's default
    topk: int | None = None  # acco: outer_topk=1/topk (None: dense rounds)
    error_feedback: bool = True
    pacing: str | None = None  # acco: lockstep or speed (None: the library's default)
    weighting: str | None = None  # acco: tokens, equal or normalized (None: the library's default)

    @classmethod
    def parse(cls, name: str) -> LocalSpec | None:
        kind, _, rest = name.partition("-h")
        if kind not in ("local", "diloco", "sdiloco") or not rest:
            return None
        parts = rest.split("-")
        try:
            if kind == "local" and parts[0] in ("auto", "default"):
                spec = cls(kind, None if parts[0] == "default" else "auto")
            else:
                spec = cls(kind, int(parts[0]))
            for part in parts[1:]:
                if part in ("discard", "keep", "estimate") and kind == "local":
                    spec = dataclasses.replace(spec, overlap=part)
                elif part in ("lockstep", "speed") and kind == "local":
                    spec = dataclasses.replace(spec, pacing=part)
                elif part in ("tokens", "equal", "normalized") and kind == "local":
                    spec = dataclasses.replace(spec, weighting=part)
                elif part == "dauto" and kind == "local":
                    spec = dataclasses.replace(spec, sync_delay="auto")
                elif part.startswith("b") and kind == "local":
                    spec = dataclasses.replace(spec, outer_bits=int(part[1:]))
                elif part.startswith("k") and kind == "local":
                    spec = dataclasses.replace(spec, topk=int(part[1:]))
                elif part == "noef" and kind == "local":
                    spec = dataclasses.replace(spec, error_feedback=False)
                elif part.startswith("olr"):
                    spec = dataclasses.replace(spec, outer_lr=float(part[3:]))
                elif part.startswith("mom") and kind == "local":
                    spec = dataclasses.replace(spec, outer_momentum=float(part[3:]))
                elif part == "hb" and kind == "local":
                    spec = dataclasses.replace(spec, nesterov=False)
                elif part.startswith("d") and kind != "diloco":
                    spec = dataclasses.replace(spec, sync_delay=int(part[1:]))
                elif part.startswith("f") and kind == "sdiloco":
                    spec = dataclasses.replace(spec, fragments=int(part[1:]))
                else:
                    return None
        except ValueError:
            return None
        return spec if spec.sync_every in ("auto", None) or spec.sync_every >= 1 else None

    def label(self) -> str:
        olr = "" if self.outer_lr is None else f", outer lr {self.outer_lr:g}"
        olr += "" if self.outer_momentum is None else f", outer momentum {self.outer_momentum:g}"
        olr += "" if self.nesterov else " (heavy ball)"
        if self.kind == "diloco":
            return f"DiLoCo (torchft), H = {self.sync_every}{olr}"
        if self.kind == "sdiloco":
            return (f"Streaming DiLoCo (torchft), H = {self.sync_every}, {self.fragments} fragments, delay "
                    f"{self.sync_delay or 0}{olr}")
        h = "default" if self.sync_every is None else self.sync_every
        bits = "" if self.outer_bits is None else f", {self.outer_bits} bits"
        bits += "" if self.topk is None else f", top 1/{self.topk}"
        bits += "" if self.error_feedback else " without error feedback"
        bits += "" if self.pacing is None else f", pacing {self.pacing}"
        bits += "" if self.weighting is None else f", {self.weighting} weights"
        if self.sync_delay == 0:
            return f"acco `local` blocking, H = {h}{bits}{olr}"
        if self.sync_delay is None and self.overlap is None:
            return f"acco `local`, H = {h}, library defaults{bits}{olr}"
        delay = "default delay" if self.sync_delay is None else f"delay {self.sync_delay}"
        return f"acco `local`, H = {h}, {delay}, {self.overlap or 'default rule'}{bits}{olr}"


def method_spec(name: str) -> MethodSpec:
    """The registry's entry; the local-steps names of :class:`LocalSpec` too.

    Raises:
        ValueError: an unknown name (argparse's ``type=`` turns it into a usage error).
    """
    if name in METHODS:
        return METHODS[name]
    local = LocalSpec.parse(name)
    if local is not None:
        colour = {"local": "C2", "diloco": "C6", "sdiloco": "C4"}[local.kind]
        line = "--" if local.sync_delay == 0 and local.kind == "local" else "-"
        return MethodSpec(local.label(), colour, line, family="diloco" if local.kind != "local" else "local")
    raise ValueError(f"unknown method {name!r} (choose from {', '.join(METHODS)}, or local-hN..., diloco-hN..., "
                     "sdiloco-hN...)")


def method_name(name: str) -> str:
    """argparse ``type=`` for a method name."""
    try:
        method_spec(name)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return name


def even(text: str) -> int:
    """argparse ``type=`` for micro-batches per update: acco splits an update into two rounds."""
    if not text.isdigit() or int(text) < 2 or int(text) % 2:
        raise argparse.ArgumentTypeError(f"must be even and at least 2 (acco splits an update into two rounds): {text}")
    return int(text)


def label(name: str) -> str:
    """How tables name a method (a name the registry does not know, as it is)."""
    try:
        return method_spec(name).label
    except ValueError:
        return name


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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_arguments(parser: argparse.ArgumentParser, defaults: ModelConfig) -> None:
    """The model's size options, with a benchmark's own defaults."""
    for field_name in ("n_layer", "n_embd", "n_head", "seq_len", "batch_size"):
        parser.add_argument("--" + field_name.replace("_", "-"), type=int, default=getattr(defaults, field_name))


def model_config(args: argparse.Namespace, **settings: Any) -> ModelConfig:
    """The model the size options ask for, ``--lr`` and ``--grad-clip`` (0: off) where a
    benchmark has them, and ``settings`` (seed...) for the rest."""
    if "grad_clip" in vars(args):
        settings = {"lr": args.lr, "max_grad_norm": args.grad_clip or None, **settings}
    return ModelConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, seq_len=args.seq_len,
                       batch_size=args.batch_size, **settings)


def describe(config: dict[str, Any], parameters: float) -> str:
    """How tables introduce the model."""
    return (f"GPT of {parameters / 1e6:.2f}M parameters ({config['n_layer']} layers, width {config['n_embd']}, seq "
            f"{config['seq_len']}, micro-batch {config['batch_size']})")


def build_model(config: ModelConfig, dtype: torch.dtype | None = None, device: torch.device | None = None) -> GPT:
    torch.manual_seed(config.seed)  # the same initial model in every method and on every rank
    return GPT(GPTConfig(config.n_layer, config.n_embd, config.n_head, config.seq_len)).to(device=device, dtype=dtype)


class UnsupportedMethod(RuntimeError):
    """This method cannot run with the installed library; a benchmark records why and goes on."""


class Method:
    """One way of training, driven round by round by :func:`train_round`: ``backward()`` then
    ``fold()`` per micro-batch, ``end_round()`` at the boundary (True: newly committed
    parameters); ``ready()``: the boundary would not wait for the network."""

    opt: Any = None
    rounds_per_update: int = 1

    def __init__(self, name: str, config: ModelConfig, micro_batches_per_update: int, model: nn.Module) -> None:
        self.name, self.spec, self.config = name, method_spec(name), config
        self.model = model
        self.micro_batches_per_update = micro_batches_per_update
        self.micro_batches_per_round = micro_batches_per_update // self.rounds_per_update
        self.loss_scale = 1.0 / self.micro_batches_per_round  # p.grad sums the round's mean gradient

    @property
    def module(self) -> nn.Module:
        """The model without its DDP wrapper."""
        return getattr(self.model, "module", self.model)

    autocast: torch.dtype | None = None  # compute in this dtype over fp32 parameters (torch.autocast)

    def backward(self, x: Tensor, y: Tensor) -> Tensor:
        with torch.autocast(x.device.type, self.autocast) if self.autocast else contextlib.nullcontext():
            loss = loss_fn(self.model, x, y)
        (loss * self.loss_scale).backward()
        return loss.detach()

    def fold(self) -> None:
        pass

    def end_round(self) -> bool:
        raise NotImplementedError

    def eval_params(self, params: list[Tensor]) -> list[Tensor]:
        """Copies of the parameters an evaluation after this boundary reads."""
        return [p.detach().clone() for p in params]

    def ready(self) -> bool:
        return True

    def finish(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def round_stats(self) -> list[Any]:
        return []

    def committed_updates(self, counted: int) -> int:
        """Optimizer updates in the committed parameters, given those ``end_round()`` counted."""
        return counted

    def committed_micro_batches(self, counted: int) -> float:
        """Micro-batches of every rank whose gradients are in the committed parameters."""
        return self.committed_updates(counted) * self.micro_batches_per_update * dist.get_world_size()


class Roofline(Method):
    """Forward and backward only, gradients summed in ``p.grad``: no optimizer, no network."""

    def end_round(self) -> bool:
        for p in self.model.parameters():
            p.grad = None
        return True


class DDPMethod(Method):
    """DDP (gradients all-reduced in the last micro-batch's backward, ``no_sync`` before)
    with AdamW on every rank (fused on CUDA), with ``ZeroRedundancyOptimizer`` (ZeRO-1), or
    with ZeRO-1 overlapped with DDP (``ddp-zero1-overlap``: ``overlap_with_ddp=True`` and
    the ``hook_with_zero_step`` comm hook, torch's own ZeRO-1 overlap: each rank's AdamW
    step runs inside the last backward as the buckets' all-reduces land).

    Raises:
        UnsupportedMethod: ``ddp-zero1-overlap`` on gloo, which torch refuses (it may hang).
    """

    def __init__(self, name: str, config: ModelConfig, micro_batches_per_update: int, model: nn.Module,
                 bucket_view: bool) -> None:
        cuda = next(model.parameters()).device.type == "cuda"
        if name == "ddp-zero1-overlap" and dist.get_backend() == dist.Backend.GLOO:
            raise UnsupportedMethod(f"{name}: torch's hook_with_zero_step refuses gloo (\"may meet hangs\"); NCCL only")
        # bucket_view: p.grad are views of DDP's buckets, the lean setting (no second copy).
        super().__init__(name, config, micro_batches_per_update, DDP(model, gradient_as_bucket_view=bucket_view))
        groups = param_groups(model, config.weight_decay)
        self.overlapped = name == "ddp-zero1-overlap"
        if name == "ddp-zero1":
            self.opt = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=config.lr,
                                               betas=config.betas)
        elif self.overlapped:
            from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            # One parameter group (overlap_with_ddp supports no other), and no clipping: the
            # step runs in the backward, before a norm over all buckets could be known. The
            # first two updates do nothing while DDP settles its buckets (torch's warning).
            self.opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                               overlap_with_ddp=True, lr=config.lr, betas=config.betas,
                                               weight_decay=config.weight_decay)
            self.model.register_comm_hook(None, hook_with_zero_step(allreduce_hook, self.model, self.opt))
        else:
            # fused: one kernel per step on CUDA, what a GPU user runs; torch's default elsewhere
            self.opt = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, fused=cuda or None)
        self._backwards = 0

    def backward(self, x: Tensor, y: Tensor) -> Tensor:
        self._backwards += 1
        last = self._backwards % self.micro_batches_per_round == 0
        with contextlib.nullcontext() if last else self.model.no_sync():
            return super().backward(x, y)

    def end_round(self) -> bool:
        if not self.overlapped:  # overlapped: the step already ran in the last backward
            if self.config.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return True


class FSDPMethod(Method):
    """FSDP2: ``fully_shard`` on every block and on the model (parameters, gradients and
    AdamW state sharded; each block's parameters all-gathered for its forward and backward,
    its gradients reduce-scattered in the last micro-batch's backward, kept unsharded
    before: ``set_requires_gradient_sync``). ``mixed``: ``MixedPrecisionPolicy`` computing
    in that dtype over the fp32 sharded parameters, reducing in fp32."""

    def __init__(self, name: str, config: ModelConfig, micro_batches_per_update: int, model: nn.Module,
                 mixed: torch.dtype | None) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=mixed, reduce_dtype=torch.float32 if mixed else None)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        super().__init__(name, config, micro_batches_per_update, model)
        cuda = next(model.parameters()).device.type == "cuda"
        self.opt = torch.optim.AdamW(param_groups(model, config.weight_decay), lr=config.lr, betas=config.betas,
                                     fused=cuda or None)
        self._backwards = 0

    def backward(self, x: Tensor, y: Tensor) -> Tensor:
        self._backwards += 1
        self.model.set_requires_gradient_sync(self._backwards % self.micro_batches_per_round == 0)
        return super().backward(x, y)

    def end_round(self) -> bool:
        if self.config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return True


class AccoRounds:
    """The round boundary of a method driven by an ``AccoOptimizer`` in ``self.opt``."""

    opt: Any

    def end_round(self) -> bool:
        return self.opt.step()

    def ready(self) -> bool:
        return self.opt.ready()

    def finish(self) -> bool:
        return self.opt.finish()

    def round_stats(self) -> list[Any]:
        return list(self.opt.round_stats)

    def committed_updates(self, counted: int) -> int:
        return self.opt.num_updates


class AccoMethod(AccoRounds, Method):
    """``AccoOptimizer`` (this checkout's, or another's: ``acco_module``) in one of its modes;
    acco's update spans two rounds of half the micro-batches, so every method computes the
    same micro-batches per update."""

    def __init__(self, name: str, config: ModelConfig, micro_batches_per_update: int, model: nn.Module,
                 acco_module: ModuleType) -> None:
        spec = method_spec(name)
        self.rounds_per_update = 2 if spec.mode == "acco" else 1
        super().__init__(name, config, micro_batches_per_update, model)
        self.loss_scale = 1.0  # accumulate() averages over micro-batches itself
        self._sequences = config.batch_size  # the last micro-batch's, its weight when balanced
        # Only when asked, so that checkouts from before the light estimate round run the rest.
        light = {"estimate_dtype": spec.estimate_dtype} if spec.estimate_dtype is not None else {}
        try:
            self.opt = acco_module.AccoOptimizer(
                param_groups(model, config.weight_decay), torch.optim.AdamW, mode=spec.mode, lr=config.lr,
                betas=config.betas, max_grad_norm=config.max_grad_norm, timeout=datetime.timedelta(minutes=5), **light)
        except (TypeError, ValueError) as error:
            if not light:
                raise
            # acco checks its arguments before any collective, so every rank refuses alike.
            raise UnsupportedMethod(f"{name}: AccoOptimizer(estimate_dtype={spec.estimate_dtype}) refused: "
                                    f"{error}") from error

    def backward(self, x: Tensor, y: Tensor) -> Tensor:
        self._sequences = x.shape[0]
        return super().backward(x, y)

    def fold(self) -> None:
        # balanced: micro-batches of different sizes, each a mean over its sequences
        self.opt.accumulate(weight=float(self._sequences) if self.spec.balanced else None)

    def committed_micro_batches(self, counted: int) -> float:
        # weight 1 per micro-batch, every rank; balanced: one per sequence, in full micro-batches
        return self.opt.committed_weight / (self.config.batch_size if self.spec.balanced else 1)


TORCHFT_INSTALL = "pip install -e '.[bench]'"
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # DiLoCo's outer SGD with Nesterov momentum (Douillard et al. 2023)


def torchft_version() -> str | None:
    """torchft's version if it imports here (DiLoCo runs through it), else None."""
    # torchft's Rust side logs every quorum at INFO unless told otherwise; it reads this when
    # the extension loads, so before the first import.
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft  # noqa: F401
    except ImportError:
        return None
    return importlib.metadata.version("torchft")


class TorchftDiLoCoMethod(Method):
    """DiLoCo through ``torchft.local_sgd.DiLoCo``, each rank a replica group of one, rank 0
    running torchft's lighthouse: the inner AdamW (an inner step is an update's micro-batches,
    with the other methods' warm-up and clipping), synchronised every H (``diloco-hH``) steps.
    ``end_round()`` is True only when the ranks have just synchronised, the only time they
    hold one model; ``finish()`` puts that model back. Collective: every rank constructs it
    and calls ``close()``.

    Raises:
        ImportError: torchft is not installed.
    """

    def __init__(self, name: str, config: ModelConfig, micro_batches_per_update: int, model: nn.Module,
                 schedule: Callable[[int], float], timeout: datetime.timedelta = datetime.timedelta(minutes=5)) -> None:
        if torchft_version() is None:
            raise ImportError(f"{name}: DiLoCo runs through torchft, which does not import here ({TORCHFT_INSTALL})")
        from torchft import Manager, ProcessGroupGloo
        from torchft.coordination import LighthouseServer
        from torchft.local_sgd import DiLoCo

        super().__init__(name, config, micro_batches_per_update, model)
        local = LocalSpec.parse(name)
        self.sync_every = local.sync_every
        self.inner = torch.optim.AdamW(param_groups(model, config.weight_decay), lr=config.lr, betas=config.betas)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.inner, schedule)
        self.inner_steps = self.outer_steps = 0
        self._params = [p for p in model.parameters() if p.requires_grad]
        rank, world = dist.get_rank(), dist.get_world_size()
        # The lighthouse (torchft's quorum server) runs on rank 0; its address reaches the
        # others through the default group's store-backed broadcast.
        self._lighthouse = LighthouseServer(bind="0.0.0.0:0", min_replicas=world) if rank == 0 else None
        address = [self._lighthouse.address() if self._lighthouse is not None else None]
        dist.broadcast_object_list(address, src=0)
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        # use_async_quorum=False: DiLoCo requires it. init_sync=False: every rank built the same
        # model from the same seed; with init_sync, the first quorum would make one replica
        # fetch the other's state over HTTP mid-run.
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), min_replica_size=world, replica_id=f"rank{rank}", rank=0,
            load_state_dict=lambda state: model.load_state_dict(state["model"]), store_addr="127.0.0.1", world_size=1,
            state_dict=lambda: {"model": model.state_dict()}, store_port=self._store.port, hostname="127.0.0.1",
            lighthouse_addr=address[0], use_async_quorum=False, init_sync=False, timeout=timeout,
            quorum_timeout=timeout, connect_timeout=timeout)
        if local.kind == "sdiloco":  # blocks cut into P consecutive fragments; embeddings with the first
            fragments = fragments_of(model, local.fragments)
            self.outer = [torch.optim.SGD(f.parameters(), lr=local.outer_lr or OUTER_LR, momentum=OUTER_MOMENTUM,
                                          nesterov=True) for f in fragments]
            self.diloco = DiLoCo(self.manager, fragments, self.inner, self.outer, sync_every=self.sync_every,
                                 fragment_sync_delay=local.sync_delay or 0)
        else:
            self.outer = torch.optim.SGD(model.parameters(), lr=local.outer_lr or OUTER_LR, momentum=OUTER_MOMENTUM,
                                         nesterov=True)
            self.diloco = DiLoCo(self.manager, [model], self.inner, self.outer, sync_every=self.sync_every)
        self.diloco.__enter__()  # registers its hooks on the inner optimizer
        self.synced = [p.detach().clone() for p in self._params]

    def end_round(self) -> bool:
        before = self.manager.current_step()  # counts committed synchronisations
        if self.config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self._params, self.config.max_grad_norm)
        self.inner.step()  # torchft synchronises in the inner optimizer's post-step hook
        self.inner.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.inner_steps += 1
        if self.manager.current_step() == before:
            return False
        self.outer_steps += 1
        with torch.no_grad():
            for s, p in zip(self.synced, self._params):
                s.copy_(p)
        return True

    def finish(self) -> bool:
        with torch.no_grad():
            for s, p in zip(self.synced, self._params):
                p.copy_(s)
        return False

    def committed_updates(self, counted: int) -> int:
        return self.outer_steps * self.sync_every  # the inner steps merged into the synchronised model

    def close(self) -> None:
        """Leave torchft (collective: the lighthouse goes once every rank is done)."""
        self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
        dist.barrier()
        if self._lighthouse is not None:
            self._lighthouse.shutdown()


def fragments_of(model: nn.Module, count: int) -> list[nn.Module]:
    """Streaming DiLoCo's fragments of the GPT: its blocks in ``count`` consecutive runs, the
    embeddings with the first, the final LayerNorm with the last (every parameter in one)."""
    blocks = list(model.blocks)
    size = -(-len(blocks) // count)
    runs = [blocks[i : i + size] for i in range(0, len(blocks), size)]
    fragments = [nn.ModuleList(run) for run in runs]
    fragments[0].extend([model.tok_emb, model.pos_emb])
    fragments[-1].append(model.ln_f)
    return fragments


class AccoLocalMethod(Method):
    """acco ``mode="local"``: every ``end_round()`` is one inner step (an update's micro-batches)
    of this rank's replica, with its own warm-up schedule; True when an outer round has landed,
    whose global values are what an evaluation reads (``eval_params``)."""

    def __init__(self, name: str, config: ModelConfig, micro_batches_per_update: int, model: nn.Module,
                 schedule: Callable[[int], float], acco_module: ModuleType) -> None:
        super().__init__(name, config, micro_batches_per_update, model)
        local = LocalSpec.parse(name)
        self.loss_scale = 1.0  # accumulate() averages over micro-batches itself
        options: dict[str, Any] = {} if local.sync_every is None else {"sync_every": local.sync_every}
        if local.outer_lr is not None or local.outer_momentum is not None or not local.nesterov:
            every = acco_module.options.DEFAULT_SYNC_EVERY if local.sync_every is None else local.sync_every
            default = acco_module.default_outer(every if every != "auto" else acco_module.options.AUTO_EVERY_BOUNDS[0]).keywords
            momentum = default["momentum"] if local.outer_momentum is None else local.outer_momentum
            options["outer_optimizer"] = functools.partial(  # torch's SGD: Nesterov needs a momentum
                torch.optim.SGD, lr=default["lr"] if local.outer_lr is None else local.outer_lr,
                momentum=momentum, nesterov=local.nesterov and momentum > 0)
        if local.sync_delay is not None:
            options["sync_delay"] = local.sync_delay
        if local.overlap is not None:
            options["overlap"] = local.overlap
        if local.outer_bits is not None:
            options["outer_bits"] = local.outer_bits
        if local.topk is not None:
            options["outer_topk"] = 1 / local.topk
        if not local.error_feedback:
            options["outer_error_feedback"] = False
        if local.pacing is not None:
            options["pacing"] = local.pacing
        if local.weighting is not None:
            options["outer_weighting"] = local.weighting
        self.local_opt = acco_module.AccoOptimizer(
            param_groups(model, config.weight_decay), torch.optim.AdamW, mode="local", lr=config.lr,
            betas=config.betas, max_grad_norm=config.max_grad_norm, timeout=datetime.timedelta(minutes=5), **options)
        # an int, or "auto": each round's H is in its RoundStats
        self.sync_every = "auto" if self.local_opt.options.local.auto_every else self.local_opt.options.local.sync_every
        self.sync_delay = self.local_opt.options.local.sync_delay
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.local_opt, schedule)
        self.inner_steps = 0

    def fold(self) -> None:
        self.local_opt.accumulate()

    def end_round(self) -> bool:
        before = self.local_opt.outer_rounds
        self.local_opt.step()
        self.scheduler.step()
        self.inner_steps += 1
        return self.local_opt.outer_rounds != before

    def ready(self) -> bool:
        return self.local_opt.ready()

    def finish(self) -> bool:
        return self.local_opt.finish()

    def eval_params(self, params: list[Tensor]) -> list[Tensor]:
        """The global values the last outer round landed (after ``finish()``: every replica's)."""
        order = [p for group in self.local_opt.param_groups for p in group["params"]]
        by_id = {id(p): value for p, value in zip(order, [t for g in self.local_opt.global_parameters() for t in g])}
        return [by_id[id(p)] for p in params]

    def round_stats(self) -> list[Any]:
        return list(self.local_opt.round_stats)

    def committed_updates(self, counted: int) -> int:
        if self.sync_every != "auto":
            return self.local_opt.outer_rounds * self.sync_every  # inner steps merged into the global model
        return sum(self.round_every()[: self.local_opt.outer_rounds])  # (round_stats keeps the last 1024 rounds)

    def round_every(self) -> list[int]:
        """Each outer round's H in launch order (fixed, or the planner's choice with ``auto``)."""
        if self.sync_every != "auto":
            return [self.sync_every] * len(self.local_opt.round_stats)
        return [s.sync_every for s in self.local_opt.round_stats if s.sync_every is not None]


def build_method(name: str, config: ModelConfig, micro_batches_per_update: int, *, dtype: torch.dtype | None = None,
                 device: torch.device | None = None, bucket_view: bool = False, acco_module: ModuleType | None = None,
                 schedule: Callable[[int], float] | None = None, mixed: torch.dtype | None = None) -> Method:
    """A fresh model (the same initial parameters every time) and ``name``'s optimizer;
    ``bucket_view``: DDP's ``gradient_as_bucket_view``; ``acco_module``: another checkout's
    ``acco`` (:class:`Checkout`); ``schedule``: DiLoCo's inner lr factor per inner step.
    ``mixed`` (with ``dtype`` None): compute in that dtype over an fp32 master, each method
    its own way: acco and the roofline hold the model in it (acco keeps an fp32 master
    shard), DDP's methods compute under ``torch.autocast`` over fp32 parameters, FSDP2
    through its ``MixedPrecisionPolicy``.

    Raises:
        ValueError: an unknown name, or an odd number of micro-batches for acco's two rounds.
        UnsupportedMethod: the installed acco refuses this method's arguments.
    """
    spec = method_spec(name)
    if spec.mode == "acco" and micro_batches_per_update % 2:
        raise ValueError(f"{name}: micro-batches per update must be even, got {micro_batches_per_update}")
    if mixed is not None and dtype is not None:
        raise ValueError(f"{name}: give dtype (every tensor in it) or mixed (compute in it), not both")
    model = build_model(config, mixed if spec.family in ("roofline", "acco") else dtype, device)
    if spec.family == "roofline":
        return Roofline(name, config, micro_batches_per_update, model)
    if spec.family == "ddp":
        method: Method = DDPMethod(name, config, micro_batches_per_update, model, bucket_view)
        method.autocast = mixed
        return method
    if spec.family == "fsdp":
        return FSDPMethod(name, config, micro_batches_per_update, model, mixed)
    if spec.family == "diloco":
        return TorchftDiLoCoMethod(name, config, micro_batches_per_update, model, schedule or (lambda step: 1.0))
    if spec.family == "local":
        return AccoLocalMethod(name, config, micro_batches_per_update, model, schedule or (lambda step: 1.0),
                               acco_module or acco)
    return AccoMethod(name, config, micro_batches_per_update, model, acco_module or acco)


@dataclass
class RoundRecord:
    """What one round did on this rank, as the training thread saw it."""

    batches: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    losses: list[Tensor] = field(default_factory=list)
    micro_batch_s: list[float] = field(default_factory=list)  # wall seconds of each micro-batch
    micro_batch_cpu_s: list[float] = field(default_factory=list)  # the training thread's CPU seconds
    compute_s: float = 0.0  # from the round's start to its boundary
    landed: bool = True  # the round in flight had landed when the boundary came
    boundary_s: float = 0.0  # wall seconds in end_round()
    boundary_cpu_s: float = 0.0
    committed: bool = False


def train_round(method: Method, next_batch: Callable[[], tuple[Tensor, Tensor]], *,
                after_backward: Callable[[int], None] | None = None,
                before_boundary: Callable[[RoundRecord], None] | None = None, slowdown: float = 1.0,
                max_micro_batches: int | None = None) -> RoundRecord:
    """One round of ``method``: its micro-batches (with the ``ready()`` loop, more while the
    round in flight has not landed, at most ``max_micro_batches``: then the boundary waits
    for the round), then the boundary. ``after_backward(i)`` runs between micro-batch ``i``'s
    backward and its fold, ``before_boundary`` before ``end_round()``. ``slowdown``: this
    rank emulates a device that many times slower by sleeping ``slowdown - 1`` times each
    micro-batch's CPU time after it: a sleep takes no CPU from the other ranks, and CPU time,
    unlike wall time, does not multiply the waits for a busy core."""
    record = RoundRecord()
    started = time.perf_counter()

    def more() -> bool:
        if len(record.losses) < method.micro_batches_per_round:
            return True
        capped = max_micro_batches is not None and len(record.losses) >= max_micro_batches
        return method.spec.ready_loop and not capped and not method.ready()

    while more():
        x, y = next_batch()
        wall, cpu = time.perf_counter(), time.thread_time()
        loss = method.backward(x, y)
        if after_backward is not None:
            after_backward(len(record.losses))
        method.fold()
        if slowdown > 1.0:
            time.sleep((slowdown - 1.0) * (time.thread_time() - cpu))
        record.micro_batch_s.append(time.perf_counter() - wall)
        record.micro_batch_cpu_s.append(time.thread_time() - cpu)
        record.batches.append((x, y))
        record.losses.append(loss)
    record.compute_s = time.perf_counter() - started
    if before_boundary is not None:
        before_boundary(record)
    record.landed = method.ready()
    wall, cpu = time.perf_counter(), time.thread_time()
    record.committed = method.end_round()
    record.boundary_s, record.boundary_cpu_s = time.perf_counter() - wall, time.thread_time() - cpu
    return record


PHASE_RENAMES = {"weights": "totals"}  # results measured before the lane phase was renamed


def phases(seconds: dict[str, Any]) -> dict[str, Any]:
    """A per-phase dict from any results file, under today's phase names."""
    return {PHASE_RENAMES.get(name, name): value for name, value in seconds.items()}


def lane_summary(stats: Sequence[Any]) -> dict[str, Any]:
    """What the comm lane did in these rounds (acco's ``RoundStats``), averaged."""
    if not stats:
        return {}
    names, mean = dict.fromkeys(p for s in stats for p in s.phase_seconds), statistics.fmean
    return {
        "rounds": len(stats), "lane_s": mean(s.lane_seconds for s in stats),
        "wait_s": mean(s.wait_seconds + getattr(s, "patience_seconds", 0.0) for s in stats), "hidden_share": mean(s.hidden_share for s in stats),
        "phase_s": {p: mean(s.phase_seconds.get(p, 0.0) for s in stats) for p in names},
        # CPU time of the lane's thread (checkouts from before RoundStats.phase_cpu_seconds: none)
        "phase_cpu_s": {p: mean(getattr(s, "phase_cpu_seconds", {}).get(p, 0.0) for s in stats) for p in names},
    }


def training_text(seq_len: int) -> tuple[Tensor, Tensor]:
    """The example's corpus (the standard library's .py files) as train / held-out tokens."""
    return split_corpus(load_corpus(None), seq_len)


def batches(data: Tensor, config: ModelConfig, seed: int) -> Callable[[], tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return lambda: sample_batch(data, config.batch_size, config.seq_len, generator)


def rank_batches(config: ModelConfig, rank: int) -> Callable[[], tuple[Tensor, Tensor]]:
    """This rank's micro-batch stream of the training text, the same in every method."""
    return batches(training_text(config.seq_len)[0], config, config.seed + 1000 * rank)


def warm_up(config: ModelConfig, next_batch: Callable[[], tuple[Tensor, Tensor]]) -> None:
    """A few backwards before the first method, so that it does not pay for the allocator's
    and the kernels' first use."""
    model = build_model(config)
    for _ in range(2):
        loss_fn(model, *next_batch()).backward()


def rotated(items: Sequence[Any], shift: int) -> list[Any]:
    """``items`` rotated by ``shift``: no method is always the first after the warm-up."""
    shift %= max(1, len(items))
    return [*items[shift:], *items[:shift]]


def lo_tx_bytes() -> int | None:
    """Bytes sent on the namespace's loopback so far (every rank's traffic); None outside it."""
    if "ACCO_BENCH_NETNS" not in os.environ:
        return None
    try:
        return int(Path("/sys/class/net/lo/statistics/tx_bytes").read_text())
    except OSError:
        return None


def all_reduce(values: Sequence[float], op: str = "sum") -> list[float]:
    """``values`` summed (or their ``max``) over the ranks, in float64."""
    t = torch.tensor(list(values), dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t.tolist()


def cpu_busy_seconds() -> float:
    """Busy CPU seconds of the whole machine so far (every core, every process)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait


class Window:
    """A measured stretch of training, the same on every rank: its wall time, the loopback's
    bytes and the CPU share other processes took (a shared machine disturbs benchmarks),
    after waiting up to ``max_quiet_wait_s`` for them to use under ``threshold`` of the CPU.
    Collective: every rank makes, opens and closes it."""

    def __init__(self, max_quiet_wait_s: float = 900.0, threshold: float = 0.1, sample_s: float = 0.5) -> None:
        started, announced = time.perf_counter(), False
        while True:
            busy0 = cpu_busy_seconds()
            time.sleep(sample_s)
            # the waited time agreed too: every rank must leave the loop at the same sample
            share, self.waited_for_quiet_s = all_reduce(
                [(cpu_busy_seconds() - busy0) / (sample_s * (os.cpu_count() or 1)), time.perf_counter() - started],
                "max")
            if share < threshold or self.waited_for_quiet_s > max_quiet_wait_s:
                break
            if not announced and dist.get_rank() == 0:
                print(f"other processes use {share:.0%} of the CPU: waiting for a quiet machine", flush=True)
                announced = True
        if share >= threshold:
            print(f"the machine is still {share:.0%} busy after {self.waited_for_quiet_s:.0f} s: measuring anyway",
                  flush=True)
        dist.barrier()

    def open(self) -> None:
        self._busy, self._own, self._bytes = cpu_busy_seconds(), time.process_time(), lo_tx_bytes()
        self._wall = time.perf_counter()

    def close(self) -> dict[str, Any]:
        wall, sent = time.perf_counter() - self._wall, lo_tx_bytes()
        busy = cpu_busy_seconds() - self._busy
        (own,) = all_reduce([time.process_time() - self._own])  # every thread of this rank
        share = max(0.0, busy - own) / (wall * (os.cpu_count() or 1)) if dist.get_rank() == 0 else 0.0
        return {"wall_s": wall, "lo_bytes": None if sent is None or self._bytes is None else sent - self._bytes,
                "foreign_cpu_share": all_reduce([share])[0], "waited_for_quiet_s": self.waited_for_quiet_s}


class Checkout:
    """The ``acco`` package of another checkout, imported beside this one's for an A/B in one
    process; its modules sit in ``sys.modules`` only inside :meth:`active`.

    Raises:
        ValueError: ``root`` holds no ``acco`` package.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        if not (self.root / "acco" / "__init__.py").is_file():
            raise ValueError(f"{self.root} is not a checkout of this repository (no acco/__init__.py)")
        self._modules: dict[str, ModuleType] = {}
        with self.active():
            sys.path.insert(0, str(self.root))
            try:
                self.acco = importlib.import_module("acco")
            finally:
                sys.path.remove(str(self.root))
        git = subprocess.run(["git", "-C", str(self.root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True)
        self.commit = git.stdout.strip() or None

    @staticmethod
    def _take() -> dict[str, ModuleType]:
        return {name: sys.modules.pop(name) for name in list(sys.modules) if name.split(".")[0] == "acco"}

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within the block, ``import acco`` means this checkout's acco."""
        others = self._take()
        sys.modules.update(self._modules)
        try:
            yield
        finally:
            self._modules = self._take()
            sys.modules.update(others)

    def module(self, name: str) -> ModuleType:
        """One of its modules, e.g. ``acco.sharding``."""
        with self.active():
            return importlib.import_module(name)


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: ``arguments`` adds its options; ``rank`` is one launch's work on every
    rank (rank 0's return value is its JSON); ``sweep``, the driver, launches ranks with
    :func:`run_ranks` (default: one launch of ``args.ranks``); ``quick``: the arguments
    ``--quick`` sets; ``check``: what is wrong with the arguments, or None. Results go to
    ``results/NAME.json``, or ``stem`` formatted with the arguments (``profile-{ranks}ranks``).
    """

    name: str
    doc: str
    arguments: Callable[[argparse.ArgumentParser], None]
    rank: Callable[[argparse.Namespace, Dist], dict[str, Any]]
    sweep: Callable[[argparse.Namespace], dict[str, Any]] | None = None
    quick: dict[str, Any] = field(default_factory=dict)
    check: Callable[[argparse.Namespace], str | None] = lambda args: None
    stem: str = ""

    def parse(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
        parser = argparse.ArgumentParser(description=self.doc.split("\n\n")[0])
        self.arguments(parser)
        add = parser.add_argument
        add("--out", type=Path, default=None, help=f"JSON output (default: results/{self.stem or self.name}.json)")
        add("--no-report", action="store_true", help="do not regenerate the README tables and plots")
        add("--quick", action="store_true", help="a short smoke run, into results/scratch/ (no report)")
        add("--label", default=None, help=argparse.SUPPRESS)  # names a rank launch in its output
        args = parser.parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)  # forwarded to the ranks
        args.script = Path(sys.modules[self.rank.__module__].__file__).resolve()
        args.benchmark = self.name
        if args.quick:
            vars(args).update(self.quick, no_report=True)
        args.stem = (self.stem or self.name).format(**vars(args))
        if args.out is None and "RANK" not in os.environ:
            args.out = (SCRATCH_DIR if args.quick else RESULTS_DIR) / f"{args.stem}.json"
        problem = self.check(args)
        if problem:
            parser.error(problem)
        return args


def main(benchmark: Benchmark, argv: Sequence[str] | None = None) -> None:
    """The driver (the user's command), or one rank when started by ``torchrun``."""
    args = benchmark.parse(argv)
    if "RANK" in os.environ:
        backend = getattr(args, "backend", None) or "gloo"  # a benchmark with --backend picks its own
        ctx = setup_distributed(getattr(args, "device", "cpu"), backend, datetime.timedelta(minutes=10))
        result = benchmark.rank(args, ctx)
        if ctx.master:
            write_json(args.out or RESULTS_DIR / f"{args.stem}-torchrun.json", result)
        dist.barrier()
        dist.destroy_process_group()
        return
    started = time.perf_counter()
    results = benchmark.sweep(args) if benchmark.sweep else run_ranks(args, args.ranks)
    results.setdefault("runtime_s", time.perf_counter() - started)  # a merged sweep keeps its own
    save(args, results)
    print(f"wrote {args.out} ({minutes(results['runtime_s'])})")
    if not args.no_report:  # its own process: report.py imports every benchmark, and they import this module
        subprocess.run([sys.executable, str(BENCH_DIR / "report.py")], check=True)


def run_ranks(args: argparse.Namespace, nproc: int, *extra: str, rate: str | None = None,
              netns: bool = False) -> Any:
    """Launch the benchmark's own file on ``nproc`` local ranks with the driver's arguments
    plus ``extra`` (later options win), in a namespace whose loopback is limited to ``rate``
    (``netns``) or under plain ``torchrun --standalone``; rank 0's JSON, with the launch's
    ``runtime_s``."""
    if rate is not None and not netns:
        raise ValueError("a rate limit needs the network namespace")
    env = {"TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONWARNINGS": "ignore"}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        script_and_args = [str(args.script), *args.argv, *extra, "--out", str(out)]
        if netns:
            from netns import run_ranks as run_in_namespace

            code = run_in_namespace(nproc, script_and_args, rate, env=env)
        else:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
            code = subprocess.run([*command, *script_and_args], env={**os.environ, **env}).returncode
        if code:
            raise SystemExit(f"ranks failed (exit {code}): {' '.join(script_and_args)}")
        return {**read_json(out), "runtime_s": time.perf_counter() - started}


@contextlib.contextmanager
def cpu_hogs(count: int) -> Iterator[None]:
    """``count`` busy processes (``sh -c 'while :; do :; done'``) for the block's duration: other
    work sharing the cores, as data loaders, logging or a neighbour's job do on a real node."""
    hogs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def save(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """The driver's results, with the benchmark's name and the machine, to ``args.out``."""
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
               "python": platform.python_version()}
    write_json(args.out, {"benchmark": args.benchmark, "machine": machine, **results})


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def rate_text(rate: str) -> str:
    """``377502045bit`` as ``378 Mbit/s``, ``20mbit`` as ``20 Mbit/s``; a schedule
    (benchmarks/netns.py) ``500mbit:15,20mbit`` as ``500 Mbit/s for 15 s, then 20 Mbit/s``;
    other spellings as they are."""
    if "," in rate:
        from netns import UNLIMITED, parse_rates

        return ", then ".join(rate_text(p.rate or UNLIMITED) + (f" for {p.seconds:g} s" if p.seconds else "")
                              for p in parse_rates(rate))
    if rate.endswith("mbit") and rate[:-4].replace(".", "", 1).isdigit():
        return f"{float(rate[:-4]):g} Mbit/s"
    if rate.endswith("bit") and rate[:-3].isdigit():
        return f"{int(rate[:-3]) / 1e6:.0f} Mbit/s"
    return rate


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend (imported late: only plots need it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_seeds(ax: Any, runs: Sequence[Sequence[tuple[float, float]]], colour: str, label: str) -> None:
    """Each seed's (seconds, loss) curve thin, their median at each evaluation thick, labelled
    with the median final loss."""
    for points in runs:
        ax.plot(*zip(*points), color=colour, lw=0.6, alpha=0.35)
    length = min(len(points) for points in runs)
    times = [statistics.median(points[i][0] for points in runs) for i in range(length)]
    losses = [statistics.median(points[i][1] for points in runs) for i in range(length)]
    final = statistics.median(points[-1][1] for points in runs)
    ax.plot(times, losses, color=colour, lw=2.2, label=f"{label}: {final:.3f}")


def save_figure(fig: Any, path: Path, dpi: int = 110) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path.name
