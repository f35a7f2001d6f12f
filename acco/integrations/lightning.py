"""PyTorch Lightning with acco: :class:`AccoStrategy` for ``lightning.pytorch.Trainer``.

Replace ``strategy="ddp"`` with ``strategy=AccoStrategy(mode="acco")`` and keep the
LightningModule as it is::

    trainer = Trainer(accelerator="cpu", devices=2, strategy=AccoStrategy(mode="acco"),
                      accumulate_grad_batches=4, gradient_clip_val=1.0, max_steps=1000)

How Lightning's words map onto acco's (docs/lightning.md has the whole story):

- one Trainer optimizer step (``trainer.global_step``) is one committed update of the
  ``accumulate_grad_batches`` (K) micro-batches of this rank, in every mode, as with DDP and
  as in :class:`~acco.integrations.hf.AccoTrainer`. In ``sync`` and ``dpu`` mode it is one
  round (``AccoOptimizer.step()`` at the step). In ``acco`` mode it is two rounds
  (:class:`~acco.integrations.schedules.UpdateRounds`): the estimate round ends after the
  first K/2 micro-batches, inside the step, and the commit round, whose update applies both
  rounds' gradients, at the step; K must be even. In ``local`` mode a step is one inner
  update of this replica; an outer round runs every ``sync_every`` steps. Under manual
  optimization each ``optimizer.step()`` the module calls is one round
  (``AccoOptimizer.step()``).
- every ``backward()`` ends a micro-batch (acco's ``micro_batch()``: the gradients are
  folded into acco's accumulator as backward produces them, and ``p.grad`` stays None).
  Lightning divides the loss by K; the strategy multiplies it back, since acco averages
  over micro-batches itself: the update is the mean gradient over the micro-batches of all
  ranks, as DDP's.
- the optimizer ``configure_optimizers`` returns (a plain torch optimizer, param groups
  included) becomes an :class:`~acco.AccoOptimizer` over the same groups and
  hyper-parameters; its ``param_groups`` become acco's, so the LR schedulers built on it
  drive acco's learning rate. Lightning steps them as with DDP, step-interval ones once per
  Trainer step (:class:`~acco.integrations.schedules.HandOverScheduler`): each update is
  handed to the comm lane with the learning rate a DDP run uses for it.
- ``gradient_clip_val`` (norm) becomes ``max_grad_norm``: acco clips the averaged gradient on
  its comm lane; Lightning's own clipping finds no ``p.grad`` and does nothing.
- validation, and the model saved in checkpoints, see the committed parameters
  (``AccoOptimizer.eval()``; in ``local`` mode the global values of the last landed round);
  training resumes at the live ones.
- checkpoints hold acco's whole state, consolidated on rank 0 (a round in flight and the
  pending gradients included), so ``Trainer.fit(ckpt_path=...)`` resumes exactly; with
  ``checkpoint="sharded"`` each rank writes its shard through DCP instead (large models).
- ``finish()`` runs when training ends, before the callbacks' ``on_train_end`` (where
  ``ModelCheckpoint(save_last=True)`` may save); after an exception acco is closed with no
  collective.

Refused, with a ``ValueError`` before any collective: ``precision="16-mixed"`` (its
GradScaler unscales ``p.grad`` to clip; acco unscales on its comm lane: train in
``bf16-mixed``), ``gradient_clip_algorithm="value"`` (the per-element clip of a rank's own
gradient has no sharded equivalent), an odd ``accumulate_grad_batches`` in ``acco`` mode (also
in a ``GradientAccumulationScheduler``'s schedule), other precision plugins than 32/64-bit,
``bf16-mixed`` and the ``-true`` half types, more than one optimizer, and an optimizer that is
not a plain torch one.
"""

from __future__ import annotations

import datetime
import math
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
    from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("acco.integrations.lightning needs lightning: pip install 'acco[lightning]'") from error

from acco import AccoOptimizer, Mode
from acco import checkpoint as checkpoint_module
from acco.integrations.schedules import (HandOverScheduler, UpdateRounds, acco_from_optimizer, check_acco_kwargs,
                                         check_micro_batches, check_precision, require_lockstep, rounds_per_update)
from acco.options import parse_enum

