"""Bad input gives ``ValueError`` whose message names the offending argument.

Oracle throughout: the documented argument contracts (the docstrings of ``quantize``, ``fake_quantize``,
``quantize_scaled``, ``dequantize``, ``QuantSpec``, ``_validate``): each case below violates exactly one of them,
and the test checks the exception type and that the message names the argument (and, where the contract says
so, lists the valid choices or suggests the fix).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lowprec
from lowprec import QuantSpec, formats

SR_SPEC = QuantSpec(elem="float8_e4m3fn", scaling="none", rounding="stochastic")
MX_SR_SPEC = QuantSpec(
    elem="float8_e4m3fn", scaling="block", block_size=32, scale_format="float8_e8m0fnu", rounding="stochastic"
)




def _raises(fn, *words: str) -> str:
    """Call fn, expect ValueError, check every word appears in the message; return the message."""
    with pytest.raises(ValueError) as ei:
        fn()
    msg = str(ei.value)
    for w in words:
        assert w in msg, f"{w!r} not in error message {msg!r}"
    return msg


# The three tensor entry points, each called on x with a valid format/spec.
ENTRY = {
    "quantize": lambda x, **kw: lowprec.quantize(x, "float8_e4m3fn", **kw),
    "quantize_sr": lambda x, **kw: lowprec.quantize(x, "float8_e4m3fn", rounding="stochastic", **kw),
    "fake_quantize": lambda x, **kw: lowprec.fake_quantize(x, "mxfp8_e4m3", **kw),
    "fake_quantize_sr": lambda x, **kw: lowprec.fake_quantize(x, SR_SPEC, **kw),
    "quantize_scaled": lambda x, **kw: lowprec.quantize_scaled(x, "mxfp8_e4m3", **kw),
    "quantize_scaled_sr": lambda x, **kw: lowprec.quantize_scaled(x, MX_SR_SPEC, **kw),
}
SR_ENTRY = {k: v for k, v in ENTRY.items() if k.endswith("_sr")}


# ------------------------------------------------------------------------------------------- input tensors
@pytest.mark.parametrize("entry", list(ENTRY))
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int8, torch.uint8, torch.bool, torch.complex64])
def test_non_float_tensors_rejected(entry: str, dtype: torch.dtype) -> None:
    """Integer, bool and complex tensors raise ValueError naming x and the dtype (float32/bf16/fp16 only)."""
    x = torch.zeros(4, 32, dtype=dtype)
    _raises(lambda: ENTRY[entry](x), "x", str(dtype))


@pytest.mark.parametrize("entry", list(ENTRY))
def test_float64_suggests_float(entry: str) -> None:
    """A float64 tensor raises ValueError naming x and suggesting .float()."""
    _raises(lambda: ENTRY[entry](torch.zeros(4, 32, dtype=torch.float64)), "x", "float64", ".float()")


@pytest.mark.parametrize("entry", ["quantize", "fake_quantize", "quantize_scaled"])
@pytest.mark.parametrize("bad", [np.zeros((4, 32), np.float32), [1.0, 2.0], 3.0, None])
def test_non_tensor_rejected(entry: str, bad) -> None:
    """Non-tensors (numpy arrays, lists, floats, None) raise ValueError naming x and torch.Tensor."""
    _raises(lambda: ENTRY[entry](bad), "x", "torch.Tensor")


# --------------------------------------------------------------------------------------------- format names
def test_unknown_format_lists_valid_names() -> None:
    """An unknown format name raises ValueError naming it and listing every valid name.

    (ExMy names such as "float7_e3m3" are valid custom formats, so the unknown name here is not of that shape.)
    """
    msg = _raises(lambda: lowprec.quantize(torch.ones(3), "float7_x3y3"), "float7_x3y3")
    for n in formats.names():
        assert n in msg, f"{n} missing from {msg!r}"
    msg = _raises(lambda: QuantSpec(elem="fp8"), "fp8")
    for n in formats.names():
        assert n in msg
    _raises(lambda: QuantSpec(elem="float8_e4m3fn", scaling="block", block_size=32, scale_format="e8m0"), "e8m0")


def test_quantspec_unknown_format_names_the_field() -> None:
    """An unknown or mistyped element / scale format in QuantSpec raises ValueError naming the field, as every
    other QuantSpec field error does ("QuantSpec.<field> ..."), so a user can tell elem from scale_format."""
    _raises(lambda: QuantSpec(elem="fp8"), "elem")
    _raises(lambda: QuantSpec(elem=3), "elem")
    _raises(lambda: QuantSpec(scale_format="e8m0"), "scale_format")


@pytest.mark.parametrize("bad", [3, 1.5, None, torch.float8_e4m3fn])
def test_format_of_wrong_type(bad) -> None:
    """A format that is neither a name nor a FormatSpec raises ValueError naming 'format'."""
    _raises(lambda: lowprec.quantize(torch.ones(3), bad), "format")


# ------------------------------------------------------------------------------------------------ rounding
@pytest.mark.parametrize("bad", ["up", "Nearest", "stochastic ", None, 1])
def test_unknown_rounding(bad) -> None:
    """An unknown rounding raises ValueError naming 'rounding' and listing the valid modes."""
    msg = _raises(lambda: lowprec.quantize(torch.ones(3), "bfloat16", rounding=bad), "rounding")
    for mode in ("nearest", "stochastic", "toward_zero"):
        assert mode in msg
    _raises(lambda: QuantSpec(rounding=bad), "QuantSpec.rounding")


# ---------------------------------------------------------------------------------------------------- seeds
@pytest.mark.parametrize("entry", list(SR_ENTRY))
@pytest.mark.parametrize("bad", [-1, -(2**63), 2**64, 2**70])
def test_seed_out_of_range(entry: str, bad: int) -> None:
    """Seeds outside [0, 2^64) raise ValueError naming seed."""
    _raises(lambda: SR_ENTRY[entry](torch.ones(4, 32), seed=bad), "seed")


@pytest.mark.parametrize("entry", list(SR_ENTRY))
@pytest.mark.parametrize("bad", [1.0, "7", True, torch.tensor(3), [1]])
def test_seed_not_an_int(entry: str, bad) -> None:
    """Non-int seeds (float, str, bool, tensor, list) raise ValueError naming seed."""
    _raises(lambda: SR_ENTRY[entry](torch.ones(4, 32), seed=bad), "seed")


def test_seed_boundaries_accepted() -> None:
    """seed = 0 and seed = 2^64 - 1 are valid (the documented range is [0, 2^64))."""
    x = torch.ones(4, 32) * 1.0625
    for seed in (0, 2**64 - 1):
        for fn in SR_ENTRY.values():
            fn(x, seed=seed)


# -------------------------------------------------------------------------------------------------- offsets
@pytest.mark.parametrize("entry", list(SR_ENTRY))
def test_offset_negative(entry: str) -> None:
    """offset < 0 raises ValueError naming offset."""
    _raises(lambda: SR_ENTRY[entry](torch.ones(4, 32), seed=1, offset=-1), "offset")


@pytest.mark.parametrize("entry", list(SR_ENTRY))
def test_offset_past_counter_range(entry: str) -> None:
    """offset + numel > 2^32 raises ValueError naming offset and 2**32; offset + numel == 2^32 is accepted."""
    x = torch.ones(4, 32)
    SR_ENTRY[entry](x, seed=1, offset=2**32 - 128)
    _raises(lambda: SR_ENTRY[entry](x, seed=1, offset=2**32 - 127), "offset", "2**32")
    _raises(lambda: SR_ENTRY[entry](x, seed=1, offset=2**40), "offset")


@pytest.mark.parametrize("entry", list(SR_ENTRY))
@pytest.mark.parametrize("bad", [1.0, "0", True, None])
def test_offset_not_an_int(entry: str, bad) -> None:
    """Non-int offsets raise ValueError naming offset."""
    _raises(lambda: SR_ENTRY[entry](torch.ones(4, 32), seed=1, offset=bad), "offset")


# ------------------------------------------------------------------------------------------------- saturate
@pytest.mark.parametrize("bad", [1, 0, "yes", None, np.bool_(True)])
def test_saturate_must_be_bool(bad) -> None:
    """saturate must be True or False: anything else raises ValueError naming saturate."""
    _raises(lambda: lowprec.quantize(torch.ones(3), "float8_e4m3fn", saturate=bad), "saturate")
    _raises(lambda: QuantSpec(saturate=bad), "saturate")


# ----------------------------------------------------------------------------------------------------- spec
_BAD_SPECS = [3, None, {"elem": "float8_e4m3fn"}, lowprec.formats.get("float8_e4m3fn")]


@pytest.mark.parametrize("bad", _BAD_SPECS, ids=["int", "None", "dict", "FormatSpec"])
def test_spec_not_a_quantspec(bad) -> None:
    """fake_quantize / quantize_scaled with a spec that is not a QuantSpec (or name) raise ValueError naming spec."""
    x = torch.ones(4, 32)
    _raises(lambda: lowprec.fake_quantize(x, bad), "spec")
    _raises(lambda: lowprec.quantize_scaled(x, bad), "spec")


@pytest.mark.parametrize("bad", _BAD_SPECS, ids=["int", "None", "dict", "FormatSpec"])
def test_dequantize_spec_not_a_quantspec(bad) -> None:
    """dequantize with a spec that is not a QuantSpec (or name) raises ValueError naming spec, like the
    quantizers do (not an AttributeError from inside)."""
    codes, scales = lowprec.quantize_scaled(torch.ones(4, 32), "mxfp8_e4m3")
    _raises(lambda: lowprec.dequantize(codes, scales, bad), "spec")


def test_dequantize_unknown_spec_name_lists_names() -> None:
    """dequantize with an unknown spec name raises ValueError listing the valid names."""
    codes, scales = lowprec.quantize_scaled(torch.ones(4, 32), "mxfp8_e4m3")
    msg = _raises(lambda: lowprec.dequantize(codes, scales, "mxfp9"), "mxfp9")
    for n in QuantSpec.names():
        assert n in msg


def test_dequantize_wrong_codes_or_shape() -> None:
    """dequantize rejects codes of the wrong storage dtype (naming codes) and a shape they do not decode to."""
    x = torch.ones(4, 33)
    codes, scales = lowprec.quantize_scaled(x, "mxfp8_e4m3")
    _raises(lambda: lowprec.dequantize(codes.float(), scales, "mxfp8_e4m3"), "codes", "float8_e4m3fn")
    _raises(lambda: lowprec.dequantize(codes, scales, "mxfp8_e4m3", shape=(4, 32)), "shape")
    c4, s4 = lowprec.quantize_scaled(x, "mxfp4")
    _raises(lambda: lowprec.dequantize(c4.to(torch.int8), s4, "mxfp4", shape=(4, 33)), "codes", "uint8")
    c6, s6 = lowprec.quantize_scaled(x, "mxfp6_e3m2")
    _raises(lambda: lowprec.dequantize(c6[:, :-1], s6, "mxfp6_e3m2"), "divisible by 3")


def test_layout_errors_name_axis_and_tile() -> None:
    """A spec that does not fit the tensor's rank raises ValueError naming axis / tile (not an IndexError)."""
    _raises(lambda: lowprec.fake_quantize(torch.ones(4, 8), QuantSpec(scaling="axis", axis=2)), "axis")
    _raises(
        lambda: lowprec.quantize_scaled(torch.ones(8), QuantSpec(scaling="block", block_size=4, axis=-2)), "axis"
    )
    _raises(lambda: lowprec.fake_quantize(torch.ones(8), "fp8_e4m3_1x128"), "tile")


