"""Misuse is a clear error at the call, never a hang or a silent approximation.

- bad constructor arguments raise ``TypeError``/``ValueError`` naming the value, before any
  collective (so the process group stays usable), and a model that differs across ranks
  fails on every rank;
- wrong call order (step before accumulate, a round with no weight on any rank, calls after
  ``finish()``, a mid-run ``load_state_dict``), parameters changed under the optimizer;
- weights: a weight that does not match what backward already folded, gradients not yet
  accumulated, a torn ``micro_batch()`` block;
- ``loss.backward(); opt.step()`` without ``accumulate()``, in any round.

Failures of the comm lane itself (a failing rank, non-finite gradients, an exception in the
base optimizer) are in tests/test_robustness.py.
"""

from __future__ import annotations

import datetime
import functools
import types
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from acco import AccoOptimizer, CommLaneError
from acco.elastic import TorchFT
from tests.helpers import TIMEOUT, assert_params_equal, inside, this_rank
from tests.reference import loss_fn, make_model, micro_batch, params_of

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------- constructor arguments


ELASTIC = TorchFT(types.SimpleNamespace(), None)
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
    (dict(nonfinite="ignore"), ValueError, "Invalid nonfinite"),
    (dict(estimate_dtype="bfloat16"), TypeError, "Invalid estimate_dtype: 'bfloat16'"),
    (dict(estimate_dtype=torch.float32), ValueError, "not lighter than the reduce dtype torch.float32"),
    # Elastic replicas (acco.elastic; a TorchFT that is never asked anything: the checks come first).
    (dict(mode="local", membership=ELASTIC, pacing="lockstep", sync_delay=2), ValueError,
     "Invalid sync_delay with membership: 2"),
    (dict(mode="local", membership=ELASTIC, sync_delay=0, sync_every=5, pacing=[2, 5]), ValueError,
     r"Invalid pacing with membership: \(2, 5\)"),
    (dict(mode="local", membership=ELASTIC, pacing="lockstep", outer_bits=32), ValueError,
     "Invalid outer_bits with membership: 32"),
    (dict(mode="local", membership=ELASTIC, pacing="lockstep", timeout=datetime.timedelta(seconds=5)), ValueError,
     "quorum_timeout is 0:02:00"),
    (dict(mode="local", membership=object(), pacing="lockstep"), TypeError, "Invalid membership"),
]


def construct(**overrides: object) -> AccoOptimizer:
    """An AccoOptimizer over a fresh model with AdamW, ``overrides`` replacing any argument."""
    arguments = {"params": make_model(), "optimizer_class": torch.optim.AdamW, "lr": 1e-3, "timeout": TIMEOUT}
    arguments.update(overrides)
    return AccoOptimizer(arguments.pop("params"), arguments.pop("optimizer_class"), **arguments)


@pytest.mark.parametrize("overrides, error, message", BAD_ARGUMENTS)
def test_bad_arguments_raise_clear_errors(overrides: dict, error: type[Exception], message: str) -> None:
    """Each bad argument raises the documented exception type with the value in the message."""
    with pytest.raises(error, match=message):
        construct(**overrides)


def test_torchft_membership_refuses_an_async_quorum() -> None:
    """A heal must complete before the round's collectives: torchft's Manager in sync mode."""
    with pytest.raises(ValueError, match="use_async_quorum=False"):
        TorchFT(types.SimpleNamespace(_use_async_quorum=True), None)
    with pytest.raises(ValueError, match="Invalid start_with: 0"):
        TorchFT(types.SimpleNamespace(), None, start_with=0)


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


def test_bad_arguments_run_no_collective(ranks) -> None:
    """On 2 ranks every bad argument fails before any collective: the group still works."""
    assert ranks(2).run(bad_arguments_then_training) == [2.0, 2.0]


