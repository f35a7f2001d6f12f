"""Memory: where gradients land, which buffers exist, and what a round costs on CUDA.

- the lean path: gradients land in acco's accumulator during backward() (as views of it
  with equal weights, through hooks in a ``micro_batch()`` block), exactly weighted (every
  misuse of weights is an error, never a silent approximation: tests/test_misuse.py);
- buffers: the reduce-scatter and the all-gather run in place in the round's buffer, sync
  has one gradient buffer, the estimate's copy is allocated once (real gloo ranks);
- CUDA (skipped without it): ``torch.cuda.max_memory_allocated()`` of a training round
  agrees with the formula computed from the buffers' sizes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from acco import AccoOptimizer
from tests.helpers import (TIMEOUT, assert_identical_across_ranks, assert_params_close, assert_params_equal, inside,
                           this_rank)
from tests.reference import OPTIMIZERS, RECURRENCES, loss_fn, make_model, micro_batch, params_of, weighted_micro_batch

pytestmark = pytest.mark.timeout(120)
MiB = 1 << 20


# ------------------------------------------------------------------ the lean path


def weighted_rank(mode: str, style: str, rounds: int) -> dict:
    """Unequal weights, given after backward (``accumulate(weight)``: p.grad kept) or
    before it (``micro_batch(weight)``: folded during backward)."""
    model = make_model(seed=this_rank())
    cls, hp = OPTIMIZERS["adamw"]
    opt = AccoOptimizer(model, cls, mode=mode, timeout=TIMEOUT, **hp)
    held = []
    for r in range(rounds):
        for i in range(2 + (r + this_rank()) % 2):
            x, y, weight = weighted_micro_batch(r, this_rank(), i)
            if style == "block":
                with opt.micro_batch(weight=weight):
                    loss_fn(model, x, y).backward()
                    held.append(any(p.grad is not None for p in model.parameters()))
            else:
                loss_fn(model, x, y).backward()
                opt.accumulate(weight=weight)
        opt.step()
    opt.finish()
    return {"params": params_of(model), "grad_held_in_block": any(held)}


@pytest.mark.parametrize("mode", ["dpu", "acco"])
def test_micro_batch_weights_are_exact_and_hold_no_gradient(ranks, mode) -> None:
    """Weights given in a micro_batch() block (folded during backward, no p.grad left) give bit for bit
    the parameters of weights given to accumulate(), and both follow the weighted recurrence."""
    rounds = 5
    blocks = ranks(2).run(weighted_rank, mode, "block", rounds)
    after = ranks(2).run(weighted_rank, mode, "after", rounds)
    for b in blocks:
        assert not b["grad_held_in_block"]  # folded during backward: no p.grad left
    # Both paths compute w * g per element in the same order: bit for bit the same.
    assert_params_equal(blocks[0]["params"], after[0]["params"])
    assert_params_equal(blocks[1]["params"], after[0]["params"])
    data = [
        [weighted_micro_batch(r, k, i) for k in range(2) for i in range(2 + (r + k) % 2)] for r in range(rounds)
    ]
    expected = RECURRENCES[mode](params_of(make_model(seed=0)), "adamw", data)
    assert_params_close(blocks[0]["params"], expected)


def test_equal_weights_put_p_grad_in_the_accumulator() -> None:
    """With equal weights p.grad is a view of the accumulator after the first micro-batch, and training
    equals the run with p.grad kept until accumulate()."""
    model = make_model()
    opt = AccoOptimizer(model, torch.optim.SGD, mode="dpu", lr=0.1)
    group = opt.sharded_groups[0]
    loss_fn(model, *micro_batch(0, 0, 0)).backward()
    assert all(p.grad is not None for p in model.parameters())  # the first micro-batch: p.grad kept
    opt.accumulate()
    for r in range(3):
        for i in range(2):
            loss_fn(model, *micro_batch(r, 0, i)).backward()
            # p.grad exists (as for plain torch) but is the accumulator's memory.
            for p in model.parameters():
                assert inside(p.grad, group.grad_accumulator)
            opt.accumulate()
        opt.step()
    opt.finish()
    # The same training with p.grad kept until accumulate() (explicit weights).
    model2 = make_model()
    opt2 = AccoOptimizer(model2, torch.optim.SGD, mode="dpu", lr=0.1)
    loss_fn(model2, *micro_batch(0, 0, 0)).backward()
    opt2.accumulate(weight=1.0)
    for r in range(3):
        for i in range(2):
            loss_fn(model2, *micro_batch(r, 0, i)).backward()
            assert not any(inside(p.grad, opt2.sharded_groups[0].grad_accumulator) for p in model2.parameters())
            opt2.accumulate(weight=1.0)
        opt2.step()
    opt2.finish()
    assert_params_equal(params_of(model), params_of(model2))


def test_a_wider_reduce_dtype_folds_through_hooks() -> None:
    """bf16 parameters with an fp32 reduce dtype: hooks fold each gradient into the fp32 accumulator
    and drop p.grad; the sum is exact."""
    # bf16 parameters, fp32 accumulation: p.grad cannot be an fp32 view, so the hooks fold
    # each gradient into the fp32 accumulator and drop it.
    model = nn.Linear(8, 4).to(torch.bfloat16)
    opt = AccoOptimizer(model, torch.optim.SGD, mode="sync", lr=0.1, reduce_dtype=torch.float32)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    model(x).sum().backward()
    first = [p.grad.float().clone() for p in model.parameters()]
    opt.accumulate()
    model(x).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    opt.accumulate()
    expected = torch.cat([2 * g.reshape(-1) for g in first])
    torch.testing.assert_close(opt.sharded_groups[0].grad_accumulator[: expected.numel()], expected)
    opt.finish()

# ------------------------------------------------------------------------ buffers


def buffers_rank(mode: str, dtype: str) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 30), nn.Tanh(), nn.Linear(30, 7))
    kwargs = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if dtype == "bf16" else {}
    opt = AccoOptimizer(model, torch.optim.AdamW, mode=mode, lr=1e-2, timeout=TIMEOUT, **kwargs)
    group = opt.sharded_groups[0]
    copies = []
    for r in range(6):
        dtype = next(model.parameters()).dtype
        loss_fn(model, torch.randn(4, 40, dtype=dtype), torch.zeros(4, 7, dtype=dtype)).backward()
        opt.accumulate()
        opt.step()
        if group.shard_copy().state_tensors():
            copies.append([v.data_ptr() for v in group.shard_copy().state_tensors()])
    opt.finish()
    handover = group.round_buffer()
    return {
        "bytes": group.buffer_bytes(),
        "n": group.plan.padded_numel,
        "chunk": group.plan.chunk,
        "grad_shard_in_round_buffer": inside(group.grad_shard, handover),
        "gather_input_in_round_buffer": inside(group.gather_input, handover),
        "gathered_is_round_buffer": group.gathered.data_ptr() == handover.data_ptr(),
        "gathers_into_params": group.gathers_into_params,
        "params_in_gathered": all(inside(p, group.gathered) for p in group.params),
        "master_grad_is_shard": group.master_grad.data_ptr() == group.grad_shard.data_ptr(),
        "single_buffer": group.grad_handover is group.grad_accumulator,
        "estimate_copies": copies,
        "workspace": group.shard_workspace() is not None,
        "state_bytes": sum(v.nbytes for b in opt.base_optimizers for s in b.state.values() for v in s.values()),
        "params": params_of(model),
    }


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["sync", "dpu", "acco"])
def test_buffers_per_rank_follow_the_formula(ranks, mode, dtype) -> None:
    """Each buffer's bytes per rank are what the design says (in-place reduce-scatter and all-gather in
    the round's buffer, one gradient buffer in sync, the estimate's copy allocated once), and the
    ranks agree."""
    results = ranks(2).run(buffers_rank, mode, dtype)
    assert_identical_across_ranks(results)
    for r in results:
        n, chunk = r["n"], r["chunk"]
        reduce_bytes = 4  # fp32 reduction in both cases (bf16 parameters reduce in fp32 here)
        expected = {
            "grad_accumulator": n * reduce_bytes,
            "grad_handover": 0 if mode == "sync" else n * reduce_bytes,
            "gathered": 0,  # in the round's buffer (bf16: its first half)
            # sync and dpu with fp32 everywhere: the master shard is the live parameters'
            # chunk, copied into the round's buffer for each update.
            "master": 0 if mode != "acco" and dtype == "fp32" else chunk * 4,
            "master_grad": 0,  # the fp32 reduce-scatter output serves
            # One copy of the AdamW state, allocated once; the estimate steps a working copy
            # of the master shard in a chunk of the round's buffer that was already sent
            # (when one does not overlap the bf16 all-gather input: else a copy of it too).
            "estimate_copy": r["state_bytes"] + (0 if r["workspace"] else chunk * 4) if mode == "acco" else 0,
        }
        assert r["bytes"] == expected
        assert r["single_buffer"] is (mode == "sync")
        assert r["grad_shard_in_round_buffer"] and r["master_grad_is_shard"]
        # sync with fp32 parameters gathers into the parameters themselves (views of one flat
        # buffer, the master shard their chunk); every other case into the round's buffer
        into_params = mode == "sync" and dtype == "fp32"
        assert r["gathers_into_params"] is into_params and r["params_in_gathered"] is into_params
        assert r["gather_input_in_round_buffer"] is not into_params
        assert r["gathered_is_round_buffer"] is not into_params
        if mode == "acco":
            assert len(r["estimate_copies"]) >= 3 and all(c == r["estimate_copies"][0] for c in r["estimate_copies"])
        if dtype == "fp32":
            assert r["workspace"]


# --------------------------------------------------------------------------- CUDA


def _cuda_round_peak(mode: str, explicit_weight: bool) -> dict:
    """One training round on CUDA after a warm-up: persistent bytes and the round's peak."""
    torch.manual_seed(0)
    width, depth, batch = 512, 16, 4  # 4.2M parameters; activations and any one gradient are small
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]).cuda()
    numel = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters()) * 4
    x = torch.randn(batch, width, device="cuda")
    # The parameters and what any training allocates once (cuBLAS workspaces): the baseline.
    model(x).square().mean().backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    # SGD with momentum and no weight decay allocates no temporaries in its step.
    opt = AccoOptimizer(model, torch.optim.SGD, mode=mode, lr=1e-3, momentum=0.9)

    def round_() -> None:
        for _ in range(2):
            model(x).square().mean().backward()
            if explicit_weight:
                opt.accumulate(weight=1.0)  # p.grad kept until here
            else:
                opt.accumulate()  # equal weights: p.grad are views of the accumulator
        opt.step()
        torch.cuda.synchronize()

    for _ in range(4):  # every lazily allocated buffer exists afterwards
        round_()
    at_rest = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    round_()
    peak = torch.cuda.max_memory_allocated()
    group = opt.sharded_groups[0]
    state = sum(v.nbytes for b in opt.base_optimizers for s in b.state.values() for v in s.values()
                if isinstance(v, torch.Tensor))
    opt.finish()
    return {"added_at_rest": at_rest - baseline, "formula": sum(group.buffer_bytes().values()) + state,
            "round_extra": peak - at_rest, "model_bytes": numel * 4, "largest": largest,
            "buffers": group.buffer_bytes()}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["sync", "dpu", "acco"])
def test_cuda_round_memory_agrees_with_the_formula(mode) -> None:
    """On CUDA the memory acco adds is its buffers plus the optimizer state (within 1% + 1 MiB), and a
    round never holds a model-size copy of the gradients."""
    lean = _cuda_round_peak(mode, explicit_weight=False)
    # At rest, on top of the parameters: acco's buffers (buffer_bytes: accumulator, hand-over,
    # master shard, ...) + the optimizer state, to within 1% + 1 MiB (the caching allocator
    # rounds blocks up to 512 bytes; a few small tensors).
    assert abs(lean["added_at_rest"] - lean["formula"]) <= 0.01 * lean["formula"] + MiB, lean
    # During a round: activations (tiny here) and the incoming gradient of a layer or two at
    # a time; never a model-size copy of the gradients.
    assert lean["round_extra"] <= 4 * lean["largest"] + 2 * MiB, lean
    # With weights given after backward p.grad (one model size) is held until accumulate():
    # the same measurement sees it.
    kept = _cuda_round_peak(mode, explicit_weight=True)
    assert kept["round_extra"] >= 0.95 * kept["model_bytes"], kept
