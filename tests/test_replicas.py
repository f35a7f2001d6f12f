"""mode="local" with replicas of different speeds, on real gloo ranks: each replica takes its own
number of inner steps per outer round (``pacing``), its pseudo-gradient weighed by the weights it
trained on (``outer_weighting``), and every replica stops at the same round (``should_stop``).

Reference (tests/reference.py, ``local_reference`` with ``None`` for a step a replica does not
take): blocking rounds over replicas that took 3 and 2 (or 3, 1 and 2) steps, the mean weighed as
docs/design.md, "Replicas of different speeds", says.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from acco import AccoOptimizer
from acco.options import LocalOptions, Mode
from acco.replicas import Pacing, ReplicaReport
from tests.helpers import TIMEOUT, assert_identical_across_ranks, assert_params_close, assert_params_equal, this_rank
from tests.reference import OPTIMIZERS, local_reference, loss_fn, make_model, params_of
from tests.test_local import MAX_NORM, build, inner_step, run_rank, step_data

pytestmark = pytest.mark.timeout(150)
# The slow replica's sleep per inner step: every step-to-step time it reports holds one, so its
# reported pace is above it whatever the load; a fast step of the test's model takes a few ms.
SLOW_STEP_S = 0.1


def paced_rank(options: dict, budget: int, sleep: dict | None = None) -> dict:
    """A loop that stops on ``should_stop`` (``stop_after(steps=budget)``); rank r sleeps
    ``sleep[r]`` seconds per inner step (a slower device). ``planned``: the plan in force once
    n rounds had landed (``opt.replica_steps``), by n."""
    rank = this_rank()
    model = make_model(seed=rank)
    opt = build(model, "adamw", **options)
    opt.stop_after(steps=budget)
    steps, planned = 0, {}
    while not opt.should_stop:
        if sleep:  # part of the step's compute, before step() measures it
            time.sleep(sleep.get(rank, 0.0))
        inner_step(opt, model, steps, rank, True)
        steps += 1
        planned[len(opt.round_stats)] = list(opt.replica_steps)
    opt.finish()
    return {"params": params_of(model), "steps": steps, "outer_rounds": opt.outer_rounds,
            "reports": [None if s.replicas is None else s.replicas.as_dict() for s in opt.round_stats],
            "weights": [s.global_weight for s in opt.round_stats], "replica": opt.replica,
            "plan": opt.replica_steps, "planned": planned}  # fmt: skip


def speed_plans(reports: list[dict | None], sync_every: int, sync_delay: int = 0) -> list[list[int]]:
    """The plan ``pacing="speed"`` gives after each of ``reports`` (``ReplicaReport.as_dict()``
    in landing order; None: a round without one), replayed through the library's planner
    (:class:`acco.replicas.Pacing`) from the first plan: what every replica of the run that
    reported them must have taken, whatever speeds the load let them measure."""
    replicas = len(next(report for report in reports if report is not None)["steps"])
    paced = Pacing(LocalOptions.check(Mode.LOCAL, sync_every, sync_delay, None, None, pacing="speed"))
    paced.join(0, replicas)
    paced.announce = False  # (the run's rank 0 warned when plans first differed)
    plans = []
    for report in reports:
        paced.landed(None if report is None else ReplicaReport.from_dict(report))
        plans.append(list(paced.plan))
    return plans


def paced_expected(schedule: tuple[int, ...], rounds: int, **options) -> dict[str, torch.Tensor]:
    """Blocking rounds in which replica m takes ``schedule[m]`` steps (its own step count
    indexes its data), then finish()'s last round, which carries nothing."""
    every = max(schedule)
    data = [[step_data(k * own + j, m) if j < own else None for m, own in enumerate(schedule)]
            for k in range(rounds) for j in range(every)]  # fmt: skip
    init = params_of(make_model(seed=0))
    return local_reference(init, "adamw", data, sync_every=every, sync_delay=0, max_norm=MAX_NORM, paced=True,
                           **options)[0]  # fmt: skip


