"""Which emulated linears take the output of a ReLU-like activation: found once, when a model is converted.

Why it matters (CPU, torch.compile only).  An ``EmulatedLinear`` saves Q(x), its quantized input, for the
grad_weight GEMM.  When x is ``relu(h)``, ReLU's backward needs ``relu(h) > 0``; with only Q(x) saved, AOTAutograd's
partitioner saves that mask as a bool tensor, and inductor's vectorised CPU store of a bool mask runs about 100x
slower than a float store (torch 2.13, AVX2: 7 ms against 27 us for 131 072 elements; bench_train's MLP spent 3 of
its 20 ms there).  Such a linear saves x instead and quantizes it again in backward, so the mask is recomputed
there, fused into ReLU's backward.  Other inputs (LayerNorm, GELU, attention outputs) gain nothing from that and
would pay the extra quantization, so only ReLU-like producers are marked.

How: from the model's structure alone, without running any of its code (tracing a user's forward can change its
state: a step counter, a cache): a linear is marked when it directly follows a ReLU-like activation module in an
``nn.Sequential``.  Elsewhere set ``linear.input_after_mask = True`` yourself.  The bits are the same either way;
only the compiled step's speed differs.
"""

from __future__ import annotations

from torch import nn

from ._linear import EmulatedLinear

# activations whose backward saves a mask of their output (threshold_backward / hardtanh_backward / leaky_relu)
_MASKED_MODULES = (nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.LeakyReLU, nn.Threshold)


def mark_masked_inputs(model: nn.Module) -> list[str]:
    """Set ``input_after_mask`` on every ``EmulatedLinear`` of ``model`` that directly follows a ReLU-like
    activation module in an ``nn.Sequential``; returns their qualified names."""
    marked = []
    for prefix, seq in model.named_modules():
        if not isinstance(seq, nn.Sequential):
            continue
        children = list(seq.named_children())
        for (_, before), (name, lin) in zip(children, children[1:], strict=False):
            if isinstance(before, _MASKED_MODULES) and isinstance(lin, EmulatedLinear):
                lin.input_after_mask = True
                marked.append(f"{prefix}.{name}" if prefix else name)
    return marked
