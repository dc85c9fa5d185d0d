"""Numerics observability: per-tensor quantization statistics, a hook-based observer for converted models, and
NaN/Inf localisation (the first module and tensor of a step that went non-finite), automatic per-layer
precision fallback driven by the sampled statistics, layer sensitivity and automatic per-layer precision under a
bits budget."""

from ._autoprecision import PrecisionPlan as PrecisionPlan
from ._autoprecision import bits_per_element as bits_per_element
from ._autoprecision import choose_precision as choose_precision
from ._autoprecision import probe_recipe as probe_recipe
from ._autoprecision import solve_budget as solve_budget
from ._autoprecision import storage_bits as storage_bits
from ._autoprecision import training_linear as training_linear
from ._autoprecision import training_probe as training_probe
from ._autoprecision import uniform_plan as uniform_plan
from ._fallback import FallbackController as FallbackController
from ._localize import Localization as Localization
from ._localize import localize_nonfinite as localize_nonfinite
from ._localize import nonfinite_summary as nonfinite_summary
from ._observer import ROLES as ROLES
from ._observer import StatsObserver as StatsObserver
from ._observer import records_from_scalars as records_from_scalars
from ._observer import worst_layers as worst_layers
from ._sensitivity import LayerSensitivity as LayerSensitivity
from ._sensitivity import group_layers as group_layers
from ._sensitivity import layer_sensitivity as layer_sensitivity
from ._sensitivity import resolve_candidate as resolve_candidate
from ._sensitivity import sensitivity_table as sensitivity_table
from ._tensor_stats import STATS as STATS
from ._tensor_stats import tensor_stats as tensor_stats

__all__ = [
    "ROLES",
    "STATS",
    "FallbackController",
    "LayerSensitivity",
    "Localization",
    "PrecisionPlan",
    "StatsObserver",
    "bits_per_element",
    "choose_precision",
    "group_layers",
    "layer_sensitivity",
    "localize_nonfinite",
    "nonfinite_summary",
    "probe_recipe",
    "records_from_scalars",
    "resolve_candidate",
    "sensitivity_table",
    "solve_budget",
    "storage_bits",
    "tensor_stats",
    "training_linear",
    "training_probe",
    "uniform_plan",
    "worst_layers",
]
