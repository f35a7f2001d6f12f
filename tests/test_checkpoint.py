"""Checkpoints: exact resume, resharding to another world size, refusing bad files."""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from acco import AccoOptimizer, checkpoint
from tests.helpers import TIMEOUT
from tests.ranks import RankPool
from tests.reference import OPTIMIZERS, RECURRENCES, loss_fn, make_model, micro_batch, params_of

pytestmark = pytest.mark.timeout(180)
GLOBAL_MICRO_BATCHES = 6  # per round, split over the ranks: 6 on 1 rank, 3 on 2, 2 on 3
CONFIGS = [(mode, layout) for mode in ("sync", "dpu", "acco") for layout in ("flat", "tensor")]


def rank_info() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def build(mode: str, layout: str, optimizer: str = "adamw", seed: int | None = None):
    rank, _ = rank_info()
    model = make_model(seed=rank if seed is None else seed)
    cls, hp = OPTIMIZERS[optimizer]
    return model, AccoOptimizer(model, cls, mode=mode, layout=layout, timeout=TIMEOUT, **hp)


def train_rounds(model, opt, first: int, last: int) -> None:
    """Rounds [first, last): this rank's share of each round's global micro-batches."""
    rank, world_size = rank_info()
    for r in range(first, last):
        for index in range(rank, GLOBAL_MICRO_BATCHES, world_size):
            loss_fn(model, *micro_batch(r, 0, index)).backward()
            opt.accumulate()
        opt.step()


def snapshot(model, opt) -> dict:
    """The whole optimizer state (rank 0), then the committed parameters after finish()."""
    full = checkpoint.full_state_dict(opt)
    opt.finish()
    return {"params": params_of(model), "optimizer": full}


def run_and_save(directory: str, rounds: int, save_at: int) -> dict:
    """For every mode and layout: train, save at ``save_at``, keep going to ``rounds``."""
    results = {}
    for mode, layout in CONFIGS:
        model, opt = build(mode, layout)
        train_rounds(model, opt, 0, save_at)
        checkpoint.save(Path(directory) / f"{mode}-{layout}", opt, model, extra={"next_round": save_at})
        train_rounds(model, opt, save_at, rounds)
        results[(mode, layout)] = snapshot(model, opt)
    return results


def resume(directory: str, rounds: int, mode: str, layout: str, new_layout: str | None = None) -> dict:
    model, opt = build(mode, new_layout or layout, seed=100)  # a different start: all must come from the file
    extra = checkpoint.load(Path(directory) / f"{mode}-{layout}", opt, model)
    train_rounds(model, opt, extra["next_round"], rounds)
    return snapshot(model, opt)


def resume_all(directory: str, rounds: int) -> dict:
    return {config: resume(directory, rounds, *config) for config in CONFIGS}


def assert_same_state(a: dict | None, b: dict | None, exact: bool = True) -> None:
    if a is None or b is None:
        assert a is b
        return
    check = (lambda x, y: torch.equal(x, y)) if exact else (
        lambda x, y: torch.allclose(x, y, rtol=1e-5, atol=1e-5))
    for x, y in zip(_tensors(a), _tensors(b)):
        assert x.shape == y.shape and check(x, y)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            yield from _tensors(value[k])
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


@pytest.fixture(scope="module")
def saved_on_two_ranks(ranks, tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("ckpt"))
    results = ranks(2).run(run_and_save, directory, 8, 3, timeout=150)
    return directory, results


def test_resume_in_fresh_processes_is_bit_identical(saved_on_two_ranks) -> None:
    """Saved at round 3 on 2 ranks and resumed in new processes, every mode and layout ends bit for bit
    where the uninterrupted run does, optimizer state included."""
    directory, uninterrupted = saved_on_two_ranks
    fresh = RankPool(2)  # new processes: nothing survives but the files
    try:
        resumed = fresh.run(resume_all, directory, 8, timeout=150)
    finally:
        fresh.close()
    for rank in range(2):
        for config in CONFIGS:
            assert_same_state(uninterrupted[rank][config]["params"], resumed[rank][config]["params"])
            assert_same_state(uninterrupted[rank][config]["optimizer"], resumed[rank][config]["optimizer"])


@pytest.mark.parametrize("world_size", [1, 3])
def test_reshard_from_two_ranks(ranks, saved_on_two_ranks, world_size) -> None:
    """A 2-rank checkpoint loads on 1 or 3 ranks, into either layout: sync ends where the uninterrupted
    run does, acco follows its recurrence, and all ranks agree."""
    directory, uninterrupted = saved_on_two_ranks
    jobs = [("sync", "flat", "flat"), ("sync", "tensor", "flat"), ("acco", "flat", "tensor"), ("acco", "tensor", "tensor")]
    for mode, layout, new_layout in jobs:
        if world_size == 1:
            results = [resume(directory, 8, mode, layout, new_layout)]
        else:
            results = ranks(world_size).run(resume, directory, 8, mode, layout, new_layout)
        params = results[0]["params"]
        if mode == "sync":
            assert_same_state(params, uninterrupted[0][(mode, layout)]["params"], exact=False)
        else:
            data = [[(*micro_batch(r, 0, i), 1.0) for i in range(GLOBAL_MICRO_BATCHES)] for r in range(8)]
            expected = RECURRENCES["acco"](params_of(make_model(seed=0)), "adamw", data)
            assert_same_state(params, expected, exact=False)
        for other in results[1:]:
            assert_same_state(params, other["params"])


