"""The comm lane's device-hook contract, with fake events (runs on CPU).

On CUDA the hooks record a ticket on the training thread's stream at submit, make the side
stream wait on it, record a done event after the round and make the caller's stream wait
on it in ``result()``. Here the events are objects the test fires by hand, so the order of
those calls, and who makes them, can be checked without a GPU.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from typing import Any

import pytest
import torch

import acco.optim
from acco import AccoOptimizer
from acco.streams import CpuHooks, ThreadLane
from tests.reference import loss_fn, make_model, micro_batch

pytestmark = pytest.mark.timeout(60)


class FakeEvent:
    def __init__(self, name: str) -> None:
        self.name = name
        self.fired = threading.Event()


class FakeHooks(CpuHooks):
    """Records every hook call with the thread that made it; done events fire on demand."""

    def __init__(self, fire_at_once: bool = False) -> None:
        self.calls: list[tuple[str, Any, str]] = []
        self.dones: list[FakeEvent] = []
        self.fire_at_once = fire_at_once
        self.release_teardown = threading.Event()
        self.release_teardown.set()

    def _log(self, what: str, event: Any = None) -> None:
        self.calls.append((what, event, threading.current_thread().name))

    def thread_end(self) -> None:
        self._log("thread_end")
        self.release_teardown.wait(10)

    def ticket(self) -> FakeEvent:
        ticket = FakeEvent(f"ticket {sum(c[0] == 'ticket' for c in self.calls)}")
        self._log("ticket", ticket)
        return ticket

    def before(self, ticket: FakeEvent) -> None:
        self._log("before", ticket)

    def after(self) -> FakeEvent:
        done = FakeEvent(f"done {len(self.dones)}")
        if self.fire_at_once:
            done.fired.set()
        self.dones.append(done)
        self._log("after", done)
        return done

    def fired(self, done: FakeEvent) -> bool:
        return done.fired.is_set()

    def join(self, done: FakeEvent) -> None:
        self._log("join", done)

    def names(self, what: str) -> list[Any]:
        return [event for call, event, _ in self.calls if call == what]


def test_ticket_at_submit_before_on_the_worker_done_only_once_fired_join_after_result() -> None:
    """The ticket is recorded on the caller's thread at submit, waited on by the lane's thread; the
    future is done only once the done event fired, and result() joins it on the caller's thread."""
    hooks = FakeHooks()
    lane = ThreadLane(hooks)
    started, finish = threading.Event(), threading.Event()

    def round_() -> str:
        started.set()
        finish.wait(10)
        return "result"

    future = lane.submit(round_)
    # The ticket is recorded by the caller, at submit, before the worker runs anything.
    assert hooks.calls[0][0] == "ticket" and hooks.calls[0][2] == threading.current_thread().name
    assert started.wait(10)
    assert not future.done()
    finish.set()
    deadline = time.monotonic() + 10
    while not hooks.names("after") and time.monotonic() < deadline:
        time.sleep(0.01)
    # The worker has finished the round, but the device has not: not done yet.
    assert not future.done()
    hooks.dones[0].fired.set()
    assert future.done()
    assert hooks.names("join") == []
    assert future.result(timeout=10) == "result"
    ticket = hooks.names("ticket")[0]
    assert hooks.names("before") == [ticket]
    assert hooks.names("join") == [hooks.dones[0]]
    where = {call: thread for call, _, thread in hooks.calls}
    assert where["before"] == where["after"] == "acco-comm-lane"
    assert where["ticket"] == where["join"] == threading.current_thread().name
    lane.close(timeout=10)


def test_a_failed_round_is_never_joined_but_still_marked_done() -> None:
    """A round that raised is done whatever the device does, its error surfaces from result(), and it
    is never joined."""
    hooks = FakeHooks()
    lane = ThreadLane(hooks)

    def failing() -> None:
        raise ValueError("boom")

    future = lane.submit(failing)
    with pytest.raises(ValueError, match="boom"):
        future.result(timeout=10)
    assert future.done()  # a failure is final whatever the device does
    assert len(hooks.names("after")) == 1  # the failed round's work is still ordered
    assert hooks.names("join") == []
    lane.close(timeout=10)


def test_a_hook_failure_at_thread_start_fails_every_round_instead_of_hanging() -> None:
    """A lane whose device set-up fails raises at the first result() and stops, instead of hanging."""
    class Broken(FakeHooks):
        def thread_start(self) -> None:
            raise RuntimeError("no device")

    lane = ThreadLane(Broken())
    with pytest.raises(RuntimeError, match="could not start: no device"):
        lane.submit(lambda: 1).result(timeout=10)
    lane.close(timeout=10)
    assert not lane.alive


def test_close_never_waits_and_drops_what_it_keeps_only_after_the_worker_synchronised() -> None:
    """close() returns while the worker is still in its teardown (the device busy: it did not
    wait for it), and the tensors it keeps stay alive until the lane's thread has synchronised
    its stream."""
    hooks = FakeHooks(fire_at_once=True)
    hooks.release_teardown.clear()  # the device is still busy with the last round
    lane = ThreadLane(hooks)
    kept = torch.zeros(4)
    alive = weakref.ref(kept)
    assert lane.close(keep=[kept]) is False  # returned with the worker alive, its teardown held
    del kept
    time.sleep(0.1)
    gc.collect()
    assert alive() is not None  # the worker still holds it while its stream may read it
    assert hooks.names("thread_end") == [None]
    hooks.release_teardown.set()
    deadline = time.monotonic() + 10
    while lane.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    gc.collect()
    assert alive() is None


def test_ready_follows_the_done_event_and_step_joins_the_callers_stream(monkeypatch) -> None:
    """ready() is False until the device's done event fires, and step() joins the caller's stream to
    each round it lands, each round having waited on its hand-over ticket."""
    hooks = FakeHooks()
    monkeypatch.setattr(acco.optim, "make_lane", lambda device: ThreadLane(hooks))
    model = make_model()
    opt = AccoOptimizer(model, torch.optim.SGD, mode="dpu", lr=0.1)
    assert opt.ready()  # nothing in flight
    loss_fn(model, *micro_batch(0, 0, 0)).backward()
    opt.accumulate()
    opt.step()
    # step() recorded the ticket on this thread, after the hand-over, before returning.
    assert [c[0] for c in hooks.calls][:1] == ["ticket"] and hooks.calls[0][2] == threading.current_thread().name
    deadline = time.monotonic() + 10
    while not hooks.names("after") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hooks.names("after"), "the round never ran"
    # The worker is done, the (fake) device is not: ready() must say so, and stay so.
    for _ in range(3):
        assert not opt.ready()
        time.sleep(0.01)
    assert hooks.names("join") == []
    hooks.dones[0].fired.set()
    assert opt.ready()
    loss_fn(model, *micro_batch(1, 0, 0)).backward()
    opt.accumulate()
    assert opt.step() is True  # lands the first round: the caller joins its done event
    assert hooks.names("join") == [hooks.dones[0]]
    deadline = time.monotonic() + 10
    while len(hooks.dones) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    hooks.dones[1].fired.set()
    assert opt.finish() is True
    assert hooks.names("join") == hooks.dones[:2]
    # Each round waited on the ticket recorded when it was handed over.
    assert hooks.names("before") == hooks.names("ticket")[:2]
