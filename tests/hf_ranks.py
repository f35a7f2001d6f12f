"""Fresh processes launched the way torchrun launches them, for the Trainer tests.

``transformers.Trainer`` and accelerate keep process-wide singletons (the accelerator state,
the process group they initialise from ``RANK``/``WORLD_SIZE``), so each call here starts
new processes with torchrun's environment variables and lets the Trainer set up the gloo
group itself, as it would under ``torchrun``. They are forked from a fork server that has
imported transformers once (seconds per process otherwise) and holds no other state. A
rank's exception is re-raised with its traceback; ranks still running after the timeout are
killed.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from tests.ranks import RankError, free_port

__all__ = ["run_fresh"]

_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _child(fn: Callable[..., Any], args: tuple, environment: dict[str, str], outbox: mp.Queue) -> None:
    for name in _TORCHRUN_VARIABLES:
        os.environ.pop(name, None)
    os.environ.update(environment)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    torch.set_num_threads(1)
    rank = int(environment.get("RANK", 0))
    try:
        result = fn(*args)
        buffer = io.BytesIO()
        torch.save(result, buffer)
        outbox.put((rank, True, buffer.getvalue()))
    except BaseException:
        outbox.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


_PRELOAD = ["torch", "transformers", "transformers.trainer", "accelerate", "tests.test_hf"]


def _context() -> mp.context.BaseContext:
    """A fork server that has imported transformers once: each process forked from it is
    new (no accelerator state, no process group) but skips the seconds of imports."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def run_fresh(fn: Callable[..., Any], *args: Any, world_size: int = 2, torchrun: bool = True,
              timeout: float = 150.0) -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` new processes; the per-rank results in rank order.

    With ``torchrun=False`` (one process only) no torchrun variable is set: the Trainer
    then runs without torch.distributed. ``fn`` must be a module-level function.
    """
    if not torchrun and world_size != 1:
        raise ValueError(f"torchrun=False launches one process, got world_size={world_size}")
    context = _context()
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
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            try:
                rank, ok, payload = outbox.get(timeout=0.5)
            except queue.Empty:
                exited = [r for r, p in enumerate(processes) if not p.is_alive() and r not in results]
                try:  # an exited rank's answer may still be on its way through the pipe
                    rank, ok, payload = outbox.get(timeout=2.0 if exited else 0.0)
                except queue.Empty:
                    if exited or time.monotonic() > deadline:
                        why = f"ranks {exited} died" if exited else f"no answer within {timeout:.0f}s"
                        raise RankError(f"{fn.__name__}: {why}; errors so far: {errors}") from None
                    continue
            if ok:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors[rank] = payload
                # The other ranks may now wait on a collective forever: stop waiting for them.
                break
    finally:
        for process in processes:
            process.join(timeout=5 if not errors else 0.1)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
    if errors:
        first = min(errors)
        raise RankError(f"{fn.__name__} failed on ranks {sorted(errors)}; rank {first}:\n{errors[first]}")
    return [results[r] for r in range(world_size)]
