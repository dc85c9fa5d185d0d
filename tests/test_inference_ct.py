"""lowprec.inference against compressed-tensors (0.20.1), the reference that llm-compressor writes and vLLM reads.

For each preset, compressed-tensors' own preset (``preset_name_to_scheme``) gives the ``QuantizationArgs``; its
``calculate_qparams`` (``quantization/utils/helpers.py``) computes scale / zero point from the weight's min / max
per its strategy, and ``lifecycle.forward.fake_quantize`` the dequantized weight, compared with
``lowprec.inference.fake_quantize_weight`` on the same float32 weight (all CPU; no Triton path is taken).

Findings (each pinned by a test below):

- fp8 tensor / channel / 128x128 block, and int4 g128 asymmetric: bit for bit (``torch.equal``).
- int8 channel and int4 g128 symmetric: equal scales (outside all-zero groups), but compressed-tensors quantizes
  with ``x / scale`` while lowprec (following torchao) uses ``x * fl(1 / scale)``; near a rounding tie the two give
  codes one apart.  A lowprec variant that divides matches compressed-tensors bit for bit.
- MXFP8 / MXFP4: compressed-tensors' E8M0 scale is not OCP's floor rule: it rounds the group amax to a power of
  two with a mantissa threshold (``round_to_power_2`` with e2m1's mantissa width, for MXFP8 too), so groups
  whose amax has mantissa >= 1.75 get twice lowprec's scale.  Groups with the same scale agree bit for bit.
- NVFP4: same e4m3 group scales (but for all-zero groups: compressed-tensors' 0.125, lowprec's and
  TransformerEngine's 0) and codes; dequantization order differs (compressed-tensors ``codes * (s /
  global_scale)``), at most 1 float32 ulp on this weight.  tests/test_nvfp4_kernels.py has the full comparison.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from lowprec import inference as I
from lowprec.inference import _affine

ct_q = pytest.importorskip("compressed_tensors.quantization")
ct_fwd = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward")
ct_helpers = pytest.importorskip("compressed_tensors.quantization.utils.helpers")

CT_PRESET = {"w8a8-int8": "W8A8", "w4a16-int4": "W4A16", "w4a16-int4-asym": "W4A16_ASYM", "fp8-static": "FP8",
             "fp8-dynamic": "FP8_DYNAMIC", "fp8-block": "FP8_BLOCK", "mxfp8": "MXFP8", "mxfp4": "MXFP4",
             "nvfp4": "NVFP4"}


def _weight(n: int = 256, k: int = 512, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 3
    w[3] = 0.0  # an all-zero row: the eps of the scale
    w[5, :] = w[5, :].abs()  # a row with no negative values: the asymmetric zero point at qmin
    return w


# ---------------------------------------------------------------------------------------------- converter
def to_ct_config(scheme: I.Scheme) -> Any:
    """A lowprec ``Scheme`` (via its ``to_dict``) as a compressed-tensors ``QuantizationConfig``: the library's
    ``to_compressed_tensors_config`` (the ``quantization_config`` of a saved checkpoint), validated by pydantic.
    ``scale_rounding`` has no field there: compressed-tensors' MX rule is fixed (module docstring)."""
    d = I.to_compressed_tensors_config(I.Scheme.from_dict(scheme.to_dict()))
    return ct_q.QuantizationConfig.model_validate(d)


_FIELDS = ("num_bits", "type", "strategy", "group_size", "symmetric", "dynamic", "block_structure", "scale_dtype")


@pytest.mark.parametrize("name", I.names())
def test_preset_matches_compressed_tensors_preset(name: str) -> None:
    ours = to_ct_config(I.get(name))
    assert ours.ignore == ["lm_head"]
    mine = ours.config_groups["group_0"]
    ref = ct_q.preset_name_to_scheme(CT_PRESET[name], ["Linear"])
    assert mine.targets == ref.targets == ["Linear"]
    for role in ("weights", "input_activations"):
        a, b = getattr(mine, role), getattr(ref, role)
        assert (a is None) == (b is None), role
        if a is not None:
            for f in _FIELDS:
                assert getattr(a, f) == getattr(b, f), f"{name} {role}.{f}: {getattr(a, f)!r} != {getattr(b, f)!r}"
    # pydantic round trip (compressed-tensors' serializer drops zp_dtype of symmetric args, so compare fields)
    back = ct_q.QuantizationConfig.model_validate(ours.model_dump()).config_groups["group_0"].weights
    assert all(getattr(back, f) == getattr(mine.weights, f) for f in _FIELDS)


