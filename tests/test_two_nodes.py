"""benchmarks/two_nodes.py's memory formula against acco's own accounting on 2-D meshes (4
real gloo ranks, FSDP2 on ``mesh["shard"]``): acco in mode ``acco`` holds 12 P/S + 20 P/(R S)
bytes per rank in fp32, the formula the benchmarks README quotes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import common  # noqa: E402
import two_nodes  # noqa: E402

pytestmark = pytest.mark.timeout(120)
# Every dimension FSDP2 shards (dim 0) divisible by 4: no FSDP2 padding at S <= 4.
TINY = common.ModelConfig(n_layer=1, n_embd=32, n_head=2, seq_len=16, batch_size=2)


def mesh_memory_rank(shape: tuple[int, int]) -> tuple[dict[str, int], int]:
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    method = two_nodes.build("fsdp-acco", TINY, 4, mesh)
    data = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    batches = common.batches(data, TINY, seed=0)
    accounts = []
    for _ in range(4):  # both kinds of rounds have run: every buffer exists
        common.train_round(method, batches, before_boundary=lambda _: accounts.append(two_nodes.account(method)))
        accounts.append(two_nodes.account(method))
    method.finish()
    method.close()
    return two_nodes.largest(accounts)["bytes"], sum(p.numel() for p in common.build_model(TINY).parameters())


@pytest.mark.parametrize("shape", [(2, 2), (4, 1)])
def test_the_mesh_memory_formula_is_what_acco_holds(ranks, shape) -> None:
    r, s = shape
    for kinds, p in ranks(4).run(mesh_memory_rank, shape):
        per_group = kinds["parameters"] + kinds["accumulator"] + kinds["hand-over"]
        sharded = kinds["master shard"] + kinds["optimizer state"] + kinds["estimate copy"]
        assert per_group == 12 * p // s, kinds
        # acco pads each param group's flat buffer to a multiple of R; AdamW's step counters
        assert 20 * p // (r * s) <= sharded <= 20 * p // (r * s) + 64 * r, kinds
        assert kinds["all-gather buffer"] == kinds["master gradient"] == kinds["gradients"] == 0, kinds
