"""FormatSpec and the format registry, checked against independent references.

Oracles: ``ml_dtypes.finfo`` / ``numpy.finfo`` / ``numpy.iinfo`` / ``ml_dtypes.iinfo`` for the named formats,
exhaustive decoding of every bit pattern by ml_dtypes (or numpy) for counts and special values, and hand-worked
arithmetic (written out in each test) for formats no library has (tf32, custom formats).
"""

from __future__ import annotations

import dataclasses
import json
import math

import ml_dtypes
import numpy as np
import pytest

from lowprec import formats
from lowprec.formats import FormatSpec

# Named formats that ml_dtypes or numpy implements, with the dtype that implements them.
ML_FLOAT_DTYPES: dict[str, type] = {
    "float32": np.float32,
    "bfloat16": ml_dtypes.bfloat16,
    "float16": np.float16,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
    "float8_e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
    "float8_e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
    "float6_e3m2fn": ml_dtypes.float6_e3m2fn,
    "float6_e2m3fn": ml_dtypes.float6_e2m3fn,
    "float4_e2m1fn": ml_dtypes.float4_e2m1fn,
    "float8_e8m0fnu": ml_dtypes.float8_e8m0fnu,
}
# Formats whose every bit pattern we can afford to decode (<= 16 bits).
SMALL_FLOATS = [n for n in ML_FLOAT_DTYPES if n != "float32"]


def _finfo(dt: type):
    return np.finfo(dt) if dt in (np.float32, np.float16) else ml_dtypes.finfo(dt)


def _all_values(name: str) -> np.ndarray:
    """Every bit pattern of a <= 16-bit format decoded to float64 by ml_dtypes/numpy (not by lowprec)."""
    dt = ML_FLOAT_DTYPES[name]
    bits = _finfo(dt).bits
    if bits <= 8:
        # ml_dtypes stores float6/float4 codes in the low bits of a one-byte container.
        codes = np.arange(2**bits, dtype=np.uint8)
    else:
        codes = np.arange(2**bits, dtype=np.uint16)
    # ml_dtypes' bfloat16 -> float64 cast flags NaN patterns as "invalid"; the NaNs are what we want to see.
    with np.errstate(invalid="ignore"):
        return codes.view(dt).astype(np.float64)


# ------------------------------------------------------------------------------------------------ named formats
def test_registry_contains_the_documented_formats():
    """Oracle: the list of named formats in the task brief / package docs (hand-written here)."""
    expected = {
        "float32", "tf32", "bfloat16", "float16",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
        "float6_e3m2fn", "float6_e2m3fn", "float4_e2m1fn",
        "int8", "int4", "int8_mx",
    }  # fmt: skip
    assert expected <= set(formats.names())
    for n in formats.names():
        assert formats.get(n).name == n


@pytest.mark.parametrize("name", list(ML_FLOAT_DTYPES))
def test_limits_match_finfo(name):
    """Oracle: ml_dtypes.finfo (numpy.finfo for float32/float16): max, smallest normal, smallest subnormal, eps,
    bits, and the mantissa/exponent widths."""
    spec = formats.get(name)
    fi = _finfo(ML_FLOAT_DTYPES[name])
    assert spec.max == float(fi.max), (spec.max, fi.max)
    assert spec.min_normal == float(fi.tiny), (spec.min_normal, fi.tiny)
    assert spec.min_subnormal == float(fi.smallest_subnormal), (spec.min_subnormal, fi.smallest_subnormal)
    assert spec.eps == float(fi.eps), (spec.eps, fi.eps)
    assert spec.bits == fi.bits
    assert spec.mbits == fi.nmant
    assert spec.ebits == fi.nexp
    if spec.signed:
        assert spec.min == float(fi.min)
    else:
        # Unsigned E8M0: the most negative "finite value" is the smallest positive one.
        assert spec.min == float(fi.smallest_subnormal)
    assert spec.kind == "float"


@pytest.mark.parametrize("name", SMALL_FLOATS)
def test_num_finite_matches_exhaustive_count(name):
    """Oracle: decode every bit pattern with ml_dtypes/numpy and count distinct finite values (+0 == -0)."""
    vals = _all_values(name)
    finite = vals[np.isfinite(vals)]
    num_finite = formats.get(name).num_finite
    assert num_finite == len(np.unique(finite)), (num_finite, len(np.unique(finite)))


