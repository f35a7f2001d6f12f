"""The minimal job of issue 24, run by test_exit.py as torchrun would run it: a few rounds,
then ``finish()`` or not (or an exception), ``destroy_process_group()`` or not, then the
interpreter exits as usual.

    torchrun --nproc-per-node 2 tests/exit_job.py MODE END DESTROY

END: ``finish``, ``forget`` (no finish()) or ``raise`` (an exception ends the job); DESTROY: 0 or 1.
"""

import sys

import torch
import torch.distributed as dist

from acco import AccoOptimizer


def main(mode: str, end: str, destroy: bool) -> None:
    dist.init_process_group("gloo")
    model = torch.nn.Linear(64, 64)
    opt = AccoOptimizer(model, torch.optim.AdamW, mode=mode, lr=1e-3)
    for _ in range(6):
        model(torch.randn(8, 64)).square().mean().backward()
        opt.accumulate()
        opt.step()
    if end == "finish":
        opt.finish()
    if destroy:
        dist.destroy_process_group()
    if end == "raise":
        raise RuntimeError("the job failed on purpose")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] == "1")
