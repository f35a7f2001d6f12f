"""The comm lane: where a round's reduce-scatter -> update -> all-gather runs.

A "stream" here is a lane of work beside the training thread's: a CUDA side stream on a
GPU, and on every device the worker thread that drives it (on CPU the thread is the whole
lane). The module's name is the design card's.

One design for every device: a daemon worker thread runs the rounds one at a time, in
submission order, and hands each result (or exception) back through a future whose every
wait takes a timeout. What differs between devices lives in a small :class:`DeviceHooks`
object:

- CPU (:class:`CpuHooks`): every hook is a no-op; a round is finished when its future is.
- CUDA (:class:`CudaHooks`): the worker makes a high-priority side stream its current
  stream once. ``submit`` records a *ticket* event on the training thread's stream (after
  the parameters were loaded and the gradients handed over); the worker makes the side
  stream wait on it, runs the round (its host synchronisations block only the worker), and
  records a *done* event, also when the round fails. ``result()`` returns once the worker
  has enqueued the round and then makes the caller's stream wait on the done event: the
  training thread never blocks on the GPU. ``done()`` is true only once the done event has
  fired.

See docs/design.md, "The comm lane and its device hooks".

Allocator rule (as torch's FSDP2, without ``record_stream``): a tensor allocated on one
stream and used on the other stays referenced until the using stream has been ordered
after the use; :meth:`ThreadLane.close` hands what the last rounds may still read to the
worker, which drops it only after synchronising its own stream.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any, Generic, Protocol, TypeVar

import torch

__all__ = [
    "CpuHooks",
    "CudaHooks",
    "DeviceHooks",
    "LaneFuture",
    "Stamp",
    "ThreadLane",
    "make_lane",
]

T = TypeVar("T")


class Stamp(Protocol):
    """A point in time on one lane: host time on CPU, a timing event on CUDA."""

    def seconds(self, block: bool = False) -> float | None:
        """Seconds on the lane's clock, or None while not yet known (``block`` waits)."""


class DeviceHooks(Protocol):
    """What a device adds to the worker thread; see the module docstring."""

    def thread_start(self) -> None:
        """On the worker, once, before its first round."""

    def thread_end(self) -> None:
        """On the worker, after its last round: wait until the device has finished it."""

    def ticket(self) -> Any:
        """On the caller at submit: marks what the round may read (None on CPU)."""

    def before(self, ticket: Any) -> None:
        """On the worker, before a round: order it after ``ticket``."""

    def after(self) -> Any:
        """On the worker, after a round (also a failed one): its done marker."""

    def fired(self, done: Any) -> bool:
        """Never blocks: whether the device has finished the round marked by ``done``."""

    def join(self, done: Any) -> None:
        """On the caller, after a successful round: order the caller's work after it."""

    def stamp(self) -> Stamp:
        """A timestamp on the calling thread's lane (its current stream on CUDA)."""

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A small host tensor on the lane's device, without waiting for the copy."""

    def host_copy(self, tensor: torch.Tensor) -> Callable[[float], torch.Tensor]:
        """Start copying a small ``tensor`` to the host; returns ``wait(timeout)`` giving
        the host copy (raises ``TimeoutError``). On the worker only."""


def _copied_now(tensor: torch.Tensor) -> Callable[[float], torch.Tensor]:
    host = tensor.to("cpu", copy=True)  # a copy: the caller may change ``tensor`` in place next
    return lambda timeout: host


class _HostStamp:
    def __init__(self) -> None:
        self._time = time.perf_counter()

    def seconds(self, block: bool = False) -> float:
        return self._time


class CpuHooks:
    """Hooks for CPU tensors: nothing to order, a round is done when it returns."""

    def thread_start(self) -> None:
        pass

    def thread_end(self) -> None:
        pass

    def ticket(self) -> None:
        return None

    def before(self, ticket: Any) -> None:
        pass

    def after(self) -> None:
        return None

    def fired(self, done: Any) -> bool:
        return True

    def join(self, done: Any) -> None:
        pass

    def stamp(self) -> Stamp:
        return _HostStamp()

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host

    def host_copy(self, tensor: torch.Tensor) -> Callable[[float], torch.Tensor]:
        return _copied_now(tensor)