@pytest.mark.parametrize("name", SMALL_FLOATS)
def test_special_value_flags_match_exhaustive_decode(name):
    """Oracle: decode every bit pattern with ml_dtypes/numpy; the format has inf / NaN / -0 / 0 / subnormals
    exactly when some pattern decodes to one."""
    spec = formats.get(name)
    vals = _all_values(name)
    fi = _finfo(ML_FLOAT_DTYPES[name])
    assert spec.has_inf == bool(np.isinf(vals).any())
    assert spec.has_nan == bool(np.isnan(vals).any())
    assert spec.has_zero == bool((vals == 0).any())
    assert spec.has_negative_zero == bool(((vals == 0) & np.signbit(vals)).any())
    assert spec.signed == bool((vals < 0).any())
    finite_pos = vals[np.isfinite(vals) & (vals > 0)]
    assert spec.has_subnormals == bool((finite_pos < float(fi.tiny)).any())
    # Largest finite and smallest positive values of the decoded set are the limits.
    assert spec.max == finite_pos.max()
    assert spec.min_subnormal == finite_pos.min()


def test_float32_num_finite_hand_count():
    """Oracle: hand count for IEEE binary32: 255 usable exponent fields x 2^23 mantissas per sign, minus the
    duplicate zero: 2 * (255 * 2^23) - 1."""
    assert formats.get("float32").num_finite == 2 * 255 * 2**23 - 1
    assert formats.get("float32").has_inf and formats.get("float32").has_nan


def test_tf32_hand_checked():
    """Oracle: hand-worked tf32 (1 sign, 8 exponent bits, bias 127, 10 mantissa bits, IEEE specials):
    max = (2 - 2^-10) * 2^127, smallest normal 2^-126, smallest subnormal 2^(-126-10) = 2^-136, eps 2^-10,
    19 bits, 2 * 255 * 2^10 - 1 finite values."""
    t = formats.get("tf32")
    assert t.max == (2 - 2.0**-10) * 2.0**127
    assert t.min == -(2 - 2.0**-10) * 2.0**127
    assert t.min_normal == 2.0**-126
    assert t.min_subnormal == 2.0**-136
    assert t.eps == 2.0**-10
    assert t.bits == 19
    assert t.num_finite == 2 * 255 * 1024 - 1
    assert t.has_inf and t.has_nan and t.has_negative_zero and t.has_subnormals
    # tf32's max is a float32 value that float32 can represent exactly and is below float32's max.
    assert t.max < float(np.finfo(np.float32).max)
    assert float(np.float32(t.max)) == t.max


# ---------------------------------------------------------------------------------------------- custom formats
def test_custom_e3m4_fn_hand_computed():
    """Oracle: hand-worked E3M4 with special="fn": bias = 2^(3-1) - 1 = 3; top exponent field 7 is usable except
    the all-ones pattern, so max = (1 + 14/16) * 2^(7-3) = 30; smallest normal 2^(1-3) = 0.25; smallest subnormal
    2^(1-3-4) = 2^-6; eps 2^-4; 8 bits; 256 codes - 2 NaN - 1 duplicate zero = 253 finite values."""
    s = FormatSpec.custom(3, 4, special="fn")
    assert s.bias == 3
    assert s.bits == 8
    assert s.max == 30.0
    assert s.min == -30.0
    assert s.min_normal == 0.25
    assert s.min_subnormal == 2.0**-6
    assert s.eps == 1 / 16
    assert s.num_finite == 253
    assert not s.has_inf and s.has_nan and s.has_negative_zero
    assert s.name == "float8_e3m4fn"


def test_custom_e8m13_hand_computed():
    """Oracle: hand-worked E8M13 IEEE (float32's range, 13 mantissa bits): bias 127, max (2 - 2^-13) * 2^127,
    smallest normal 2^-126, smallest subnormal 2^(-126-13) = 2^-139, eps 2^-13, 22 bits,
    2 * 255 * 2^13 - 1 finite values."""
    s = FormatSpec.custom(8, 13)
    assert s.bias == 127
    assert s.bits == 22
    assert s.max == (2 - 2.0**-13) * 2.0**127
    assert s.min_normal == 2.0**-126
    assert s.min_subnormal == 2.0**-139
    assert s.eps == 2.0**-13
    assert s.num_finite == 2 * 255 * 2**13 - 1
    assert s.has_inf and s.has_nan


