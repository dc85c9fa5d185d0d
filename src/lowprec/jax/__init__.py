"""lowprec for JAX: the same quantizers as ``lowprec.quant`` (same names, arguments and bits), jit- and vmap-able,
recipe-emulated linear layers (``linear``, ``dot_general``) whose forward and backward GEMMs follow a
``lowprec.LinearRecipe``, the recipe's weight-update policies around an optax optimizer
(``LowPrecisionOptimizer``), and exported programs (``export``, ``save``, ``load``: serialized StableHLO with the
emulated numerics inside, for any PJRT backend).  See docs/jax.md and docs/xla.md.

Import it explicitly (``import lowprec.jax``); ``import lowprec`` does not import JAX.  Formats, specs and recipes
are the shared ``lowprec.formats`` / ``lowprec.QuantSpec`` / ``lowprec.Recipe``.
"""

from ..quant._scale_rules import TwoLevelScales as TwoLevelScales
from ..quant._spec import QuantSpec as QuantSpec
from ._dense import dot_general as dot_general
from ._dense import init_state as init_state
from ._dense import linear as linear
from ._export import custom_call_targets as custom_call_targets
from ._export import export as export
from ._export import load as load
from ._export import portable as portable
from ._export import register_containers as register_containers
from ._export import save as save
from ._optax import LowPrecisionOptimizer as LowPrecisionOptimizer
from ._optax import LowPrecisionState as LowPrecisionState
from ._parallel import CommState as CommState
from ._parallel import comm_keys as comm_keys
from ._parallel import comm_spec as comm_spec
from ._parallel import compressed_mean as compressed_mean
from ._parallel import data_parallel as data_parallel
from ._parallel import init_comm_state as init_comm_state
from ._quantize import quantize as quantize
from ._scaled import dequantize as dequantize
from ._scaled import fake_quantize as fake_quantize
from ._scaled import quantize_scaled as quantize_scaled

__all__ = [
    "CommState",
    "LowPrecisionOptimizer",
    "LowPrecisionState",
    "QuantSpec",
    "TwoLevelScales",
    "comm_keys",
    "comm_spec",
    "compressed_mean",
    "custom_call_targets",
    "data_parallel",
    "dequantize",
    "dot_general",
    "export",
    "fake_quantize",
    "init_comm_state",
    "init_state",
    "linear",
    "load",
    "portable",
    "quantize",
    "quantize_scaled",
    "register_containers",
    "save",
]
