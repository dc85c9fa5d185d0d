"""lowprec: exact emulation of low-precision number formats and training numerics."""

from . import formats as formats
from . import quant as quant
from ._version import __version__ as __version__
from .formats import FormatSpec as FormatSpec
from .quant import QuantSpec as QuantSpec
from .quant import dequantize as dequantize
from .quant import fake_quantize as fake_quantize
from .quant import quantize as quantize
from .quant import quantize_scaled as quantize_scaled

__all__ = [
    "FormatSpec",
    "QuantSpec",
    "__version__",
    "dequantize",
    "fake_quantize",
    "formats",
    "quant",
    "quantize",
    "quantize_scaled",
]
