"""NVFP4 as the kernels compute it (issue 20, section 3): lowprec's ``nvfp4`` is TransformerEngine's arithmetic.

Oracles, each independent of lowprec's code:

* TE: ``_te_quantize`` below, a transcription of TransformerEngine's NVFP4 reference quantizer
  (``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py``, ``_quantize_blockwise_reference``, 1x16
  tiles), which TE's own tests hold bit for bit against its CUDA kernels (``cast/nvfp4/core_nvfp4.cuh``,
  ``quantize_transpose_nvfp4.cuh``).  Its decode scale is ``amax / (6 * 448)`` (the GEMM's alpha in
  ``qgemm``; ``dequantize_nvfp4.cuh``), correctly rounded to float32.
* torchao 0.18 ``NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(amax))``
  (``prototype/mx_formats/nvfp4_tensor.py``, ``nvfp4_quantize``), dequantized with its own ``dequantize``.
* compressed-tensors 0.20.1's NVFP4 preset on CPU: ``generate_gparam``, ``calculate_qparams``,
  ``lifecycle.forward.fake_quantize`` (as tests/test_inference_ct.py calls them).

Findings (docs/quantization.md, "NVFP4: what the kernels compute"), each pinned by a test:

1. lowprec = TE bit for bit: codes, e4m3 block scales, tensor scale, dequantized values; eager native kernel, tensor
   route and JAX give the same bits.
2. torchao: the same tensor scale; its block scales are clamped below at e4m3's smallest *normal* 2^-6
   (``E4M3_EPS = finfo.tiny``) where TE rounds to e4m3 subnormals or 0, and computed as ``(amax / 6) / s_t`` where
   TE multiplies ``amax * fl(S_enc * fl(1/6))``, which rounds the other way at exact e4m3 midpoints (common with
   bfloat16 inputs); outside those blocks bit for bit, except near an e2m1 tie, where torchao's multiplier
   ``fl(fl(1 / s_t) / s)`` and TE's ``fl(1 / fl(s * S_dec))`` differ by an ulp (a hand-worked example).  An
   all-zero tensor gives NaN in torchao (0 / 0).
3. compressed-tensors: its global scale ``448 * 6 / amax`` has a Python-float numerator (``2688 * fl(1 / amax)``,
   two roundings), its block scale is ``fl(G * fl(amax / 6))``, elements are divided by ``fl(s / G)`` and
   dequantized by it, and a zero block scale becomes 0.125.  lowprec's codes and scales dequantized in
   compressed-tensors' order reproduce its output bit for bit (-0 aside, which it returns as +0); values differ by
   at most 2 float32 ulps; near an e4m3 midpoint the block scale differs (a hand-worked example).  A NaN anywhere
   makes its global scale 1.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

import lowprec
from lowprec import formats
from lowprec.quant import QuantSpec, _backend, _codec, _native, _native_group, _random
from lowprec.quant._scaled import fake_quantize_tensors
from lowprec.testing import assert_bitwise_equal

ao = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
ct_q = pytest.importorskip("compressed_tensors.quantization")
ct_fwd = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward")
ct_helpers = pytest.importorskip("compressed_tensors.quantization.utils.helpers")

F32_MAX = float(np.finfo(np.float32).max)
f = np.float32
E2M1 = formats.get("float4_e2m1fn")


# ------------------------------------------------------------------------------------------------------ inputs
def _wide(seed: int, n: int = 128, k: int = 512, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Blocks of 16 spanning 2^-40 .. 2^20 (60 binades; e4m3 scales span 17.8), so most block scales are e4m3
    subnormals or 0, many of them with elements > 1 (x times float32 max is inf); a zero block, a zero row, a row of
    float32 subnormals, a block at the tensor's max, negative zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g)
    e = torch.randint(-40, 20, (n, k // 16, 1), generator=g).float()
    x = (x.view(n, k // 16, 16) * torch.exp2(e)).view(n, k)
    x[0, :16] = 0.0
    x[0, 16:32] = -0.0
    x[1] = 0.0
    x[2] = torch.randn(k, generator=g) * 1e-40
    x[3, :16] = x.abs().max() * torch.linspace(-1, 1, 16)
    return x.to(dtype)


def _weight(seed: int, n: int = 128, k: int = 512) -> torch.Tensor:
    """A weight-like tensor (rows of different scale): no block scale below e4m3's normal range."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 3


