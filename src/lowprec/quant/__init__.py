"""Quantizers: elementwise rounding, scaled and block-scaled quantization, real low-bit storage."""

from ._backend import backend as backend
from ._backend import get_backend as get_backend
from ._backend import set_backend as set_backend
from ._elementwise import quantize as quantize
from ._scaled import TwoLevelScales as TwoLevelScales
from ._scaled import dequantize as dequantize
from ._scaled import fake_quantize as fake_quantize
from ._scaled import quantize_scaled as quantize_scaled
from ._spec import QuantSpec as QuantSpec

__all__ = [
    "QuantSpec",
    "TwoLevelScales",
    "backend",
    "dequantize",
    "fake_quantize",
    "get_backend",
    "quantize",
    "quantize_scaled",
    "set_backend",
]