@pytest.mark.parametrize(
    ("kwargs", "dt"),
    [
        ({"ebits": 3, "mbits": 4}, ml_dtypes.float8_e3m4),
        ({"ebits": 4, "mbits": 3}, ml_dtypes.float8_e4m3),
        ({"ebits": 4, "mbits": 3, "bias": 11, "special": "fnuz"}, ml_dtypes.float8_e4m3b11fnuz),
        ({"ebits": 5, "mbits": 10}, np.float16),
        ({"ebits": 8, "mbits": 7}, ml_dtypes.bfloat16),
    ],
)
def test_custom_matches_ml_dtypes_formats(kwargs, dt):
    """Oracle: ml_dtypes.finfo / numpy.finfo of the ml_dtypes types that custom() formats coincide with
    (float8_e3m4 and float8_e4m3 are IEEE-style with inf; e4m3b11fnuz has bias 11), plus an exhaustive count of
    distinct finite values decoded by ml_dtypes."""
    ebits, mbits = kwargs.pop("ebits"), kwargs.pop("mbits")
    s = FormatSpec.custom(ebits, mbits, **kwargs)
    fi = _finfo(dt)
    assert (s.max, s.min_normal, s.min_subnormal, s.eps, s.bits) == (
        float(fi.max), float(fi.tiny), float(fi.smallest_subnormal), float(fi.eps), fi.bits
    )  # fmt: skip
    container = np.uint8 if fi.bits == 8 else np.uint16
    # ml_dtypes flags NaN patterns as "invalid" when casting to float64; the NaNs are what we want to see.
    with np.errstate(invalid="ignore"):
        vals = np.arange(2**fi.bits, dtype=container).view(dt).astype(np.float64)
    assert s.num_finite == len(np.unique(vals[np.isfinite(vals)]))
    assert s.has_inf == bool(np.isinf(vals).any())
    assert s.has_nan == bool(np.isnan(vals).any())


def test_custom_bias_changes_name_and_limits():
    """Oracle: hand-worked E4M3 IEEE with bias 9: emax = 14 - 9 = 5, max = 1.875 * 2^5 = 60; smallest normal
    2^(1-9) = 2^-8; smallest subnormal 2^(-8-3) = 2^-11."""
    s = FormatSpec.custom(4, 3, bias=9)
    assert s.max == 60.0
    assert s.min_normal == 2.0**-8
    assert s.min_subnormal == 2.0**-11
    assert "b9" in s.name
    assert FormatSpec.custom(4, 3, bias=9, name="mine").name == "mine"


@pytest.mark.parametrize("bad", [1.5, "3", True, None])
def test_custom_rejects_non_int_fields(bad):
    """Oracle: the documented contract (ebits/mbits must be ints); the message names the field."""
    with pytest.raises(ValueError, match="ebits"):
        FormatSpec.custom(bad, 3)
    with pytest.raises(ValueError, match="mbits"):
        FormatSpec.custom(4, bad)


def test_custom_rejects_mbits_zero():
    """Oracle: documented contract: exponent-only formats are only float8_e8m0fnu; custom() needs mbits >= 1."""
    with pytest.raises(ValueError, match="mbits"):
        FormatSpec.custom(4, 0)


# ---------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"ebits": 9, "mbits": 3, "bias": 255}, "ebits"),
        ({"ebits": 0, "mbits": 3, "bias": 0}, "ebits"),
        ({"ebits": 4, "mbits": 24, "bias": 7}, "mbits"),
        ({"ebits": 4, "mbits": -1, "bias": 7}, "mbits"),
        ({"ebits": 4, "mbits": 3, "bias": 200}, "bias"),  # subnormals below 2^-149
        ({"ebits": 4, "mbits": 3, "bias": -200}, "bias"),  # max above 2^127
        ({"ebits": 8, "mbits": 7, "bias": 126}, "bias"),  # emax = 254 - 126 = 128
        ({"ebits": 8, "mbits": 23, "bias": 128}, "bias"),  # smallest subnormal 2^(1-128-23) = 2^-150
        ({"ebits": 4, "mbits": 3, "bias": 7, "special": "weird"}, "special"),
        ({"ebits": 4, "mbits": 3, "bias": 7, "kind": "fixed"}, "kind"),
    ],
)
def test_invalid_fields_raise_naming_the_field(kwargs, field):
    """Oracle: the documented limits (ebits in [1, 8], mbits in [0, 23], every value inside float32's range:
    emax <= 127 and smallest step >= 2^-149, hand-computed in the comments); the message must name the field."""
    with pytest.raises(ValueError, match=field):
        FormatSpec(name="bad", **kwargs)


