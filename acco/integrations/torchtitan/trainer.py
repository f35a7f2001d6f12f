"""``AccoTrainer``: torchtitan's ``Trainer`` with acco owning the gradient reduction, and
``AccoCheckpointManager``: torchtitan's DCP checkpoints with acco's state beside them.

What changes against torchtitan's own step (docs/torchtitan.md has the whole story):

- the mesh: acco runs across the replicate dimension (``data_parallel_replicate_degree``;
  -1, the recipes' default, means every rank the other dimensions leave) and FSDP2 (and TP)
  inside a replica group, applied by the model's own ``parallelize`` function, which is shown
  the mesh without its replicate dimension (torchtitan would otherwise build HSDP, which
  all-reduces across replicas in every backward). The data loader still reads one shard per
  data-parallel rank of every group (torchtitan's ``batch`` mesh).
- the step: each micro-batch's backward runs inside acco's ``micro_batch()`` with its
  gradient a mean over the replica group's tokens of that micro-batch and that token count
  as its weight, so acco's update is the mean over every token of every rank, as
  torchtitan's is; no token all-reduce across replicas before the step. No
  ``clip_grad_norm_`` (it would clip local, unreduced gradients): acco clips the averaged
  gradient on its comm lane (``optimizer.max_grad_norm``, default ``training.max_norm``).
  ``optimizers.step()`` is acco's round boundary. The logged ``grad_norm`` is that of the
  last round acco has landed.
- validation and checkpoints see the committed parameters (``mode="local"``: the global
  values); the live ones (an acco estimate) go into acco's checkpoint, so a resumed run
  continues exactly. At the end of training ``finish()`` lands the last update.
- a model-only load before the first step (initial weights) builds acco again from them.
- ``optimizer.elastic``: this job is one replica group of an elastic job; its ranks read the
  group's part of the data, and a restarted group heals the trainer's step and the LR
  schedules from a peer with acco's state (:class:`AccoOptimizersContainer`).
- on a machine with no accelerator torchtitan falls back to ``device_type = "cuda"``;
  :func:`use_cpu_without_accelerator` points it at the CPU (gloo) instead. On torch 2.13
  (torchtitan 0.3 asks for a nightly) :func:`set_timeouts_on_this_torch` stands in for the
  one call it lacks.

Refused with a ``ValueError`` before any collective (:func:`check_trainer_config`): pipeline,
context and expert parallelism, an ``spmd_backend`` other than ``partial_dtensor``, CUDA
graphs, FSDP's CPU offload, asynchronous checkpoints, an optimizer config that is not
:class:`AccoOptimizersContainer`'s, a checkpoint config that is not
:class:`AccoCheckpointManager`'s (with checkpoints enabled), and an odd number of
micro-batches per step in ``acco`` mode; with ``optimizer.elastic``, more than one replica
group in a job and initial weights.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import math
import os
import resource
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.config import Configurable
from torchtitan.distributed import ParallelDims, utils as dist_utils
from torchtitan.trainer import Trainer

from acco import Mode
from acco import checkpoint as acco_checkpoint
from acco.integrations.schedules import check_micro_batches
from acco.integrations.torchtitan.container import ACCO_CHECKPOINT_DIR, AccoOptimizersContainer, check_container_config

__all__ = ["AccoCheckpointManager", "AccoTrainer", "check_trainer_config", "set_timeouts_on_this_torch",
           "use_cpu_without_accelerator"]

_SPMD_BACKEND = "partial_dtensor"  # DTensors for TP only; FSDP2 by fully_shard (docs/torchtitan.md)


class AccoCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` (DCP, ``step-N`` folders, ``keep_latest_k``,
    ``load_step``, resuming from the last one) with acco's state in each step folder.

    A full checkpoint writes acco's own sharded checkpoint (:mod:`acco.checkpoint`: master
    shards, base-optimizer state, the round in flight, pending gradients, the local mode's
    replicas, and the live parameters) into ``step-N/acco/``, then torchtitan's files with the
    model at its committed parameters (the ones ``finish()`` would leave). Loading reads
    torchtitan's, then acco's, which puts the live parameters back. acco's DCP entries are
    sharded per rank and reshardable (docs/checkpoints.md); the model entries stay torchtitan's
    own, so its tools (``last_save_in_hf``, model-only loads) read them as usual.

    Raises:
        ValueError: ``async_mode`` other than ``"disabled"`` (acco's state is read while
            the round in flight lands); loading a full checkpoint with no ``acco/``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    def __init__(self, config: Config, **kwargs: Any) -> None:
        check_checkpoint_config(config)
        super().__init__(config, **kwargs)

    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, *args: Any, **kwargs: Any) -> Any:
        container = self.states["optimizer"]
        if "optimizer" in state_dict:  # a full checkpoint (not last_save_model_only's last one)
            acco_checkpoint.save(Path(checkpoint_id) / ACCO_CHECKPOINT_DIR, container.require_acco(),
                                 container.model_parts[0])  # fmt: skip
        container.eval()
        try:
            return super().dcp_save(state_dict, checkpoint_id, *args, **kwargs)
        finally:
            container.train()

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, *args: Any, **kwargs: Any) -> None:
        super().dcp_load(state_dict, checkpoint_id, *args, **kwargs)
        container = self.states["optimizer"]
        if "optimizer" not in state_dict:  # a model-only load before the first step (step 0, initial_load_path)
            container.restart_from_model()  # acco reads the loaded parameters
            return
        directory = Path(checkpoint_id) / ACCO_CHECKPOINT_DIR
        if not (directory / ".metadata").is_file():
            raise ValueError(f"{checkpoint_id} holds no acco state ({ACCO_CHECKPOINT_DIR}/): not written by "
                             "AccoCheckpointManager; load its model alone (checkpoint.initial_load_model_only)")
        acco_checkpoint.load(directory, container.require_acco(), container.model_parts[0])


class AccoTrainer(Trainer):
    """torchtitan's ``Trainer``, training with :class:`AccoOptimizersContainer` (see the
    module docstring for what changes). Built by ``AccoTrainer.Config(...).build()``, which is
    what ``python -m torchtitan.train --module acco.integrations.torchtitan --config ...`` does.

    Raises:
        ValueError: a setting acco cannot honour (:func:`check_trainer_config`), before any
            collective.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    optimizers: AccoOptimizersContainer

    def __init__(self, config: Config) -> None:
        check_trainer_config(config)
        use_cpu_without_accelerator()
        set_timeouts_on_this_torch()
        # FSDP2 (and TP) inside a replica group: the model's parallelize function sees no
        # replicate dimension (torchtitan's own would build HSDP across it).
        spec = config.model_spec
        assert spec is not None
        parallelize = spec.parallelize_fn
        wrapped = isinstance(parallelize, functools.partial) and parallelize.func is _inside_replica_group
        if not wrapped:  # (a config built into a trainer before is wrapped already)
            config.model_spec = dataclasses.replace(spec, parallelize_fn=functools.partial(_inside_replica_group,
                                                                                          spec.parallelize_fn))
        elastic = config.optimizer.elastic
        if elastic and not isinstance(config.dataloader, _DataOfReplicaGroup.Config):
            # this job is one replica group: its ranks read their group's part of the data
            config.dataloader = _DataOfReplicaGroup.Config(loader=config.dataloader,
                                                           group=config.optimizer.replica_group,
                                                           groups=config.optimizer.replica_groups)  # fmt: skip
        super().__init__(config)
        dims = self.parallel_dims
        group = dims.get_mesh("dp_replicate").get_group() if dims.dp_replicate > 1 else _own_group()
        # A restarted elastic group heals the trainer's step and the schedules with acco's state.
        healed = {"train_state": self, "lr_scheduler": self.lr_schedulers} if elastic else None
        self.optimizers.start(process_group=group, micro_batches=self.gradient_accumulation_steps,
                              max_norm=config.training.max_norm, healed=healed)  # fmt: skip
        if config.validator.enable:
            self.validator = _CommittedValidator(self.validator, self.optimizers)

    def init_distributed(self) -> ParallelDims:
        """torchtitan's, with two of acco's defaults resolved: ``data_parallel_replicate_degree``
        -1, every rank the other dimensions leave is a replica (group); ``global_batch_size``
        -K, K micro-batches a step on every rank (torchtitan's -1 is one)."""
        config = self.config
        world_size = dist_utils.init_distributed(config.comm, enable_cpu_backend=config.training.enable_cpu_offload,
                                                 base_folder=config.dump_folder)  # fmt: skip
        parallelism = config.parallelism
        if parallelism.data_parallel_replicate_degree == -1:
            others = (parallelism.data_parallel_shard_degree * parallelism.tensor_parallel_degree
                      * parallelism.context_parallel_degree * parallelism.pipeline_parallel_degree)  # fmt: skip
            if world_size % others:
                raise ValueError(f"Invalid parallelism for {world_size} ranks: the shard, tensor, context and "
                                 f"pipeline degrees ({others} ranks a replica group) do not divide it")
            parallelism.data_parallel_replicate_degree = world_size // others
        dims = ParallelDims.from_config(parallelism, world_size)
        training = config.training
        if training.global_batch_size < -1:  # -K: K micro-batches a step on every rank
            training.global_batch_size *= -training.local_batch_size * dims.dp_replicate * dims.dp_shard
        return dims

    def train_step(self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> None:
        """One committed update (``local``: one inner update) of the step's micro-batches."""
        optimizers = self.optimizers
        optimizers.train()  # the live parameters, in case a save or a validation left others
        optimizers.zero_grad()
        lr_metrics = self.lr_schedulers.get_metrics()
        should_log = self.metrics_processor.should_log(self.step)
        batches = [next(data_iterator) for _ in range(self.gradient_accumulation_steps)]
        local_tokens = torch.stack([(labels != IGNORE_INDEX).sum() for _, labels in batches]).to(self.device)
        # Each micro-batch's gradient: the mean over its tokens on every rank of the replica
        # group (FSDP2 sums the group's gradients: torchtitan sets no divide factor, and acco
        # takes the group's mean); its weight: those tokens, the same on every rank of the group.
        group_tokens = local_tokens.clone()
        shard_size = self.parallel_dims.dp_shard
        if shard_size > 1:
            dist.all_reduce(group_tokens, group=self.parallel_dims.get_mesh("fsdp").get_group())
        local_loss_sum = torch.zeros((), device=self.device)
        for (input_dict, labels), tokens in zip(batches, group_tokens):
            input_dict = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in input_dict.items()}
            normaliser = tokens.to(torch.float32) / shard_size
            with optimizers.micro_batch(tokens):
                loss = self.forward_backward_step(input_dict=input_dict, labels=labels.to(self.device),
                                                  global_valid_tokens=normaliser)  # fmt: skip
            local_loss_sum += loss.detach() * normaliser
        self.checkpointer.maybe_wait_for_staging()
        optimizers.step()
        self.lr_schedulers.step()
        if should_log:
            self._log_step(local_loss_sum, local_tokens.sum(), lr_metrics)

    def _log_step(self, local_loss_sum: torch.Tensor, local_tokens: torch.Tensor, lr_metrics: dict[str, Any]) -> None:
        """torchtitan's per-step line (``loss:``, ``grad_norm:``, ...): the token mean of the
        loss over every rank (``local`` mode too: the replicas' mean) and its largest rank mean."""
        mesh = self.parallel_dims.get_optional_mesh("loss") if self.parallel_dims.dp_cp_enabled else None
        if mesh is not None:
            tokens = dist_utils.dist_sum(local_tokens.to(torch.float64), mesh)
            loss = dist_utils.dist_sum(local_loss_sum.to(torch.float64), mesh) / tokens
            max_loss = dist_utils.dist_max(local_loss_sum / local_tokens, mesh)
            seen = dist_utils.dist_sum(torch.tensor(self.ntokens_seen, dtype=torch.int64, device=self.device), mesh)
        else:
            loss = max_loss = float(local_loss_sum / local_tokens)
            seen = self.ntokens_seen
        if not math.isfinite(loss):
            raise RuntimeError(f"Loss is not finite (global_avg_loss={loss}) at step {self.step}. Stopping training.")
        self.metrics_processor.log(self.step, loss, max_loss, self.optimizers.grad_norm,
                                   extra_metrics={"n_tokens_seen": seen, **lr_metrics})  # fmt: skip

    def train(self) -> None:
        """torchtitan's loop, then ``finish()``: the last update lands and the model holds the
        last committed parameters (``local`` mode: the same global values on every replica)."""
        super().train()
        self.optimizers.finish()

    def close(self) -> None:
        """Stops acco with no collective if training did not end (an error), then torchtitan's."""
        if hasattr(self, "optimizers") and isinstance(self.optimizers, AccoOptimizersContainer):
            self.optimizers.close()
        super().close()


