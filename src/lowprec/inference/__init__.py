"""Inference: post-training quantization schemes as data, the plan of which module gets which scheme, and the
dequantized weights a serving kernel computes with (``docs/inference.md``)."""

from ._checkpoint import from_compressed_tensors_config as from_compressed_tensors_config
from ._checkpoint import load_quantized as load_quantized
from ._checkpoint import save_quantized as save_quantized
from ._checkpoint import to_compressed_tensors_config as to_compressed_tensors_config
from ._compare import Comparison as Comparison
from ._compare import compare as compare
from ._greedy import GreedyResult as GreedyResult
from ._greedy import greedy_divergence as greedy_divergence
from ._judge import InferenceCriteria as InferenceCriteria
from ._judge import InferenceVerdict as InferenceVerdict
from ._judge import judge_comparison as judge_comparison
from ._judge import judge_inference as judge_inference
from ._plan import PlanEntry as PlanEntry
from ._plan import check_fit as check_fit
from ._plan import fake_quantize_weight as fake_quantize_weight
from ._plan import plan as plan
from ._plan import weight_spec as weight_spec
from ._presets import get as get
from ._presets import names as names
from ._quantize import QuantizedLinear as QuantizedLinear
from ._quantize import fake_quantize_activation as fake_quantize_activation
from ._quantize import quantize_model as quantize_model
from ._quantize import unquantize_model as unquantize_model
from ._record import load_verdicts as load_verdicts
from ._record import record_verdict as record_verdict
from ._report import write_inference_report as write_inference_report
from ._scheme import GRANULARITIES as GRANULARITIES
from ._scheme import ConfigGroup as ConfigGroup
from ._scheme import Granularity as Granularity
from ._scheme import Scheme as Scheme
from ._scheme import TensorScheme as TensorScheme

__all__ = [
    "GRANULARITIES",
    "Comparison",
    "ConfigGroup",
    "Granularity",
    "GreedyResult",
    "InferenceCriteria",
    "InferenceVerdict",
    "PlanEntry",
    "QuantizedLinear",
    "Scheme",
    "TensorScheme",
    "check_fit",
    "compare",
    "fake_quantize_activation",
    "fake_quantize_weight",
    "from_compressed_tensors_config",
    "get",
    "greedy_divergence",
    "judge_comparison",
    "judge_inference",
    "load_quantized",
    "load_verdicts",
    "names",
    "plan",
    "quantize_model",
    "record_verdict",
    "save_quantized",
    "to_compressed_tensors_config",
    "unquantize_model",
    "weight_spec",
    "write_inference_report",
]