__all__ = ["AccoStrategy", "LightningAccoOptimizer"]

# Precision plugins whose work acco leaves intact: autocast or a cast of the module, no
# gradient scaler. (bf16-mixed is MixedPrecision without a scaler.)
_ACCEPTED_PRECISION = (Precision, MixedPrecision, HalfPrecision, DoublePrecision)
# In a checkpoint's optimizer state: the live parameters (an acco estimate, dpu's previous
# parameters), which the next round computes at; "state_dict" holds the committed ones.
LIVE_PARAMETERS_KEY = "acco_live_parameters"
# In a checkpoint saved after finish() (or after an error closed acco): the model only.
FINISHED_KEY = "acco_finished"
_SHARDED_DIR = "acco"  # inside a sharded checkpoint's directory: acco's DCP checkpoint
_META_FILE = "lightning.pt"  # inside it: the Trainer's own entries (loops, callbacks, schedulers)
# Under the Trainer's default_root_dir, with checkpoint="sharded": acco's state as training
# ended, written by finish() for the checkpoints saved after it (removed at teardown).
_FINAL_DIR = ".acco-final"


class LightningAccoOptimizer(AccoOptimizer):
    """An :class:`~acco.AccoOptimizer` whose ``step(closure)`` runs the closure first, as
    torch optimizers do and Lightning's precision plugins expect: the closure is the last
    micro-batch's forward and backward. Then it ends the update: under automatic
    optimization the rounds of :attr:`update_rounds` (``acco`` mode: the commit round, and
    the estimate round first if the update was too short to end it), otherwise one round.

    Returns True when a committed update landed during the update's rounds, not the
    closure's loss.
    """

    # No GradScaler under the strategy (16-mixed is refused): with the flag set, Lightning's
    # bf16-mixed plugin would refuse gradient_clip_val, taking acco for a fused optimizer.
    _step_supports_amp_scaling = False
    # Set by AccoStrategy under automatic optimization: one step() is one committed update.
    update_rounds: UpdateRounds | None = None

    def step(self, closure: Callable[[], Any] | None = None) -> bool:  # type: ignore[override]
        if closure is not None:
            with torch.enable_grad():
                closure()
        if self.update_rounds is None:
            return self.end_round()
        return self.update_rounds.end_update()

    def end_round(self) -> bool:
        """One round boundary: ``AccoOptimizer.step()`` (collective)."""
        return super().step()


