"""Numerics observability: per-tensor quantization statistics, a hook-based observer for converted models, and
NaN/Inf localisation (the first module and tensor of a step that went non-finite), and automatic per-layer
precision fallback driven by the sampled statistics."""

from ._fallback import FallbackController as FallbackController
from ._localize import Localization as Localization
from ._localize import localize_nonfinite as localize_nonfinite
from ._localize import nonfinite_summary as nonfinite_summary
from ._observer import ROLES as ROLES
from ._observer import StatsObserver as StatsObserver
from ._observer import records_from_scalars as records_from_scalars
from ._observer import worst_layers as worst_layers
from ._tensor_stats import STATS as STATS
from ._tensor_stats import tensor_stats as tensor_stats

__all__ = [
    "ROLES",
    "STATS",
    "FallbackController",
    "Localization",
    "StatsObserver",
    "localize_nonfinite",
    "nonfinite_summary",
    "records_from_scalars",
    "tensor_stats",
    "worst_layers",
]
