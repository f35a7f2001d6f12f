"""examples/pretrain_mesh.py as docs/multinode.md runs it on CPU: 4 gloo processes as 2 replica
groups of 2 ranks (FSDP2 inside, acco's local steps across). It trains, saves a checkpoint at an
outer round and a second launch with ``--resume`` continues from it to the same end, and every
rank's ``buffer_bytes()`` total is what the memory formula (``acco_local_bytes``) says. The
formula is also checked term by term on the rank pool, for each overlap rule, ``outer_bits``,
an fp32 and a bf16 model, and the mesh shapes 2x2, 4x1 and 1x4."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from acco import AccoOptimizer
from acco.options import LocalOptions, Mode
from examples.pretrain_mesh import acco_local_bytes, buffer_totals, local_numels
from examples.train_gpt import GPT, GPTConfig, param_groups
from tests.helpers import TIMEOUT

pytestmark = pytest.mark.timeout(300)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pretrain_mesh.py"
# Every dimension FSDP2 shards (dim 0: 256 bytes, 32 positions, 32 / 96 / 128 features) divides by
# S = 2, and every param group's half by R = 2: no padding anywhere.
N_LAYER, N_EMBD, N_HEAD, SEQ_LEN = 1, 32, 2, 32
SYNC_EVERY, STEPS = 4, 8  # two outer rounds; the checkpoint after the first
# Lockstep replicas and blocking rounds (whatever acco's defaults): a resumed run is the
# uninterrupted one bit for bit.
TINY = ["--n-layer", str(N_LAYER), "--n-embd", str(N_EMBD), "--n-head", str(N_HEAD), "--seq-len", str(SEQ_LEN),
        "--batch-size", "4", "--max-bytes", "200000", "--eval-batches", "2", "--steps", str(STEPS),
        "--sync-every", str(SYNC_EVERY), "--sync-delay", "0", "--pacing", "lockstep", "--ckpt-every", str(SYNC_EVERY),
        "--eval-every", str(SYNC_EVERY), "--warmup", "2", "--timeout", "120"]  # fmt: skip
MEMORY = re.compile(r"memory rank (\d) \(replica (\d), shard (\d)\): acco holds (\d+) bytes \(buffer_bytes\), formula (\d+) "
                    r"\((equal|DIFFERENT[^)]*)\) \| local values (\d+) x (\d) bytes, R (\d)")  # fmt: skip


def launch(ckpt_dir: Path, *extra: str) -> str:
    """The documented CPU command (tiny sizes), its output; fails the test on a non-zero exit."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(EXAMPLE),
               "--mesh", "2x2", "--backend", "gloo", "--ckpt-dir", str(ckpt_dir), *TINY, *extra]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=200,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    # torch's DeviceMesh warnings at each checkpoint would crowd the ranks' tracebacks out of the message.
    errors = "\n".join(line for line in done.stderr.splitlines() if "DeviceMesh" not in line)
    assert done.returncode == 0, done.stdout[-3000:] + errors[-6000:]
    return done.stdout


