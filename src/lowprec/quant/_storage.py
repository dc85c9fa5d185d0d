"""Pure-Python facts about real low-bit storage, shared by the PyTorch and JAX code (no torch, no jax).

``code_value`` is the reference definition of a format: the value of each code, derived from the ``FormatSpec``
fields alone (the storage layout itself is described in ``lowprec.quant._codec``).  ``TORCH_DTYPE_NAMES`` lists
the formats torch stores in a dtype of their own; each name is also the name of that dtype (``torch.<name>``), so
``has_torch_dtype`` answers the question without importing torch.
"""

from __future__ import annotations

import math

from ..formats import FormatSpec

TORCH_DTYPE_NAMES = (
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "bfloat16",
    "float16",
    "float32",
)


def has_torch_dtype(fmt: FormatSpec) -> bool:
    """True when a torch dtype (``torch.<fmt.name>``) stores ``fmt`` exactly."""
    return fmt.kind == "float" and fmt.name in TORCH_DTYPE_NAMES


def code_value(fmt: FormatSpec, code: int) -> float:
    """The value of one code (Python float; NaN for NaN codes).  The reference definition of a format."""
    if fmt.kind == "int":
        k = code - (1 << fmt.bits) if code >= 1 << (fmt.bits - 1) else code
        return math.ldexp(k, -fmt.frac_bits)
    e_bits, m_bits = fmt.ebits, fmt.mbits
    sign = (code >> (e_bits + m_bits)) & 1 if fmt.signed else 0
    field = (code >> m_bits) & ((1 << e_bits) - 1)
    mant = code & ((1 << m_bits) - 1)
    top = field == (1 << e_bits) - 1
    if fmt.special == "ieee" and top:
        return math.nan if mant else (-math.inf if sign else math.inf)
    if fmt.special == "fn" and top and mant == (1 << m_bits) - 1:
        return math.nan
    if fmt.special == "fnuz" and sign and field == 0 and mant == 0:
        return math.nan
    if field == 0 and fmt.has_subnormals:
        mag = math.ldexp(mant, 1 - fmt.bias - m_bits)
    else:
        mag = math.ldexp(1.0 + mant / (1 << m_bits), field - fmt.bias)
    return -mag if sign else mag
