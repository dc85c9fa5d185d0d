"""Quantized checkpoints in the compressed-tensors layout, checked against compressed-tensors 0.20.1 itself: its
``QuantizationConfig`` validates the saved ``quantization_config``, and its per-format compressor
(``BaseCompressor.get_value_from_registry(format).decompress``, what ``ModelCompressor.decompress_model`` runs per
module) turns the saved tensors back into exactly ``lowprec.inference.fake_quantize_weight``'s weights.

compressed-tensors 0.20.1 returns MX and NVFP4 weights in bfloat16: MX values are exact there (compared in float32
too); NVFP4's ``codes * (s / global_scale)`` is rounded to bfloat16, so it is compared with bfloat16 weights
(a bfloat16 model's ``QuantizedLinear.weight``) and, before that rounding, within one float32 ulp."""

from __future__ import annotations

import json
import os
import pickle
from typing import Any

import pytest
import torch
from torch import nn

from lowprec import inference as I
from lowprec._errors import UsageError

ct_q = pytest.importorskip("compressed_tensors.quantization")
ct_comp = pytest.importorskip("compressed_tensors.compressors")
safetensors_torch = pytest.importorskip("safetensors.torch")

SUPPORTED = ["w8a8-int8", "w4a16-int4", "w4a16-int4-asym", "fp8-static", "fp8-dynamic", "fp8-block", "mxfp8",
             "mxfp4", "nvfp4"]
FORMAT = {"w8a8-int8": "int-quantized", "w4a16-int4": "pack-quantized", "w4a16-int4-asym": "pack-quantized",
          "fp8-static": "float-quantized", "fp8-dynamic": "float-quantized", "fp8-block": "float-quantized",
          "mxfp8": "mxfp8-quantized", "mxfp4": "mxfp4-pack-quantized", "nvfp4": "nvfp4-pack-quantized"}
NARROW = ["mxfp8", "mxfp4", "nvfp4"]


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(256, 384)
        self.fc2 = nn.Linear(384, 256, bias=False)
        self.norm = nn.LayerNorm(256)
        self.lm_head = nn.Linear(256, 64)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    m = MLP()
    with torch.no_grad():
        m.fc1.weight[3] = 0.0  # an all-zero row
        m.fc1.weight[5] = m.fc1.weight[5].abs()  # no negative values: asymmetric zero point at qmin
    return m


def _llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False)
    torch.manual_seed(1)
    return transformers.LlamaForCausalLM(cfg)


@pytest.fixture(autouse=True)
def _no_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a: Any, **k: Any) -> Any:
        raise AssertionError("something unpickled")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)


def _expected(model: nn.Module, scheme: I.Scheme) -> dict[str, torch.Tensor]:
    return {f"{e.name}.weight": I.fake_quantize_weight(e.module.weight.detach(), e.weights)
            for e in I.plan(model, scheme) if e.weights is not None}


