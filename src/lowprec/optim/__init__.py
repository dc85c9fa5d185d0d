"""Optimizer policies from a recipe: low-precision weights (nearest, stochastic, Kahan), state formats, loss scaling."""

from ._optimizer import LowPrecisionOptimizer as LowPrecisionOptimizer
from ._scaler import LossScaler as LossScaler

__all__ = ["LossScaler", "LowPrecisionOptimizer"]
