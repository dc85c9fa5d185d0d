"""Built-in recipes and hardware numerics profiles.

Profiles are emulations: they reproduce the publicly described numerics of an accelerator's low-precision path
(formats, scaling, accumulation), not its exact hardware behaviour, which vendors do not fully specify.
"""

from __future__ import annotations

from collections.abc import Callable

from .._errors import UsageError
from ..quant._spec import QuantSpec
from ._recipe import (
    Accumulator,
    Attention,
    AttentionGranularity,
    Gemm,
    LinearRecipe,
    LossScaling,
    Operand,
    Recipe,
    Scaling,
    Weights,
)

_DELAYED = Scaling(kind="delayed", history_len=16, algorithm="max")
# defaults of _op/_linear (frozen dataclasses of immutable fields, so one shared instance is safe)
_CURRENT = Scaling()
_FP32_ACCUMULATOR = Accumulator()


def _op(spec: QuantSpec | str | None, scaling: Scaling = _CURRENT) -> Operand:
    if isinstance(spec, str):
        spec = QuantSpec.named(spec)
    return Operand(spec=spec, scaling=scaling)


def _linear(
    x: QuantSpec | str | None,
    w: QuantSpec | str | None,
    g: QuantSpec | str | None,
    *,
    scaling: Scaling = _CURRENT,
    accumulator: Accumulator = _FP32_ACCUMULATOR,
    output_format: str | None = None,
) -> LinearRecipe:
    """Input spec x, weight spec w, grad_output spec g, used in all three GEMMs as in HYBRID fp8 recipes."""

    def gemm(a: QuantSpec | str | None, b: QuantSpec | str | None) -> Gemm:
        return Gemm(a=_op(a, scaling), b=_op(b, scaling), accumulator=accumulator, output_format=output_format)

    return LinearRecipe(forward=gemm(x, w), grad_input=gemm(g, w), grad_weight=gemm(g, x))


def _elementwise(fmt: str, rounding: str = "nearest") -> QuantSpec:
    return QuantSpec(elem=fmt, scaling="none", rounding=rounding, saturate=False)  # type: ignore[arg-type]


def _with(spec: QuantSpec | str, **changes: object) -> QuantSpec:
    import dataclasses

    base = QuantSpec.named(spec) if isinstance(spec, str) else spec
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


_KEEP = ("*lm_head*", "*embed*", "*head")  # output heads and embeddings stay in high precision by convention


def fp32() -> Recipe:
    """Everything in float32: the reference."""
    return Recipe(name="fp32")


def bf16() -> Recipe:
    """bf16 GEMM operands and outputs (as torch.autocast), float32 master weights and optimizer state."""
    b = _elementwise("bfloat16")
    return Recipe(name="bf16", linear=_linear(b, b, b, output_format="bfloat16"))


def bf16_pure() -> Recipe:
    """bf16 weights updated with round-to-nearest: small updates are lost (the known-bad baseline)."""
    return Recipe(name="bf16-pure", linear=bf16().linear, weights=Weights(update="nearest", format="bfloat16"))


def bf16_sr() -> Recipe:
    """bf16 weights updated with stochastic rounding (Zamirai et al. 2020; Trainium's SR casts)."""
    return Recipe(name="bf16-sr", linear=bf16().linear, weights=Weights(update="stochastic", format="bfloat16"))


def bf16_kahan() -> Recipe:
    """bf16 weights updated with Kahan-compensated summation (a bf16 compensation buffer per weight)."""
    return Recipe(name="bf16-kahan", linear=bf16().linear, weights=Weights(update="kahan", format="bfloat16"))


def fp16_dynamic_loss_scale() -> Recipe:
    """fp16 GEMM operands and outputs, float32 masters, dynamic loss scaling (init 2^16, x2 / x0.5, 2000 steps)."""
    h = _elementwise("float16")
    return Recipe(
        name="fp16-dynamic-loss-scale",
        linear=_linear(h, h, h, output_format="float16"),
        loss_scaling=LossScaling(kind="dynamic"),
    )


def fp8_tensorwise() -> Recipe:
    """HYBRID fp8 with current (dynamic) per-tensor scaling: e4m3 input and weight, e5m2 grad_output (torchao's
    default tensorwise recipe); float32 accumulation and outputs."""
    return Recipe(
        name="fp8-tensorwise",
        linear=_linear("fp8_e4m3_tensorwise", "fp8_e4m3_tensorwise", "fp8_e5m2_tensorwise"),
        keep_high_precision=_KEEP,
    )


def fp8_unscaled() -> Recipe:
    """Negative control: e4m3 input and weight, e5m2 grad_output cast with NO scaling (values beyond the format
    saturate, small gradients flush to zero).  Known bad: used to show that the accuracy judge catches it."""
    x = QuantSpec(elem="float8_e4m3fn", scaling="none", saturate=True)
    g = QuantSpec(elem="float8_e5m2", scaling="none", saturate=True)
    return Recipe(name="fp8-unscaled", linear=_linear(x, x, g), keep_high_precision=_KEEP)