# ------------------------------------------------------------------------------------------ QuantSpec fields
@pytest.mark.parametrize(
    "kwargs,word",
    [
        (dict(scaling="blocks"), "scaling"),
        (dict(scaling="block"), "block_size"),
        (dict(scaling="block", block_size=0), "block_size"),
        (dict(scaling="block", block_size=-8), "block_size"),
        (dict(scaling="block", block_size=32.0), "block_size"),
        (dict(scaling="tensor", block_size=32), "block_size"),
        (dict(scaling="tile"), "tile"),
        (dict(scaling="tile", tile=(0, 128)), "tile"),
        (dict(scaling="block", block_size=32, tile=(1, 128)), "tile"),
        (dict(axis="0"), "axis"),
        (dict(axis=1.0), "axis"),
        (dict(axis=True), "axis"),
        (dict(scale_format="int8"), "scale_format"),
        (dict(scale_rounding="up"), "scale_rounding"),
        (dict(margin=1.5), "margin"),
        (dict(margin=65), "margin"),
        (dict(margin=True), "margin"),
        (dict(saturate=1), "saturate"),
        (dict(tensor_scale=1), "tensor_scale"),
        (dict(scaling="tensor", tensor_scale=True), "tensor_scale"),
        (dict(scaling="block", block_size=16, scale_format="float8_e8m0fnu", tensor_scale=True), "tensor_scale"),
        (dict(elem="float8_e8m0fnu"), "elem"),
        (dict(rounding="round"), "rounding"),
    ],
    ids=lambda v: str(v),
)
def test_quantspec_field_errors(kwargs: dict, word: str) -> None:
    """Invalid QuantSpec fields raise ValueError naming the field."""
    _raises(lambda: QuantSpec(**kwargs), word)


def test_quantize_scaled_without_storage() -> None:
    """Scale or element formats that have no storage raise ValueError naming the format (fake_quantize works).

    Oracle: quantize_scaled's docstring (scales in the scale format's dtype; storage per _codec).
    """
    x = torch.ones(4, 32)
    spec = QuantSpec(elem="float8_e4m3fn", scaling="tensor", scale_format="float6_e3m2fn")
    _raises(lambda: lowprec.quantize_scaled(x, spec), "float6_e3m2fn")
    lowprec.fake_quantize(x, spec)
    spec = QuantSpec(elem="tf32", scaling="tensor")
    _raises(lambda: lowprec.quantize_scaled(x, spec), "tf32")


def test_set_backend_unknown() -> None:
    """set_backend with an unknown name raises ValueError naming backend and leaves the setting unchanged."""
    before = lowprec.quant.get_backend()
    _raises(lambda: lowprec.quant.set_backend("gpu"), "backend", "gpu")
    assert lowprec.quant.get_backend() == before
