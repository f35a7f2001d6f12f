"""The comm lane: where a round's reduce-scatter -> update -> all-gather runs.

On CPU it is one daemon worker thread; on CUDA it is a side stream, so a round is enqueued
without blocking the Python thread. Either way :meth:`CommLane.submit` returns a
:class:`LaneFuture` that carries the round's result or its exception back to the compute
lane, and every wait on it takes a timeout.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Generic, Protocol, TypeVar

import torch

__all__ = ["CommLane", "LaneFuture", "StreamLane", "ThreadLane", "make_lane"]

T = TypeVar("T")


class LaneFuture(Protocol[T]):
    def done(self) -> bool:
        """Whether the round has finished (successfully or not); never blocks."""

    def result(self, timeout: float) -> T:
        """The round's result; re-raises its exception; ``TimeoutError`` after ``timeout`` s."""


class CommLane(Protocol):
    def submit(self, fn: Callable[[], T]) -> LaneFuture[T]: ...

    def close(self) -> None: ...


def _work(tasks: queue.SimpleQueue) -> None:
    # Holds no reference to the optimizer, so the optimizer can be garbage collected
    # (which closes the lane) while this thread waits for work.
    while True:
        item = tasks.get()
        if item is None:
            return
        fn, future = item
        del item
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn())
            except BaseException as error:  # handed to the compute lane, never swallowed
                future.set_exception(error)
        # The round's closure references the optimizer: drop it before waiting again.
        del fn, future


class ThreadLane:
    """A single daemon worker thread running one round at a time, in submission order."""

    def __init__(self, name: str = "acco-comm-lane") -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=_work, args=(self._tasks,), name=name, daemon=True)
        self._thread.start()
        self._closed = False

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        if self._closed:
            raise RuntimeError("the comm lane is closed")
        future: Future[T] = Future()
        self._tasks.put((fn, future))
        return future

    def close(self, timeout: float = 0.0) -> None:
        """Stop the worker once its current round (if any) ends; waits up to ``timeout`` s.

        A round blocked in a collective ends when the collective does (at the latest after
        the process group's timeout); the thread is a daemon, so it never keeps the
        process alive.
        """
        if not self._closed:
            self._closed = True
            self._tasks.put(None)
        if timeout > 0 and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


class StreamFuture(Generic[T]):
    """A round enqueued on a CUDA side stream; done when its final event has fired."""

    def __init__(
        self, device: torch.device, done_event: torch.cuda.Event, value: T | None, error: BaseException | None
    ) -> None:
        self._device = device
        self._event = done_event
        self._value = value
        self._error = error

    def done(self) -> bool:
        return self._error is not None or self._event.query()

    def result(self, timeout: float) -> T:
        if self._error is not None:
            raise self._error
        deadline = time.monotonic() + timeout
        # cudaEventSynchronize cannot time out, so poll.
        while not self._event.query():
            if time.monotonic() > deadline:
                raise FutureTimeoutError(f"CUDA comm lane still busy after {timeout:.1f}s")
            time.sleep(1e-4)
        torch.cuda.current_stream(self._device).wait_event(self._event)
        return self._value  # type: ignore[return-value]


class StreamLane:
    """A CUDA side stream: the round's kernels and NCCL calls queue behind the gradients."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device=device)

    def submit(self, fn: Callable[[], T]) -> StreamFuture[T]:
        # The round reads gradients the compute stream has just produced.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            try:
                value, error = fn(), None
            except BaseException as caught:
                value, error = None, caught
            done = torch.cuda.Event()
            done.record(self._stream)
        return StreamFuture(self.device, done, value, error)

    def close(self) -> None:
        self._stream.synchronize()


def make_lane(device: torch.device) -> ThreadLane | StreamLane:
    """A side stream for CUDA parameters, a worker thread otherwise."""
    if device.type == "cuda":
        return StreamLane(device)
    return ThreadLane()
