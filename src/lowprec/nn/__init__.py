"""PyTorch modules with recipe-emulated GEMMs: ``convert``/``unconvert``, ``EmulatedLinear``, ``functional.matmul``."""

from . import functional as functional
from ._convert import convert as convert
from ._convert import unconvert as unconvert
from ._linear import EmulatedLinear as EmulatedLinear

__all__ = ["EmulatedLinear", "convert", "functional", "unconvert"]
