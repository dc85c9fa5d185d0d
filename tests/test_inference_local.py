"""NVFP4 activations with ``dynamic = "local"`` (lowprec.inference._local): a calibrated global scale, e4m3 group
scales from each input.

Oracle: compressed-tensors 0.20.1 itself, ``compute_dynamic_scales_and_zp`` + ``fake_quantize`` with the layer's
``global_scale`` (what its NVFP4 preset runs in a quantized forward), and ``generate_gparam`` for the global scale
llm-compressor's ``static_minmax`` observer stores.  Compared bit for bit (``torch.equal``: compressed-tensors
maps ``-0.0`` to ``+0.0``, lowprec keeps the sign; both compare equal)."""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _reload import assert_reloads
from torch import nn

from lowprec import inference as I
from lowprec.inference import _calibrate
from lowprec.inference._local import fake_quantize_local, global_scale_from_clip

ct_scheme = pytest.importorskip("compressed_tensors.quantization.quant_scheme")
ct_helpers = pytest.importorskip("compressed_tensors.quantization.utils.helpers")
ct_forward = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward")
ct_q = pytest.importorskip("compressed_tensors.quantization")

TS = I.get("nvfp4").config_groups[0].input_activations
ARGS = ct_scheme.NVFP4["input_activations"]


def _ct_qdq(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    scale, zp = ct_helpers.compute_dynamic_scales_and_zp(x, ARGS, module=None, global_scale=g)
    return ct_forward.fake_quantize(x, scale, zp, ARGS, global_scale=g)  # type: ignore[no-any-return]


def _gparam(c: torch.Tensor) -> torch.Tensor:
    c = c.float().reshape(1)
    return ct_helpers.generate_gparam(-c, c)  # type: ignore[no-any-return]


def _wide(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.exp2(torch.randint(-24, 12, shape, generator=g).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qdq_equals_compressed_tensors(dtype: torch.dtype) -> None:
    checked = clipped = 0
    for trial in range(40):
        x = _wide((6, 5, 64), trial).to(dtype)
        x[0, 0, :16] = 0.0  # an all-zero group: compressed-tensors' 0.125 scale
        x[1, 1, 16:32] = -0.0
        x[2, 2, 3] = 6.0 * 448 * 4  # one large value
        ratio = (0.1, 0.5, 1.0, 2.0)[trial % 4]  # calibrated range below the input's: groups saturate and clip
        c = x.float().abs().max() * ratio
        g = _gparam(c)
        assert torch.equal(global_scale_from_clip(c), g)
        ours, theirs = fake_quantize_local(x, g, TS), _ct_qdq(x, g)
        assert ours.dtype == theirs.dtype == dtype and ours.shape == x.shape
        assert torch.equal(ours, theirs), (trial, (ours != theirs).sum())
        checked += x.numel()
        clipped += int((ours.float().abs() < x.float().abs() * 0.5).sum())
    assert checked == 40 * 6 * 5 * 64 and clipped > 0  # the clipping path was exercised


@pytest.mark.parametrize("c", [0.0, 1e-45, 1e-30, 3.0e-3, 1.0, 2688.0, 1e30, 3.4e38, float("inf")])
def test_global_scale_equals_generate_gparam(c: float) -> None:
    assert torch.equal(global_scale_from_clip(torch.tensor(c)), _gparam(torch.tensor(c)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.fc1 = nn.Linear(64, 96)
        self.fc2 = nn.Linear(96, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _data() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return [torch.randn(3, 7, 64, generator=g) * (1 + i) for i in range(3)]


def _seen(model: nn.Module, data: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    seen: dict[str, list[torch.Tensor]] = {"fc1": [], "fc2": []}
    hooks = [getattr(model, n).register_forward_pre_hook(lambda m, a, n=n: seen[n].append(a[0].reshape(-1)))
             for n in seen]
    with torch.no_grad():
        for x in data:
            model(x)
    for h in hooks:
        h.remove()
    return {n: torch.cat(v) for n, v in seen.items()}


def test_quantize_model_forward_is_compressed_tensors_on_calibrated_scale() -> None:
    base, data = Net().eval(), _data()
    seen = _seen(base, data)
    q = I.quantize_model(copy.deepcopy(base), I.get("nvfp4"), data)
    wts = I.get("nvfp4").config_groups[0].weights
    assert wts is not None
    for n in ("fc1", "fc2"):
        layer = getattr(q, n)
        assert layer.input_scale is None and layer.input_global_scale.shape == (1,)
        assert torch.equal(layer.input_global_scale, _gparam(seen[n].abs().max()))
        assert "input_activations=float4_e2m1fn/tensor_group/local" in repr(layer)
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(9)) * 3  # beyond the calibrated range too
    h = F.linear(_ct_qdq(x, q.fc1.input_global_scale), I.fake_quantize_weight(base.fc1.weight, wts), base.fc1.bias)
    h = torch.relu(h)
    want = F.linear(_ct_qdq(h, q.fc2.input_global_scale), I.fake_quantize_weight(base.fc2.weight, wts), base.fc2.bias)
    with torch.no_grad():
        assert torch.equal(q(x), want)


def test_percentile_and_mse_choose_the_clip() -> None:
    base, data = Net().eval(), _data()
    seen = _seen(base, data)
    mx = I.quantize_model(copy.deepcopy(base), I.get("nvfp4"), data)
    pc = I.quantize_model(copy.deepcopy(base), I.get("nvfp4"), data, algorithm="percentile", percentile=99.0)
    ms = I.quantize_model(copy.deepcopy(base), I.get("nvfp4"), data, algorithm="mse")
    for n in ("fc1", "fc2"):
        v = seen[n]
        want = _gparam(torch.quantile(v.abs().double(), 0.99).float())
        assert torch.equal(getattr(pc, n).input_global_scale, want)
        assert getattr(pc, n).input_global_scale > getattr(mx, n).input_global_scale  # a smaller clip
        # mse: the grid candidate with the least squared error of compressed-tensors' own QDQ
        amax = float(v.abs().max())
        errs = []
        for r in _calibrate.MSE_GRID:
            g = _gparam(torch.tensor(amax * r, dtype=torch.float32))
            errs.append((float((_ct_qdq(v.reshape(-1, 16), g).reshape(-1) - v).double().square().sum()), g))
        best = min(range(len(errs)), key=lambda i: (errs[i][0], i))
        assert torch.equal(getattr(ms, n).input_global_scale, errs[best][1])
        assert errs[best][0] <= errs[-1][0]  # no worse than max (the last candidate)


def _llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False)
    torch.manual_seed(1)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_checkpoint_stores_input_global_scale(tmp_path: Any) -> None:
    st = pytest.importorskip("safetensors.torch")
    data = [{"input_ids": torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(i))}
            for i in range(2)]
    scheme = I.get("nvfp4")
    model = I.quantize_model(_llama(), scheme, data)
    path = str(tmp_path / "ckpt")
    I.save_quantized(model, scheme, path)
    with open(os.path.join(path, "config.json")) as f:
        qc_dict = json.load(f)["quantization_config"]
    qc = ct_q.QuantizationConfig.model_validate(qc_dict)
    assert qc.config_groups["group_0"].input_activations.dynamic == "local"
    tensors = st.load_file(os.path.join(path, "model.safetensors"))
    layers = {n: m for n, m in model.named_modules() if isinstance(m, I.QuantizedLinear)}
    assert len(layers) == 7
    for n, m in layers.items():
        t = tensors[f"{n}.input_global_scale"]
        assert t.dtype == torch.float32 and t.shape == (1,) and torch.equal(t, m.input_global_scale)
        assert f"{n}.input_scale" not in tensors
    x = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(7))
    assert_reloads(path, scheme, I.quantize_model(_llama(), scheme, data[:1]), model, x)  # other scales at first


def test_fp8_static_input_scale_has_compressed_tensors_shape(tmp_path: Any) -> None:
    st = pytest.importorskip("safetensors.torch")
    data = [{"input_ids": torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))}]
    model = I.quantize_model(_llama(), I.get("fp8-static"), data)
    I.save_quantized(model, I.get("fp8-static"), tmp_path / "ckpt")
    tensors = st.load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    scales = {k: v for k, v in tensors.items() if k.endswith(".input_scale")}
    assert len(scales) == 7 and all(v.shape == (1,) and v.dtype == torch.float32 for v in scales.values())
