"""A ``sync_every="auto"`` job behind a rate-limited loopback that lifts its limit mid-run, run
by test_auto_every.py as torchrun would run it, inside a network namespace whose loopback
carries a tbf (benchmarks/netns.py).

    ip netns exec NS torchrun --nproc-per-node 2 tests/auto_every_job.py OUT [--rounds-after 5]

Each inner step sleeps ``--sleep`` seconds (the step time the planner measures); blocking
rounds (``sync_delay=0``), 4-bit. Once a round of the upper bound's H has landed (the planner has
met the slow link), rank 0 deletes the loopback's tbf (``tc qdisc del dev lo root``: the link
becomes fast) and the job goes on for ``--rounds-after`` more rounds. Each rank writes ``OUT/rank{r}.pt``: every round's
H and index, the round after which the link changed, and the error it ended with.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from acco import AccoOptimizer


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add = parser.add_argument
    add("out", type=Path)
    add("--width", type=int, default=512)
    add("--sleep", type=float, default=0.05)
    add("--bounds", type=int, nargs=2, default=[2, 128])
    add("--rounds-after", type=int, default=5)
    args = parser.parse_args(argv)

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    layers = [nn.Linear(args.width, args.width) for _ in range(4)]  # 4 x 512 x 513: 1.05M parameters
    model = nn.Sequential(*layers)
    record: dict = {"error": None, "lifted_after": None}
    try:
        opt = AccoOptimizer(model, torch.optim.AdamW, mode="local", sync_every=("auto", *args.bounds), sync_delay=0,
                            lr=1e-3, timeout=datetime.timedelta(seconds=60))
        generator = torch.Generator().manual_seed(rank)
        step = 0
        while record["lifted_after"] is None or opt.outer_rounds <= record["lifted_after"] + args.rounds_after:
            x = torch.randn(8, args.width, generator=generator)
            model(x).square().mean().backward()
            time.sleep(args.sleep)
            opt.accumulate()
            opt.step()
            opt.zero_grad()
            step += 1
            landed = [s.sync_every for s in opt.round_stats if s.sync_every is not None][: opt.outer_rounds]
            if record["lifted_after"] is None and landed and landed[-1] == args.bounds[1]:
                record["lifted_after"] = opt.outer_rounds - 1  # the same round on both: blocking landings
                if rank == 0:
                    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], check=True)
        opt.finish()
        record["rounds"] = [(s.index, s.sync_every) for s in opt.round_stats if s.sync_every is not None]
        record["steps"] = step
    except Exception:  # noqa: BLE001 - the test reads what happened from the record
        record["error"] = traceback.format_exc()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(record, args.out / f"rank{rank}.pt")
    dist.destroy_process_group()
    return 1 if record["error"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
