"""lowprec for JAX: the same quantizers as ``lowprec.quant`` (same names, arguments and bits), jit- and vmap-able,
recipe-emulated linear layers (``linear``, ``dot_general``) whose forward and backward GEMMs follow a
``lowprec.LinearRecipe``, and the recipe's weight-update policies around an optax optimizer
(``LowPrecisionOptimizer``).  See docs/jax.md.

Import it explicitly (``import lowprec.jax``); ``import lowprec`` does not import JAX.  Formats, specs and recipes
are the shared ``lowprec.formats`` / ``lowprec.QuantSpec`` / ``lowprec.Recipe``.
"""

from ..quant._scaled import TwoLevelScales as TwoLevelScales
from ..quant._spec import QuantSpec as QuantSpec
from ._dense import dot_general as dot_general
from ._dense import init_state as init_state
from ._dense import linear as linear
from ._optax import LowPrecisionOptimizer as LowPrecisionOptimizer
from ._optax import LowPrecisionState as LowPrecisionState
from ._quantize import quantize as quantize
from ._scaled import dequantize as dequantize
from ._scaled import fake_quantize as fake_quantize
from ._scaled import quantize_scaled as quantize_scaled

__all__ = [
    "LowPrecisionOptimizer",
    "LowPrecisionState",
    "QuantSpec",
    "TwoLevelScales",
    "dequantize",
    "dot_general",
    "fake_quantize",
    "init_state",
    "linear",
    "quantize",
    "quantize_scaled",
]
