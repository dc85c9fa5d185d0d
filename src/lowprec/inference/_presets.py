"""Built-in post-training quantization schemes, each mirroring a compressed-tensors preset
(``compressed_tensors/quantization/quant_scheme.py``, ``PRESET_SCHEMES``; read at commit 0bb1251 of
vllm-project/compressed-tensors), as llm-compressor applies them and vLLM serves them.

All target ``Linear`` and ignore ``lm_head`` (llm-compressor's examples pass ``ignore=["lm_head"]``).
"""

from __future__ import annotations

from collections.abc import Callable

from .._errors import UsageError
from ._scheme import ConfigGroup, Scheme, TensorScheme

_IGNORE = ("lm_head",)


def _scheme(name: str, weights: TensorScheme, inputs: TensorScheme | None = None) -> Scheme:
    group = ConfigGroup(name="group_0", targets=("Linear",), weights=weights, input_activations=inputs)
    return Scheme(name=name, config_groups=(group,), ignore=_IGNORE)


def w8a8_int8() -> Scheme:
    """compressed-tensors ``W8A8`` (``INT8_W8A8``): int8 symmetric per-channel static weights, int8 symmetric
    dynamic per-token activations (vLLM's CompressedTensorsW8A8Int8)."""
    return _scheme("w8a8-int8", TensorScheme(format="int8", granularity="channel"),
                   TensorScheme(format="int8", granularity="token", dynamic=True))


def w4a16_int4() -> Scheme:
    """compressed-tensors ``W4A16``: int4 symmetric weights in groups of 128 along in_features, activations in
    high precision (GPTQ/AWQ-style checkpoints, vLLM's WNA16 / Marlin kernels)."""
    return _scheme("w4a16-int4", TensorScheme(format="int4", granularity="group", group_size=128))


def w4a16_int4_asym() -> Scheme:
    """compressed-tensors ``W4A16_ASYM``: as ``w4a16-int4`` with a zero point per group (AWQ's default)."""
    return _scheme("w4a16-int4-asym",
                   TensorScheme(format="int4", granularity="group", group_size=128, symmetric=False))


def fp8_static() -> Scheme:
    """compressed-tensors ``FP8``: e4m3 per-tensor static weights and per-tensor static (calibrated)
    activations."""
    return _scheme("fp8-static", TensorScheme(format="float8_e4m3fn"),
                   TensorScheme(format="float8_e4m3fn", dynamic=False))


def fp8_dynamic() -> Scheme:
    """compressed-tensors ``FP8_DYNAMIC``: e4m3 per-channel static weights, dynamic per-token activations
    (torchao's float8 rowwise inference; vLLM's CompressedTensorsW8A8Fp8)."""
    return _scheme("fp8-dynamic", TensorScheme(format="float8_e4m3fn", granularity="channel"),
                   TensorScheme(format="float8_e4m3fn", granularity="token", dynamic=True))


def fp8_block() -> Scheme:
    """compressed-tensors ``FP8_BLOCK`` (DeepSeek-V3 style): e4m3 weights with one scale per 128x128 block,
    dynamic activations with one scale per 1x128 group of each token."""
    return _scheme("fp8-block", TensorScheme(format="float8_e4m3fn", granularity="block", block=(128, 128)),
                   TensorScheme(format="float8_e4m3fn", granularity="group", group_size=128, dynamic=True))


def _mx(elem: str) -> TensorScheme:
    return TensorScheme(format=elem, granularity="group", group_size=32, scale_format="float8_e8m0fnu",
                        scale_rounding="floor")


def mxfp8() -> Scheme:
    """compressed-tensors ``MXFP8``: OCP MXFP8 (e4m3 elements, groups of 32, E8M0 scales) for weights and dynamic
    activations; the scale rule here is OCP MX v1.0's floor rule (``QuantSpec.named("mxfp8_e4m3")``)."""
    return _scheme("mxfp8", _mx("float8_e4m3fn"), _dynamic(_mx("float8_e4m3fn")))


def mxfp4() -> Scheme:
    """compressed-tensors ``MXFP4``: OCP MXFP4 (e2m1, groups of 32, E8M0 floor-rule scales) for weights and
    dynamic activations (``QuantSpec.named("mxfp4")``)."""
    return _scheme("mxfp4", _mx("float4_e2m1fn"), _dynamic(_mx("float4_e2m1fn")))


def _nvfp4(dynamic: bool | str) -> TensorScheme:
    return TensorScheme(format="float4_e2m1fn", granularity="tensor_group", group_size=16,
                        scale_format="float8_e4m3fn", dynamic=dynamic)  # type: ignore[arg-type]


def nvfp4() -> Scheme:
    """compressed-tensors ``NVFP4``: e2m1 in groups of 16 with e4m3 group scales and a float32 tensor scale
    (``QuantSpec.named("nvfp4")``); activations ``dynamic="local"`` (calibrated tensor scale, dynamic group
    scales), as NVIDIA ModelOpt's NVFP4 checkpoints."""
    return _scheme("nvfp4", _nvfp4(False), _nvfp4("local"))


def _dynamic(ts: TensorScheme) -> TensorScheme:
    import dataclasses

    return dataclasses.replace(ts, dynamic=True)


_PRESETS: dict[str, Callable[[], Scheme]] = {
    "w8a8-int8": w8a8_int8,
    "w4a16-int4": w4a16_int4,
    "w4a16-int4-asym": w4a16_int4_asym,
    "fp8-static": fp8_static,
    "fp8-dynamic": fp8_dynamic,
    "fp8-block": fp8_block,
    "mxfp8": mxfp8,
    "mxfp4": mxfp4,
    "nvfp4": nvfp4,
}


def names() -> list[str]:
    """The built-in scheme names, in table order."""
    return list(_PRESETS)


def get(name: str) -> Scheme:
    """A built-in scheme by name (``names()``)."""
    try:
        return _PRESETS[name]()
    except (KeyError, TypeError):
        raise UsageError(f"unknown scheme name {name!r}; valid names: {', '.join(_PRESETS)}") from None