def a_bad_load(directory: str, what: str) -> str:
    """Try a load that must fail; check that nothing changed."""
    if what == "other model":
        model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        opt = AccoOptimizer(model, torch.optim.AdamW, mode="acco", timeout=TIMEOUT)
    else:
        model, opt = build("acco", "flat", "sgd" if what == "other optimizer" else "adamw")
    before = (params_of(model), opt.state_dict())
    try:
        checkpoint.load(Path(directory) / "acco-flat", opt, model)
    except ValueError as error:
        after = (params_of(model), opt.state_dict())
        assert_same_state(before[0], after[0])
        assert_same_state(before[1], after[1])
        loss_fn(model, *micro_batch(0, 0, 0)).backward()  # still usable
        opt.accumulate()
        opt.step()
        opt.finish()
        return str(error)
    return "loaded"


def saved_value_offset(directory: Path, content: bytes) -> int:
    """Where, in rank 0's data file, a byte of its largest float32 tensor lies (a flip
    anywhere else may hit bytes of the container that nothing reads)."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(directory))
    entries = {k: e for k, e in reader.read_metadata().state_dict_metadata.items()
               if k.startswith("acco.rank0.") and getattr(e, "properties", None) is not None
               and e.properties.dtype == torch.float32}
    key = max(entries, key=lambda k: entries[k].size.numel())
    state = {key: torch.empty(entries[key].size)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, no_dist=True)
    raw = state[key].numpy().tobytes()
    start = content.find(raw)
    assert start >= 0, "the tensor's bytes are not stored as they are"
    return start + len(raw) // 2


def test_a_mismatched_or_damaged_checkpoint_is_refused_on_every_rank(ranks, saved_on_two_ranks, tmp_path) -> None:
    """Another model, another optimizer, a flipped byte or a truncated file: a ValueError on every
    rank, with the model and optimizer unchanged and still usable."""
    directory, _ = saved_on_two_ranks
    for what, message in (("other model", "shape|does not match"), ("other optimizer", "optimizer_class")):
        for error in ranks(2).run(a_bad_load, directory, what):
            assert __import__("re").search(message, error), error
    # Damage copies of the checkpoint: one byte flipped, one file truncated.
    import shutil

    for damage in ("flip", "truncate"):
        copy = tmp_path / damage
        shutil.copytree(directory, copy)
        data_file = sorted((copy / "acco-flat").glob("*.distcp"))[0]
        content = bytearray(data_file.read_bytes())
        if damage == "flip":
            content[saved_value_offset(copy / "acco-flat", content)] ^= 0xFF
        else:
            content = content[: len(content) // 2]
        data_file.write_bytes(bytes(content))
        for error in ranks(2).run(a_bad_load, str(copy), "same"):
            assert error != "loaded" and ("corrupted" in error or "reading the checkpoint failed" in error), error


class Payload:
    def __reduce__(self):
        return (exec, ("raise SystemExit('the payload ran')",))


def test_a_pickle_payload_is_refused_without_running_it(tmp_path) -> None:
    """A pickled payload in a checkpoint's metadata is refused before it can run."""
    model, opt = build("sync", "flat")
    # A torch.save file carrying a payload next to a real state dict.
    path = tmp_path / "state.pt"
    torch.save({"optimizer": opt.state_dict(), "payload": Payload()}, path)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    # A DCP checkpoint whose metadata carries a payload.
    saved = checkpoint.save(tmp_path / "ckpt", opt, model)
    metadata = saved / ".metadata"
    metadata.write_bytes(pickle.dumps(Payload()))
    with pytest.raises(ValueError, match="refusing to load builtins.exec"):
        checkpoint.load(saved, opt, model)
    opt.finish()


def test_state_dict_round_trips_through_weights_only_load() -> None:
    """state_dict() survives torch.load(weights_only=True), records the round in flight, and loads only
    into a fresh optimizer."""
    model, opt = build("acco", "tensor")
    train_rounds(model, opt, 0, 3)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state["acco"]["round"]["in_flight_kind"] == "estimate"
    assert state["acco"]["num_updates"] == 1
    opt.finish()
    with pytest.raises(RuntimeError, match="fresh optimizer"):
        other_model, other = build("acco", "tensor")
        train_rounds(other_model, other, 0, 1)
        other.load_state_dict(state)


def test_latest_names_only_complete_checkpoints(tmp_path) -> None:
    """latest_checkpoint() ignores a save that died half-way."""
    model, opt = build("sync", "flat")
    assert checkpoint.latest_checkpoint(tmp_path) is None
    first = checkpoint.save(tmp_path / "step-1", opt, model)
    (tmp_path / "step-2.partial").mkdir()  # a save that died half-way
    assert checkpoint.latest_checkpoint(tmp_path) == first
    opt.finish()
