"""The named formats.  Each entry is the format's defining fields; every limit is derived by ``FormatSpec``."""

from __future__ import annotations

from ._spec import FormatSpec

_F = FormatSpec
_FORMATS: dict[str, FormatSpec] = {
    f.name: f
    for f in (
        _F(name="float32", ebits=8, mbits=23, bias=127),
        _F(name="tf32", ebits=8, mbits=10, bias=127),
        _F(name="bfloat16", ebits=8, mbits=7, bias=127),
        _F(name="float16", ebits=5, mbits=10, bias=15),
        _F(name="float8_e4m3fn", ebits=4, mbits=3, bias=7, special="fn"),
        _F(name="float8_e5m2", ebits=5, mbits=2, bias=15),
        _F(name="float8_e4m3fnuz", ebits=4, mbits=3, bias=8, special="fnuz"),
        _F(name="float8_e5m2fnuz", ebits=5, mbits=2, bias=16, special="fnuz"),
        _F(name="float6_e3m2fn", ebits=3, mbits=2, bias=3, special="finite"),
        _F(name="float6_e2m3fn", ebits=2, mbits=3, bias=1, special="finite"),
        _F(name="float4_e2m1fn", ebits=2, mbits=1, bias=1, special="finite"),
        _F(name="float8_e8m0fnu", ebits=8, mbits=0, bias=127, special="fn", signed=False),
        FormatSpec.integer(8),
        FormatSpec.integer(4),
        # OCP MX v1.0 MXINT8 element: 8-bit two's complement with an implicit scale of 2^-6.
        FormatSpec.integer(8, frac_bits=6, name="int8_mx"),
    )
}


def names() -> list[str]:
    """Names of the built-in formats, in registry order."""
    return list(_FORMATS)


def get(name: str | FormatSpec) -> FormatSpec:
    """The format called ``name`` (a ``FormatSpec`` is returned as is).

    Raises ``ValueError`` listing the valid names when ``name`` is unknown.
    """
    if isinstance(name, FormatSpec):
        return name
    if not isinstance(name, str):
        raise ValueError(f"format must be a name or a FormatSpec, got {type(name).__name__}")
    try:
        return _FORMATS[name]
    except KeyError:
        raise ValueError(
            f"unknown format {name!r}; valid names: {', '.join(_FORMATS)} "
            "(or build one with FormatSpec.custom(ebits, mbits))"
        ) from None
