"""Real gloo ranks for tests: a pool of spawned processes sharing one process group.

Spawning a rank and importing torch costs seconds, so a pool lives for the whole test
session and runs one function per test on every rank. A rank's exception is re-raised in
the test with its traceback; a rank that dies or hangs past the timeout breaks the pool
(it is killed and the next test gets a new one).
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["RankError", "RankPool", "free_port"]

GROUP_TIMEOUT = datetime.timedelta(seconds=30)


class RankError(RuntimeError):
    """An exception raised on one of the ranks."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dumps(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _serve(rank: int, world_size: int, port: int, inbox: mp.Queue, outbox: mp.Queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT
    )
    while True:
        task = inbox.get()
        if task is None:
            break
        fn, args = task
        try:
            outbox.put((rank, True, _dumps(fn(*args))))
        except BaseException:
            outbox.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """``world_size`` spawned processes in one gloo group, running test functions."""

    def __init__(self, world_size: int) -> None:
        context = mp.get_context("spawn")
        port = free_port()
        self.world_size = world_size
        self._outbox = context.Queue()
        self._inboxes = [context.Queue() for _ in range(world_size)]
        self._processes = [
            context.Process(target=_serve, args=(r, world_size, port, self._inboxes[r], self._outbox), daemon=True)
            for r in range(world_size)
        ]
        for process in self._processes:
            process.start()
        self.broken = False

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 90.0) -> list[Any]:
        """Run ``fn(*args)`` on every rank; returns the per-rank results in rank order.

        ``fn`` must be a module-level function (it is pickled by name).
        """
        if self.broken:
            raise RuntimeError("the rank pool is broken")
        for inbox in self._inboxes:
            inbox.put((fn, args))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < self.world_size:
            try:
                rank, ok, payload = self._outbox.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._processes) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close(kill=True)
                    why = f"ranks {dead} died" if dead else f"no answer within {timeout:.0f}s"
                    raise RankError(f"{fn.__name__}: {why}; errors so far: {errors}") from None
                continue
            if ok:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors[rank] = payload
        if errors:
            first = min(errors)
            raise RankError(f"{fn.__name__} failed on ranks {sorted(errors)}; rank {first}:\n{errors[first]}")
        return [results[r] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        self.broken = True
        if not kill:
            for inbox in self._inboxes:
                inbox.put(None)
            for process in self._processes:
                process.join(timeout=10)
        for process in self._processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
