"""The collectives the comm lane runs (``acco.collectives.Collectives``), on real ranks.

- gloo: the pairwise reduce-scatter (each chunk crosses the network once) in one piece and
  in many, in place, with a piece-sized receive buffer; the in-place all-gather;
- the light estimate round's quantized reduce-scatter and all-gather move exactly what
  :mod:`acco.quantize` computes locally (its rounding is tested in tests/test_quantize.py);
- NCCL (skipped without CUDA): every lane collective is issued from the comm lane's thread.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing as mp
import threading

import pytest
import torch
import torch.distributed as dist

from acco.collectives import Collectives
from acco import AccoOptimizer
from acco.quantize import dequantize_row, quantize_rows
from tests.helpers import CUDA_TIMEOUT, assert_params_close
from tests.ranks import free_port
from tests.reference import OPTIMIZERS, loss_fn, make_model, micro_batch, params_of

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------------------ gloo


def one_piece_rank(chunk: int) -> dict:
    """The default thresholds (a small chunk travels in one piece), in place, against a sum."""
    comm = Collectives(dist.group.WORLD)
    n, r = comm.world_size, comm.rank
    inputs = [torch.randn(chunk * n, generator=torch.Generator().manual_seed(k)) for k in range(n)]
    buffer = inputs[r].clone()
    own = buffer[r * chunk : (r + 1) * chunk]
    comm.reduce_scatter_sum(own, buffer)
    total = torch.stack(inputs).sum(0)
    error = float((own - total[r * chunk : (r + 1) * chunk]).abs().max())
    comm.all_gather(buffer, own)
    return {"error": error, "gathered": buffer, "total": total}


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_gloo_reduce_scatter_in_one_piece_and_the_all_gather_are_exact(ranks, world_size: int) -> None:
    """Each rank's shard is the sum of every rank's chunk; after the in-place all-gather
    every rank holds the whole sum, the same on every rank."""
    results = ranks(world_size).run(one_piece_rank, 37)
    for result in results:
        assert result["error"] < 1e-5
        torch.testing.assert_close(result["gathered"], result["total"], rtol=1e-5, atol=1e-5)
        assert torch.equal(result["gathered"], results[0]["gathered"])


def pairwise_reduce_scatter_rank(numel: int, first_bytes: int, largest_bytes: int) -> dict:
    """The gloo reduce-scatter in small pieces (thresholds lowered), in place, against a sum."""
    comm = Collectives(dist.group.WORLD)
    comm.one_piece_bytes, comm.first_piece_bytes, comm.largest_piece_bytes = 0, first_bytes, largest_bytes
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
def test_the_gloo_reduce_scatter_in_pieces_is_exact_with_a_piece_sized_buffer(ranks, world_size: int) -> None:
    """With the piece thresholds lowered, the pairwise gloo reduce-scatter sums exactly,
    receives into one first-piece-sized buffer only, and the in-place all-gather agrees."""
    # 1001 elements per rank's chunk: pieces of 16, 16, 32, 64, ... up to 128 elements.
    results = ranks(world_size).run(pairwise_reduce_scatter_rank, 1001 * world_size, 64, 512)
    for result in results:
        assert result["error"] < 1e-5
        assert result["scratch"] == result["first"]  # the only receive buffer: one first piece
        assert torch.equal(result["gathered"], results[0]["gathered"])  # in-place all-gather


def quantized_rank(chunk: int, dtype_name: str) -> dict:
    """The quantized reduce-scatter and all-gather against the same rounding done locally."""
    dtype = getattr(torch, dtype_name)
    comm = Collectives(dist.group.WORLD)
    n, r = comm.world_size, comm.rank
    # Magnitudes 1, 100, 1e4 per rank (within float16's range, which has no scale): a
    # float8 scale shared across ranks would lose the small ones.
    inputs = [torch.randn(chunk * n, generator=torch.Generator().manual_seed(k)) * 100.0**k for k in range(n)]
    shard = torch.empty(chunk)
    comm.reduce_scatter_quantized(shard, inputs[r].clone(), dtype)
    expected = torch.zeros(chunk)
    for k in range(n):  # summed in fp32 in rank order, as on arrival
        payload, scales = quantize_rows(inputs[k].view(n, -1).clone(), dtype)
        expected.add_(dequantize_row(payload[r], scales[r]))
    rows, scales = comm.all_gather_quantized(inputs[r][:chunk].clone(), dtype)
    gathered_ok = True
    for k in range(n):
        payload, scale = quantize_rows(inputs[k][:chunk].view(1, -1).clone(), dtype)
        gathered_ok &= torch.equal(rows[k].view(torch.uint8), payload[0].view(torch.uint8))
        gathered_ok &= torch.equal(scales[k : k + 1], scale)
    exact = torch.stack([x.view(n, -1)[r] for x in inputs]).sum(0)
    return {"shard_equal": torch.equal(shard, expected), "gathered_equal": bool(gathered_ok),
            "relative_error": float((shard - exact).abs().max() / exact.abs().max()),
            "rows": (tuple(rows.shape), rows.dtype)}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_quantized_collectives_move_exactly_the_local_rounding(ranks, world_size: int, dtype: str) -> None:
    """What arrives is bit for bit what quantize_rows/dequantize_row give locally, with one
    scale per destination row: only the rounding of the dtype is lost, nothing in transit."""
    results = ranks(world_size).run(quantized_rank, 23, dtype)
    bound = {"bfloat16": 2**-8, "float16": 2**-11, "float8_e4m3fn": 2**-4, "float8_e5m2": 2**-3}[dtype]
    for result in results:
        assert result["shard_equal"] and result["gathered_equal"], result
        assert result["rows"] == ((world_size, 23), getattr(torch, dtype))
        assert 0.0 < result["relative_error"] <= world_size * bound, result


# -------------------------------------------------------- NCCL on the lane's thread


COLLECTIVES = ("all_reduce", "reduce_scatter_single", "reduce_scatter_tensor", "all_gather_single",
               "all_gather_into_tensor")


def nccl_alone(port: int, mode: str) -> dict:
    """One NCCL rank, the lane's collectives forced on; which threads issued them."""
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    threads: dict[str, set[str]] = {}
    for name in COLLECTIVES:
        if not hasattr(dist, name):
            continue  # e.g. reduce_scatter_single before torch 2.13
        original = getattr(dist, name)

        def counted(*args, _original=original, _name=name, **kwargs):  # type: ignore[no-untyped-def]
            threads.setdefault(_name, set()).add(threading.current_thread().name)
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    try:
        model = make_model().cuda()
        cls, hp = OPTIMIZERS["adamw"]
        opt = AccoOptimizer(model, cls, mode=mode, max_grad_norm=0.5, timeout=CUDA_TIMEOUT, **hp)
        opt.lane_collectives.communicate_alone = True
        for r in range(6):
            for i in range(2):
                x, y = micro_batch(r, 0, i)
                loss_fn(model, x.cuda(), y.cuda()).backward()
                opt.accumulate(weight=torch.tensor(float(1 + i), device="cuda"))
            opt.step()
        opt.finish()
        return {"params": {k: v.cpu() for k, v in params_of(model).items()}, "threads": threads,
                "nccl": str(torch.cuda.nccl.version())}
    finally:
        dist.destroy_process_group()


