"""Lighter outer rounds (``outer_bits``): which 8- and 4-bit formats, and the tables of the runs.

    python benchmarks/outer_bits.py --formats   # ~1 min, 1 process: formats on real pseudo-gradients
    python benchmarks/outer_bits.py             # prints the tables of docs/loops.md, "Lighter outer rounds"

``--formats`` trains the time-to-loss GPT (its settings: width 128, 4 layers, seq 64, AdamW lr
3e-3 with 10 warm-up steps) in ``mode="local"`` on one process, ``sync_every`` 8, and at every
outer round's launch takes the pseudo-gradient it sends (``global_parameters()`` minus the
parameters, public API); each candidate format quantises the same stream, in blocks of 64
values of one parameter with one bf16 scale each: int8 and int4 (acco's), float8 e4m3 and
fp4 e2m1 (Streaming DiLoCo's FP4) as alternatives. Written to results/outer_bits-formats.json.

The tables read benchmarks/results/ (commands in docs/loops.md):

- ``time_to_loss-outer-bits-steps.json`` and ``-steps-seed7.json``: equal inner steps, unlimited link;
- ``time_to_loss-outer-bits-20mbit.json``: 30 s behind a 20 Mbit/s loopback;
- ``time_to_loss-outer-bits-50mbit.json``: 30 s, unlimited and behind 50 Mbit/s.

They ran while 32 bits was the default: a name without ``-bB`` is 32 bits there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import common

import torch
from torch import Tensor

RESULTS = common.RESULTS_DIR
BLOCK = 64
FP4_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def blocks_of(values: Tensor) -> Tensor:
    """One parameter's values as rows of BLOCK (the last zero padded)."""
    padded = torch.zeros(-(-values.numel() // BLOCK) * BLOCK)
    padded[: values.numel()] = values.reshape(-1)
    return padded.view(-1, BLOCK)


def scaled(rows: Tensor, largest: float) -> tuple[Tensor, Tensor]:
    """Each row over its bf16 scale (the row's largest magnitude maps to ``largest``)."""
    scales = (rows.abs().amax(dim=1) / largest).bfloat16().float()
    return rows / torch.where(scales > 0, scales, 1.0)[:, None], scales


def integer(bits: int):
    levels = 2 ** (bits - 1) - 1

    def quantise(rows: Tensor) -> Tensor:
        values, scales = scaled(rows, levels)
        return values.round().clamp(-levels, levels) * scales[:, None]
    return quantise


def float8(rows: Tensor) -> Tensor:
    values, scales = scaled(rows, torch.finfo(torch.float8_e4m3fn).max)
    return values.to(torch.float8_e4m3fn).float() * scales[:, None]


def fp4(rows: Tensor) -> Tensor:
    values, scales = scaled(rows, 6.0)
    nearest = (values.abs()[..., None] - FP4_GRID).abs().argmin(dim=-1)
    return FP4_GRID[nearest] * values.sign() * scales[:, None]


FORMATS = {"int8": integer(8), "float8 e4m3": float8, "int4": integer(4), "fp4 e2m1": fp4}


def pseudo_gradients(steps: int) -> list[list[Tensor]]:
    """The pseudo-gradient of every outer round of a one-process local run, per parameter."""
    sys.path.insert(0, str(common.REPO_ROOT))
    from acco import AccoOptimizer
    from examples.train_gpt import loss_fn

    config = common.ModelConfig(n_embd=128, seq_len=64, lr=3e-3, max_grad_norm=1.0)
    model = common.build_model(config)
    opt = AccoOptimizer(model, torch.optim.AdamW, mode="local", sync_every=8, sync_delay=4, lr=config.lr,
                        betas=config.betas, weight_decay=config.weight_decay, max_grad_norm=config.max_grad_norm)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 11))
    next_batch = common.rank_batches(config, 0)
    params = [p for group in opt.param_groups for p in group["params"]]
    rounds = []
    for step in range(steps):
        for _ in range(4):
            loss_fn(model, *next_batch()).backward()
            opt.accumulate()
        opt.step()
        schedule.step()
        if (step + 1) % 8 == 0:  # just launched: the model holds what the round was handed
            copy = [t for group in opt.global_parameters() for t in group]
            rounds.append([(c - p.detach()).clone() for c, p in zip(copy, params)])
    opt.finish()
    return rounds