@pytest.mark.parametrize("schedule,weighting,bits", [
    ((3, 2), "tokens", 32), ((3, 2), "equal", 32), ((3, 2), "normalized", 32), ((3, 1, 2), "tokens", 32),
    ((3, 2), "tokens", 4),
])  # fmt: skip
def test_schedule_equals_weighted_reference(ranks, schedule, weighting, bits) -> None:
    """Replica m takes schedule[m] steps a round; the outer round's mean weighs each pseudo-
    gradient by its replica's tokens (equal, or FedNova's normalisation): the recurrence to
    1e-5 (fp32; 4 bits 1e-6). stop_after(9): the fastest asks at its launch after 6 steps, so
    every replica stops at round 3 (9 and 6 steps), and finish()'s round carries nothing."""
    options = {"sync_every": 3, "sync_delay": 0, "pacing": schedule, "outer_weighting": weighting, "outer_bits": bits}
    results = ranks(len(schedule)).run(paced_rank, options, 9)
    assert_identical_across_ranks([{"params": r["params"]} for r in results])
    assert [r["steps"] for r in results] == [3 * s for s in schedule]
    assert all(r["outer_rounds"] == 4 for r in results)  # 3, then finish()'s
    reports = results[0]["reports"]
    assert all(r["reports"] == reports for r in results)  # one report on every rank
    assert [report["steps"] for report in reports] == [list(schedule)] * 3 + [[0] * len(schedule)]
    assert reports[2]["stop"] == [True] + [False] * (len(schedule) - 1) and reports[3]["finishing"] == [True] * len(schedule)
    tolerance = 1e-6 if bits == 4 else 1e-5
    expected = paced_expected(schedule, 3, weighting=weighting, outer_bits=bits)
    assert_params_close(results[0]["params"], expected, rtol=tolerance, atol=tolerance)


def test_weighting_changes_the_round(ranks) -> None:
    """The references themselves: token weighting, equal weighting and FedNova's give three
    different models for replicas of 3 and 2 steps (so the test above tells them apart)."""
    models = [paced_expected((3, 2), 3, weighting=w) for w in ("tokens", "equal", "normalized")]
    for i in range(3):
        for j in range(i + 1, 3):
            assert not torch.allclose(models[i]["0.weight"], models[j]["0.weight"], atol=1e-4)


@pytest.mark.parametrize("bits", [32, 4])
def test_equal_schedule_is_lockstep_bit_for_bit(ranks, bits) -> None:
    """An explicit schedule giving both replicas sync_every steps is the lockstep run bit for bit
    (unequal token weights included), a partial last round at finish() too."""
    common = {"sync_every": 3, "sync_delay": 0, "outer_bits": bits}
    scheduled = ranks(2).run(run_rank, 8, "adamw", "flat", True, {**common, "pacing": [3, 3]})
    lockstep = ranks(2).run(run_rank, 8, "adamw", "flat", True, {**common, "pacing": "lockstep"})
    for a, b in zip(scheduled, lockstep):
        assert_params_equal(a["params"], b["params"])
        assert a["outer_rounds"] == b["outer_rounds"] == 3