def _ct_decompress(path: str, qc: Any) -> dict[str, torch.Tensor]:
    """compressed-tensors' own decompression of every quantized layer of the saved checkpoint."""
    tensors = safetensors_torch.load_file(os.path.join(path, "model.safetensors"))
    layers = {k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_scale")}
    out = {}
    for layer in layers:
        local = {k[len(layer) + 1:]: v for k, v in tensors.items()
                 if k.rsplit(".", 1)[0] == layer  # the activations' scales are not the weight's
                 and not k.endswith((".input_scale", ".input_global_scale"))}
        scheme = qc.config_groups["group_0"]
        comp = ct_comp.BaseCompressor.get_value_from_registry(scheme.format or qc.format)
        assert set(local) == set(comp.compression_param_names(scheme)) | {"bias"} & set(local), layer
        out[f"{layer}.weight"] = comp.decompress(local, scheme)["weight"]
    return out


@pytest.mark.parametrize("model_fn", [_mlp, _llama], ids=["mlp", "llama"])
@pytest.mark.parametrize("name", SUPPORTED)
def test_round_trip_bit_for_bit(tmp_path: Any, name: str, model_fn: Any) -> None:
    model = model_fn()
    scheme = I.get(name)
    path = str(tmp_path / "ckpt")
    I.save_quantized(model, scheme, path)
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors"]
    assert not [p for p in os.listdir(tmp_path) if p != "ckpt"]  # the temporary folder was renamed
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    qd = config["quantization_config"]
    assert qd["quant_method"] == "compressed-tensors" and qd["format"] == FORMAT[name]
    qc = ct_q.QuantizationConfig.model_validate(qd)  # (c) compressed-tensors accepts the config
    assert qc.ignore == ["lm_head"] and qc.format == FORMAT[name]
    if model_fn is _llama:
        assert config["model_type"] == "llama" and config["hidden_size"] == 128

    want = _expected(model, scheme)
    assert len(want) == (2 if model_fn is _mlp else 7)
    theirs = _ct_decompress(path, qc)  # (a) compressed-tensors' decompression
    assert set(theirs) == set(want)
    for k, w in want.items():
        got = theirs[k]
        if name in NARROW:  # compressed-tensors decompresses MX / NVFP4 to bfloat16
            assert got.dtype == torch.bfloat16
            if name != "nvfp4":
                got = got.float()  # MX values are exact in bfloat16
            w = w.to(got.dtype)
        assert torch.equal(got, w), f"{name} {k}: {(got != w).sum().item()} elements differ"

    state, back = I.load_quantized(path)  # (b) lowprec's loader
    assert back == scheme
    full = model.state_dict()
    assert set(state) == set(full)
    for k, v in state.items():
        assert torch.equal(v, want.get(k, full[k])), k

    # real low-bit storage
    t = safetensors_torch.load_file(os.path.join(path, "model.safetensors"))
    key = "fc1" if model_fn is _mlp else "model.layers.0.mlp.up_proj"
    if FORMAT[name] == "pack-quantized":
        assert t[f"{key}.weight_packed"].dtype == torch.int32 and f"{key}.weight" not in t
        assert t[f"{key}.weight_packed"].numel() * 8 == t[f"{key}.weight_shape"].prod()
        assert (f"{key}.weight_zero_point" in t) == (name == "w4a16-int4-asym")
    elif name in NARROW:
        n, k = (384, 256) if model_fn is _mlp else (256, 128)
        if name == "mxfp8":
            assert t[f"{key}.weight"].dtype == torch.float8_e4m3fn and t[f"{key}.weight"].shape == (n, k)
        else:
            assert t[f"{key}.weight_packed"].dtype == torch.uint8 and t[f"{key}.weight_packed"].shape == (n, k // 2)
        group, sdt = (16, torch.float8_e4m3fn) if name == "nvfp4" else (32, torch.uint8)
        assert t[f"{key}.weight_scale"].dtype == sdt and t[f"{key}.weight_scale"].shape == (n, k // group)
        assert (f"{key}.weight_global_scale" in t) == (name == "nvfp4")
    else:
        assert t[f"{key}.weight"].dtype == (torch.int8 if name == "w8a8-int8" else torch.float8_e4m3fn)
    assert t["lm_head.weight"].dtype == torch.float32


def test_int4_packing_matches_compressed_tensors() -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from lowprec.inference import _checkpoint as C

    g = torch.Generator().manual_seed(0)
    for bits, cols in ((4, 40), (4, 128), (8, 12)):
        q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (6, cols), generator=g, dtype=torch.int8)
        ref = pack_to_int32(q, bits)
        assert torch.equal(C._pack(q, bits), ref)
        assert torch.equal(C._unpack(ref, bits, cols), q)
        assert torch.equal(C._pack(q.t().contiguous(), bits).t(), pack_to_int32(q, bits, packed_dim=0))


@pytest.mark.parametrize("name", I.names())
def test_config_validates_for_every_preset(name: str) -> None:
    d = I.to_compressed_tensors_config(I.get(name))
    qc = ct_q.QuantizationConfig.model_validate(d)
    assert qc.quant_method == "compressed-tensors" and list(qc.config_groups) == ["group_0"]
    assert I.from_compressed_tensors_config(d, name=name) == I.get(name)


def _saved(tmp_path: Any, name: str = "w4a16-int4-asym") -> tuple[str, dict[str, torch.Tensor]]:
    path = str(tmp_path / "ckpt")
    I.save_quantized(_mlp(), I.get(name), path)
    return path, safetensors_torch.load_file(os.path.join(path, "model.safetensors"))


def _rewrite(path: str, tensors: dict[str, torch.Tensor]) -> None:
    safetensors_torch.save_file(tensors, os.path.join(path, "model.safetensors"))


def _nan_global(t: dict[str, torch.Tensor]) -> None:
    t["fc1.weight_global_scale"] = torch.tensor([float("nan")])


# (preset, edit of the saved tensors, the error's regex)
MALFORMED = [
    ("w4a16-int4-asym", lambda t: t.pop("fc2.weight_scale"),
     r"model\.safetensors: tensor 'fc2\.weight_scale' is missing"),
    ("w4a16-int4-asym", lambda t: t.pop("fc1.weight_packed"), r"'fc1\.weight_packed' is missing"),
    ("w4a16-int4-asym", lambda t: t.update({"fc1.weight_shape": torch.tensor([384, 512])}),
     r"fc1\.weight_packed has shape \[384, 32\] but fc1\.weight_shape"),
    ("w8a8-int8", lambda t: t.update({"fc1.weight": t["fc1.weight"].float()}),
     r"'fc1\.weight' has dtype torch\.float32, expected torch\.int8"),
    ("fp8-dynamic", lambda t: t.update({"fc1.weight_scale": t["fc1.weight_scale"][:10]}),
     r"'fc1\.weight_scale' has shape \[10, 1\], expected \[384, 1\]"),
    ("mxfp8", lambda t: t.pop("fc1.weight"), r"'fc1\.weight' is missing"),
    ("mxfp8", lambda t: t.update({"fc1.weight_scale": t["fc1.weight_scale"].float()}),
     r"'fc1\.weight_scale' has dtype torch\.float32, expected torch\.uint8"),
    ("mxfp8", lambda t: t.update({"fc1.weight": t["fc1.weight"].float()}),
     r"'fc1\.weight' has dtype torch\.float32, expected torch\.float8_e4m3fn"),
    ("mxfp4", lambda t: t.update({"fc2.weight_scale": t["fc2.weight_scale"][:, :6].contiguous()}),
     r"'fc2\.weight_scale' has shape \[256, 6\], expected \[256, 12\]"),
    ("mxfp4", lambda t: t["fc1.weight_scale"].__setitem__((0, 0), 255), r"fc1\.weight_scale holds 255, E8M0's NaN"),
    ("mxfp4", lambda t: t.update({"fc1.weight_packed": t["fc1.weight_packed"].view(torch.int8)}),
     r"'fc1\.weight_packed' has dtype torch\.int8, expected torch\.uint8"),
    ("nvfp4", lambda t: t.pop("fc1.weight_global_scale"), r"'fc1\.weight_global_scale' is missing"),
    ("nvfp4", lambda t: t.update({"fc1.weight_global_scale": t["fc1.weight_global_scale"].reshape(())}),
     r"'fc1\.weight_global_scale' has shape \[\], expected \[1\]"),
    ("nvfp4", lambda t: t.update({"fc1.weight_global_scale": t["fc1.weight_global_scale"].double()}),
     r"'fc1\.weight_global_scale' has dtype torch\.float64, expected torch\.float32"),
    ("nvfp4", lambda t: t.update({"fc1.weight_global_scale": torch.zeros(1)}),
     r"fc1\.weight_global_scale is 0\.0; it must be finite and positive"),
    ("nvfp4", lambda t: t.update({"fc1.weight_global_scale": -t["fc1.weight_global_scale"]}),
     r"fc1\.weight_global_scale is -.*must be finite and positive"),
    ("nvfp4", lambda t: t.update({"fc1.weight_global_scale": torch.tensor([float("inf")])}),
     r"fc1\.weight_global_scale is inf"),
    ("nvfp4", _nan_global, r"fc1\.weight_global_scale is nan"),
    ("nvfp4", lambda t: t.update({"fc1.weight_global_scale": t["fc1.weight_global_scale"] * 2}),
     r"layer 'fc1': lowprec's tensor scale .* does not match fc1\.weight_global_scale"),
    ("nvfp4", lambda t: t.update({"fc1.weight_scale": t["fc1.weight_scale"].float()}),
     r"'fc1\.weight_scale' has dtype torch\.float32, expected torch\.float8_e4m3fn"),
    ("nvfp4", lambda t: t.update({"fc1.weight_scale": (-t["fc1.weight_scale"].float()).to(torch.float8_e4m3fn)}),
     r"fc1\.weight_scale has NaN or negative e4m3 group scales"),
    ("nvfp4", lambda t: t.update({"fc1.weight_packed": t["fc1.weight_packed"][:, :64].contiguous()}),
     r"'fc1\.weight_scale' has shape \[384, 16\], expected \[384, 8\]"),
]


@pytest.mark.parametrize(("name", "edit", "match"), MALFORMED,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(MALFORMED)])
def test_malformed_tensors(tmp_path: Any, name: str, edit: Any, match: str) -> None:
    path, t = _saved(tmp_path, name)
    edit(t)
    # the lowprec metadata (layer groups, NVFP4 tensor scales) is kept, as an edit in place would
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        meta = f.metadata()
    safetensors_torch.save_file(t, os.path.join(path, "model.safetensors"), metadata=meta)
    with pytest.raises(UsageError, match=match):
        I.load_quantized(path)


def test_config_errors(tmp_path: Any) -> None:
    path, _ = _saved(tmp_path)
    cfg_file = os.path.join(path, "config.json")
    with open(cfg_file) as f:
        config = json.load(f)
    with open(cfg_file, "w") as f:
        json.dump({"model_type": "mlp"}, f)
    with pytest.raises(UsageError, match=r"config\.json: has no quantization_config"):
        I.load_quantized(path)
    config["quantization_config"]["format"] = "marlin-24"
    del config["quantization_config"]["config_groups"]["group_0"]["format"]
    with open(cfg_file, "w") as f:
        json.dump(config, f)
    with pytest.raises(UsageError, match=r"format 'marlin-24'.*not supported"):
        I.load_quantized(path)
    os.remove(cfg_file)
    with pytest.raises(UsageError, match=r"config\.json: no such file"):
        I.load_quantized(path)


def test_pickle_file_refused(tmp_path: Any) -> None:
    path, t = _saved(tmp_path)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        pickle.dump({"fc1.weight": [1.0, 2.0]}, f)
    with pytest.raises(UsageError, match=r"model\.safetensors: not a safetensors file"):
        I.load_quantized(path)


def test_overwrite_is_atomic_replace(tmp_path: Any) -> None:
    path, _ = _saved(tmp_path, "fp8-static")
    I.save_quantized(_mlp(), I.get("w8a8-int8"), path)
    _, scheme = I.load_quantized(path)
    assert scheme.name == "w8a8-int8" and sorted(os.listdir(tmp_path)) == ["ckpt"]


# ---------------------------------------------------------------------------------------------- MX / NVFP4
def _nvfp4a16() -> I.Scheme:
    """NVFP4 weights only (compressed-tensors' NVFP4A16), so that a converted model needs no calibration (the
    full preset's calibrated activations are tests/test_inference_local.py's)."""
    import dataclasses

    base = I.get("nvfp4")
    return dataclasses.replace(base, name="nvfp4a16",
                               config_groups=(dataclasses.replace(base.config_groups[0], input_activations=None),))


NARROW_SCHEMES = {"mxfp8": lambda: I.get("mxfp8"), "mxfp4": lambda: I.get("mxfp4"), "nvfp4a16": _nvfp4a16}


def _inputs(model: nn.Module) -> Any:
    if isinstance(model, MLP):
        return torch.randn(4, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(2))


def _run(model: nn.Module, x: Any) -> torch.Tensor:
    if isinstance(model, MLP):
        return model.lm_head(model.norm(model.fc2(torch.relu(model.fc1(x)))))
    return model(input_ids=x).logits


@pytest.mark.parametrize("model_fn", [_mlp, _llama], ids=["mlp", "llama"])
@pytest.mark.parametrize("name", list(NARROW_SCHEMES))
def test_quantized_model_round_trip(tmp_path: Any, name: str, model_fn: Any) -> None:
    """A bfloat16 model converted by quantize_model: compressed-tensors' decompression of the checkpoint is every
    QuantizedLinear.weight bit for bit, and a fresh model loaded from load_quantized gives the same outputs."""
    scheme = NARROW_SCHEMES[name]()
    model = I.quantize_model(model_fn().to(torch.bfloat16), scheme)
    path = str(tmp_path / "ckpt")
    I.save_quantized(model, scheme, path)
    with open(os.path.join(path, "config.json")) as f:
        qc = ct_q.QuantizationConfig.model_validate(json.load(f)["quantization_config"])
    layers = {n: m for n, m in model.named_modules() if isinstance(m, I.QuantizedLinear)}
    theirs = _ct_decompress(path, qc)
    assert set(theirs) == {f"{n}.weight" for n in layers}
    for n, m in layers.items():
        assert m.weight.dtype == torch.bfloat16
        assert torch.equal(theirs[f"{n}.weight"], m.weight), n

    state, back = I.load_quantized(path)
    assert back == scheme
    fresh = model_fn().to(torch.bfloat16)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    I.quantize_model(fresh, scheme)
    fresh.load_state_dict(state, strict=True)
    x = _inputs(model)
    with torch.no_grad():
        assert torch.equal(_run(fresh, x), _run(model, x))


def test_nvfp4_float32_within_one_ulp_of_compressed_tensors(tmp_path: Any) -> None:
    """compressed-tensors' NVFP4 ``dequantize`` in float32 (before its bfloat16 cast) is ``codes * (s / g)``;
    lowprec's is ``codes * (s * s_t)``.  The stored codes and e4m3 scales are lowprec's (equal exactly), and the
    chosen ``g`` keeps every element within one float32 ulp; where no float32 ``g`` satisfies ``s / g == s *
    s_t`` for all of a layer's group scales some elements differ by that ulp."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    from lowprec.quant import quantize_scaled

    model = _mlp()
    scheme = I.get("nvfp4")
    path = str(tmp_path / "ckpt")
    I.save_quantized(model, scheme, path)
    t = safetensors_torch.load_file(os.path.join(path, "model.safetensors"))
    args = ct_q.QuantizationConfig.model_validate(I.to_compressed_tensors_config(scheme)).config_groups["group_0"]
    ts = scheme.config_groups[0].weights
    assert ts is not None
    for layer in ("fc1", "fc2"):
        w = getattr(model, layer).weight.detach()
        codes, scales = quantize_scaled(w, ts.quant_spec())
        assert torch.equal(t[f"{layer}.weight_packed"], codes)
        assert torch.equal(t[f"{layer}.weight_scale"].view(torch.uint8), scales.group.view(torch.uint8))
        gs = t[f"{layer}.weight_global_scale"]
        assert abs(float(gs) * float(scales.tensor) - 1) < 2.0**-19
        n, k2 = codes.shape
        q = unpack_fp4_from_uint8(codes, n, 2 * k2, dtype=torch.float32)
        ref = dequantize(q, t[f"{layer}.weight_scale"].float(), args=args.weights, global_scale=gs,
                         dtype=torch.float32)
        want = I.fake_quantize_weight(w, ts)
        ulps = (ref.view(torch.int32).long() - want.view(torch.int32).long()).abs()
        assert ulps.max().item() <= 1, layer


def test_fp4_packing_matches_compressed_tensors(tmp_path: Any) -> None:
    """Nibble order and e2m1 codes: compressed-tensors' pack_fp4_to_uint8 of the unpacked values gives back the
    stored bytes (element 2i in the low nibble, sign in bit 3)."""
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8

    path, t = _saved(tmp_path, "mxfp4")
    packed = t["fc1.weight_packed"]
    values = unpack_fp4_from_uint8(packed, packed.shape[0], 2 * packed.shape[1], dtype=torch.float32)
    assert torch.equal(pack_fp4_to_uint8(values), packed)
    assert len(torch.unique(packed & 0x0F)) > 8  # both signs of most magnitudes occur


def test_nvfp4_without_lowprec_metadata_dequantizes_as_compressed_tensors(tmp_path: Any) -> None:
    """A checkpoint without lowprec's tensor-scale metadata (llm-compressor's) is dequantized with
    compressed-tensors' ``codes * (s / g)`` in float32."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    path, t = _saved(tmp_path, "nvfp4")
    safetensors_torch.save_file(t, os.path.join(path, "model.safetensors"))  # no metadata
    state, _ = I.load_quantized(path)
    for layer in ("fc1", "fc2"):
        p = t[f"{layer}.weight_packed"]
        q = unpack_fp4_from_uint8(p, p.shape[0], 2 * p.shape[1], dtype=torch.float32)
        s = (t[f"{layer}.weight_scale"].float() / t[f"{layer}.weight_global_scale"]).repeat_interleave(16, dim=1)
        assert torch.equal(state[f"{layer}.weight"], q * s)


