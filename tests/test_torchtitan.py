"""acco as the optimizer of torchtitan's Trainer (acco.integrations.torchtitan), on gloo ranks.

Each job launches fresh processes as torchrun would (``run_fresh``) and builds torchtitan's
Trainer from the ``acco_llama3_debugmodel`` recipe, shrunk to short windows so that a step
takes a fraction of a second on CPU:

- refusals raise before any process group exists (fast tier, in this process);
- ``sync`` mode against torchtitan's own AdamW container (the stock Trainer, every rank a
  replica) on the same config and data, clipping on: parameters within 1e-5 after 3 steps
  (fast tier: one launch, about a minute on 2 loaded cores) and after 10 (stress tier);
- stress tier (each launch pays torchtitan's import and a trainer's set-up per run, one to
  five minutes on 2 shared cores): ``acco``, ``dpu`` and ``local`` train (the loss falls); a
  DCP checkpoint at step 10 resumed to 20 in new processes ends within 1e-6 of the
  uninterrupted run in ``acco`` and ``local`` mode; a 2x2 mesh (FSDP2 inside, 4 processes)
  trains and ends with the same parameters on every rank; the documented torchrun command runs.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchtitan")
pytest.importorskip("triton")  # torchtitan's Trainer imports it (an expert-parallel kernel module)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.ranks import ROOT, RankLost, run_fresh  # noqa: E402

pytestmark = pytest.mark.timeout(900)


def _config(root: str, mode: str, steps: int, **optimizer: Any) -> Any:
    """The recipe, shrunk: windows of 32 tokens, 2 a micro-batch, 2 micro-batches a step, fp32."""
    from acco.integrations.torchtitan import acco_adamw, acco_llama3_debugmodel

    config = acco_llama3_debugmodel()
    config.optimizer = acco_adamw(mode=mode, lr=8e-4, implementation="for-loop", **optimizer)
    config.training.steps = steps
    config.training.seq_len = 32
    config.training.local_batch_size = 2
    config.training.mixed_precision_param = "float32"
    config.debug.seed = 7
    config.dump_folder = root
    config.metrics.log_freq = 1
    return config


def _train(config: Any, trainer_class: Any = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Build and train; the logged losses and the model's full parameters at the end."""
    from acco.integrations.torchtitan import AccoTrainer

    trainer = (trainer_class or AccoTrainer)(config)
    losses: list[float] = []
    log = trainer.metrics_processor.log

    def record(step: int, loss: float, *args: Any, **kwargs: Any) -> None:
        losses.append(float(loss))
        log(step, loss, *args, **kwargs)

    trainer.metrics_processor.log = record
    try:
        trainer.train()
        params = {name: _full(p).clone() for name, p in trainer.model_parts[0].named_parameters()}
    finally:
        trainer.close()
    return losses, params


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor().detach() if hasattr(tensor, "full_tensor") else tensor.detach()


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# ------------------------------------------------------------------------------ jobs


