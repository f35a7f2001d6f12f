"""A mode="local" job with a collective of its own, run by test_pacing.py as torchrun would run
it (inside a rate-limited network namespace where the test asks for one).

    torchrun --nproc-per-node 2 tests/pacing_job.py OUT [--loop broadcast|allreduce|plain] [--pacing speed]
        [--outer-bits 32] [--steps 120] [--sync-every 30] [--sleep 0.01 0.03] [--collective-from 0]
        [--hang-at 40 8]

- ``broadcast``: rank 0's step count is broadcast at every inner step and decides the stop (the
  shape of a time budget agreed at every step);
- ``allreduce``: the loss is all-reduced at every inner step from ``--collective-from`` on (a
  logged mean loss), the stop at ``--steps``;
- ``plain``: no collective of its own, the stop on ``opt.should_stop`` (``stop_after(steps=)``).

Rank r sleeps ``--sleep[r]`` seconds in each inner step (a device that much slower); with
``--hang-at STEP SECONDS`` rank 1 stops stepping for that long after its inner step STEP (a hung
data loader). Each rank writes ``OUT/rank{r}.pt``: its parameters, inner steps, the plans of every
round, the warnings it raised and logged, the held-out loss of the initial and of the final
global values, and the error it ended with (then it exits with status 1).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from acco import AccoOptimizer


def model_of(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, width))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add = parser.add_argument
    add("out", type=Path)
    add("--loop", choices=["broadcast", "allreduce", "plain"], default="broadcast")
    add("--pacing", default="speed")
    add("--outer-bits", type=int, default=32)
    add("--steps", type=int, default=120)
    add("--sync-every", type=int, default=30)
    add("--width", type=int, default=32)
    add("--sleep", type=float, nargs="+", default=[0.0, 0.0])
    add("--collective-from", type=int, default=0)
    add("--timeout", type=float, default=30.0)
    add("--hang-at", type=float, nargs=2, default=None)
    args = parser.parse_args(argv)

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("acco").addHandler(handler)
    model = model_of(args.width)
    held_out = torch.randn(64, args.width, generator=torch.Generator().manual_seed(1234))

    def held_out_loss() -> float:
        with torch.no_grad():
            return float((model(held_out) - held_out).square().mean())

    loss_start = held_out_loss()
    opt = AccoOptimizer(model, torch.optim.AdamW, mode="local", sync_every=args.sync_every, outer_bits=args.outer_bits,
                        pacing=args.pacing, lr=1e-3, timeout=datetime.timedelta(seconds=args.timeout))
    if args.loop == "plain":
        opt.stop_after(steps=args.steps)
    generator = torch.Generator().manual_seed(rank)
    steps, error, failed_at = 0, None, None
    count = torch.zeros(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            while True:
                x = torch.randn(16, args.width, generator=generator)
                loss = (model(x) - x).square().mean()
                loss.backward()
                opt.accumulate()
                time.sleep(args.sleep[rank])
                opt.step()
                steps += 1
                if args.hang_at is not None and rank == 1 and steps == int(args.hang_at[0]):
                    time.sleep(args.hang_at[1])
                if args.loop == "broadcast":
                    count.fill_(steps)
                    dist.broadcast(count, 0)
                    if count.item() >= args.steps:
                        break
                elif args.loop == "allreduce":
                    if steps >= args.collective_from:
                        dist.all_reduce(loss.detach())
                    if steps >= args.steps:
                        break
                elif opt.should_stop:
                    break
            opt.finish()
        except Exception as raised:  # noqa: BLE001 - written out, then the job fails
            error, failed_at = f"{type(raised).__name__}: {raised}", time.time()
            traceback.print_exc()
    plans = [list(s.replicas.steps) for s in opt.round_stats if s.replicas is not None]
    torch.save({"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, "steps": steps,
                "plans": plans, "warnings": [str(w.message) for w in caught if "speed pacing" in str(w.message)],
                "logged": [m for m in logged if "speed pacing" in m], "error": error, "failed_at": failed_at,
                "loss_start": loss_start, "loss_end": held_out_loss() if error is None else None,
                "round_seconds": [s.lane_seconds for s in opt.round_stats]}, args.out / f"rank{rank}.pt")
    if error is not None:
        return 1
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