@pytest.mark.parametrize(
    ("ebits", "mbits", "special"),
    [(4, 3, "ieee"), (4, 3, "fn"), (5, 2, "fnuz"), (3, 2, "finite"), (8, 7, "ieee"), (2, 1, "finite"), (8, 23, "ieee")],
)
def test_bias_edges_hand_derived(ebits, mbits, special):
    """Oracle: hand derivation of the valid bias range.  The top usable exponent field is 2^E - 2 for "ieee" and
    2^E - 1 otherwise, so emax = top - bias <= 127 gives bias >= top - 127; the smallest step
    2^(1 - bias - M) >= 2^-149 gives bias <= 150 - M.  Both ends construct, one past either end raises."""
    top = (1 << ebits) - (2 if special == "ieee" else 1)
    lo, hi = top - 127, 150 - mbits
    for b in (lo, hi):
        s = FormatSpec(name="edge", ebits=ebits, mbits=mbits, bias=b, special=special)
        assert s.emax <= 127 and s.emin - s.mbits >= -149
    for b in (lo - 1, hi + 1):
        with pytest.raises(ValueError, match="bias"):
            FormatSpec(name="edge", ebits=ebits, mbits=mbits, bias=b, special=special)


def test_bias_error_message_suggests_a_valid_range_for_exponent_only_formats():
    """Oracle: hand derivation for an unsigned exponent-only format (E8M0-like, special="fn"): codes 0..254 are
    2^(f - bias) (255 is NaN), so emax = 254 - bias <= 127 needs bias >= 127 and the smallest value 2^-bias
    >= 2^-149 needs bias <= 149.  An invalid bias must raise, and the suggested range in the message must be
    non-empty and contain only biases that construct."""
    import re

    def make(b):
        return FormatSpec(name="e8m0x", ebits=8, mbits=0, bias=b, special="fn", signed=False)

    make(127)  # float8_e8m0fnu itself
    with pytest.raises(ValueError, match="bias") as info:
        make(126)  # emax = 128: 2^128 is not a float32
    m = re.search(r"\[(-?\d+), (-?\d+)\]", str(info.value))
    assert m is not None, str(info.value)
    lo, hi = int(m.group(1)), int(m.group(2))
    assert lo <= hi, f"suggested bias range [{lo}, {hi}] is empty: {info.value}"
    for b in (lo, hi):
        make(b)


def test_exponent_only_and_unsigned_rules():
    """Oracle: the documented structural rules: mbits=0 must be unsigned with special="fn"; unsigned formats need
    mbits=0; fnuz needs a sign bit (its NaN is the -0 pattern)."""
    with pytest.raises(ValueError):
        FormatSpec(name="x", ebits=8, mbits=0, bias=127, special="fn", signed=True)
    with pytest.raises(ValueError):
        FormatSpec(name="x", ebits=8, mbits=0, bias=127, special="ieee", signed=False)
    with pytest.raises(ValueError):
        FormatSpec(name="x", ebits=4, mbits=3, bias=7, signed=False)


def test_integer_bits_validated():
    """Oracle: the documented limits for integer formats (2..24 bits, frac_bits in [0, 24])."""
    with pytest.raises(ValueError, match="bits"):
        FormatSpec.integer(1)
    with pytest.raises(ValueError, match="bits"):
        FormatSpec.integer(25)
    with pytest.raises(ValueError, match="frac_bits"):
        FormatSpec.integer(8, frac_bits=-1)
    with pytest.raises(ValueError, match="frac_bits"):
        FormatSpec.integer(8, frac_bits=25)


