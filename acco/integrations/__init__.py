"""Integrations of acco with training frameworks.

Each lives in its own module and imports its framework only when imported itself, so
``import acco`` never needs them:

- :mod:`acco.integrations.hf`: ``AccoTrainer``, a ``transformers.Trainer`` that trains with
  ``AccoOptimizer`` (``pip install 'acco[hf]'``).
"""

__all__: list[str] = []
