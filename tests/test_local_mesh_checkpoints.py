"""mode="local" checkpoints on a mesh (FSDP2 or tensor parallelism inside each replica group)
through ``acco.checkpoint``, on 4 gloo ranks: exact at the same layout with a round in flight and
4-bit rounds (residuals included), and resharded by the documented rule (docs/checkpoints.md):
at the same number of replicas each replica reads its own state into the new layout; at another
number every replica starts from replica 0's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from acco import AccoOptimizer, checkpoint
from tests.helpers import TIMEOUT, assert_params_close, assert_params_equal
from tests.reference import OPTIMIZERS, loss_fn
from tests.test_mesh import S, build, data_of, full_params

pytestmark = pytest.mark.timeout(300)

H, DELAY, STEPS = 3, 1, 8
SAVE_AFTER = 3  # the round launched after inner step 3 is in flight (delay 1) when the state is saved


def sources_of(inner: str, layout: str, rank: int) -> list[int]:
    """The mesh ranks whose micro-batches this rank feeds: on a 2 x 2 mesh its own (FSDP2 averages
    its replica group's), on 2 flat ranks (one replica each) both of its old replica group's."""
    if layout == "flat":
        return [rank * S, rank * S + 1]
    return [rank]


def build_opt(inner: str, layout: str, seed: int, outer_bits: int) -> tuple[torch.nn.Module, AccoOptimizer]:
    from torch.distributed.device_mesh import init_device_mesh

    from tests.reference import make_model
    from tests.test_mesh import hidden_of

    torch.manual_seed(seed)
    if layout == "flat":
        model, group = make_model(hidden=hidden_of(inner), seed=seed), None
    else:
        shape = tuple(int(n) for n in layout.split("x"))
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        model, group = build(inner, mesh) if seed == 0 else _build_seeded(inner, mesh, seed), mesh["replicate"].get_group()
    cls, hp = OPTIMIZERS["adamw"]
    opt = AccoOptimizer(model, cls, process_group=group, mode="local", sync_every=H, sync_delay=DELAY,
                        pacing="lockstep", outer_bits=outer_bits, max_grad_norm=0.5, timeout=TIMEOUT, **hp)
    return model, opt


def _build_seeded(inner: str, mesh, seed: int) -> torch.nn.Module:
    """``build`` with other initial values: a model that loads must get its values from the checkpoint."""
    model = build(inner, mesh)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(seed)
    return model


def train(model, opt, inner: str, layout: str, steps: range) -> None:
    rank = dist.get_rank()
    for t in steps:
        for source in sources_of(inner, layout, rank):
            for i in range(2):
                x, y, _ = data_of(inner, t, source, i, False)
                loss_fn(model, x, y).backward()
                opt.accumulate()
        opt.step()


def ckpt_rank(inner: str, layout: str, load_from: str | None, save_to: str | None, outer_bits: int = 4) -> dict:
    """Train to SAVE_AFTER (or load there), optionally save there, continue to STEPS."""
    model, opt = build_opt(inner, layout, 0 if load_from is None else 1, outer_bits)
    if load_from is None:
        train(model, opt, inner, layout, range(SAVE_AFTER))
    else:
        checkpoint.load(load_from, opt, model)
    at_save = full_params(model)
    in_flight = opt.in_flight is not None
    if save_to is not None:
        checkpoint.save(save_to, opt, model)
    train(model, opt, inner, layout, range(SAVE_AFTER, STEPS))
    opt.finish()
    return {"params": full_params(model), "at_save": at_save, "in_flight": in_flight, "outer_rounds": opt.outer_rounds}


def assert_all_equal(results: list[dict]) -> None:
    for result in results[1:]:
        assert_params_equal(result["params"], results[0]["params"])


@pytest.mark.parametrize("inner", ["fsdp", "tp"])
def test_resume_at_the_same_layout_is_bit_for_bit(ranks, tmp_path, inner) -> None:
    """Saved on a 2 x 2 mesh with a 4-bit round in flight: the run that loads ends bit for bit
    where the one that saved does, on every rank (parameters, inner and outer state, residuals,
    the clock: any of them off changes the parameters)."""
    pool = ranks(4)
    saved = str(tmp_path / "ckpt")
    reference = pool.run(ckpt_rank, inner, "2x2", None, saved)
    assert all(r["in_flight"] for r in reference)
    assert reference[0]["outer_rounds"] >= 2
    resumed = pool.run(ckpt_rank, inner, "2x2", saved, None)
    assert all(r["in_flight"] for r in resumed)
    assert_all_equal(resumed)
    assert_params_equal(resumed[0]["params"], reference[0]["params"])
    # the two replicas' own parameters differed at the save, and each got its own back
    assert_params_equal(resumed[0]["at_save"], reference[0]["at_save"])
    assert_params_equal(resumed[2]["at_save"], reference[2]["at_save"])
    assert any(not torch.equal(reference[0]["at_save"][k], reference[2]["at_save"][k]) for k in reference[0]["at_save"])


def test_reshard_to_flat_ranks_and_back_at_the_same_number_of_replicas(ranks, tmp_path) -> None:
    """2 x 2 (FSDP2) -> 2 flat ranks (each feeding its old replica group's micro-batches) -> 2 x 2:
    each replica keeps its own parameters and state, the run continues as the uninterrupted one
    (fp32 rounds: a resharded rank starts from a zero residual)."""
    saved, there = str(tmp_path / "at-2x2"), str(tmp_path / "at-flat")
    reference = ranks(4).run(ckpt_rank, "fsdp", "2x2", None, saved, 32)
    flat = ranks(2).run(ckpt_rank, "fsdp", "flat", saved, there, 32)
    assert_all_equal(flat)
    assert_params_equal(flat[1]["at_save"], reference[2]["at_save"])
    assert_params_close(flat[0]["params"], reference[0]["params"], rtol=1e-5, atol=1e-6)
    back = ranks(4).run(ckpt_rank, "fsdp", "2x2", there, None, 32)
    assert_all_equal(back)
    assert_params_equal(back[2]["at_save"], reference[2]["at_save"])
    assert_params_close(back[0]["params"], reference[0]["params"], rtol=1e-5, atol=1e-6)


def test_another_number_of_replicas_starts_every_replica_from_replica_0(ranks, tmp_path) -> None:
    """2 replicas -> 1 (1 x 4) or 4 (4 x 1): the global values and the outer state are resharded,
    every new replica starts from replica 0's parameters (and state); training goes on, every rank
    alike at the end."""
    saved = str(tmp_path / "ckpt")
    reference = ranks(4).run(ckpt_rank, "fsdp", "2x2", None, saved)
    for layout in ("1x4", "4x1"):
        moved = ranks(4).run(ckpt_rank, "fsdp", layout, saved, None)
        for result in moved:
            assert_params_equal(result["at_save"], reference[0]["at_save"])
        assert_all_equal(moved)
