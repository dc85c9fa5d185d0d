"""Quantizers: elementwise rounding, scaled and block-scaled quantization, real low-bit storage.

``QuantSpec`` and ``TwoLevelScales`` are pure Python; the PyTorch quantizers (``quantize``, ``fake_quantize``, ...)
are imported on first use, so ``import lowprec.quant`` works without torch (see ``lowprec._lazy``).
"""

import typing as _typing

from .. import _lazy
from ._scale_rules import TwoLevelScales as TwoLevelScales
from ._spec import QuantSpec as QuantSpec

if _typing.TYPE_CHECKING:
    from ._backend import backend as backend
    from ._backend import get_backend as get_backend
    from ._backend import set_backend as set_backend
    from ._elementwise import quantize as quantize
    from ._scaled import dequantize as dequantize
    from ._scaled import fake_quantize as fake_quantize
    from ._scaled import quantize_scaled as quantize_scaled

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

_TORCH_ATTRS: _lazy.LazyTable = {
    "backend": ("._backend", "backend"),
    "get_backend": ("._backend", "get_backend"),
    "set_backend": ("._backend", "set_backend"),
    "quantize": ("._elementwise", "quantize"),
    "dequantize": ("._scaled", "dequantize"),
    "fake_quantize": ("._scaled", "fake_quantize"),
    "quantize_scaled": ("._scaled", "quantize_scaled"),
}

if not _typing.TYPE_CHECKING:  # hidden from type checkers, which see the imports above (and flag unknown names)
    __getattr__, __dir__ = _lazy.attach(__name__, _TORCH_ATTRS, globals())
