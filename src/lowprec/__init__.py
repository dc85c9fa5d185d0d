"""lowprec: exact emulation of low-precision number formats and training numerics.

Formats, ``QuantSpec`` and recipes are pure Python and imported here; the PyTorch parts (``convert``,
``fake_quantize``, ``lowprec.nn``, ``lowprec.optim``, ...) are imported on first use, so ``import lowprec`` and
``import lowprec.jax`` work without torch (see ``lowprec._lazy``).
"""

import typing as _typing

from . import _lazy
from . import formats as formats
from . import quant as quant
from . import recipes as recipes
from ._errors import UsageError as UsageError
from ._version import __version__ as __version__
from .formats import FormatSpec as FormatSpec
from .quant import QuantSpec as QuantSpec
from .recipes import Recipe as Recipe

if _typing.TYPE_CHECKING:
    from . import nn as nn
    from . import optim as optim
    from .nn import convert as convert
    from .nn import unconvert as unconvert
    from .quant import dequantize as dequantize
    from .quant import fake_quantize as fake_quantize
    from .quant import quantize as quantize
    from .quant import quantize_scaled as quantize_scaled

__all__ = [
    "FormatSpec",
    "QuantSpec",
    "Recipe",
    "UsageError",
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

_TORCH_ATTRS: _lazy.LazyTable = {
    "nn": (".nn", None),
    "optim": (".optim", None),
    "convert": (".nn", "convert"),
    "unconvert": (".nn", "unconvert"),
    "dequantize": (".quant", "dequantize"),
    "fake_quantize": (".quant", "fake_quantize"),
    "quantize": (".quant", "quantize"),
    "quantize_scaled": (".quant", "quantize_scaled"),
}

if not _typing.TYPE_CHECKING:  # hidden from type checkers, which see the imports above (and flag unknown names)
    __getattr__, __dir__ = _lazy.attach(__name__, _TORCH_ATTRS, globals())
