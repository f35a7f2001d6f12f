"""AccoStrategy (Lightning Trainer) against Lightning's DDP, every mode, exact resumes, refusals.

Each job launches fresh processes as torchrun would (``run_fresh``): Lightning finds
``LOCAL_RANK`` and runs each process as one rank of ``devices=2``, setting up the gloo group
itself. One job trains several Trainers back to back, so a launch serves several checks.
The module is a small MLP (about 1.5 thousand parameters) on seeded data; an epoch is 20
Trainer steps (2 ranks x ``accumulate_grad_batches=2`` x batches of 4: 160 samples).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from tests.helpers import assert_params_close  # noqa: E402
from tests.ranks import run_fresh  # noqa: E402

pytestmark = pytest.mark.timeout(180)

STEPS = 40  # Trainer steps of a whole run
STEPS_PER_EPOCH = 20
BATCH = 4
ACCUMULATE = 2
SAMPLES = 2 * ACCUMULATE * BATCH * STEPS_PER_EPOCH
LOCAL = {"sync_every": 4}  # local mode: an outer round every 4 inner steps (10 in a run)


# --------------------------------------------------------------------------- set-up


def data(seed: int = 1) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, 16, generator=generator)
    y = (x[:, :4] + 0.3 * x[:, 4:8]).argmax(1)
    return torch.utils.data.TensorDataset(x, y)


def make_module(namespace: str = "lightning.pytorch"):
    """The test's LightningModule, from ``namespace`` (``lightning.pytorch`` or ``pytorch_lightning``)."""
    pl = importlib.import_module(namespace)

    class Classifier(pl.LightningModule):
        """Two param groups (no decay on biases) and a per-step cosine schedule."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Tanh(), torch.nn.Linear(48, 4))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

        def configure_model(self):
            # FSDP2 inside a replica group, as a user writes it for ModelParallelStrategy: the
            # strategy's mesh (AccoStrategy(mesh=...)) names the dimension to shard on.
            from torch.distributed.fsdp import fully_shard

            if self.device_mesh is None or getattr(self.net, "_acco_test_sharded", False):
                return
            for layer in (self.net[0], self.net[2]):
                fully_shard(layer, mesh=self.device_mesh["shard"])
            fully_shard(self.net, mesh=self.device_mesh["shard"])
            self.net._acco_test_sharded = True

        def configure_optimizers(self):
            decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
            other = [p for n, p in self.named_parameters() if not n.endswith("weight")]
            opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                                    lr=2e-2, betas=(0.9, 0.95))
            schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    return Classifier()


def fit(strategy, steps: int = STEPS, ckpt_dir: str | None = None, ckpt_path: str | None = None,
        fail_at: int | None = None, devices: int = 2, module=None, save_every: int | None = None,
        namespace: str = "lightning.pytorch", **trainer_kwargs):
    """One Trainer.fit on this process's rank; the module (committed parameters), the
    trainer and what :class:`Record` saw afterwards.

    ``ckpt_dir``: ``last.ckpt`` saved there at the end of training, or with ``save_every``
    a checkpoint every that many steps (``step=N.ckpt``), kept. ``namespace``: the Trainer's
    (``lightning.pytorch`` or ``pytorch_lightning``)."""
    pl = importlib.import_module(namespace)
    ModelCheckpoint = pl.callbacks.ModelCheckpoint

    record = make_record(namespace)
    callbacks = [record]
    if ckpt_dir is not None and save_every is None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=0))
    elif ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=save_every,
                                         save_top_k=-1))
    if fail_at is not None:
        callbacks.append(_FailAt(fail_at))
    module = make_module(namespace) if module is None else module
    # This rank's share of the samples, in order, every epoch the same (no DistributedSampler,
    # whose order depends on the epoch number): a resumed run meets the batches of the
    # uninterrupted one whether Lightning counts the saved epoch as ended or not.
    rank = int(os.environ.get("RANK", 0))
    shard = torch.utils.data.Subset(data(), range(rank, SAMPLES, devices))
    loader = torch.utils.data.DataLoader(shard, batch_size=BATCH, shuffle=False)
    held_out = torch.utils.data.DataLoader(data(seed=2), batch_size=32)
    settings = dict(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=1.0, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=ckpt_dir is not None, callbacks=callbacks, num_sanity_val_steps=1,
        use_distributed_sampler=False, limit_val_batches=2,
    )
    settings.update(trainer_kwargs)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(**settings)
    trainer.fit(module, loader, held_out, ckpt_path=ckpt_path)
    return module, trainer, record


def make_record(namespace: str = "lightning.pytorch"):
    """A callback recording, at each Trainer step, the mean training loss of its
    micro-batches and the learning rate the schedule left; and the steps validation ran at."""
    pl = importlib.import_module(namespace)

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.window: list[float] = []
            self.losses: list[float] = []
            self.lrs: list[float] = []
            self.validated_at: list[int] = []
            self.step = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.step = trainer.global_step if self.step is None else self.step
            self.window.append(float(outputs["loss"]))
            if trainer.global_step != self.step:  # the window's optimizer step ran
                self.step = trainer.global_step
                self.losses.append(sum(self.window) / len(self.window))
                self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])
                self.window = []

        def on_validation_start(self, trainer, pl_module):
            if not trainer.sanity_checking:
                self.validated_at.append(trainer.global_step)

    return Record()


def _FailAt(step: int):
    from lightning.pytorch.callbacks import Callback

    class FailAt(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == step:
                raise RuntimeError(f"interrupted at step {step}")

    return FailAt()


def held_out_loss(module) -> float:
    x, y = data(seed=2).tensors
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(module.net(x), y))


def params(module) -> dict[str, torch.Tensor]:
    """Whole parameters, as plain tensors (FSDP2's DTensors gathered: collective)."""
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in module.named_parameters()}