class _Smoothed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.lm_head = nn.Linear(32, 8)
        self.fc.register_buffer("smooth", torch.ones(32))


def test_save_errors(tmp_path: Any) -> None:
    dest = str(tmp_path / "x")
    with pytest.raises(UsageError, match=r"module 'fc' has a per-input-channel 'smooth'.*options=\{'fold': True\} "
                                         r"to fold the factors into the norms"):
        I.save_quantized(_Smoothed(), I.get("mxfp8"), dest)
    m = _mlp()
    with torch.no_grad():
        m.fc2.weight[0, 0] = float("nan")
    with pytest.raises(UsageError, match=r"layer 'fc2': the weight has NaN or inf"):
        I.save_quantized(m, I.get("nvfp4"), dest)
    q = I.quantize_model(_mlp(), I.get("mxfp4"))
    with pytest.raises(UsageError, match=r"layer 'fc1' was quantized with config group 'group_0'.*pass the scheme"):
        I.save_quantized(q, I.get("mxfp8"), dest)
    q.lm_head = I.QuantizedLinear(nn.Linear(256, 64), name="lm_head", group="group_0",
                                  weights=I.get("mxfp4").config_groups[0].weights,
                                  input_activations=I.get("mxfp4").config_groups[0].input_activations)
    with pytest.raises(UsageError, match=r"layer 'lm_head' is a QuantizedLinear but scheme 'mxfp4' ignores it"):
        I.save_quantized(q, I.get("mxfp4"), dest)
    q.lm_head = nn.Linear(256, 64)
    q.extra = nn.Linear(4, 4)  # targeted by 'Linear', not converted
    with pytest.raises(UsageError, match=r"module 'extra' is an nn.Linear that scheme 'mxfp4' targets"):
        I.save_quantized(q, I.get("mxfp4"), dest)
    del q.extra
    with torch.no_grad():
        q.fc1.weight[0, 0] += 1.0
    with pytest.raises(UsageError, match=r"layer 'fc1': its weight is no longer fake_quantize_weight"):
        I.save_quantized(q, I.get("mxfp4"), dest)
    assert not os.listdir(tmp_path)


