"""lowprec.inference.quantize_model: fake-quantized inference and calibration against hand-written references.

References written out here, independently of ``_affine``/``_calibrate``: int8 symmetric per-token activations
(``amax / 127.5``, ``round(x * fl(1/s))`` ties to even, clamp to [-128, 127]), e4m3 per-tensor activations
(``amax / 448``, ``x / s`` cast by torch to ``float8_e4m3fn``), the weights by ``fake_quantize_weight`` (tested
against torchao and compressed-tensors in test_inference_scheme.py / test_inference_ct.py), then ``F.linear``.
torchao's ``Int8DynamicActivationInt8WeightConfig`` is a second oracle for w8a8-int8.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lowprec import UsageError
from lowprec import inference as I
from lowprec.inference import _calibrate, _plan

TINY = 2.0**-126


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _preset(name: str) -> I.Scheme:
    return dataclasses.replace(I.get(name), ignore=())  # the MLP has no lm_head


def _data(n: int = 4, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(3, 5, 16, generator=g) for _ in range(n)]
    out[1][0, 0, 3] = 9.0  # an outlier: percentile and mse clip it
    return out


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    cfg._attn_implementation = "eager"
    return LlamaForCausalLM(cfg).eval()


def _int8_per_token(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    s = torch.clamp(xf.abs().amax(dim=-1, keepdim=True) / 127.5, min=TINY)
    return (torch.clamp(torch.round(xf * (1.0 / s)), -128, 127) * s).to(x.dtype)


def _fp8_static(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return ((x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).to(x.dtype)


def _hand_model(model: nn.Module, scheme: I.Scheme, act: Any) -> nn.Module:
    """A copy of ``model`` with every planned Linear's weight fake-quantized and ``act(name, x)`` on its input."""
    ref = copy.deepcopy(model)
    for e in _plan.plan(ref, scheme):
        lin = e.module
        assert isinstance(lin, nn.Linear) and e.weights is not None
        with torch.no_grad():
            lin.weight.copy_(I.fake_quantize_weight(lin.weight, e.weights))
        lin.register_forward_pre_hook(lambda _m, args, n=e.name: (act(n, args[0]),))
    return ref


def _inputs(model: nn.Module, names: list[str], data: list[Any]) -> dict[str, torch.Tensor]:
    """Every input each named layer of ``model`` sees over ``data``, flattened, by hand."""
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    hooks = [model.get_submodule(n).register_forward_pre_hook(
        lambda _m, args, n=n: seen[n].append(args[0].detach().reshape(-1))) for n in names]
    with torch.no_grad():
        for b in data:
            model(**b) if isinstance(b, dict) else model(b)
    for h in hooks:
        h.remove()
    return {n: torch.cat(v) for n, v in seen.items()}


# ---------------------------------------------------------------------------------------------- dynamic
def test_w8a8_int8_mlp_matches_hand_reference() -> None:
    model, x = _mlp(), _data()[0]
    ref = _hand_model(model, _preset("w8a8-int8"), lambda _n, v: _int8_per_token(v))
    q = I.quantize_model(model, _preset("w8a8-int8"))
    assert q is model and isinstance(q[0], I.QuantizedLinear) and isinstance(q[2], I.QuantizedLinear)
    with torch.no_grad():
        assert torch.equal(q(x), ref(x))
        wts = I.get("w8a8-int8").config_groups[0].weights
        assert wts is not None
        h = F.linear(_int8_per_token(x), I.fake_quantize_weight(q[0].original_weight, wts), q[0].bias)
        assert torch.equal(q[0](x), h)


