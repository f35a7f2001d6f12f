"""Elastic replicas: what a lost replica group costs, from kill to rejoin (docs/elastic.md).

Runs examples/elastic_local.py (2 replica groups of one process, or of ``--nproc-per-replica``
ranks with ``--inner`` FSDP2 or TP inside; an in-process lighthouse) once uninterrupted and
``--runs`` times with replica 1 killed (SIGKILL from outside, at a random point of its inner
steps; in a group of several ranks one rank at random, and the launcher restarts the whole group),
and reports per run, from the replicas' jsonl records:

- detect: seconds from the kill to the survivor's first round without it;
- rejoin: seconds from the kill to the restarted replica's first round (restart and heal included);
- alone: the survivor's inner steps in the rounds it landed alone after the kill; dropped: its
  rounds dropped after the kill (a peer lost inside one);
- the held-out loss of the final global values against the uninterrupted run's (same inner steps);
- bytes: an outer round's bytes per replica (2 groups, and 1; per rank of a group), and the
  bytes a heal moves per rank: the serialized size of what a peer's equal rank sends (its blocks
  of the global values and of the inner AdamW state);
- memory: ``buffer_bytes()`` of an elastic group's rank 0 at the end of the uninterrupted run,
  beside a fixed group's (the same model and options: 2 ranks of one gloo process group, or a
  fixed 2 x N mesh with the same inner sharding).

    pip install -e '.[ft]'
    python benchmarks/elastic_recovery.py --runs 6 --out benchmarks/results/elastic-recovery.json
    python benchmarks/elastic_recovery.py --runs 6 --nproc-per-replica 2 --inner fsdp \
        --out benchmarks/results/elastic-recovery-fsdp2.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import common

EXAMPLE = common.REPO_ROOT / "examples" / "elastic_local.py"


def run(directory: Path, steps: int, kill_after: float | None, seed: int, ranks: int = 1, inner: str = "fsdp",
        victim: int = 0) -> dict[str, Any]:
    """One launch; ``kill_after``: seconds after replica 1's second round to kill its rank
    ``victim`` (None: no kill)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
    command = [sys.executable, str(EXAMPLE), "--replicas", "2", "--steps", str(steps), "--sync-every", "10",
               "--log-dir", str(directory), "--seed", str(seed), "--nproc-per-replica", str(ranks), "--inner", inner]
    out = open(directory.with_suffix(".out"), "w")
    process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    killed_at = None
    try:
        if kill_after is not None:
            records = directory / "replica-1.jsonl"
            while not records.exists() or len(records.read_text().splitlines()) < 2:
                if process.poll() is not None:
                    raise RuntimeError("the run ended before the kill")
                time.sleep(0.01)
            time.sleep(kill_after)
            os.kill(int((directory / "replica-1.pid").read_text().split()[victim]), signal.SIGKILL)
            killed_at = time.time()
        process.wait(timeout=600)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    if process.returncode != 0:
        raise RuntimeError(f"the launcher failed: {directory.with_suffix('.out').read_text()[-2000:]}")
    survivor = [json.loads(line) for line in (directory / "replica-0.jsonl").read_text().splitlines()]
    other = [json.loads(line) for line in (directory / "replica-1.jsonl").read_text().splitlines()]
    rounds = [r for r in survivor if not r.get("final")]
    result: dict[str, Any] = {
        "eval_loss": survivor[-1]["eval_loss"],
        "buffer_bytes": survivor[-1].get("buffer_bytes"),
        "same_final": (directory / "replica-0.final").read_text() == (directory / "replica-1.final").read_text(),
        "round_bytes": {str(p): statistics.median(r["bytes"] for r in rounds if r["participants"] == p)
                        for p in sorted({r["participants"] for r in rounds})},
        "alone_steps": 0,
        "dropped_rounds": sum(1 for r in rounds if r["dropped"]),
    }  # fmt: skip
    if killed_at is not None:
        # From the kill on (a group that started first may have tried its join alone before).
        after = [r for r in rounds if r["time"] >= killed_at]
        alone = [r for r in after if r["participants"] == 1 and not r["dropped"]]
        restarted = [r for r in other if not r.get("final") and r["pid"] != other[0]["pid"]]
        result["alone_steps"] = sum(r["steps"][0] for r in alone if r.get("steps"))
        result["dropped_rounds"] = sum(1 for r in after if r["dropped"])
        result["detect_seconds"] = alone[0]["time"] - killed_at if alone else None
        result["rejoin_seconds"] = restarted[0]["time"] - killed_at if restarted else None
    return result


