"""Recipes for ``python -m torchtitan.train --module acco.integrations.torchtitan --config NAME``.

Each returns an :class:`~acco.integrations.torchtitan.AccoTrainer` config; the mode is a
config field (``--optimizer.mode acco|dpu|sync|local``), and every other field takes
torchtitan's command-line overrides as usual.

- :func:`acco_llama3_debugmodel`: torchtitan's llama3 ``debugmodel`` (dim 256, 6 layers,
  vocab 2048) on the standard library's documentation, byte-tokenized (no download), every
  rank a replica, two micro-batches per step (``acco`` mode's estimate and commit rounds).
  Runs on CPU ranks (gloo) and on GPUs.
- :func:`acco_llama3_8b`: the same recipe at Llama 3 8B's shape, FSDP2 over 8 ranks inside
  each replica group; a config for clusters, not run here.
"""

from __future__ import annotations

import torch
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer
from torchtitan.components.validate import Validator
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import model_registry
from torchtitan.protocols.model_spec import ModelSpec

from acco.integrations.torchtitan.container import acco_adamw
from acco.integrations.torchtitan.data import ByteTokenizer, PydocTextDataLoader
from acco.integrations.torchtitan.trainer import AccoCheckpointManager, AccoTrainer

__all__ = ["acco_llama3_8b", "acco_llama3_debugmodel"]


def acco_llama3_debugmodel() -> AccoTrainer.Config:
    """torchtitan's ``llama3_debugmodel`` recipe under acco: the same model, AdamW (lr 8e-4,
    betas (0.9, 0.95), weight decay 0.1), warm-up and linear decay, clipping at 1.0; the data
    and tokenizer of :mod:`acco.integrations.torchtitan.data`; ``seq_len`` 256 and 4 windows a
    micro-batch, 2 micro-batches a step per rank; checkpoints every 10 steps when enabled
    (``--checkpoint.enable``); the plain cross-entropy (torchtitan's chunked one runs its own
    backward per chunk). On CPU the attention is causal SDPA (:func:`_causal_attention`)."""
    model_spec = model_registry("debugmodel")
    if torch._utils._get_available_device_type() is None:
        _causal_attention(model_spec)
    return AccoTrainer.Config(
        loss=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(model_spec)),
        model_spec=model_spec,
        tokenizer=ByteTokenizer.Config(),
        dataloader=PydocTextDataLoader.Config(),
        optimizer=acco_adamw(mode="acco", lr=8e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                                  min_lr_factor=0.0),
        # global_batch_size -1 is one micro-batch a step; acco mode needs two.
        training=TrainingConfig(local_batch_size=4, global_batch_size=-2, seq_len=256, steps=10,
                                disable_cuda_graphs=True),
        metrics=MetricsProcessor.Config(log_freq=1),
        parallelism=ParallelismConfig(data_parallel_replicate_degree=-1, data_parallel_shard_degree=1,
                                      spmd_backend="partial_dtensor"),
        checkpoint=AccoCheckpointManager.Config(interval=10, last_save_model_only=False),
        activation_checkpoint=SelectiveAC.Config(),
        validator=Validator.Config(freq=5, steps=10),
    )


def _causal_attention(model_spec: ModelSpec) -> None:
    """On CPU: FlexAttention has no backward there (torch 2.13), so the model attends
    causally over each window with ``scaled_dot_product_attention`` (no masking at topic
    boundaries inside a window; positions still restart at each topic for RoPE)."""
    for _, _, parent, name in model_spec.model.traverse(FlexAttention.Config):
        setattr(parent, name, ScaledDotProductAttention.Config())


def acco_llama3_8b() -> AccoTrainer.Config:
    """:func:`acco_llama3_debugmodel` at Llama 3 8B's shape: FSDP2 over 8 ranks inside each
    replica group (one node), acco across nodes, ``seq_len`` 8192, one window a micro-batch,
    lr 3e-4 with 200 warm-up steps, bf16 parameters. Untested here (no such machine)."""
    config = acco_llama3_debugmodel()
    config.model_spec = model_registry("8B")
    config.loss = CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(config.model_spec))
    config.optimizer = acco_adamw(mode="acco", lr=3e-4)
    config.lr_scheduler = LRSchedulersContainer.Config(warmup_steps=200)
    config.training = TrainingConfig(local_batch_size=1, global_batch_size=-2, seq_len=8192, steps=1000,
                                     disable_cuda_graphs=True)
    config.parallelism = ParallelismConfig(data_parallel_replicate_degree=-1, data_parallel_shard_degree=8,
                                           spmd_backend="partial_dtensor")
    config.checkpoint = AccoCheckpointManager.Config(interval=500, last_save_model_only=True)
    return config
