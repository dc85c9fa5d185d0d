"""Quantized checkpoints in the compressed-tensors layout, checked against compressed-tensors 0.20.1 itself: its
``QuantizationConfig`` validates the saved ``quantization_config``, and its per-format compressor
(``BaseCompressor.get_value_from_registry(format).decompress``, what ``ModelCompressor.decompress_model`` runs per
module) turns the saved tensors back into exactly ``lowprec.inference.fake_quantize_weight``'s weights."""

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

SUPPORTED = ["w8a8-int8", "w4a16-int4", "w4a16-int4-asym", "fp8-static", "fp8-dynamic", "fp8-block"]
FORMAT = {"w8a8-int8": "int-quantized", "w4a16-int4": "pack-quantized", "w4a16-int4-asym": "pack-quantized",
          "fp8-static": "float-quantized", "fp8-dynamic": "float-quantized", "fp8-block": "float-quantized"}


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
        local = {k[len(layer) + 1:]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == layer}
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
        assert torch.equal(theirs[k], w), f"{name} {k}: {(theirs[k] != w).sum().item()} elements differ"

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


@pytest.mark.parametrize("name", ["mxfp8", "mxfp4", "nvfp4"])
def test_mx_nvfp4_not_yet(tmp_path: Any, name: str) -> None:
    with pytest.raises(UsageError, match="not supported yet"):
        I.save_quantized(_mlp(), I.get(name), str(tmp_path / "x"))
    assert not os.listdir(tmp_path)


def _saved(tmp_path: Any, name: str = "w4a16-int4-asym") -> tuple[str, dict[str, torch.Tensor]]:
    path = str(tmp_path / "ckpt")
    I.save_quantized(_mlp(), I.get(name), path)
    return path, safetensors_torch.load_file(os.path.join(path, "model.safetensors"))


def _rewrite(path: str, tensors: dict[str, torch.Tensor]) -> None:
    safetensors_torch.save_file(tensors, os.path.join(path, "model.safetensors"))


def test_missing_scale(tmp_path: Any) -> None:
    path, t = _saved(tmp_path)
    del t["fc2.weight_scale"]
    _rewrite(path, t)
    with pytest.raises(UsageError, match=r"model\.safetensors: tensor 'fc2\.weight_scale' is missing"):
        I.load_quantized(path)


def test_missing_packed(tmp_path: Any) -> None:
    path, t = _saved(tmp_path)
    del t["fc1.weight_packed"]
    _rewrite(path, t)
    with pytest.raises(UsageError, match=r"'fc1\.weight_packed' is missing"):
        I.load_quantized(path)


def test_wrong_weight_shape(tmp_path: Any) -> None:
    path, t = _saved(tmp_path)
    t["fc1.weight_shape"] = torch.tensor([384, 512])
    _rewrite(path, t)
    with pytest.raises(UsageError, match=r"fc1\.weight_packed has shape \[384, 32\] but fc1\.weight_shape"):
        I.load_quantized(path)


def test_wrong_dtype(tmp_path: Any) -> None:
    path, t = _saved(tmp_path, "w8a8-int8")
    t["fc1.weight"] = t["fc1.weight"].float()
    _rewrite(path, t)
    with pytest.raises(UsageError, match=r"'fc1\.weight' has dtype torch\.float32, expected torch\.int8"):
        I.load_quantized(path)


def test_wrong_scale_shape(tmp_path: Any) -> None:
    path, t = _saved(tmp_path, "fp8-dynamic")
    t["fc1.weight_scale"] = t["fc1.weight_scale"][:10]
    _rewrite(path, t)
    with pytest.raises(UsageError, match=r"'fc1\.weight_scale' has shape \[10, 1\], expected \[384, 1\]"):
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
