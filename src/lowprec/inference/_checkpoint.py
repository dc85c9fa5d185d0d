"""Quantized checkpoints in the compressed-tensors layout (what llm-compressor writes and vLLM reads).

A checkpoint is a folder with ``model.safetensors`` and ``config.json``.  ``config.json`` holds the model's own
config (when it has ``.config.to_dict()``) and ``quantization_config`` (``to_compressed_tensors_config``:
``quant_method: "compressed-tensors"``, ``format``, ``config_groups``, ``ignore``, ``kv_cache_scheme``,
``quantization_status: "compressed"``).  Per quantized Linear ``<name>`` (compressed-tensors' names, 0.20.1)::

    int-quantized   (int weights with activations, w8a8-int8)   <name>.weight int8 [N, K], <name>.weight_scale
    pack-quantized  (int weights only, w4a16-int4[-asym])       <name>.weight_packed int32 [N, ceil(K*b/32)],
                    <name>.weight_shape int64 [2], <name>.weight_scale,
                    <name>.weight_zero_point (asymmetric; group / channel: int32 packed along N)
    float-quantized (fp8 weights with activations)              <name>.weight float8_e4m3fn [N, K], .weight_scale
    naive-quantized (fp8 weights only)                          as float-quantized
    mxfp8-quantized      (mxfp8)   <name>.weight float8_e4m3fn [N, K], <name>.weight_scale uint8 [N, K/32]
    mxfp4-pack-quantized (mxfp4)   <name>.weight_packed uint8 [N, K/2], <name>.weight_scale uint8 [N, K/32]
    nvfp4-pack-quantized (nvfp4)   <name>.weight_packed uint8 [N, K/2], <name>.weight_scale float8_e4m3fn
                                   [N, K/16], <name>.weight_global_scale float32 [1]

``weight_scale`` is float32 for int and fp8: ``[1]`` per tensor, ``[N, 1]`` per channel, ``[N, K/g]`` per group,
``[N/a, K/b]`` per block; ``weight_zero_point`` int8 in the scale's shape (before packing).  Packing
(``pack_to_int32``): codes ``q + 2^(b-1)`` (unsigned), element ``j`` of each run of ``32/b`` at bits
``[b*j, b*j + b)`` of one int32 word.  The codes are lowprec's own (``_affine``), so that dequantizing them,
``(q - zero_point) * scale`` (compressed-tensors' ``dequantize``), is ``fake_quantize_weight`` bit for bit.

MX and NVFP4 (``lowprec.quant.quantize_scaled``'s codes and scales, so the stored values are lowprec's, not what
compressed-tensors' observers would choose): e2m1 codes (``sign << 3 | exponent << 1 | mantissa``: 0, 0.5, 1,
1.5, 2, 3, 4, 6) two per byte, element ``2i`` in the low nibble; E8M0 scales as their uint8 biased exponent
(``2^(byte - 127)``; 255, E8M0's NaN, is never written: non-finite weights are refused).  NVFP4's
``weight_global_scale`` is compressed-tensors' convention, the *reciprocal* of lowprec's float32 tensor scale
``s_t = amax / (6 * 448)``: compressed-tensors dequantizes ``codes * (weight_scale / weight_global_scale)``,
lowprec ``codes * (weight_scale * s_t)``.  No float32 ``g`` makes ``s / g == s * s_t`` for every e4m3 ``s`` in
general, so ``weight_global_scale`` is the float32 within 16 ulps of ``1 / s_t`` that agrees best for the layer's
own group scales (first: compressed-tensors' bfloat16 result equals ``bfloat16(lowprec)``; then the most exact
float32 scales), and lowprec's exact ``s_t`` is kept in the safetensors metadata (``lowprec.tensor_scales``, hex
floats), which ``load_quantized`` uses; a checkpoint without it is dequantized as compressed-tensors does.
compressed-tensors 0.20.1 returns MX and NVFP4 weights in bfloat16 (``unpack_fp4_from_uint8``'s default dtype,
MXFP8's bfloat16 scales): MX values are exact there, NVFP4's are rounded to bfloat16.

Every other tensor of the state dict is stored as is.  A model already converted by ``quantize_model`` is saved
from its ``QuantizedLinear`` layers: codes from ``original_weight``, checked against the layer's ``weight``, or
for GPTQ layers (their weight is on GPTQ's own grid) codes from ``weight`` with the layer's ``weight_scale`` /
``weight_zero_point``, checked by dequantizing them back to ``weight`` bit for bit.  A layer with a ``smooth``
buffer (SmoothQuant / AWQ factors) is refused (fold it into the previous layer first), and so is AWQ without
activation quantization (its weight ``Q(W diag(s)) diag(s)^-1`` has per-input-channel factors that no
compressed-tensors format stores).

Loading reads only JSON and safetensors (``safetensors.torch.load_file``): nothing is unpickled.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from .. import formats
from .._errors import UsageError
from ._scheme import ConfigGroup, Scheme, TensorScheme

_WEIGHTS_FILE = "model.safetensors"
_CONFIG_FILE = "config.json"
_META_GROUPS = "lowprec.config_groups"  # safetensors metadata: {layer name: config group name}
_META_TENSOR_SCALES = "lowprec.tensor_scales"  # {layer name: float.hex(s_t)} of NVFP4 layers
_BITS_TYPE = {"int8": (8, "int"), "int4": (4, "int"), "float8_e4m3fn": (8, "float"), "float4_e2m1fn": (4, "float")}
_FORMAT_OF = {v: k for k, v in _BITS_TYPE.items()}
_SCALE_DTYPE = {"float32": None, "float8_e8m0fnu": "torch.uint8", "float8_e4m3fn": "torch.float8_e4m3fn"}
_SCALE_FORMAT_OF = {"torch.uint8": "float8_e8m0fnu", "torch.float8_e4m3fn": "float8_e4m3fn"}
_SUPPORTED = ("int-quantized", "pack-quantized", "float-quantized", "naive-quantized", "mxfp8-quantized",
              "mxfp4-pack-quantized", "nvfp4-pack-quantized")
_NARROW = {"mxfp8-quantized": ("float8_e4m3fn", "float8_e8m0fnu", 32),
           "mxfp4-pack-quantized": ("float4_e2m1fn", "float8_e8m0fnu", 32),
           "nvfp4-pack-quantized": ("float4_e2m1fn", "float8_e4m3fn", 16)}  # format: (elements, scales, group)
_GS_ULPS = 16  # NVFP4 weight_global_scale candidates: 1 / s_t +- this many float32 ulps
_TINY = float.fromhex("0x1p-126")


# ------------------------------------------------------------------------------------------------ config
def _ct_args(ts: TensorScheme) -> dict[str, Any]:
    bits, typ = _BITS_TYPE[ts.format]
    out: dict[str, Any] = {"num_bits": bits, "type": typ, "strategy": ts.granularity, "symmetric": ts.symmetric,
                           "dynamic": ts.dynamic}
    if ts.group_size is not None:
        out["group_size"] = ts.group_size
    if ts.block is not None:
        out["block_structure"] = list(ts.block)
    sdt = _SCALE_DTYPE[ts.scale_format]
    if sdt is not None:
        out.update(scale_dtype=sdt, zp_dtype=sdt)
    return out


def _group_format(group: ConfigGroup) -> str:
    """compressed-tensors' inferred format (``infer_module_format``'s priority) for float32-scale schemes."""
    w = group.weights
    if w is None:
        return "dense"
    if w.scale_format != "float32":
        if w.format == "float4_e2m1fn":
            return "nvfp4-pack-quantized" if w.scale_format == "float8_e4m3fn" else "mxfp4-pack-quantized"
        return "mxfp8-quantized"
    acts = group.input_activations
    if w.is_int:
        return "int-quantized" if acts is not None and not acts.format.startswith("float") else "pack-quantized"
    return "float-quantized" if acts is not None else "naive-quantized"


def to_compressed_tensors_config(scheme: Scheme) -> dict[str, Any]:
    """``scheme`` as compressed-tensors' ``quantization_config`` (the dict in ``config.json`` that vLLM reads):
    ``QuantizationConfig.model_validate`` accepts it.  ``scale_rounding`` has no field there."""
    if not isinstance(scheme, Scheme):
        raise UsageError(f"to_compressed_tensors_config(scheme): scheme must be a lowprec.inference.Scheme; got "
                         f"{type(scheme).__name__}")
    groups: dict[str, Any] = {}
    fmts = []
    for g in scheme.config_groups:
        fmt = _group_format(g)
        fmts.append(fmt)
        groups[g.name] = {"targets": list(g.targets),
                          "weights": _ct_args(g.weights) if g.weights is not None else None,
                          "input_activations": _ct_args(g.input_activations) if g.input_activations else None,
                          "output_activations": None, "format": fmt}
    fmt = fmts[0] if len(set(fmts)) == 1 else "mixed-precision"
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": groups, "ignore": list(scheme.ignore),
            "kv_cache_scheme": _ct_args(scheme.kv_cache) if scheme.kv_cache is not None else None}


def _from_ct_args(d: Any, where: str) -> TensorScheme:
    if not isinstance(d, Mapping):
        raise UsageError(f"{where} must be an object of quantization args; got {d!r}")
    key = (d.get("num_bits"), d.get("type"))
    if key not in _FORMAT_OF:
        raise UsageError(f"{where}: num_bits={key[0]!r}, type={key[1]!r} is not a format lowprec knows; known: "
                         f"{', '.join(f'{b}-bit {t}' for b, t in _FORMAT_OF)}")
    sdt = d.get("scale_dtype")
    scale_format = _SCALE_FORMAT_OF.get(str(sdt), "float32") if sdt is not None else "float32"
    block = d.get("block_structure")
    try:
        return TensorScheme(format=_FORMAT_OF[key], granularity=d.get("strategy", "tensor"),
                            group_size=d.get("group_size"), block=tuple(block) if block is not None else None,
                            symmetric=bool(d.get("symmetric", True)), dynamic=d.get("dynamic", False),
                            scale_format=scale_format,
                            scale_rounding="floor" if scale_format == "float8_e8m0fnu" else "nearest")
    except UsageError as e:
        raise UsageError(f"{where}: {e}") from None


def from_compressed_tensors_config(qc: Mapping[str, Any], name: str = "compressed-tensors") -> Scheme:
    """Inverse of ``to_compressed_tensors_config`` (the ``quantization_config`` dict of a checkpoint)."""
    if not isinstance(qc, Mapping) or qc.get("quant_method") != "compressed-tensors":
        raise UsageError(f"quantization_config must have quant_method 'compressed-tensors'; got "
                         f"{qc.get('quant_method') if isinstance(qc, Mapping) else qc!r}")
    groups_d = qc.get("config_groups")
    if not isinstance(groups_d, Mapping) or not groups_d:
        raise UsageError("quantization_config.config_groups must be a non-empty object")
    groups = []
    for gname, g in groups_d.items():
        where = f"quantization_config.config_groups.{gname}"
        if not isinstance(g, Mapping):
            raise UsageError(f"{where} must be an object; got {g!r}")
        w, a = g.get("weights"), g.get("input_activations")
        groups.append(ConfigGroup(name=gname, targets=tuple(g.get("targets") or ()),
                                  weights=_from_ct_args(w, f"{where}.weights") if w else None,
                                  input_activations=_from_ct_args(a, f"{where}.input_activations") if a else None))
    kv = qc.get("kv_cache_scheme")
    return Scheme(name=name, config_groups=tuple(groups), ignore=tuple(qc.get("ignore") or ()),
                  kv_cache=_from_ct_args(kv, "quantization_config.kv_cache_scheme") if kv else None)


# ------------------------------------------------------------------------------------------------ codes
def _groups(w: torch.Tensor, ts: TensorScheme) -> torch.Tensor:
    from ._affine import _groups as groups

    return groups(w, ts)


def _scale_shape(ts: TensorScheme, n: int, k: int) -> tuple[int, ...]:
    g = ts.granularity
    if g == "tensor":
        return (1,)
    if g == "channel":
        return (n, 1)
    if g in ("group", "tensor_group"):
        return (n, k // int(ts.group_size or 1))
    a, b = ts.block or (1, 1)
    return (n // a, k // b)


def quantize_weight(weight: torch.Tensor, ts: TensorScheme,
                    qparams: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The unpacked stored form of one weight ``[N, K]``: ``weight`` (codes: int8, or float8_e4m3fn),
    ``weight_scale`` float32 and, for asymmetric schemes, ``weight_zero_point`` int8 (module docstring), such that
    ``(weight - weight_zero_point) * weight_scale`` is ``fake_quantize_weight(weight, ts)`` in float32.

    ``qparams``: ``(scale, zero_point)`` float32 in the stored shape (``_scale_shape``) to use instead of the ones
    ``weight`` implies: GPTQ's, whose weight is already on its grid, so the codes are ``round(weight / scale) +
    zero_point`` (the caller checks that they dequantize back to ``weight``)."""
    from . import _affine
    from ._plan import check_fit

    ts.check_role("weights", "TensorScheme")
    check_fit(ts, tuple(weight.shape))
    if ts.scale_format != "float32" or ts.granularity == "tensor_group":
        raise UsageError(f"quantize_weight: {ts.format} weights with {ts.scale_format} scales (MX / NVFP4) are "
                         "stored by _compress_narrow; quantize_weight is for float32-scale schemes")
    n, k = weight.shape
    g = _groups(weight.float(), ts)
    out: dict[str, torch.Tensor] = {}
    given: tuple[torch.Tensor, torch.Tensor] | None = None
    if qparams is not None:
        want = _scale_shape(ts, n, k)
        if qparams[0].numel() != math.prod(want) or qparams[1].numel() != math.prod(want):
            raise UsageError(f"quantize_weight: qparams must hold {list(want)} scales and zero points for a weight "
                             f"{[n, k]}; got {list(qparams[0].shape)} and {list(qparams[1].shape)}")
        shape4 = (g.shape[0], 1, g.shape[2], 1)
        given = (qparams[0].float().reshape(shape4), qparams[1].float().reshape(shape4))
    if ts.is_int:
        qmin, qmax = _affine.int_range(ts.format)
        scale, zp = _affine.int_qparams(weight, ts) if given is None else given
        q = torch.clamp(torch.round(g * (1.0 / scale)) + zp, qmin, qmax)
        out["weight"] = q.reshape(n, k).to(torch.int8)
        if not ts.symmetric:
            out["weight_zero_point"] = zp.reshape(_scale_shape(ts, n, k)).to(torch.int8)
    else:
        from ..quant import quantize

        if ts.format != "float8_e4m3fn":
            raise UsageError(f"checkpoints with {ts.format} weights are not supported yet; use float8_e4m3fn")
        fmt = formats.get(ts.format)
        scale = torch.clamp(g.abs().amax(dim=(1, 3), keepdim=True) / fmt.max, min=_TINY) if given is None \
            else given[0]
        codes = quantize(torch.clamp(g / scale, -fmt.max, fmt.max), fmt, saturate=True)
        out["weight"] = codes.reshape(n, k).to(torch.float8_e4m3fn)
    out["weight_scale"] = scale.reshape(_scale_shape(ts, n, k)).contiguous()
    return out


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """compressed-tensors' ``pack_to_int32`` along dim 1 for ``bits`` in (4, 8)."""
    per = 32 // bits
    rows, cols = q.shape
    u = (q.to(torch.int64) + (1 << (bits - 1))) & ((1 << bits) - 1)
    pad = -cols % per
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))
    shifts = torch.arange(per, dtype=torch.int64) * bits
    words = (u.reshape(rows, -1, per) << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32).contiguous()


