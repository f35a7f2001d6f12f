"""The CUDA comm lane: it never blocks the training thread, overlaps on the GPU, and
computes what the CPU computes. Skipped without CUDA.

- ``step()`` returns at once while the compute stream is busy (``torch.cuda._sleep``), with
  and without clipping, with an optimizer that syncs the host itself (ASGD), and with a
  token count on the device as the weight;
- a round sleeping on the side stream and compute sleeping on the compute stream take the
  time of one sleep, not two;
- sync / dpu / acco on CUDA equal the same run on CPU: world size 1, world size 2 with gloo
  on CUDA tensors (two ranks sharing one GPU), and bf16 parameters with an fp32 master;
- module buffers (BatchNorm statistics) on CUDA: identical on both ranks, equal to the CPU run.

That NCCL collectives run from the lane's thread is in tests/test_collectives.py.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from acco import AccoOptimizer
from tests.helpers import CUDA_TIMEOUT, assert_identical_across_ranks, this_rank
from tests.reference import OPTIMIZERS, loss_fn, make_model, micro_batch, params_of

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def cycles_per_second() -> float:
    """``torch.cuda._sleep`` cycles per second on this GPU."""
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(int(5e7))
    end.record()
    end.synchronize()
    return 5e7 / (start.elapsed_time(end) / 1000.0)


def wide_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512)).cuda()


def settle(opt: AccoOptimizer) -> None:
    """Wait until the GPU is idle and the round in flight has finished."""
    torch.cuda.synchronize()
    deadline = time.monotonic() + 30
    while not opt.ready() and time.monotonic() < deadline:
        time.sleep(0.001)
    torch.cuda.synchronize()


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
@pytest.mark.parametrize("optimizer", ["adamw", "asgd"])
def test_step_returns_at_once_while_the_compute_stream_is_busy(cycles_per_second, optimizer, max_grad_norm) -> None:
    """accumulate() + step() return in milliseconds while 0.5 s of compute is queued: no host
    synchronisation on the training thread (clipping, ASGD, a device weight)."""
    model = wide_model()
    cls = {"adamw": torch.optim.AdamW, "asgd": torch.optim.ASGD}[optimizer]
    opt = AccoOptimizer(model, cls, mode="acco", lr=1e-3, max_grad_norm=max_grad_norm, timeout=CUDA_TIMEOUT)
    x = torch.randn(64, 512, device="cuda")
    for _ in range(4):  # the lane thread, CUDA context and optimizer state exist from here on
        model(x).square().mean().backward()
        opt.accumulate(weight=torch.tensor(64.0, device="cuda"))
        opt.step()
    settle(opt)
    timings = []
    for _ in range(3):
        model(x).square().mean().backward()
        tokens = torch.full((), 64.0, device="cuda")  # a token count computed on the device
        torch.cuda._sleep(int(0.5 * cycles_per_second))  # the compute stream is busy for 0.5 s
        started = time.perf_counter()
        opt.accumulate(weight=tokens)
        opt.step()
        timings.append(time.perf_counter() - started)
        busy = not opt.ready()
        settle(opt)
        assert busy, "ready() was True while the round's inputs were still being computed"
    opt.finish()
    print(f"{optimizer}, max_grad_norm={max_grad_norm}: accumulate()+step() took "
          + ", ".join(f"{1000 * t:.2f}" for t in timings) + " ms with 0.5 s of compute queued")
    # Before the comm lane, this took the full 0.5 s (the round's host syncs ran here).
    assert min(timings) < 0.02, timings
    assert sorted(timings)[1] < 0.05, timings


class SleepySGD(torch.optim.SGD):
    """SGD whose next steps first sleep on the current stream (the lane's side stream)."""

    sleeps: list[int] = []

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        if SleepySGD.sleeps:
            torch.cuda._sleep(SleepySGD.sleeps.pop(0))
        return super().step(closure)


def test_a_round_and_the_compute_overlap_on_the_gpu(cycles_per_second) -> None:
    """0.3 s on the lane's side stream and 0.3 s on the compute stream take about 0.3 s in all, and the
    telemetry says the round was hidden."""
    model = wide_model()
    opt = AccoOptimizer(model, SleepySGD, mode="dpu", lr=1e-3, timeout=CUDA_TIMEOUT)
    x = torch.randn(64, 512, device="cuda")
    for _ in range(3):
        model(x).square().mean().backward()
        opt.accumulate()
        opt.step()
    settle(opt)
    SleepySGD.sleeps = [int(0.3 * cycles_per_second)]
    model(x).square().mean().backward()
    opt.accumulate()
    started = time.perf_counter()
    opt.step()  # the round sleeps 0.3 s on the side stream ...
    torch.cuda._sleep(int(0.3 * cycles_per_second))  # ... while compute sleeps 0.3 s
    model(x).square().mean().backward()
    opt.accumulate()
    opt.step()  # lands the round: the compute stream waits for it on the GPU
    torch.cuda.current_stream().record_event().synchronize()
    elapsed = time.perf_counter() - started
    opt.finish()
    print(f"0.3 s on each stream: {elapsed:.3f} s in all")
    assert elapsed < 0.45, f"{elapsed:.3f}s: the lane and compute did not overlap (0.6 s if serialised)"
    assert elapsed > 0.28, elapsed
    slow = [s for s in opt.round_stats if s.phase_seconds.get("update", 0.0) > 0.25]
    assert len(slow) == 1, [s.phase_seconds for s in opt.round_stats]
    # GPU times: the lane's round took 0.3 s and the compute stream hardly waited for it.
    assert slow[0].lane_seconds >= 0.28 and slow[0].hidden_share > 0.8, slow[0]


# ------------------------------------------------------------------- parity with CPU


def train(device: str, mode: str, optimizer: str, rounds: int = 6, param_dtype: torch.dtype | None = None,
          estimate_dtype: torch.dtype | None = None) -> dict:
    """A run with clipping and unequal weights (tensors on ``device``); params on the CPU."""
    rank = this_rank()
    model = make_model(seed=rank).to(device)
    cls, hp = OPTIMIZERS[optimizer]
    opt = AccoOptimizer(
        model, cls, mode=mode, max_grad_norm=0.5, param_dtype=param_dtype,
        reduce_dtype=torch.float32 if param_dtype else None, timeout=CUDA_TIMEOUT, estimate_dtype=estimate_dtype, **hp,
    )
    committed = []
    for r in range(rounds):
        for i in range(2 + (r + rank) % 2):
            x, y = micro_batch(r, rank, i)
            x, y = x.to(device, param_dtype or torch.float32), y.to(device, param_dtype or torch.float32)
            loss_fn(model, x, y).backward()
            weight = float(1 + i + rank)
            opt.accumulate(weight=torch.tensor(weight, device=device) if device == "cuda" else weight)
        committed.append(opt.step())
    committed.append(opt.finish())
    masters = [g.master.dtype for g in opt.sharded_groups]
    return {
        "params": {k: v.float().cpu() for k, v in params_of(model).items()},
        "committed": committed,
        "norms": [s.grad_norm for s in opt.round_stats],
        "master_dtypes": masters,
    }


def assert_same_run(cuda: dict, cpu: dict, tol: float) -> None:
    assert cuda["committed"] == cpu["committed"]
    for name, value in cpu["params"].items():
        torch.testing.assert_close(cuda["params"][name], value, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(torch.tensor(cuda["norms"]), torch.tensor(cpu["norms"]), rtol=tol, atol=tol)


@pytest.mark.parametrize("mode", ["sync", "dpu", "acco"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_cuda_equals_cpu_at_world_size_one(mode, optimizer) -> None:
    """On one GPU every mode computes what it computes on the CPU (clipping, unequal weights)."""
    assert_same_run(train("cuda", mode, optimizer), train("cpu", mode, optimizer), 1e-5)


def test_bf16_parameters_with_an_fp32_master_on_cuda_follow_the_cpu() -> None:
    """bf16 parameters keep an fp32 master shard on CUDA and follow the CPU run within bf16 rounding."""
    cuda = train("cuda", "acco", "adamw", param_dtype=torch.bfloat16)
    cpu = train("cpu", "acco", "adamw", param_dtype=torch.bfloat16)
    assert cuda["master_dtypes"] == [torch.float32]
    assert_same_run(cuda, cpu, 2e-2)  # bf16 forward/backward rounding differs between devices


@pytest.fixture(scope="module")
def gloo_pair():
    from tests.ranks import RankPool

    pool = RankPool(2)
    yield pool
    pool.close()


@pytest.mark.parametrize("mode", ["sync", "dpu", "acco"])
def test_gloo_on_cuda_tensors_equals_gloo_on_cpu_at_world_size_two(gloo_pair, mode) -> None:
    """Two ranks sharing a GPU over gloo compute what two CPU ranks compute, identical on both ranks."""
    cuda = gloo_pair.run(train, "cuda", mode, "adamw")
    cpu = gloo_pair.run(train, "cpu", mode, "adamw")
    assert_identical_across_ranks(cuda)
    for rank in range(2):
        assert_same_run(cuda[rank], cpu[rank], 1e-5)


@pytest.mark.parametrize("estimate_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_gloo_on_cuda_tensors_light_estimate_equals_cpu(gloo_pair, estimate_dtype) -> None:
    """The light estimate round over gloo on CUDA tensors equals the same run on the CPU."""
    cuda = gloo_pair.run(train, "cuda", "acco", "adamw", 6, None, estimate_dtype)
    cpu = gloo_pair.run(train, "cpu", "acco", "adamw", 6, None, estimate_dtype)
    for rank in range(2):
        assert_same_run(cuda[rank], cpu[rank], 1e-5)


def test_gloo_on_cuda_tensors_bf16_parameters(gloo_pair) -> None:
    """bf16 parameters over gloo on CUDA tensors: identical ranks, the CPU run within bf16 rounding."""
    cuda = gloo_pair.run(train, "cuda", "acco", "adamw", 6, torch.bfloat16)
    cpu = gloo_pair.run(train, "cpu", "acco", "adamw", 6, torch.bfloat16)
    assert_identical_across_ranks(cuda)
    assert_same_run(cuda[0], cpu[0], 2e-2)


def bn_train(device: str, mode: str, buffers: str) -> dict:
    """A BatchNorm model, each rank on differently scaled data: its full state after finish()."""
    from tests.test_buffers import batch, bn_model

    model = bn_model()
    # A bias right before train-mode BatchNorm has a zero gradient up to rounding, which AdamW
    # scales to +-lr steps: it would follow each device's rounding (1e-2 apart between the H200
    # and its host, and between fp32 and fp64 on one CPU), not acco's arithmetic.
    model[0].bias = None
    model = model.to(device)
    opt = AccoOptimizer(model, torch.optim.AdamW, mode=mode, buffers=buffers, lr=1e-2, timeout=CUDA_TIMEOUT)
    for r in range(6):
        for i in range(2):
            x, y = (t.to(device) for t in batch(r, this_rank(), i))
            nn.functional.mse_loss(model(x), y).backward()
            opt.accumulate()
        opt.step()
    opt.finish()
    return {"state": {k: v.detach().cpu() for k, v in model.state_dict().items()}}


@pytest.mark.parametrize("buffers", ["broadcast", "average"])
@pytest.mark.parametrize("mode", ["dpu", "acco"])
def test_module_buffers_on_cuda_stay_identical_and_equal_the_cpu_run(gloo_pair, mode, buffers) -> None:
    """BatchNorm buffers on CUDA ride with the rounds on the side stream: identical on both
    ranks after finish(), and what the same run computes on the CPU."""
    cuda = gloo_pair.run(bn_train, "cuda", mode, buffers)
    cpu = gloo_pair.run(bn_train, "cpu", mode, buffers)
    assert_identical_across_ranks(cuda, key="state")
    for name, value in cpu[0]["state"].items():
        torch.testing.assert_close(cuda[0]["state"][name], value, rtol=1e-4, atol=1e-5,
                                   msg=lambda message, name=name: f"{name}: {message}")
