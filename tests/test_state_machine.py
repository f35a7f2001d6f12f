"""Random sequences of calls: each behaves as documented or raises a documented error,
never hangs, and leaves every rank with the same parameters and the same committed counts.

What two ranks must agree on: each call's outcome (what it returned or raised), the
parameters and ``num_updates`` / ``skipped_updates``. Not ``ready()``'s answer: it says
whether this rank's comm lane has finished the round in flight, which depends on each
rank's own lane timing (docs/loops.md), so the outcome records only that it answered."""

from __future__ import annotations

import datetime

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from acco import AccoOptimizer, CommLaneError
from tests.helpers import assert_params_equal, this_rank
from tests.reference import loss_fn, make_model, micro_batch, params_of

pytestmark = pytest.mark.timeout(240)
SEQUENCE_TIMEOUT = datetime.timedelta(seconds=10)
OPERATIONS = ["accumulate", "accumulate", "accumulate_nothing", "step", "step", "ready", "state_dict", "reload",
              "finish"]


class Driver:
    """Runs one sequence of calls and records what each did, checking the documented rules."""

    def __init__(self, mode: str, layout: str) -> None:
        self.mode, self.layout = mode, layout
        self.rank = this_rank()
        self.model, self.opt = self._build()
        self.saved: tuple[dict, dict] | None = None
        self.finished = self.failed = False
        self.accumulated = 0  # this round
        self.rounds = 0
        self.counter = 0

    def _build(self):
        model = make_model()
        # Shorter than tests.helpers.TIMEOUT: a hang fails one example in seconds, well
        # inside the pool's 60 s wait for the whole sequence.
        opt = AccoOptimizer(model, torch.optim.AdamW, mode=self.mode, layout=self.layout, lr=1e-2,
                            timeout=SEQUENCE_TIMEOUT)
        return model, opt

    def run(self, operation: str) -> str:
        if operation == "reload" and (self.saved is None or self.finished or self.failed):
            return "skipped"
        try:
            outcome = getattr(self, operation)()
        except CommLaneError as error:
            assert "total weight over all ranks is 0" in str(error), error
            self.failed = True
            return "CommLaneError"
        except RuntimeError as error:
            message = str(error)
            if self.failed:
                assert "after the comm lane failed" in message, message
            elif self.finished:
                assert "after finish" in message, message
            else:
                documented = ("no gradient", "before any accumulate", "fresh optimizer")
                assert any(d in message for d in documented), message
            return "RuntimeError"
        assert not self.finished or operation in ("ready", "finish"), f"{operation} worked after finish()"
        return f"ok:{outcome}"

    def accumulate(self) -> None:
        self.counter += 1
        loss_fn(self.model, *micro_batch(self.rounds, self.rank, self.counter)).backward()
        self.opt.accumulate()
        self.accumulated += 1

    def accumulate_nothing(self) -> None:
        self.opt.accumulate()  # no backward: documented RuntimeError

    def step(self) -> bool:
        committed = self.opt.step()
        self.rounds += 1
        self.accumulated = 0
        return committed

    def ready(self) -> str:
        answer = self.opt.ready()
        assert isinstance(answer, bool)
        if self.opt.in_flight is None:
            assert answer, "ready() is False with nothing in flight"
        return "answered"  # True or False per rank: this rank's lane timing

    def state_dict(self) -> None:
        state = self.opt.state_dict()
        self.saved = ({k: v.clone() for k, v in self.model.state_dict().items()}, state)

    def reload(self) -> None:
        """Load the last saved state into a fresh model and optimizer, and go on with those."""
        self.opt.close()
        self.model, self.opt = self._build()
        self.model.load_state_dict(self.saved[0])
        self.opt.load_state_dict(self.saved[1])
        return None

    def finish(self) -> bool:
        was_finished = self.finished
        try:
            return self.opt.finish()
        finally:
            self.finished = True
            if was_finished:
                assert self.opt.finish() is False

    def close(self) -> dict:
        if not self.finished:
            self.opt.close()
        params = params_of(self.model)
        assert all(torch.isfinite(v).all() for v in params.values())
        return params


def run_sequence(mode: str, layout: str, operations: list[str]) -> dict:
    driver = Driver(mode, layout)
    outcomes = [driver.run(op) for op in operations]
    counts = (driver.opt.num_updates, driver.opt.skipped_updates)
    return {"outcomes": outcomes, "params": driver.close(), "counts": counts}


sequences = st.lists(st.sampled_from(OPERATIONS), min_size=1, max_size=14)
configs = st.sampled_from([("acco", "flat"), ("dpu", "tensor"), ("sync", "flat"), ("acco", "tensor")])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, operations=sequences)
def test_random_calls_on_one_rank(config, operations) -> None:
    """Random call sequences on one rank: each call works as documented or raises a documented error,
    and the parameters stay finite."""
    run_sequence(*config, operations)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(config=configs, operations=sequences)
def test_random_calls_on_two_ranks(ranks, config, operations) -> None:
    """The same sequence on two ranks gives the same outcomes, identical parameters and the same
    committed counts on both, without a hang (``ready()``'s answers are per rank)."""
    first, second = ranks(2).run(run_sequence, *config, operations, timeout=60)
    assert first["outcomes"] == second["outcomes"]
    assert first["counts"] == second["counts"]
    assert_params_equal(second["params"], first["params"])
