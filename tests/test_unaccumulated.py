"""``loss.backward(); opt.step()`` without ``accumulate()``: a clear error at the call, in any round."""

from __future__ import annotations

import datetime

import pytest
import torch

from acco import AccoOptimizer, CommLaneError
from tests.reference import loss_fn, make_model, micro_batch

pytestmark = pytest.mark.timeout(60)


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
    import torch.distributed as dist

    model = make_model()
    opt = AccoOptimizer(model, torch.optim.SGD, mode="dpu", lr=0.1, timeout=datetime.timedelta(seconds=3))
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