class _CommittedValidator:
    """torchtitan's validator, run at the committed parameters (``local`` mode: the global
    values), the live ones put back after."""

    def __init__(self, validator: Any, optimizers: AccoOptimizersContainer) -> None:
        self._validator = validator
        self._optimizers = optimizers

    def validate(self, model_parts: list[torch.nn.Module], step: int) -> None:
        self._optimizers.eval()
        try:
            self._validator.validate(model_parts, step)
        finally:
            self._optimizers.train()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._validator, name)


class _DataOfReplicaGroup(Configurable):
    """An elastic job's data: each replica group (its own torchrun job, whose batch mesh
    spans its own ranks alone) reads its own part, ``group`` of ``groups``, split further
    over its ranks as torchtitan splits it (torchtitan's torchft trainer re-ranks the same way)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        loader: Any = None
        """The data loader's own config."""

        group: int = 0
        groups: int = 1

        def build(self, *, dp_world_size: int, dp_rank: int, **kwargs: Any) -> Any:
            return self.loader.build(dp_world_size=dp_world_size * self.groups,
                                     dp_rank=self.group * dp_world_size + dp_rank, **kwargs)  # fmt: skip


class _ReplicaGroupDims:
    """``ParallelDims`` as a model's ``parallelize`` function sees it under acco: without the
    replicate dimension, so FSDP2 shards over ``fsdp`` (the group's ranks) only."""

    dp_replicate_enabled = False

    def __init__(self, dims: ParallelDims) -> None:
        self._dims = dims

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dims, name)


