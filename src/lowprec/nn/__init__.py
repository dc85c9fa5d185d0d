"""PyTorch modules with recipe-emulated GEMMs: ``convert``/``unconvert``, ``EmulatedLinear``, ``EmulatedConv1D``,
``EmulatedExperts`` (MoE experts), emulated attention (``scaled_dot_product_attention``, ``emulate_attention``,
``attention_mode``), the conversion report and ``functional.matmul``."""

from . import functional as functional
from ._attention import attention_mode as attention_mode
from ._attention import emulate_attention as emulate_attention
from ._attention import restore_attention as restore_attention
from ._attention import scaled_dot_product_attention as scaled_dot_product_attention
from ._convert import CONVERTERS as CONVERTERS
from ._convert import Converter as Converter
from ._convert import convert as convert
from ._convert import unconvert as unconvert
from ._experts import EmulatedExperts as EmulatedExperts
from ._experts import is_experts as is_experts
from ._linear import EmulatedConv1D as EmulatedConv1D
from ._linear import EmulatedLinear as EmulatedLinear
from ._report import ConversionReport as ConversionReport
from ._report import ModuleEntry as ModuleEntry
from ._report import conversion_report as conversion_report

__all__ = [
    "CONVERTERS", "ConversionReport", "Converter", "EmulatedConv1D", "EmulatedExperts", "EmulatedLinear", "ModuleEntry",
    "attention_mode", "conversion_report", "convert", "emulate_attention", "functional", "is_experts",
    "restore_attention", "scaled_dot_product_attention", "unconvert",
]
