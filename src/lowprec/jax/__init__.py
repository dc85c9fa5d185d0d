"""lowprec for JAX: the same quantizers as ``lowprec.quant`` (same names, arguments and bits), jit- and vmap-able.

Import it explicitly (``import lowprec.jax``); ``import lowprec`` does not import JAX.  Formats and specs are the
shared ``lowprec.formats`` / ``lowprec.QuantSpec``.
"""

from ..quant._scaled import TwoLevelScales as TwoLevelScales
from ..quant._spec import QuantSpec as QuantSpec
from ._quantize import quantize as quantize
from ._scaled import dequantize as dequantize
from ._scaled import fake_quantize as fake_quantize
from ._scaled import quantize_scaled as quantize_scaled

__all__ = ["QuantSpec", "TwoLevelScales", "dequantize", "fake_quantize", "quantize", "quantize_scaled"]
