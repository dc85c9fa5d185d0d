"""Codes <-> values and 4/6-bit packing (``lowprec.quant._codec``), checked bit pattern by bit pattern.

Oracles: ml_dtypes decoding of every code (the uint8 pattern viewed as the ml_dtypes type; float6/float4 codes
sit in the low bits of a one-byte container), numpy/ml_dtypes integer views for int8/int4, torch's native float8
dtypes, and hand-worked byte layouts for the packers.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from lowprec import formats
from lowprec.quant import _codec

ML_DTYPES: dict[str, type] = {
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
    "float8_e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
    "float8_e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
    "float8_e8m0fnu": ml_dtypes.float8_e8m0fnu,
    "float6_e3m2fn": ml_dtypes.float6_e3m2fn,
    "float6_e2m3fn": ml_dtypes.float6_e2m3fn,
    "float4_e2m1fn": ml_dtypes.float4_e2m1fn,
}
FLOAT_FORMATS = list(ML_DTYPES)
INT_FORMATS = ["int8", "int4", "int8_mx"]
TORCH_F8 = {
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "float8_e4m3fnuz": torch.float8_e4m3fnuz,
    "float8_e5m2fnuz": torch.float8_e5m2fnuz,
    "float8_e8m0fnu": torch.float8_e8m0fnu,
}


def oracle_values(name: str) -> np.ndarray:
    """float32 value of every code of ``name``, decoded by ml_dtypes / numpy (independent of lowprec)."""
    if name in ML_DTYPES:
        bits = ml_dtypes.finfo(ML_DTYPES[name]).bits
        return np.arange(2**bits, dtype=np.uint8).view(ML_DTYPES[name]).astype(np.float32)
    if name == "int8":
        return np.arange(256, dtype=np.uint8).view(np.int8).astype(np.float32)
    if name == "int8_mx":
        return np.arange(256, dtype=np.uint8).view(np.int8).astype(np.float32) / np.float32(64)  # OCP MX: 2^-6
    if name == "int4":
        return np.arange(16, dtype=np.uint8).view(ml_dtypes.int4).astype(np.float32)
    raise AssertionError(name)


def assert_same_bits(got: np.ndarray, exp: np.ndarray, inputs: np.ndarray, what: str) -> None:
    """Bitwise float32 equality with NaN == NaN; on failure report count and first few (input, got, expected)."""
    got = np.asarray(got, dtype=np.float32)
    exp = np.asarray(exp, dtype=np.float32)
    bad = (got.view(np.int32) != exp.view(np.int32)) & ~(np.isnan(got) & np.isnan(exp))
    if bad.any():
        idx = np.flatnonzero(bad)[:8]
        rows = [(inputs.reshape(-1)[i], got.reshape(-1)[i], exp.reshape(-1)[i]) for i in idx]
        pytest.fail(f"{what}: {bad.sum()} of {bad.size} differ; first (input, got, expected): {rows}")


def assert_equal_ints(got: np.ndarray, exp: np.ndarray, inputs: np.ndarray, what: str) -> None:
    got, exp = np.asarray(got), np.asarray(exp)
    bad = got != exp
    if bad.any():
        idx = np.flatnonzero(bad)[:8]
        rows = [(inputs.reshape(-1)[i], got.reshape(-1)[i], exp.reshape(-1)[i]) for i in idx]
        pytest.fail(f"{what}: {bad.sum()} of {bad.size} differ; first (input, got, expected): {rows}")


# ---------------------------------------------------------------------------------------------------- decoding
@pytest.mark.parametrize("name", FLOAT_FORMATS + INT_FORMATS)
def test_decode_table_matches_ml_dtypes(name):
    """Oracle: ml_dtypes decodes every code (uint8 pattern viewed as the ml_dtypes type, cast to float32); for
    int8/int8_mx numpy's int8 view (times 2^-6 for MXINT8); for int4 ml_dtypes.int4."""
    fmt = formats.get(name)
    exp = oracle_values(name)
    codes = np.arange(2**fmt.bits)
    assert len(exp) == 2**fmt.bits
    table = _codec.decode_table(fmt)
    assert table.dtype == torch.float32 and table.shape == (2**fmt.bits,)
    assert_same_bits(table.numpy(), exp, codes, f"decode_table({name})")
    per_code = np.array([_codec.code_value(fmt, int(c)) for c in codes], dtype=np.float32)
    assert_same_bits(per_code, exp, codes, f"code_value({name})")


