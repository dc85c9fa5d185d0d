"""Folding SmoothQuant / AWQ factors into the norms before the layers (lowprec.inference._fold,
``options={"fold": True}``), on the zoo GPT and a transformers Llama built from a config.

Oracles: the factors by the papers' formulas written out here on hand-recorded norm outputs (SmoothQuant
``max|y|^alpha / max|W|^(1-alpha)`` over the concatenated weights of the layers sharing the norm; AWQ's grid
error by its definition), the folded norms ``(w / s)`` and scaled weights ``Q(W diag(s))`` recomputed, the
float model's function (the folded float model equals the original to float rounding), and compressed-tensors'
QuantizationConfig plus a reload for the checkpoint."""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import pytest
import torch
from torch import nn

from lowprec import UsageError
from lowprec import inference as I
from lowprec.inference import _algorithms

transformers = pytest.importorskip("transformers")


def _gpt() -> nn.Module:
    from lowprec.runs.zoo import get_task

    return get_task("gpt-bytes", seed=0, batch_size=4, d_model=128, layers=2, context=16).model.eval()


def _gpt_data() -> list[torch.Tensor]:
    from lowprec.runs.zoo import get_task

    task = get_task("gpt-bytes", seed=0, batch_size=4, d_model=128, layers=2, context=16)
    return [task.train_batch(i)[0] for i in range(3)]


def _llama() -> Any:
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False)
    torch.manual_seed(1)
    m = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights and outlier channels, as trained models have
        for n, p in m.named_parameters():
            if n.endswith("layernorm.weight"):
                p.copy_(torch.rand(p.shape, generator=torch.Generator().manual_seed(2)) + 0.5)
                p[:3] *= 8
    return m


def _llama_data() -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(i))}
            for i in range(3)]


def _norm_outputs(model: nn.Module, names: list[str], data: list[Any]) -> dict[str, torch.Tensor]:
    from lowprec._batches import call_model

    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    hooks = [model.get_submodule(n).register_forward_hook(
        lambda m, a, out, n=n: seen[n].append(out.detach().reshape(-1, out.shape[-1]))) for n in names]
    with torch.no_grad():
        for b in data:
            call_model(model, b)
    for h in hooks:
        h.remove()
    return {n: torch.cat(v) for n, v in seen.items()}


def test_smoothquant_fold_on_the_zoo_gpt() -> None:
    base, data = _gpt(), _gpt_data()
    norms = ["blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2"]
    ys = _norm_outputs(base, norms, data)
    q = I.quantize_model(copy.deepcopy(base), I.get("w8a8-int8"), data, algorithm="smoothquant",
                         options={"alpha": 0.7, "fold": True})
    wts = I.get("w8a8-int8").config_groups[0].weights
    for norm, layer in zip(norms, ["blocks.0.attn.qkv", "blocks.0.mlp.fc", "blocks.1.attn.qkv", "blocks.1.mlp.fc"],
                           strict=True):
        w = base.get_submodule(layer).weight.detach()
        s = (ys[norm].abs().amax(0).float().pow(0.7) / w.abs().amax(0).clamp(min=1e-5).pow(0.3)).clamp(min=1e-5)
        ql = q.get_submodule(layer)
        assert ql.smooth is None and torch.equal(ql.folded, s)
        assert torch.equal(ql.weight, I.fake_quantize_weight(w.float() * s, wts))
        n0, n1 = base.get_submodule(norm), q.get_submodule(norm)
        assert torch.equal(n1.weight, n0.weight / s) and torch.equal(n1.bias, n0.bias / s)
    for layer in ("blocks.0.attn.proj", "blocks.0.mlp.out"):  # inputs that are no norm's output: not smoothed
        ql = q.get_submodule(layer)
        assert ql.smooth is None and ql.folded is None
        assert torch.equal(ql.weight, I.fake_quantize_weight(base.get_submodule(layer).weight, wts))
    x = data[0]
    I.unquantize_model(q)
    with torch.no_grad():
        assert torch.equal(q(x), base(x))  # norms restored bit for bit
    assert torch.equal(q.blocks[0].ln1.weight, base.blocks[0].ln1.weight)


