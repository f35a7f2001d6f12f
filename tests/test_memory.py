"""Memory: where gradients land, which buffers exist, and what a round costs on CUDA.

- the lean path: gradients land in acco's accumulator during backward() (as views of it
  with equal weights, through hooks in a ``micro_batch()`` block), exactly weighted;
- every misuse of weights is an error, never a silent approximation;
- buffers: the reduce-scatter and the all-gather run in place in the round's buffer, sync
  has one gradient buffer, the estimate's copy is allocated once (real gloo ranks);
- CUDA (skipped without it): ``torch.cuda.max_memory_allocated()`` of a training round
  agrees with the formula computed from the buffers' sizes.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn

from acco import AccoOptimizer
from tests.reference import OPTIMIZERS, RECURRENCES, loss_fn, make_model, micro_batch, params_of
from tests.test_heterogeneous import weighted_micro_batch

pytestmark = pytest.mark.timeout(120)
TIMEOUT = datetime.timedelta(seconds=30)
MiB = 1 << 20


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def inside(t: torch.Tensor, buffer: torch.Tensor) -> bool:
    start, size = buffer.data_ptr(), buffer.numel() * buffer.element_size()
    return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= start + size


# ------------------------------------------------------------------ the lean path


def weighted_rank(mode: str, style: str, rounds: int) -> dict:
    """Unequal weights, given after backward (``accumulate(weight)``: p.grad kept) or
    before it (``micro_batch(weight)``: folded during backward)."""
    model = make_model(seed=rank())
    cls, hp = OPTIMIZERS["adamw"]
    opt = AccoOptimizer(model, cls, mode=mode, timeout=TIMEOUT, **hp)
    held = []
    for r in range(rounds):
        for i in range(2 + (r + rank()) % 2):
            x, y, weight = weighted_micro_batch(r, rank(), i)
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
def test_micro_batch_weights_are_exact_and_hold_no_gradient(ranks, mode):
    rounds = 5
    blocks = ranks(2).run(weighted_rank, mode, "block", rounds)
    after = ranks(2).run(weighted_rank, mode, "after", rounds)
    for b in blocks:
        assert not b["grad_held_in_block"]  # folded during backward: no p.grad left
    # Both paths compute w * g per element in the same order: bit for bit the same.
    for name, value in after[0]["params"].items():
        assert torch.equal(blocks[0]["params"][name], value), name
        assert torch.equal(blocks[1]["params"][name], value), name
    data = [
        [weighted_micro_batch(r, k, i) for k in range(2) for i in range(2 + (r + k) % 2)] for r in range(rounds)
    ]
    expected = RECURRENCES[mode](params_of(make_model(seed=0)), "adamw", data)
    for name, value in expected.items():
        torch.testing.assert_close(blocks[0]["params"][name], value, rtol=1e-5, atol=1e-5)


def test_equal_weights_put_p_grad_in_the_accumulator():
    model = make_model()
    opt = AccoOptimizer(model, torch.optim.SGD, mode="dpu", lr=0.1)
    group = opt._groups[0]
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
            assert not any(inside(p.grad, opt2._groups[0].grad_accumulator) for p in model2.parameters())
            opt2.accumulate(weight=1.0)
        opt2.step()
    opt2.finish()
    for (name, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(a, b), name


def test_a_wider_reduce_dtype_folds_through_hooks():
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
    torch.testing.assert_close(opt._groups[0].grad_accumulator[: expected.numel()], expected)
    opt.finish()


# ------------------------------------------------------------------------- misuse


def lean_optimizer() -> tuple[nn.Module, AccoOptimizer]:
    model = make_model()
    opt = AccoOptimizer(model, torch.optim.SGD, mode="acco", lr=0.1)
    loss_fn(model, *micro_batch(0, 0, 0)).backward()
    opt.accumulate()  # no weight: equal weights, folded during backward from now on
    return model, opt


def test_a_weight_after_a_folded_backward_is_an_error():
    model, opt = lean_optimizer()
    loss_fn(model, *micro_batch(0, 0, 1)).backward()
    with pytest.raises(ValueError, match=r"already folded at weight 1\.0.*micro_batch\(weight=w\)"):
        opt.accumulate(weight=3.0)
    assert opt._schedule.current.total() == 2.0 and opt._schedule.current.micro_batches == 2  # counted at its real weight
    loss_fn(model, *micro_batch(0, 0, 2)).backward()
    opt.accumulate(weight=1.0)  # the weight it was folded at: fine
    opt.finish()


def test_a_folded_backward_cannot_be_discarded_by_zero_grad():
    model, opt = lean_optimizer()
    loss_fn(model, *micro_batch(0, 0, 1)).backward()
    with pytest.raises(RuntimeError, match="cannot be discarded"):
        opt.zero_grad()
    opt.accumulate()
    opt.zero_grad()  # nothing pending: allowed, and p.grad no longer aliases the accumulator
    assert all(p.grad is None for p in model.parameters())
    assert opt._groups[0].grad_accumulator.abs().sum() > 0
    opt.finish()


def test_micro_batch_misuse_is_reported():
    model, opt = lean_optimizer()
    x, y = micro_batch(0, 0, 1)
    for bad in (-1.0, float("nan"), float("inf"), "2", True):
        with pytest.raises(ValueError, match="Invalid weight"):
            with opt.micro_batch(weight=bad):
                pass
    with pytest.raises(RuntimeError, match="do not nest"):
        with opt.micro_batch(weight=2.0):
            with opt.micro_batch(weight=3.0):
                pass
    with pytest.raises(RuntimeError, match="inside a micro_batch"):
        with opt.micro_batch(weight=2.0):
            loss_fn(model, x, y).backward()
            opt.accumulate()
    # The block above raised before folding anything? No: backward ran, so it is torn.
    with pytest.raises(RuntimeError, match="partial micro-batch"):
        opt.step()
    opt.close()


def test_micro_batch_without_backward_or_with_pending_gradients():
    model, opt = lean_optimizer()
    with pytest.raises(RuntimeError, match="no gradient"):
        with opt.micro_batch(weight=2.0):
            pass
    with pytest.raises(RuntimeError, match="inside a micro_batch"):
        with opt.micro_batch(weight=2.0):
            opt.step()
    loss_fn(model, *micro_batch(0, 0, 1)).backward()  # equal-weights backward, not accumulated
    with pytest.raises(RuntimeError, match="not been accumulated"):
        with opt.micro_batch(weight=2.0):
            pass
    opt.accumulate()
    with opt.micro_batch(weight=2.0):
        loss_fn(model, *micro_batch(0, 0, 2)).backward()
    assert opt._schedule.current.total() == 4.0
    # After the block p.grad is the accumulator's view again (equal weights resume).
    loss_fn(model, *micro_batch(0, 0, 3)).backward()
    assert all(inside(p.grad, opt._groups[0].grad_accumulator) for p in model.parameters())
    opt.accumulate()
    opt.step()
    opt.finish()


def test_an_exception_inside_a_block_after_backward_stops_the_optimizer():
    model, opt = lean_optimizer()
    with pytest.raises(KeyError):
        with opt.micro_batch(weight=2.0):
            loss_fn(model, *micro_batch(0, 0, 1)).backward()
            raise KeyError("user error")
    for call in (opt.accumulate, opt.step):
        with pytest.raises(RuntimeError, match="partial micro-batch"):
            call()
    opt.close()
    # An exception before any gradient was folded leaves the optimizer usable.
    model, opt = lean_optimizer()
    with pytest.raises(KeyError):
        with opt.micro_batch(weight=2.0):
            raise KeyError("before backward")
    with opt.micro_batch(weight=2.0):
        loss_fn(model, *micro_batch(0, 0, 1)).backward()
    opt.step()
    opt.finish()


# ------------------------------------------------------------------------ buffers


def buffers_rank(mode: str, dtype: str) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 30), nn.Tanh(), nn.Linear(30, 7))
    kwargs = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if dtype == "bf16" else {}
    opt = AccoOptimizer(model, torch.optim.AdamW, mode=mode, lr=1e-2, timeout=TIMEOUT, **kwargs)
    group = opt._groups[0]
    copies = []
    for r in range(6):
        dtype = next(model.parameters()).dtype
        loss_fn(model, torch.randn(4, 40, dtype=dtype), torch.zeros(4, 7, dtype=dtype)).backward()
        opt.accumulate()
        opt.step()
        if group.estimate_copy is not None and group.estimate_copy._state_copy:
            copies.append([v.data_ptr() for s in group.estimate_copy._state_copy.values() for v in s.values()])
    opt.finish()
    handover = group.round_buffer()
    return {
        "bytes": group.buffer_bytes(),
        "n": group.plan.padded_numel,
        "chunk": group.plan.chunk,
        "shard_in_round_buffer": inside(group.grad_shard, handover) and inside(group.gather_input, handover),
        "gathered_is_round_buffer": group.gathered.data_ptr() == handover.data_ptr(),
        "master_grad_is_shard": group.master_grad.data_ptr() == group.grad_shard.data_ptr(),
        "single_buffer": group.grad_handover is group.grad_accumulator,
        "estimate_copies": copies,
        "workspace": group.shard_workspace() is not None,
        "state_bytes": sum(v.nbytes for b in opt.base_optimizers for s in b.state.values() for v in s.values()),
        "params": params_of(model),
    }


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["sync", "dpu", "acco"])
def test_buffers_per_rank_follow_the_formula(ranks, mode, dtype):
    results = ranks(2).run(buffers_rank, mode, dtype)
    for name, value in results[0]["params"].items():
        assert torch.equal(value, results[1]["params"][name])
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
        assert r["shard_in_round_buffer"] and r["master_grad_is_shard"]
        assert r["gathered_is_round_buffer"]
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
    group = opt._groups[0]
    state = sum(v.nbytes for b in opt.base_optimizers for s in b.state.values() for v in s.values()
                if isinstance(v, torch.Tensor))
    opt.finish()
    return {"added_at_rest": at_rest - baseline, "formula": sum(group.buffer_bytes().values()) + state,
            "round_extra": peak - at_rest, "model_bytes": numel * 4, "largest": largest,
            "buffers": group.buffer_bytes()}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["sync", "dpu", "acco"])
def test_cuda_round_memory_agrees_with_the_formula(mode):
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


def pairwise_reduce_scatter_rank(numel: int, first_bytes: int, largest_bytes: int) -> dict:
    """The gloo reduce-scatter in small pieces (thresholds lowered), in place, against a sum."""
    from acco.collectives import Collectives

    comm = Collectives(dist.group.WORLD)
    comm.one_piece_bytes, comm.first_piece_bytes, comm.largest_piece_bytes = 0, first_bytes, largest_bytes
    if True:
        n, r = comm.world_size, comm.rank
        chunk = -(-numel // n)
        inputs = [torch.randn(chunk * n, generator=torch.Generator().manual_seed(k)) for k in range(n)]
        buffer = inputs[r].clone()
        comm.reduce_scatter_sum(buffer[r * chunk : (r + 1) * chunk], buffer)
        expected = torch.stack(inputs).sum(0)[r * chunk : (r + 1) * chunk]
        scratch = comm.scratch_numel
        comm.all_gather(buffer, buffer[r * chunk : (r + 1) * chunk])
        return {"error": float((buffer[r * chunk : (r + 1) * chunk] - expected).abs().max()),
                "gathered": buffer, "scratch": scratch, "first": first_bytes // 4}


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_gloo_reduce_scatter_in_pieces_is_exact_with_a_piece_sized_buffer(ranks, world_size):
    # 1001 elements per rank's chunk: pieces of 16, 16, 32, 64, ... up to 128 elements.
    results = ranks(world_size).run(pairwise_reduce_scatter_rank, 1001 * world_size, 64, 512)
    for result in results:
        assert result["error"] < 1e-5
        assert result["scratch"] == result["first"]  # the only receive buffer: one first piece
        assert torch.equal(result["gathered"], results[0]["gathered"])  # in-place all-gather
