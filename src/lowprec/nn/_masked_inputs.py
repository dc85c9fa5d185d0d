"""Which emulated linears take the output of a ReLU-like activation: found once, when a model is converted.

Why it matters (CPU, torch.compile only).  An ``EmulatedLinear`` saves Q(x), its quantized input, for the
grad_weight GEMM.  When x is ``relu(h)``, ReLU's backward needs ``relu(h) > 0``; with only Q(x) saved, AOTAutograd's
partitioner saves that mask as a bool tensor, and inductor's vectorised CPU store of a bool mask runs about 100x
slower than a float store (torch 2.13, AVX2: 7 ms against 27 us for 131 072 elements; bench_train's MLP spent 3 of
its 20 ms there).  Such a linear saves x instead and quantizes it again in backward, so the mask is recomputed
there, fused into ReLU's backward.  Other inputs (LayerNorm, GELU, attention outputs) gain nothing from that and
would pay the extra quantization, so only ReLU-like producers are marked.

How: ``torch.fx`` symbolic tracing of the converted model with the emulated linears as leaves.  A model that fx
cannot trace (data-dependent control flow, ...) marks nothing: the bits are the same either way, only the compiled
step's speed differs.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import fx, nn

from ._linear import EmulatedLinear

# activations whose backward saves a mask of their output (threshold_backward / hardtanh_backward / leaky_relu)
_MASKED_MODULES = (nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.LeakyReLU, nn.Threshold)
_MASKED_FUNCTIONS = {torch.relu, F.relu, F.relu6, F.hardtanh, F.leaky_relu, F.threshold, torch.clamp_min}
_MASKED_METHODS = {"relu", "clamp_min"}


class _Tracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, EmulatedLinear) or super().is_leaf_module(m, qualname)


def _is_masked(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    if node.op == "call_module":
        return isinstance(modules.get(str(node.target)), _MASKED_MODULES)
    if node.op == "call_function":
        return node.target in _MASKED_FUNCTIONS
    if node.op == "call_method":
        return node.target in _MASKED_METHODS
    return False


def mark_masked_inputs(model: nn.Module) -> list[str]:
    """Set ``input_after_mask`` on every ``EmulatedLinear`` of ``model`` whose input is the output of a ReLU-like
    activation; returns their qualified names (empty when fx cannot trace the model)."""
    try:
        with warnings.catch_warnings():  # tracing is an optimisation probe: its warnings are not the user's
            warnings.simplefilter("ignore")
            graph = _Tracer().trace(model)
    except Exception:  # any model fx cannot trace: nothing is marked (speed only, never bits)
        return []
    modules = dict(model.named_modules())
    marked = []
    for node in graph.nodes:
        if node.op != "call_module" or not isinstance(modules.get(str(node.target)), EmulatedLinear):
            continue
        src = node.args[0] if node.args else None
        if isinstance(src, fx.Node) and _is_masked(src, modules):
            lin = modules[str(node.target)]
            assert isinstance(lin, EmulatedLinear)
            lin.input_after_mask = True
            marked.append(str(node.target))
    return marked
