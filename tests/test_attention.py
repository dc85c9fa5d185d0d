"""Emulated attention (issue 17): ``lowprec.nn._attention`` and the ``Attention`` recipe.

Oracles:
* PyTorch's math SDPA: ``torch.ops.aten._scaled_dot_product_attention_math`` and ``F.scaled_dot_product_attention``
  under ``sdpa_kernel(SDPBackend.MATH)``, forward and backward, bit for bit with the float32 recipe;
* a hand-composed reference for quantized recipes: ``lowprec.quant.fake_quantize`` of each GEMM operand (reduction
  dimension last) followed by the same float32 operations, forward and every gradient, bit for bit;
* per-head scaling: one call per (batch, head) matrix with per-tensor scaling;
* transformers' own sdpa (math backend) and eager attention on a tiny Llama;
* the hashes of the built-in recipes as computed before ``Recipe.attention`` existed (pinned below).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import lowprec
from lowprec import UsageError, recipes
from lowprec.nn._attention import (
    attention_mode,
    emulate_attention,
    restore_attention,
    scaled_dot_product_attention,
)
from lowprec.quant import QuantSpec, fake_quantize
from lowprec.recipes import Attention, LinearRecipe, Operand, Recipe, Scaling

MATH = torch.ops.aten._scaled_dot_product_attention_math


def _qkv(b: int = 2, h: int = 4, hk: int = 4, lq: int = 7, s: int = 9, e: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g).requires_grad_() for shape in
                 ((b, h, lq, e), (b, hk, s, e), (b, hk, s, e)))


def _grads(out: torch.Tensor, inputs, seed: int = 1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad(out, inputs, g)


def _assert_same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y), (x - y).abs().max()


# ------------------------------------------------------------------------------------------------ float32 = math SDPA
@pytest.mark.parametrize("case", ["plain", "causal", "float_mask", "gqa", "scale", "negative_scale", "broadcast_mask"])
def test_fp32_equals_math_sdpa_forward_and_backward(case: str) -> None:
    kw: dict = {}
    shape: dict = {}
    if case == "causal":
        kw, shape = {"is_causal": True}, {"s": 7}
    elif case == "float_mask":
        kw = {"attn_mask": torch.randn(2, 4, 7, 9)}
    elif case == "broadcast_mask":
        kw = {"attn_mask": torch.randn(7, 9)}
    elif case == "gqa":
        kw, shape = {"enable_gqa": True}, {"hk": 2}
    elif case == "scale":
        kw = {"scale": 0.3}
    elif case == "negative_scale":
        kw = {"scale": -0.7}
    q, k, v = _qkv(**shape)
    ref = MATH(q, k, v, **kw)[0]
    ref_grads = _grads(ref, (q, k, v))
    for recipe in ("fp32", "fp32+attn", Attention()):
        out = scaled_dot_product_attention(q, k, v, **kw, recipe=recipe)
        assert torch.equal(out, ref)
        _assert_same(_grads(out, (q, k, v)), ref_grads)


def test_fp32_boolean_mask_equals_functional_math_sdpa() -> None:
    """A boolean mask (True = take part) as ``F.scaled_dot_product_attention`` reads it: False -> -inf (the raw
    ``_scaled_dot_product_attention_math`` op adds a bool mask as 0/1 instead, so the oracle is F under MATH, and
    the math op on the converted float mask).  A fully masked row gives zeros, as PyTorch's ``_safe_softmax``."""
    q, k, v = _qkv()
    mask = torch.rand(7, 9, generator=torch.Generator().manual_seed(3)) > 0.4
    mask[2] = False  # one fully masked query row
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref_op = MATH(q, k, v, attn_mask=torch.zeros(7, 9).masked_fill(~mask, -math.inf))[0]
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask, recipe="fp32")
    assert torch.equal(out, ref) and torch.equal(out, ref_op)
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    _assert_same(_grads(out, (q, k, v)), _grads(ref, (q, k, v)))


def test_bf16_inputs_computed_in_float32() -> None:
    """bf16 q, k, v: float32 math (as the math kernel upcasts), output back in bf16."""
    q, k, v = (t.detach().bfloat16() for t in _qkv())
    out = scaled_dot_product_attention(q, k, v, is_causal=False, recipe="fp32")
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, MATH(q.float(), k.float(), v.float())[0].bfloat16())