def test_speed_pacing_follows_a_slow_replica(ranks) -> None:
    """pacing="speed" (the default): rank 1 sleeps SLOW_STEP_S a step, rank 0 none. The first
    round is lockstep (sync_every each: nothing measured yet); after each landed round both
    replicas take the plan the library's planner derives from the paces the replicas reported
    in this run (a replayed :class:`Pacing`), whatever the load made of those paces; the slow
    replica's reported pace holds its sleep, and the plans pace it below sync_every. Every rank
    derives the same plans from the same reports, each replica's inner steps are the steps its
    hand-overs reported, and the replicas stop at the same round and end identical."""
    options = {"sync_every": 6, "sync_delay": 0, "pacing": "speed"}
    results = ranks(2).run(paced_rank, options, 36, {1: SLOW_STEP_S})
    assert_identical_across_ranks([{"params": r["params"]} for r in results])
    assert results[0]["reports"] == results[1]["reports"] and results[0]["outer_rounds"] == results[1]["outer_rounds"]
    reports = results[0]["reports"]
    assert reports[0]["steps"] == [6, 6], reports[0]
    # The mechanism: on every rank, the plan in force once n rounds had landed is the planner's on
    # the first n reports.
    replayed = [[6, 6]] + speed_plans(reports, sync_every=6)
    for result in results:
        assert all(plan == replayed[n] for n, plan in result["planned"].items()), (result["planned"], replayed, reports)
    # A genuinely slow replica: its sleep is in each of the step times its pace is measured over,
    # and the plans took it below sync_every; the fast one kept sync_every.
    seconds = [report["step_seconds"] for report in reports]
    assert all(slow > SLOW_STEP_S for _, slow in seconds), seconds
    planned = list(results[0]["planned"].values())
    assert any(slow < 6 for _, slow in planned) and all(fast == 6 for fast, _ in planned), planned
    # Each replica's inner steps are the steps its hand-overs reported (the last round's too); the
    # fast one asked to stop (stop_after), and one round followed, in which a replica finished (its
    # finish()'s, or the fast one's regular round if it had stepped on a whole plan meanwhile).
    assert [r["steps"] for r in results] == [sum(report["steps"][m] for report in reports) for m in range(2)]
    asked = next(n for n, report in enumerate(reports) if any(report["stop"]))
    assert reports[asked]["stop"][0] and asked == len(reports) - 2 and any(reports[-1]["finishing"]), reports


def peer_finished_rank(options: dict) -> dict:
    """Rank 0 takes 3 steps and finishes; rank 1 (one step a round) runs a fixed loop of 3."""
    rank = this_rank()
    model = make_model(seed=rank)
    opt = build(model, "adamw", **options)
    error = None
    for t in range(3):
        try:
            inner_step(opt, model, t, rank, True)
        except RuntimeError as raised:
            error = str(raised)
            break
    opt.finish()
    return {"params": params_of(model), "error": error, "should_stop": opt.should_stop}


def test_a_replica_that_finishes_stops_the_others(ranks) -> None:
    """finish() on a replica ends the run: its last round is the others' regular one, after
    which should_stop is True there and step() raises, naming what to do; the others' finish()
    runs no further round and every replica ends at the same global values (no hang)."""
    results = ranks(2).run(peer_finished_rank, {"sync_every": 3, "sync_delay": 0, "pacing": [3, 1]})
    assert results[0]["error"] is None
    assert "opt.should_stop" in results[1]["error"] and "finish()" in results[1]["error"]
    assert results[1]["should_stop"]
    assert_identical_across_ranks([{"params": r["params"]} for r in results])


def resume_paced_rank(options: dict, budget: int, save_at: list[int]) -> dict:
    """Straight to the stop, and again saving this rank's state_dict() after ``save_at[rank]``
    inner steps (each replica its own count) into a new model and optimizer."""
    rank = this_rank()

    def run(opt, model, steps, until):
        while not opt.should_stop and steps < until:
            inner_step(opt, model, steps, rank, True)
            steps += 1
        return steps

    straight = make_model(seed=rank)
    opt = build(straight, "adamw", **options)
    opt.stop_after(steps=budget)
    run(opt, straight, 0, 10**9)
    opt.finish()

    first = make_model(seed=rank)
    opt = build(first, "adamw", **options)
    opt.stop_after(steps=budget)
    steps = run(opt, first, 0, save_at[rank])
    saved, model_state = opt.state_dict(), {k: v.clone() for k, v in first.state_dict().items()}
    in_flight = opt.in_flight is not None
    opt.close()
    resumed = make_model(seed=100 + rank)
    resumed.load_state_dict(model_state)
    opt = build(resumed, "adamw", **options)
    opt.load_state_dict(saved)
    run(opt, resumed, steps, 10**9)
    opt.finish()
    return {"straight": params_of(straight), "resumed": params_of(resumed), "saved_at": steps, "in_flight": in_flight}


