"""Numerics observability: per-tensor quantization statistics and a hook-based observer for converted models."""

from ._observer import ROLES as ROLES
from ._observer import StatsObserver as StatsObserver
from ._observer import records_from_scalars as records_from_scalars
from ._observer import worst_layers as worst_layers
from ._tensor_stats import STATS as STATS
from ._tensor_stats import tensor_stats as tensor_stats

__all__ = ["ROLES", "STATS", "StatsObserver", "records_from_scalars", "tensor_stats", "worst_layers"]