def _inside_replica_group(parallelize: Callable[..., Any], model: Any, *, parallel_dims: ParallelDims,
                          **kwargs: Any) -> Any:
    model = parallelize(model, parallel_dims=_ReplicaGroupDims(parallel_dims), **kwargs)
    if dist.get_backend(parallel_dims.get_mesh("fsdp").get_group()) == "gloo":
        # torchtitan sets FSDP2's divide factor to 1, which FSDP2 reduces with NCCL's
        # PREMUL_SUM; gloo has none: a plain sum, then the same factor.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    return model


def _own_group() -> Any:
    """One replica group: acco's process group is this rank alone (collective: every rank
    makes every one-rank group)."""
    group, _ = dist.new_subgroups(group_size=1)
    return group


# ----------------------------------------------------------------------------- checks


def check_trainer_config(config: Trainer.Config) -> None:
    """``ValueError`` for a setting acco cannot honour under torchtitan, naming it; reads the
    config and ``WORLD_SIZE`` only, so it raises before any process group or collective."""
    if not isinstance(config.optimizer, AccoOptimizersContainer.Config):
        raise ValueError(f"Invalid optimizer config {type(config.optimizer).__qualname__} for AccoTrainer: "
                         "use AccoOptimizersContainer.Config (acco_adamw(...))")
    check_container_config(config.optimizer)
    parallelism, training = config.parallelism, config.training
    refused = {
        "parallelism.pipeline_parallel_degree": (parallelism.pipeline_parallel_degree, 1),
        "parallelism.context_parallel_degree": (parallelism.context_parallel_degree, 1),
        "parallelism.expert_parallel_degree": (parallelism.expert_parallel_degree, 1),
        "parallelism.spmd_backend": (parallelism.spmd_backend, _SPMD_BACKEND),
        "training.disable_cuda_graphs": (training.disable_cuda_graphs, True),
        "training.enable_cpu_offload": (training.enable_cpu_offload, False),
    }
    for name, (value, supported) in refused.items():
        if value != supported:
            raise ValueError(f"Invalid {name}={value!r} for acco: only {supported!r} is supported "
                             "(docs/torchtitan.md, 'Refused')")
    if config.checkpoint.enable:
        if config.optimizer.elastic and (config.checkpoint.initial_load_path or config.checkpoint.initial_load_in_hf):
            raise ValueError("Invalid checkpoint.initial_load_path / initial_load_in_hf with optimizer.elastic: the "
                             "groups' first outer round runs before the initial weights load; load them into every "
                             "group's model before training (docs/torchtitan.md)")  # fmt: skip
        if not isinstance(config.checkpoint, AccoCheckpointManager.Config):
            raise ValueError(f"Invalid checkpoint config {type(config.checkpoint).__qualname__} for AccoTrainer: "
                             "use AccoCheckpointManager.Config, which saves acco's state")
        check_checkpoint_config(config.checkpoint)
    replicate, shard = parallelism.data_parallel_replicate_degree, parallelism.data_parallel_shard_degree
    if replicate == -1 and shard == -1:
        raise ValueError("Invalid parallelism: data_parallel_replicate_degree and data_parallel_shard_degree are "
                         "both -1; give the shard degree (ranks of FSDP2 inside a replica group)")
    if config.optimizer.elastic:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        others = max(shard, 1) * parallelism.tensor_parallel_degree
        groups = replicate if replicate != -1 else (world_size // others if shard != -1 else 1)
        if groups != 1:
            raise ValueError(f"Invalid parallelism for optimizer.elastic: {groups} replica groups in one job of "
                             f"{world_size} ranks (data_parallel_replicate_degree={replicate}, "
                             f"data_parallel_shard_degree={shard}); an elastic job's replica groups are torchrun jobs "
                             "of their own: give each one data_parallel_shard_degree = its ranks")  # fmt: skip
    mode = Mode(config.optimizer.mode)
    micro_batches = _micro_batches(config)
    if micro_batches is not None:
        check_micro_batches(mode, micro_batches, f"micro-batches per step ({micro_batches}: training.global_batch_size "
                            "/ (local_batch_size x data-parallel degree), or -global_batch_size)",
                            "e.g. --training.global_batch_size -2, or --optimizer.mode dpu")


def _micro_batches(config: Trainer.Config) -> int | None:
    """Micro-batches per step and rank, as far as the config and ``WORLD_SIZE`` tell."""
    training, parallelism = config.training, config.parallelism
    if training.global_batch_size < 0:
        return -training.global_batch_size
    replicate, shard = parallelism.data_parallel_replicate_degree, parallelism.data_parallel_shard_degree
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    others = parallelism.tensor_parallel_degree * max(shard, 1)
    degree = world_size // parallelism.tensor_parallel_degree if replicate == -1 or shard == -1 else replicate * shard
    if world_size % others or training.global_batch_size % (training.local_batch_size * degree):
        return None  # torchtitan's own checks name it
    return training.global_batch_size // (training.local_batch_size * degree)


def check_checkpoint_config(config: CheckpointManager.Config) -> None:
    if config.async_mode != "disabled":
        raise ValueError(f"Invalid checkpoint.async_mode={config.async_mode!r} for acco: only 'disabled' "
                         "(acco's state is read while its round in flight lands)")


# --------------------------------------------------------------------------------- CPU


def use_cpu_without_accelerator() -> None:
    """On a machine with no accelerator, point torchtitan at the CPU (gloo, ``cpu`` tensors)
    instead of its fallback to ``"cuda"``; a no-op where torch finds an accelerator.

    torchtitan reads ``device_type`` and ``device_module`` from module globals that several of
    its modules copied at import (``tools.utils``, ``distributed.utils``,
    ``distributed.parallel_dims``, ``components.metrics``, ``tools.profiler``); they are set
    here, at run time, with no change to torchtitan's files. The device module stands in for
    ``torch.cuda`` where the Trainer asks it for memory figures: the host's memory and this
    process's peak resident size.
    """
    if torch._utils._get_available_device_type() is not None:
        return
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as distributed_utils
    import torchtitan.tools.profiler as profiler
    import torchtitan.tools.utils as tools_utils

    for module in (tools_utils, distributed_utils, parallel_dims, metrics, profiler):
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = _CPU


def set_timeouts_on_this_torch() -> None:
    """torchtitan 0.3 changes its process groups' timeouts after the first step with
    ``torch.distributed.set_timeout``, which torch releases up to 2.13 lack (torchtitan asks
    for a nightly); there, its ``set_pg_timeouts`` is given the same procedure on torch's
    older private call. A no-op where torch has ``set_timeout``."""
    if hasattr(dist, "set_timeout"):
        return
    import torchtitan.distributed.utils as distributed_utils
    from torch.distributed.distributed_c10d import _set_pg_timeout

    def set_pg_timeouts(timeout: datetime.timedelta, parallel_dims: ParallelDims) -> None:
        # torchtitan's: a barrier first, so no rank shortens its timeouts while another still
        # needs the long ones; then every group of the mesh and the default one.
        dist.barrier()
        groups = [mesh.get_group() for mesh in parallel_dims.get_all_one_dimensional_meshes().values()]
        for group in [*groups, None]:
            _set_pg_timeout(timeout, group)

    distributed_utils.set_pg_timeouts = set_pg_timeouts


class _CpuDeviceModule:
    """What torchtitan asks its device module (``torch.cuda`` on GPU) for, on the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def set_device(device: Any) -> None:
        pass

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> SimpleNamespace:
        return SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak, "num_alloc_retries": 0,
                "num_ooms": 0}  # fmt: skip

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def synchronize(device: Any = None) -> None:
        pass


_CPU = _CpuDeviceModule()