def _model(shape: tuple[int, int], inner: str) -> tuple[torch.nn.Module, Any]:
    """The example's model (its default size), with ``inner`` over a ``shape`` mesh's second
    dimension when it has several ranks there; and the group acco reduces across (None: every rank)."""
    import types

    sys.path.insert(0, str(common.REPO_ROOT / "examples"))
    from train_gpt import GPT, GPTConfig, shard_inside

    torch.manual_seed(0)
    model = GPT(GPTConfig(1, 32, 2, 32))
    if shape[1] == 1:
        return model, None
    context = types.SimpleNamespace(world_size=shape[0] * shape[1], device=torch.device("cpu"))
    return model, shard_inside(model, shape, inner, context)


def _heal_rank(rank: int, ranks: int, inner: str, port: int, out: Any) -> None:
    """The serialized size of what this rank of a group receives in a heal: its blocks of the
    global values and of the inner AdamW state (after a step, its moments allocated), as
    :meth:`acco.local.LocalLoop.heal_state` serves them (local tensors)."""
    import datetime

    import torch.distributed as dist

    sys.path.insert(0, str(common.REPO_ROOT / "examples"))
    from train_gpt import param_groups

    from acco.mesh import local_tensor

    torch.set_num_threads(1)
    if ranks > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks,
                                timeout=datetime.timedelta(seconds=60))  # fmt: skip
    model, _ = _model((1, ranks), inner)
    adamw = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    adamw.step()
    state = adamw.state_dict()
    state["state"] = {i: {k: local_tensor(v).clone() for k, v in entry.items()} for i, entry in state["state"].items()}
    sent = {"global_values": [torch.cat([local_tensor(p).detach().reshape(-1) for p in model.parameters()])],
            "inner": [state]}
    buffer = io.BytesIO()
    torch.save(sent, buffer)
    out.put((rank, buffer.getbuffer().nbytes))
    if ranks > 1:
        dist.destroy_process_group()


def _fixed_rank(rank: int, shape: tuple[int, int], inner: str, port: int, out: Any) -> None:
    """One rank of a fixed layout with the example's model and options (one round): 2 flat
    ranks, or a 2 x N mesh with ``inner`` inside each replica group."""
    import datetime

    import torch.distributed as dist

    sys.path.insert(0, str(common.REPO_ROOT / "examples"))
    from train_gpt import param_groups

    from acco import AccoOptimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=shape[0] * shape[1],
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    model, group = _model(shape, inner)
    opt = AccoOptimizer(param_groups(model, weight_decay=0.1), torch.optim.AdamW, module=model, mode="local",
                        process_group=group, sync_every=1, sync_delay=0, outer_bits=4, lr=3e-3, max_grad_norm=1.0)  # fmt: skip
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.accumulate()
    opt.step()
    opt.finish()
    if rank == 0:
        out.put({key: sum(entry[key] for entry in opt.buffer_bytes()) for key in opt.buffer_bytes()[0]})
    dist.destroy_process_group()


