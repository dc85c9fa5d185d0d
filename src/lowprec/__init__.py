"""lowprec: exact emulation of low-precision number formats and training numerics."""

from . import formats as formats
from . import nn as nn
from . import optim as optim
from . import quant as quant
from . import recipes as recipes
from ._version import __version__ as __version__
from .formats import FormatSpec as FormatSpec
from .nn import convert as convert
from .nn import unconvert as unconvert
from .quant import QuantSpec as QuantSpec
from .quant import dequantize as dequantize
from .quant import fake_quantize as fake_quantize
from .quant import quantize as quantize
from .quant import quantize_scaled as quantize_scaled
from .recipes import Recipe as Recipe

__all__ = [
    "FormatSpec",
    "QuantSpec",
    "Recipe",
    "__version__",
    "convert",
    "dequantize",
    "fake_quantize",
    "formats",
    "nn",
    "optim",
    "quant",
    "quantize",
    "quantize_scaled",
    "recipes",
    "unconvert",
]