def _unpack(words: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    per = 32 // bits
    rows = words.shape[0]
    shifts = torch.arange(per, dtype=torch.int64) * bits
    u = (words.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return (u.reshape(rows, -1)[:, :cols] - (1 << (bits - 1))).to(torch.int8)


def _nvfp4_global_scale(s_t: torch.Tensor, group_scales: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' ``weight_global_scale`` ``[1]`` for lowprec's tensor scale ``s_t`` (module docstring):
    of the float32s within ``_GS_ULPS`` ulps of ``1 / s_t``, the one whose ``codes * (s / g)`` agrees best with
    lowprec's ``codes * (s * s_t)`` over the layer's distinct group scales ``s`` and all e2m1 magnitudes."""
    t = s_t.reshape(1).float()
    s = torch.unique(group_scales.float()).reshape(-1, 1)
    c = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    ours = s * t
    ours_bf16 = (c * ours).bfloat16()
    base = int((1.0 / t).view(torch.int32).item())
    best: tuple[tuple[int, int, int], torch.Tensor] | None = None
    for d in range(-_GS_ULPS, _GS_ULPS + 1):
        g = torch.tensor([base + d], dtype=torch.int32).view(torch.float32)
        if not (bool(torch.isfinite(g).all()) and float(g) > 0):
            continue
        theirs = s / g
        key = (int(((c * theirs).bfloat16() != ours_bf16).sum()), int((theirs != ours).sum()), abs(d))
        if best is None or key < best[0]:
            best = (key, g)
    if best is None:
        raise UsageError(f"tensor scale {float(t)!r} has no finite float32 reciprocal for weight_global_scale")
    return best[1]


def _compress_narrow(weight: torch.Tensor, ts: TensorScheme, fmt: str, layer: str) -> dict[str, torch.Tensor]:
    """MX / NVFP4 storage of one weight ``[N, K]`` (module docstring): lowprec's own codes and scales
    (``quantize_scaled`` with ``ts.quant_spec()``, which ``fake_quantize_weight`` dequantizes bit for bit)."""
    from ..quant import quantize_scaled
    from ._plan import check_fit

    elem, scale_fmt, group = _NARROW[fmt]
    if (ts.format, ts.scale_format, ts.group_size) != (elem, scale_fmt, group) or ts.granularity not in (
            ("tensor_group",) if fmt.startswith("nvfp4") else ("group",)):
        raise UsageError(f"save_quantized: layer {layer!r}: format {fmt!r} stores {elem} in groups of {group} with "
                         f"{scale_fmt} scales; the scheme has {ts.format}/{ts.granularity}/{ts.group_size} with "
                         f"{ts.scale_format} scales")
    check_fit(ts, tuple(weight.shape), module=layer)
    if not bool(torch.isfinite(weight).all()):
        raise UsageError(f"save_quantized: layer {layer!r}: the weight has NaN or inf elements, which MX / NVFP4 "
                         "storage cannot hold (their group scale would be NaN); fix the weight first")
    codes, scales = quantize_scaled(weight, ts.quant_spec())
    if fmt == "mxfp8-quantized":
        return {"weight": codes.contiguous(), "weight_scale": scales.view(torch.uint8).contiguous()}  # type: ignore[union-attr]
    if fmt == "mxfp4-pack-quantized":
        return {"weight_packed": codes.contiguous(), "weight_scale": scales.view(torch.uint8).contiguous()}  # type: ignore[union-attr]
    group_scales, s_t = scales  # TwoLevelScales
    return {"weight_packed": codes.contiguous(), "weight_scale": group_scales.contiguous(),
            "weight_global_scale": _nvfp4_global_scale(s_t, group_scales), "_tensor_scale": s_t.reshape(())}


def _compress(weight: torch.Tensor, ts: TensorScheme, fmt: str, layer: str = "",
              qparams: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    if fmt in _NARROW:
        if qparams is not None:
            raise UsageError(f"save_quantized: layer {layer!r}: GPTQ's float32 scales cannot be stored as {fmt} "
                             "(its scales are e8m0 / e4m3); quantize this layer with algorithm='max'")
        return _compress_narrow(weight, ts, fmt, layer)
    t = quantize_weight(weight, ts, qparams)
    if fmt != "pack-quantized":
        return t
    bits = _BITS_TYPE[ts.format][0]
    out = {"weight_packed": _pack(t.pop("weight"), bits), "weight_scale": t["weight_scale"],
           "weight_shape": torch.tensor(list(weight.shape), dtype=torch.int64)}
    if "weight_zero_point" in t:
        zp = t["weight_zero_point"]
        out["weight_zero_point"] = (_pack(zp.t(), bits).t().contiguous()
                                    if ts.granularity in ("group", "channel") else zp)
    return out


# ------------------------------------------------------------------------------------------------ save / load
class _Layer(NamedTuple):
    name: str
    group: str
    weights: TensorScheme | None
    original: torch.Tensor  # the weight to quantize
    current: torch.Tensor | None  # QuantizedLinear.weight (checked against the stored codes), None for nn.Linear
    qparams: tuple[torch.Tensor, torch.Tensor] | None = None  # GPTQ's weight_scale, weight_zero_point
    algorithm: str = "max"


def _weight_of(module: nn.Module) -> torch.Tensor:
    w = module.weight
    assert isinstance(w, torch.Tensor)  # plan() checked it
    return w.detach()


def _layers(model: nn.Module, scheme: Scheme) -> list[_Layer]:
    """The layers to store quantized: a model's ``QuantizedLinear`` layers when it has any (``quantize_model``),
    otherwise ``plan(model, scheme)``."""
    from ._plan import _matches, plan
    from ._quantize import QuantizedLinear

    for name, m in model.named_modules():
        if getattr(m, "smooth", None) is not None:
            raise UsageError(f"save_quantized: module {name or type(m).__name__!r} has a per-input-channel 'smooth' "
                             "buffer (SmoothQuant / AWQ): compressed-tensors checkpoints have no place for it; "
                             "quantize with options={'fold': True} to fold the factors into the norms")
    quantized = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    if not quantized:
        return [_Layer(e.name, e.group, e.weights, _weight_of(e.module), None) for e in plan(model, scheme)]
    groups = {g.name: g for g in scheme.config_groups}
    for n, m in quantized:
        if any(_matches(e, n, m) for e in scheme.ignore):
            raise UsageError(f"save_quantized: layer {n!r} is a QuantizedLinear but scheme {scheme.name!r} ignores it; "
                             "compressed-tensors would load it as a float layer: unquantize it (to_linear) or drop "
                             "it from Scheme.ignore")
        g = groups.get(m.group)
        if g is None or g.weights != m.weights or g.input_activations != m.input_activations:
            raise UsageError(f"save_quantized: layer {n!r} was quantized with config group {m.group!r} "
                             f"(weights {m.weights}, input_activations {m.input_activations}), which scheme "
                             f"{scheme.name!r} does not have; pass the scheme given to quantize_model")
    for n, m in model.named_modules():
        if type(m) is nn.Linear and not any(_matches(e, n, m) for e in scheme.ignore) and any(
                _matches(t, n, m) for g in scheme.config_groups for t in g.targets):
            raise UsageError(f"save_quantized: module {n!r} is an nn.Linear that scheme {scheme.name!r} targets but "
                             "quantize_model did not convert; a checkpoint would claim it is quantized: quantize it "
                             "or add it to Scheme.ignore")
    return [_Layer(n, m.group, m.weights, m.original_weight.detach() if m.folded is None
                   else m.original_weight.detach().float() * m.folded, m.weight.detach(),
                   None if m.weight_scale is None or m.weight_zero_point is None
                   else (m.weight_scale, m.weight_zero_point), m.algorithm) for n, m in quantized]


def check_savable(scheme: Scheme, algorithm: str = "max", options: Mapping[str, Any] | None = None) -> None:
    """Raise UsageError, before any calibration, when ``save_quantized`` could not store a model that
    ``quantize_model(model, scheme, algorithm=algorithm, options=options)`` makes: an unsupported
    compressed-tensors format, SmoothQuant or AWQ without ``fold`` (per-input-channel factors left in the layers),
    or GPTQ with MX / NVFP4 weights (float32 scales)."""
    if algorithm in ("smoothquant", "awq") and not (options or {}).get("fold"):
        raise UsageError(f"a model quantized with algorithm {algorithm!r} keeps per-input-channel factors in its "
                         "layers, which compressed-tensors checkpoints have no place for: fold them into the norms "
                         "with options={'fold': True} (CLI: --option fold=true), or use algorithm 'gptq' or 'max'")
    for g in scheme.config_groups:
        fmt = _group_format(g)
        if fmt not in _SUPPORTED:
            raise UsageError(f"config group {g.name!r} needs the compressed-tensors format {fmt!r}, which is not "
                             f"supported yet; supported: {', '.join(_SUPPORTED)}")
        if algorithm == "gptq" and fmt in _NARROW and g.weights is not None:
            raise UsageError(f"config group {g.name!r}: GPTQ's float32 scales cannot be stored as {fmt} (its scales "
                             "are e8m0 / e4m3); use algorithm 'max' for a checkpoint")


def save_quantized(model: nn.Module, scheme: Scheme, path: str | os.PathLike[str]) -> None:
    """Write ``model`` quantized with ``scheme`` to the folder ``path``: ``model.safetensors`` (packed codes and
    scales, the compressed-tensors names of the module docstring; other tensors as they are) and ``config.json``
    (``quantization_config``, plus ``model.config.to_dict()`` when the model has one).  ``model`` is either a
    float model (the layers ``plan(model, scheme)`` selects are quantized) or one that ``quantize_model(model,
    scheme)`` converted (its ``QuantizedLinear`` layers are stored; their ``input_scale`` as is).  The folder is
    written next to ``path`` and renamed into place; an existing ``path`` is replaced."""
    from safetensors.torch import save_file

    from ._plan import fake_quantize_weight

    layers = _layers(model, scheme)
    qc = to_compressed_tensors_config(scheme)
    fmts = {g.name: _group_format(g) for g in scheme.config_groups}
    for e in layers:
        if fmts[e.group] not in _SUPPORTED:
            raise UsageError(f"save_quantized: module {e.name!r} (config group {e.group!r}) needs the "
                             f"compressed-tensors format {fmts[e.group]!r}, which is not supported yet; supported: "
                             f"{', '.join(_SUPPORTED)}")
    state = {k: v.detach() for k, v in model.state_dict().items()}
    tensors: dict[str, torch.Tensor] = {}
    done: dict[str, str] = {}
    tensor_scales: dict[str, str] = {}
    for e in layers:
        w = state.pop(f"{e.name}.weight")
        if e.weights is None:
            tensors[f"{e.name}.weight"] = w
            continue
        if e.qparams is not None:
            assert e.current is not None
            stored = _compress(e.current, e.weights, fmts[e.group], e.name, e.qparams)
            back = _decompress(e.name, {f"{e.name}.{k}": v for k, v in stored.items()}, e.weights, fmts[e.group],
                               "save_quantized")
            if not torch.equal(back.to(e.current.dtype), e.current):
                raise UsageError(f"save_quantized: layer {e.name!r}: its weight is not on the grid of its "
                                 f"{e.algorithm} weight_scale / weight_zero_point: it was changed after "
                                 "quantize_model; quantize the model again")
        elif e.current is not None and not torch.equal(
                fake_quantize_weight(e.original, e.weights).to(e.current.dtype), e.current):
            if e.algorithm == "awq":
                raise UsageError(f"save_quantized: layer {e.name!r} was quantized by AWQ without activation "
                                 "quantization: its weight Q(W diag(s)) diag(s)^-1 carries per-input-channel "
                                 "factors s that compressed-tensors formats cannot store; use algorithm='gptq' or "
                                 "'max' for a checkpoint, or quantize the activations too (then s is a 'smooth' "
                                 "buffer to fold into the previous layer)")
            raise UsageError(f"save_quantized: layer {e.name!r}: its weight is no longer fake_quantize_weight("
                             "original_weight): it was changed after quantize_model; quantize the model again")
        else:
            stored = _compress(e.original, e.weights, fmts[e.group], e.name)
        for key, t in stored.items():
            if key == "_tensor_scale":
                tensor_scales[e.name] = float(t).hex()
            else:
                tensors[f"{e.name}.{key}"] = t
        done[e.name] = e.group
    for key, t in state.items():
        tensors.setdefault(key, t)
    tensors = {k: v.contiguous().cpu().clone() for k, v in tensors.items()}  # no shared storage (tied weights)
    meta = {"format": "pt", _META_GROUPS: json.dumps(done)}
    if tensor_scales:
        meta[_META_TENSOR_SCALES] = json.dumps(tensor_scales)
    config: dict[str, Any] = {}
    mc = getattr(model, "config", None)
    if mc is not None and callable(getattr(mc, "to_dict", None)):
        config.update(json.loads(json.dumps(mc.to_dict(), default=str)))
    config["quantization_config"] = qc
    config["lowprec_scheme_name"] = scheme.name

    dest = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(dest))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".lowprec-save-", dir=parent)
    try:
        save_file(tensors, os.path.join(tmp, _WEIGHTS_FILE), metadata=meta)
        with open(os.path.join(tmp, _CONFIG_FILE), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        if os.path.isdir(dest):
            old = dest + ".lowprec-old"
            os.replace(dest, old)
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _target_matches(target: str, name: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return fnmatch.fnmatchcase(name, target)


def _group_of(layer: str, scheme: Scheme, assigned: Mapping[str, str]) -> ConfigGroup:
    by_name = {g.name: g for g in scheme.config_groups}
    if layer in assigned and assigned[layer] in by_name:
        return by_name[assigned[layer]]
    if len(scheme.config_groups) == 1:
        return scheme.config_groups[0]
    for g in scheme.config_groups:
        if any(_target_matches(t, layer) for t in g.targets):
            return g
    class_groups = [g for g in scheme.config_groups if any("." not in t and "*" not in t for t in g.targets)]
    if len(class_groups) == 1:
        return class_groups[0]
    raise UsageError(f"quantized layer {layer!r}: cannot tell which config group applies (groups "
                     f"{', '.join(by_name)}); the checkpoint lacks lowprec's layer-to-group metadata")


def _expect(tensors: Mapping[str, torch.Tensor], key: str, file: str, dtype: torch.dtype | None,
            shape: tuple[int, ...] | None) -> torch.Tensor:
    if key not in tensors:
        raise UsageError(f"{file}: tensor {key!r} is missing (its layer is quantized per quantization_config)")
    t = tensors[key]
    if dtype is not None and t.dtype != dtype:
        raise UsageError(f"{file}: tensor {key!r} has dtype {t.dtype}, expected {dtype}")
    if shape is not None and tuple(t.shape) != shape:
        raise UsageError(f"{file}: tensor {key!r} has shape {list(t.shape)}, expected {list(shape)}")
    return t


def _decompress_narrow(layer: str, tensors: Mapping[str, torch.Tensor], ts: TensorScheme, fmt: str, file: str,
                       tensor_scale: str | None) -> torch.Tensor:
    """MX / NVFP4 (module docstring): lowprec's dequantization ``codes * scale`` (NVFP4: ``scale * s_t`` with the
    metadata's ``s_t``; without it compressed-tensors' ``scale / weight_global_scale``), float32."""
    from ..quant import _codec
    from ._plan import check_fit

    elem, scale_fmt, group = _NARROW[fmt]
    nv = fmt.startswith("nvfp4")
    strategy = "tensor_group" if nv else "group"
    if (ts.format, ts.scale_format, ts.group_size, ts.granularity) != (elem, scale_fmt, group, strategy):
        raise UsageError(f"{file}: layer {layer!r}: format {fmt!r} needs {elem} weights, strategy {strategy!r} in "
                         f"groups of {group} with {scale_fmt} scales (quantization_config weights: num_bits, type, "
                         f"strategy, group_size, scale_dtype); the config says {ts.format}, {ts.granularity!r}, "
                         f"group_size={ts.group_size}, {ts.scale_format} scales")
    if elem == "float8_e4m3fn":
        q = _expect(tensors, f"{layer}.weight", file, torch.float8_e4m3fn, None)
        if q.dim() != 2:
            raise UsageError(f"{file}: tensor {layer}.weight must be 2-D [N, K]; got shape {list(q.shape)}")
        n, k = q.shape
        values = q.float()
    else:
        packed = _expect(tensors, f"{layer}.weight_packed", file, torch.uint8, None)
        if packed.dim() != 2:
            raise UsageError(f"{file}: tensor {layer}.weight_packed must be 2-D [N, K/2] (two e2m1 codes a byte); "
                             f"got shape {list(packed.shape)}")
        n, k = packed.shape[0], 2 * packed.shape[1]
        values = _codec.decode(packed, formats.get(elem), k)
    try:
        check_fit(ts, (n, k), module=layer)
    except UsageError as e:
        raise UsageError(f"{file}: {e}") from None
    sshape = (n, k // group)
    if nv:
        scale = _expect(tensors, f"{layer}.weight_scale", file, torch.float8_e4m3fn, sshape).float()
        if bool(torch.isnan(scale).any()) or bool((scale < 0).any()):
            raise UsageError(f"{file}: tensor {layer}.weight_scale has NaN or negative e4m3 group scales; every "
                             "group scale must be >= 0 (re-save the checkpoint)")
        gs = _expect(tensors, f"{layer}.weight_global_scale", file, torch.float32, (1,))
        if not (bool(torch.isfinite(gs).all()) and float(gs) > 0):
            raise UsageError(f"{file}: tensor {layer}.weight_global_scale is {float(gs)!r}; it must be finite and "
                             "positive (compressed-tensors' 6 * 448 / amax of the weight): re-save the checkpoint")
        if tensor_scale is None:
            eff = scale / gs  # compressed-tensors' order
        else:
            try:
                s_t = float.fromhex(tensor_scale)
            except (TypeError, ValueError):
                raise UsageError(f"{file}: metadata {_META_TENSOR_SCALES!r} for layer {layer!r} is {tensor_scale!r},"
                                 " not a hex float") from None
            t = torch.tensor(s_t, dtype=torch.float32)
            if not (math.isfinite(s_t) and s_t > 0) or float(t) != s_t or abs(float(t) * float(gs) - 1) > 2.0**-17:
                raise UsageError(f"{file}: layer {layer!r}: lowprec's tensor scale {tensor_scale} (metadata "
                                 f"{_META_TENSOR_SCALES!r}) does not match {layer}.weight_global_scale {float(gs)!r} "
                                 "(they must be reciprocals): the tensor was edited after saving; re-save the "
                                 "checkpoint, or drop the metadata to use weight_global_scale alone")
            eff = scale * t  # lowprec's order: bit for bit fake_quantize_weight
    else:
        byte = _expect(tensors, f"{layer}.weight_scale", file, torch.uint8, sshape)
        if bool((byte == 255).any()):
            raise UsageError(f"{file}: tensor {layer}.weight_scale holds 255, E8M0's NaN; MX scales are biased "
                             "exponents 0..254 (2^(byte - 127)): re-save the checkpoint")
        eff = byte.view(torch.float8_e8m0fnu).float()
    g = _groups(values, ts)
    return (g * eff.reshape(n, 1, k // group, 1)).reshape(n, k)


def _decompress(layer: str, tensors: Mapping[str, torch.Tensor], ts: TensorScheme, fmt: str,
                file: str, tensor_scale: str | None = None) -> torch.Tensor:
    if fmt in _NARROW:
        return _decompress_narrow(layer, tensors, ts, fmt, file, tensor_scale)
    bits = _BITS_TYPE[ts.format][0]
    if fmt == "pack-quantized":
        if not ts.is_int or bits not in (4, 8):
            raise UsageError(f"{file}: layer {layer!r}: pack-quantized needs 4- or 8-bit int weights; the config says "
                             f"{ts.format}")
        ws = _expect(tensors, f"{layer}.weight_shape", file, None, (2,))
        n, k = (int(x) for x in ws.tolist())
        packed = _expect(tensors, f"{layer}.weight_packed", file, torch.int32, None)
        want = (n, -(-k * bits // 32))
        if tuple(packed.shape) != want:
            raise UsageError(f"{file}: tensor {layer}.weight_packed has shape {list(packed.shape)} but "
                             f"{layer}.weight_shape {[n, k]} needs {list(want)} ({bits}-bit codes in int32 words)")
        q = _unpack(packed, bits, k)
    else:
        want_dtype = torch.int8 if ts.is_int else torch.float8_e4m3fn
        if (ts.is_int and bits != 8) or (not ts.is_int and ts.format != "float8_e4m3fn"):
            raise UsageError(f"{file}: layer {layer!r}: format {fmt!r} with {ts.format} weights is not supported")
        q = _expect(tensors, f"{layer}.weight", file, want_dtype, None)
        if q.dim() != 2:
            raise UsageError(f"{file}: tensor {layer}.weight must be 2-D; got shape {list(q.shape)}")
        n, k = q.shape
    from ._plan import check_fit

    try:
        check_fit(ts, (n, k), module=layer)
    except UsageError as e:
        raise UsageError(f"{file}: {e}") from None
    sshape = _scale_shape(ts, n, k)
    scale = _expect(tensors, f"{layer}.weight_scale", file, torch.float32, sshape)
    zp: torch.Tensor | float = 0.0
    if not ts.symmetric:
        if fmt == "pack-quantized" and ts.granularity in ("group", "channel"):
            zpp = _expect(tensors, f"{layer}.weight_zero_point", file, torch.int32,
                          (-(-sshape[0] * bits // 32), sshape[1]))
            zp = _unpack(zpp.t().contiguous(), bits, sshape[0]).t().float()
        else:
            zp = _expect(tensors, f"{layer}.weight_zero_point", file, torch.int8, sshape).float()
    s4 = scale.reshape(_groups(torch.empty(n, k), ts).shape[0], 1, -1, 1)
    z4 = zp.reshape(s4.shape) if isinstance(zp, torch.Tensor) else zp
    g = _groups(q.float(), ts)
    return ((g - z4) * s4).reshape(n, k)


def load_quantized(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], Scheme]:
    """Read a checkpoint folder (``save_quantized``'s, or compressed-tensors' for the supported formats): the state
    dict with every quantized weight dequantized (float32, ``fake_quantize_weight``'s values) and the
    ``Scheme`` of its ``quantization_config``.  Only JSON and safetensors are read; UsageError names the file
    and tensor of a missing, mis-shaped or mis-typed entry."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    folder = os.fspath(path)
    cfg_file = os.path.join(folder, _CONFIG_FILE)
    st_file = os.path.join(folder, _WEIGHTS_FILE)
    if not os.path.isfile(cfg_file):
        raise UsageError(f"{cfg_file}: no such file; a quantized checkpoint folder needs config.json with "
                         "quantization_config (save_quantized writes one)")
    try:
        with open(cfg_file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"{cfg_file}: not valid JSON: {e}") from None
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if qc is None:
        raise UsageError(f"{cfg_file}: has no quantization_config; this is not a compressed-tensors checkpoint")
    try:
        scheme = from_compressed_tensors_config(qc, name=str(config.get("lowprec_scheme_name", "compressed-tensors")))
    except UsageError as e:
        raise UsageError(f"{cfg_file}: {e}") from None
    top = qc.get("format")
    if not os.path.isfile(st_file):
        raise UsageError(f"{st_file}: no such file; the checkpoint's tensors must be in model.safetensors")
    try:
        tensors = load_file(st_file)
        with safe_open(st_file, framework="pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as e:
        raise UsageError(f"{st_file}: not a safetensors file ({e}); loading never unpickles") from None
    try:
        assigned = json.loads(meta.get(_META_GROUPS, "{}"))
    except ValueError:
        raise UsageError(f"{st_file}: metadata {_META_GROUPS!r} is not valid JSON") from None
    try:
        tensor_scales = json.loads(meta.get(_META_TENSOR_SCALES, "{}"))
    except ValueError:
        raise UsageError(f"{st_file}: metadata {_META_TENSOR_SCALES!r} is not valid JSON") from None
    if not isinstance(assigned, dict) or not isinstance(tensor_scales, dict):
        raise UsageError(f"{st_file}: metadata {_META_GROUPS!r} and {_META_TENSOR_SCALES!r} must be JSON objects")
    layers = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith((".weight_scale", ".weight_packed"))})
    layers += [str(x) for x in assigned if x not in layers]
    out = dict(tensors)
    for layer in layers:
        group = _group_of(layer, scheme, assigned)
        fmt = str(qc["config_groups"][group.name].get("format") or top)
        if fmt not in _SUPPORTED:
            raise UsageError(f"{cfg_file}: compressed-tensors format {fmt!r} (config group {group.name!r}) is not "
                             f"supported; supported: {', '.join(_SUPPORTED)}")
        if group.weights is None:
            continue
        out[f"{layer}.weight"] = _decompress(layer, tensors, group.weights, fmt, st_file, tensor_scales.get(layer))
        for key in ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_global_scale"):
            out.pop(f"{layer}.{key}", None)
    return out, scheme