# A configurator's typed defaults (nanoGPT's configurator.py overrides only keys that have
# one): every mode's own arguments set, whichever mode the command line picks.
CONFIGURATOR = dict(
    max_grad_norm=0.0, sync_every=8, sync_delay="half", overlap="keep", outer_bits=8, outer_error_feedback=False,
    outer_optimizer=functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True),
    estimate_dtype=torch.bfloat16,
)


def configured_run(mode: str, config: dict) -> dict:
    """Three rounds in ``mode`` with ``config``; the parameters and the warnings about other modes."""
    rank = this_rank()
    model = make_model(seed=rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = construct(params=model, mode=mode, **config)
    for round_ in range(3):
        for index in range(2):
            loss_fn(model, *micro_batch(round_, rank, index)).backward()
            opt.accumulate()
        opt.step()
    opt.finish()
    ignored = [str(w.message) for w in caught if "ignored with mode" in str(w.message)]
    return {"params": params_of(model), "ignored": ignored, "estimate_dtype": opt.estimate_dtype}


def test_a_configurator_setting_every_key_runs_in_sync_mode(ranks) -> None:
    """mode="sync" with every local-only argument and estimate_dtype set (sync_every=8 among them):
    one UserWarning on each rank names them all, and the run equals the one without them bit for bit."""
    configured = ranks(2).run(configured_run, "sync", CONFIGURATOR)
    plain = ranks(2).run(configured_run, "sync", {})
    for rank, (run, reference) in enumerate(zip(configured, plain)):
        assert reference["ignored"] == []
        assert run["ignored"] == [
            "estimate_dtype=torch.bfloat16 only applies to mode='acco'; sync_every=8, sync_delay='half', "
            "overlap='keep', outer_optimizer=" + repr(CONFIGURATOR["outer_optimizer"]) + ", outer_bits=8, "
            "outer_error_feedback=False only apply to mode='local': ignored with mode='sync'"
        ], f"rank {rank}"
        assert run["estimate_dtype"] is None
        assert_params_equal(run["params"], reference["params"])


def test_the_configurator_in_the_other_modes_warns_about_the_rest_and_checks_its_own() -> None:
    """The same keys with mode="acco" or "local": only the other mode's are ignored (one warning);
    the chosen mode's are used, and a value wrong for it still raises."""
    with pytest.warns(UserWarning, match=r"^sync_every=8, .*outer_error_feedback=False only apply to mode='local': "
                                         r"ignored with mode='acco'$") as caught:  # fmt: skip
        acco = construct(mode="acco", **CONFIGURATOR)
    assert len([w for w in caught if "ignored with mode" in str(w.message)]) == 1
    assert acco.estimate_dtype is torch.bfloat16
    acco.finish()
    with pytest.warns(UserWarning, match=r"^estimate_dtype=torch.bfloat16 only applies to mode='acco': ignored with "
                                         r"mode='local'$"):  # fmt: skip
        local = construct(mode="local", **CONFIGURATOR)
    assert (local.options.local.sync_every, local.options.local.sync_delay, local.options.local.outer_bits) == (8, 4, 8)
    local.finish()
    with pytest.raises(ValueError, match="Invalid sync_every: 0"), pytest.warns(UserWarning, match="estimate_dtype"):
        construct(mode="local", **{**CONFIGURATOR, "sync_every": 0})
    with pytest.raises(ValueError, match="not lighter than"), pytest.warns(UserWarning, match="sync_every=8"):
        construct(mode="acco", **{**CONFIGURATOR, "estimate_dtype": torch.float32})
    with pytest.raises(ValueError, match="param_dtype"):
        construct(mode="local", param_dtype=torch.bfloat16)


def mismatched_models() -> str:
    """Each rank builds a Linear of another width: the constructor's error message."""
    model = nn.Linear(5, 7 + dist.get_rank())
    try:
        AccoOptimizer(model, torch.optim.AdamW, timeout=TIMEOUT)
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_model_that_differs_across_ranks_fails_on_every_rank(ranks) -> None:
    """Different parameter shapes on two ranks: a ValueError on both, not a hang."""
    for message in ranks(2).run(mismatched_models):
        assert "differs across ranks" in message


# ------------------------------------------------------------------ wrong call order


def step_without_accumulate(mode: str) -> str:
    """One accumulated round, then rounds with nothing accumulated: the lane's error."""
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
def test_a_round_with_zero_total_weight_fails_on_every_rank(ranks, mode: str) -> None:
    """A round in which no rank accumulated anything fails on every rank (no division by 0)."""
    for message in ranks(2).run(step_without_accumulate, mode):
        assert "total weight over all ranks is 0" in message


def test_misuse_of_the_compute_lane_is_reported_at_the_call() -> None:
    """accumulate without a gradient, step before accumulate, bad weights, a closure,
    add_param_group, and any call after finish(): each raises at the call."""
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


def test_a_mid_run_load_and_changed_parameters_are_reported_at_the_call() -> None:
    """load_state_dict mid-run, a parameter whose dtype or shape changed under the
    optimizer, and an invalid nonfinite policy: each raises at the call that meets it."""
    model = make_model()
    opt = AccoOptimizer(model, torch.optim.SGD, mode="dpu", lr=0.1)
    loss_fn(model, *micro_batch(0, 0, 0)).backward()
    opt.accumulate()
    opt.step()
    with pytest.raises(RuntimeError, match="fresh optimizer"):
        opt.load_state_dict(opt.state_dict())  # mid-run
    model[0].weight.data = model[0].weight.data.double()
    with pytest.raises(RuntimeError, match="parameter 0 of group 0 changed"):
        opt.step()
    model[0].weight.data = model[0].weight.data.float()[:, :4]
    with pytest.raises(RuntimeError, match="changed to \\(7, 4\\)"):
        opt.accumulate()
    opt.close()
    with pytest.raises(ValueError, match="Invalid nonfinite"):
        AccoOptimizer(make_model(), torch.optim.SGD, lr=0.1, nonfinite="ignore")


# ------------------------------------------------------------------------- weights


def lean_optimizer() -> tuple[nn.Module, AccoOptimizer]:
    """An acco optimizer after one equal-weight accumulate: later backwards fold into it."""
    model = make_model()
    opt = AccoOptimizer(model, torch.optim.SGD, mode="acco", lr=0.1)
    loss_fn(model, *micro_batch(0, 0, 0)).backward()
    opt.accumulate()  # no weight: equal weights, folded during backward from now on
    return model, opt


def test_a_weight_after_a_folded_backward_is_an_error() -> None:
    """A weight given after backward already folded the gradient at weight 1 is a
    ValueError (the micro-batch counts at the weight it was folded at), not a silent rescale."""
    model, opt = lean_optimizer()
    loss_fn(model, *micro_batch(0, 0, 1)).backward()
    with pytest.raises(ValueError, match=r"already folded at weight 1\.0.*micro_batch\(weight=w\)"):
        opt.accumulate(weight=3.0)
    assert opt.accumulated == (2, 2.0)  # counted at its real weight
    loss_fn(model, *micro_batch(0, 0, 2)).backward()
    opt.accumulate(weight=1.0)  # the weight it was folded at: fine
    opt.finish()


def test_a_folded_backward_cannot_be_discarded_by_zero_grad() -> None:
    """zero_grad() cannot discard a gradient already folded into the accumulator."""
    model, opt = lean_optimizer()
    loss_fn(model, *micro_batch(0, 0, 1)).backward()
    with pytest.raises(RuntimeError, match="cannot be discarded"):
        opt.zero_grad()
    opt.accumulate()
    # Nothing pending: allowed, and p.grad no longer aliases the accumulator, whose sum
    # stays: a DDP user expecting it discarded is told, once.
    with pytest.warns(UserWarning, match=r"discards nothing: the \d micro-batch\(es\) accumulated"):
        opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert opt.sharded_groups[0].grad_accumulator.abs().sum() > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.zero_grad()  # once only
        opt.step()
        loss_fn(model, *micro_batch(1, 0, 1)).backward()
        opt.accumulate()
        opt.step()
        opt.zero_grad()  # after step(), as every torch loop does: silent
    opt.finish()


def test_zero_grad_mid_round_warns_once_per_optimizer() -> None:
    model, opt = lean_optimizer()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss_fn(model, *micro_batch(0, 0, 1)).backward()
        opt.accumulate()
        opt.step()
        opt.zero_grad()
    loss_fn(model, *micro_batch(1, 0, 1)).backward()
    opt.accumulate()
    with pytest.warns(UserWarning, match="discards nothing"):
        opt.zero_grad()
    opt.finish()


def test_micro_batch_misuse_is_reported() -> None:
    """micro_batch(): invalid weights, nested blocks, accumulate() inside a block; a torn
    block then stops step()."""
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


def test_micro_batch_without_backward_or_with_pending_gradients() -> None:
    """A micro_batch() block without backward, step() inside a block, and a block opened
    over gradients not yet accumulated are errors; a proper block is counted at its weight."""
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
    assert opt.accumulated[1] == 4.0
    # After the block p.grad is the accumulator's view again (equal weights resume).
    loss_fn(model, *micro_batch(0, 0, 3)).backward()
    assert all(inside(p.grad, opt.sharded_groups[0].grad_accumulator) for p in model.parameters())
    opt.accumulate()
    opt.step()
    opt.finish()


def test_an_exception_inside_a_block_after_backward_stops_the_optimizer() -> None:
    """An exception inside a micro_batch() block after backward leaves a partial
    micro-batch: every later call refuses; before backward the optimizer stays usable."""
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


# ----------------------------------------------------- step() without accumulate()

# The other rank's lane waits this long for the rank that raised before failing.
SHORT_TIMEOUT = datetime.timedelta(seconds=3)


@pytest.mark.parametrize("mode", ["sync", "dpu", "acco"])
@pytest.mark.parametrize("weights", ["equal", "given", "reduce_dtype"])
def test_step_with_unaccumulated_gradients_raises_at_the_call_and_loses_nothing(mode, weights):
    """In a later round, whatever way the gradients reach the accumulator (views, kept
    ``p.grad``, hooks), ``step()`` names ``accumulate()``; calling it then recovers."""
    model = make_model()
    reduce_dtype = torch.float64 if weights == "reduce_dtype" else None
    opt = AccoOptimizer(model, torch.optim.SGD, mode=mode, lr=0.1, reduce_dtype=reduce_dtype)
    weight = 2.0 if weights == "given" else None
    for r in range(3):
        loss_fn(model, *micro_batch(r, 0, 0)).backward()
        opt.accumulate(weight)
        opt.step()
    loss_fn(model, *micro_batch(3, 0, 0)).backward()
    with pytest.raises(RuntimeError, match=r"step\(\): the gradients of the last backward\(\) were not accumulated"):
        opt.step()
    opt.accumulate(weight)  # the gradients are still there
    opt.step()
    opt.finish()


def unaccumulated_rank() -> str:
    model = make_model()
    opt = AccoOptimizer(model, torch.optim.SGD, mode="dpu", lr=0.1, timeout=SHORT_TIMEOUT)
    for r in range(2):
        loss_fn(model, *micro_batch(r, dist.get_rank(), 0)).backward()
        opt.accumulate()
        opt.step()
    loss_fn(model, *micro_batch(2, dist.get_rank(), 0)).backward()
    if dist.get_rank() == 1:
        opt.accumulate()
    try:
        opt.step()
        opt.step()
    except CommLaneError as error:
        return f"CommLaneError: {error}"
    except RuntimeError as error:
        return f"RuntimeError: {error}"
    finally:
        opt.close()
    return "no error"


def test_the_other_ranks_fail_within_the_timeout_instead_of_hanging(ranks):
    mistaken, other = ranks(2).run(unaccumulated_rank)
    assert mistaken.startswith("RuntimeError: step(): the gradients of the last backward()"), mistaken
    assert other.startswith("CommLaneError:"), other
