"""Real gloo ranks for tests, two ways, sharing one result loop.

- :class:`RankPool`: spawned processes in one gloo process group, living for the whole
  test session (spawning a rank and importing torch costs seconds) and running one
  function per test on every rank. A rank that dies or hangs past the timeout breaks the
  pool (it is killed and the next test gets a new one).
- :func:`run_fresh`: new processes per call, launched as torchrun launches them, for the
  ``transformers.Trainer`` tests: the Trainer and accelerate keep process-wide singletons
  (the accelerator state, the process group they initialise from ``RANK``/``WORLD_SIZE``),
  so each call starts clean processes and lets the Trainer set up the gloo group itself.

Either way a free port is picked for the group, a rank's exception is re-raised in the test
with its traceback (:class:`RankError`), and every wait has a timeout.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["RankError", "RankLost", "RankPool", "free_port", "run_fresh", "run_script"]

GROUP_TIMEOUT = datetime.timedelta(seconds=30)


class RankError(RuntimeError):
    """An exception raised on one of the ranks (its traceback in the message)."""


class RankLost(RankError):
    """A rank died, or did not answer within the timeout."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dumps(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _run_and_report(rank: int, fn: Callable[..., Any], args: tuple, outbox: mp.Queue) -> None:
    """``fn(*args)`` on this rank; its result, or its traceback, goes to ``outbox``."""
    try:
        outbox.put((rank, True, _dumps(fn(*args))))
    except BaseException:
        outbox.put((rank, False, traceback.format_exc()))


def collect(name: str, outbox: mp.Queue, processes: Sequence[mp.process.BaseProcess], timeout: float,
            stop_at_first_error: bool) -> list[Any]:
    """The per-rank results in rank order, from ``(rank, ok, payload)`` answers on ``outbox``.

    Raises :class:`RankError` with the first failing rank's traceback once every rank has
    answered (or at the first error with ``stop_at_first_error``: the others may then wait
    on a collective forever); :class:`RankLost` when a rank exits without answering or
    ``timeout`` seconds have passed.
    """
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < len(processes):
        try:
            rank, ok, payload = outbox.get(timeout=0.5)
        except queue.Empty:
            exited = [r for r, p in enumerate(processes) if not p.is_alive() and r not in results and r not in errors]
            try:  # an exited rank's answer may still be on its way through the pipe
                rank, ok, payload = outbox.get(timeout=2.0 if exited else 0.0)
            except queue.Empty:
                if exited or time.monotonic() > deadline:
                    why = f"ranks {exited} died" if exited else f"no answer within {timeout:.0f}s"
                    raise RankLost(f"{name}: {why}; errors so far: {errors}") from None
                continue
        if ok:
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            errors[rank] = payload
            if stop_at_first_error:
                break
    if errors:
        first = min(errors)
        raise RankError(f"{name} failed on ranks {sorted(errors)}; rank {first}:\n{errors[first]}")
    return [results[r] for r in range(len(processes))]


# ----------------------------------------------------------------- the session's pool


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
        _run_and_report(rank, fn, args, outbox)
    dist.destroy_process_group()


class RankPool:
    """``world_size`` spawned processes in one gloo group, running test functions."""

    def __init__(self, world_size: int) -> None:
        context = fork_server()  # new processes that skip the seconds of importing torch
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
        self.tasks = 0  # run so far

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 90.0) -> list[Any]:
        """Run ``fn(*args)`` on every rank; returns the per-rank results in rank order.

        ``fn`` must be a module-level function (it is pickled by name).
        """
        if self.broken:
            raise RuntimeError("the rank pool is broken")
        self.tasks += 1
        for inbox in self._inboxes:
            inbox.put((fn, args))
        try:
            # Every rank answers before the next task: an answer left behind would be taken
            # for the next test's.
            return collect(fn.__name__, self._outbox, self._processes, timeout, stop_at_first_error=False)
        except RankLost:
            self.close(kill=True)
            raise

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


# ------------------------------------------------------- fresh processes, as torchrun


_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_PRELOAD = ["torch", "transformers", "transformers.trainer", "accelerate", "tests.test_hf", "lightning.pytorch",
            "pytorch_lightning", "tests.test_lightning"]  # a missing one is skipped by the fork server


def _child(fn: Callable[..., Any], args: tuple, environment: dict[str, str], outbox: mp.Queue) -> None:
    for name in _TORCHRUN_VARIABLES:
        os.environ.pop(name, None)
    os.environ.update(environment)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    torch.set_num_threads(1)
    try:
        _run_and_report(int(environment.get("RANK", 0)), fn, args, outbox)
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def fork_server() -> mp.context.BaseContext:
    """A fork server that has imported transformers once: each process forked from it is
    new (no accelerator state, no process group) but skips the seconds of imports."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def run_fresh(fn: Callable[..., Any], *args: Any, world_size: int = 2, torchrun: bool = True,
              timeout: float = 150.0) -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` new processes; the per-rank results in rank order.

    Each process gets torchrun's environment variables (``RANK``, ``WORLD_SIZE``,
    ``MASTER_PORT`` on a free port, ...). With ``torchrun=False`` (one process only) none is
    set: the Trainer then runs without torch.distributed. ``fn`` must be a module-level
    function. Ranks still running after an error or the timeout are killed.
    """
    if not torchrun and world_size != 1:
        raise ValueError(f"torchrun=False launches one process, got world_size={world_size}")
    context = fork_server()
    outbox = context.Queue()
    port = str(free_port())
    processes = []
    for rank in range(world_size):
        environment = (
            {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
             "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            if torchrun else {}
        )
        process = context.Process(target=_child, args=(fn, args, environment, outbox), daemon=True)
        process.start()
        processes.append(process)
    failed = True
    try:
        results = collect(fn.__name__, outbox, processes, timeout, stop_at_first_error=True)
        failed = False
        return results
    finally:
        for process in processes:
            process.join(timeout=0.1 if failed else 5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)


# ------------------------------------------------ a script, as torchrun runs it


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(script: str, *args: str, world_size: int = 2, cwd: str | None = None,
               timeout: float = 120.0, netns: str | None = None) -> list[subprocess.CompletedProcess]:
    """``python script *args`` on ``world_size`` ranks, each with torchrun's environment
    variables (``MASTER_PORT`` a free port), run to its end: atexit and the interpreter's
    finalisation happen as in a real job. Per rank, in rank order; a rank still running after
    ``timeout`` seconds is killed (``subprocess.TimeoutExpired``). ``netns``: every rank runs in
    that network namespace (``benchmarks/netns.py``'s, e.g. behind a rate-limited loopback)."""
    port = str(free_port())
    prefix = [] if netns is None else ["ip", "netns", "exec", netns]
    processes = []
    for rank in range(world_size):
        environment = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                           LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                           OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        if netns is not None:  # the host name does not resolve to an address inside the namespace
            environment["GLOO_SOCKET_IFNAME"] = "lo"
        processes.append(subprocess.Popen([*prefix, sys.executable, script, *args], env=environment, cwd=cwd,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    finished = []
    try:
        for process in processes:
            out, err = process.communicate(timeout=timeout)
            finished.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    return finished