def test_config_with_kv_cache_and_groups_validates() -> None:
    grp = I.ConfigGroup(name="attn", targets=("re:.*self_attn.*",),
                        weights=I.TensorScheme(format="float8_e4m3fn", granularity="channel"))
    base = I.get("w4a16-int4")
    s = I.Scheme(name="mix", config_groups=(grp, *base.config_groups), ignore=base.ignore,
                 kv_cache=I.TensorScheme(format="float8_e4m3fn"))
    cfg = to_ct_config(s)
    assert list(cfg.config_groups) == ["attn", "group_0"]
    assert cfg.kv_cache_scheme.num_bits == 8 and cfg.kv_cache_scheme.strategy == "tensor"


# ---------------------------------------------------------------------------------------------- numerics
def _ct_fake_quantize(w: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """compressed-tensors' QDQ of ``w`` with its preset's weight args; returns (w_hat, scale, zero_point)."""
    a = ct_q.preset_name_to_scheme(CT_PRESET[name], ["Linear"]).weights
    n, k = w.shape
    gs = None
    if a.strategy == "tensor":
        mn, mx = w.amin(), w.amax()
    elif a.strategy == "channel":
        mn, mx = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif a.strategy in ("group", "tensor_group"):
        g = w.reshape(n, k // a.group_size, a.group_size)
        mn, mx = g.amin(-1), g.amax(-1)
        if a.strategy == "tensor_group":
            gs = ct_helpers.generate_gparam(w.amin(), w.amax())
    else:
        bh, bw = a.block_structure
        g = w.reshape(n // bh, bh, k // bw, bw)
        mn, mx = g.amin((1, 3)), g.amax((1, 3))
    scale, zp = ct_helpers.calculate_qparams(mn, mx, a, global_scale=gs)
    return ct_fwd.fake_quantize(w, scale, zp, a, global_scale=gs), scale, zp


def _ws(name: str) -> I.TensorScheme:
    ts = I.get(name).config_groups[0].weights
    assert ts is not None
    return ts


@pytest.mark.parametrize("name", ["fp8-static", "fp8-dynamic", "fp8-block", "w4a16-int4-asym"])
def test_bit_for_bit(name: str) -> None:
    """fp8: both compute ``amax / 448`` in float32, divide, clamp, cast to e4m3 (ties to even); an all-zero group
    dequantizes to 0 in both (compressed-tensors' eps scale 2^-23, lowprec's 2^-126).  int4 asymmetric: the same
    scale ``(hi - lo) / 15`` and zero point (qmin = -8 is even, so ``round(qmin - lo/s) == qmin - round(lo/s)``);
    quantization differs in form (compressed-tensors ``round(x / s + zp)``, lowprec ``round(x * fl(1/s)) + zp``)
    and so may differ by one code near a tie, but on this weight no element does."""
    w = _weight()
    ref, _, _ = _ct_fake_quantize(w, name)
    got = I.fake_quantize_weight(w, _ws(name))
    assert torch.equal(got, ref), f"{(got != ref).sum().item()} elements differ"
    assert got[3].abs().max() == 0


@pytest.mark.parametrize(("name", "n_diff"), [("w8a8-int8", 24), ("w4a16-int4", 84)])
def test_int_symmetric_reciprocal_vs_division(name: str, n_diff: int) -> None:
    """Symmetric int: same scale ``amax / ((qmax - qmin) / 2)`` (bit for bit, except all-zero groups: eps 2^-23
    there vs lowprec's 2^-126, both dequantizing to 0).  compressed-tensors quantizes with ``round(x / s)``, lowprec
    (= torchao) with ``round(x * fl(1 / s))``: ``fl(1/s)`` is off by up to half an ulp, so a product landing within
    an ulp of a .5 tie can round the other way.  Exactly ``n_diff`` of 131072 elements differ on this weight, each
    by exactly one code (one scale step); the division variant of lowprec's own formula matches bit for bit."""
    w = _weight()
    ts = _ws(name)
    ref, ct_scale, _ = _ct_fake_quantize(w, name)
    scale, zp = _affine.int_qparams(w, ts)
    s = scale.reshape(ct_scale.shape)
    nonzero = s > float.fromhex("0x1p-126")
    assert torch.equal(s[nonzero], ct_scale[nonzero]) and not nonzero.all()
    qmin, qmax = _affine.int_range(ts.format)
    g = _affine._groups(w, ts)
    by_division = ((torch.clamp(torch.round(g / scale) + zp, qmin, qmax) - zp) * scale).reshape(w.shape)
    assert torch.equal(by_division, ref)
    got = I.fake_quantize_weight(w, ts)
    diff = got != ref
    assert diff.sum().item() == n_diff
    codes = [torch.round(_affine._groups(x, ts) / scale).reshape(w.shape) for x in (got, ref)]
    assert torch.equal((codes[0] - codes[1]).abs()[diff], torch.ones(n_diff))


def _mx_floor_scale(amax: torch.Tensor, emax: int) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(amax)) - emax)


@pytest.mark.parametrize(("name", "emax", "n_groups"), [("mxfp8", 8, 829), ("mxfp4", 2, 829)])
def test_mx_scale_rule_differs(name: str, emax: int, n_groups: int) -> None:
    """lowprec's MX scale is OCP MX v1.0's floor rule, ``2^(floor(log2 amax) - emax_elem)``.  compressed-tensors'
    ``generate_mx_scales`` first rounds amax up to the next power of two when its mantissa is >= 1.75
    (``round_to_power_2`` with e2m1's 1 mantissa bit, for MXFP8 too: add 2^-2, mask the mantissa);
    such groups get twice lowprec's scale.  Exactly those groups (``n_groups`` of 4096 on this weight) differ;
    every other group is bit for bit."""
    w = _weight()
    w[3] = 1.0  # log2(0) is -inf: keep every group non-zero for the scale comparison
    ref, ct_scale, _ = _ct_fake_quantize(w, name)
    n, k = w.shape
    amax = w.reshape(n, k // 32, 32).abs().amax(-1)
    floor = _mx_floor_scale(amax, emax)
    mantissa = amax / torch.exp2(torch.floor(torch.log2(amax)))
    bumped = mantissa >= 1.75
    assert torch.equal(ct_scale.float(), torch.where(bumped, 2 * floor, floor))
    assert bumped.sum().item() == n_groups
    got = I.fake_quantize_weight(w, _ws(name))
    same = (~bumped).repeat_interleave(32, dim=1)
    assert torch.equal(got[same], ref[same])
    assert (got != ref)[~same].any()


def test_nvfp4_within_one_ulp() -> None:
    """Same e4m3 group scales (all-zero row aside: 0.125 there, lowprec's TE rule 0; both dequantize to 0) and e2m1
    codes; compressed-tensors dequantizes as ``codes * (s_e4m3 / global_scale)`` with ``global_scale = 448 * 6 /
    amax``, lowprec as ``codes * (s_e4m3 * fl(amax / (448 * 6)))``, so 18077 of 131072 elements differ by exactly 1
    float32 ulp (a code or scale difference would be far larger: adjacent e2m1 codes are >= 1/3 apart
    relatively)."""
    w = _weight()
    ref, _, _ = _ct_fake_quantize(w, "nvfp4")
    got = I.fake_quantize_weight(w, _ws("nvfp4"))
    bits = (got.view(torch.int32).long() - ref.view(torch.int32).long()).abs()
    assert bits.max().item() == 1
    assert (bits != 0).sum().item() == 18077
    assert torch.equal(torch.sign(got), torch.sign(ref)) and math.isfinite(ref.abs().max().item())