class _EventStamp:
    def __init__(self, origin: torch.cuda.Event) -> None:
        self._origin = origin
        self._event = torch.cuda.Event(enable_timing=True)
        self._event.record()

    def seconds(self, block: bool = False) -> float | None:
        if block:
            self._event.synchronize()
        elif not self._event.query():
            return None
        return self._origin.elapsed_time(self._event) / 1000.0


def _poll(event: torch.cuda.Event, timeout: float, what: str) -> None:
    # cudaEventSynchronize cannot time out: poll, sleeping (the GIL is released meanwhile).
    deadline = time.monotonic() + timeout
    pause = 2e-5
    while not event.query():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not finished on the GPU after {timeout:.1f}s")
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


class CudaHooks:
    """Hooks for CUDA tensors: a side stream on the worker, ordered by events."""

    def __init__(self, device: torch.device) -> None:
        if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
            warnings.warn(
                "CUDA_DEVICE_MAX_CONNECTIONS=1: all streams share one hardware queue, so the comm lane's "
                "kernels (an NCCL kernel waiting for a slow rank included) can hold up the compute stream",
                stacklevel=3,
            )
        self.device = device
        # High priority, as FSDP2's communication streams: the lane's small update kernels
        # and NCCL launches must not queue behind long compute kernels.
        self.stream = torch.cuda.Stream(device=device, priority=-1)
        # All timestamps are seconds since this event: one clock for both streams.
        self._origin = torch.cuda.Event(enable_timing=True)
        self._origin.record(torch.cuda.current_stream(device))

    def thread_start(self) -> None:
        # Both are thread-local: the device (lazy NCCL communicators are created on it)
        # and the current stream, so everything the worker allocates is side-stream memory
        # and freeing it there is stream-ordered.
        torch.cuda.set_device(self.device)
        torch.cuda.set_stream(self.stream)

    def thread_end(self) -> None:
        # Only the worker waits here (it may hang on a dead peer; it is a daemon thread).
        self.stream.synchronize()

    def ticket(self) -> torch.cuda.Event:
        return torch.cuda.current_stream(self.device).record_event()

    def before(self, ticket: torch.cuda.Event) -> None:
        # Only what was enqueued before submit (parameters loaded, gradients handed over),
        # not the micro-batches the training thread enqueues afterwards.
        self.stream.wait_event(ticket)

    def after(self) -> torch.cuda.Event:
        return self.stream.record_event()

    def fired(self, done: torch.cuda.Event) -> bool:
        return done.query()

    def join(self, done: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(done)

    def stamp(self) -> Stamp:
        return _EventStamp(self._origin)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        # From pageable memory a copy is a stream synchronisation; from pinned memory it is
        # only enqueued (the caching host allocator keeps the source alive until it is done).
        return host.pin_memory().to(self.device, non_blocking=True)

    def host_copy(self, tensor: torch.Tensor) -> Callable[[float], torch.Tensor]:
        if tensor.device.type != "cuda":
            return _copied_now(tensor)
        # Pinned and non-blocking: enqueued, not waited for; the worker polls its event with
        # a deadline instead of blocking in a synchronisation that cannot time out.
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        copied = torch.cuda.current_stream(self.device).record_event()

        def wait(timeout: float) -> torch.Tensor:
            _poll(copied, timeout, "the comm lane's small all-reduce")
            return host

        return wait


class LaneFuture(Generic[T]):
    """A round on the comm lane: its result once the worker has run it and the device
    has been told to order the caller after it."""

    def __init__(self, future: Future, hooks: DeviceHooks) -> None:
        self._future = future
        self._hooks = hooks

    def done(self) -> bool:
        """Whether the round has finished (successfully or not), on the device too. Never blocks."""
        if not self._future.done():
            return False
        if self._future.exception() is not None:
            return True
        _, done = self._future.result()
        return self._hooks.fired(done)

    def result(self, timeout: float) -> T:
        """The round's result; re-raises its exception; ``TimeoutError`` after ``timeout`` s.

        On success the caller's stream is ordered after the round (a GPU-side wait); a failed
        round is never joined.
        """
        try:
            value, done = self._future.result(timeout)
        except FutureTimeoutError:
            raise FutureTimeoutError(f"comm lane still busy after {timeout:.1f}s") from None
        self._hooks.join(done)
        return value


_STOP = object()


def _work(tasks: queue.SimpleQueue, hooks: DeviceHooks) -> None:
    # Holds no reference to the optimizer, so the optimizer can be garbage collected
    # (which closes the lane) while this thread waits for work.
    try:
        hooks.thread_start()
        broken: BaseException | None = None
    except BaseException as error:  # every round then fails with it, none hangs
        broken = error
    while True:
        item = tasks.get()
        if item[0] is _STOP:
            kept = item[1]
            del item
            try:
                if broken is None:
                    hooks.thread_end()
            finally:
                del kept  # only now may what the last rounds read be freed
            return
        fn, ticket, future = item
        del item
        if future.set_running_or_notify_cancel():
            _run(fn, ticket, future, hooks, broken)
        # The round's closure references the optimizer: drop it before waiting again.
        del fn, ticket, future


def _run(fn: Callable[[], Any], ticket: Any, future: Future, hooks: DeviceHooks, broken: BaseException | None) -> None:
    try:
        if broken is not None:
            raise RuntimeError(f"the comm lane could not start: {broken}") from broken
        hooks.before(ticket)
        value = fn()
        done = hooks.after()
    except BaseException as error:  # handed to the compute lane, never swallowed
        with contextlib.suppress(BaseException):
            hooks.after()  # a failed round's work stays ordered before the teardown
        _drop_locals(error)
        future.set_exception(error)
    else:
        future.set_result((value, done))


def _drop_locals(error: BaseException) -> None:
    """Clear the finished frames of ``error``'s tracebacks (its causes' too): the message
    and the lines stay, the locals go. The error is kept until the compute lane reads it,
    often until exit, and those locals would keep process groups alive past the optimizer's
    teardown (see :meth:`acco.collectives.Collectives.drain`) and buffers past ``close()``.
    What the lane allocated was allocated on its own stream, so freeing it here is safe."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


class ThreadLane:
    """A single daemon worker thread running one round at a time, in submission order."""

    def __init__(self, device_hooks: DeviceHooks | None = None, name: str = "acco-comm-lane") -> None:
        self.device_hooks: DeviceHooks = device_hooks if device_hooks is not None else CpuHooks()
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=_work, args=(self._tasks, self.device_hooks), name=name, daemon=True)
        self._thread.start()
        self._closed = False

    def submit(self, fn: Callable[[], T]) -> LaneFuture[T]:
        """Run ``fn`` on the worker after everything the caller has enqueued so far."""
        if self._closed:
            raise RuntimeError("the comm lane is closed")
        future: Future = Future()
        self._tasks.put((fn, self.device_hooks.ticket(), future))
        return LaneFuture(future, self.device_hooks)

    def run(self, fn: Callable[[], T], timeout: float) -> T:
        """``submit(fn).result(timeout)``: e.g. to allocate state on the lane's stream."""
        return self.submit(fn).result(timeout)

    def close(self, timeout: float = 0.0, keep: Any = None) -> bool:
        """Stop the worker once its current round (if any) ends; waits up to ``timeout`` s.

        Never waits on the device itself: the worker synchronises its own stream before it
        exits and only then drops ``keep`` (tensors the last rounds may still read; kept from
        the first call). A round blocked in a collective ends when the collective does (at
        the latest after the process group's timeout); the thread is a daemon, so it never
        keeps the process alive. Returns whether the worker has ended.
        """
        if not self._closed:
            self._closed = True
            self._tasks.put((_STOP, keep))
        if timeout > 0 and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


def make_lane(device: torch.device) -> ThreadLane:
    """The comm lane for parameters on ``device``: CUDA hooks on a GPU, none otherwise."""
    if device.type == "cuda":
        return ThreadLane(CudaHooks(device))
    return ThreadLane()
