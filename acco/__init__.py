"""acco: data-parallel training that accumulates while it communicates (ACCO, NeurIPS 2025)."""

from acco.optim import AccoOptimizer, CommLaneError, Mode, NonFinite, RoundKind, RoundStats
from acco.sharding import Layout

__all__ = ["AccoOptimizer", "CommLaneError", "Layout", "Mode", "NonFinite", "RoundKind", "RoundStats"]
__version__ = "0.1.0"