def loss_at(parameters: dict[str, torch.Tensor]) -> float:
    """The held-out loss of the module at these (whole) parameters, on this process alone."""
    module = make_module()
    module.load_state_dict(parameters)
    return held_out_loss(module)


def strategy_of(mode: str):
    from acco.integrations.lightning import AccoStrategy

    return AccoStrategy(mode=mode, **(LOCAL if mode == "local" else {}))


# --------------------------------------------------------------------------- jobs


MODES = ("sync", "acco", "dpu", "local")
RESUMED = ("acco", "local")
# acco mode's whole runs validate every 10 batches (5 steps), the others once an epoch.
VALIDATION = {"acco": 10}


def job_parity_and_modes(ckpt_root: str) -> dict:
    """DDP and every acco mode on the same module, data, seed and Trainer arguments, 40 steps
    each (acco validating every 10 batches, sync and acco saving a checkpoint every 20
    steps); acco and local for 20 steps with last.ckpt saved at the end, after finish()
    (resumed by the next job); bf16-mixed over epochs whose last update is cut short; a run
    interrupted by an exception on every rank (no collective in the teardown: the job goes
    on); the pytorch_lightning namespace, 20 sync steps."""
    from acco.integrations.lightning import AccoStrategy

    out: dict = {"initial_loss": held_out_loss(make_module())}
    ddp, _, _ = fit("ddp")
    out["ddp"] = params(ddp)
    for mode in MODES:
        saves = dict(ckpt_dir=f"{ckpt_root}/{mode}-step", save_every=STEPS // 2) if mode in ("sync", "acco") else {}
        module, trainer, record = fit(strategy_of(mode), val_check_interval=VALIDATION.get(mode, 1.0), **saves)
        acco = trainer.strategy.acco_optimizer
        out[mode] = params(module)
        out[f"{mode}_steps"] = trainer.global_step
        out[f"{mode}_loss"] = held_out_loss(module)
        out[f"{mode}_updates"] = acco.num_updates
        out[f"{mode}_val_loss"] = float(trainer.callback_metrics["val_loss"])
        out[f"{mode}_schedule_steps"] = trainer.lr_scheduler_configs[0].scheduler.last_epoch
        out[f"{mode}_training_losses"] = record.losses
        out[f"{mode}_lrs"] = record.lrs
        out[f"{mode}_validated_at"] = record.validated_at
    for mode in RESUMED:
        fit(strategy_of(mode), steps=STEPS_PER_EPOCH, ckpt_dir=f"{ckpt_root}/{mode}-last",
            val_check_interval=VALIDATION.get(mode, 1.0))
    # 5 batches an epoch: updates of 2, 2 and 1 micro-batches (the estimate round ends after
    # the first micro-batch of the short one, and the commit round computes none).
    module, trainer, _ = fit(AccoStrategy(mode="acco"), steps=6, precision="bf16-mixed", limit_train_batches=5)
    out["bf16"] = params(module)
    out["bf16_loss"] = held_out_loss(module)
    out["bf16_steps"] = trainer.global_step
    out["bf16_epochs"] = trainer.current_epoch
    out["bf16_updates"] = trainer.strategy.acco_optimizer.num_updates
    strategy = AccoStrategy(mode="acco")
    try:
        fit(strategy, fail_at=2)
    except RuntimeError as error:
        out["failure"] = str(error)
    out["closed_after_failure"] = strategy.acco_optimizer is not None and strategy._acco_finished
    if importlib.util.find_spec("pytorch_lightning") is not None:
        from acco.integrations import pytorch_lightning

        module, trainer, _ = fit(pytorch_lightning.AccoStrategy(mode="sync"), steps=STEPS // 2,
                                 namespace="pytorch_lightning")
        out["pytorch_lightning_sync"] = params(module)
        out["pytorch_lightning_updates"] = trainer.strategy.acco_optimizer.num_updates
    return out


def job_resume(ckpt_root: str) -> dict:
    """In new processes, to step 40: acco and local from last.ckpt of a 20-step run (saved
    after finish())."""
    out = {}
    for mode in RESUMED:
        path = f"{ckpt_root}/{mode}-last/last.ckpt"
        out[f"{mode}_saved_step"] = torch.load(path, map_location="cpu", weights_only=False)["global_step"]
        module, trainer, _ = fit(strategy_of(mode), ckpt_path=path, val_check_interval=VALIDATION.get(mode, 1.0))
        out[mode] = params(module)
        out[f"{mode}_updates"] = trainer.strategy.acco_optimizer.num_updates
        out[f"{mode}_schedule_steps"] = trainer.lr_scheduler_configs[0].scheduler.last_epoch
    return out


MESH = (2, 2)  # 2 replica groups (acco across them) of 2 ranks (FSDP2 inside each)
MESH_STEPS = 6  # 2 epochs of 3 steps (the first 6 batches of each rank's 20: limit_train_batches)


def job_mesh(ckpt_root: str) -> dict:
    """On 4 ranks, acco across the replicate dimension of a 2x2 mesh, FSDP2 (the module's
    configure_model) on the shard one, checkpoints sharded through DCP: 6 steps saving at
    step 3 (during training); 3 steps saving last.ckpt after finish(); that one resumed to
    step 6 (a new Trainer, strategy and module)."""
    from acco.integrations.lightning import AccoStrategy

    def strategy():
        return AccoStrategy(mode="acco", mesh=MESH, checkpoint="sharded")

    epoch = dict(devices=4, limit_train_batches=MESH_STEPS)  # resumes at an epoch's end meet the same batches
    module, trainer, _ = fit(strategy(), steps=MESH_STEPS, ckpt_dir=f"{ckpt_root}/whole", save_every=MESH_STEPS // 2,
                             **epoch)
    weight = next(module.net.parameters())
    out = {
        "sharded": type(weight).__name__ == "DTensor" and weight.device_mesh.mesh_dim_names == ("shard",),
        "acco_ranks": trainer.strategy.acco_optimizer.world_size,  # the replicate dimension
        "whole": params(module),
        "updates": trainer.strategy.acco_optimizer.num_updates,
        "val_loss": float(trainer.callback_metrics["val_loss"]),
    }
    fit(strategy(), steps=MESH_STEPS // 2, ckpt_dir=f"{ckpt_root}/half", default_root_dir=ckpt_root, **epoch)
    out["final_dir_left"] = os.path.exists(f"{ckpt_root}/.acco-final")
    module, trainer, _ = fit(strategy(), steps=MESH_STEPS, ckpt_path=f"{ckpt_root}/half/last.ckpt", **epoch)
    out["resumed"] = params(module)
    out["resumed_updates"] = trainer.strategy.acco_optimizer.num_updates
    return out


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[list[dict], Path]:
    root = tmp_path_factory.mktemp("lightning")
    return run_fresh(job_parity_and_modes, str(root), timeout=170), root


def last_mean(losses_per_rank: list[list[float]], last: int = 10) -> float:
    """The mean training loss of the last ``last`` steps, over ranks."""
    return sum(sum(losses[-last:]) / last for losses in losses_per_rank) / len(losses_per_rank)


def test_sync_matches_ddp(trained) -> None:
    """accumulate_grad_batches=2, gradient_clip_val=1.0, two param groups, a cosine schedule:
    40 steps of AccoStrategy(mode="sync") end within 1e-5 of Lightning's DDP."""
    results, _ = trained
    for rank in results:
        assert_params_close(rank["sync"], rank["ddp"], rtol=0, atol=1e-5)
        assert rank["sync_updates"] == STEPS
        assert rank["sync_lrs"][-1] == pytest.approx(0.0, abs=1e-12)  # the cosine schedule ran to its end


def test_pytorch_lightning_namespace_matches_ddp(trained) -> None:
    """acco.integrations.pytorch_lightning.AccoStrategy in a pytorch_lightning.Trainer (a
    pytorch_lightning.LightningModule): 20 sync steps end within 1e-5 of lightning's sync
    mode at step 20 (its checkpoint), which ends within 1e-5 of DDP at step 40."""
    pytest.importorskip("pytorch_lightning")
    results, root = trained
    saved = torch.load(root / "sync-step/step=20.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    for rank in results:
        assert rank["pytorch_lightning_updates"] == STEPS // 2
        assert_params_close(rank["pytorch_lightning_sync"], saved, rtol=0, atol=1e-5)


@pytest.mark.parametrize("mode", ["acco", "dpu", "local"])
def test_a_step_is_one_update_in_every_mode(trained, mode: str) -> None:
    """The same Trainer arguments as DDP's (accumulate_grad_batches=2, max_steps=40, a cosine
    schedule per step): 40 committed updates (local: inner updates), the schedule stepped 40
    times with sync mode's learning rates, validation at the same steps as DDP's; in acco and
    dpu mode a last-10 mean training loss within 5% of sync mode's (local mode's, each
    replica's loss on its own parameters between outer rounds, is another algorithm's); the
    held-out loss falls and every rank ends bit-identical. In acco mode,
    ModelCheckpoint(every_n_train_steps=20) saved at steps 20 and 40, and val_check_interval=10
    (batches) validated every 5 steps, as with DDP."""
    results, root = trained
    first = results[0]
    if mode == "acco":
        assert sorted(p.name for p in (root / "acco-step").iterdir()) == ["step=20.ckpt", "step=40.ckpt"]
    for rank in results:
        assert rank[f"{mode}_steps"] == rank[f"{mode}_updates"] == rank[f"{mode}_schedule_steps"] == STEPS
        assert rank[f"{mode}_lrs"] == pytest.approx(rank["sync_lrs"], rel=1e-12, abs=1e-15)
        if mode == "acco":
            assert rank["acco_validated_at"] == [5, 10, 15, 20, 25, 30, 35, 40]  # DDP's steps
        for name, value in first[mode].items():
            assert torch.equal(rank[mode][name], value), f"{name} differs across ranks"
    if mode != "local":
        loss = last_mean([rank[f"{mode}_training_losses"] for rank in results])
        sync = last_mean([rank["sync_training_losses"] for rank in results])
        assert loss == pytest.approx(sync, rel=0.05), (loss, sync)
    assert first[f"{mode}_loss"] < 0.8 * first["initial_loss"], (first[f"{mode}_loss"], first["initial_loss"])
    assert math.isfinite(first[f"{mode}_val_loss"])


def test_short_updates_and_bf16_mixed(trained) -> None:
    """bf16-mixed, epochs of 5 batches (updates of 2, 2 and 1 micro-batches): 6 steps over 2
    epochs are 6 committed updates, the same on every rank, and the loss falls."""
    results, _ = trained
    first = results[0]
    assert math.isfinite(first["bf16_loss"]) and first["bf16_loss"] < first["initial_loss"]
    for rank in results:
        assert rank["bf16_steps"] == rank["bf16_updates"] == 6 and rank["bf16_epochs"] == 2
        assert_params_close(rank["bf16"], first["bf16"], rtol=0, atol=0)


def test_exception_closes_without_collective(trained) -> None:
    results, _ = trained
    for rank in results:
        assert rank["failure"] == "interrupted at step 2"
        assert rank["closed_after_failure"]


@pytest.mark.parametrize("mode", RESUMED)
def test_last_checkpoint_resumes_exactly(trained, mode: str) -> None:
    """last.ckpt of a 20-step run (saved after finish()), resumed in new processes to step 40,
    ends within 1e-6 of the uninterrupted 40-step run (the round in flight and the schedule
    included)."""
    results, root = trained
    resumed = _resumed(root)
    for whole, again in zip(results, resumed):
        assert again[f"{mode}_saved_step"] == STEPS_PER_EPOCH
        assert again[f"{mode}_updates"] == whole[f"{mode}_updates"] == STEPS
        assert again[f"{mode}_schedule_steps"] == STEPS
        assert_params_close(again[mode], whole[mode], rtol=0, atol=1e-6)


_RESUMED: dict[str, list[dict]] = {}


def _resumed(root: Path) -> list[dict]:
    if str(root) not in _RESUMED:
        _RESUMED[str(root)] = run_fresh(job_resume, str(root), timeout=170)
    return _RESUMED[str(root)]


@pytest.mark.timeout(60)
def test_refusals_before_any_collective() -> None:
    """16-mixed fails when the Trainer is built; value clipping and an odd
    accumulate_grad_batches in acco mode when fit starts, before the process group exists;
    bad acco keywords when the strategy is made."""
    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    from acco.integrations.lightning import AccoStrategy

    from lightning.pytorch.plugins.precision import MixedPrecision

    # On CPU Lightning turns precision="16-mixed" into bf16; the plugin itself is what a GPU gets.
    fp16 = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="16-mixed.*bf16-mixed"):
        pl.Trainer(accelerator="cpu", devices=1, strategy=AccoStrategy(), plugins=[fp16], logger=False)
    loader = torch.utils.data.DataLoader(data(), batch_size=BATCH)
    refused = {
        "gradient_clip_algorithm='value'": dict(gradient_clip_val=1.0, gradient_clip_algorithm="value"),
        r"accumulate_grad_batches=3 for mode='acco'.*even: use accumulate_grad_batches=4, or AccoStrategy\(mode='dpu'\)":
            dict(accumulate_grad_batches=3),
        r"accumulate_grad_batches=1 for mode='acco'.*even": dict(),
        r"GradientAccumulationScheduler scheduling\[2\]=3 for mode='acco'":
            dict(callbacks=[GradientAccumulationScheduler({0: 2, 2: 3})]),
    }
    for message, settings in refused.items():
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=AccoStrategy(), logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, max_steps=1, **settings)
        with pytest.raises(ValueError, match=message):
            trainer.fit(make_module(), loader)
        assert not dist.is_initialized()
    with pytest.raises(ValueError, match="sync_every"):
        AccoStrategy(mode="local", sync_every=0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        AccoStrategy(max_grad_norm=1.0)
    with pytest.raises(ValueError, match="pacing"):
        AccoStrategy(mode="local", pacing="speed")
    # Fabric's strategy refuses a GradScaler the same way, when Fabric hands it the plugin,
    # and acco mode without an even accumulate_grad_batches when it is made.
    from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision

    from acco.integrations.fabric import AccoFabricStrategy

    with pytest.raises(ValueError, match="16-mixed.*bf16-mixed"):
        AccoFabricStrategy(accumulate_grad_batches=2).precision = FabricMixedPrecision(
            "16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match=r"needs accumulate_grad_batches=K.*mode='dpu'"):
        AccoFabricStrategy(mode="acco")
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=3 for mode='acco'.*even.*mode='dpu'"):
        AccoFabricStrategy(mode="acco", accumulate_grad_batches=3)
    AccoFabricStrategy(mode="dpu", accumulate_grad_batches=3)  # one round per update: any K


# --------------------------------------------------------------------------- Fabric


FABRIC_STEPS = 20  # an epoch of this rank's samples
FABRIC_SAVED = 10  # the step the resumed run starts from


def fabric_loop(mode: str, save: tuple[int, str] | None = None, resume: str | None = None) -> dict:
    """A LitGPT-shaped Fabric loop of 20 steps: no_backward_sync while accumulating, backward,
    clip, step, zero_grad, a cosine learning rate written into the param groups each step. The
    DDP loop divides the loss by the micro-batches per step; the acco loop does not.

    ``save``: ``(step, path)``, ``fabric.save`` after that many steps; ``resume``: start from
    such a checkpoint (a fresh Fabric, strategy, model and optimizer). Returns the parameters
    (committed, after ``finish()``), the mean training loss of each step (over this rank's
    micro-batches), the optimizer steps that said an update landed, and the committed updates.
    """
    from lightning.fabric import Fabric

    from acco.integrations.fabric import AccoFabricStrategy

    acco = mode != "ddp"
    strategy = AccoFabricStrategy(mode, accumulate_grad_batches=ACCUMULATE, max_grad_norm=1.0,
                                  **(LOCAL if mode == "local" else {})) if acco else "ddp"
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)
    module = make_module()
    model = fabric.setup(module.net)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.1))
    first = 0
    if resume is not None:
        first = fabric.load(resume, {"model": model, "optimizer": optimizer})["step"]
    x, y = torch.utils.data.Subset(data(), range(fabric.global_rank, SAMPLES, 2))[:]
    out: dict = {"losses": [], "landed": 0}
    for step in range(first, FABRIC_STEPS):
        for group in optimizer.param_groups:
            group["lr"] = 2e-2 * 0.5 * (1 + math.cos(math.pi * step / FABRIC_STEPS))
        losses = []
        for micro in range(ACCUMULATE):
            start = (step * ACCUMULATE + micro) * BATCH % len(x)
            with fabric.no_backward_sync(model, enabled=micro < ACCUMULATE - 1):
                loss = torch.nn.functional.cross_entropy(model(x[start:start + BATCH]), y[start:start + BATCH])
                fabric.backward(loss if acco else loss / ACCUMULATE)
            losses.append(float(loss))
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        out["landed"] += bool(optimizer.step())
        optimizer.zero_grad()
        out["losses"].append(sum(losses) / len(losses))
        if save is not None and step + 1 == save[0]:
            fabric.save(save[1], {"model": model, "optimizer": optimizer, "step": step + 1})
    if acco:
        optimizer.finish()
        out["updates"] = optimizer.num_updates
    out["params"] = {n: p.detach().clone() for n, p in module.net.named_parameters()}
    return out