# --------------------------------------------------------------------------------------------------- TE oracle
def _e2m1(v: torch.Tensor) -> torch.Tensor:
    """TE's ``cast_to_fp4x2`` thresholds (round to nearest, ties to even) as values, the sign kept (TE's reference
    writes -0.0 as the code of +0; the hardware's ``cvt.rn.satfinite.e2m1x2.f32`` keeps it)."""
    a = v.abs()
    out = torch.zeros_like(a)
    for lo, hi, lo_in, hi_in, val in [(0.25, 0.75, False, False, 0.5), (0.75, 1.25, True, True, 1.0),
                                      (1.25, 1.75, False, False, 1.5), (1.75, 2.5, True, True, 2.0),
                                      (2.5, 3.5, False, False, 3.0), (3.5, 5.0, True, True, 4.0)]:
        m = ((a >= lo) if lo_in else (a > lo)) & ((a <= hi) if hi_in else (a < hi))
        out = torch.where(m, val, out)
    return torch.copysign(torch.where(a > 5.0, 6.0, out), v)


def _te_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """TE's reference 1x16 NVFP4 quantization of ``x [M, K]``: (element values on the e2m1 grid [M, K/16, 16],
    e4m3 decode scales [M, K/16, 1] as float32, the tensor amax, and x_hat = codes * fl(s * fl(amax / 2688)))."""
    m, k = x.shape
    xb = x.float().reshape(m, k // 16, 16)
    vec_max = xb.abs().amax(-1, keepdim=True)
    amax = x.float().abs().amax()
    six, e448, fmax = torch.tensor(6.0), torch.tensor(448.0), torch.tensor(F32_MAX)
    s_enc = torch.minimum(torch.div(e448 * six, amax), fmax)
    s_enc = torch.where((amax == 0) | (s_enc == 0), 1.0, s_enc)  # compute_global_encode_scaling_factor_FP4
    s_dec = torch.div(1.0, s_enc)
    scale = torch.minimum(vec_max * (s_enc * torch.reciprocal(six)), fmax)
    scale = torch.clamp(scale, -e448, e448).to(torch.float8_e4m3fn).float()
    enc = torch.minimum(torch.div(1.0, scale * s_dec), fmax)
    q = _e2m1(torch.clamp(xb * enc, -6.0, 6.0))
    s_t = torch.where(amax > 0, amax / 2688.0, 1.0)
    return q, scale, amax, (q * (scale * s_t)).reshape(m, k)


def _lowprec_parts(x: torch.Tensor, name: str = "nvfp4") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """lowprec's element values [M, K/16, 16], block scales [M, K/16, 1] and tensor scale (float32)."""
    codes, scales = lowprec.quantize_scaled(x, name)
    m, k = x.shape
    q = _codec.decode(codes, E2M1, k).reshape(m, k // 16, 16)
    return q, scales.group.float().reshape(m, k // 16, 1), scales.tensor


INPUTS = [("wide", s, torch.float32) for s in range(3)] + [("wide", 0, torch.bfloat16)] + [
    ("weight", s, torch.float32) for s in range(3)]


def _input(kind: str, seed: int, dtype: torch.dtype) -> torch.Tensor:
    return _wide(seed, dtype=dtype) if kind == "wide" else _weight(seed).to(dtype)


@pytest.mark.parametrize(("kind", "seed", "dtype"), INPUTS, ids=str)
def test_bit_for_bit_with_transformer_engine(kind: str, seed: int, dtype: torch.dtype) -> None:
    x = _input(kind, seed, dtype)
    q_te, s_te, amax, want = _te_quantize(x)
    q, s, s_t = _lowprec_parts(x)
    assert_bitwise_equal(s, s_te, context="e4m3 block scales")
    assert_bitwise_equal(q, q_te, context="e2m1 codes")
    assert s_t.item() == (amax / 2688.0).item()  # the tensor scale: TE's decode amax / (6 * 448)
    assert_bitwise_equal(lowprec.fake_quantize(x, "nvfp4"), want.to(dtype), context="fake_quantize")
    codes, scales = lowprec.quantize_scaled(x, "nvfp4")
    assert_bitwise_equal(lowprec.dequantize(codes, scales, "nvfp4", shape=x.shape), want, context="dequantize")
    if kind == "wide":  # the regimes the input was built for
        assert (s_te == 0).any() and ((s_te > 0) & (s_te < 2.0**-6)).any()
        assert (q_te.abs() == 6).logical_and(s_te == 0).any()  # x * float32 max clamped to 6 (inf products)


def test_bit_for_bit_with_transformer_engine_transposed() -> None:
    x = _wide(4).t()  # a transposed view: the kernel reads it in place
    _, _, _, want = _te_quantize(x.contiguous())
    assert_bitwise_equal(lowprec.fake_quantize(x, "nvfp4"), want, context="transposed")


# ----------------------------------------------------------------------------------------------- torchao oracle
def _ao(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchao's (dequantized values in x's dtype, e4m3 block scales as float32 [M, K/16, 1], tensor scale)."""
    amax = x.abs().amax().float()
    t = ao.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=ao.per_tensor_amax_to_scale(amax))
    m, k = x.shape
    return t.dequantize(x.dtype), t.scale.float().reshape(m, k // 16, 1), t.per_tensor_scale


@pytest.mark.parametrize(("kind", "seed", "dtype"), INPUTS, ids=str)
def test_torchao_differs_where_it_clamps_or_divides_block_scales(kind: str, seed: int, dtype: torch.dtype) -> None:
    """torchao's block scale is ``e4m3(clamp(fl(fl(amax / 6) / s_t), 2^-6, 448))``: clamped below at finfo.tiny =
    2^-6 where TE has no lower bound, and divided where TE multiplies by ``fl(S_enc * fl(1/6))``.  Blocks differ
    exactly where torchao clamps, or where its quotient is exactly an e4m3 midpoint (a tie, to even) while TE's
    product lands just above it (bfloat16 inputs, whose 8-bit amaxes hit midpoints).  In the other blocks elements
    differ only at exact e2m1 ties of torchao's product (bfloat16 inputs; test_reciprocal_order_at_an_e2m1_tie
    works one by hand); every other element is bit for bit."""
    x = _input(kind, seed, dtype)
    got = lowprec.fake_quantize(x, "nvfp4")
    ref, s_ao, st_ao = _ao(x)
    _, s, s_t = _lowprec_parts(x)
    assert st_ao.item() == s_t.item()
    vec_max = x.float().reshape(s.shape[0], -1, 16).abs().amax(-1, keepdim=True)
    raw = (vec_max / 6.0) / st_ao  # torchao's order, by hand
    assert torch.equal(torch.clamp(raw, 2.0**-6, 448.0).to(torch.float8_e4m3fn).float(), s_ao)
    clamped = s < 2.0**-6
    assert bool((s_ao[clamped] == 2.0**-6).all())
    tie = (raw.view(torch.int32) & 0xFFFFF) == 0x80000  # 4 significant bits, the last one set: an e4m3 midpoint
    differ = (s_ao != s) & ~clamped
    assert bool((tie & (s > s_ao))[differ].all())
    assert bool(differ.any()) == (dtype == torch.bfloat16)
    # in blocks with the same scale, elements differ only where torchao's x * fl(fl(1 / s_t) / s) is exactly an
    # e2m1 tie and TE's x * fl(1 / fl(s * S_dec)) is not (bfloat16 inputs again)
    xb = x.float().reshape(s.shape[0], -1, 16)
    v_ao = xb * ((1.0 / st_ao) / s_ao)
    s_dec = 1.0 / (torch.tensor(2688.0) / vec_max.max())
    v_te = xb * torch.clamp(1.0 / (s * s_dec), max=F32_MAX)
    at_tie = torch.isin(v_ao.abs(), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])) & (v_te != v_ao)
    same = (s_ao == s).expand(-1, -1, 16)
    moved = same & (got.reshape(xb.shape) != ref.reshape(xb.shape))
    assert bool(at_tie[moved].all())
    assert bool(moved.any()) == (dtype == torch.bfloat16)
    assert_bitwise_equal(got.reshape(xb.shape)[same & ~moved], ref.reshape(xb.shape)[same & ~moved],
                         context="blocks with torchao's scale")
    assert bool(clamped.any()) == (kind == "wide")


def _one_block(*values: float) -> torch.Tensor:
    x = torch.zeros(1, 16)
    x[0, : len(values)] = torch.tensor(values, dtype=torch.float64).float()
    return x


def test_reciprocal_order_at_an_e2m1_tie() -> None:
    """Hand-worked: tensor amax A = 0x1.a7cb0cp+9 (847.586), X = 0x1.a7cb0ap+6 (X = A/8 less one ulp).
    S_enc = fl(2688 / A), S_dec = fl(1 / S_enc) = 0x1.42e3dap-2 but torchao's s_t = fl(A / 2688) = 0x1.42e3d8p-2 (one
    ulp apart); the block scale is 448 either way.  TE: m = fl(1 / fl(448 * S_dec)), X * m = 0x1.7ffffcp-1 < 0.75
    -> code 0.5.  torchao: m = fl(fl(1 / s_t) / 448), X * m = 0.75 exactly, a tie -> code 1.0 (even).
    compressed-tensors: G = fl(2688 * fl(1 / A)), X / fl(448 / G) = 0.75 exactly -> code 1.0 too."""
    a, xv = f(float.fromhex("0x1.a7cb0cp+9")), f(float.fromhex("0x1.a7cb0ap+6"))
    s_enc = f(f(2688) / a)
    s_dec, s_t = f(f(1) / s_enc), f(a / f(2688))
    assert s_dec != s_t
    assert f(a * f(s_enc * f(1 / 6))) == 448  # e4m3 448
    v_te, v_ao = f(xv * f(f(1) / f(f(448) * s_dec))), f(xv * f(f(f(1) / s_t) / f(448)))
    assert float(v_te) == float.fromhex("0x1.7ffffcp-1") and v_ao == f(0.75)
    x = _one_block(float(a), float(xv))
    eff = float(f(f(448) * s_t))
    assert lowprec.fake_quantize(x, "nvfp4")[0, 1].item() == 0.5 * eff
    assert _ao(x)[0][0, 1].item() == 1.0 * eff
    g_ct = f(f(2688) * f(f(1) / a))
    assert f(xv / f(f(448) / g_ct)) == f(0.75)
    assert _ct(x)[0][0, 1].item() == 1.0 * float(f(f(448) / g_ct))


def test_all_zero_tensor() -> None:
    """An all-zero tensor: TE's S_enc = 1, block scales 0, values 0 (compressed-tensors also 0); torchao's
    per-tensor scale is 0 and its block scale 0 / 0 = NaN, so every value is NaN."""
    x = torch.zeros(4, 32)
    q, s, s_t = _lowprec_parts(x)
    assert s_t.item() == 1.0 and bool((s == 0).all()) and bool((q == 0).all())
    assert_bitwise_equal(lowprec.fake_quantize(x, "nvfp4"), x)
    assert bool(torch.isnan(_ao(x)[0]).all())
    assert bool((_ct(x)[0] == 0).all())


def test_subnormal_and_zero_block_scales() -> None:
    """Hand-worked, tensor amax 2688 (S_enc = S_dec = s_t = 1).  Block [6 * 2^-8, 2^-8]: scale e4m3(6 * 2^-8 *
    fl(1/6)) = 2^-8 (an e4m3 subnormal); values exact.  torchao clamps the scale to 2^-6: 2^-8 / 2^-6 = 0.25, a tie
    -> 0.  Block [6 * 2^-11]: 2^-11 rounds to e4m3 0 (below 2^-10, half the smallest subnormal): the block is 0 in
    TE (its multiplier float32 max, code 6, times scale 0), torchao (scale 2^-6: 0.1875 -> 0) and
    compressed-tensors (scale 0 -> 0.125); lowprec's earlier rule ("nvfp4_div") clamped the scale to 2^-9 and kept
    6 * 2^-11 exactly (code 1.5)."""
    x = torch.zeros(1, 48)
    x[0, 0] = 2688.0
    x[0, 16:18] = torch.tensor([6 * 2.0**-8, 2.0**-8])
    x[0, 32] = 6 * 2.0**-11
    q, s, _ = _lowprec_parts(x)
    assert s.flatten().tolist() == [448.0, 2.0**-8, 0.0] and q[0, 2, 0].item() == 6.0
    got = lowprec.fake_quantize(x, "nvfp4")
    assert got[0, 16:18].tolist() == [6 * 2.0**-8, 2.0**-8] and got[0, 32].item() == 0.0
    ref = _ao(x)[0]
    assert ref[0, 16:18].tolist() == [6 * 2.0**-8, 0.0] and ref[0, 32].item() == 0.0
    assert _ct(x)[0][0, 32].item() == 0.0
    assert lowprec.fake_quantize(x, "nvfp4_div")[0, 32].item() == 6 * 2.0**-11


def test_tiny_tensor_encode_scale_saturates() -> None:
    """Hand-worked: a tensor amax of 2^-120 < 2688 / float32 max.  TE's S_enc = 2688 / 2^-120 overflows and is
    clamped to float32 max, so the block scale is e4m3(2^-120 * fl(float32max * fl(1/6))) = e4m3(42.67) = 44 and the
    codes are 6; but the decode scale is amax / 2688 (TE's GEMM alpha and dequantize), so the value comes back as
    6 * fl(44 * fl(2^-120 / 2688)) = 0.098 * 2^-120: TE's encoding and decoding disagree below 2688 / float32 max
    (7.9e-36), and lowprec reproduces that."""
    t = f(2.0**-120)
    m6 = f(f(F32_MAX) * f(1 / 6))
    assert f(t * m6) > 42 and f(t * m6) < 43
    want = float(f(f(6) * f(f(44) * f(t / f(2688)))))
    x = _one_block(float(t))
    q, s, _ = _lowprec_parts(x)
    assert s.item() == 44.0 and q[0, 0, 0].item() == 6.0
    got = lowprec.fake_quantize(x, "nvfp4")[0, 0].item()
    assert got == want and 0.09 < got / 2.0**-120 < 0.1


# ------------------------------------------------------------------------------------- compressed-tensors oracle
def _ct(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """compressed-tensors' (dequantized values, block scales [M, K/16, 1] float32, global scale G [1])."""
    a = ct_q.preset_name_to_scheme("NVFP4", ["Linear"]).weights
    n, k = x.shape
    g = x.reshape(n, k // 16, 16)
    gs = ct_helpers.generate_gparam(x.amin(), x.amax())
    scale, zp = ct_helpers.calculate_qparams(g.amin(-1), g.amax(-1), a, global_scale=gs)
    return ct_fwd.fake_quantize(x, scale, zp, a, global_scale=gs), scale.float().reshape(n, k // 16, 1), gs


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()


@pytest.mark.parametrize(("kind", "seed"), [(k, s) for k, s, d in INPUTS if d == torch.float32], ids=str)
def test_compressed_tensors_is_lowprec_dequantized_in_its_order(kind: str, seed: int) -> None:
    """Same e4m3 scales on every block with a nonzero scale (compressed-tensors writes 0.125 for a zero one), same
    codes there; dequantizing lowprec's codes and scales in compressed-tensors' order, ``codes * (s / G)`` with its
    G, gives its output bit for bit (but for -0, which it returns as +0); lowprec's own order ``codes * (s * s_t)``
    is at most 2 ulps away."""
    x = _input(kind, seed, torch.float32)
    ref, s_ct, gs = _ct(x)
    q, s, _ = _lowprec_parts(x)
    zero = s == 0
    assert torch.equal(s_ct[~zero], s[~zero]) and bool((s_ct[zero] == 0.125).all())
    ct_order = (q * (s / gs)).reshape(x.shape)  # compressed-tensors' _dequantize: scale / global_scale, then times
    neg_zero = (x == 0) & torch.signbit(x)  # its cast_to_fp4 multiplies by torch.sign(x), +0 for -0: -0 becomes +0
    assert_bitwise_equal(ct_order[~neg_zero], ref[~neg_zero], context="lowprec's codes in compressed-tensors' order")
    assert not bool(torch.signbit(ref[neg_zero]).any()) and bool(torch.signbit(ct_order[neg_zero]).all())
    got = lowprec.fake_quantize(x, "nvfp4")
    assert _ulps(got[~neg_zero], ref[~neg_zero]).max().item() <= 2
    assert bool(zero.any()) == (kind == "wide")


def test_compressed_tensors_block_scale_order() -> None:
    """Hand-worked: tensor amax A = 0x1.ca03b2p+9 (916.03), block amax B = 0x1.fb166p+2 (7.92).  TE: B * fl(S_enc *
    fl(1/6)) = 3.875 exactly, the e4m3 midpoint of 3.75 and 4, a tie -> 4 (even).  compressed-tensors:
    G = fl(2688 * fl(1 / A)), fl(G * fl(B / 6)) = 3.8749998 -> 3.75; torchao's fl(fl(B / 6) / s_t) also 3.75."""
    a, b = f(float.fromhex("0x1.ca03b2p+9")), f(float.fromhex("0x1.fb166p+2"))
    assert f(b * f(f(f(2688) / a) * f(1 / 6))) == f(3.875)
    g_ct = f(f(2688) * f(f(1) / a))
    assert f(g_ct * f(b / f(6))) < 3.875 and f(f(b / f(6)) / f(a / f(2688))) < 3.875
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16] = float(a), float(b)
    assert _lowprec_parts(x)[1].flatten().tolist() == [448.0, 4.0]
    assert _ct(x)[1].flatten().tolist() == [448.0, 3.75]
    assert _ao(x)[1].flatten().tolist() == [448.0, 3.75]


def test_nan_handling() -> None:
    """A NaN element: lowprec (and torchao) make the whole tensor NaN; compressed-tensors' generate_gparam turns the
    NaN global scale into 1, so only the NaN's block is NaN and the others are quantized without a tensor scale."""
    x = _weight(0, 4, 64)
    x[1, 3] = float("nan")
    assert bool(torch.isnan(lowprec.fake_quantize(x, "nvfp4")).all())
    assert bool(torch.isnan(_ao(x)[0]).all())
    ref, _, gs = _ct(x)
    assert gs.item() == 1.0 and torch.isnan(ref).sum().item() == 16


# ------------------------------------------------------------------------------------------ routes and bindings
_TE_SPECS = [QuantSpec.named("nvfp4"),
             dataclasses.replace(QuantSpec.named("nvfp4"), saturate=False),
             dataclasses.replace(QuantSpec.named("nvfp4"), margin=-2),
             QuantSpec(elem="float8_e4m3fn", scaling="block", block_size=16, scale_format="float8_e4m3fn",
                       tensor_scale=True)]  # e4m3 elements: inf products become NaN unless clamped


@pytest.mark.skipif(not _native.available(), reason="no C compiler here: the native kernels are not built")
@pytest.mark.parametrize("rounding", ["nearest", "stochastic", "toward_zero"])
@pytest.mark.parametrize("spec", _TE_SPECS, ids=str)
def test_native_kernel_matches_the_tensor_route(spec: QuantSpec, rounding: str) -> None:
    """The eager C kernel (``_native_group``) gives the tensor route's bits under TE's rule, inf products included.
    Oracle: the same quantizer with the fast paths off."""
    spec = dataclasses.replace(spec, rounding=rounding)  # type: ignore[arg-type]
    keys, off = _random.key_tensor(7), _random.offset_tensor(123)
    for x in (_wide(0), _wide(1).t(), _wide(2, dtype=torch.bfloat16), _weight(0)):
        fast = _native_group.fake(x, spec, keys, off)
        with _backend.fast_paths(False):
            ref = fake_quantize_tensors(x, spec, keys=keys, offset=off)
        assert fast is not None
        assert_bitwise_equal(fast, ref, context=f"{spec} {tuple(x.shape)} {x.dtype}")


@pytest.mark.parametrize("spec", [*_TE_SPECS, QuantSpec.named("nvfp4_div")], ids=str)
def test_jax_matches_pytorch(spec: QuantSpec) -> None:
    """JAX's quantizer gives PyTorch's bits (fake_quantize, codes, scales, dequantize) under TE's rule."""
    jnp = pytest.importorskip("jax.numpy")
    lj = pytest.importorskip("lowprec.jax")
    for rounding, kw in (("nearest", {}), ("stochastic", {"seed": 5, "offset": 3})):
        sp = dataclasses.replace(spec, rounding=rounding)  # type: ignore[arg-type]
        x = _wide(3, 64, 256)
        want = lowprec.fake_quantize(x, sp, **kw).numpy()
        got = np.asarray(lj.fake_quantize(jnp.asarray(x.numpy()), sp, **kw))
        assert np.array_equal(want.view(np.int32), got.view(np.int32)), (sp, (want != got).sum())
        if sp.format.name == "float4_e2m1fn":
            codes, scales = lowprec.quantize_scaled(x, sp, **kw)
            jcodes, jscales = lj.quantize_scaled(jnp.asarray(x.numpy()), sp, **kw)
            assert np.array_equal(_codec.decode(codes, E2M1, x.shape[-1]).numpy(), np.asarray(jcodes, np.float32))
            assert np.array_equal(scales.group.float().numpy(), np.asarray(jscales.group, np.float32))
            assert scales.tensor.item() == float(jscales.tensor)


def test_tensor_stats_count_zero_scale_blocks_as_underflow() -> None:
    """``lowprec.numerics.tensor_stats``: under TE's rule a block with scale 0 has x times float32 max as its scaled
    values (codes +-6) but dequantizes to 0: underflow, not overflow.  Oracle: the TE transcription's scaled values
    (overflow: |x * m| >= 7, e2m1's rounding boundary past 6, in blocks with a nonzero scale) and its zeros."""
    from lowprec.numerics import tensor_stats

    x = _wide(0)
    _, s_te, amax, want = _te_quantize(x)
    xb = x.reshape(s_te.shape[0], -1, 16)
    s_dec = torch.div(1.0, torch.div(torch.tensor(2688.0), amax))
    v = xb * torch.minimum(torch.div(1.0, s_te * s_dec), torch.tensor(F32_MAX))
    nonzero = x != 0
    over = ((s_te > 0) & (v.abs() >= 7)).reshape(x.shape) & nonzero
    st = tensor_stats(x, "nvfp4")
    n = nonzero.sum().item()
    assert st["overflow_pct"] == pytest.approx(100.0 * over.sum().item() / n, rel=1e-12)
    assert st["underflow_pct"] == pytest.approx(100.0 * (nonzero & (want == 0)).sum().item() / n, rel=1e-12)
    assert 0 < st["overflow_pct"] < 1 < st["underflow_pct"]


def test_spec_field_validation_and_serialisation() -> None:
    """two_level_rule: "te" (default) or "divide", only with tensor_scale=True; it survives to_dict/from_dict."""
    with pytest.raises(ValueError, match="two_level_rule"):
        QuantSpec(two_level_rule="nvidia")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="two_level_rule"):
        QuantSpec(scaling="block", block_size=16, two_level_rule="divide")
    div = QuantSpec.named("nvfp4_div")
    assert QuantSpec.from_dict(div.to_dict()) == div and div.to_dict()["two_level_rule"] == "divide"
    old = {k: v for k, v in QuantSpec.named("nvfp4").to_dict().items() if k != "two_level_rule"}
    assert QuantSpec.from_dict(old) == QuantSpec.named("nvfp4")  # a record without the field: the default
    assert math.isfinite(lowprec.fake_quantize(_weight(1), div).abs().max().item())