# ------------------------------------------------------------------------------------------------ quantized = reference
def _reference(q, k, v, x: QuantSpec, g: QuantSpec, mask=None, per_head=False):
    """Fake-quantized operands + float32 math, forward and all gradients composed by hand (module docstring of
    lowprec.nn._attention: which GEMM reads which operand along which dimension)."""

    def fq(t: torch.Tensor, spec: QuantSpec) -> torch.Tensor:  # reduction dimension last
        if per_head:  # one matrix at a time, into a tensor with t's strides (as tensorwise quantization keeps)
            out = torch.empty_like(t)
            for i in range(t.shape[0]):
                for j in range(t.shape[1]):
                    out[i, j] = fake_quantize(t[i, j], spec)
            return out
        return fake_quantize(t, spec)  # tensorwise keeps t's strides, as the emulation's shared Q(t)^T views

    sf = math.sqrt(1.0 / math.sqrt(q.shape[-1]))
    q1, k1 = q.detach() * sf, k.detach() * sf
    s = fq(q1, x) @ fq(k1, x).transpose(-1, -2)  # scores: Q' [L,E], K' [S,E]
    s = s.requires_grad_()
    p = torch.ops.aten._safe_softmax(s + mask if mask is not None else s, -1)
    vd = v.detach()
    out = fq(p.detach(), x) @ fq(vd.transpose(-1, -2), x).transpose(-1, -2)  # values: P [L,S], V^T [E,S]
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    d_p = fq(d_out, g) @ fq(vd, x).transpose(-1, -2)  # dP = dO @ V^T: dO [L,E], V [S,E]
    d_v = fq(p.detach().transpose(-1, -2), x) @ fq(d_out.transpose(-1, -2), g).transpose(-1, -2)  # P^T, dO^T
    (d_s,) = torch.autograd.grad(p, s, d_p)
    d_q = (fq(d_s, g) @ fq(k1.transpose(-1, -2), x).transpose(-1, -2)) * sf  # dS [L,S], K'^T [E,S]
    d_k = (fq(q1.transpose(-1, -2), x) @ fq(d_s.transpose(-1, -2), g).transpose(-1, -2)) * sf  # Q'^T, dS^T
    return out, (d_q, d_k.transpose(-1, -2), d_v)


@pytest.mark.parametrize("name, x, g, dims", [
    ("fp8-tensorwise", "fp8_e4m3_tensorwise", "fp8_e5m2_tensorwise", {}),
    ("mxfp8", "mxfp8_e4m3", "mxfp8_e4m3", {"lq": 40, "s": 64, "e": 64}),
])
def test_quantized_equals_fake_quantized_operands_then_float32_math(name, x, g, dims) -> None:
    q, k, v = _qkv(b=1, h=2, hk=2, **dims)
    mask = torch.randn(q.shape[-2], k.shape[-2], generator=torch.Generator().manual_seed(5))
    recipe = recipes.get(name + "+attn")
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask, recipe=recipe)
    ref, ref_grads = _reference(q, k, v, QuantSpec.named(x), QuantSpec.named(g), mask)
    assert torch.equal(out, ref)
    _assert_same(_grads(out, (q, k, v)), ref_grads)
    assert not torch.equal(out, MATH(q, k, v, attn_mask=mask)[0])  # it did quantize


def test_per_head_scaling_equals_a_loop_over_heads_and_differs_from_per_tensor() -> None:
    q, k, v = _qkv(b=2, h=3, hk=3)
    ranges = torch.tensor([1e-3, 1.0, 300.0]).reshape(1, 3, 1, 1)
    q, k, v = ((t.detach() * ranges).requires_grad_() for t in (q, k, v))
    per_head = recipes.with_attention("fp8-tensorwise", granularity="head")
    per_tensor = recipes.get("fp8-tensorwise+attn")
    out = scaled_dot_product_attention(q, k, v, recipe=per_head)
    ref, ref_grads = _reference(q, k, v, QuantSpec.named("fp8_e4m3_tensorwise"), QuantSpec.named("fp8_e5m2_tensorwise"),
                                per_head=True)
    assert torch.equal(out, ref)
    _assert_same(_grads(out, (q, k, v)), ref_grads)
    loop = torch.stack([torch.stack([scaled_dot_product_attention(q[i, j][None, None], k[i, j][None, None],
                                                                  v[i, j][None, None], recipe=per_tensor)[0, 0]
                                     for j in range(3)]) for i in range(2)])
    assert torch.equal(out, loop)
    tensorwise = scaled_dot_product_attention(q, k, v, recipe=per_tensor)
    assert not torch.equal(out[:, 0], tensorwise[:, 0])  # the small head loses its bits under one shared scale
    exact = MATH(q, k, v)[0]
    assert (out - exact)[:, 0].abs().max() < (tensorwise - exact)[:, 0].abs().max()


