"""What a number format is, defined once.

A binary floating-point format with ``E`` exponent bits, ``M`` mantissa bits and exponent bias ``b`` encodes a
bit pattern ``(s, f, m)`` (sign, exponent field, mantissa field) as

* normal, ``f >= 1``:      ``(-1)^s * (1 + m / 2^M) * 2^(f - b)``
* subnormal, ``f == 0``:   ``(-1)^s * (m / 2^M) * 2^(1 - b)``    (only when ``M > 0``)

so every binade ``[2^e, 2^(e+1))`` holds ``2^M`` evenly spaced values, and below the smallest normal ``2^(1-b)``
the subnormals continue with the same spacing ``2^(1-b-M)`` down to zero.  Formats differ in what the top of
the code space means (``special``):

* ``"ieee"``   the all-ones exponent is reserved: ``m == 0`` is infinity, ``m != 0`` is NaN (float32, bf16,
  fp16, float8_e5m2).
* ``"fn"``     finite: no infinity, only the all-ones pattern ``S.1111.111`` is NaN, so the top binade is usable
  except its last code (float8_e4m3fn: max = 1.75 * 2^8 = 448).
* ``"fnuz"``   finite, unsigned zero: no infinity, no negative zero; the pattern that would be ``-0`` (0x80) is
  the one NaN (float8_e4m3fnuz, float8_e5m2fnuz).
* ``"finite"`` every pattern is a finite number: no infinity, no NaN (float6_e3m2fn, float6_e2m3fn,
  float4_e2m1fn).  ml_dtypes still calls these ``fn``.

An exponent-only format (``M == 0``, unsigned, like OCP's E8M0 scale) has no zero and no subnormals: every code
``f`` is ``2^(f - b)``, and with ``special="fn"`` the all-ones code is NaN.

Integer formats (``kind="int"``) are two's-complement integers ``k`` in ``[-2^(B-1), 2^(B-1) - 1]`` with value
``k * 2^-frac_bits`` (``frac_bits = 6`` gives OCP's MXINT8 elements).

Everything a user asks about (max, smallest normal, smallest subnormal, eps, number of finite values) is derived
from these fields; nothing is typed in by hand.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from .._checks import check_bool, check_int, check_literal, check_str, literal_values
from .._errors import UsageError

Special = Literal["ieee", "fn", "fnuz", "finite"]
"""Meaning of the top codes of a float format (module docstring)."""
Kind = Literal["float", "int"]
"""Float or two's-complement integer."""
SPECIALS: tuple[str, ...] = literal_values(Special)
KINDS: tuple[str, ...] = literal_values(Kind)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FormatSpec:
    """A number format, from which every property is derived.

    Values of every format lie inside float32's range (``ebits <= 8``, ``mbits <= 23``), so quantizers can compute
    in float32 exactly.
    """

    name: str
    """Canonical name in ml_dtypes/LLVM style, e.g. ``"float8_e4m3fn"``."""
    ebits: int
    """Exponent bits E (0 for integer formats)."""
    mbits: int
    """Mantissa (fraction) bits M; for integer formats, the magnitude bits (bits - 1)."""
    bias: int
    """Exponent bias b: a normal value is ``(1 + m/2^M) * 2^(f - b)``."""
    special: Special = "ieee"
    """Meaning of the top codes: "ieee" (inf + NaNs), "fn" (all-ones is NaN), "fnuz" (0x80 is NaN), "finite"."""
    signed: bool = True
    """Whether the format has a sign bit (False only for exponent-only scale formats such as E8M0)."""
    kind: Kind = "float"
    """"float" or "int" (two's complement)."""
    frac_bits: int = 0
    """Integer formats only: value = code * 2^-frac_bits."""

    def __post_init__(self) -> None:
        check_str(self.name, "FormatSpec.name")
        check_literal(self.kind, "FormatSpec.kind", Kind)
        check_literal(self.special, "FormatSpec.special", Special)
        check_bool(self.signed, "FormatSpec.signed")
        for field in ("ebits", "mbits", "bias", "frac_bits"):
            check_int(getattr(self, field), f"FormatSpec.{field}")
        if self.kind == "int":
            check_int(self.mbits + 1, "integer format bits (mbits + 1)", 2, 24)
            check_int(self.frac_bits, "FormatSpec.frac_bits", 0, 24)
            return
        check_int(self.ebits, "FormatSpec.ebits", 1, 8, note="so values fit float32")
        check_int(self.mbits, "FormatSpec.mbits", 0, 23, note="so values fit float32")
        if self.mbits == 0 and (self.signed or self.special != "fn"):
            raise UsageError(
                "an exponent-only format (mbits=0) must be unsigned with special='fn' (like float8_e8m0fnu)"
            )
        if self.mbits > 0 and not self.signed:
            raise UsageError("unsigned formats are only supported without mantissa bits (like float8_e8m0fnu)")
        if self.special == "fnuz" and not self.signed:
            raise UsageError("special='fnuz' needs a sign bit: its NaN is the negative-zero pattern")
        # The format must sit inside float32: smallest step >= 2^-149, largest exponent <= 127.
        if self.emin - self.mbits < -149 or self.emax > 127:
            raise UsageError(
                f"format e{self.ebits}m{self.mbits} with bias {self.bias} does not fit inside float32 "
                f"(emin={self.emin}, emax={self.emax}); choose a bias in [{self._bias_range()[0]}, "
                f"{self._bias_range()[1]}]"
            )

    def _bias_range(self) -> tuple[int, int]:
        """Biases that keep the format inside float32: ``emax <= 127`` and smallest step ``>= 2^-149``."""
        top = (1 << self.ebits) - 1
        if self.special == "ieee" or (self.special == "fn" and self.mbits == 0):
            top -= 1
        lowest_field = 1 if self.has_subnormals else 0
        return (top - 127, lowest_field + 149 - self.mbits)

    # ----------------------------------------------------------------------------------------------- builders
    @classmethod
    def custom(
        cls,
        ebits: int,
        mbits: int,
        *,
        bias: int | None = None,
        special: Special = "ieee",
        name: str | None = None,
    ) -> FormatSpec:
        """Any signed ExMy float; bias defaults to the IEEE choice ``2^(E-1) - 1``.

        ``FormatSpec.custom(3, 4, special="fn")`` is an fp8 e3m4; ``FormatSpec.custom(8, 13)`` models an
        accumulator keeping 13 mantissa bits with float32's range.
        """
        for field, v in (("ebits", ebits), ("mbits", mbits)):
            check_int(v, f"FormatSpec.custom: {field}")
        check_literal(special, "FormatSpec.custom: special", Special)
        if bias is None:
            bias = (1 << (ebits - 1)) - 1 if ebits >= 1 else 0
        if mbits < 1:
            raise UsageError("FormatSpec.custom: mbits must be >= 1 (exponent-only formats: use float8_e8m0fnu)")
        bits = 1 + ebits + mbits
        suffix = {"ieee": "", "fn": "fn", "fnuz": "fnuz", "finite": "fn"}[special]
        default = f"float{bits}_e{ebits}m{mbits}{suffix}"
        if bias != (1 << (ebits - 1)) - 1:
            default += f"_b{bias}"
        return cls(name=name or default, ebits=ebits, mbits=mbits, bias=bias, special=special)

    @classmethod
    def integer(cls, bits: int, *, frac_bits: int = 0, name: str | None = None) -> FormatSpec:
        """A two's-complement integer format with ``bits`` bits and value ``code * 2^-frac_bits``."""
        check_int(bits, "FormatSpec.integer: bits", 2, 24)
        return cls(
            name=name or (f"int{bits}" if frac_bits == 0 else f"int{bits}_f{frac_bits}"),
            ebits=0,
            mbits=bits - 1,
            bias=0,
            special="finite",
            kind="int",
            frac_bits=frac_bits,
        )

    # ----------------------------------------------------------------------------------------- derived facts
    @property
    def bits(self) -> int:
        """Width of one code in bits."""
        return int(self.signed) + self.ebits + self.mbits

    @property
    def has_inf(self) -> bool:
        return self.kind == "float" and self.special == "ieee"

    @property
    def has_nan(self) -> bool:
        return self.kind == "float" and self.special in ("ieee", "fn", "fnuz")

    @property
    def has_negative_zero(self) -> bool:
        return self.kind == "float" and self.signed and self.special != "fnuz"

    @property
    def has_zero(self) -> bool:
        return self.kind == "int" or self.mbits > 0

    @property
    def has_subnormals(self) -> bool:
        return self.kind == "float" and self.mbits > 0

    @property
    def emax(self) -> int:
        """Exponent of the largest binade that holds finite values."""
        if self.kind == "int":
            return self.mbits - self.frac_bits - 1
        top_field = (1 << self.ebits) - 1
        if self.special == "ieee" or (self.special == "fn" and self.mbits == 0):
            top_field -= 1
        return top_field - self.bias

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal binade (``2^emin`` is the smallest normal)."""
        if self.kind == "int":
            # Integers behave like floats whose whole range is "subnormal" with step 2^-frac_bits.
            return self.mbits - self.frac_bits
        return (1 if self.has_subnormals else 0) - self.bias

    @property
    def max(self) -> float:
        """Largest finite value."""
        if self.kind == "int":
            return math.ldexp((1 << self.mbits) - 1, -self.frac_bits)
        if self.mbits == 0:
            return math.ldexp(1.0, self.emax)
        top_mant = (1 << self.mbits) - (2 if self.special == "fn" else 1)
        return math.ldexp(1.0 + top_mant / (1 << self.mbits), self.emax)

    @property
    def min(self) -> float:
        """Most negative finite value (0 < smallest value for unsigned formats)."""
        if self.kind == "int":
            return -math.ldexp(1 << self.mbits, -self.frac_bits)
        return -self.max if self.signed else self.min_subnormal

    @property
    def min_normal(self) -> float:
        """Smallest positive normal value (for integers: the step, 2^-frac_bits)."""
        if self.kind == "int":
            return math.ldexp(1.0, -self.frac_bits)
        return math.ldexp(1.0, self.emin)

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value (equal to min_normal for formats without subnormals)."""
        if self.kind == "int":
            return math.ldexp(1.0, -self.frac_bits)
        return math.ldexp(1.0, self.emin - self.mbits) if self.has_subnormals else self.min_normal

    @property
    def eps(self) -> float:
        """Distance from 1.0 to the next larger value: 2^-M (1 for integers and exponent-only formats)."""
        if self.kind == "int":
            return math.ldexp(1.0, -self.frac_bits)
        return math.ldexp(1.0, -self.mbits) if self.mbits else 1.0

    @property
    def num_finite(self) -> int:
        """Number of distinct finite values (+0 and -0 counted once)."""
        if self.kind == "int":
            return 1 << (self.mbits + 1)
        per_binade = 1 << self.mbits
        fields = (1 << self.ebits) - (1 if self.special == "ieee" else 0)
        magnitudes = fields * per_binade  # codes with the sign bit clear, zero included
        if self.special == "fn":
            magnitudes -= 1  # the all-ones NaN code
        if not self.signed:
            return magnitudes
        # +-each nonzero magnitude, zero once.  fnuz: its NaN is the -0 pattern, so this count is unchanged.
        return 2 * (magnitudes - int(self.has_zero)) + int(self.has_zero)

    def to_dict(self) -> dict[str, object]:
        """Plain-data description (for JSON) with the derived facts."""
        return {
            "name": self.name,
            "kind": self.kind,
            "bits": self.bits,
            "ebits": self.ebits,
            "mbits": self.mbits,
            "bias": self.bias if self.kind == "float" else None,
            "frac_bits": self.frac_bits if self.kind == "int" else None,
            "special": self.special,
            "signed": self.signed,
            "max": self.max,
            "min_normal": self.min_normal,
            "min_subnormal": self.min_subnormal,
            "eps": self.eps,
            "num_finite": self.num_finite,
            "has_inf": self.has_inf,
            "has_nan": self.has_nan,
        }