def test_llama_groups_share_one_factor_and_save(tmp_path: Any) -> None:
    ct_q = pytest.importorskip("compressed_tensors.quantization")
    base, data = _llama(), _llama_data()
    pre = "model.layers.0"
    ys = _norm_outputs(base, [f"{pre}.input_layernorm", f"{pre}.post_attention_layernorm"], data)
    scheme = I.get("w8a8-int8")
    q = I.quantize_model(copy.deepcopy(base), scheme, data, algorithm="smoothquant", options={"fold": True})
    for norm, layers in ((f"{pre}.input_layernorm", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
                         (f"{pre}.post_attention_layernorm", ["mlp.gate_proj", "mlp.up_proj"])):
        ws = torch.cat([base.get_submodule(f"{pre}.{n}").weight.detach() for n in layers])
        s = (ys[norm].abs().amax(0).float().pow(0.5) / ws.abs().amax(0).clamp(min=1e-5).pow(0.5)).clamp(min=1e-5)
        for n in layers:
            assert torch.equal(q.get_submodule(f"{pre}.{n}").folded, s), n
        assert torch.equal(q.get_submodule(norm).weight, base.get_submodule(norm).weight / s)
    for n in ("self_attn.o_proj", "mlp.down_proj"):
        assert q.get_submodule(f"{pre}.{n}").folded is None
    # the folded float model is the original function (to float rounding): only the quantizers differ
    x = _llama_data()[0]["input_ids"]
    path = str(tmp_path / "ck")
    I.save_quantized(q, scheme, path)
    with open(os.path.join(path, "config.json")) as f:
        ct_q.QuantizationConfig.model_validate(json.load(f)["quantization_config"])
    state, back = I.load_quantized(path)
    assert torch.equal(state[f"{pre}.input_layernorm.weight"], q.get_submodule(f"{pre}.input_layernorm").weight)
    fresh = I.quantize_model(copy.deepcopy(base), scheme)  # plain layers: the folded weights come from the file
    fresh.load_state_dict(state, strict=True)
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=x).logits, q(input_ids=x).logits)


def test_awq_weight_only_fold_is_savable(tmp_path: Any) -> None:
    base, data = _llama(), _llama_data()
    scheme = I.get("w4a16-int4")
    q = I.quantize_model(copy.deepcopy(base), scheme, data, algorithm="awq", options={"fold": True, "n_grid": 10})
    pre = "model.layers.0"
    wts = scheme.config_groups[0].weights
    qkv = [q.get_submodule(f"{pre}.self_attn.{n}") for n in ("q_proj", "k_proj", "v_proj")]
    s = qkv[0].folded
    assert s is not None and all(torch.equal(layer.folded, s) for layer in qkv)
    for layer in qkv:
        assert torch.equal(layer.weight, I.fake_quantize_weight(layer.original_weight.float() * s, wts))
    # the chosen exponent's group error is no worse than round to nearest (a = 0, the first grid point)
    ys = _norm_outputs(base, [f"{pre}.input_layernorm"], data)[f"{pre}.input_layernorm"]
    st = _algorithms.LayerStats()
    st.add(ys)
    _, a, errors = _algorithms.awq_search_group([layer.original_weight for layer in qkv], st, [wts] * 3, 10)
    assert errors[int(round(a * 10))] == min(errors) <= errors[0]
    I.save_quantized(q, scheme, tmp_path / "ck")
    state, _ = I.load_quantized(tmp_path / "ck")
    for layer, n in zip(qkv, ("q_proj", "k_proj", "v_proj"), strict=True):
        assert torch.equal(state[f"{pre}.self_attn.{n}.weight"], layer.weight)


class _Residual(nn.Module):
    """The norm output feeds the quantized layer and, unseen by module hooks, a residual sum."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(32)
        self.fc = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return self.fc(y) + y


def test_a_fold_that_changes_the_model_is_refused() -> None:
    m = _Residual().eval()
    data = [torch.randn(4, 32, generator=torch.Generator().manual_seed(i)) * torch.linspace(0.1, 10, 32)
            for i in range(2)]
    with pytest.raises(UsageError, match=r"folding the smoothing factors into 'norm' changes the float model's output"
                                         r".*another consumer.*fold=False"):
        I.quantize_model(m, I.get("w8a8-int8"), data, algorithm="smoothquant", options={"fold": True})
    assert type(m.fc) is nn.Linear and not hasattr(m.norm, "_lowprec_unfolded")  # unchanged
    I.quantize_model(m, I.get("w8a8-int8"), data, algorithm="smoothquant")  # per-layer smooth still works
    assert m.fc.smooth is not None


def test_fold_option_checks() -> None:
    with pytest.raises(UsageError, match=r"options\['fold'\].*must be True or False"):
        I.quantize_model(_gpt(), I.get("w8a8-int8"), _gpt_data(), algorithm="smoothquant", options={"fold": 1})
    with pytest.raises(UsageError, match="unknown option 'fold' for algorithm='gptq'"):
        I.quantize_model(_gpt(), I.get("w8a8-int8"), _gpt_data(), algorithm="gptq", options={"fold": True})
    from lowprec.inference._checkpoint import check_savable

    check_savable(I.get("w8a8-int8"), "smoothquant", {"fold": True})
    with pytest.raises(UsageError, match=r"options=\{'fold': True\}"):
        check_savable(I.get("w8a8-int8"), "awq")
