"""PyTorch modules with recipe-emulated GEMMs: ``convert``/``unconvert``, ``EmulatedLinear``, ``EmulatedConv1D``,
the conversion report and ``functional.matmul``."""

from . import functional as functional
from ._convert import CONVERTERS as CONVERTERS
from ._convert import Converter as Converter
from ._convert import convert as convert
from ._convert import unconvert as unconvert
from ._linear import EmulatedConv1D as EmulatedConv1D
from ._linear import EmulatedLinear as EmulatedLinear
from ._report import ConversionReport as ConversionReport
from ._report import ModuleEntry as ModuleEntry
from ._report import conversion_report as conversion_report

__all__ = [
    "CONVERTERS", "ConversionReport", "Converter", "EmulatedConv1D", "EmulatedLinear", "ModuleEntry",
    "conversion_report", "convert", "functional", "unconvert",
]