def job_sync_parity(root: str, steps: int = 10) -> dict[str, Any]:
    """torchtitan's AdamW container, then acco's sync mode, on the same config and data,
    clipping at the recipe's ``max_norm`` 1.0 in both (active at every step: norms 2-4.7).

    torchtitan's ``clip_grad_norm_`` measures the norm with ``torch.nn.utils.get_total_norm``
    in float32, whose CPU kernel sums a tensor's squares in one float32 accumulator (no
    cascade summation, pytorch/pytorch#169237): on ``lm_head``'s 524,288 gradients it comes
    out 2e-4 below the exact norm, so the stock run clips each step by a slightly different
    factor (its norms 1.5e-4 low in all) and ends 1.1e-5 from acco, whose norm sums the
    squares in float64. The stock Trainer is given the same procedure with an exact norm
    (:func:`_exact_clip_grad_norm_`); everything else is torchtitan's.
    """
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.trainer import Trainer

    from acco.integrations.torchtitan import set_timeouts_on_this_torch, use_cpu_without_accelerator

    use_cpu_without_accelerator()
    set_timeouts_on_this_torch()
    stock = _config(os.path.join(root, "stock"), "sync", steps=steps)
    stock.optimizer = default_adamw(lr=8e-4, foreach=False, fused=False)
    stock.checkpoint = CheckpointManager.Config()
    stock.training.global_batch_size = 2 * stock.training.local_batch_size * 2  # 2 micro-batches, 2 ranks
    stock.parallelism.data_parallel_replicate_degree = 2  # every rank a replica, as acco's
    assert stock.training.max_norm == 1.0
    stock_norms: list[float] = []
    torchtitans_clip = dist_utils.clip_grad_norm_
    dist_utils.clip_grad_norm_ = functools.partial(_exact_clip_grad_norm_, stock_norms)
    try:
        stock_losses, stock_params = _train(stock, Trainer)
    finally:
        dist_utils.clip_grad_norm_ = torchtitans_clip
    config = _config(os.path.join(root, "acco"), "sync", steps=steps)
    acco_losses, acco_params = _train(config)
    return {"stock": stock_losses, "acco": acco_losses, "stock_norms": stock_norms,
            "difference": _max_difference(stock_params, acco_params),
            "moved": _max_difference(stock_params, {k: torch.zeros_like(v) for k, v in stock_params.items()})}


def _exact_clip_grad_norm_(norms: list[float], parameters: Any, max_norm: float, **kwargs: Any) -> torch.Tensor:
    """torchtitan's ``clip_grad_norm_`` (no pipeline or expert parallelism) with the norm's
    squares summed in float64, as acco sums them; the scaling is torch's own."""
    parameters = list(parameters)
    squares = sum(_full(p.grad).double().square().sum() for p in parameters if p.grad is not None)
    norm = torch.as_tensor(squares).sqrt()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm, kwargs.get("foreach"))
    norms.append(float(norm))
    return norm


def job_modes(root: str, steps: int) -> dict[str, list[float]]:
    return {mode: _train(_config(os.path.join(root, mode), mode, steps=steps, **_LOCAL.get(mode, {})))[0]
            for mode in ("acco", "dpu", "local")}


_LOCAL = {"local": {"sync_every": 4}}