@pytest.mark.parametrize("delay,bits", [(0, 4), (1, 32)])
def test_resume_with_a_schedule_is_exact(ranks, delay, bits) -> None:
    """Each replica saves at its second launch (6 and 4 steps; with sync_delay 1 the round in
    flight) and resumes in a new optimizer: bit for bit the run that did not stop, the stop
    budget and the plan included."""
    options = {"sync_every": 3, "sync_delay": delay, "pacing": (3, 2), "outer_bits": bits,
               "overlap": "keep" if delay else "estimate"}  # fmt: skip
    results = ranks(2).run(resume_paced_rank, options, 12, [6, 4])
    assert [r["saved_at"] for r in results] == [6, 4]
    assert all(r["in_flight"] == bool(delay) for r in results)
    for result in results:
        assert_params_equal(result["resumed"], result["straight"])
    assert_identical_across_ranks([{"params": r["straight"]} for r in results])


def mesh_paced_rank(inner: str) -> dict:
    """A 2 x 2 mesh (FSDP2 or TP inside each replica group): replica group 0 takes 3 steps a
    round, group 1 takes 2, both stop at round 3."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests.test_mesh import build as build_inner, data_of, full_params

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = build_inner(inner, mesh)
    cls, hp = OPTIMIZERS["adamw"]
    opt = AccoOptimizer(model, cls, process_group=mesh["replicate"].get_group(), mode="local", sync_every=3,
                        sync_delay=0, max_grad_norm=MAX_NORM, timeout=TIMEOUT, pacing=(3, 2), outer_bits=32, **hp)
    opt.stop_after(steps=9)
    t = 0
    while not opt.should_stop:
        for i in range(2):
            loss_fn(model, *data_of(inner, t, dist.get_rank(), i, False)[:2]).backward()
            opt.accumulate()
        opt.step()
        t += 1
    opt.finish()
    return {"params": full_params(model), "steps": t, "replica": opt.replica}


@pytest.mark.parametrize("inner", ["fsdp", "tp"])
def test_schedule_on_a_mesh(ranks, inner) -> None:
    """A replica group runs as one replica (all its ranks take its steps): the weighted
    recurrence of two replicas, each fed its ranks' micro-batches, to 1e-5 on all 4 ranks."""
    from tests.test_mesh import data_of, hidden_of

    results = ranks(4).run(mesh_paced_rank, inner)
    assert [r["replica"] for r in results] == [0, 0, 1, 1]
    assert [r["steps"] for r in results] == [9, 9, 6, 6]
    assert_identical_across_ranks(results)
    sources = (lambda m: [2 * m]) if inner == "tp" else (lambda m: [2 * m, 2 * m + 1])
    schedule = (3, 2)
    data = [[[(x, y, 1.0) for x, y, _ in (data_of(inner, k * own + j, rank, i, False) for rank in sources(m)
                                           for i in range(2))] if j < own else None
             for m, own in enumerate(schedule)] for k in range(3) for j in range(3)]  # fmt: skip
    init = params_of(make_model(hidden=hidden_of(inner)))
    expected = local_reference(init, "adamw", data, sync_every=3, sync_delay=0, max_norm=MAX_NORM, paced=True)[0]
    assert_params_close(results[0]["params"], expected)