def test_w8a8_int8_llama_matches_hand_reference() -> None:
    model = _llama()
    scheme = I.get("w8a8-int8")
    ref = _hand_model(model, scheme, lambda _n, v: _int8_per_token(v))
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    I.quantize_model(model, scheme)
    names = [n for n, m in model.named_modules() if isinstance(m, I.QuantizedLinear)]
    assert len(names) == 7 and "lm_head" not in names  # q k v o gate up down
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_w8a8_int8_against_torchao() -> None:
    """torchao's Int8DynamicActivationInt8WeightConfig on CPU: the dequantized weight and the quantized
    activation match bit for bit; the output differs in the last bits only, because torchao multiplies the exact
    int32 dot product by the two scales ((qx @ qw^T) * s_x * s_w) where F.linear sums the float32 products of the
    dequantized values."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    from torchao.quantization.quantize_.common import _choose_quant_func_and_quantize_tensor

    model, x = _mlp(), _data()[0].reshape(-1, 16)
    tao = copy.deepcopy(model)
    quantize_(tao, Int8DynamicActivationInt8WeightConfig())
    q = I.quantize_model(model, _preset("w8a8-int8"))
    act = I.get("w8a8-int8").config_groups[0].input_activations
    assert act is not None
    with torch.no_grad():
        for i in (0, 2):
            w = tao[i].weight
            assert torch.equal(w.dequantize(), q[i].weight)
            xa = _choose_quant_func_and_quantize_tensor(x if i == 0 else F.relu(q[0](x)), w.act_quant_kwargs)
            assert torch.equal(xa.dequantize(), I.fake_quantize_activation(x if i == 0 else F.relu(q[0](x)), act))
        y, yt = q(x), tao(x)
        assert torch.allclose(y, yt, rtol=1e-5, atol=1e-6) and (y - yt).abs().max() < 1e-5


# ---------------------------------------------------------------------------------------------- static
def test_fp8_static_max_scale_and_output() -> None:
    model, data = _mlp(), _data()
    seen = _inputs(model, ["0", "2"], data)
    scales = {n: v.abs().amax() / 448 for n, v in seen.items()}
    ref = _hand_model(model, _preset("fp8-static"), lambda n, v: _fp8_static(v, scales[n]))
    I.quantize_model(model, _preset("fp8-static"), data)
    for i, n in ((0, "0"), (2, "2")):
        assert torch.equal(model[i].input_scale, scales[n].reshape(1))  # [1]: compressed-tensors' shape
    x = _data(seed=7)[0] * 2  # beyond the calibrated range: saturates at +-448 * s
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


def test_percentile_below_max_and_equals_quantile() -> None:
    base, data = _mlp(), _data()
    seen = _inputs(base, ["0", "2"], data)
    mx = I.quantize_model(copy.deepcopy(base), _preset("fp8-static"), data)
    pc = I.quantize_model(copy.deepcopy(base), _preset("fp8-static"), data, algorithm="percentile", percentile=99.0)
    for i, n in ((0, "0"), (2, "2")):
        assert pc[i].input_scale <= mx[i].input_scale
        want = torch.quantile(seen[n].abs().double(), 0.99).float() / 448
        assert torch.equal(pc[i].input_scale, want.reshape(1))
    assert pc[0].input_scale < mx[0].input_scale  # the outlier 9.0 is clipped
    full = I.quantize_model(copy.deepcopy(base), _preset("fp8-static"), data, algorithm="percentile", percentile=100)
    assert torch.equal(full[0].input_scale, mx[0].input_scale)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "int8"])
def test_mse_minimises_over_grid(fmt: str) -> None:
    base, data = _mlp(), _data()
    seen = _inputs(base, ["0"], data)["0"]
    act = I.TensorScheme(format=fmt)
    scheme = I.Scheme(config_groups=(I.ConfigGroup(weights=I.TensorScheme(format="int8", granularity="channel"),
                                                   input_activations=act),))
    q = I.quantize_model(copy.deepcopy(base), scheme, data, algorithm="mse")
    amax = float(seen.abs().max())
    assert len(_calibrate.MSE_GRID) == 100 and _calibrate.MSE_GRID[0] == 0.5 and _calibrate.MSE_GRID[-1] == 1.0
    best, best_err = None, float("inf")
    for i in range(100):  # brute force, written out
        c = torch.tensor(amax * (0.5 + 0.5 * i / 99), dtype=torch.float32)
        if fmt == "int8":
            s = c / 127.5
            xh = torch.clamp(torch.round(seen * (1.0 / s)), -128, 127) * s
        else:
            s = c / 448
            xh = _fp8_static(seen, s)
        err = float((xh - seen).double().square().sum()) / seen.numel()
        if err < best_err:
            best, best_err = s, err
    assert best is not None and torch.equal(q[0].input_scale, best.reshape(1))
    mx = I.quantize_model(copy.deepcopy(base), scheme, data)
    assert q[0].input_scale <= mx[0].input_scale


@pytest.mark.parametrize("algorithm", ["max", "percentile", "mse"])
def test_calibration_reproducible(algorithm: str) -> None:
    base = _mlp()
    a = I.quantize_model(copy.deepcopy(base), _preset("fp8-static"), _data(), algorithm=algorithm)
    b = I.quantize_model(copy.deepcopy(base), _preset("fp8-static"), _data(), algorithm=algorithm)
    for i in (0, 2):
        assert torch.equal(a[i].input_scale, b[i].input_scale)


def test_llama_static_calibration_with_dict_batches() -> None:
    model = _llama()
    g = torch.Generator().manual_seed(5)
    data = [{"input_ids": torch.randint(0, 64, (2, 10), generator=g)} for _ in range(3)]
    seen = _inputs(model, ["model.layers.0.mlp.down_proj"], data[:2])
    I.quantize_model(model, I.get("fp8-static"), iter(data), batches=2)
    down = model.get_submodule("model.layers.0.mlp.down_proj")
    assert torch.equal(down.input_scale, (seen["model.layers.0.mlp.down_proj"].abs().amax() / 448).reshape(1))
    with torch.no_grad():
        assert torch.isfinite(model(**data[2]).logits).all()


# ---------------------------------------------------------------------------------------------- conversion
def test_weights_quantized_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = [0]
    real = _plan.fake_quantize_weight

    def counting(w: torch.Tensor, ts: I.TensorScheme) -> torch.Tensor:
        calls[0] += 1
        return real(w, ts)

    monkeypatch.setattr(_plan, "fake_quantize_weight", counting)
    model = I.quantize_model(_mlp(), _preset("w8a8-int8"))
    assert calls[0] == 2
    with torch.no_grad():
        for _ in range(3):
            model(_data()[0])
    assert calls[0] == 2
    assert not model[0].weight.requires_grad and "weight" in model[0].state_dict()
    assert "original_weight" not in model[0].state_dict()


def test_unquantize_restores_linear() -> None:
    base = _mlp()
    model = I.quantize_model(copy.deepcopy(base), _preset("fp8-static"), _data())
    I.unquantize_model(model)
    assert all(type(model[i]) is nn.Linear for i in (0, 2))
    for k, v in base.state_dict().items():
        assert torch.equal(model.state_dict()[k], v)
    x = _data()[0]
    with torch.no_grad():
        assert torch.equal(model(x), base(x))
    I.quantize_model(model, _preset("w8a8-int8"))  # can be quantized again


# ---------------------------------------------------------------------------------------------- errors
def test_errors() -> None:
    model = _mlp()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(UsageError, match="calibration_data is empty"):
        I.quantize_model(model, _preset("fp8-static"), [])
    with pytest.raises(ValueError, match=r"static input activations .*needs calibration_data.*'fp8-dynamic'"):
        I.quantize_model(model, _preset("fp8-static"))
    with pytest.raises(ValueError, match=r"calibration batch 1: layer '0' expects inputs \[\.\.\., 16\] "
                                         r"\(in_features=16\); got \[4, 15\]"):
        I.quantize_model(model, _preset("fp8-static"), [torch.randn(4, 16), torch.randn(4, 15)])
    with pytest.raises(UsageError, match=r"calibration batch 0: the model cannot run on it \(RuntimeError"):
        I.quantize_model(model, _preset("fp8-static"), [torch.randn(4, 16, dtype=torch.float64)])
    with pytest.raises(ValueError, match="unknown calibration algorithm 'minmax'; valid: max, percentile, mse"):
        I.quantize_model(model, _preset("fp8-static"), _data(), algorithm="minmax")
    with pytest.raises(ValueError, match=r"percentile must be a number in \(0, 100\]"):
        I.quantize_model(model, _preset("fp8-static"), _data(), algorithm="percentile", percentile=0)
    with pytest.raises(ValueError, match="batches must be a positive int"):
        I.quantize_model(model, _preset("fp8-static"), _data(), batches=0)
    assert all(type(model[i]) is nn.Linear for i in (0, 2)) and model.training  # unchanged on error
    for k, v in before.items():
        assert torch.equal(model.state_dict()[k], v)
    I.quantize_model(model, _preset("w8a8-int8"))
    with pytest.raises(ValueError, match="already holds QuantizedLinear"):
        I.quantize_model(model, _preset("w8a8-int8"))
    with pytest.raises(ValueError, match=r"layer '0' expects inputs \[\.\.\., 16\]"):
        model(torch.randn(2, 15))
