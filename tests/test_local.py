"""mode="local" on real gloo ranks: inner steps on each replica, outer rounds across replicas.

References (tests/reference.py, ``local_reference``, written from docs/design.md "Local
steps"): each replica its own model and inner optimizer on its own data, the outer optimizer
on a whole one-process copy of the snapshot. ``sync_delay=0`` is blocking DiLoCo.
"""

from __future__ import annotations

import functools
import logging
import threading

import pytest
import torch
import torch.distributed as dist

from acco import AccoOptimizer
from tests.helpers import TIMEOUT, assert_identical_across_ranks, assert_params_close, assert_params_equal, this_rank
from tests.reference import OPTIMIZERS, local_reference, loss_fn, make_model, micro_batch, params_of

pytestmark = pytest.mark.timeout(120)

H = 3
MAX_NORM = 0.5
# The tests held to the fp32 recurrence send fp32 (the default, 4 bits: tests/test_outer_bits.py);
# the others run the default.
FP32 = {"outer_bits": 32}
# The tests of the outer state's sharding need an outer optimizer with state (the default has none).
NESTEROV = {"outer_optimizer": functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)}


def step_data(step: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """Replica ``rank``'s micro-batches of inner step ``step``: 1 to 3 of them, 1 to 6 samples
    each, the weight being the sample count (unequal across replicas and steps)."""
    out = []
    for index in range(1 + (step + rank) % 3):
        size = 1 + (7 * step + 3 * rank + index) % 6
        x, y = micro_batch(step, rank, index, size=size)
        out.append((x, y, float(size)))
    return out


def build(model: torch.nn.Module, optimizer: str, **options) -> AccoOptimizer:
    """The tests held to a recurrence run replicas in lockstep unless they say otherwise: the
    default pacing follows measured speeds (tests/test_replicas.py)."""
    cls, hp = OPTIMIZERS[optimizer]
    options.setdefault("pacing", "lockstep")
    return AccoOptimizer(model, cls, mode="local", timeout=TIMEOUT, max_grad_norm=MAX_NORM, **options, **hp)


def inner_step(opt: AccoOptimizer, model: torch.nn.Module, step: int, rank: int, weighted: bool) -> bool:
    for x, y, w in step_data(step, rank):
        if weighted:
            with opt.micro_batch(weight=w):
                loss_fn(model, x, y).backward()
        else:
            loss_fn(model, x, y).backward()
            opt.accumulate(w)
    return opt.step()


def run_rank(steps: int, optimizer: str, layout: str, weighted: bool, options: dict) -> dict:
    """One replica's loop; every rank starts from different parameters (rank 0's are broadcast).
    Records the parameters each time an outer round lands."""
    rank = this_rank()
    model = make_model(seed=rank)
    opt = build(model, optimizer, layout=layout, **options)
    landed, updates = [], []
    for t in range(steps):
        before = opt.outer_rounds
        updates.append(inner_step(opt, model, t, rank, weighted))
        if opt.outer_rounds != before:
            landed.append(params_of(model))
    opt.finish()
    return {"params": params_of(model), "landed": landed, "updates": updates, "num_updates": opt.num_updates,
            "outer_rounds": opt.outer_rounds, "kinds": [s.kind.value for s in opt.round_stats],
            "replicas": [s.update_weight for s in opt.round_stats]}


def expected(world_size: int, steps: int, optimizer: str, **options) -> list[dict[str, torch.Tensor]]:
    init = params_of(make_model(seed=0))
    data = [[step_data(t, r) for r in range(world_size)] for t in range(steps)]
    return local_reference(init, optimizer, data, max_norm=MAX_NORM, **options)


@pytest.mark.parametrize("world_size,layout,optimizer", [(2, "flat", "adamw"), (3, "tensor", "sgd"), (3, "flat", "adamw")])
def test_blocking_equals_diloco(ranks, world_size, layout, optimizer) -> None:
    """sync_delay=0 is DiLoCo: each replica its own inner optimizer on its own (weighted, clipped)
    gradients, SGD (lr 1.0, no momentum: the default) on the mean pseudo-gradient every 3 steps,
    and every replica holds the new global values after every outer round; a last round at
    finish() carries the inner steps since (8 steps: rounds after 3, 6 and at the end)."""
    steps = 8
    results = ranks(world_size).run(run_rank, steps, optimizer, layout, True, {"sync_every": H, "sync_delay": 0, **FP32})
    reference = expected(world_size, steps, optimizer, sync_every=H, sync_delay=0)
    assert_identical_across_ranks(results)
    for result in results:
        assert len(result["landed"]) == 2 and result["outer_rounds"] == 3
        assert result["updates"] == [True] * steps and result["num_updates"] == steps
        assert result["kinds"] == ["outer"] * 3 and result["replicas"] == [world_size] * 3  # each counted once
    for n in range(2):  # identical after every landed round
        assert_identical_across_ranks([{"params": r["landed"][n]} for r in results])
    assert_params_close(results[0]["params"], reference[0])


@pytest.mark.parametrize("overlap,delay", [("keep", 1), ("keep", 3), ("discard", 2), ("estimate", 3)])
def test_overlapped_rule_equals_its_recurrence(ranks, overlap, delay) -> None:
    """With sync_delay > 0 the round lands `delay` inner steps after its launch: "keep" adds what
    each replica learnt meanwhile to the new global values, "discard" drops it, "estimate" keeps
    it and started it from each replica's estimate of the outer step (a whole round in flight
    with delay 3); all equal the recurrence of docs/design.md on every rank, and every replica
    ends identical."""
    steps = 10
    results = ranks(2).run(run_rank, steps, "adamw", "flat", False, {"sync_every": H, "sync_delay": delay, "overlap": overlap, **FP32})
    reference = expected(2, steps, "adamw", sync_every=H, sync_delay=delay, overlap=overlap)
    assert_identical_across_ranks(results)
    assert_params_close(results[0]["params"], reference[0])
    if overlap == "discard":  # every replica takes the new global values
        for n in range(len(results[0]["landed"])):
            assert_identical_across_ranks([{"params": r["landed"][n]} for r in results])
    else:  # the global values are one, the progress since the launch each replica's own
        assert not torch.equal(results[0]["landed"][0]["0.weight"], results[1]["landed"][0]["0.weight"])


def test_overlapped_recurrence_differs_from_blocking() -> None:
    """The references themselves: the four rules give four different models (the tests above
    would pass vacuously otherwise)."""
    a = expected(2, 10, "adamw", sync_every=H, sync_delay=0)[0]
    b = expected(2, 10, "adamw", sync_every=H, sync_delay=2, overlap="keep")[0]
    c = expected(2, 10, "adamw", sync_every=H, sync_delay=2, overlap="discard")[0]
    d = expected(2, 10, "adamw", sync_every=H, sync_delay=2, overlap="estimate")[0]
    for one, other in ((a, b), (a, c), (b, c), (a, d), (b, d)):
        assert (one["0.weight"] - other["0.weight"]).abs().max() > 1e-3


def resume_rank(steps: int, stop: int, options: dict) -> dict:
    """Train ``steps`` inner steps straight, and again saving after ``stop`` steps (a round in
    flight) into a new model and optimizer that load the state and continue."""
    rank = this_rank()
    straight = make_model(seed=rank)
    opt = build(straight, "adamw", **options)
    for t in range(steps):
        inner_step(opt, straight, t, rank, False)
    opt.finish()

    first = make_model(seed=rank)
    opt = build(first, "adamw", **options)
    for t in range(stop):
        inner_step(opt, first, t, rank, False)
    in_flight = opt.in_flight is not None
    saved, model_state = opt.state_dict(), {k: v.clone() for k, v in first.state_dict().items()}
    opt.close()
    resumed = make_model(seed=100 + rank)  # other values, overwritten by the load
    resumed.load_state_dict(model_state)
    opt = build(resumed, "adamw", **options)
    opt.load_state_dict(saved)
    for t in range(stop, steps):
        inner_step(opt, resumed, t, rank, False)
    opt.finish()
    return {"straight": params_of(straight), "resumed": params_of(resumed), "in_flight": in_flight,
            "outer_rounds": opt.outer_rounds, "residuals": saved["acco"]["local"]["residuals"] is not None}


@pytest.mark.parametrize("delay,stop", [(2, 4), (0, 5)])
def test_resume_is_bit_identical(ranks, delay, stop) -> None:
    """A state saved with an outer round in flight (delay 2, after step 4 of rounds launched at 3)
    or between rounds (blocking) resumes bit for bit."""
    results = ranks(2).run(resume_rank, 9, stop, {"sync_every": H, "sync_delay": delay})
    for result in results:
        assert result["in_flight"] == (delay > 0)
        assert_params_equal(result["resumed"], result["straight"])
        assert result["outer_rounds"] == 3  # launched after 3, 6 and 9 inner steps; none left for finish()
    assert_identical_across_ranks(results, "resumed")


def memory_rank(layout: str) -> dict:
    model = make_model(seed=0, hidden=61)
    opt = build(model, "adamw", layout=layout, sync_every=2, sync_delay=1, overlap="keep", **NESTEROV)
    for t in range(3):
        inner_step(opt, model, t, this_rank(), False)
    outer = opt.outer_optimizers[0]
    outer_state = sum(v.numel() * v.element_size() for s in outer.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor) and v.dim())
    inner_state = sum(v.numel() * v.element_size() for s in opt.inner_optimizers[0].state.values()
                      for v in s.values() if isinstance(v, torch.Tensor) and v.dim())
    result = {"bytes": opt.buffer_bytes()[0], "outer_state": outer_state, "inner_state": inner_state,
              "chunk": opt.shard_plans[0].chunk, "padded": opt.shard_plans[0].padded_numel}
    opt.finish()
    return result


