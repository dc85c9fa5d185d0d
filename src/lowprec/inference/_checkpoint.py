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

``weight_scale`` is float32: ``[1]`` per tensor, ``[N, 1]`` per channel, ``[N, K/g]`` per group, ``[N/a, K/b]``
per block; ``weight_zero_point`` int8 in the scale's shape (before packing).  Packing (``pack_to_int32``): codes
``q + 2^(b-1)`` (unsigned), element ``j`` of each run of ``32/b`` at bits ``[b*j, b*j + b)`` of one int32 word.
Every other tensor of the state dict is stored as is.  The codes are lowprec's own (``_affine``), so that
dequantizing them, ``(q - zero_point) * scale`` (compressed-tensors' ``dequantize``), is ``fake_quantize_weight``
bit for bit.  MX and NVFP4 are not written yet.

Loading reads only JSON and safetensors (``safetensors.torch.load_file``): nothing is unpickled.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .. import formats
from .._errors import UsageError
from ._scheme import ConfigGroup, Scheme, TensorScheme

_WEIGHTS_FILE = "model.safetensors"
_CONFIG_FILE = "config.json"
_META_GROUPS = "lowprec.config_groups"  # safetensors metadata: {layer name: config group name}
_BITS_TYPE = {"int8": (8, "int"), "int4": (4, "int"), "float8_e4m3fn": (8, "float"), "float4_e2m1fn": (4, "float")}
_FORMAT_OF = {v: k for k, v in _BITS_TYPE.items()}
_SCALE_DTYPE = {"float32": None, "float8_e8m0fnu": "torch.uint8", "float8_e4m3fn": "torch.float8_e4m3fn"}
_SCALE_FORMAT_OF = {"torch.uint8": "float8_e8m0fnu", "torch.float8_e4m3fn": "float8_e4m3fn"}
_SUPPORTED = ("int-quantized", "pack-quantized", "float-quantized", "naive-quantized")
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
    if g == "group":
        return (n, k // int(ts.group_size or 1))
    a, b = ts.block or (1, 1)
    return (n // a, k // b)


def quantize_weight(weight: torch.Tensor, ts: TensorScheme) -> dict[str, torch.Tensor]:
    """The unpacked stored form of one weight ``[N, K]``: ``weight`` (codes: int8, or float8_e4m3fn),
    ``weight_scale`` float32 and, for asymmetric schemes, ``weight_zero_point`` int8 (module docstring), such that
    ``(weight - weight_zero_point) * weight_scale`` is ``fake_quantize_weight(weight, ts)`` in float32."""
    from . import _affine
    from ._plan import check_fit

    ts.check_role("weights", "TensorScheme")
    check_fit(ts, tuple(weight.shape))
    if ts.scale_format != "float32" or ts.granularity == "tensor_group":
        raise UsageError(f"checkpoints with {ts.format} weights and {ts.scale_format} scales (MX / NVFP4) are not "
                         "supported yet; use an int8, int4 or float8_e4m3fn scheme with float32 scales")
    n, k = weight.shape
    g = _groups(weight.float(), ts)
    out: dict[str, torch.Tensor] = {}
    if ts.is_int:
        qmin, qmax = _affine.int_range(ts.format)
        scale, zp = _affine.int_qparams(weight, ts)
        q = torch.clamp(torch.round(g * (1.0 / scale)) + zp, qmin, qmax)
        out["weight"] = q.reshape(n, k).to(torch.int8)
        if not ts.symmetric:
            out["weight_zero_point"] = zp.reshape(_scale_shape(ts, n, k)).to(torch.int8)
    else:
        from ..quant import quantize

        if ts.format != "float8_e4m3fn":
            raise UsageError(f"checkpoints with {ts.format} weights are not supported yet; use float8_e4m3fn")
        fmt = formats.get(ts.format)
        scale = torch.clamp(g.abs().amax(dim=(1, 3), keepdim=True) / fmt.max, min=_TINY)
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


def _compress(weight: torch.Tensor, ts: TensorScheme, fmt: str) -> dict[str, torch.Tensor]:
    t = quantize_weight(weight, ts)
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
def save_quantized(model: nn.Module, scheme: Scheme, path: str | os.PathLike[str]) -> None:
    """Write ``model`` quantized with ``scheme`` (``plan``) to the folder ``path``: ``model.safetensors`` (packed
    codes and scales, the compressed-tensors names of the module docstring; other tensors as they are) and
    ``config.json`` (``quantization_config``, plus ``model.config.to_dict()`` when the model has one).  The folder
    is written next to ``path`` and renamed into place; an existing ``path`` is replaced."""
    from safetensors.torch import save_file

    from ._plan import plan

    entries = plan(model, scheme)
    qc = to_compressed_tensors_config(scheme)
    fmts = {g.name: _group_format(g) for g in scheme.config_groups}
    for e in entries:
        if fmts[e.group] not in _SUPPORTED:
            raise UsageError(f"save_quantized: module {e.name!r} (config group {e.group!r}) needs the "
                             f"compressed-tensors format {fmts[e.group]!r}, which is not supported yet; supported: "
                             f"{', '.join(_SUPPORTED)} (int8 / int4 / float8_e4m3fn weights with float32 scales)")
    state = {k: v.detach() for k, v in model.state_dict().items()}
    tensors: dict[str, torch.Tensor] = {}
    done: dict[str, str] = {}
    for e in entries:
        w = state.pop(f"{e.name}.weight")
        if e.weights is None:
            tensors[f"{e.name}.weight"] = w
            continue
        for key, t in _compress(w, e.weights, fmts[e.group]).items():
            tensors[f"{e.name}.{key}"] = t
        done[e.name] = e.group
    for key, t in state.items():
        tensors.setdefault(key, t)
    tensors = {k: v.contiguous().cpu().clone() for k, v in tensors.items()}  # no shared storage (tied weights)
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
        save_file(tensors, os.path.join(tmp, _WEIGHTS_FILE), metadata={"format": "pt", _META_GROUPS: json.dumps(done)})
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


def _decompress(layer: str, tensors: Mapping[str, torch.Tensor], ts: TensorScheme, fmt: str,
                file: str) -> torch.Tensor:
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
        out[f"{layer}.weight"] = _decompress(layer, tensors, group.weights, fmt, st_file)
        for key in ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point"):
            out.pop(f"{layer}.{key}", None)
    return out, scheme