def test_decode_table_rejects_wide_formats():
    """Oracle: documented contract (decode_table is for formats of at most 8 bits)."""
    with pytest.raises(ValueError, match="8 bits"):
        _codec.decode_table(formats.get("bfloat16"))


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"])
def test_decode_table_matches_torch_float8(name):
    """Oracle: torch's native float8 dtypes decode every uint8 pattern (view as the float8 dtype, cast float32)."""
    fmt = formats.get(name)
    exp = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(TORCH_F8[name]).float().numpy()
    assert_same_bits(_codec.decode_table(fmt).numpy(), exp, np.arange(256), name)


# ---------------------------------------------------------------------------------------------------- encoding
@pytest.mark.parametrize("name", FLOAT_FORMATS)
def test_encode_float_roundtrips_every_code(name):
    """Oracle: exhaustive bit patterns.  ml_dtypes' value of every code, encoded back, is that code for every
    non-NaN code; values that ml_dtypes decodes as NaN must encode to some code ml_dtypes decodes as NaN."""
    fmt = formats.get(name)
    vals = oracle_values(name)
    codes = np.arange(2**fmt.bits)
    got = _codec.encode_float(torch.from_numpy(vals.copy()), fmt)
    assert got.dtype == torch.int32
    got = got.numpy()
    is_nan = np.isnan(vals)
    assert_equal_ints(got[~is_nan], codes[~is_nan], vals[~is_nan], f"encode_float({name})")
    if is_nan.any():
        assert ((got[is_nan] >= 0) & (got[is_nan] < 2**fmt.bits)).all(), got[is_nan]
        back = np.asarray(got[is_nan], dtype=np.uint8).view(ML_DTYPES[name]).astype(np.float32)
        assert np.isnan(back).all(), (got[is_nan], back)


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_encode_float_nan_keeps_sign(name):
    """Oracle: ml_dtypes' own float32 -> float8 cast of +NaN / -NaN (its NaN codes keep the sign bit), and the
    docstring's promise that the sign is kept where the format has a signed NaN."""
    fmt = formats.get(name)
    nans = np.array([np.nan, -np.nan], dtype=np.float32)
    got = _codec.encode_float(torch.from_numpy(nans.copy()), fmt).numpy()
    sign = 1 << (fmt.bits - 1)
    assert got[0] & sign == 0 and got[1] & sign == sign, got
    back = got.astype(np.uint8).view(ML_DTYPES[name]).astype(np.float32)
    assert np.isnan(back).all()


@pytest.mark.parametrize("name", ["float6_e3m2fn", "float6_e2m3fn", "float4_e2m1fn"])
def test_encode_float_nan_without_nan_code_is_zero(name):
    """Oracle: the docstring of encode_float (formats without NaN encode NaN as code 0) and ml_dtypes, whose
    code 0 decodes to +0."""
    fmt = formats.get(name)
    got = _codec.encode_float(torch.tensor([float("nan")]), fmt).numpy()
    assert got.tolist() == [0]
    assert np.asarray([0], dtype=np.uint8).view(ML_DTYPES[name]).astype(np.float32)[0] == 0.0


@pytest.mark.parametrize("name", list(TORCH_F8))
def test_encode_torch_dtype_formats_match_encode_float(name):
    """Oracle: torch's native float8 casts.  encode() stores in the torch dtype; its uint8 view must equal the
    codes of encode_float (and those of ml_dtypes, checked in the round-trip test) for every non-NaN value, and
    NaN values must be stored as patterns torch decodes as NaN."""
    fmt = formats.get(name)
    vals = oracle_values(name)
    q = torch.from_numpy(vals.copy())
    stored = _codec.encode(q, fmt)
    assert stored.dtype == TORCH_F8[name]
    got = stored.view(torch.uint8).to(torch.int32).numpy()
    exp = _codec.encode_float(q, fmt).numpy()
    is_nan = np.isnan(vals)
    assert_equal_ints(got[~is_nan], exp[~is_nan], vals[~is_nan], f"encode({name}) vs encode_float")
    assert torch.isnan(stored.float()[torch.from_numpy(is_nan)]).all()
    # And torch decodes the stored codes to ml_dtypes' values.
    assert_same_bits(_codec.decode(stored, fmt, None).numpy(), vals, np.arange(len(vals)), f"decode({name})")