class _Forward(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run(self, x)


def _calibration(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(16, 256, generator=g) * torch.linspace(0.1, 3.0, 256)).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["w8a8-int8", "w4a16-int4", "w4a16-int4-asym", "fp8-static", "fp8-block"])
def test_gptq_model_round_trip(tmp_path: Any, name: str, dtype: torch.dtype) -> None:
    """A GPTQ-quantized model (weights on GPTQ's own scales, not fake_quantize_weight's): the checkpoint's codes
    and scales, decompressed by compressed-tensors, are every QuantizedLinear.weight bit for bit, and a fresh
    model loaded from load_quantized gives the same outputs."""
    torch.manual_seed(0)
    model = _Forward().to(dtype)
    scheme = I.get(name)
    I.quantize_model(model, scheme, _calibration(dtype), algorithm="gptq")
    layers = {n: m for n, m in model.named_modules() if isinstance(m, I.QuantizedLinear)}
    assert set(layers) == {"fc1", "fc2"}
    # the GPTQ path is exercised: its weights are not round-to-nearest's
    assert any(not torch.equal(m.weight, I.fake_quantize_weight(m.original_weight, m.weights).to(dtype))
               for m in layers.values())
    path = str(tmp_path / "ckpt")
    I.save_quantized(model, scheme, path)
    with open(os.path.join(path, "config.json")) as f:
        qc = ct_q.QuantizationConfig.model_validate(json.load(f)["quantization_config"])
    theirs = _ct_decompress(path, qc)
    assert set(theirs) == {f"{n}.weight" for n in layers}
    for n, m in layers.items():
        got = theirs[f"{n}.weight"]
        assert torch.equal(got.to(dtype), m.weight), f"{n}: {(got.to(dtype) != m.weight).sum().item()} differ"
        if dtype == torch.float32:
            assert got.dtype == torch.float32
    state, back = I.load_quantized(path)
    assert back == scheme
    fresh = _Forward().to(dtype)
    I.quantize_model(fresh, scheme, _calibration(dtype))
    fresh.load_state_dict({k: v if k.endswith("input_scale") else v.to(dtype) for k, v in state.items()},
                          strict=True)
    x = _calibration(dtype)[0]
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))


