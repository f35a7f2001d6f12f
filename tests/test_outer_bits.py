"""mode="local" with lighter outer rounds (``outer_bits`` 16, 8, 4) on real gloo ranks.

Reference (tests/reference.py, ``local_reference`` with ``outer_bits``, written from
docs/design.md "Lighter outer rounds"): the flat layout's rows quantised by an independent
block quantiser, each replica's residual, the fp32 sum, and the copy c of the global values
every rank holds, moved by the quantised difference to the master.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist

from acco import AccoOptimizer
from tests.helpers import TIMEOUT, assert_identical_across_ranks, assert_params_close, assert_params_equal, this_rank
from tests.reference import OPTIMIZERS, loss_fn, make_model, params_of
from tests.test_local import H, MAX_NORM, build, expected, inner_step, resume_rank, step_data

pytestmark = pytest.mark.timeout(120)


def row_bytes(sizes: list[int], chunk: int, world_size: int, bits: int) -> int:
    """The longest row an outer round sends (every row padded to it): 16 bits 2 bytes per
    value; below, per block of up to 64 values of one parameter's piece of the row, 64 values
    of ``bits`` and a bf16 scale."""
    if bits == 16:
        return 2 * chunk
    ends = list(itertools.accumulate(sizes))
    longest = 0
    for rank in range(world_size):
        first, last = rank * chunk, (rank + 1) * chunk
        pieces = [min(end, last) - max(end - size, first) for size, end in zip(sizes, ends)]
        longest = max(longest, sum(math.ceil(n / 64) for n in pieces if n > 0) * (64 * bits // 8 + 2))
    return longest


def run_rank(steps: int, options: dict) -> dict:
    rank = this_rank()
    model = make_model(seed=rank)
    opt = build(model, "adamw", layout="flat", **options)
    for t in range(steps):
        inner_step(opt, model, t, rank, True)
    opt.finish()
    return {"params": params_of(model), "bytes": [s.collective_bytes for s in opt.round_stats],
            "padded": opt.shard_plans[0].padded_numel, "sizes": opt.buffer_bytes()[0],
            "global": {k: v for k, v in zip(params_of(model), opt.global_parameters()[0])}}


@pytest.mark.parametrize("world_size,bits,feedback,delay,overlap", [
    (2, 4, True, 0, "discard"),
    (3, 4, True, 1, "keep"),
    (2, 8, True, 2, "discard"),
    (2, 16, True, 0, "discard"),
    (2, 4, False, 2, "keep"),
])
def test_quantised_rounds_equal_their_recurrence(ranks, world_size, bits, feedback, delay, overlap) -> None:
    """Every replica ends where the one-process recurrence puts it (1e-6), identical on every
    rank, at the copy of the global values; each round moves the codec's bytes: R rows of
    ceil(P/R) values on each leg (4 bits: 4.25 per value, 8 bits: 8.25, 16 bits: 16)."""
    steps = 8
    options = {"sync_every": H, "sync_delay": delay, "overlap": overlap, "outer_bits": bits,
               "outer_error_feedback": feedback}
    results = ranks(world_size).run(run_rank, steps, options)
    reference = expected(world_size, steps, "adamw", sync_every=H, sync_delay=delay, overlap=overlap,
                         outer_bits=bits, error_feedback=feedback)
    full_precision = expected(world_size, steps, "adamw", sync_every=H, sync_delay=delay, overlap=overlap)
    assert_identical_across_ranks(results)
    assert_params_close(results[0]["params"], reference[0], rtol=0, atol=1e-6)
    assert max((reference[0][k] - full_precision[0][k]).abs().max() for k in reference[0]) > 1e-5  # not vacuous (10x the tolerance)
    padded = results[0]["padded"]
    sizes = [p.numel() for p in make_model().parameters()]
    rounds = results[0]["bytes"]
    assert len(rounds) >= 2 and rounds == [2 * world_size * row_bytes(sizes, padded // world_size, world_size, bits)] * len(rounds)
    assert_params_equal(results[0]["global"], results[0]["params"])  # finish(): the model holds the copy
    residual = 4 * padded if feedback and bits < 16 else 0
    assert results[0]["sizes"]["outer_residual"] == residual


def test_error_feedback_changes_the_recurrence() -> None:
    """The references themselves: with and without residuals at 4 bits, and 4 against 8 bits,
    give different models (the test above would pass vacuously otherwise)."""
    kwargs = {"sync_every": H, "sync_delay": 0}
    a = expected(2, 8, "adamw", outer_bits=4, **kwargs)[0]
    b = expected(2, 8, "adamw", outer_bits=4, error_feedback=False, **kwargs)[0]
    c = expected(2, 8, "adamw", outer_bits=8, **kwargs)[0]
    for one, other in ((a, b), (a, c)):
        assert (one["0.weight"] - other["0.weight"]).abs().max() > 1e-4


@pytest.mark.parametrize("delay,stop", [(2, 4), (0, 5)])
def test_resume_with_residuals_is_bit_identical(ranks, delay, stop) -> None:
    """The state carries each rank's residuals and the copy of the global values; resumed with a
    round in flight (its gather leg sent again from the restored master and copy) or between
    rounds, the run ends bit for bit as the uninterrupted one."""
    options = {"sync_every": H, "sync_delay": delay, "outer_bits": 4}
    results = ranks(2).run(resume_rank, 9, stop, options)
    for result in results:
        assert result["in_flight"] == (delay > 0) and result["residuals"]
        assert_params_equal(result["resumed"], result["straight"])
    assert_identical_across_ranks(results, "resumed")


def auto_rank(steps: int) -> dict:
    rank = this_rank()
    model = make_model(seed=rank)
    opt = build(model, "sgd", sync_every=2, sync_delay="auto", overlap="keep", outer_bits=8)
    for t in range(steps):
        inner_step(opt, model, t, rank, False)
    opt.finish()
    return {"params": params_of(model), "rounds": opt.outer_rounds}


def test_auto_delay_and_keep(ranks) -> None:
    """sync_delay="auto" with overlap="keep" at 8 bits: every replica ends identical."""
    results = ranks(2).run(auto_rank, 9)
    assert_identical_across_ranks(results)
    assert all(math.isfinite(v.abs().sum().item()) for v in results[0]["params"].values())


def mesh_rank(inner: str, bits: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from tests.test_mesh import build as build_inner, data_of, full_params

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = build_inner(inner, mesh)
    cls, hp = OPTIMIZERS["adamw"]
    opt = AccoOptimizer(model, cls, process_group=mesh["replicate"].get_group(), mode="local", sync_every=H,
                        sync_delay=1, max_grad_norm=MAX_NORM, timeout=TIMEOUT, outer_bits=bits, pacing="lockstep", **hp)
    for t in range(7):
        for i in range(2):
            loss_fn(model, *data_of(inner, t, dist.get_rank(), i, False)[:2]).backward()
            opt.accumulate()
        opt.step()
    opt.finish()
    return {"params": full_params(model), "bytes": [s.collective_bytes for s in opt.round_stats],
            "chunk": opt.shard_plans[0].chunk}


@pytest.mark.parametrize("inner", ["fsdp", "tp"])
def test_mesh_replicas_end_identical(ranks, inner) -> None:
    """FSDP2 or TP inside each replica group: the outer round quantises each rank's local
    shards across mesh["replicate"]; all 4 ranks end with the same full parameters (replicated
    parameters, TP's biases here, stay identical across a replica group's ranks: their blocks
    hold their own values only)."""
    four = ranks(4).run(mesh_rank, inner, 4)
    assert_identical_across_ranks(four)
    assert all(torch.isfinite(v).all() for v in four[0]["params"].values())


def bad(**options) -> None:
    AccoOptimizer(make_model(), torch.optim.AdamW, lr=1e-3, **options)


@pytest.mark.parametrize("options,message", [
    ({"mode": "local", "outer_bits": 5}, "outer_bits: 5"),
    ({"mode": "local", "outer_bits": 2}, "outer_bits: 2"),
    ({"mode": "local", "outer_bits": True}, "outer_bits: True"),
    ({"mode": "local", "outer_bits": "4"}, "outer_bits: '4'"),
    ({"mode": "local", "outer_bits": 4, "outer_error_feedback": "yes"}, "outer_error_feedback: 'yes'"),
])
def test_bad_input_before_any_collective(options, message) -> None:
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=message):
        bad(**options)


def test_one_process_equals_the_recurrence() -> None:
    """Without a process group (one replica) the rounds still go through the codec."""
    result = run_rank(7, {"sync_every": H, "sync_delay": 1, "outer_bits": 4})
    reference = expected(1, 7, "adamw", sync_every=H, sync_delay=1, outer_bits=4)
    assert_params_close(result["params"], reference[0], rtol=0, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_one_process_rounds_go_through_the_codec_on_the_device() -> None:
    """On a GPU (no Triton, no CUDA-only kernel: torch ops only) the codec runs on the device:
    the rounds move the same bytes as on the CPU and the run ends near the CPU one (a level
    may round the other way where the two devices' arithmetic differ in the last bit)."""
    results = {}
    for device in ("cpu", "cuda"):
        model = make_model(seed=0).to(device)
        opt = build(model, "adamw", sync_every=H, sync_delay=1, outer_bits=4)
        for t in range(7):
            for x, y, w in step_data(t, 0):
                loss_fn(model, x.to(device), y.to(device)).backward()
                opt.accumulate(w)
            opt.step()
        opt.finish()
        results[device] = ({k: v.cpu() for k, v in params_of(model).items()}, [s.collective_bytes for s in opt.round_stats])
    assert results["cuda"][1] == results["cpu"][1]
    assert_params_close(results["cuda"][0], results["cpu"][0], rtol=0, atol=1e-2)


def test_none_means_the_defaults() -> None:
    """A configurator's typed None is the default, as for the other local arguments."""
    opt = AccoOptimizer(make_model(), torch.optim.AdamW, mode="local", outer_bits=None, outer_error_feedback=None)
    assert (opt.options.local.outer_bits, opt.options.local.error_feedback) == (4, True)
    opt.finish()


def skip_rank() -> dict:
    """Rank 1's parameters hold a NaN when the second round launches (nonfinite="skip")."""
    rank = this_rank()
    model = make_model(seed=rank)
    opt = build(model, "sgd", sync_every=2, sync_delay=0, nonfinite="skip")
    for t in range(6):
        if t == 3 and rank == 1:
            with torch.no_grad():
                next(model.parameters())[0, 0] = float("nan")
        inner_step(opt, model, t, rank, False)
    skipped = [s.skipped for s in opt.round_stats]
    opt.finish()
    return {"params": params_of(model), "skipped": skipped, "counted": opt.skipped_outer_rounds,
            "bytes": [s.collective_bytes for s in opt.round_stats]}


def test_a_skipped_round_sends_the_master_through_the_gather_leg(ranks) -> None:
    """NaN in one replica's parameters with nonfinite="skip": the round changes nothing on
    every rank, its result travels quantised like any gather leg (no raw values), and the
    replicas end identical and finite."""
    results = ranks(2).run(skip_rank)
    assert_identical_across_ranks(results)
    for result in results:
        assert result["skipped"][:3] == [False, True, False] and result["counted"] == 1
        assert 0 < result["bytes"][1] < result["bytes"][0]  # the gather leg only
        assert all(torch.isfinite(v).all() for v in result["params"].values())


def relayout_rank(directory: str, save: bool) -> dict:
    """Save with the flat layout through acco.checkpoint, load with the tensor layout (every
    rank is handed rank 0's part): each rank's residual after the load."""
    import acco.checkpoint

    rank = this_rank()
    model = make_model(seed=rank)
    opt = build(model, "sgd", layout="flat" if save else "tensor", sync_every=2, sync_delay=0)
    if save:
        for t in range(3):
            inner_step(opt, model, t, rank, False)
        acco.checkpoint.save(directory, opt, model)
        residuals = opt.state_dict()["acco"]["local"]["residuals"][0]
    else:
        acco.checkpoint.load(directory, opt, model)
        residuals = opt.state_dict()["acco"]["local"]["residuals"][0]
    opt.finish()
    return {"residual": torch.cat([r.reshape(-1) for r in residuals])}


def test_a_rank_handed_another_ranks_part_starts_from_a_zero_residual(ranks, tmp_path) -> None:
    """Resharded to another layout, acco.checkpoint hands every rank rank 0's part: rank 0
    keeps its residual, rank 1 starts from zero instead of counting rank 0's a second time."""
    directory = str(tmp_path / "ckpt")
    saved = ranks(2).run(relayout_rank, directory, True)
    loaded = ranks(2).run(relayout_rank, directory, False)
    assert saved[0]["residual"].abs().sum() > 0 and saved[1]["residual"].abs().sum() > 0
    assert torch.equal(loaded[0]["residual"], saved[0]["residual"])
    assert not loaded[1]["residual"].any()