@pytest.mark.parametrize("name", FLOAT_FORMATS)
def test_encode_decode_roundtrip_every_value(name):
    """Oracle: ml_dtypes' values of every code.  decode(encode(v)) must give v back bit for bit (NaN as NaN),
    for the storage layout of each format (torch dtype, packed 6-bit, packed 4-bit).  An odd length exercises
    the padding of the packers."""
    fmt = formats.get(name)
    vals = oracle_values(name)
    vals = np.concatenate([vals, vals[:3]])  # 2^bits + 3 elements: not a multiple of 2 or 4
    for shape in [(len(vals),), (3, len(vals))]:
        x = np.broadcast_to(vals, shape).copy()
        stored = _codec.encode(torch.from_numpy(x), fmt)
        back = _codec.decode(stored, fmt, x.shape[-1])
        assert back.shape == x.shape
        assert_same_bits(back.numpy(), x, x, f"decode(encode({name})) shape {shape}")
    if fmt.bits == 6:
        assert stored.dtype == torch.uint8 and stored.shape[-1] == 3 * -(-len(vals) // 4)
    if fmt.bits == 4:
        assert stored.dtype == torch.uint8 and stored.shape[-1] == -(-len(vals) // 2)


@pytest.mark.parametrize("name", INT_FORMATS)
def test_integer_encode_roundtrips_every_code(name):
    """Oracle: numpy int8 view / ml_dtypes.int4 values of every code.  int8 and MXINT8 are stored as torch.int8
    whose uint8 view must be the code itself; int4 is two's-complement nibbles packed like float4, so unpacking
    gives the code back.  decode(encode(v)) == v for every code."""
    fmt = formats.get(name)
    vals = oracle_values(name)
    codes = np.arange(2**fmt.bits)
    q = torch.from_numpy(vals.copy())
    stored = _codec.encode(q, fmt)
    if fmt.bits == 8:
        assert stored.dtype == torch.int8
        assert_equal_ints(stored.view(torch.uint8).to(torch.int32).numpy(), codes, vals, f"encode({name})")
    else:
        assert stored.dtype == torch.uint8 and stored.shape == (8,)
        assert_equal_ints(_codec.unpack_4bit(stored, 16).numpy(), codes, vals, f"encode({name})")
    assert_same_bits(_codec.decode(stored, fmt, len(vals)).numpy(), vals, vals, f"decode({name})")


def test_integer_encode_nan_is_zero():
    """Oracle: docstring of encode (integers have no NaN; NaN is stored as code 0, which numpy decodes to 0)."""
    for name in INT_FORMATS:
        fmt = formats.get(name)
        stored = _codec.encode(torch.tensor([float("nan"), 1.0]), fmt)
        back = _codec.decode(stored, fmt, 2)
        assert back.tolist() == [0.0, 1.0]


def test_decode_rejects_wrong_storage_dtype():
    """Oracle: documented contract of decode (codes must have the format's storage dtype)."""
    with pytest.raises(ValueError):
        _codec.decode(torch.zeros(4, dtype=torch.uint8), formats.get("float8_e4m3fn"), None)
    with pytest.raises(ValueError):
        _codec.decode(torch.zeros(4, dtype=torch.int32), formats.get("float4_e2m1fn"), 8)


def test_torch_dtype_mapping():
    """Oracle: torch's dtype list (the formats torch stores natively) and their bit widths from itemsize."""
    for name, dt in TORCH_F8.items():
        assert _codec.torch_dtype(formats.get(name)) is dt
        assert torch.empty(0, dtype=dt).element_size() * 8 == formats.get(name).bits
    assert _codec.torch_dtype(formats.get("bfloat16")) is torch.bfloat16
    assert _codec.torch_dtype(formats.get("float16")) is torch.float16
    for name in ["float6_e3m2fn", "float6_e2m3fn", "float4_e2m1fn", "int8", "int4", "int8_mx", "tf32"]:
        assert _codec.torch_dtype(formats.get(name)) is None


# ---------------------------------------------------------------------------------------------------- packing
def test_pack_4bit_hand_example():
    """Oracle: hand-worked layout: first element in the low nibble, so [1, 2] -> 0x21, [0xA, 0x5, 0xF] ->
    [0x5A, 0x0F] (odd length padded with a zero high nibble)."""
    assert _codec.pack_4bit(torch.tensor([1, 2])).tolist() == [0x21]
    assert _codec.pack_4bit(torch.tensor([0xA, 0x5, 0xF])).tolist() == [0x5A, 0x0F]
    assert _codec.pack_4bit(torch.tensor([[0xF, 0x0], [0x0, 0xF]])).tolist() == [[0x0F], [0xF0]]
    assert _codec.pack_4bit(torch.tensor([1, 2])).dtype == torch.uint8
    assert _codec.unpack_4bit(torch.tensor([0x21, 0x0F], dtype=torch.uint8), 3).tolist() == [1, 2, 0xF]


def test_pack_6bit_hand_example():
    """Oracle: hand-worked layout: codes [1, 2, 3, 4] form the word 1 | 2<<6 | 3<<12 | 4<<18 = 0x103081, stored
    little-endian as bytes [0x81, 0x30, 0x10]; 63 in slot 0 is 0x00003F, in slot 3 is 0xFC0000."""
    word = 1 | 2 << 6 | 3 << 12 | 4 << 18
    assert word == 0x103081
    assert _codec.pack_6bit(torch.tensor([1, 2, 3, 4])).tolist() == [0x81, 0x30, 0x10]
    assert _codec.pack_6bit(torch.tensor([63, 0, 0, 0])).tolist() == [0x3F, 0x00, 0x00]
    assert _codec.pack_6bit(torch.tensor([0, 0, 0, 63])).tolist() == [0x00, 0x00, 0xFC]
    assert _codec.pack_6bit(torch.tensor([63, 63, 63, 63])).tolist() == [0xFF, 0xFF, 0xFF]
    # Odd length: [5] -> word 5, padded group.
    assert _codec.pack_6bit(torch.tensor([5])).tolist() == [0x05, 0x00, 0x00]
    assert _codec.pack_6bit(torch.tensor([1, 2, 3, 4])).dtype == torch.uint8
    assert _codec.unpack_6bit(torch.tensor([0x81, 0x30, 0x10], dtype=torch.uint8), 4).tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("k", [1, 2, 3, 5, 7, 8, 9, 33])
def test_pack_4bit_roundtrip(k):
    """Oracle: identity (unpack(pack(c)) == c) on seeded random 4-bit codes, plus a per-byte reference built with
    numpy (low nibble = even index, high nibble = odd index)."""
    rng = np.random.default_rng(1000 + k)
    c = rng.integers(0, 16, size=(3, k))
    packed = _codec.pack_4bit(torch.from_numpy(c))
    assert packed.shape == (3, (k + 1) // 2) and packed.dtype == torch.uint8
    cp = np.pad(c, ((0, 0), (0, k % 2)))
    ref = cp[:, 0::2] | (cp[:, 1::2] << 4)
    assert_equal_ints(packed.numpy(), ref, c, "pack_4bit")
    assert_equal_ints(_codec.unpack_4bit(packed, k).numpy(), c, c, "unpack_4bit")


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, 7, 9, 31])
def test_pack_6bit_roundtrip(k):
    """Oracle: identity (unpack(pack(c)) == c) on seeded random 6-bit codes, plus a reference built bit by bit with
    numpy (element j of a group of four at bits 6j..6j+5 of a little-endian 24-bit word)."""
    rng = np.random.default_rng(2000 + k)
    c = rng.integers(0, 64, size=(2, k))
    packed = _codec.pack_6bit(torch.from_numpy(c))
    groups = -(-k // 4)
    assert packed.shape == (2, 3 * groups) and packed.dtype == torch.uint8
    cp = np.pad(c, ((0, 0), (0, 4 * groups - k))).reshape(2, groups, 4)
    ref = np.zeros((2, groups, 3), dtype=np.int64)
    for j in range(4):
        for b in range(6):
            bit = (cp[..., j] >> b) & 1
            pos = 6 * j + b
            ref[..., pos // 8] |= bit << (pos % 8)
    assert_equal_ints(packed.numpy(), ref.reshape(2, -1), c, "pack_6bit")
    assert_equal_ints(_codec.unpack_6bit(packed, k).numpy(), c, c, "unpack_6bit")


def test_unpack_6bit_rejects_bad_length():
    """Oracle: documented contract (packed 6-bit data comes in groups of three bytes)."""
    with pytest.raises(ValueError, match="divisible by 3"):
        _codec.unpack_6bit(torch.zeros(4, dtype=torch.uint8), 4)