def fp8_delayed() -> Recipe:
    """HYBRID fp8 with delayed scaling: scales from the max of a 16-step amax history (TransformerEngine style)."""
    lin = _linear("fp8_e4m3_tensorwise", "fp8_e4m3_tensorwise", "fp8_e5m2_tensorwise", scaling=_DELAYED)
    return Recipe(name="fp8-delayed", linear=lin, keep_high_precision=_KEEP)


def fp8_rowwise() -> Recipe:
    """e4m3 everywhere with one power-of-two scale per GEMM row (torchao's rowwise recipe)."""
    row = QuantSpec(elem="float8_e4m3fn", scaling="axis", axis=-1, scale_format="float8_e8m0fnu",
                    scale_rounding="ceil")
    return Recipe(name="fp8-rowwise", linear=_linear(row, row, row), keep_high_precision=_KEEP)


def fp8_blockwise() -> Recipe:
    """DeepSeek-V3 fine-grained fp8: e4m3, 1x128 tiles for activations and gradients, 128x128 blocks for weights."""
    act, wt = "fp8_e4m3_1x128", "fp8_e4m3_128x128"
    return Recipe(name="fp8-blockwise", linear=_linear(act, wt, act), keep_high_precision=_KEEP)


def mxfp8() -> Recipe:
    """OCP MXFP8 (e4m3 elements, blocks of 32 along the reduction dimension, E8M0 floor-rule scales) everywhere."""
    return Recipe(name="mxfp8", linear=_linear("mxfp8_e4m3", "mxfp8_e4m3", "mxfp8_e4m3"), keep_high_precision=_KEEP)


def mxfp6() -> Recipe:
    """OCP MXFP6: e2m3 for input and weight, e3m2 (more range) for gradients."""
    return Recipe(name="mxfp6", linear=_linear("mxfp6_e2m3", "mxfp6_e2m3", "mxfp6_e3m2"), keep_high_precision=_KEEP)


def mxfp4() -> Recipe:
    """OCP MXFP4 everywhere; gradients use stochastic rounding (round-to-nearest fp4 gradients are biased)."""
    g = _with("mxfp4", rounding="stochastic")
    return Recipe(name="mxfp4", linear=_linear("mxfp4", "mxfp4", g), keep_high_precision=_KEEP)


def nvfp4() -> Recipe:
    """NVFP4 (e2m1, e4m3 scales per 16, float32 tensor scale); stochastic rounding on gradients."""
    g = _with("nvfp4", rounding="stochastic")
    return Recipe(name="nvfp4", linear=_linear("nvfp4", "nvfp4", g), keep_high_precision=_KEEP)


# ------------------------------------------------------------------------------------------------ attention
ATTENTION_SUFFIX = "+attn"
"""``get("<name>+attn")`` is ``with_attention(get("<name>"))`` for every built-in name."""


def _attention_gemm(g: Gemm, a: Operand, b: Operand) -> Gemm:
    return Gemm(a=Operand(spec=a.spec), b=Operand(spec=b.spec), accumulator=g.accumulator,
                output_format=g.output_format)


def with_attention(recipe: Recipe | str, *, granularity: AttentionGranularity = "tensor") -> Recipe:
    """``recipe`` with emulated attention whose formats follow its linear layers, named ``<name>+attn``.

    Q, K, V and the probabilities P are activations: they take the linear recipe's input spec
    (``linear.forward.a``) in every GEMM that reads them; the gradients dS and dO take its output-gradient spec
    (``linear.grad_input.a``).  Each attention GEMM keeps the accumulator and output rounding of the linear GEMM in
    the same position (forward, grad_input, grad_weight).  So fp8-tensorwise gives e4m3 Q, K, P, V and e5m2
    gradients, one scale per tensor (``granularity="head"``: per batch and head); mxfp8 gives MX blocks of 32
    along each GEMM's reduction dimension; bf16 recipes give bf16 operands and outputs; fp32 gives float32
    attention, bit-identical to PyTorch's math SDPA.  Delayed scaling becomes current scaling (attention keeps no
    amax history).  The existing built-in recipes are unchanged (their ``attention`` stays None, and so do their
    hashes): ``get("fp8-tensorwise+attn")`` is ``with_attention(get("fp8-tensorwise"))``.
    """
    base = get(recipe)
    lin = base.linear
    x, g = lin.forward.a, lin.grad_input.a

    gemms = LinearRecipe(forward=_attention_gemm(lin.forward, x, x), grad_input=_attention_gemm(lin.grad_input, g, x),
                         grad_weight=_attention_gemm(lin.grad_weight, g, x))
    import dataclasses

    att = Attention(scores=gemms, values=gemms, granularity=granularity)
    return dataclasses.replace(base, name=base.name + ATTENTION_SUFFIX, attention=att)


