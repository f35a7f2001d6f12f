"""acco: data-parallel training that accumulates while it communicates (ACCO, NeurIPS 2025).

See docs/design.md for the algorithm and a map of the modules.
"""

from acco.sharding import Layout
from acco.module_buffers import BufferPolicy
from acco.optim import AccoOptimizer
from acco.options import Mode, NonFinite, RoundKind, default_outer
from acco.replicas import PacingStall
from acco.rounds import CommLaneError
from acco.telemetry import RoundStats

__all__ = ["AccoOptimizer", "BufferPolicy", "CommLaneError", "Layout", "Mode", "NonFinite", "PacingStall", "RoundKind", "RoundStats", "default_outer"]
__version__ = "0.1.0"
