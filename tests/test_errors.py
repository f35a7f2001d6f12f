"""Bad input is a clear error before any collective; failures reach every rank."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn

from acco import AccoOptimizer, CommLaneError
from tests.reference import loss_fn, make_model, micro_batch

pytestmark = pytest.mark.timeout(120)
TIMEOUT = datetime.timedelta(seconds=20)


class ExplodingSGD(torch.optim.SGD):
    def step(self, closure=None):
        raise FloatingPointError("injected failure in the base optimizer")


BAD_ARGUMENTS = [
    (dict(optimizer_class=nn.Linear), TypeError, "torch.optim.Optimizer subclass"),
    (dict(optimizer_class=lambda params: None), TypeError, "torch.optim.Optimizer subclass"),
    (dict(optimizer_class=torch.optim.LBFGS), ValueError, "closure"),
    (dict(mode="fast"), ValueError, "Invalid mode: 'fast'"),
    (dict(layout="rows"), ValueError, "Invalid layout: 'rows'"),
    (dict(optimizer_class=torch.optim.Muon, layout="flat"), ValueError, "layout='tensor'"),
    (dict(lr=-1.0), ValueError, "Invalid learning rate: -1.0"),
    (dict(timeout=5), ValueError, "Invalid timeout"),
    (dict(params=[]), ValueError, "empty parameter list"),
    (dict(params=torch.zeros(3, requires_grad=True)), TypeError, "single Tensor"),
    (dict(params=[{"params": [torch.zeros(3)]}]), ValueError, "no parameter with requires_grad"),
    (dict(params=[torch.zeros(2, requires_grad=True), torch.zeros(2, dtype=torch.float64, requires_grad=True)]),
     ValueError, "mixes dtypes"),
]


def construct(**overrides):
    arguments = {"params": make_model(), "optimizer_class": torch.optim.AdamW, "lr": 1e-3, "timeout": TIMEOUT}
    arguments.update(overrides)
    return AccoOptimizer(arguments.pop("params"), arguments.pop("optimizer_class"), **arguments)


@pytest.mark.parametrize("overrides, error, message", BAD_ARGUMENTS)
def test_bad_arguments_raise_clear_errors(overrides, error, message):
    with pytest.raises(error, match=message):
        construct(**overrides)


def bad_arguments_then_training() -> float:
    """Every bad argument raises on every rank; the group is then still usable."""
    for overrides, error, _ in BAD_ARGUMENTS:
        try:
            construct(**overrides)
        except error:
            pass
        else:
            raise AssertionError(f"{overrides} did not raise")
    check = torch.ones(1)
    dist.all_reduce(check)  # a collective consumed by a failed construction would hang here
    model = make_model()
    opt = construct(params=model, mode="sync")
    loss_fn(model, *micro_batch(0, dist.get_rank(), 0)).backward()
    opt.accumulate()
    assert opt.step()
    return float(check)


def test_bad_arguments_run_no_collective(ranks):
    assert ranks(2).run(bad_arguments_then_training) == [2.0, 2.0]


def mismatched_models() -> str:
    model = nn.Linear(5, 7 + dist.get_rank())
    try:
        AccoOptimizer(model, torch.optim.AdamW, timeout=TIMEOUT)
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_model_that_differs_across_ranks_fails_on_every_rank(ranks):
    for message in ranks(2).run(mismatched_models):
        assert "differs across ranks" in message


def step_without_accumulate(mode: str) -> str:
    model = make_model()
    opt = construct(params=model, mode=mode)
    loss_fn(model, *micro_batch(0, 0, 0)).backward()
    opt.accumulate()
    opt.step()
    try:
        opt.step()  # a round in which no rank accumulated anything
        opt.step()
        opt.finish()
    except CommLaneError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("mode", ["sync", "dpu"])
def test_a_round_with_zero_total_weight_fails_on_every_rank(ranks, mode):
    for message in ranks(2).run(step_without_accumulate, mode):
        assert "total weight over all ranks is 0" in message


def lane_failure() -> list[str]:
    model = make_model()
    opt = AccoOptimizer(model, ExplodingSGD, mode="dpu", lr=0.1, timeout=TIMEOUT)
    loss_fn(model, *micro_batch(0, 0, 0)).backward()
    opt.accumulate()
    opt.step()  # launches the round that fails on the lane
    messages = []
    for call in (opt.step, opt.step, opt.finish):
        try:
            call()
        except RuntimeError as error:
            messages.append(f"{type(error).__name__}: {error}")
    return messages


def test_an_exception_on_the_lane_surfaces_at_the_next_call(ranks):
    for messages in ranks(2).run(lane_failure):
        assert messages[0].startswith("CommLaneError: commit round 0 failed on the comm lane during update")
        assert "injected failure" in messages[0]
        assert all("after the comm lane failed" in m for m in messages[1:])


def test_misuse_of_the_compute_lane_is_reported_at_the_call():
    model = make_model()
    opt = construct(params=model, mode="acco")
    with pytest.raises(RuntimeError, match="no gradient"):
        opt.accumulate()
    with pytest.raises(RuntimeError, match="before any accumulate"):
        opt.step()
    loss_fn(model, *micro_batch(0, 0, 0)).backward()
    for bad in (-1.0, float("nan"), float("inf"), "2", True):
        with pytest.raises(ValueError, match="Invalid weight"):
            opt.accumulate(bad)
    opt.accumulate(3)
    with pytest.raises(TypeError, match="closure"):
        opt.step(lambda: 0.0)
    with pytest.raises(RuntimeError, match="add_param_group"):
        opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})
    opt.step()
    assert opt.finish() is False  # an estimate round in flight is dropped
    assert opt.finish() is False  # idempotent
    with pytest.raises(RuntimeError, match="after finish"):
        opt.step()
    with pytest.raises(RuntimeError, match="after finish"):
        opt.accumulate()