@pytest.mark.parametrize("world_size", [2, 3])
def test_snapshot_and_outer_state_are_sharded(ranks, world_size) -> None:
    """Per rank: the snapshot and the outer momentum are one chunk (1/R of the model, fp32), the
    inner AdamW state is the whole model (this replica's own), and acco's model-size buffers are
    the accumulator, the round's buffer, the last landed global values (for eval() at any step)
    and (overlap "keep") the parameters handed over."""
    results = ranks(world_size).run(memory_rank, "flat")
    numel = sum(p.numel() for p in make_model(hidden=61).parameters())
    for result in results:
        chunk, padded = result["chunk"], result["padded"]
        assert chunk == -(-numel // world_size) and padded == chunk * world_size
        assert result["bytes"]["master"] == 4 * chunk  # the snapshot's shard
        assert result["outer_state"] == 4 * chunk  # Nesterov momentum, the shard's only
        assert result["inner_state"] == 2 * 4 * numel  # exp_avg, exp_avg_sq of the whole replica
        sizes = result["bytes"]
        assert sizes["grad_accumulator"] == sizes["grad_handover"] == sizes["handed_over"] == 4 * padded
        assert sizes["global_values"] == sizes["outer_residual"] == 4 * padded  # the residual: 4 bits by default
        assert sizes["gathered"] == sizes["master_grad"] == sizes["estimate_copy"] == 0


def reshard_rank(directory: str, steps: int, world_size_saved: int) -> dict:
    """Save at one world size with acco.checkpoint, load at another; record the outer state."""
    import acco.checkpoint

    rank = this_rank()
    model = make_model(seed=rank)
    opt = build(model, "adamw", sync_every=H, sync_delay=1, **NESTEROV)
    if dist.get_world_size() == world_size_saved:
        for t in range(steps):
            inner_step(opt, model, t, rank, False)
        acco.checkpoint.save(directory, opt, model)
    else:
        acco.checkpoint.load(directory, opt, model)
    plan = opt.shard_plans[0]
    start, stop = plan.rank_range(rank)
    shard = {"momentum": opt.outer_optimizers[0].state[opt.outer_optimizers[0].param_groups[0]["params"][0]]
             ["momentum_buffer"].clone(), "start": start, "stop": stop}
    inner = {k: v.clone() for k, v in opt.inner_optimizers[0].state_dict()["state"][0].items()}
    out = {"shard": shard, "inner": inner, "params": params_of(model), "in_flight": opt.in_flight is not None}
    for t in range(steps, steps + 4):
        inner_step(opt, model, t, rank, False)
    opt.finish()
    out["final"] = params_of(model)
    return out


def test_reshard_two_to_three_replicas(ranks, tmp_path) -> None:
    """A checkpoint of 2 replicas (saved with a round in flight) loads on 3: the outer momentum is
    re-cut into thirds (the same whole), every new replica takes rank 0's parameters and inner
    state (docs/checkpoints.md), the round in flight lands, and the 3 replicas end identical."""
    directory = str(tmp_path / "ckpt")
    saved = ranks(2).run(reshard_rank, directory, 3, 2)
    loaded = ranks(3).run(reshard_rank, directory, 3, 2)
    whole = lambda results: torch.cat([r["shard"]["momentum"] for r in results])  # noqa: E731
    numel = sum(p.numel() for p in make_model().parameters())
    torch.testing.assert_close(whole(loaded)[:numel], whole(saved)[:numel], rtol=0, atol=0)
    for result in loaded:
        assert result["in_flight"]
        assert_params_equal(result["params"], saved[0]["params"])
        for key, value in saved[0]["inner"].items():
            assert torch.equal(result["inner"][key], value), key
    assert_identical_across_ranks(loaded, "final")


def bad(**options) -> None:
    AccoOptimizer(make_model(), torch.optim.AdamW, lr=1e-3, **options)


@pytest.mark.parametrize("options,message", [
    ({"mode": "local", "sync_every": 0}, "sync_every: 0"),
    ({"mode": "local", "sync_every": 2.5}, "sync_every: 2.5"),
    ({"mode": "local", "sync_every": 4, "sync_delay": 5}, "sync_delay: 5"),
    ({"mode": "local", "sync_delay": -1}, "sync_delay: -1"),
    ({"mode": "local", "param_dtype": torch.bfloat16}, "param_dtype"),
    ({"mode": "local", "reduce_dtype": torch.float32}, "reduce_dtype"),
    ({"mode": "local", "overlap": "blend"}, "overlap: 'blend'"),
    ({"mode": "local", "sync_every": 4, "sync_delay": 4, "overlap": "discard"}, "sync_delay: 4 with overlap='discard'"),
    ({"mode": "local", "sync_delay": "soon"}, "sync_delay: 'soon'"),
    ({"mode": "local", "outer_optimizer": 3}, "outer_optimizer"),
])
def test_bad_input_before_any_collective(options, message) -> None:
    """Each bad argument is a ValueError (or TypeError) naming it; no process group exists, so
    nothing collective ran."""
    assert not dist.is_initialized()
    with pytest.raises((ValueError, TypeError), match=message):
        bad(**options)


@pytest.mark.skipif(not hasattr(torch.optim, "Adafactor"), reason="torch without Adafactor")
def test_whole_tensor_outer_optimizer_refuses_a_flat_shard() -> None:
    """An outer optimizer that updates whole tensors cannot step a flat shard."""
    with pytest.raises(ValueError, match="Adafactor updates whole tensors"):
        bad(mode="local", outer_optimizer=functools.partial(torch.optim.Adafactor, lr=0.1), layout="flat")
    # layout=None picks whole tensors for it, which works on one process
    model = make_model()
    opt = AccoOptimizer(model, torch.optim.AdamW, mode="local", outer_optimizer=torch.optim.Adafactor, sync_every=1,
                        sync_delay=0, lr=1e-2)
    loss_fn(model, *micro_batch(0, 0, 0)).backward()
    opt.accumulate()
    opt.step()
    assert opt.outer_rounds == 1 and opt.shard_plans[0].layout.value == "tensor"
    opt.finish()


def test_one_process_is_diloco_with_one_replica() -> None:
    """Without a process group (one replica) the mode still equals the recurrence."""
    result = run_rank(7, "adamw", "flat", True, {"sync_every": H, "sync_delay": 1, "overlap": "discard", **FP32})
    assert_params_close(result["params"], expected(1, 7, "adamw", sync_every=H, sync_delay=1, overlap="discard")[0])


def mesh_rank(inner: str, steps: int, delay: int, overlap: str = "discard") -> dict:
    """mode="local" across mesh["replicate"], FSDP2 or tensor parallelism inside each replica
    group (R = S = 2): a replica is a group of 2 ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests.test_mesh import build as build_inner, data_of, full_params

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = build_inner(inner, mesh)
    cls, hp = OPTIMIZERS["adamw"]
    opt = AccoOptimizer(model, cls, process_group=mesh["replicate"].get_group(), mode="local", sync_every=H,
                        sync_delay=delay, overlap=overlap, max_grad_norm=MAX_NORM, timeout=TIMEOUT, pacing="lockstep",
                        **FP32, **hp)
    for t in range(steps):
        for i in range(2):
            loss_fn(model, *data_of(inner, t, dist.get_rank(), i, False)[:2]).backward()
            opt.accumulate()
        opt.step()
    opt.finish()
    return {"params": full_params(model), "outer_rounds": opt.outer_rounds}


@pytest.mark.parametrize("inner,delay", [("fsdp", 0), ("fsdp", 1), ("tp", 2)])
def test_mesh_equals_the_recurrence_over_replica_groups(ranks, inner, delay) -> None:
    """On a 2 x 2 mesh each replica group is one replica: its gradient is the mean over its
    ranks' micro-batches (FSDP2) or its one micro-batch stream (TP); the outer round runs across
    mesh["replicate"] on the local shards. Equal to the recurrence with 2 replicas, identical
    full parameters on all 4 ranks."""
    steps = 7
    results = ranks(4).run(mesh_rank, inner, steps, delay)
    assert_identical_across_ranks(results)
    assert_params_close(results[0]["params"], mesh_expected(inner, steps, delay, "discard"), rtol=1e-4, atol=1e-5)


def mesh_expected(inner: str, steps: int, delay: int, overlap: str) -> dict[str, torch.Tensor]:
    """The recurrence of a 2 x 2 mesh's two replica groups: each one replica fed its ranks'
    micro-batches (FSDP2) or its one stream (TP)."""
    from tests.test_mesh import data_of, hidden_of

    sources = (lambda m: [2 * m]) if inner == "tp" else (lambda m: [2 * m, 2 * m + 1])
    data = [[[data_of(inner, t, rank, i, False) for rank in sources(m) for i in range(2)] for m in range(2)]
            for t in range(steps)]
    data = [[[(x, y, 1.0) for x, y, _ in replica] for replica in step] for step in data]
    init = params_of(make_model(hidden=hidden_of(inner)))
    return local_reference(init, "adamw", data, sync_every=H, sync_delay=delay, overlap=overlap, max_norm=MAX_NORM)[0]


def test_defaults() -> None:
    """sync_every 4, sync_delay 0 (blocking), overlap "estimate" (where a delay is given), SGD
    with lr 1.0 and no momentum, 4 bits with error feedback: what measured best against
    data-parallel at equal tokens (docs/loops.md); with an outer optimizer that has no linear split the default rule is
    "discard" ("half" still means sync_every // 2); typed defaults, which other modes accept as
    passed (a configurator's)."""
    opt = AccoOptimizer(make_model(), torch.optim.AdamW, mode="local", lr=1e-3)
    local = opt.options.local
    assert (local.sync_every, local.sync_delay, local.overlap.value) == (4, 0, "estimate")
    assert (local.outer_bits, local.error_feedback) == (4, True)
    outer = opt.outer_optimizers[0].defaults
    assert (outer["lr"], outer["momentum"], outer["nesterov"]) == (1.0, 0.0, False)
    opt.finish()
    adam = AccoOptimizer(make_model(), torch.optim.AdamW, mode="local", outer_optimizer=torch.optim.Adam)
    assert adam.options.local.overlap.value == "discard" and adam.options.local.sync_delay == 0
    adam.finish()
    assert AccoOptimizer(make_model(), torch.optim.AdamW, mode="local", sync_every=1, sync_delay="half").options.local.sync_delay == 0
    same = AccoOptimizer(make_model(), torch.optim.AdamW, mode="acco", sync_every=4, sync_delay=0, overlap="estimate",
                         outer_bits=4, outer_error_feedback=True)
    assert same.options.local is None
    same.finish()


def test_repr_and_the_log_line_show_the_resolved_settings(caplog) -> None:
    """repr(opt) shows, before the param groups as torch optimizers show them, the mode and every
    resolved local setting ("half" as a count, the default overlap rule as chosen, the outer
    optimizer's hyper-parameters, error feedback as it runs, pacing and weighting); rank 0 logs
    them at construction."""
    outer = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
    with caplog.at_level(logging.INFO, logger="acco"):
        opt = AccoOptimizer(make_model(), torch.optim.AdamW, mode="local", sync_every=8, sync_delay="half",
                            outer_optimizer=outer, outer_bits=8, lr=1e-2, max_grad_norm=0.0)  # fmt: skip
    settings = ["mode: local", "max_grad_norm: None", "nonfinite: raise", "buffers: broadcast", "timeout: 0:10:00",
                "sync_every: 8", "sync_delay: 4", "overlap: estimate",
                "outer_optimizer: SGD(lr=0.7, momentum=0.9, nesterov=True, weight_decay=0)", "outer_bits: 8",
                "outer_error_feedback: True", "pacing: speed", "outer_weighting: tokens"]  # fmt: skip
    text = repr(opt)
    options = "".join(f"    {line}\n" for line in settings)
    assert text.startswith(f"AccoOptimizer (\nOptions\n{options}Parameter Group 0\n")
    assert "\n    lr: 0.01\n" in text and "\n    optimizer_class: <class 'torch.optim.adamw.AdamW'>\n" in text
    assert text.endswith("\n)")
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("acco")]
    assert logged == ["AccoOptimizer, world size 1: " + ", ".join(settings)]
    opt.finish()
    # Resolved defaults: no linear split, so "discard"; 16 bits send no residual.
    adam = AccoOptimizer(make_model(), torch.optim.AdamW, mode="local", outer_optimizer=torch.optim.Adam, outer_bits=16)
    assert "\n    overlap: discard\n" in repr(adam) and "\n    outer_error_feedback: False\n" in repr(adam)
    assert "\n    outer_optimizer: Adam(lr=0.001, betas=(0.9, 0.999), weight_decay=0)\n" in repr(adam)
    adam.finish()
    sync = AccoOptimizer(make_model(), torch.optim.AdamW, mode="sync", lr=1e-2)
    assert repr(sync).startswith("AccoOptimizer (\nOptions\n    mode: sync\n") and "sync_every" not in repr(sync)
    sync.finish()


def auto_rank(steps: int) -> dict:
    """sync_every 4, sync_delay "auto", the comm lane's all-gather held at a gate this test
    opens: rounds launch after steps 4, 8 and 12; the record says after which steps each landed."""
    rank = this_rank()
    model = make_model(seed=rank)
    opt = build(model, "adamw", sync_every=4, sync_delay="auto")
    gate = threading.Event()
    comm = opt.lane_collectives  # test hook: the comm lane's own collectives
    original = comm.all_gather

    def gated(*args, **kwargs):
        assert gate.wait(60), "the gate was never opened"
        return original(*args, **kwargs)

    comm.all_gather = gated
    landed_after = []
    for t in range(steps):
        before = opt.outer_rounds
        if t == 15:  # the third round: opened only once step 16 has begun
            threading.Timer(0.5, gate.set).start()
        inner_step(opt, model, t, rank, False)
        if opt.outer_rounds != before:
            landed_after.append(t + 1)
        if t + 1 in (5, 8):  # the first round, still held after step 5, then the second just launched
            gate.set()
            opt.state_dict()  # waits for the round in flight to finish on the lane; it lands at the next step()
        if t + 1 == 9:  # nothing in flight: the round launched after step 12 is held
            gate.clear()
    opt.finish()
    return {"landed_after": landed_after, "params": params_of(model)}


def test_auto_lands_a_round_at_the_first_step_after_it_is_done(ranks) -> None:
    """sync_delay="auto": a round held on the lane does not land (step 5); once done it lands at the
    very next step (6, and 9 for a round done right after its launch at 8); one still held
    sync_every steps after its launch lands there, step 16 waiting for it; replicas end identical."""
    results = ranks(2).run(auto_rank, 16)
    for result in results:
        assert result["landed_after"] == [6, 9, 16]
    assert_identical_across_ranks(results)


def eval_on_rank_zero(steps: int, evaluate_at: int | None) -> dict:
    """A run of ``steps`` inner steps (sync_every 3, a round in flight for 2 steps); with
    ``evaluate_at``, rank 0 alone calls eval() after that step, reads the model, and train()."""
    rank = this_rank()
    model = make_model(seed=rank)
    opt = build(model, "adamw", sync_every=H, sync_delay=2, overlap="keep")
    out: dict = {}
    for t in range(steps):
        inner_step(opt, model, t, rank, False)
        if t == evaluate_at:
            out["in_flight"] = opt.in_flight is not None
            out["global"] = [v for group in opt.global_parameters() for v in group]
            if rank == 0:
                own = params_of(model)
                opt.eval()
                opt.eval()  # idempotent
                out["evaluated"] = params_of(model)
                opt.train()
                out["restored"] = all(torch.equal(v, own[k]) for k, v in params_of(model).items())
    opt.finish()
    out["params"] = params_of(model)
    return out


def test_eval_on_one_rank_with_a_round_in_flight_gives_the_global_values_and_changes_nothing(ranks) -> None:
    """opt.eval() on rank 0 alone, while an outer round is in flight: no collective, no hang; the
    model holds the last landed global values (the same on both ranks), train() puts this
    replica's parameters back, and the run ends bit for bit as the one without eval()."""
    evaluated = ranks(2).run(eval_on_rank_zero, 8, 3)  # rounds launch after steps 3 and 6, land 2 later: one in flight after step 4
    plain = ranks(2).run(eval_on_rank_zero, 8, None)
    assert evaluated[0]["in_flight"] and evaluated[0]["restored"]
    for mine, theirs in zip(evaluated[0]["global"], evaluated[1]["global"]):
        assert torch.equal(mine, theirs)
    names = list(evaluated[0]["evaluated"])
    for name, value in zip(names, evaluated[0]["global"]):
        assert torch.equal(evaluated[0]["evaluated"][name], value), name
    for a, b in zip(evaluated, plain):
        assert_params_equal(a["params"], b["params"])


def step_after_eval() -> str:
    model = make_model()
    opt = build(model, "adamw", sync_every=H)
    inner_step(opt, model, 0, 0, False)
    opt.eval()
    loss_fn(model, *micro_batch(1, 0, 0)).backward()
    opt.accumulate()
    try:
        opt.step()
    except RuntimeError as error:
        return str(error)
    finally:
        opt.close()
    return ""


def test_a_step_between_eval_and_train_is_refused() -> None:
    assert "call opt.train() before the next forward pass" in step_after_eval()


def consolidated_local(path: str, before: int, after: int, save: bool, pending: bool, options: dict | None = None) -> dict:
    """Inner steps ``before`` .. ``before + after`` of a 2-replica run (sync_every 3, sync_delay
    2, keep: a round in flight at the save), saved by rank 0 after ``before`` steps with
    consolidate_state_dict(to=0) (``save``) or loaded from that file into fresh processes.
    ``pending``: one micro-batch of the next step is accumulated before the save; ``options``:
    the local ones (those above by default)."""
    if not save:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = make_model(seed=rank + (0 if save else 7))
    opt = build(model, "adamw", sync_every=H, **(options or {"sync_delay": 2, "overlap": "keep"}))
    data = step_data(before, rank)
    if save:
        for t in range(before):
            inner_step(opt, model, t, rank, False)
        if pending:
            x, y, w = data[0]
            loss_fn(model, x, y).backward()
            opt.accumulate(w)
        opt.consolidate_state_dict(to=0)
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
        dist.barrier()
    else:
        checkpoint = torch.load(path, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
    in_flight = opt.in_flight is not None
    for x, y, w in data[1 if pending else 0:]:
        loss_fn(model, x, y).backward()
        opt.accumulate(w)
    opt.step()
    for t in range(before + 1, before + after):
        inner_step(opt, model, t, rank, False)
    opt.finish()
    return {"params": params_of(model), "in_flight": in_flight, "updates": opt.num_updates}


@pytest.mark.parametrize("pending", [False, True])
def test_a_rank_zero_checkpoint_resumes_every_replica_exactly(ranks, tmp_path, pending) -> None:
    """consolidate_state_dict(to=0) in local mode: rank 0's file holds every replica's parameters,
    inner state, pending gradients and the round in flight; fresh processes at 2 replicas end bit
    for bit as the uninterrupted run; at 3 every new replica starts from rank 0's (the documented
    rule) and they end identical."""
    from tests.ranks import run_fresh

    path = str(tmp_path / "ckpt.pt")
    uninterrupted = ranks(2).run(consolidated_local, path, 4, 5, True, pending)
    resumed = run_fresh(consolidated_local, path, 4, 5, False, pending, world_size=2)
    assert all(r["in_flight"] for r in resumed)
    for a, b in zip(resumed, uninterrupted):
        assert a["updates"] == b["updates"] == 9
        assert_params_equal(a["params"], b["params"])
    assert_identical_across_ranks(run_fresh(consolidated_local, path, 4, 5, False, pending, world_size=3))