def job_checkpointed(root: str, resume: bool, steps: int, modes: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    """Each mode to ``steps``, checkpoints every ``steps / 2`` (``resume``: from a copy of the
    uninterrupted run's middle checkpoint, in these new processes)."""
    finals = {}
    for mode in modes:
        config = _config(os.path.join(root, "resumed" if resume else "whole", mode), mode, steps=steps,
                         **_LOCAL.get(mode, {}))
        config.checkpoint.enable = True
        config.checkpoint.interval = steps // 2
        finals[mode] = _train(config)[1]
    return finals


def job_initial_load(root: str) -> dict[str, float]:
    """A model-only checkpoint of a run that moved far from the initial values (sync mode, lr
    1e-2, 3 steps), then a new run in ``acco`` mode from it (``checkpoint.initial_load_path``,
    2 steps at lr 8e-4): how far the first run moved, and how far the second ended from the
    values it loaded."""
    from acco.integrations.torchtitan import AccoTrainer, acco_adamw

    first = _config(os.path.join(root, "first"), "sync", steps=3)
    first.optimizer = acco_adamw(mode="sync", lr=1e-2, implementation="for-loop")
    first.checkpoint.enable = True
    first.checkpoint.interval = 3
    first.checkpoint.last_save_model_only = True
    trainer = AccoTrainer(copy.deepcopy(first))  # the initial values
    try:
        initial = {name: _full(p).clone() for name, p in trainer.model_parts[0].named_parameters()}
    finally:
        trainer.close()
    _, loaded = _train(first)
    second = _config(os.path.join(root, "second"), "acco", steps=2)
    second.checkpoint.enable = True
    second.checkpoint.initial_load_path = os.path.join(root, "first", "checkpoint", "step-3")
    _, ended = _train(second)
    return {"moved": _max_difference(loaded, initial), "from_loaded": _max_difference(ended, loaded)}


def job_mesh(root: str, steps: int) -> tuple[list[float], str]:
    """2 replica groups of 2 FSDP2 ranks, acco mode: the losses and a digest of the final
    parameters (the same on every rank)."""
    config = _config(os.path.join(root, "mesh"), "acco", steps=steps)
    config.parallelism.data_parallel_replicate_degree = 2
    config.parallelism.data_parallel_shard_degree = 2
    losses, params = _train(config)
    return losses, _digest(params)


def job_elastic_group(root: str, lighthouse: str, group: int, steps: int, die_at: int | None = None,
                      restarted: bool = False) -> dict[str, Any]:
    """One replica group of an elastic job (its own one-process "torchrun" job), local mode,
    an outer round every 2 steps through torchft: its losses, its rounds (participants,
    dropped, healed by content), the step it started at (a restarted group: its peer's) and a
    digest of its final parameters. ``die_at``: the process exits after that step, as a
    crashed job would; ``restarted``: torchrun's mark of a job it restarted."""
    if restarted:
        os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"
    config = _config(os.path.join(root, f"group-{group}"), "local", steps=steps, sync_every=2, elastic=True,
                     lighthouse=lighthouse, hostname="localhost", replica_group=group, replica_groups=2,
                     collective_timeout_seconds=60.0)  # fmt: skip
    record: dict[str, Any] = {"rounds": []}
    losses, params = _train(config, _recording(record, die_at))
    return {"losses": losses, "digest": _digest(params), **record}


def _recording(record: dict[str, Any], die_at: int | None) -> Any:
    from acco.integrations.torchtitan import AccoTrainer

    class Recording(AccoTrainer):
        def train(self) -> None:
            record["first_step"] = self.step + 1
            try:
                super().train()
            finally:
                acco = self.optimizers.acco
                rounds = acco.round_stats if acco is not None else ()
                record["rounds"] += [(r.participants, r.dropped, r.content_heal) for r in rounds
                                     if r.participants is not None]  # fmt: skip

        def train_step(self, data_iterator: Any) -> None:
            super().train_step(data_iterator)
            if self.step == die_at:
                os._exit(1)

    return Recording


def _digest(params: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(params):
        digest.update(params[name].numpy().tobytes())
    return digest.hexdigest()


def _falls(curve: list[float]) -> bool:
    """The loss falls: the mean of the last two steps at least 0.5 below that of the first two."""
    return sum(curve[-2:]) / 2 < sum(curve[:2]) / 2 - 0.5


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("steps", [3, pytest.param(10, marks=pytest.mark.stress)])
def test_sync_matches_torchtitan_adamw(tmp_path: Path, steps: int) -> None:
    """The bar's 10 steps in the stress tier; 3 in the fast tier (one launch, two trainers)."""
    results = run_fresh(job_sync_parity, str(tmp_path), steps, timeout=800)
    for rank in results:
        assert len(rank["stock"]) == len(rank["acco"]) == steps
        assert rank["moved"] > 1e-3  # the parameters trained
        assert min(rank["stock_norms"]) > 1.0, rank["stock_norms"]  # clipping at every step
        assert rank["difference"] < 1e-5, rank["difference"]
        assert abs(rank["stock"][-1] - rank["acco"][-1]) < 1e-4


@pytest.mark.parametrize("steps", [6, pytest.param(12, marks=pytest.mark.stress)])
def test_modes_train(tmp_path: Path, steps: int) -> None:
    losses = run_fresh(job_modes, str(tmp_path), steps, timeout=800)[0]
    for mode, curve in losses.items():
        assert len(curve) == steps, mode
        assert _falls(curve), (mode, curve)


@pytest.mark.timeout(1800)  # two launches
@pytest.mark.parametrize("steps, modes", [(4, ("acco",)),
                                          pytest.param(20, ("acco", "local"), marks=pytest.mark.stress)])
def test_checkpoint_resumes_exactly(tmp_path: Path, steps: int, modes: tuple[str, ...]) -> None:
    """The bar's 10 -> 20 in acco and local mode in the stress tier; 2 -> 4 in acco mode (a
    round in flight at the checkpoint) in the fast tier."""
    whole = run_fresh(job_checkpointed, str(tmp_path), False, steps, modes, timeout=800)
    for mode in modes:
        source = tmp_path / "whole" / mode / "checkpoint" / f"step-{steps // 2}"
        target = tmp_path / "resumed" / mode / "checkpoint" / f"step-{steps // 2}"
        assert (source / "acco" / ".metadata").is_file()
        shutil.copytree(source, target)
    resumed = run_fresh(job_checkpointed, str(tmp_path), True, steps, modes, timeout=800)
    for rank in range(2):
        for mode in modes:
            difference = _max_difference(whole[rank][mode], resumed[rank][mode])
            assert difference <= 1e-6, (mode, difference)


@pytest.mark.stress
def test_initial_load_is_what_acco_trains_from(tmp_path: Path) -> None:
    """A model-only load before the first step (initial weights) rebuilds acco from them: in
    acco mode, whose master shards are its own, training goes on from the loaded values."""
    for rank in run_fresh(job_initial_load, str(tmp_path), timeout=800):
        assert rank["moved"] > 1e-2, rank  # the loaded values are far from the initial ones
        assert rank["from_loaded"] < rank["moved"] / 5, rank  # 2 steps at lr 8e-4 from them


@pytest.mark.parametrize("steps", [4, pytest.param(10, marks=pytest.mark.stress)])
def test_mesh_2x2_trains(tmp_path: Path, steps: int) -> None:
    results = run_fresh(job_mesh, str(tmp_path), steps, world_size=4, timeout=800)
    losses = results[0][0]
    assert len(losses) == steps
    assert _falls(losses), losses
    assert len({digest for _, digest in results}) == 1  # every rank ends with the same parameters


@pytest.mark.parametrize("steps", [4, pytest.param(10, marks=pytest.mark.stress)])
def test_elastic_groups_train_together(tmp_path: Path, steps: int) -> None:
    """Two replica groups, each its own job, with ``optimizer.elastic`` (torchft's lighthouse in
    this process): every outer round has both, the loss falls, and both end with the same
    parameters."""
    pytest.importorskip("torchft")
    from tests.test_elastic import after_join, lighthouse

    server = lighthouse()
    try:
        with ThreadPoolExecutor(2) as pool:
            runs = [pool.submit(run_fresh, job_elastic_group, str(tmp_path), server.address(), group, steps,
                                world_size=1, timeout=800) for group in range(2)]  # fmt: skip
            groups = [run.result()[0] for run in runs]
    finally:
        server.shutdown()
    for group in groups:
        assert group["first_step"] == 1
        assert len(group["losses"]) == steps
        assert _falls(group["losses"]), group["losses"]
        # From the first round with both groups (the one that starts first tries it alone, dropped,
        # until the other is there): one every 2 steps and finish()'s, every one with both.
        rounds = after_join(group["rounds"])
        assert len(rounds) == 1 + steps // 2 + 1, group["rounds"]
        assert all(p == 2 and not dropped and not healed for p, dropped, healed in rounds), group["rounds"]
    assert groups[0]["digest"] == groups[1]["digest"]


@pytest.mark.stress
def test_elastic_group_restarted_heals(tmp_path: Path) -> None:
    """Group 1's job exits after step 5; group 0 goes on alone; group 1's job, started again as
    torchrun restarts one, takes acco's state, the trainer's step and the LR schedules from
    group 0, trains with it to the end, and both end with the same parameters."""
    pytest.importorskip("torchft")
    from tests.test_elastic import lighthouse

    steps = 16
    server = lighthouse()

    def group_1() -> dict[str, Any]:
        with pytest.raises(RankLost, match="died"):
            run_fresh(job_elastic_group, str(tmp_path), server.address(), 1, steps, 5, world_size=1, timeout=800)
        return run_fresh(job_elastic_group, str(tmp_path), server.address(), 1, steps, None, True, world_size=1,
                         timeout=800)[0]  # fmt: skip

    try:
        with ThreadPoolExecutor(2) as pool:
            runs = [pool.submit(run_fresh, job_elastic_group, str(tmp_path), server.address(), 0, steps, world_size=1,
                                timeout=800), pool.submit(group_1)]  # fmt: skip
            survivor, restarted = runs[0].result()[0], runs[1].result()
    finally:
        server.shutdown()
    assert len(survivor["losses"]) == steps and _falls(survivor["losses"]), survivor["losses"]
    assert any(p == 1 and not dropped for p, dropped, _ in survivor["rounds"]), survivor["rounds"]  # alone a while
    assert restarted["first_step"] > 6, restarted["first_step"]  # the survivor's step, not 1
    assert len(restarted["losses"]) == steps - restarted["first_step"] + 1
    assert survivor["digest"] == restarted["digest"]


def test_documented_command(tmp_path: Path) -> None:
    """docs/torchtitan.md's command, as a user runs it, from the repository root (3 steps of
    shorter windows)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
               "torchtitan.train", "--module", "acco.integrations.torchtitan", "--config", "acco_llama3_debugmodel",
               "--optimizer.mode", "acco", "--training.steps", "3", "--training.seq_len", "32",
               "--training.local_batch_size", "2",
               "--dump_folder", str(tmp_path)]
    environment = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    finished = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=800)
    output = finished.stdout + finished.stderr
    assert finished.returncode == 0, output[-3000:]
    assert output.count("loss:") >= 6, output[-3000:]  # 3 steps, 2 ranks


# ---------------------------------------------------------------------------- refusals


def _refused(config: Any, match: str) -> None:
    from acco.integrations.torchtitan import AccoTrainer

    with pytest.raises(ValueError, match=match):
        AccoTrainer(config)
    assert not dist.is_initialized()  # raised before any process group, so before any collective


@pytest.mark.parametrize("change, match", [
    (lambda c: setattr(c.parallelism, "pipeline_parallel_degree", 2), "pipeline_parallel_degree"),
    (lambda c: setattr(c.parallelism, "context_parallel_degree", 2), "context_parallel_degree"),
    (lambda c: setattr(c.parallelism, "spmd_backend", "spmd_types"), "spmd_backend"),
    (lambda c: setattr(c.training, "disable_cuda_graphs", False), "disable_cuda_graphs"),
    (lambda c: setattr(c.training, "global_batch_size", -3), "must be even"),
    (lambda c: setattr(c.optimizer, "mode", "fast"), "optimizer.mode"),
    (lambda c: setattr(c.optimizer, "implementation", "fused_opt_states_bf16"), "implementation"),
    (lambda c: setattr(c.optimizer, "outer_bits", 3), "outer_bits"),
    (lambda c: setattr(c.checkpoint, "async_mode", "async") or setattr(c.checkpoint, "enable", True), "async_mode"),
    (lambda c: setattr(c.parallelism, "data_parallel_shard_degree", -1), "both -1"),
], ids=["pipeline", "context", "spmd_types", "cuda_graphs", "odd_micro_batches", "mode", "bf16_states",
        "outer_bits", "async_checkpoint", "both_degrees_open"])
def test_refusals(tmp_path: Path, change: Any, match: str) -> None:
    config = _config(str(tmp_path), "local" if match == "outer_bits" else "acco", steps=2)
    change(config)
    _refused(config, match)


@pytest.mark.parametrize("mode, change, match", [
    ("acco", {}, "optimizer.elastic with optimizer.mode='acco'"),
    ("local", {"replica_group": 2}, "replica_group"),
    ("local", {"outer_bits": 32}, "outer_bits with membership"),
    ("local", {"sync_delay": 1}, "sync_delay with membership"),
    ("local", {"quorum_timeout_seconds": 900.0}, "quorum_timeout"),
    ("local", {"parallelism": 2}, "replica groups in one job"),
    ("local", {"initial_load_path": "weights"}, "initial_load_path"),
], ids=["not_local", "group_index", "outer_bits_32", "sync_delay", "quorum_past_timeout", "two_groups_in_a_job",
        "initial_weights"])
def test_elastic_refusals(tmp_path: Path, mode: str, change: dict[str, Any], match: str) -> None:
    """Refused before any process group, so before the lighthouse is asked (none runs here)."""
    pytest.importorskip("torchft")
    replicate = change.pop("parallelism", None)
    initial = change.pop("initial_load_path", None)
    config = _config(str(tmp_path), mode, steps=2, elastic=True, lighthouse="http://localhost:1", replica_groups=2,
                     **change)  # fmt: skip
    if replicate is not None:
        config.parallelism.data_parallel_replicate_degree = replicate
    if initial is not None:
        config.checkpoint.enable = True
        config.checkpoint.initial_load_path = initial
    _refused(config, match)


def test_refuses_torchtitans_own_containers(tmp_path: Path) -> None:
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.optimizer import default_adamw

    config = _config(str(tmp_path), "acco", steps=2)
    config.optimizer = default_adamw()
    _refused(config, "AccoOptimizersContainer.Config")
    config = _config(str(tmp_path), "acco", steps=2)
    config.checkpoint = CheckpointManager.Config(enable=True)
    _refused(config, "AccoCheckpointManager.Config")


@pytest.mark.parametrize("elastic", [False, True], ids=["fixed", "elastic"])
def test_outer_lr_alone_keeps_the_rest_of_acco_default(tmp_path: Path, elastic: bool) -> None:
    """``optimizer.outer_lr`` alone changes the lr of acco's default outer optimizer and keeps
    its momentum: plain averaging's 0 for a fixed job, the elastic default's Nesterov 0.3 with
    ``optimizer.elastic`` (acco.default_outer(H, elastic=True))."""
    from acco import default_outer

    config = _config(str(tmp_path), "local", steps=2, outer_lr=0.8, elastic=elastic)
    outer = config.optimizer.acco_kwargs()["outer_optimizer"]
    default = default_outer(config.optimizer.sync_every, elastic=elastic).keywords
    assert outer.keywords["lr"] == 0.8
    assert outer.keywords["momentum"] == default["momentum"] and outer.keywords["nesterov"] == default.get("nesterov", False)


@pytest.mark.parametrize("given, expected", [
    ([], ("auto", 4, 128)),
    (["--optimizer.sync_every", "auto", "--optimizer.sync_every_bounds", "8", "64"], ("auto", 8, 64)),
    (["--optimizer.sync_every", "16"], 16),
], ids=["default", "auto_bounds", "fixed"])
def test_sync_every_from_the_command_line(given: list[str], expected: Any) -> None:
    """``--optimizer.sync_every`` takes "auto" (the default, as everywhere local mode runs) with
    ``--optimizer.sync_every_bounds LO HI``, or an int; what AccoOptimizer is given, checked as it
    checks it."""
    from torchtitan.config.manager import ConfigManager

    from acco.options import LocalOptions, Mode

    config = ConfigManager().parse_args(["--module", "acco.integrations.torchtitan", "--config",
                                         "acco_llama3_debugmodel", "--optimizer.mode", "local", *given])
    kwargs = config.optimizer.acco_kwargs()
    assert kwargs["sync_every"] == expected and kwargs["sync_delay"] is None
    options = LocalOptions.check(Mode.LOCAL, kwargs["sync_every"], kwargs["sync_delay"], None, None,
                                 pacing=kwargs["pacing"])
    assert options.auto_every == (None if isinstance(expected, int) else expected[1:])
    assert options.landing == ("fixed" if isinstance(expected, int) else "block-or-hide")  # (a fixed H: blocking)
