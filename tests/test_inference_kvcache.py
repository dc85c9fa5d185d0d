"""KV cache quantization (lowprec.inference._kvcache) on a real transformers Llama built from a config.

Oracles, independent of lowprec's quantizers: a ``transformers.DynamicCache`` subclass that records the key and
value states its ``update`` receives (post-rotary keys, what a serving engine caches), giving the calibrated scales
by hand (``max |k| / 448``, ``/ 127.5`` for int8, torch.quantile for "percentile"); and one whose ``update``
quantizes with torch's own float8 cast (``(k / s).clamp(+-448).to(float8_e4m3fn) * s``) or ``round`` for int8,
run on the same model with the same Linear scheme but no ``kv_cache``: the logits must be equal bit for bit."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from typing import Any

import pytest
import torch
from _reload import assert_reloads

from lowprec import UsageError
from lowprec import inference as I
from lowprec.inference import TensorScheme

transformers = pytest.importorskip("transformers")


def _llama() -> Any:
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False)
    torch.manual_seed(1)
    return transformers.LlamaForCausalLM(cfg).eval()


def _data(n: int = 3) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(i))}
            for i in range(n)]


def _scheme(fmt: str = "float8_e4m3fn", base: str = "fp8-dynamic") -> I.Scheme:
    return dataclasses.replace(I.get(base), name=f"{base}-kv", kv_cache=TensorScheme(format=fmt, dynamic=False))


class Recording(transformers.DynamicCache):  # type: ignore[misc]
    def __init__(self, seen: dict[int, dict[str, list[torch.Tensor]]], **kw: Any) -> None:
        super().__init__(**kw)
        self.seen = seen

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *a: Any, **kw: Any) -> Any:
        d = self.seen.setdefault(layer_idx, {"k": [], "v": []})
        d["k"].append(k.detach().reshape(-1).clone())
        d["v"].append(v.detach().reshape(-1).clone())
        return super().update(k, v, layer_idx, *a, **kw)


class HandQuantized(transformers.DynamicCache):  # type: ignore[misc]
    def __init__(self, scales: dict[int, tuple[float, float]], fmt: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.scales, self.fmt = scales, fmt

    def _q(self, t: torch.Tensor, s: float) -> torch.Tensor:
        st = torch.tensor(s, dtype=torch.float32)
        if self.fmt == "int8":
            return (torch.clamp(torch.round(t * (1.0 / st)), -128, 127) * st).to(t.dtype)
        return ((t / st).clamp(-448, 448).to(torch.float8_e4m3fn).float() * st).to(t.dtype)

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *a: Any, **kw: Any) -> Any:
        ks, vs = self.scales[layer_idx]
        return super().update(self._q(k, ks), self._q(v, vs), layer_idx, *a, **kw)


def _recorded(model: Any, data: list[dict[str, torch.Tensor]]) -> dict[int, dict[str, torch.Tensor]]:
    seen: dict[int, dict[str, list[torch.Tensor]]] = {}
    with torch.no_grad():
        for b in data:
            model(**b, cache=Recording(seen, config=model.config), use_cache=True)
    return {i: {k: torch.cat(v) for k, v in d.items()} for i, d in seen.items()}


def _attn(model: Any, i: int) -> Any:
    return model.model.layers[i].self_attn


@pytest.mark.parametrize("fmt,div", [("float8_e4m3fn", 448.0), ("int8", 127.5)])
def test_scales_and_logits_equal_hand_quantized_cache(fmt: str, div: float) -> None:
    base, data = _llama(), _data()
    seen = _recorded(base, data)
    scheme = _scheme(fmt, "w8a8-int8" if fmt == "int8" else "fp8-dynamic")
    q = I.quantize_model(copy.deepcopy(base), scheme, data)
    scales = {}
    for i in (0, 1):
        a = _attn(q, i)
        want_k, want_v = seen[i]["k"].abs().max() / div, seen[i]["v"].abs().max() / div
        assert a.k_scale.shape == (1,) and a.k_scale.dtype == torch.float32
        assert torch.equal(a.k_scale, want_k.reshape(1)) and torch.equal(a.v_scale, want_v.reshape(1))
        scales[i] = (float(want_k), float(want_v))
    ref = I.quantize_model(copy.deepcopy(base), dataclasses.replace(scheme, kv_cache=None))
    x = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(42))
    with torch.no_grad():
        want = ref(input_ids=x, cache=HandQuantized(scales, fmt, config=base.config), use_cache=True).logits
        cache = transformers.DynamicCache(config=base.config)
        got_cached = q(input_ids=x, cache=cache, use_cache=True).logits
        got = q(input_ids=x).logits  # no cache passed: the states are quantized all the same
        plain = ref(input_ids=x).logits
    assert torch.equal(got_cached, want) and torch.equal(got, want)
    assert not torch.equal(got, plain)  # the KV quantization changes the output
    k0, s0 = cache.layers[0].keys, _attn(q, 0).k_scale
    grid = (k0 / s0).round() if fmt == "int8" else (k0 / s0).to(torch.float8_e4m3fn).float()
    assert torch.equal(grid * s0, k0)  # the cache holds values on the quantization grid


def test_percentile_kv_scale() -> None:
    base, data = _llama(), _data()
    seen = _recorded(base, data)
    q = I.quantize_model(copy.deepcopy(base), _scheme(), data, algorithm="percentile", percentile=99.0)
    for i in (0, 1):
        want = torch.quantile(seen[i]["k"].abs().double(), 0.99).float() / 448
        assert torch.equal(_attn(q, i).k_scale, want.reshape(1))


def test_checkpoint_carries_k_and_v_scales(tmp_path: Any) -> None:
    ct_q = pytest.importorskip("compressed_tensors.quantization")
    st = pytest.importorskip("safetensors.torch")
    data, scheme = _data(), _scheme()
    model = I.quantize_model(_llama(), scheme, data)
    path = str(tmp_path / "ckpt")
    I.save_quantized(model, scheme, path)
    with open(os.path.join(path, "config.json")) as f:
        qc = ct_q.QuantizationConfig.model_validate(json.load(f)["quantization_config"])
    kv = qc.kv_cache_scheme
    assert kv is not None and (kv.num_bits, kv.type, kv.strategy, kv.dynamic) == (8, "float", "tensor", False)
    tensors = st.load_file(os.path.join(path, "model.safetensors"))
    for i in (0, 1):
        for name in ("k_scale", "v_scale"):
            t = tensors[f"model.layers.{i}.self_attn.{name}"]
            assert t.shape == (1,) and t.dtype == torch.float32 and torch.equal(t, getattr(_attn(model, i), name))
    x = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(5))
    assert_reloads(path, scheme, I.quantize_model(_llama(), scheme, data[:1]), model, x)  # other scales at first


def test_unquantize_removes_the_kv_quantizer() -> None:
    base = _llama()
    x = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = base(input_ids=x).logits
    q = I.quantize_model(copy.deepcopy(base), _scheme(), _data())
    with pytest.raises(UsageError, match="already holds QuantizedLinear"):
        I.quantize_model(q, _scheme(), _data())
    I.unquantize_model(q)
    assert not any(k.endswith(("k_scale", "v_scale")) for k in q.state_dict())
    with torch.no_grad():
        assert torch.equal(q(input_ids=x).logits, want)
    I.quantize_model(q, _scheme(), _data())  # and it can be quantized again


def test_kv_cache_bad_input() -> None:
    from lowprec.runs.zoo import get_task

    gpt = get_task("gpt-bytes", seed=0, batch_size=2, d_model=128, layers=1, context=16).model
    with pytest.raises(UsageError, match="no attention module that takes a Hugging Face cache"):
        I.quantize_model(gpt, _scheme(), [torch.zeros(2, 16, dtype=torch.int64)])
    assert not any(isinstance(m, I.QuantizedLinear) for m in gpt.modules())
    llama = _llama()
    with pytest.raises(UsageError, match="needs calibration_data"):
        I.quantize_model(llama, _scheme())
    dyn = dataclasses.replace(_scheme(), kv_cache=TensorScheme(format="float8_e4m3fn", dynamic=True))
    with pytest.raises(UsageError, match=r"static per-tensor float8_e4m3fn or int8 KV caches.*dynamic=True"):
        I.quantize_model(llama, dyn, _data())
    fp4 = dataclasses.replace(_scheme(), kv_cache=TensorScheme(format="float4_e2m1fn", granularity="group",
                                                               group_size=16, dynamic=False))
    with pytest.raises(UsageError, match="format='float4_e2m1fn'"):
        I.quantize_model(llama, fp4, _data())
    assert not any(isinstance(m, I.QuantizedLinear) for m in llama.modules())
    assert not any(k.endswith("k_scale") for k in llama.state_dict())