def test_formatspec_is_frozen_and_hashable():
    """Oracle: dataclasses' frozen contract: assignment raises FrozenInstanceError; equal fields hash equal."""
    s = formats.get("float8_e4m3fn")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.mbits = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.name = "other"  # type: ignore[misc]
    twin = FormatSpec(name="float8_e4m3fn", ebits=4, mbits=3, bias=7, special="fn")
    assert twin == s and hash(twin) == hash(s)
    assert {s: 1}[twin] == 1


# ---------------------------------------------------------------------------------------------- registry get()
def test_get_unknown_name_lists_valid_names():
    """Oracle: documented contract of get(): ValueError whose message lists every valid name."""
    with pytest.raises(ValueError) as info:
        formats.get("float8_e9m9")
    msg = str(info.value)
    assert "float8_e9m9" in msg
    for n in formats.names():
        assert n in msg, f"{n!r} missing from {msg!r}"


@pytest.mark.parametrize("bad", [None, 8, 3.5, b"float16"])
def test_get_non_string_raises_value_error(bad):
    """Oracle: documented contract: a non-name, non-FormatSpec argument is a ValueError (not KeyError/TypeError)."""
    with pytest.raises(ValueError):
        formats.get(bad)


def test_get_passes_formatspec_through():
    """Oracle: documented contract: a FormatSpec is returned as is (identity)."""
    s = FormatSpec.custom(3, 4, special="fn")
    assert formats.get(s) is s


def test_names_is_a_fresh_list():
    """Oracle: mutating the returned list must not change the registry (a copy, per 'names of the formats')."""
    a = formats.names()
    a.clear()
    assert len(formats.names()) > 0


# ---------------------------------------------------------------------------------------------- integer formats
@pytest.mark.parametrize(
    ("name", "lo", "hi", "step", "bits"),
    [
        ("int8", int(np.iinfo(np.int8).min), int(np.iinfo(np.int8).max), 1.0, 8),
        ("int4", int(ml_dtypes.iinfo(ml_dtypes.int4).min), int(ml_dtypes.iinfo(ml_dtypes.int4).max), 1.0, 4),
        # MXINT8 (OCP MX v1.0): int8 codes times 2^-6.
        ("int8_mx", int(np.iinfo(np.int8).min) / 64, int(np.iinfo(np.int8).max) / 64, 2.0**-6, 8),
    ],
)
def test_integer_format_properties(name, lo, hi, step, bits):
    """Oracle: numpy.iinfo(int8) / ml_dtypes.iinfo(int4) for the code range, OCP MX's 2^-6 scale for MXINT8, and
    the count of codes 2^bits (two's complement has one zero, so every code is a distinct value)."""
    s = formats.get(name)
    assert s.kind == "int"
    assert s.bits == bits
    assert s.max == hi
    assert s.min == lo
    assert s.min_normal == step
    assert s.min_subnormal == step
    assert s.eps == step
    assert s.num_finite == 2**bits
    assert not s.has_inf and not s.has_nan and not s.has_negative_zero
    assert s.has_zero
    assert s.signed


def test_integer_builder_name_and_frac_bits():
    """Oracle: hand-worked int6 with 2 fractional bits: codes -32..31, value code/4: max 31/4, min -8."""
    s = FormatSpec.integer(6, frac_bits=2)
    assert s.name == "int6_f2"
    assert s.max == 31 / 4 and s.min == -8.0 and s.min_subnormal == 0.25
    assert s.num_finite == 64


# ---------------------------------------------------------------------------------------------- to_dict
@pytest.mark.parametrize("name", list(ML_FLOAT_DTYPES))
def test_to_dict_is_json_and_matches_finfo(name):
    """Oracle: ml_dtypes/numpy finfo for the numeric entries; json round trip for 'plain data'."""
    d = formats.get(name).to_dict()
    back = json.loads(json.dumps(d))
    fi = _finfo(ML_FLOAT_DTYPES[name])
    assert back["name"] == name
    assert back["max"] == float(fi.max)
    assert back["min_normal"] == float(fi.tiny)
    assert back["min_subnormal"] == float(fi.smallest_subnormal)
    assert back["eps"] == float(fi.eps)
    assert back["bits"] == fi.bits
    assert math.isfinite(back["max"])
