"""The built-in ``QuantSpec``s (OCP MX v1.0, NVFP4, fp8 tensorwise/rowwise, DeepSeek-V3 fine-grained tiles)."""

from __future__ import annotations

from .._errors import UsageError
from ._spec import QuantSpec, TwoLevelRule


def _mx(elem: str) -> QuantSpec:
    # OCP MX v1.0: blocks of 32 along the last (reduction) dim, E8M0 shared scale, floor rule, saturating elements.
    return QuantSpec(
        elem=elem, scaling="block", block_size=32, scale_format="float8_e8m0fnu", scale_rounding="floor"
    )


def _nvfp4(rule: TwoLevelRule) -> QuantSpec:
    # E2M1 elements, one E4M3 scale per 16 along the last dim, one float32 tensor scale
    return QuantSpec(elem="float4_e2m1fn", scaling="block", block_size=16, scale_format="float8_e4m3fn",
                     scale_rounding="nearest", tensor_scale=True, two_level_rule=rule)


_SPECS: dict[str, QuantSpec] = {
    "mxfp8_e4m3": _mx("float8_e4m3fn"),
    "mxfp8_e5m2": _mx("float8_e5m2"),
    "mxfp6_e3m2": _mx("float6_e3m2fn"),
    "mxfp6_e2m3": _mx("float6_e2m3fn"),
    "mxfp4": _mx("float4_e2m1fn"),
    "mxint8": _mx("int8_mx"),
    # NVFP4 as TransformerEngine's kernels compute it (QuantSpec.two_level_rule "te"); "nvfp4_div" is lowprec's
    # earlier rule (division, group scales clamped to e4m3's smallest subnormal), kept to reproduce older runs.
    "nvfp4": _nvfp4("te"),
    "nvfp4_div": _nvfp4("divide"),
    "fp8_e4m3_tensorwise": QuantSpec(elem="float8_e4m3fn", scaling="tensor"),
    "fp8_e5m2_tensorwise": QuantSpec(elem="float8_e5m2", scaling="tensor"),
    "fp8_e4m3_rowwise": QuantSpec(elem="float8_e4m3fn", scaling="axis", axis=-1),
    "fp8_e5m2_rowwise": QuantSpec(elem="float8_e5m2", scaling="axis", axis=-1),
    "fp8_e4m3_1x128": QuantSpec(elem="float8_e4m3fn", scaling="tile", tile=(1, 128)),
    "fp8_e4m3_128x128": QuantSpec(elem="float8_e4m3fn", scaling="tile", tile=(128, 128)),
}


def spec_names() -> list[str]:
    return list(_SPECS)


def named_spec(name: str) -> QuantSpec:
    try:
        return _SPECS[name]
    except (KeyError, TypeError):
        raise UsageError(f"unknown QuantSpec name {name!r}; valid names: {', '.join(_SPECS)}") from None