class AccoStrategy(DDPStrategy):
    """A Lightning Trainer strategy that trains with :class:`~acco.AccoOptimizer`, without DDP.

    Args:
        mode: ``"acco"`` (default), ``"dpu"``, ``"sync"`` (ZeRO-1) or ``"local"``. A Trainer
            step is one committed update of ``accumulate_grad_batches`` micro-batches per rank
            in each (``local``: an inner update); see the module docstring.
        mesh: ``(replicas, shard)``: FSDP2 inside each replica group of ``shard`` ranks, acco
            across the ``replicas`` groups. The strategy builds a ``("replicate", "shard")``
            device mesh and hands it to the LightningModule (``self.device_mesh``), whose
            ``configure_model()`` calls ``fully_shard(..., mesh=self.device_mesh["shard"])``.
            Default None: every rank is a replica (no FSDP2).
        checkpoint: ``"consolidated"`` (default: acco's whole state gathered on rank 0 into
            Lightning's single checkpoint file) or ``"sharded"`` (the checkpoint path is a
            directory; every rank writes its shard through DCP: :mod:`acco.checkpoint`).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
            process_group_backend, timeout, start_method: as ``DDPStrategy``'s.
        **acco_kwargs: further ``AccoOptimizer`` keywords (``layout``, ``param_dtype``,
            ``reduce_dtype``, ``nonfinite``, ``timeout`` of acco's collectives, ``estimate_dtype``;
            ``sync_every``, ``sync_delay``, ``outer_optimizer``, ... with ``mode="local"``),
            checked here as ``AccoOptimizer`` checks them.

    Raises:
        ValueError: an invalid ``mode``, ``mesh``, ``checkpoint`` or acco keyword (here); a
            precision acco cannot honour (when the Trainer is built); value clipping, or an
            odd ``accumulate_grad_batches`` in ``acco`` mode (when ``fit`` starts, before the
            process group); more than one optimizer, or one that is not a plain torch
            optimizer (before acco's first collective).

    Example::

        >>> trainer = Trainer(accelerator="cpu", devices=2, strategy=AccoStrategy(mode="acco"),
        ...                   accumulate_grad_batches=2, gradient_clip_val=1.0, max_steps=100)
        >>> trainer.fit(module, data)          # or under torchrun
        >>> trainer.fit(module, data, ckpt_path="last")   # exact resume
    """

    strategy_name = "acco"

    def __init__(
        self,
        mode: Mode | str = Mode.ACCO,
        *,
        mesh: tuple[int, int] | None = None,
        checkpoint: str = "consolidated",
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: datetime.timedelta | None = default_pg_timeout,
        start_method: str = "popen",
        **acco_kwargs: Any,
    ) -> None:
        self.mode: Mode = parse_enum(Mode, mode, "mode")
        self.acco_kwargs = check_acco_kwargs(self.mode, acco_kwargs)
        if self.mode is Mode.LOCAL:
            # Validation, checkpoints and epoch ends are collectives at step counts: every
            # replica must take the same steps per outer round.
            require_lockstep(self.acco_kwargs, (
                "Invalid pacing={pacing!r} for AccoStrategy: the Trainer's validation, checkpoints and epoch "
                "ends are collectives at step counts, which replicas paced apart never all reach; use "
                "pacing='lockstep' (the default here) or sync_delay='auto' to keep replicas from waiting"))
        if mesh is not None and not (
            isinstance(mesh, (tuple, list)) and len(mesh) == 2 and all(isinstance(n, int) and n >= 1 for n in mesh)
        ):
            raise ValueError(f"Invalid mesh: {mesh!r} (a (replicas, shard) pair of positive ints, or None)")
        if checkpoint not in ("consolidated", "sharded"):
            raise ValueError(f"Invalid checkpoint: {checkpoint!r} ('consolidated' or 'sharded')")
        self.mesh_shape = None if mesh is None else (int(mesh[0]), int(mesh[1]))
        self.checkpoint_format = checkpoint
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
            process_group_backend=process_group_backend, timeout=timeout, start_method=start_method,
        )  # fmt: skip
        self._acco: LightningAccoOptimizer | None = None
        self._acco_finished = False
        self._final_state: dict[str, Any] | None = None  # acco's state as training ended (rank 0)
        self._final_dir: Path | None = None  # the same, sharded through DCP (checkpoint="sharded")
        self._device_mesh: Any = None
        self._lifecycle = _AccoLifecycle(self)

    # ------------------------------------------------------------------ checks and set-up

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        # The Trainer sets the plugin while it is built: "16-mixed" fails there.
        if precision_plugin is not None:
            check_precision(precision_plugin, _ACCEPTED_PRECISION)
        self._precision_plugin = precision_plugin

    @property
    def acco_optimizer(self) -> LightningAccoOptimizer | None:
        """The AccoOptimizer (built when ``fit`` sets the strategy up; None before)."""
        return self._acco

    @property
    def device_mesh(self) -> Any:
        """The ``("replicate", "shard")`` device mesh (with ``mesh=``; None otherwise)."""
        return self._device_mesh

    def setup_environment(self) -> None:
        """Check the Trainer's settings, then set up the process group (and the mesh)."""
        trainer = self.lightning_module.trainer
        check_trainer(trainer, self.mode)
        if self._lifecycle not in trainer.callbacks:  # first, so finish() precedes ModelCheckpoint's last save
            trainer.callbacks.insert(0, self._lifecycle)
        super().setup_environment()
        if self.mesh_shape is not None:
            from torch.distributed.device_mesh import init_device_mesh

            replicas, shard = self.mesh_shape
            if replicas * shard != self.world_size:
                raise ValueError(
                    f"Invalid mesh {self.mesh_shape}: {replicas} x {shard} != world size {self.world_size}"
                )
            self._device_mesh = init_device_mesh(self.root_device.type, self.mesh_shape,
                                                 mesh_dim_names=("replicate", "shard"))
            self.lightning_module._device_mesh = self._device_mesh

    def configure_ddp(self) -> None:
        """No DDP: acco reduces the gradients itself (and broadcasts rank 0's parameters and
        buffers when it is built, as DDP does)."""

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """The user's optimizer and schedulers (``configure_optimizers``), then the
        AccoOptimizer over that optimizer's groups, whose ``step()`` ends an update's rounds
        (:class:`~acco.integrations.schedules.UpdateRounds`, under automatic optimization).

        .. warning:: Collective (acco's construction): every rank runs it.
        """
        super().setup_optimizers(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if len(self.optimizers) != 1:
            raise ValueError(
                f"AccoStrategy trains one optimizer; configure_optimizers returned {len(self.optimizers)}"
            )
        clip = trainer.gradient_clip_val
        group = self._device_mesh["replicate"].get_group() if self._device_mesh is not None else None
        self._acco = acco_from_optimizer(
            self.optimizers[0], module=self.lightning_module, acco_class=LightningAccoOptimizer, mode=self.mode,
            max_grad_norm=float(clip) if clip else None, process_group=group, **self.acco_kwargs,
        )  # fmt: skip
        if self.lightning_module.automatic_optimization:
            self._acco.update_rounds = UpdateRounds(self._acco.end_round, rounds_per_update(self.mode),
                                                    trainer.accumulate_grad_batches)
        self._acco_finished = False
        self._final_state = None
        self._final_dir = None
        for config in self.lr_scheduler_configs:
            if not config.reduce_on_plateau:  # built on the optimizer acco replaced, which is never stepped
                config.scheduler = HandOverScheduler(config.scheduler)
        self.optimizers = [self._acco]

    # ------------------------------------------------------------------------ training

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """One micro-batch: its backward, folded into acco's accumulator as it runs; in
        ``acco`` mode the estimate round ends after the first half of an update's
        micro-batches (collective).

        Lightning divided the loss by ``accumulate_grad_batches`` (automatic optimization);
        acco averages over micro-batches itself, so the loss is multiplied back first.
        """
        acco = self._require_acco()
        module = self.lightning_module
        if module.automatic_optimization:
            closure_loss = closure_loss * module.trainer.accumulate_grad_batches
        with acco.micro_batch():
            loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        if acco.update_rounds is not None:
            acco.update_rounds.micro_batch_ended()
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if not self._live():
            return
        acco = self._require_acco()
        acco.train()  # the live parameters, if a save or a validation loaded others
        # Lightning's updates start every K batches of an epoch; its last may be shorter.
        trainer = self.lightning_module.trainer
        accumulate = trainer.accumulate_grad_batches
        if acco.update_rounds is not None and batch_idx % accumulate == 0:
            left = trainer.num_training_batches - batch_idx  # inf for a loader of unknown length
            acco.update_rounds.expect(accumulate if math.isinf(left) else int(min(accumulate, left)))

    def on_validation_start(self) -> None:
        if self._live():
            self._require_acco().eval()  # the committed parameters (local mode: the global values)

    def on_validation_end(self) -> None:
        if self._live():
            self._require_acco().train()

    def finish(self) -> None:
        """Land the last update (``AccoOptimizer.finish()``, collective): the model then holds
        the last committed parameters (``local`` mode: every replica the same global ones).
        Run when training ends; idempotent.

        With checkpoint callbacks, acco's state is consolidated on rank 0 first (collective)
        and kept (``checkpoint="sharded"``: written through DCP under the Trainer's
        ``default_root_dir``, in ``.acco-final/``): a checkpoint saved after this
        (``ModelCheckpoint(save_last=True)`` at the end of training) holds the final model and
        the state training ended with, so it resumes exactly as if training had not stopped.
        The LR schedules are Lightning's, stepped once per Trainer step: ``finish()`` steps
        none."""
        acco = self._acco
        if acco is None or self._acco_finished:
            return
        trainer = self.lightning_module.trainer
        if trainer is not None and trainer.checkpoint_callbacks:
            if self._sharded():
                self._final_dir = Path(trainer.default_root_dir) / _FINAL_DIR / _SHARDED_DIR
                checkpoint_module.save(self._final_dir, acco, self.lightning_module)
            else:
                self._final_state = self._consolidated_state()
        self._acco_finished = True
        acco.finish()
        acco.train()  # drops a copy eval() may still hold; the model keeps finish()'s parameters

    def close(self) -> None:
        """Stop acco without landing anything and with no collective (after an error)."""
        if self._acco is not None and not self._acco_finished:
            self._acco_finished = True
            self._acco.close()

    def on_exception(self, exception: BaseException) -> None:
        self.close()
        super().on_exception(exception)

    def teardown(self) -> None:
        self.close()  # after finish() a no-op; after an error no collective runs
        self._final_state = None
        if self._final_dir is not None and self.is_global_zero:
            shutil.rmtree(self._final_dir.parent, ignore_errors=True)
        self._final_dir = None
        super().teardown()

    def _live(self) -> bool:
        return self._acco is not None and not self._acco_finished

    def _require_acco(self) -> LightningAccoOptimizer:
        if self._acco is None:
            raise RuntimeError("AccoStrategy: the AccoOptimizer is built when fit() sets the strategy up")
        return self._acco

    # ------------------------------------------------------------------------ checkpoints

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The committed parameters (``local`` mode: the global values of the last landed
        round), the model a DDP run would save; the live ones go with the optimizer state."""
        if not self._live() or self.mode is Mode.SYNC or not (self.is_global_zero or self._sharded()):
            return super().lightning_module_state_dict()
        acco = self._require_acco()
        acco.eval()
        try:
            return {name: value.clone() for name, value in super().lightning_module_state_dict().items()}
        finally:
            acco.train()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """acco's whole state on rank 0 (``consolidate_state_dict``, collective), with the
        live parameters where they differ from the committed ones; ``{}`` on other ranks.
        After ``finish()``: the state it was called with (kept by :meth:`finish`); after an
        error: no state, only a marker saying so."""
        if not self._live():
            return self._final_state if self._final_state is not None else {FINISHED_KEY: True}
        if self._sharded():
            return {}  # save_checkpoint writes acco's state, every rank its shard
        return self._consolidated_state()

    def _consolidated_state(self) -> dict[str, Any]:
        """acco's whole state on rank 0, with the live parameters in ``acco`` and ``dpu``
        mode; ``{}`` on the other ranks. Collective."""
        acco = self._require_acco()
        acco.consolidate_state_dict(to=0)
        if not self.is_global_zero:
            return {}
        state = dict(acco.state_dict())
        if self.mode in (Mode.ACCO, Mode.DPU):
            state[LIVE_PARAMETERS_KEY] = {n: p.detach().clone() for n, p in self.lightning_module.named_parameters()}
        return state

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Restore acco's state (and the live parameters) into the fresh AccoOptimizer.

        Raises:
            ValueError: the checkpoint was saved after ``finish()`` or holds no acco state
                (a DDP checkpoint, say); acco's own checks name any other mismatch.
        """
        if self._sharded():
            return  # load_checkpoint has restored it
        acco = self._require_acco()
        states = checkpoint.get("optimizer_states") or [{}]
        state = dict(states[0])
        if state.get(FINISHED_KEY) or not state:
            raise ValueError(
                "This checkpoint holds no acco optimizer state: it was saved after training ended (finish()) or "
                "after an error, or not by AccoStrategy. Resume from a checkpoint saved during training, or load "
                "the weights alone (LightningModule.load_from_checkpoint)"
            )
        live = state.pop(LIVE_PARAMETERS_KEY, None)
        if live is not None:
            _copy_parameters(self.lightning_module, live)
        acco.load_state_dict(state)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Lightning's file on rank 0; with ``checkpoint="sharded"`` a directory instead:
        acco's DCP checkpoint under ``acco/`` (every rank writes its shard, with the live
        parameters as the model; after ``finish()``, a copy of the one it wrote) and the
        Trainer's other entries in ``lightning.pt`` (rank 0).

        .. warning:: Collective with ``checkpoint="sharded"``.
        """
        if not self._sharded():
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(filepath)
        if self._live():
            checkpoint_module.save(path / _SHARDED_DIR, self._require_acco(), self.lightning_module)
        elif self._final_dir is not None and self.is_global_zero:
            # DCP's files are on a file system every rank reads (its metadata names them all).
            shutil.rmtree(path / _SHARDED_DIR, ignore_errors=True)
            shutil.copytree(self._final_dir, path / _SHARDED_DIR)
        if self.is_global_zero:
            path.mkdir(parents=True, exist_ok=True)
            # The model is in acco's DCP checkpoint (as DTensor blocks on a mesh), not here;
            # after an error, or after finish() with no checkpoint callback, only here.
            has_acco = self._live() or self._final_dir is not None
            torch.save({**checkpoint, "state_dict": {}} if has_acco else checkpoint, path / _META_FILE)
        self.barrier()

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """With ``checkpoint="sharded"``: acco's DCP checkpoint, read into the AccoOptimizer
        built by then (the model's live parameters and acco's state, resharded to this world
        size). Otherwise Lightning's."""
        if not self._sharded():
            return super().load_model_state_dict(checkpoint, strict=strict)
        directory = Path(checkpoint["acco_checkpoint_dir"])
        if not (directory / ".metadata").is_file():
            raise ValueError(f"{directory.parent} holds no acco checkpoint ({_SHARDED_DIR}/): not saved by "
                             "AccoStrategy(checkpoint='sharded') during training")
        checkpoint_module.load(directory, self._require_acco(), self.lightning_module)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if not self._sharded() or not Path(checkpoint_path).is_dir():
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        loaded = torch.load(Path(checkpoint_path) / _META_FILE, map_location="cpu", weights_only=False)
        loaded["acco_checkpoint_dir"] = str(Path(checkpoint_path) / _SHARDED_DIR)
        return loaded

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # A sharded checkpoint is read into the built AccoOptimizer; a file needs nothing built.
        return self._sharded()

    def _sharded(self) -> bool:
        return self.checkpoint_format == "sharded"