def cpu_alone(mode: str) -> dict:
    model = make_model()
    cls, hp = OPTIMIZERS["adamw"]
    opt = AccoOptimizer(model, cls, mode=mode, max_grad_norm=0.5, timeout=CUDA_TIMEOUT, **hp)
    for r in range(6):
        for i in range(2):
            loss_fn(model, *micro_batch(r, 0, i)).backward()
            opt.accumulate(weight=float(1 + i))
        opt.step()
    opt.finish()
    return {"params": params_of(model)}


@pytest.mark.timeout(180)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not (dist.is_available() and dist.is_nccl_available()), reason="needs NCCL")
@pytest.mark.parametrize("mode", ["dpu", "acco"])
def test_nccl_collectives_run_on_the_lane_thread(mode: str) -> None:
    """Every reduce-scatter, all-gather and all-reduce of a round is issued from the comm
    lane's thread, and the result equals the same run on the CPU."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        result = pool.submit(nccl_alone, free_port(), mode).result(timeout=150)
    threads = result["threads"]
    for kind in ("all_reduce", "reduce_scatter", "all_gather"):
        used = set().union(*(names for name, names in threads.items() if name.startswith(kind)))
        assert used == {"acco-comm-lane"}, threads  # every lane collective, from the worker
    expected = cpu_alone(mode)["params"]
    assert_params_close(result["params"], expected)