def _spawn(target: Any, count: int, expected: int, *args: Any) -> list[Any]:
    """``target(rank, *args, port, queue)`` in ``count`` new processes; the ``expected`` things they put."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    out = context.Queue()
    processes = [context.Process(target=target, args=(rank, *args, port, out)) for rank in range(count)]
    for process in processes:
        process.start()
    try:
        results = [out.get(timeout=180) for _ in range(expected)]
    finally:
        for process in processes:
            process.join(timeout=60)
    return results


def heal_bytes(ranks: int, inner: str) -> list[int]:
    """Per rank of a group, the bytes a heal moves to it (:func:`_heal_rank`)."""
    return [size for _, size in sorted(_spawn(_heal_rank, ranks, ranks, ranks, inner))]


def fixed_buffer_bytes(ranks: int, inner: str) -> dict[str, int]:
    """``buffer_bytes()`` of rank 0 of the fixed layout beside the elastic one (mode="local", the
    example's options): 2 flat ranks, or a 2 x ``ranks`` mesh."""
    return _spawn(_fixed_rank, 2 * ranks, 1, (2, ranks), inner)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--nproc-per-replica", type=int, default=1, help="ranks per replica group")
    parser.add_argument("--inner", choices=["fsdp", "tp"], default="fsdp", help="inside a group of several ranks")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    ranks, inner = args.nproc_per_replica, args.inner
    with tempfile.TemporaryDirectory() as tmp:
        reference = run(Path(tmp) / "uninterrupted", args.steps, None, args.seed, ranks, inner)
        plan = [(rng.uniform(0.0, 1.5), rng.randrange(ranks)) for _ in range(args.runs)]
        killed = [{**run(Path(tmp) / f"killed-{n}", args.steps, after, args.seed, ranks, inner, victim), "victim": victim}
                  for n, (after, victim) in enumerate(plan)]  # fmt: skip
    sizes = heal_bytes(ranks, inner)
    fixed = fixed_buffer_bytes(ranks, inner)
    elastic = reference["buffer_bytes"]
    layout = "2 ranks" if ranks == 1 else f"a 2 x {ranks} mesh, {inner} inside"
    print(f"uninterrupted: eval loss {reference['eval_loss']:.4f}; round bytes per replica (its rank 0) {reference['round_bytes']}")
    print(f"memory (buffer_bytes(), summed over param groups, rank 0): | buffer | fixed ({layout}) | elastic group, 1 of 2 |")
    for key in sorted(set(fixed) | set(elastic or {})):
        print(f"| {key} | {fixed.get(key, 0):,} | {(elastic or {}).get(key, 0):,} |")
    print(f"| total | {sum(fixed.values()):,} | {sum((elastic or {}).values()):,} |")
    print(f"a heal moves {', '.join(f'{size:,}' for size in sizes)} bytes to rank(s) {list(range(ranks))} of the group "
          "(global values + inner AdamW state, serialized, each rank its own blocks)")  # fmt: skip
    print("| run | killed rank | detect (s) | rejoin (s) | survivor's steps alone | dropped rounds | eval loss | vs uninterrupted |")
    print("|---|---|---|---|---|---|---|---|")
    for n, result in enumerate(killed):
        gap = result["eval_loss"] / reference["eval_loss"] - 1
        print(f"| {n} | {result['victim']} | {result['detect_seconds']:.2f} | {result['rejoin_seconds']:.2f} | "
              f"{result['alone_steps']} | {result['dropped_rounds']} | {result['eval_loss']:.4f} | {gap:+.2%} |")
    print(f"median: detect {statistics.median(r['detect_seconds'] for r in killed):.2f} s, rejoin "
          f"{statistics.median(r['rejoin_seconds'] for r in killed):.2f} s, loss "
          f"{statistics.median(r['eval_loss'] / reference['eval_loss'] - 1 for r in killed):+.2%}")
    if args.out:
        Path(args.out).write_text(json.dumps({"steps": args.steps, "nproc_per_replica": ranks, "inner": inner,
                                              "reference": reference, "killed": killed, "heal_bytes": sizes,
                                              "fixed_buffer_bytes": fixed}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
