"""acco across replica groups, FSDP2 or tensor parallelism inside (2-D DeviceMesh), on 4 gloo ranks.

Mesh ``(R, S) = (2, 2)`` with dims ``("replicate", "shard")``: global rank ``g`` is replica
``g // S`` and position ``g % S`` inside it. Every rank of a replica group uses the same
weights (FSDP2 averages inside the group; tensor parallelism computes one micro-batch on
all its ranks); replicas use different ones. References:

- ``sync``: FSDP2 HSDP (``fully_shard(model, mesh=mesh)``, the same base optimizer and
  ``clip_grad_norm_``) and one-process training on the global batch (tests/reference.py);
- ``acco`` / ``dpu``: flat acco on 4 ranks with the same micro-batches and the recurrences.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from acco import AccoOptimizer
from tests.helpers import TIMEOUT, assert_params_close, assert_params_equal
from tests.reference import OPTIMIZERS, RECURRENCES, loss_fn, make_model, micro_batch, params_of

pytestmark = pytest.mark.timeout(180)

R = S = 2
ROUNDS = 4
MAX_NORM = 0.05  # small enough that every update is clipped
TOLERANCE = {"sgd": 1e-5, "adamw": 1e-4}


def weight_of(round_: int, replica: int, index: int) -> float:
    """The micro-batch size (its weight) of a replica group: unequal across replicas."""
    return float(1 + (5 * round_ + 3 * replica + index) % 4)


def data_of(inner: str, round_: int, rank: int, index: int, weighted: bool) -> tuple[torch.Tensor, torch.Tensor, float]:
    """A rank's micro-batch: its own under FSDP2 (and flat), its replica group's under TP."""
    replica = rank // S
    source = replica if inner == "tp" else rank
    size = int(weight_of(round_, replica, index)) if weighted else 4
    x, y = micro_batch(round_, source, index, size=size)
    return x, y, float(size)


def global_rounds(inner: str, weighted: bool) -> list[list[tuple[torch.Tensor, torch.Tensor, float]]]:
    """Every micro-batch of each round once, with its weight, for the references."""
    sources = range(R) if inner == "tp" else range(R * S)
    rank_of = (lambda source: source * S) if inner == "tp" else (lambda source: source)
    return [
        [data_of(inner, r, rank_of(source), i, weighted) for source in sources for i in range(2)] for r in range(ROUNDS)
    ]


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole parameters (DTensors gathered: collective), as plain tensors."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def hidden_of(inner: str) -> int:
    """Tensor parallelism's plans shard evenly only; FSDP2 gets odd (uneven) shards."""
    return 8 if inner == "tp" else 7