def job_fabric(ckpt_root: str) -> dict:
    """The loop on Fabric's DDP, in sync mode, and in acco mode saving at step 10, then
    resumed to step 20 from the checkpoint. (In dpu and local mode a step was one round
    before, as it is now.)"""
    return {
        "ddp": fabric_loop("ddp"),
        "sync": fabric_loop("sync"),
        "acco": fabric_loop("acco", save=(FABRIC_SAVED, f"{ckpt_root}/fabric.ckpt")),
        "acco_resumed": fabric_loop("acco", resume=f"{ckpt_root}/fabric.ckpt"),
    }


@pytest.fixture(scope="module")
def fabric_runs(tmp_path_factory) -> list[dict]:
    return run_fresh(job_fabric, str(tmp_path_factory.mktemp("fabric")), timeout=120)


def test_fabric_sync_matches_ddp(fabric_runs) -> None:
    """The same loop on Fabric's DDP and on AccoFabricStrategy("sync"): within 1e-5 after 20 steps."""
    for rank in fabric_runs:
        assert_params_close(rank["sync"]["params"], rank["ddp"]["params"], rtol=0, atol=1e-5)
        assert rank["sync"]["updates"] == rank["sync"]["landed"] == FABRIC_STEPS


def test_fabric_step_is_one_update(fabric_runs) -> None:
    """AccoFabricStrategy("acco", accumulate_grad_batches=2): 20 optimizer steps are 20
    committed updates (the last lands at finish(); every other step says one landed), and
    the last-10 mean training loss is within 5% of DDP's (which sync mode equals)."""
    for rank in fabric_runs:
        assert rank["acco"]["updates"] == FABRIC_STEPS
        assert rank["acco"]["landed"] == FABRIC_STEPS - 1
    loss = last_mean([rank["acco"]["losses"] for rank in fabric_runs])
    ddp = last_mean([rank["ddp"]["losses"] for rank in fabric_runs])
    assert loss == pytest.approx(ddp, rel=0.05), (loss, ddp)