# ------------------------------------------------------------------------------------------------ profiles
def trn_bf16_sr() -> Recipe:
    """Emulation of Trainium-style bf16 training: bf16 GEMM operands and outputs with float32 accumulation, bf16
    weights with stochastic rounding on the weight-update cast (AWS Neuron's documented SR mode)."""
    return Recipe(name="trn-bf16-sr", linear=bf16().linear, weights=Weights(update="stochastic", format="bfloat16"))


def h100_fp8() -> Recipe:
    """Emulation of H100/H800 fp8 tensor cores: HYBRID fp8 tensorwise operands; partial sums kept with about 14
    significant bits (an e8m13 accumulator, truncating) and promoted to float32 every 128 products, as DeepSeek-V3
    reports for H800.  The truncation is an assumption: NVIDIA does not document the accumulator's rounding."""
    acc = Accumulator(format="e8m13", chunk=128, rounding="toward_zero")
    lin = _linear("fp8_e4m3_tensorwise", "fp8_e4m3_tensorwise", "fp8_e5m2_tensorwise", accumulator=acc)
    return Recipe(name="h100-fp8", linear=lin, keep_high_precision=_KEEP)


def b200_mxfp8() -> Recipe:
    """Emulation of B200 MXFP8 training as in NVIDIA's MXFP8 pre-training study (arXiv 2506.08027): e4m3
    elements everywhere, E8M0 scales rounded up (never clipping) per 32 elements, float32 accumulation."""
    s = _with("mxfp8_e4m3", scale_rounding="ceil")
    return Recipe(name="b200-mxfp8", linear=_linear(s, s, s), keep_high_precision=_KEEP)


def b200_nvfp4() -> Recipe:
    """Emulation of B200 NVFP4 training: NVFP4 operands, stochastic rounding on gradients, float32 accumulation."""
    return Recipe(name="b200-nvfp4", linear=nvfp4().linear, keep_high_precision=_KEEP)


def mi300_fp8() -> Recipe:
    """Emulation of MI300 fp8 (the fnuz formats: e4m3fnuz max 240, e5m2fnuz), HYBRID, current per-tensor scaling."""
    x = QuantSpec(elem="float8_e4m3fnuz", scaling="tensor")
    g = QuantSpec(elem="float8_e5m2fnuz", scaling="tensor")
    return Recipe(name="mi300-fp8", linear=_linear(x, x, g), keep_high_precision=_KEEP)


_RECIPES: dict[str, Callable[[], Recipe]] = {
    "fp32": fp32,
    "bf16": bf16,
    "bf16-pure": bf16_pure,
    "bf16-sr": bf16_sr,
    "bf16-kahan": bf16_kahan,
    "fp16-dynamic-loss-scale": fp16_dynamic_loss_scale,
    "fp8-tensorwise": fp8_tensorwise,
    "fp8-delayed": fp8_delayed,
    "fp8-unscaled": fp8_unscaled,
    "fp8-rowwise": fp8_rowwise,
    "fp8-blockwise": fp8_blockwise,
    "mxfp8": mxfp8,
    "mxfp6": mxfp6,
    "mxfp4": mxfp4,
    "nvfp4": nvfp4,
    "trn-bf16-sr": trn_bf16_sr,
    "h100-fp8": h100_fp8,
    "b200-mxfp8": b200_mxfp8,
    "b200-nvfp4": b200_nvfp4,
    "mi300-fp8": mi300_fp8,
}
PROFILES = ("trn-bf16-sr", "h100-fp8", "b200-mxfp8", "b200-nvfp4", "mi300-fp8")


def names() -> list[str]:
    """Names of the built-in recipes and hardware profiles (each also exists as ``<name>+attn``, see ``get``)."""
    return list(_RECIPES)


def is_named(name: object) -> bool:
    """Whether ``get(name)`` knows ``name``: a built-in name or ``<built-in>+attn``."""
    return isinstance(name, str) and (name in _RECIPES or (name.endswith(ATTENTION_SUFFIX)
                                                             and name[: -len(ATTENTION_SUFFIX)] in _RECIPES))


def get(name: str | Recipe) -> Recipe:
    """The built-in recipe ``name`` (a Recipe is returned as is); ValueError listing the names otherwise.

    ``"<name>+attn"`` (e.g. "fp8-tensorwise+attn", "mxfp8+attn", "bf16-sr+attn") is ``with_attention(<name>)``:
    the same recipe with emulated attention in its formats.  These variants are derived, not listed by ``names``.
    """
    if isinstance(name, Recipe):
        return name
    fn = _RECIPES.get(name) if isinstance(name, str) else None
    if fn is None and isinstance(name, str) and name.endswith(ATTENTION_SUFFIX):
        if name[: -len(ATTENTION_SUFFIX)] in _RECIPES:
            return with_attention(name[: -len(ATTENTION_SUFFIX)])
    if fn is None:
        raise UsageError(f"unknown recipe {name!r}; valid names: {', '.join(_RECIPES)} (each also as "
                         f"'<name>{ATTENTION_SUFFIX}', with emulated attention)")
    return fn()