def test_gqa_quantized_equals_repeated_heads() -> None:
    q, k, v = _qkv(hk=2)
    rec = recipes.get("fp8-tensorwise+attn")
    out = scaled_dot_product_attention(q, k, v, enable_gqa=True, recipe=rec)
    rep = scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), recipe=rec)
    assert torch.equal(out, rep)


def test_dropout_and_bad_arguments_are_refused() -> None:
    q, k, v = _qkv()
    with pytest.raises(UsageError, match="dropout_p"):
        scaled_dot_product_attention(q, k, v, dropout_p=0.1, recipe="fp32")
    with pytest.raises(UsageError, match="attn_mask or is_causal"):
        scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(7, 9), is_causal=True, recipe="fp32")
    with pytest.raises(UsageError, match="enable_gqa"):
        scaled_dot_product_attention(q, k[:, :3], v[:, :3], enable_gqa=True, recipe="fp32")
    with pytest.raises(UsageError, match="recipe"):
        scaled_dot_product_attention(q, k, v, recipe=3)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ plain PyTorch models
class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(x).reshape(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum(1)


def test_plain_model_and_attention_mode() -> None:
    torch.manual_seed(0)
    model, x = _Block(), torch.randn(2, 5, 16)
    q, k, v = model.proj(x).reshape(2, 5, 3, 2, 8).permute(2, 0, 3, 1, 4)
    rec = recipes.get("fp8-tensorwise+attn")
    want = scaled_dot_product_attention(q, k, v, is_causal=True, recipe=rec).sum(1)
    with attention_mode(rec):
        assert torch.equal(model(x), want)
    plain = model(x)
    assert emulate_attention(model, rec) is True
    got = model(x)
    assert torch.equal(got, want)
    got.sum().backward()  # the backward GEMMs were recorded in the forward
    assert model.proj.weight.grad is not None
    assert restore_attention(model) is True and restore_attention(model) is False
    assert torch.equal(model(x), plain)
    assert emulate_attention(model, "fp8-tensorwise") is False  # no attention in the recipe: nothing done


def test_plain_model_forward_that_raises_leaves_no_mode_behind() -> None:
    from torch.overrides import _get_current_function_mode_stack

    class Broken(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("boom")

    model = Broken()
    emulate_attention(model, "fp32+attn")
    with pytest.raises(ValueError, match="boom"):
        model(torch.zeros(1))
    assert _get_current_function_mode_stack() == []


# ------------------------------------------------------------------------------------------------ transformers
def _llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def _loss(model, ids, **kw):
    model.zero_grad()
    out = model(input_ids=ids, labels=ids, **kw)
    out.loss.backward()
    return out.loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_transformers_llama() -> None:
    """fp32 attention: loss and every gradient equal transformers' sdpa under the math backend and its eager
    attention, bit for bit (with and without a padding mask); fp8 and mxfp8 attention: finite, close, different."""
    model = _llama()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    pad = torch.ones(2, 12, dtype=torch.long)
    pad[0, :3] = 0
    with sdpa_kernel(SDPBackend.MATH):
        ref, ref_grads = _loss(model, ids)
        ref_pad, _ = _loss(model, ids, attention_mask=pad)
    model.set_attn_implementation("eager")
    eager, _ = _loss(model, ids)
    model.set_attn_implementation("sdpa")

    assert emulate_attention(model, "fp32+attn") is True
    assert model.config._attn_implementation == "lowprec"
    got, got_grads = _loss(model, ids)
    assert torch.equal(got, ref) and torch.equal(got, eager)
    _assert_same(got_grads, ref_grads)
    assert torch.equal(_loss(model, ids, attention_mask=pad)[0], ref_pad)

    for name in ("fp8-tensorwise+attn", "mxfp8+attn"):
        assert emulate_attention(model, name) is True
        loss, grads = _loss(model, ids)
        assert torch.isfinite(loss) and loss != ref and abs(loss - ref) < 1e-2 * ref
        assert all(torch.isfinite(gr).all() for gr in grads)

    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    with pytest.raises(UsageError, match="dropout_p"):
        model.train()(input_ids=ids)
    assert restore_attention(model) is True
    assert model.config._attn_implementation == "sdpa"
    assert not hasattr(model.model.layers[0].self_attn, "lowprec_attention")


# ------------------------------------------------------------------------------------------------ recipes
# Recipe.hash() of every built-in, computed at the commit before Recipe.attention; nvfp4 and b200-nvfp4 since
# issue 20 (their QuantSpecs gained two_level_rule="te", TransformerEngine's NVFP4 arithmetic: other numerics)
HASHES_BEFORE_ATTENTION = {
    "fp32": "75cf73ba63c3e52b", "bf16": "7012715b06bfeb33", "bf16-pure": "9857e58bfc40452f",
    "bf16-sr": "03ae9250142bfcab", "bf16-kahan": "f9e3c231f86338df", "fp16-dynamic-loss-scale": "faf45151330c4ee6",
    "fp8-tensorwise": "aac63c05460cc1de", "fp8-delayed": "757b9d7efedc1a32", "fp8-unscaled": "be01093cdbafd483",
    "fp8-rowwise": "c83f520387df1180", "fp8-blockwise": "27f0861dc06c4461", "mxfp8": "c43e9dd3093599a9",
    "mxfp6": "6edbbf8572fe5876", "mxfp4": "28e90b330899810e", "nvfp4": "7d2a934c55e6a313",
    "trn-bf16-sr": "e7752a949c445af8", "h100-fp8": "bedc29d9f201c991", "b200-mxfp8": "acb0b70ec8575bba",
    "b200-nvfp4": "b78b93bc2f0493bd", "mi300-fp8": "2be140d33930c9d6",
}


def test_existing_recipe_hashes_unchanged_and_names_unlisted() -> None:
    assert {n: recipes.get(n).hash() for n in recipes.names()} == HASHES_BEFORE_ATTENTION
    assert all(recipes.get(n).attention is None for n in recipes.names())
    assert "attention" not in recipes.get("fp8-tensorwise").to_dict()


@pytest.mark.parametrize("name", ["fp8-tensorwise+attn", "mxfp8+attn", "bf16-sr+attn", "fp8-delayed+attn"])
def test_attention_recipes_round_trip(name: str) -> None:
    r = recipes.get(name)
    assert r.name == name and r.attention is not None
    base = recipes.get(name.removesuffix("+attn"))
    assert dataclasses.replace(r, name=base.name, attention=None) == base
    for back in (Recipe.from_dict(r.to_dict()), Recipe.from_json(r.to_json()), Recipe.from_toml(r.to_toml())):
        assert back == r and back.hash() == r.hash()
    assert r.hash() != base.hash()
    head = recipes.with_attention(base, granularity="head")
    assert Recipe.from_toml(head.to_toml()) == head and head.hash() != r.hash()


def test_with_attention_formats() -> None:
    fp8 = recipes.get("fp8-tensorwise+attn").attention
    assert fp8 is not None and fp8.scores == fp8.values
    assert fp8.scores.forward.a.spec == fp8.scores.forward.b.spec == QuantSpec.named("fp8_e4m3_tensorwise")
    assert fp8.scores.grad_input.a.spec == fp8.scores.grad_weight.a.spec == QuantSpec.named("fp8_e5m2_tensorwise")
    assert fp8.scores.grad_input.b.spec == QuantSpec.named("fp8_e4m3_tensorwise")
    mx = recipes.get("mxfp8+attn").attention
    assert mx is not None and {op.spec for op in mx.scores.operands().values()} == {QuantSpec.named("mxfp8_e4m3")}
    bf = recipes.get("bf16-sr+attn").attention
    assert bf is not None and bf.scores.forward.output_format == "bfloat16"
    delayed = recipes.get("fp8-delayed+attn").attention  # delayed scaling becomes current in attention
    assert delayed is not None and all(op.scaling == Scaling() for op in delayed.values.operands().values())
    assert recipes.get("fp32+attn").attention == Attention()


def test_attention_validation_names_the_field() -> None:
    with pytest.raises(UsageError, match="Attention.granularity"):
        Attention(granularity="block")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="Attention.scores must be a LinearRecipe"):
        Attention(scores="fp8")  # type: ignore[arg-type]
    delayed = Operand(spec=QuantSpec.named("fp8_e4m3_tensorwise"), scaling=Scaling(kind="delayed"))
    lin = LinearRecipe(forward=dataclasses.replace(LinearRecipe().forward, a=delayed))
    with pytest.raises(UsageError, match=r"Attention.values.forward.a: delayed scaling"):
        Attention(values=lin)
    with pytest.raises(UsageError, match="Recipe.attention must be an Attention"):
        Recipe(attention="fp8")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"recipe.attention: unknown key\(s\) \['heads'\]"):
        Recipe.from_dict({"attention": {"heads": 2}})
    with pytest.raises(UsageError, match="Attention.granularity"):
        Recipe.from_dict({"attention": {"granularity": "row"}})
    with pytest.raises(UsageError, match="unknown recipe 'nope\\+attn'"):
        recipes.get("nope+attn")
    assert lowprec.recipes.Attention is Attention
