"""examples/train_gpt.py as torchrun runs it, with what its optimizer decided written out, run by
tests/test_example_counts.py:

    torchrun --standalone --nproc_per_node=2 tests/train_gpt_job.py OUT [train_gpt.py's arguments]

The example runs unchanged (its own ``main()``, output and exit status). A global optimizer step
hook (``torch.optim.optimizer.register_optimizer_step_post_hook``: an ``AccoOptimizer`` is a
``torch.optim.Optimizer``, whose hooks run after each ``step()``) watches its ``AccoOptimizer``.
Each rank writes ``OUT/rank{r}.json``: ``reports``, every landed outer round's report
(``RoundStats.replicas.as_dict()``, in landing order); ``planned``, the plan in force once n
rounds had landed (``opt.replica_steps``) by n; ``pacing``, ``sync_every`` and ``sync_delay`` as
the optimizer resolved them; its ``num_updates`` and ``outer_rounds``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import train_gpt  # noqa: E402

from acco import AccoOptimizer  # noqa: E402


def main(argv: list[str]) -> None:
    out, example_argv = Path(argv[0]), argv[1:]
    watched: list[AccoOptimizer] = []
    planned: dict[int, list[int]] = {}

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        if not isinstance(optimizer, AccoOptimizer):  # (its inner optimizer's steps run the hook too)
            return
        if not watched:
            watched.append(optimizer)
        planned[len(optimizer.round_stats)] = list(optimizer.replica_steps)

    handle = register_optimizer_step_post_hook(after_step)
    try:
        train_gpt.main(example_argv)
    finally:
        handle.remove()
    opt = watched[0]
    local = opt.options.local
    record = {"reports": [None if s.replicas is None else s.replicas.as_dict() for s in opt.round_stats],
              "planned": planned, "pacing": local.pacing, "sync_every": local.sync_every,
              "sync_delay": local.sync_delay, "num_updates": opt.num_updates,
              "outer_rounds": opt.outer_rounds}  # fmt: skip
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1:])