def test_stop_is_local_mode_only_and_checked() -> None:
    """request_stop() / stop_after() name the mode they need; a budget must be positive; a
    schedule must give the fastest replica sync_every and be as long as there are replicas."""
    opt = AccoOptimizer(make_model(), torch.optim.AdamW, mode="sync", lr=1e-3)
    with pytest.raises(RuntimeError, match="mode='local' only"):
        opt.request_stop()
    assert not opt.should_stop and opt.replica_steps == []
    local = AccoOptimizer(make_model(), torch.optim.AdamW, mode="local", sync_every=4, lr=1e-3)
    with pytest.raises(ValueError, match="Invalid steps"):
        local.stop_after(steps=0)
    with pytest.raises(ValueError, match="Invalid seconds"):
        local.stop_after(seconds=-1)
    assert local.replica_steps == [4] and local.options.local.pacing == "speed"  # sync_every first (lockstep)
    with pytest.raises(ValueError, match="the fastest replica takes sync_every=4"):
        AccoOptimizer(make_model(), torch.optim.AdamW, mode="local", sync_every=4, pacing=[3], lr=1e-3)
    with pytest.raises(ValueError, match="Invalid pacing"):
        AccoOptimizer(make_model(), torch.optim.AdamW, mode="local", sync_every=4, pacing=[4, 0], lr=1e-3)
    with pytest.raises(ValueError, match="gives 2 replicas' inner steps, and there are 1"):
        AccoOptimizer(make_model(), torch.optim.AdamW, mode="local", sync_every=4, pacing=[4, 2], lr=1e-3)
    with pytest.raises(ValueError, match="outer_weighting"):
        AccoOptimizer(make_model(), torch.optim.AdamW, mode="local", outer_weighting="loss", lr=1e-3)


def resume_speed_rank(sleep: dict) -> dict:
    """pacing="speed" with rank 1 slower: save each replica's state after 3 landed rounds,
    load it into a new optimizer, and train on to stop_after's budget."""
    rank = this_rank()
    options = {"sync_every": 6, "sync_delay": 0, "pacing": "speed"}
    model = make_model(seed=rank)
    opt = build(model, "adamw", **options)
    opt.stop_after(steps=60)
    steps = 0
    while opt.outer_rounds < 3:
        time.sleep(sleep.get(rank, 0.0))
        inner_step(opt, model, steps, rank, True)
        steps += 1
    saved, plan = opt.state_dict(), opt.replica_steps
    model_state = {k: v.clone() for k, v in model.state_dict().items()}
    opt.close()
    model = make_model(seed=100 + rank)
    model.load_state_dict(model_state)
    opt = build(model, "adamw", **options)
    opt.load_state_dict(saved)
    loaded_plan, loaded_budget = opt.replica_steps, _find(opt.state_dict(), "stop_steps")
    while not opt.should_stop:
        time.sleep(sleep.get(rank, 0.0))
        inner_step(opt, model, steps, rank, True)
        steps += 1
    opt.finish()
    return {"params": params_of(model), "plan": plan, "loaded_plan": loaded_plan, "steps": steps,
            "outer_rounds": opt.outer_rounds, "loaded_budget": loaded_budget}


def _find(state: Any, key: str) -> Any:
    """``key``'s value anywhere in a nested state dict (None: absent)."""
    if isinstance(state, dict):
        if key in state:
            return state[key]
        for value in state.values():
            found = _find(value, key)
            if found is not None:
                return found
    return None


def test_speed_pacing_resumes_with_its_plan(ranks) -> None:
    """What "speed" guarantees on resume: the saved plan (the same on every replica) is the
    loaded one, the stop budget survives the load, and the replicas go on pacing, stop at the
    same round and end identical; the pace itself is measured again (wall clock). (How far past
    the budget the fast replica ends depends on the load: it steps on while it waits for the
    slow one's hand-over, and those steps count in the round that stops.)"""
    results = ranks(2).run(resume_speed_rank, {1: SLOW_STEP_S})
    assert results[0]["plan"] == results[1]["plan"] == results[0]["loaded_plan"] == results[1]["loaded_plan"]
    assert results[0]["plan"][0] == 6 and results[0]["plan"][1] <= 2
    assert results[0]["outer_rounds"] == results[1]["outer_rounds"]
    assert results[0]["loaded_budget"] == results[1]["loaded_budget"] == 60
    assert results[1]["steps"] < results[0]["steps"] // 2
    assert_identical_across_ranks([{"params": r["params"]} for r in results])