def test_awq_weight_only_and_edited_gptq_refused(tmp_path: Any) -> None:
    dest = str(tmp_path / "x")
    awq = I.quantize_model(_Forward(), I.get("w4a16-int4"), _calibration(torch.float32), algorithm="awq")
    with pytest.raises(UsageError, match=r"layer 'fc\d' was quantized by AWQ without activation quantization.*"
                                         r"use algorithm='gptq' or 'max'"):
        I.save_quantized(awq, I.get("w4a16-int4"), dest)
    gptq = I.quantize_model(_Forward(), I.get("w4a16-int4"), _calibration(torch.float32), algorithm="gptq")
    with torch.no_grad():
        gptq.fc2.weight[0, 0] += 1e-3
    with pytest.raises(UsageError, match=r"layer 'fc2': its weight is not on the grid of its gptq weight_scale"):
        I.save_quantized(gptq, I.get("w4a16-int4"), dest)
    assert not os.listdir(tmp_path)


def test_gptq_act_order_round_trip(tmp_path: Any) -> None:
    """act_order quantizes columns in Hessian order but keeps the groups in column order (static groups): the
    checkpoint needs no g_idx and compressed-tensors' decompression is the model's weights exactly."""
    scheme = I.get("w4a16-int4-asym")
    model = I.quantize_model(_Forward(), scheme, _calibration(torch.float32), algorithm="gptq",
                             options={"act_order": True})
    path = str(tmp_path / "ckpt")
    I.save_quantized(model, scheme, path)
    with open(os.path.join(path, "config.json")) as f:
        qc = ct_q.QuantizationConfig.model_validate(json.load(f)["quantization_config"])
    theirs = _ct_decompress(path, qc)
    for n in ("fc1", "fc2"):
        assert torch.equal(theirs[f"{n}.weight"], model.get_submodule(n).weight), n
