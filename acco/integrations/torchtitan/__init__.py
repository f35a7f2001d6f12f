"""torchtitan with acco: ``AccoTrainer``, ``AccoOptimizersContainer``, ``AccoCheckpointManager``
and recipes (``pip install 'acco[torchtitan]'``; torchtitan 0.3).

Train torchtitan's llama3 debug model on 2 CPU ranks (or GPUs) in any mode::

    torchrun --standalone --nproc_per_node=2 -m torchtitan.train \\
        --module acco.integrations.torchtitan --config acco_llama3_debugmodel \\
        --optimizer.mode acco --training.steps 20

- :class:`AccoOptimizersContainer` (:mod:`.container`): torchtitan's optimizer container
  whose ``Config`` adds acco's fields (``mode``, ``max_grad_norm``, ``sync_every``,
  ``outer_bits``, ...), one :class:`~acco.AccoOptimizer` over its param groups.
- :class:`AccoTrainer` (:mod:`.trainer`): torchtitan's ``Trainer`` whose step hands each
  micro-batch's backward to acco, clips in acco, and validates and checkpoints the committed
  parameters; acco across the replicate dimension, FSDP2 (and TP) inside a group.
- :class:`AccoCheckpointManager`: torchtitan's DCP checkpoints with acco's state in each
  step folder; a resumed run continues exactly; initial weights (a model-only load) rebuild acco.
- Elastic replica groups (``--optimizer.mode local --optimizer.elastic``): each torchrun job is
  one group of an elastic job on torchft (:class:`acco.elastic.TorchFT`), a restarted group
  heals from a peer.
- :mod:`.data`: a byte tokenizer and the standard library's documentation as text.
- :mod:`.config_registry`: ``acco_llama3_debugmodel``, ``acco_llama3_8b``.

docs/torchtitan.md: the commands, what differs from torchtitan's own optimizer and why,
what is refused, measured figures.
"""

try:
    import torchtitan  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("acco.integrations.torchtitan needs torchtitan: pip install 'acco[torchtitan]'") from error

from acco.integrations.torchtitan.config_registry import acco_llama3_8b, acco_llama3_debugmodel
from acco.integrations.torchtitan.container import AccoOptimizersContainer, acco_adamw
from acco.integrations.torchtitan.data import ByteTokenizer, PydocTextDataLoader
from acco.integrations.torchtitan.trainer import (AccoCheckpointManager, AccoTrainer, check_trainer_config,
                                                  set_timeouts_on_this_torch, use_cpu_without_accelerator)

__all__ = ["AccoCheckpointManager", "AccoOptimizersContainer", "AccoTrainer", "ByteTokenizer", "PydocTextDataLoader",
           "acco_adamw", "acco_llama3_8b", "acco_llama3_debugmodel", "check_trainer_config",
           "set_timeouts_on_this_torch", "use_cpu_without_accelerator"]
