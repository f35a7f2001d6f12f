"""Integrations of acco with training frameworks.

Each lives in its own module and imports its framework only when imported itself, so
``import acco`` never needs them:

- :mod:`acco.integrations.hf`: ``AccoTrainer``, a ``transformers.Trainer`` that trains with
  ``AccoOptimizer`` (``pip install 'acco[hf]'``).
- :mod:`acco.integrations.lightning`: ``AccoStrategy``, a Lightning Trainer strategy, and
  :mod:`acco.integrations.fabric`: ``AccoFabricStrategy``, a Fabric one
  (``pip install 'acco[lightning]'``).
- :mod:`acco.integrations.torchtitan`: ``AccoTrainer``, ``AccoOptimizersContainer``,
  ``AccoCheckpointManager`` and recipes for torchtitan's ``Trainer``
  (``pip install 'acco[torchtitan]'``).
- :mod:`acco.integrations.schedules`: what they share (no framework import).
"""

__all__: list[str] = []