def build(inner: str, mesh, mixed: bool = False) -> torch.nn.Module:
    model = make_model(hidden=hidden_of(inner))
    if inner == "fsdp":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else MixedPrecisionPolicy()
        for index in (0, 2):
            fully_shard(model[index], mesh=mesh["shard"], mp_policy=policy)
        fully_shard(model, mesh=mesh["shard"], mp_policy=policy)
    elif inner == "tp":
        parallelize_module(model, mesh["shard"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    elif inner == "hsdp":
        for index in (0, 2):
            fully_shard(model[index], mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def train_rank(inner: str, mode: str, optimizer: str, weighted: bool, fold: str = "accumulate",
               mixed: bool = False, shape: tuple[int, int] = (R, S)) -> dict:
    """One rank: acco across ``mesh["replicate"]``, ``inner`` inside (``"flat"``: plain
    parameters, acco over all ranks)."""
    rank = dist.get_rank()
    cls, hp = OPTIMIZERS[optimizer]
    if inner == "flat":
        model, group = make_model(), None
    else:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        model, group = build(inner, mesh, mixed), mesh["replicate"].get_group()
    opt = AccoOptimizer(model, cls, process_group=group, mode=mode, max_grad_norm=MAX_NORM, timeout=TIMEOUT, **hp)
    for r in range(ROUNDS):
        for i in range(2):
            x, y, w = data_of("tp" if inner == "tp" else "fsdp", r, rank, i, weighted)
            if fold == "micro_batch":
                with opt.micro_batch(weight=w):
                    loss_fn(model, x, y).backward()
            else:
                loss_fn(model, x, y).backward()
                opt.accumulate(weight=w if weighted else None)
        opt.step()
    opt.finish()
    return {"params": full_params(model), "norms": [s.grad_norm for s in opt.round_stats if s.grad_norm is not None]}


def hsdp_rank(optimizer: str) -> dict:
    """FSDP2 HSDP on the 2-D mesh: its all-reduce across replicas in every backward."""
    cls, hp = OPTIMIZERS[optimizer]
    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
    model = build("hsdp", mesh)
    opt = cls(model.parameters(), **hp)
    for r in range(ROUNDS):
        for i in range(2):
            x, y, _ = data_of("fsdp", r, dist.get_rank(), i, weighted=False)
            (loss_fn(model, x, y) / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
    return {"params": full_params(model)}


def assert_all_ranks_equal(results: list[dict]) -> None:
    for rank, result in enumerate(results[1:], start=1):
        assert_params_equal(result["params"], results[0]["params"]), rank


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("inner", ["fsdp", "tp"])
def test_sync_equals_hsdp_and_one_process_training(ranks, inner, optimizer) -> None:
    """acco ``sync`` across replicas, FSDP2 / TP inside, clipped: equal to one process on the
    global batch with unequal weights, and (equal weights) to FSDP2 HSDP; every rank ends
    with the same full parameters."""
    pool, tol = ranks(4), TOLERANCE[optimizer]
    fold = "micro_batch" if optimizer == "adamw" else "accumulate"
    weighted = pool.run(train_rank, inner, "sync", optimizer, True, fold)
    assert_all_ranks_equal(weighted)
    init = params_of(make_model(hidden=hidden_of(inner)))
    expected = RECURRENCES["sync"](init, optimizer, global_rounds(inner, True), max_norm=MAX_NORM)
    assert_params_close(weighted[0]["params"], expected, rtol=tol, atol=tol)
    equal = pool.run(train_rank, inner, "sync", optimizer, False)
    assert_params_close(equal[0]["params"], RECURRENCES["sync"](init, optimizer, global_rounds(inner, False), max_norm=MAX_NORM), rtol=tol, atol=tol)
    if inner == "fsdp":
        hsdp = pool.run(hsdp_rank, optimizer)
        assert_params_close(equal[0]["params"], hsdp[0]["params"], rtol=tol, atol=tol)


@pytest.mark.parametrize("mode", ["acco", "dpu"])
@pytest.mark.parametrize("inner", ["fsdp", "tp"])
def test_acco_and_dpu_equal_flat_acco_and_the_recurrences(ranks, inner, mode) -> None:
    """acco / dpu with FSDP2 or TP inside, unequal weights, clipping: equal to flat acco on 4
    ranks fed the same micro-batches and to the one-process recurrence."""
    pool = ranks(4)
    for optimizer in ("sgd", "adamw"):
        tol = TOLERANCE[optimizer]
        mesh = pool.run(train_rank, inner, mode, optimizer, True)
        assert_all_ranks_equal(mesh)
        expected = RECURRENCES[mode](params_of(make_model(hidden=hidden_of(inner))), optimizer, global_rounds(inner, True), max_norm=MAX_NORM)
        assert_params_close(mesh[0]["params"], expected, rtol=tol, atol=tol)
        if inner == "fsdp":  # flat acco sees each rank's micro-batch: the same global batch
            flat = pool.run(train_rank, "flat", mode, optimizer, True)
            assert_params_close(mesh[0]["params"], flat[0]["params"], rtol=tol, atol=tol)


def test_one_rank_inside_equals_the_flat_path_bit_for_bit(ranks) -> None:
    """S = 1 (FSDP2 on a mesh of one rank per replica group): the DTensor path is the flat path."""
    pool = ranks(4)
    for mode in ("acco", "sync"):
        mesh = pool.run(train_rank, "fsdp", mode, "adamw", True, "micro_batch", False, (4, 1))
        flat = pool.run(train_rank, "flat", mode, "adamw", True, "micro_batch")
        assert_params_equal(mesh[0]["params"], flat[0]["params"])
        assert mesh[0]["norms"] == flat[0]["norms"]


def test_bf16_parameters_with_fp32_reduce(ranks) -> None:
    """FSDP2's MixedPrecisionPolicy (bf16 all-gather and compute, fp32 reduce): within 2e-2 of fp32."""
    pool = ranks(4)
    mixed = pool.run(train_rank, "fsdp", "acco", "adamw", True, "accumulate", True)
    exact = pool.run(train_rank, "fsdp", "acco", "adamw", True, "accumulate", False)
    assert_all_ranks_equal(mixed)
    assert_params_close(mixed[0]["params"], exact[0]["params"], rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------------------- checkpoints

SAVE_AFTER, CKPT_ROUNDS = 3, 6  # saved with an estimate in flight and its gradients pending


def layout_model(layout: str, seed: int = 0):
    """A model and acco's group for ``layout``: ``"RxS"`` (FSDP2 inside) or ``"flat"``."""
    model = make_model(seed=seed)
    if layout == "flat":
        return model, None
    shape = tuple(int(n) for n in layout.split("x"))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    for index in (0, 2):
        fully_shard(model[index], mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    return model, mesh["replicate"].get_group()


def ckpt_rounds(model, opt, rounds: range, sources: list[int]) -> None:
    """Rounds of 2 micro-batches of each source (4 sources in all, split over the ranks)."""
    for r in rounds:
        for source in sources:
            for i in range(2):
                loss_fn(model, *micro_batch(r, source, i)).backward()
                opt.accumulate()
        opt.step()


def ckpt_rank(layout: str, load_from: str | None, save_to: str | None, mode: str = "acco") -> dict:
    """Train (or load at round SAVE_AFTER), optionally save there, continue to CKPT_ROUNDS."""
    from acco import checkpoint

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    sources = list(range(rank * 4 // world, (rank + 1) * 4 // world))
    # A model that loads starts elsewhere: the checkpoint must bring its parameters.
    model, group = layout_model(layout, seed=0 if load_from is None else 1)
    cls, hp = OPTIMIZERS["adamw"]
    opt = AccoOptimizer(model, cls, process_group=group, mode=mode, max_grad_norm=MAX_NORM, timeout=TIMEOUT, **hp)
    if load_from is None:
        ckpt_rounds(model, opt, range(SAVE_AFTER), sources)
    else:
        checkpoint.load(load_from, opt, model)
    if save_to is not None:
        checkpoint.save(save_to, opt, model)
    ckpt_rounds(model, opt, range(SAVE_AFTER, CKPT_ROUNDS), sources)
    opt.finish()
    return {"params": full_params(model)}


@pytest.mark.timeout(300)
def test_checkpoints_reshard_between_meshes_flat_ranks_and_one_rank(ranks, tmp_path) -> None:
    """Saved at (2, 2) with an estimate in flight: continuation at (2, 2) is bit-identical;
    at (1, 4), (4, 1), flat 4 ranks and 1 rank equal to 1e-6; and each of those saves a
    checkpoint that (2, 2) loads back."""
    pool = ranks(4)
    saved = str(tmp_path / "at-2x2")
    reference = pool.run(ckpt_rank, "2x2", None, saved)[0]["params"]
    again = pool.run(ckpt_rank, "2x2", saved, None)
    assert_all_ranks_equal(again)
    assert_params_equal(again[0]["params"], reference)
    for layout in ("1x4", "4x1", "flat"):
        there = str(tmp_path / f"at-{layout}")
        moved = pool.run(ckpt_rank, layout, saved, there)
        assert_all_ranks_equal(moved)
        assert_params_close(moved[0]["params"], reference, rtol=1e-6, atol=1e-6)
        back = pool.run(ckpt_rank, "2x2", there, None)
        assert_params_close(back[0]["params"], reference, rtol=1e-6, atol=1e-6)
    alone = str(tmp_path / "at-1")
    one = ckpt_rank("flat", saved, alone)  # this process: no process group
    assert_params_close(one["params"], reference, rtol=1e-6, atol=1e-6)
    back = pool.run(ckpt_rank, "2x2", alone, None)
    assert_params_close(back[0]["params"], reference, rtol=1e-6, atol=1e-6)


def test_optimizer_state_reaches_dcp_whole_at_its_global_offsets(ranks, tmp_path) -> None:
    """Every per-parameter entry of a (2, 2) checkpoint is stored whole (its chunks cover the
    tensor): ZeRO-1 slices saved as plain tensors under one key would keep one rank's only."""
    import torch.distributed.checkpoint as dcp

    pool = ranks(4)
    saved = str(tmp_path / "ckpt")
    pool.run(ckpt_rank, "2x2", None, saved)
    entries = dcp.FileSystemReader(saved).read_metadata().state_dict_metadata
    portable = {k: v for k, v in entries.items() if k.startswith("acco.portable.") and not k.endswith("skeleton")}
    assert any(k.endswith(".exp_avg") for k in portable) and any(k.endswith(".acco_master") for k in portable)
    for key, entry in portable.items():
        covered = sum(torch.Size(c.sizes).numel() for c in entry.chunks)
        assert covered == entry.size.numel(), f"{key}: chunks cover {covered} of {entry.size.numel()} elements"
        assert len(entry.chunks) == 2, f"{key}: stored as {len(entry.chunks)} chunks, not S = 2 blocks"


def state_dict_api_rank() -> dict:
    """torch's get/set_optimizer_state_dict move acco's state between two optimizers."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    rank = dist.get_rank()
    model, group = layout_model("2x2")
    cls, hp = OPTIMIZERS["adamw"]
    opt = AccoOptimizer(model, cls, process_group=group, mode="acco", timeout=TIMEOUT, **hp)
    ckpt_rounds(model, opt, range(SAVE_AFTER), [rank])
    state = get_optimizer_state_dict(model, opt)
    kinds = {type(v).__name__ for entry in state["state"].values() for k, v in entry.items() if k == "exp_avg"}
    twin, twin_group = layout_model("2x2")
    twin.load_state_dict(model.state_dict())
    twin_opt = AccoOptimizer(twin, cls, process_group=twin_group, mode="acco", timeout=TIMEOUT, **hp)
    set_optimizer_state_dict(twin, twin_opt, state)
    for m, o in ((model, opt), (twin, twin_opt)):
        ckpt_rounds(m, o, range(SAVE_AFTER, CKPT_ROUNDS), [rank])
        o.finish()
    return {"params": full_params(model), "twin": full_params(twin), "keys": sorted(state["state"]), "kinds": kinds}


def test_get_and_set_optimizer_state_dict(ranks) -> None:
    results = ranks(4).run(state_dict_api_rank)
    assert results[0]["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert results[0]["kinds"] == {"DTensor"}
    for result in results:
        assert_params_equal(result["twin"], result["params"])


def divide_factor_rank(factor: float | None) -> dict:
    """FSDP2 summing inside the group (torchtitan's set_gradient_divide_factor(1.0)) or
    averaging (its default): acco's update is the global mean either way."""
    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
    model = build("fsdp", mesh)
    if factor is not None:
        model.set_gradient_divide_factor(factor)
        model.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    cls, hp = OPTIMIZERS["sgd"]
    opt = AccoOptimizer(model, cls, process_group=mesh["replicate"].get_group(), mode="sync", timeout=TIMEOUT, **hp)
    for r in range(2):
        for i in range(2):
            loss_fn(model, *micro_batch(r, dist.get_rank(), i)).backward()
            opt.accumulate()
        opt.step()
    opt.finish()
    return {"params": full_params(model)}


def test_gradient_divide_factor_is_undone(ranks) -> None:
    pool = ranks(4)
    default = pool.run(divide_factor_rank, None)
    summed = pool.run(divide_factor_rank, 1.0)
    assert_params_close(summed[0]["params"], default[0]["params"], rtol=1e-6, atol=1e-6)


def misuse_rank() -> list[str]:
    """Each refused setting raises ValueError on every rank, before any collective."""
    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
    group = mesh["replicate"].get_group()
    messages = []
    for make, kwargs in (
        (lambda: build("hsdp", mesh), {}),  # FSDP2 given the replicate dimension
        (lambda: build("fsdp", mesh), {"param_dtype": torch.bfloat16}),
        (lambda: build("fsdp", mesh), {"layout": "tensor"}),
        (lambda: build("fsdp", mesh), {"process_group": None}),  # acco over the ranks FSDP2 shards over
    ):
        try:
            AccoOptimizer(make(), torch.optim.AdamW, **{"process_group": group, **kwargs}, timeout=TIMEOUT)
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_refused_settings_raise_before_any_collective(ranks) -> None:
    for messages in ranks(4).run(misuse_rank):
        assert len(messages) == 4, messages
        assert "HSDP" in messages[0] and "MixedPrecisionPolicy" in messages[1]
        assert "whole tensors" in messages[2] and "shares ranks" in messages[3]


def features_rank() -> dict:
    """The ready() loop, the light estimate, a NaN on one rank skipped everywhere, eval()."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
    model = build("fsdp", mesh)
    cls, hp = OPTIMIZERS["adamw"]
    opt = AccoOptimizer(model, cls, process_group=mesh["replicate"].get_group(), mode="acco",
                        estimate_dtype=torch.bfloat16, nonfinite="skip", max_grad_norm=1.0, timeout=TIMEOUT, **hp)
    counts, evals = [], []
    for r in range(8):
        n = 0
        while n < 1 or not opt.ready():  # at least one micro-batch, more while the round is in flight
            loss = loss_fn(model, *micro_batch(r, rank, n))
            if r == 4 and rank == 1 and n == 0:
                loss = loss * float("nan")  # one rank of one replica group
            loss.backward()
            opt.accumulate()
            n += 1
        counts.append(n)
        opt.step()
        if r == 5:
            before = full_params(model)
            opt.eval()
            evals.append(full_params(model))
            opt.train()
            assert_params_equal(full_params(model), before)
    opt.finish()
    return {"params": full_params(model), "counts": counts, "skipped": opt.skipped_updates,
            "updates": opt.num_updates}


def test_ready_loop_light_estimate_and_a_skipped_nan_on_a_mesh(ranks) -> None:
    """Every acco feature on the mesh: the ranks of a replica group run the same number of
    micro-batches in the ready() loop, a NaN on one rank skips the update on all, and every
    rank ends with the same finite parameters."""
    results = ranks(4).run(features_rank)
    assert_all_ranks_equal(results)
    for replica in range(R):
        assert results[replica * S]["counts"] == results[replica * S + 1]["counts"]
    assert {r["skipped"] for r in results} == {1}
    assert {r["updates"] for r in results} == {results[0]["updates"]}
    assert all(torch.isfinite(v).all() for v in results[0]["params"].values())


def fresh_forward_rank() -> dict:
    """After eval() (a forward with no backward: FSDP2 keeps the root's parameters unsharded)
    and train(), the next forward must read the live values acco put back into the shards,
    in every mode. The root module holds parameters of its own (layer 2 is not wrapped)."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
    fresh = {}
    for mode in ("acco", "local"):
        model = make_model(hidden=7)
        fully_shard(model[0], mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])  # layer 2's parameters: the root's
        cls, hp = OPTIMIZERS["adamw"]
        opt = AccoOptimizer(model, cls, process_group=mesh["replicate"].get_group(), mode=mode, timeout=TIMEOUT,
                            **({"sync_every": 2} if mode == "local" else {}), **hp)
        x, _ = micro_batch(0, rank, 0)
        same = []
        for r in range(4):
            for n in range(2):
                loss_fn(model, *micro_batch(r, rank, n)).backward()
                opt.accumulate()
            opt.step()
            opt.eval()
            with torch.no_grad():
                model(x)
            opt.train()
            with torch.no_grad():
                seen = model(x)
                for module in model.modules():  # what an all-gather of the shards gives
                    if hasattr(module, "reshard"):
                        module.reshard()
                same.append(torch.equal(seen, model(x)))
        opt.finish()
        fresh[mode] = same
    return fresh


def test_the_forward_after_eval_and_train_reads_the_live_values(ranks) -> None:
    """FSDP2 keeps a module's parameters unsharded after a forward that no backward followed;
    acco writes into the shards, so without a reshard the next forward would read the
    evaluated values (acco.mesh.FreshForward)."""
    for fresh in ranks(4).run(fresh_forward_rank):
        assert fresh == {"acco": [True] * 4, "local": [True] * 4}, fresh


def ready_loop_rank() -> dict:
    """The ready() loop with replica group 1 slower: the groups fold different numbers of
    micro-batches each round; what each rank folded is returned for the reference."""
    import time

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
    model = build("fsdp", mesh)
    cls, hp = OPTIMIZERS["sgd"]
    opt = AccoOptimizer(model, cls, process_group=mesh["replicate"].get_group(), mode="acco", max_grad_norm=MAX_NORM,
                        timeout=TIMEOUT, **hp)  # fmt: skip
    counts = []
    for r in range(ROUNDS * 2):
        n = 0
        while n < 1 or not opt.ready():
            loss_fn(model, *micro_batch(r, rank, n)).backward()
            opt.accumulate()
            n += 1
            if rank // S == 1:
                time.sleep(0.02)  # a slower replica group: the other one accumulates meanwhile
        counts.append(n)
        opt.step()
    opt.finish()
    return {"params": full_params(model), "counts": counts}


def test_ready_loop_equals_the_recurrence_on_the_micro_batches_each_rank_folded(ranks) -> None:
    results = ranks(4).run(ready_loop_rank)
    assert_all_ranks_equal(results)
    rounds = [
        [(*micro_batch(r, rank, i), 1.0) for rank in range(R * S) for i in range(results[rank]["counts"][r])]
        for r in range(ROUNDS * 2)
    ]
    expected = RECURRENCES["acco"](params_of(make_model()), "sgd", rounds, max_norm=MAX_NORM)
    assert_params_close(results[0]["params"], expected, rtol=TOLERANCE["sgd"], atol=TOLERANCE["sgd"])