class _AccoLifecycle(Callback):
    """The strategy's own callback, first in ``trainer.callbacks``: ``finish()`` when
    training ends, before the other callbacks' ``on_train_end`` (``ModelCheckpoint``'s last
    save), and ``close()`` (no collective) at an exception, before their ``on_exception``."""

    def __init__(self, strategy: AccoStrategy) -> None:
        self.strategy = strategy

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.strategy.finish()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.strategy.close()


# ------------------------------------------------------------------------------ checks


def check_trainer(trainer: pl.Trainer, mode: Mode) -> None:
    """``ValueError`` for a Trainer setting acco cannot honour in ``mode`` (before the process
    group): value clipping, a precision plugin, an ``accumulate_grad_batches`` (or one a
    ``GradientAccumulationScheduler`` will set) that one update's rounds cannot split."""
    algorithm = str(getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm))
    if trainer.gradient_clip_val and algorithm == "value":
        raise ValueError(
            f"Invalid gradient_clip_algorithm='value' (gradient_clip_val={trainer.gradient_clip_val}) for acco: it "
            "clips each element of one rank's gradient, which acco never holds whole (it averages the ranks' "
            "gradients in shards on its comm lane); clip by norm (gradient_clip_algorithm='norm'), which acco "
            "applies to the global averaged gradient"
        )
    check_precision(trainer.precision_plugin, _ACCEPTED_PRECISION)
    if not trainer.lightning_module.automatic_optimization:
        return  # the module calls step(): each call is a round
    fix = "or AccoStrategy(mode='dpu') (one round per update, one round stale)"
    schedules = [c for c in trainer.callbacks if isinstance(c, GradientAccumulationScheduler)]
    if not schedules:
        check_micro_batches(mode, trainer.accumulate_grad_batches, "accumulate_grad_batches", fix)
    for schedule in schedules:  # it sets accumulate_grad_batches (left at 1) at each epoch's start
        for epoch, accumulate in sorted(schedule.scheduling.items()):
            check_micro_batches(mode, accumulate, f"GradientAccumulationScheduler scheduling[{epoch}]", fix)


def _copy_parameters(module: torch.nn.Module, values: Mapping[str, Tensor]) -> None:
    named = dict(module.named_parameters())
    if named.keys() != values.keys():
        raise ValueError(
            f"The checkpoint's live parameters do not fit this model: {sorted(set(named) ^ set(values))[:5]} differ"
        )
    with torch.no_grad():
        for name, param in named.items():
            param.copy_(values[name])
