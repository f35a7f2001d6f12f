"""Param groups, clipping, LR schedulers, per-group base optimizers and mixed precision,
each against an unsharded single-process reference."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from acco import AccoOptimizer
from tests.helpers import TIMEOUT, assert_identical_across_ranks, assert_params_close, assert_params_equal, this_rank
from tests.reference import RECURRENCES, loss_fn, make_model, micro_batch, params_of

pytestmark = pytest.mark.timeout(120)
MAX_NORM = 0.05  # small enough that most updates are clipped


def two_groups(model: nn.Module) -> list[dict]:
    """Weights with decay and one lr, biases without decay and a higher lr."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0, "lr": 3e-2}]


def muon_groups(model: nn.Module) -> list[dict]:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights, "optimizer_class": torch.optim.Muon, "lr": 2e-2}, {"params": biases}]


def scheduler_for(name: str, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    sched = torch.optim.lr_scheduler
    if name == "lambda":
        return sched.LambdaLR(optimizer, lambda t: 1.0 / (1 + t))
    if name == "cosine":
        return sched.CosineAnnealingLR(optimizer, T_max=20, eta_min=1e-4)
    if name == "onecycle":
        return sched.OneCycleLR(optimizer, max_lr=3e-2, total_steps=25)
    if name == "warmup_cosine":
        warmup = sched.LinearLR(optimizer, start_factor=0.1, total_iters=5)
        return sched.SequentialLR(optimizer, [warmup, sched.CosineAnnealingLR(optimizer, T_max=15)], milestones=[5])
    raise ValueError(name)


def plain_optimizer(config: str, model: nn.Module) -> torch.optim.Optimizer:
    if config == "groups" or config.startswith("acco"):
        return torch.optim.AdamW(two_groups(model), lr=1e-2)
    if config == "muon":
        weights, biases = muon_groups(model)
        return MuonAndAdamW(torch.optim.Muon(weights["params"], lr=2e-2), torch.optim.AdamW(biases["params"], lr=1e-2))
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


class MuonAndAdamW:
    """Two plain optimizers stepped together (the single-process Muon recipe)."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad()


def build(config: str, model: nn.Module, mode: str) -> AccoOptimizer:
    common = dict(mode=mode, timeout=TIMEOUT, lr=1e-2)
    if config == "groups":
        return AccoOptimizer(two_groups(model), torch.optim.AdamW, **common)
    if config == "clip":
        return AccoOptimizer(model, torch.optim.AdamW, max_grad_norm=MAX_NORM, **common)
    if config == "muon":
        return AccoOptimizer(muon_groups(model), torch.optim.AdamW, layout="tensor", **common)
    if config == "bf16":
        return AccoOptimizer(model, torch.optim.AdamW, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, **common)
    if config.startswith("sched:"):
        return AccoOptimizer(model, torch.optim.AdamW, **common)
    if config == "acco":
        return AccoOptimizer(two_groups(model), torch.optim.AdamW, max_grad_norm=MAX_NORM, **common)
    raise ValueError(config)


def train_rank(config: str, mode: str, rounds: int) -> dict:
    rank = this_rank()
    model = make_model(seed=rank)
    opt = build(config, model, mode)
    scheduler = None
    if config.startswith("sched:"):
        scheduler = scheduler_for(config.split(":")[1], opt)
    elif config == "acco":
        scheduler = scheduler_for("warmup_cosine", opt)
    lrs = []
    for r in range(rounds):
        for i in range(2):
            x, y = micro_batch(r, rank, i)
            loss_fn(model, x.to(next(model.parameters()).dtype), y.to(next(model.parameters()).dtype)).backward()
            opt.accumulate()
        if opt.step() and scheduler is not None:
            scheduler.step()
        lrs.append([g["lr"] for g in opt.param_groups])
    opt.finish()
    masters = [[p.detach().clone() for p in base.param_groups[0]["params"]] if base else [] for base in opt.base_optimizers]
    return {
        "params": {n: p.detach().float() for n, p in model.named_parameters()},
        "dtypes": {str(p.dtype) for p in model.parameters()},
        "norms": [s.grad_norm for s in opt.round_stats],
        "lrs": lrs,
        "masters": masters,
        "base_classes": [type(b).__name__ if b else None for b in opt.base_optimizers],
    }


def plain_training(config: str, rounds: int, world_size: int) -> dict:
    """Single-process training on the global batch, the same rules by hand."""
    model = make_model()
    master = None
    if config == "bf16":  # bf16 model, fp32 master copy updated by AdamW
        master = make_model()
        model = make_model().to(torch.bfloat16)
        opt = torch.optim.AdamW(master.parameters(), lr=1e-2)
    else:
        opt = plain_optimizer(config, model)
    scheduler = scheduler_for(config.split(":")[1], opt) if config.startswith("sched:") else None
    norms, lrs = [], []
    for r in range(rounds):
        batches = [micro_batch(r, rank, i) for rank in range(world_size) for i in range(2)]
        x = torch.cat([b[0] for b in batches]).to(next(model.parameters()).dtype)
        y = torch.cat([b[1] for b in batches]).to(next(model.parameters()).dtype)
        model.zero_grad()
        if master is not None:
            # bf16 backward per micro-batch (the global batch would round differently),
            # gradients averaged in fp32 into the master's .grad.
            for m in master.parameters():
                m.grad = torch.zeros_like(m)
            for bx, by in batches:
                model.zero_grad()
                loss_fn(model, bx.to(torch.bfloat16), by.to(torch.bfloat16)).backward()
                for p, m in zip(model.parameters(), master.parameters()):
                    m.grad += p.grad.float() / len(batches)
        else:
            loss_fn(model, x, y).backward()
        if config == "clip":
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        if master is not None:
            with torch.no_grad():
                for p, m in zip(model.parameters(), master.parameters()):
                    p.copy_(m)
        if scheduler is not None:
            scheduler.step()
            lrs.append([g["lr"] for g in opt.param_groups])
    return {"params": {n: p.detach().float() for n, p in model.named_parameters()}, "norms": norms, "lrs": lrs,
            "master": None if master is None else params_of(master)}


@pytest.mark.parametrize("config", ["groups", "clip", "muon"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_sync_equals_single_process_training(ranks, world_size, config) -> None:
    """sync with two param groups, global-norm clipping (same norms) or per-group Muon + AdamW equals
    single-process training on the global batch."""
    rounds = 5
    results = ranks(world_size).run(train_rank, config, "sync", rounds)
    expected = plain_training(config, rounds, world_size)
    for result in results:
        assert_params_close(result["params"], expected["params"])
    if config == "clip":
        assert all(n > MAX_NORM for n in expected["norms"])  # clipping was active
        torch.testing.assert_close(results[0]["norms"], expected["norms"], rtol=1e-5, atol=0)
    if config == "muon":
        owned = {c for r in results for c in r["base_classes"] if c}
        assert owned == {"Muon", "AdamW"}


@pytest.mark.parametrize("scheduler", ["lambda", "cosine", "onecycle", "warmup_cosine"])
def test_lr_schedulers_over_20_updates(ranks, scheduler) -> None:
    """LR schedulers driven by committed steps give the single-process learning rates and parameters
    over 20 updates."""
    rounds = 20
    results = ranks(2).run(train_rank, f"sched:{scheduler}", "sync", rounds)
    expected = plain_training(f"sched:{scheduler}", rounds, 2)
    assert results[0]["lrs"] == expected["lrs"]
    assert_params_close(results[0]["params"], expected["params"])


def test_bf16_params_with_an_fp32_master(ranks) -> None:
    """bf16 parameters with fp32 master shards: the masters, concatenated, are the reference fp32
    master, and the live parameters are it rounded to bf16."""
    rounds = 5
    results = ranks(2).run(train_rank, "bf16", "sync", rounds)
    expected = plain_training("bf16", rounds, 2)
    for result in results:
        assert result["dtypes"] == {"torch.bfloat16"}
        # The fp32 masters, concatenated over ranks (flat layout), are the reference master.
    flat_master = torch.cat([r["masters"][0][0] for r in results])
    reference = torch.cat([v.flatten() for v in expected["master"].values()])
    torch.testing.assert_close(flat_master[: reference.numel()], reference, rtol=1e-5, atol=1e-5)
    # The live bf16 parameters are the master rounded to bf16.
    assert_params_close(results[0]["params"],
                        {k: v.to(torch.bfloat16).float() for k, v in expected["master"].items()}, rtol=0, atol=0)


def test_acco_with_groups_clipping_and_a_scheduler_equals_its_recurrence(ranks) -> None:
    """acco with param groups, clipping and a warm-up cosine schedule equals its recurrence with the
    documented rule for which lr each estimate and commit use."""
    rounds = 12
    results = ranks(2).run(train_rank, "acco", "acco", rounds)
    data = [[(*micro_batch(r, rank, i), 1.0) for rank in range(2) for i in range(2)] for r in range(rounds)]

    # The rule: an update's commit applies the lr the scheduler has when the commit round
    # is handed over, after t scheduler steps for update t (0-based), as in sync mode; its
    # estimate started inside the step() that committed update t - 1, before that
    # scheduler step, so it uses the lr after max(t - 1, 0) steps.
    probe = torch.optim.AdamW(two_groups(make_model()), lr=1e-2)
    probe_scheduler = scheduler_for("warmup_cosine", probe)
    lrs = [[g["lr"] for g in probe.param_groups]]
    for _ in range(rounds):
        probe.step()
        probe_scheduler.step()
        lrs.append([g["lr"] for g in probe.param_groups])
    assert lrs[1] != lrs[2], "the schedule must change between updates for this test to mean anything"

    def set_lr(t: int, optimizer: torch.optim.Optimizer, kind: str) -> None:
        for group, lr in zip(optimizer.param_groups, lrs[t if kind == "commit" else max(t - 1, 0)]):
            group["lr"] = lr

    expected = RECURRENCES["acco"](
        params_of(make_model()), lambda m: torch.optim.AdamW(two_groups(m), lr=1e-2), data,
        max_norm=MAX_NORM, on_update=set_lr,
    )
    assert_params_close(results[0]["params"], expected)
    assert_identical_across_ranks(results)


def test_a_16_bit_reduce_dtype_warns_and_fp32_accumulation_keeps_precision() -> None:
    """A bf16 reduce dtype warns, and an fp32 one sums 256 bf16 gradients 100x more precisely."""
    with pytest.warns(UserWarning, match="reduce_dtype=torch.float32"):
        AccoOptimizer(make_model(), torch.optim.SGD, mode="sync", lr=0.1, param_dtype=torch.bfloat16)
    # 256 micro-batch gradients of bf16 parameters, summed in fp32 vs in bf16.
    sums = {}
    for reduce_dtype in (torch.float32, torch.bfloat16):
        model = nn.Linear(64, 1, bias=False).to(torch.bfloat16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = AccoOptimizer(model, torch.optim.SGD, mode="sync", lr=1.0, reduce_dtype=reduce_dtype)
        grads = []
        for i in range(256):
            g = torch.Generator().manual_seed(i)
            model.weight.grad = (1 + torch.rand(1, 64, generator=g)).to(torch.bfloat16)
            grads.append(model.weight.grad.double())
            opt.accumulate()
        opt.step()
        exact = torch.stack(grads).mean(0)
        sums[reduce_dtype] = float((opt.sharded_groups[0].grad_shard.double()[:64] / 256 - exact.flatten()).abs().max())
    assert sums[torch.float32] < 1e-6
    assert sums[torch.bfloat16] > 100 * sums[torch.float32]


CLIPS = (None, 0, 0.0, MAX_NORM)


def clipping_off_rank(modes: tuple[str, ...]) -> dict:
    """Each mode trained 4 rounds with each of ``CLIPS`` as ``max_grad_norm``."""
    rank = this_rank()
    runs = {}
    for mode in modes:
        # Two outer rounds, the replicas in lockstep: the default pacing follows measured speeds,
        # so two runs of it may split their steps differently and are not bit for bit alike.
        local = {"sync_every": 2, "pacing": "lockstep"} if mode == "local" else {}
        for clip in CLIPS:
            model = make_model(seed=rank)
            opt = AccoOptimizer(model, torch.optim.AdamW, mode=mode, max_grad_norm=clip, timeout=TIMEOUT, lr=1e-2,
                                **local)  # fmt: skip
            for r in range(4):
                for i in range(2):
                    loss_fn(model, *micro_batch(r, rank, i)).backward()
                    opt.accumulate()
                opt.step()
            opt.finish()
            runs[f"{mode} {clip!r}"] = {"params": params_of(model), "max_grad_norm": opt.max_grad_norm}
    return runs


def test_max_grad_norm_zero_is_no_clipping_in_every_mode(ranks) -> None:
    """max_grad_norm=0 and 0.0 (nanoGPT's grad_clip=0.0, the HF Trainer's max_grad_norm=0) train
    bit for bit as None in every mode, on 2 ranks, where a small norm changes the result; a
    negative norm still raises."""
    modes = ("sync", "dpu", "acco", "local")
    results = ranks(2).run(clipping_off_rank, modes)
    for runs in results:
        for mode in modes:
            unclipped = runs[f"{mode} None"]["params"]
            for clip in (0, 0.0):
                assert runs[f"{mode} {clip!r}"]["max_grad_norm"] is None
                assert_params_equal(runs[f"{mode} {clip!r}"]["params"], unclipped)
            clipped = runs[f"{mode} {MAX_NORM!r}"]["params"]
            assert any(not torch.equal(clipped[name], unclipped[name]) for name in unclipped), f"{mode}: never clipped"
    with pytest.raises(ValueError, match="Invalid max_grad_norm: -1.0"):
        AccoOptimizer(make_model(), torch.optim.AdamW, max_grad_norm=-1.0, lr=1e-2)