def measure(rounds: list[list[Tensor]]) -> dict[str, Any]:
    """Per format: the median over rounds of |Q(d) - d| / |d| (no error feedback), and with
    error feedback |sum of what was sent - sum of d| / |sum of d| after the last round."""
    out: dict[str, Any] = {}
    whole = [torch.cat([blocks_of(t).view(-1) for t in r]) for r in rounds]
    for name, quantise in FORMATS.items():
        plain = [float((torch.cat([quantise(blocks_of(t)).view(-1) for t in r]) - d).norm() / d.norm())
                 for r, d in zip(rounds, whole)]
        residual = [torch.zeros_like(blocks_of(t)) for t in rounds[0]]
        for r in rounds:
            for i, t in enumerate(r):
                payload = blocks_of(t) + residual[i]
                residual[i] = payload - quantise(payload)
        total = torch.stack(whole).sum(0)
        left = torch.cat([e.view(-1) for e in residual])
        out[name] = {"error_per_round": statistics.median(plain), "error_of_sum_with_feedback": float(left.norm() / total.norm())}
    return out


def formats_table(path: Path = RESULTS / "outer_bits-formats.json") -> str:
    if not path.exists():
        return "(outer_bits-formats.json not measured: python benchmarks/outer_bits.py --formats)"
    data = json.loads(path.read_text())
    rows = [f"{data['rounds']} outer rounds of the time-to-loss GPT ({data['parameters'] / 1e6:.2f}M parameters), "
            "blocks of 64 values of one parameter, one bf16 scale each.", "",
            "| format | bits per value | relative error of a round, median | error of the sum of all rounds, error feedback |",
            "|---|---|---|---|"]
    for name, m in data["formats"].items():
        bits = 8.25 if "8" in name else 4.25
        rows.append(f"| {name} | {bits} | {m['error_per_round']:.4f} | {m['error_of_sum_with_feedback']:.5f} |")
    return "\n".join(rows)


def runs_table(path: Path) -> str:
    if not path.exists():
        return f"({path.name} not measured)"
    data = json.loads(path.read_text())
    rows = ["| link | seed | method | held-out loss | vs 32 bits | inner steps | outer rounds | loopback MB per outer round "
            "(vs 32 bits) |", "|---|---|---|---|---|---|---|---|"]
    for run in data["runs"]:
        methods = run["methods"]
        for name, m in methods.items():
            if "final_loss" not in m:
                continue
            full = _full_precision(name)
            base = methods.get(full) or methods.get(full + "-b32") or {}
            versus = "-" if base is m or not base else f"{(m['final_loss'] / base['final_loss'] - 1) * 100:+.2f}%"
            per_round, base_round = m.get("lo_bytes_per_sync"), base.get("lo_bytes_per_sync")
            wire = "-" if per_round is None else f"{per_round / 1e6:.3f}"
            if per_round is not None and base_round and base is not m and base:
                wire += f" ({per_round / base_round:.3f})"
            rows.append(f"| {run['rate']} | {run['seed']} | {_bits_label(name)} | {m['final_loss']:.4f} | {versus} | "
                        f"{m.get('inner_steps', '-')} | {m.get('outer_steps', '-')} | {wire} |")
    return "\n".join(rows)


def _bits_label(name: str) -> str:
    """The method's label, 32 bits named where the run's default was."""
    return common.label(name if "-b" in name else name + "-b32")


def _full_precision(name: str) -> str:
    return "-".join(part for part in name.split("-") if not (part.startswith("b") and part[1:].isdigit()) and part != "noef")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", action="store_true", help="measure the formats (about a minute)")
    parser.add_argument("--steps", type=int, default=240, help="inner steps of the --formats run")
    args = parser.parse_args()
    if args.formats:
        rounds = pseudo_gradients(args.steps)
        common.write_json(RESULTS / "outer_bits-formats.json", {
            "command": "python benchmarks/outer_bits.py --formats", "rounds": len(rounds),
            "parameters": sum(t.numel() for t in rounds[0]), "formats": measure(rounds)})
    print(formats_table(), *(runs_table(RESULTS / f"time_to_loss-outer-bits-{name}.json") for name in ("steps", "steps-seed7", "20mbit", "50mbit")),
          sep="\n\n")


if __name__ == "__main__":
    main()
