"""mode="local" with overlap="estimate" on real gloo ranks: each replica starts a round from its
own estimate of the outer step, the commit lands a round later (docs/design.md, "The estimate
rule").

Reference (tests/reference.py, ``local_reference`` with ``overlap="estimate"``): the replicas'
start points s_m = y - a (c - theta_m) from the outer SGD's own state on a whole copy of x,
landings as "keep" (x_new - s_m added), the commit the outer step on the mean pseudo-gradient.
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch
import torch.distributed as dist

from acco import AccoOptimizer
from tests.helpers import assert_identical_across_ranks, assert_params_close, assert_params_equal, this_rank
from tests.reference import make_model, params_of
from tests.test_local import H, build, consolidated_local, expected, inner_step, mesh_expected, mesh_rank, resume_rank, run_rank
from tests.test_outer_bits import row_bytes, run_rank as bits_rank

pytestmark = pytest.mark.timeout(120)

ESTIMATE = {"overlap": "estimate"}


NESTEROV = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.3, nesterov=True)


@pytest.mark.parametrize("bits,delay,outer", [(4, H, None), (8, 1, None), (4, H, NESTEROV), (8, 1, NESTEROV)],
                         ids=["4-whole-plain", "8-early-plain", "4-whole-nesterov", "8-early-nesterov"])
def test_quantised_estimate_equals_its_recurrence(ranks, bits, delay, outer) -> None:
    """Below 32 bits the common part y travels as x does (quantised against each rank's copy):
    every replica ends where the recurrence puts it, identical on every rank; each round sends
    three legs of the codec's rows (the reduce, x and y). With plain averaging (the default outer
    step) y is x itself: two legs, and no copy of it."""
    steps = 10
    options = {"sync_every": H, "sync_delay": delay, "outer_bits": bits, "outer_optimizer": outer, **ESTIMATE}
    results = ranks(2).run(bits_rank, steps, options)
    reference = expected(2, steps, "adamw", sync_every=H, sync_delay=delay, overlap="estimate", outer_bits=bits,
                         **({} if outer is None else {"outer": outer}))  # fmt: skip
    assert_identical_across_ranks(results)
    assert_params_close(results[0]["params"], reference[0], rtol=0, atol=1e-6)
    padded = results[0]["padded"]
    sizes = [p.numel() for p in make_model().parameters()]
    rounds = results[0]["bytes"]
    legs = 2 if outer is None else 3
    assert len(rounds) >= 3 and rounds == [legs * 2 * row_bytes(sizes, padded // 2, 2, bits)] * len(rounds)
    assert results[0]["sizes"]["common_term"] == (0 if outer is None else 4 * padded)


def test_a_whole_round_in_flight_differs_from_landing_early() -> None:
    """The references themselves: landing after 1 step (the start corrected early) and a whole
    round in flight are different runs, and neither is blocking (the tests would pass vacuously
    otherwise)."""
    whole = expected(2, 10, "adamw", sync_every=H, sync_delay=H, overlap="estimate")[0]
    early = expected(2, 10, "adamw", sync_every=H, sync_delay=1, overlap="estimate")[0]
    blocking = expected(2, 10, "adamw", sync_every=H, sync_delay=0)[0]
    for one, other in ((whole, early), (whole, blocking), (early, blocking)):
        assert (one["0.weight"] - other["0.weight"]).abs().max() > 1e-4


def test_the_commit_is_the_outer_step_on_the_mean() -> None:
    """One replica: its own pseudo-gradient is the mean, so the estimate is the commit and a
    whole round in flight is blocking DiLoCo exactly (up to rounding)."""
    result = run_rank(9, "sgd", "flat", False, {"sync_every": H, "sync_delay": H, "outer_bits": 32, **ESTIMATE})
    blocking = expected(1, 9, "sgd", sync_every=H, sync_delay=0)[0]
    assert_params_close(result["params"], blocking, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("inner,delay", [("fsdp", H), ("tp", 1)])
def test_mesh_equals_the_recurrence_over_replica_groups(ranks, inner, delay) -> None:
    """FSDP2 or TP inside each replica group of a 2 x 2 mesh: the estimate is formed on each
    rank's local shards; equal to the recurrence with 2 replicas, identical on all 4 ranks."""
    steps = 8
    results = ranks(4).run(mesh_rank, inner, steps, delay, "estimate")
    assert_identical_across_ranks(results)
    assert_params_close(results[0]["params"], mesh_expected(inner, steps, delay, "estimate"), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bits,delay,stop", [(32, H, 4), (4, 1, 6)])
def test_resume_is_bit_identical(ranks, bits, delay, stop) -> None:
    """A state saved with a round in flight (its copy of y already brought up to date by the
    lane, its x gather replayed at the load) or between rounds resumes bit for bit."""
    options = {"sync_every": H, "sync_delay": delay, "outer_bits": bits, **ESTIMATE}
    results = ranks(2).run(resume_rank, 10, stop, options)
    for result in results:
        assert result["in_flight"] == (stop % H < delay)
        assert_params_equal(result["resumed"], result["straight"])
    assert_identical_across_ranks(results, "resumed")


def test_a_rank_zero_checkpoint_resumes_every_replica_exactly(ranks, tmp_path) -> None:
    """consolidate_state_dict(to=0) after 4 inner steps with a whole round in flight: fresh
    processes end bit for bit as the uninterrupted run (each replica's own start comes back from
    rank 0's file)."""
    from tests.ranks import run_fresh

    path, options = str(tmp_path / "ckpt.pt"), {"sync_delay": H, **ESTIMATE}
    uninterrupted = ranks(2).run(consolidated_local, path, 4, 5, True, False, options)
    resumed = run_fresh(consolidated_local, path, 4, 5, False, False, options, world_size=2)
    assert all(r["in_flight"] for r in resumed)
    for a, b in zip(resumed, uninterrupted):
        assert_params_equal(a["params"], b["params"])


def gated_rank(steps: int, release: str) -> dict:
    """sync_every 3, sync_delay "auto", the comm lane's reduce leg held at a gate that lets one
    round through per opening: ``"late"`` opens it only once the round is due to land (a whole
    round in flight), ``"early"`` at the launch, then waits for the lane (so the round lands at
    the next step)."""
    rank = this_rank()
    model = make_model(seed=rank)
    opt = build(model, "adamw", sync_every=H, sync_delay="auto", outer_bits=32, **ESTIMATE)
    gate = threading.Event()
    comm = opt.lane_collectives  # test hook: the comm lane's own collectives
    original = comm.reduce_scatter_sum

    def gated(*args, **kwargs):  # one round through per opening
        assert gate.wait(60), "the gate was never opened"
        gate.clear()
        return original(*args, **kwargs)

    comm.reduce_scatter_sum = gated
    landed_after = []
    for t in range(steps):
        before = opt.outer_rounds
        if release == "late" and (t + 1) % H == 0 and t + 1 > H:
            threading.Timer(0.3, gate.set).start()  # opened while step() waits for the round due now
        inner_step(opt, model, t, rank, False)
        if opt.outer_rounds != before:
            landed_after.append(t + 1)
        if (t + 1) % H == 0 and release == "early":
            gate.set()
            opt.state_dict()  # waits for the round on the lane; it lands at the next step()
    gate.set()
    opt.finish()
    return {"landed_after": landed_after, "params": params_of(model)}


@pytest.mark.parametrize("release,delay,landed", [("late", H, [6, 9]), ("early", 1, [4, 7])])
def test_auto_lands_by_the_next_boundary_and_equals_that_integer_delay(ranks, release, delay, landed) -> None:
    """sync_delay="auto": a round still on the lane at the next boundary is waited for there (a
    whole round in flight: the run equals sync_delay=3); one done right after its launch lands at
    the next step (equals sync_delay=1). What auto changes is only when a round lands, and the
    run is the recurrence of the landing steps it took."""
    steps = 9
    results = ranks(2).run(gated_rank, steps, release)
    reference = expected(2, steps, "adamw", sync_every=H, sync_delay=delay, overlap="estimate")
    for result in results:
        assert result["landed_after"] == landed
    assert_identical_across_ranks(results)
    assert_params_close(results[0]["params"], reference[0])


def memory_rank() -> dict:
    model = make_model(seed=0, hidden=61)
    opt = build(model, "adamw", sync_every=2, sync_delay=2, outer_optimizer=NESTEROV, **ESTIMATE)
    for t in range(3):
        inner_step(opt, model, t, this_rank(), False)
    sizes = opt.buffer_bytes()[0]
    padded = opt.shard_plans[0].padded_numel
    opt.finish()
    return {"sizes": sizes, "padded": padded}


def test_memory_is_keeps_plus_one_copy(ranks) -> None:
    """Beyond "keep": one model-size copy of y (param dtype; an outer step with momentum: with
    plain averaging y is the global values); the start each replica's round began from is
    "keep"'s handed_over buffer; the outer state stays 1/R."""
    for result in ranks(2).run(memory_rank):
        sizes, padded = result["sizes"], result["padded"]
        assert sizes["common_term"] == sizes["handed_over"] == sizes["global_values"] == 4 * padded
        assert sizes["master"] == 4 * padded // 2


def bad(**options) -> None:
    AccoOptimizer(make_model(), torch.optim.AdamW, mode="local", lr=1e-3, **options)


@pytest.mark.parametrize("options,message", [
    ({"overlap": "estimate", "outer_optimizer": functools.partial(torch.optim.Adam, lr=0.1)},
     "overlap='estimate' needs an outer optimizer whose step is linear in its gradient .* got Adam"),
    ({"overlap": "estimate", "outer_optimizer": functools.partial(torch.optim.SGD, lr=0.5, momentum=0.5, dampening=0.1)},
     "dampening=0.1"),
    ({"overlap": "estimate", "outer_optimizer": functools.partial(torch.optim.SGD, lr=0.5, maximize=True)},
     "maximize=True"),
])
def test_a_nonlinear_outer_optimizer_is_refused_before_any_collective(options, message) -> None:
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=message):
        bad(**options)


def test_the_split_is_torchs_sgd_step() -> None:
    """common(x, m) - coefficient * g is torch's SGD step, with and without Nesterov, momentum
    and weight decay, on a step with momentum already held."""
    from acco.outer_step import LinearOuterStep

    torch.manual_seed(0)
    for kwargs in ({"momentum": 0.9, "nesterov": True}, {"momentum": 0.5}, {}, {"momentum": 0.7, "nesterov": True,
                                                                              "weight_decay": 0.1}):
        x = torch.randn(10, requires_grad=True)
        opt = torch.optim.SGD([x], lr=0.6, **kwargs)
        x.grad = torch.randn(10)
        opt.step()  # momentum now held
        split = LinearOuterStep.of(opt)
        before, grad = x.detach().clone(), torch.randn(10)
        momentum = opt.state[x].get("momentum_buffer")
        common = torch.empty(10)
        split.common(common, before, [momentum], [common])
        x.grad = grad
        opt.step()
        torch.testing.assert_close(common - split.coefficient * grad, x.detach(), rtol=1e-6, atol=1e-6)
