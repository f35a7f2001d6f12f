"""Local-mode runs that save per-rank checkpoints, and runs that resume from them, as a user
runs them (``torch.save`` of each rank's model and optimizer state after an inner step; new
processes load both and train on), for tests/test_resume.py. As a job, under torchrun:

    torchrun --nproc-per-node 2 tests/resume_job.py OUT --delay auto --save-at 9 21
    torchrun --nproc-per-node 2 tests/resume_job.py OUT --delay auto --resume-from 21

2 replicas in lockstep, a small MLP, AdamW, ``sync_every=8``, ``--steps`` inner steps (40). The
first form trains them all, saving ``OUT/step{S}.rank{r}.pt`` after each inner step S of
``--save-at``, and writes its record to ``OUT/whole.rank{r}.pt``; the second loads
``OUT/step{S}.rank{r}.pt`` into a new model and optimizer, trains on to ``--steps`` and writes
its record to ``OUT/resumed{S}.rank{r}.pt``. ``--pause R T S``: rank R waits S seconds before
its inner step of index T, from 0 (a slow data loader; repeatable); ``--jitter SEED``: each rank waits up to 0.1 s
before a fifth of its steps, drawn from SEED and the rank. ``--dump S``: every thread's stack
to stderr if the job still runs after S seconds.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import random
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from acco import AccoOptimizer
from tests.reference import OPTIMIZERS, loss_fn, make_model, micro_batch, params_of

H = 8
STEPS = 40


def inner_step(opt: AccoOptimizer, model: torch.nn.Module, step: int, rank: int) -> None:
    """Inner step ``step`` of replica ``rank``: two micro-batches of its own data."""
    for index in range(2):
        x, y = micro_batch(step, rank, index)
        loss_fn(model, x, y).backward()
        opt.accumulate()
    opt.step()


def checkpoint(out: Path, step: int, rank: int) -> Path:
    return out / f"step{step}.rank{rank}.pt"


def run(out: Path, delay: int | str, *, steps: int = STEPS, save_at: Sequence[int] = (), resume_from: int | None = None,
        load: int | None | str = "own", pauses: dict[int, float] | None = None, jitter: int | None = None,
        timeout: float = 30.0) -> dict[str, Any]:
    """This rank's run: from inner step 0, or from ``resume_from`` loading this rank's state saved
    after inner step ``load`` (``"own"``: ``resume_from``; None: loads nothing), to ``steps``,
    saving after each step of ``save_at`` (counted from 1: after ``S`` inner steps); ``pauses``:
    seconds this rank waits before an inner step (by its index, from 0). The record: the parameters after ``finish()``, or the error the run ended with (its
    type and message) and the seconds from the load to it; whether each saved state had a
    round in flight."""
    rank = dist.get_rank()
    pauses = dict(pauses or {})
    if jitter is not None:
        draw = random.Random(1000 * jitter + rank)
        pauses.update({step: 0.1 * draw.random() for step in range(steps) if draw.random() < 0.2})
    start = 0 if resume_from is None else resume_from
    record: dict[str, Any] = {"error": None, "params": None, "seconds": None, "in_flight": {}}
    model = make_model(seed=rank if resume_from is None else 100 + rank)  # a resume overwrites them
    cls, hp = OPTIMIZERS["adamw"]
    opt = AccoOptimizer(model, cls, mode="local", sync_every=H, sync_delay=delay, pacing="lockstep",
                        timeout=datetime.timedelta(seconds=timeout), **hp)  # fmt: skip
    started = time.monotonic()
    try:
        load = resume_from if load == "own" else load
        if load is not None:
            saved = torch.load(checkpoint(out, load, rank), weights_only=True)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
        started = time.monotonic()
        for step in range(start, steps):
            time.sleep(pauses.get(step, 0.0))
            inner_step(opt, model, step, rank)
            if step + 1 in save_at:
                state = opt.state_dict()
                torch.save({"model": model.state_dict(), "optimizer": state}, checkpoint(out, step + 1, rank))
                record["in_flight"][step + 1] = state["acco"]["round"]["in_flight_kind"] is not None
        opt.finish()
        record["params"] = params_of(model)
    except Exception as error:
        record["error"] = f"{type(error).__name__}: {error}"
        record["seconds"] = time.monotonic() - started
        opt.close()
    return record


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add = parser.add_argument
    add("out", type=Path)
    add("--delay", type=lambda text: text if text == "auto" else int(text), default="auto")
    add("--steps", type=int, default=STEPS)
    add("--save-at", type=int, nargs="*", default=[])
    add("--resume-from", type=int, default=None)
    add("--pause", nargs=3, type=float, action="append", default=[], metavar=("RANK", "STEP", "SECONDS"))
    add("--jitter", type=int, default=None)
    add("--timeout", type=float, default=30.0)
    add("--dump", type=float, default=None)
    args = parser.parse_args(argv)
    if args.dump is not None:
        faulthandler.dump_traceback_later(args.dump, exit=False)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    pauses = {int(step): seconds for who, step, seconds in args.pause if int(who) == rank}
    try:
        record = run(args.out, args.delay, steps=args.steps, save_at=args.save_at, resume_from=args.resume_from,
                     pauses=pauses, jitter=args.jitter, timeout=args.timeout)  # fmt: skip
    except Exception:
        record = {"error": traceback.format_exc()}
    name = "whole" if args.resume_from is None else f"resumed{args.resume_from}"
    torch.save(record, args.out / f"{name}.rank{rank}.pt")
    if record["error"] is None:  # (after an error the other rank may never come to it)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
