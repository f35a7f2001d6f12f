"""``sync_every="auto"``: H chosen before each round from the measured inner step time and the
round's own time (acco.replicas.plan_sync_every), the same on every replica, saved and resumed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from acco import AccoOptimizer
from acco.options import AUTO_EVERY_BOUNDS
from acco.replicas import AUTO_HYSTERESIS, AUTO_SHARE, plan_sync_every
from tests.helpers import TIMEOUT
from tests.reference import OPTIMIZERS, make_model
from tests.test_local import inner_step

pytestmark = pytest.mark.timeout(120)

BOUNDS = (4, 128)


def test_the_plan_is_the_smallest_h_whose_round_costs_its_share() -> None:
    step, share = 0.1, AUTO_SHARE
    # Blocking: a round of 0.05 s is 5% of 10 steps of 0.1 s.
    assert plan_sync_every(30, BOUNDS, step, share * 10 * step, blocking=True) == 10
    # In flight: the round must fit behind its steps (5 steps of 0.1 s for a round of 0.45 s).
    assert plan_sync_every(30, BOUNDS, step, 0.45, blocking=False) == 5
    # The bounds.
    assert plan_sync_every(30, BOUNDS, step, 100.0, blocking=True) == BOUNDS[1]
    assert plan_sync_every(30, BOUNDS, step, 1e-6, blocking=True) == BOUNDS[0]
    # Nothing measured yet: H stays.
    assert plan_sync_every(7, BOUNDS, 0.0, 0.5, blocking=True) == 7
    assert plan_sync_every(7, BOUNDS, 0.1, 0.0, blocking=True) == 7
    # Hysteresis: a choice within AUTO_HYSTERESIS of H leaves it; one outside moves it.
    inside = int(10 * AUTO_HYSTERESIS)
    assert plan_sync_every(10, BOUNDS, step, share * inside * step, blocking=True) == 10
    assert plan_sync_every(10, BOUNDS, step, share * (inside + 1) * step, blocking=True) == inside + 1
    assert plan_sync_every(10, BOUNDS, step, share * 7 * step, blocking=True) == 7


def test_auto_is_checked_before_anything_is_built() -> None:
    model = torch.nn.Linear(2, 2)
    opt = AccoOptimizer(model, torch.optim.AdamW, mode="local", sync_every="auto")
    assert (opt.options.local.sync_every, opt.options.local.auto_every) == (AUTO_EVERY_BOUNDS[0], AUTO_EVERY_BOUNDS)
    assert "sync_every: auto (4-128, from 4)" in repr(opt)
    opt.finish()
    opt = AccoOptimizer(model, torch.optim.AdamW, mode="local", sync_every=("auto", 8, 64))
    assert (opt.options.local.sync_every, opt.options.local.auto_every) == (8, (8, 64))
    opt.finish()
    for bad in ("often", ("auto", 0, 8), ("auto", 16, 8), ("auto", 4), ("auto", 4.0, 8)):
        with pytest.raises(ValueError, match="Invalid sync_every"):
            AccoOptimizer(model, torch.optim.AdamW, mode="local", sync_every=bad)
    for options, says in ((dict(sync_delay=3), "Invalid sync_delay"), (dict(sync_delay="half"), "Invalid sync_delay"),
                          (dict(pacing=[4, 4]), "Invalid pacing")):
        with pytest.raises(ValueError, match=says):
            AccoOptimizer(model, torch.optim.AdamW, mode="local", sync_every="auto", **options)


def auto_rank(steps: int, save_at: int | None, states: list[dict] | None, delay: object) -> dict:
    """Replicas in lockstep with sync_every="auto" (bounds 2-16): each round's H, and the state
    saved after ``save_at`` inner steps (or, from ``states``, each rank's own, the H a resumed run
    starts with)."""
    rank = dist.get_rank()
    model = make_model()
    cls, hp = OPTIMIZERS["adamw"]
    opt = AccoOptimizer(model, cls, mode="local", sync_every=("auto", 2, 16), sync_delay=delay, pacing="lockstep",
                        timeout=TIMEOUT, **hp)  # fmt: skip
    if states is not None:
        opt.load_state_dict(states[rank])
    saved = None
    for step in range(steps):
        inner_step(opt, model, step, rank, weighted=False)
        if save_at is not None and step + 1 == save_at:
            saved = opt.state_dict()
    opt.finish()
    history = [(s.index, s.sync_every, None if s.replayed else list(s.replicas.steps)) for s in opt.round_stats]
    return {"history": history, "saved": saved}


@pytest.mark.parametrize("delay", [0, "auto"])
def test_every_replica_takes_the_same_h_each_round(ranks, delay) -> None:
    """The H of each round is the same on both replicas and what each replica stepped (with
    rounds landing in flight too, at different steps on each replica: the new H starts at the
    next launch); the first round runs the lower bound."""
    results = ranks(2).run(auto_rank, 60, None, None, delay)
    histories = [r["history"] for r in results]
    assert histories[0] == histories[1]
    assert histories[0][0][1] == 2
    for _, every, stepped in histories[0][:-1]:  # (the last round: finish()'s, over the steps left)
        assert 2 <= every <= 16 and stepped == [every, every]


def test_a_resume_keeps_the_h_it_had_chosen(ranks) -> None:
    """Each rank's state saved mid-run holds the H of the steps since its last launch and the
    one the next launch takes; a resumed run's first round is that H."""
    results = ranks(2).run(auto_rank, 60, 30, None, 0)
    saved = [r["saved"] for r in results]
    chosen = saved[0]["acco"]["local"]["sync_every"]
    assert 2 <= chosen <= 16 and saved[1]["acco"]["local"]["sync_every"] == chosen
    assert saved[0]["acco"]["local"]["next_every"] == saved[1]["acco"]["local"]["next_every"]
    resumed = ranks(2).run(auto_rank, 4, None, saved, 0)
    assert resumed[0]["history"] == resumed[1]["history"]
    assert resumed[0]["history"][0][1] == chosen