def test_fabric_checkpoint_resumes_exactly(fabric_runs) -> None:
    """acco mode: fabric.save after step 10, loaded into a fresh setup and run to step 20:
    within 1e-6 of the uninterrupted run."""
    for rank in fabric_runs:
        assert rank["acco_resumed"]["updates"] == FABRIC_STEPS
        assert_params_close(rank["acco_resumed"]["params"], rank["acco"]["params"], rtol=0, atol=1e-6)


def test_fsdp2_mesh_trains_and_sharded_checkpoint_resumes_exactly(tmp_path) -> None:
    """AccoStrategy(mesh=(2, 2), checkpoint="sharded") on 4 ranks: the module's own
    configure_model shards it with FSDP2 inside each replica group; the held-out loss falls and
    every rank ends with the same whole parameters. A 3-step run's last.ckpt (saved after
    finish()) resumed to step 6 ends within 1e-6 of the uninterrupted run, and holds the same
    acco state as that run's checkpoint at step 3 (saved during training)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    results = run_fresh(job_mesh, str(tmp_path), world_size=4, timeout=170)
    first = results[0]
    initial = held_out_loss(make_module())
    assert loss_at(first["whole"]) < 0.8 * initial, (loss_at(first["whole"]), initial)
    assert math.isfinite(first["val_loss"])
    assert not first["final_dir_left"]  # rank 0 removes finish()'s copy at teardown
    for rank in results:
        assert rank["sharded"] and rank["acco_ranks"] == MESH[0]
        assert rank["updates"] == rank["resumed_updates"] == MESH_STEPS
        assert_params_close(rank["whole"], first["whole"], rtol=0, atol=0)
        assert_params_close(rank["resumed"], rank["whole"], rtol=0, atol=1e-6)
    saved = {}
    for name, path in (("live", tmp_path / f"whole/step={MESH_STEPS // 2}.ckpt"), ("final", tmp_path / "half/last.ckpt")):
        dcp_to_torch_save(path / "acco", tmp_path / f"{name}.pt")
        saved[name] = torch.load(tmp_path / f"{name}.pt", weights_only=False)
    assert saved["live"].keys() == saved["final"].keys()
    for key, value in saved["live"].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, saved["final"][key]), key
