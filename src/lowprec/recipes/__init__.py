"""Recipes: training numerics as data, the built-in recipes and hardware numerics profiles."""

from ._named import PROFILES as PROFILES
from ._named import get as get
from ._named import is_named as is_named
from ._named import names as names
from ._named import with_attention as with_attention
from ._recipe import Accumulator as Accumulator
from ._recipe import Attention as Attention
from ._recipe import Fallback as Fallback
from ._recipe import Gemm as Gemm
from ._recipe import GradComm as GradComm
from ._recipe import LinearRecipe as LinearRecipe
from ._recipe import LossScaling as LossScaling
from ._recipe import Operand as Operand
from ._recipe import OptimizerState as OptimizerState
from ._recipe import Recipe as Recipe
from ._recipe import Scaling as Scaling
from ._recipe import Weights as Weights

__all__ = [
    "PROFILES",
    "Accumulator",
    "Attention",
    "Fallback",
    "Gemm",
    "GradComm",
    "LinearRecipe",
    "LossScaling",
    "Operand",
    "OptimizerState",
    "Recipe",
    "Scaling",
    "Weights",
    "get",
    "is_named",
    "names",
    "with_attention",
]
