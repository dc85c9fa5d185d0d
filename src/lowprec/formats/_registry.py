"""The named formats.  Each entry is the format's defining fields; every limit is derived by ``FormatSpec``."""

from __future__ import annotations

import re

from .._errors import UsageError
from ._spec import FormatSpec

_EXMY = re.compile(r"^(?:float(\d+)_)?e(\d)m(\d{1,2})(fn|fnuz)?$")

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

    Besides the registered names, ``"eXmY"`` (optionally ``float{bits}_`` before and ``fn``/``fnuz`` after) names a
    custom float with X exponent bits, Y mantissa bits and the IEEE bias, as built by ``FormatSpec.custom``.

    Raises ``ValueError`` listing the valid names when ``name`` is unknown.
    """
    if isinstance(name, FormatSpec):
        return name
    if not isinstance(name, str):
        raise UsageError(f"format must be a name or a FormatSpec, got {type(name).__name__}")
    if name in _FORMATS:
        return _FORMATS[name]
    m = _EXMY.match(name)
    if m:  # "e3m4", "e8m13", "float8_e3m4fn": a custom ExMy float with the IEEE bias
        bits, ebits, mbits = m.group(1), int(m.group(2)), int(m.group(3))
        special = {"fn": "fn", "fnuz": "fnuz", None: "ieee"}[m.group(4)]
        if bits is not None and int(bits) != 1 + ebits + mbits:
            problem = f"format {name!r} has {1 + ebits + mbits} bits (1 + {ebits} + {mbits}), not {bits}"
        else:
            try:
                return FormatSpec.custom(ebits, mbits, special=special)  # type: ignore[arg-type]
            except ValueError as e:
                problem = f"format {name!r} cannot be built: {e}"
    else:
        problem = f"unknown format {name!r}"
    raise UsageError(
        f"{problem}; valid names: {', '.join(_FORMATS)} "
        "(or an ExMy name such as 'e3m4' or 'e5m6fn', or FormatSpec.custom(ebits, mbits))"
    )