def expected_bytes() -> int:
    """acco's bytes per rank for the example's model, from its config: each param group's P/S
    values per rank (FSDP2's even dim-0 shards), the library's resolved local-mode options."""
    model = GPT(GPTConfig(N_LAYER, N_EMBD, N_HEAD, SEQ_LEN))
    numels = [sum(p.numel() for p in group["params"]) // 2 for group in param_groups(model, weight_decay=0.1)]
    local = LocalOptions.check(Mode.LOCAL, SYNC_EVERY, 0, None, None, pacing="lockstep")
    terms = acco_local_bytes(numels, 2, 4, sync_delay=local.sync_delay, overlap=local.overlap.value,
                             outer_bits=local.outer_bits, error_feedback=local.error_feedback, landing=local.landing,
                             outer_common=local.estimate is not None and not local.estimate.common_is_values)  # fmt: skip
    return sum(terms.values())


def check_memory_lines(output: str) -> None:
    lines = MEMORY.findall(output)
    assert sorted(int(line[0]) for line in lines) == [0, 1, 2, 3], output[-3000:]
    expected = expected_bytes()
    for rank, replica, shard, measured, formula, verdict, _, param_bytes, replicas in lines:
        assert (int(replica), int(shard)) == divmod(int(rank), 2)
        assert verdict == "equal" and int(measured) == int(formula) == expected, (rank, measured, formula, expected)
        assert (int(param_bytes), int(replicas)) == (4, 2)  # fp32 shards under bf16 compute


def test_the_documented_cpu_run_trains_saves_resumes_and_meets_the_memory_formula(tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    first = launch(ckpt)
    start = re.search(r"step    0 \| eval loss ([\d.]+)", first)
    final = re.search(r"final eval loss ([\d.]+) after (\d+) inner steps, (\d+) outer rounds", first)
    assert start and final, first[-3000:]
    assert math.isfinite(float(final.group(1))) and float(final.group(1)) < float(start.group(1)), first[-3000:]
    assert final.group(2, 3) == (str(STEPS), str(STEPS // SYNC_EVERY))
    train_losses = [float(v) for v in re.findall(r"train loss \(replica 0\) ([\d.]+)", first)]
    assert len(train_losses) == STEPS // SYNC_EVERY and all(math.isfinite(v) for v in train_losses), first[-3000:]
    # Saved at the first outer round only: the run stops at the second.
    assert f"saved {ckpt / 'round-000001'}" in first, first[-3000:]
    assert (ckpt / "round-000001" / ".metadata").is_file() and (ckpt / "latest").read_text().strip() == "round-000001"
    check_memory_lines(first)

    second = launch(ckpt, "--resume")
    assert f"resumed from {ckpt / 'round-000001'} at outer round 1, inner step {SYNC_EVERY}" in second, second[-3000:]
    assert "step    0 |" not in second
    resumed = re.search(r"final eval loss ([\d.]+) after (\d+) inner steps", second)
    # The resumed run is the uninterrupted one, bit for bit (the same printed loss): its data
    # position and schedule came back through the checkpoint's extra values.
    assert resumed and resumed.groups() == final.group(1, 2), (second[-3000:], final.groups())
    check_memory_lines(second)


# ----------------------------------------------------------- the formula on the rank pool


def formula_rank(shape: tuple[int, int], bf16_params: bool, options: dict) -> dict:
    """One rank: a tiny GPT, FSDP2 inside each of R replica groups of S ranks, acco across;
    three inner steps (a round launched and, with a delay, one in flight); acco's buffers
    against the formula, term by term."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = GPT(GPTConfig(1, 16, 2, 8))
    if bf16_params:  # cast: the sharded parameters (and the inner optimizer's state) are bf16
        model = model.to(torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    opt = AccoOptimizer(param_groups(model, weight_decay=0.1), torch.optim.AdamW, process_group=mesh["replicate"].get_group(),
                        module=model, mode="local", sync_every=2, pacing="lockstep", lr=1e-3, timeout=TIMEOUT,
                        **options)  # fmt: skip
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        x = torch.randint(0, 256, (2, 8), generator=generator)
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.float().view(-1, 256), x.view(-1)).backward()
        opt.accumulate()
        opt.step()
    measured = buffer_totals(opt)
    local = opt.options.local
    numels = local_numels(opt)
    param_bytes = 2 if bf16_params else 4
    predicted = acco_local_bytes(numels, shape[0], param_bytes, sync_delay=local.sync_delay, overlap=local.overlap.value,
                                 outer_bits=local.outer_bits, error_feedback=local.error_feedback, landing=local.landing,
                                 outer_common=local.estimate is not None and not local.estimate.common_is_values)  # fmt: skip
    opt.finish()
    return {"measured": measured, "predicted": predicted, "numels": numels}


CASES = {
    "blocking-4bit": ((2, 2), False, {"sync_delay": 0, "outer_bits": 4, "outer_error_feedback": True}),
    "blocking-sparse-2bit": ((2, 2), False, {"sync_delay": 0, "outer_bits": 2, "outer_topk": 1 / 64}),
    "estimate": ((2, 2), False, {"sync_delay": 1, "overlap": "estimate"}),
    "keep-32bit": ((2, 2), False, {"sync_delay": 1, "overlap": "keep", "outer_bits": 32}),
    "discard-8bit-no-feedback": ((2, 2), False, {"sync_delay": 1, "overlap": "discard", "outer_bits": 8,
                                                 "outer_error_feedback": False}),
    "bf16-model-4x1": ((4, 1), True, {"sync_delay": 1, "overlap": "estimate"}),
    "one-replica-1x4": ((1, 4), False, {"sync_delay": 0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_formula_is_buffer_bytes_term_by_term(ranks, case) -> None:
    shape, bf16_params, options = CASES[case]
    replicas = shape[0]
    for result in ranks(4).run(formula_rank, shape, bf16_params, options):
        assert result["measured"] == result["predicted"], result
        # The closed forms docs/multinode.md states, per param group n = P/S values on a rank
        # (padded to a multiple of R), b = 4: blocking 4-bit rounds (3b + 4) n + 4 n/R, the
        # estimate rule b n more (its start; plain averaging, the default outer step, has no
        # common part to copy).
        # Sparse rounds (outer_topk) hold what 4-bit ones do: the outer state in 1/(R x S) shards.
        if case in ("blocking-4bit", "blocking-sparse-2bit", "estimate"):
            per_value = 20 if case == "estimate" else 16
            chunks = [math.ceil(n / replicas) for n in result["numels"]]
            assert sum(result["measured"].values()) == sum(per_value * c * replicas + 4 * c for c in chunks), result
