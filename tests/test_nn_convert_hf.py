"""``convert`` on Hugging Face transformers models: GPT-2's ``Conv1D``, tied heads, the conversion report and the
warning about modules that may carry GEMMs lowprec does not emulate (MoE experts, routers).

Oracles: the same model with every ``Conv1D`` replaced by an ``nn.Linear`` holding ``W^T`` (``Conv1D`` computes
``x @ W + b``, so that Linear is the same layer) and converted: loss and every gradient bit-identical; the
unconverted model (state dicts, restored forward); Parameter identity for tied weights; the module layout of the
tiny configs written out below.
"""

from __future__ import annotations

import copy
import time
import warnings

import pytest
import torch
from torch import nn

import lowprec
from lowprec._errors import UsageError
from lowprec.nn import EmulatedConv1D, EmulatedExperts, EmulatedLinear, conversion_report

transformers = pytest.importorskip("transformers")

GPT2_CONV1D = [f"transformer.h.{i}.{m}" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                                      "mlp.c_proj")]


def _gpt2(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # no dropout: deterministic
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _llama(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, tie_word_embeddings=True)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _mixtral(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=128)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed))


def _conv1d_as_linear(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose Conv1D modules are nn.Linear with weight W^T (values copied)."""
    model = copy.deepcopy(model)
    for name, mod in list(model.named_modules()):
        if type(mod).__name__ == "Conv1D":
            lin = nn.Linear(mod.nx, mod.nf)
            with torch.no_grad():
                lin.weight.copy_(mod.weight.t())
                lin.bias.copy_(mod.bias)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, lin)
    return model


def _loss_and_grads(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(ids, labels=ids).loss
    loss.backward()
    grads = {}
    for n, p in model.named_parameters():
        assert p.grad is not None, n
        grads[n] = p.grad
    return loss.detach(), grads


# ------------------------------------------------------------------------------------------------ GPT-2 Conv1D
@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "fp8-rowwise", "bf16"])
def test_gpt2_conv1d_bit_identical_to_linear_with_transposed_weight(recipe: str) -> None:
    """Every Conv1D becomes an EmulatedConv1D sharing its Parameters; loss and every parameter gradient equal
    (torch.equal) those of the same model whose Conv1Ds were first replaced by nn.Linear(W^T) and converted (the
    Conv1D weight gradient is the transpose of the Linear's).  Row-wise scaling is included because it tells
    W from W^T apart: the reduction dimension must be the right one."""
    base = _gpt2()
    ours = lowprec.convert(copy.deepcopy(base), recipe)
    ref = lowprec.convert(_conv1d_as_linear(base), recipe)
    for name in GPT2_CONV1D:
        mod, orig = ours.get_submodule(name), base.get_submodule(name)
        assert type(mod) is EmulatedConv1D and isinstance(mod, EmulatedLinear)
        assert mod.weight.shape == orig.weight.shape  # [in, out] as in Conv1D
        assert (mod.in_features, mod.out_features) == (orig.nx, orig.nf)
        assert type(ref.get_submodule(name)) is EmulatedLinear
    loss, grads = _loss_and_grads(ours, _ids())
    loss_ref, grads_ref = _loss_and_grads(ref, _ids())
    assert torch.equal(loss, loss_ref)
    assert grads.keys() == grads_ref.keys()
    for n, g in grads.items():
        conv1d_weight = n.endswith(".weight") and n.removesuffix(".weight") in GPT2_CONV1D
        expect = grads_ref[n].t() if conv1d_weight else grads_ref[n]
        assert torch.equal(g, expect), n


def test_gpt2_conv1d_shares_parameters_and_state_dict_round_trips() -> None:
    """The converted model holds the very same Parameter objects (an optimizer built before still steps it); its
    state dict has the keys and shapes of the unconverted one and loads into an unconverted GPT-2 (strict), and an
    unconverted state dict loads into the converted model."""
    base = _gpt2()
    params = list(base.parameters())
    sd_before = {k: v.shape for k, v in base.state_dict().items()}
    lowprec.convert(base, "fp8-tensorwise")
    assert all(a is b for a, b in zip(base.parameters(), params, strict=True))
    sd = base.state_dict()
    assert {k: v.shape for k, v in sd.items()} == sd_before
    plain = _gpt2(seed=5)
    plain.load_state_dict(sd, strict=True)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), sd.values(), strict=True))
    other = lowprec.convert(_gpt2(seed=7), "fp8-tensorwise")
    other.load_state_dict(_gpt2(seed=0).state_dict(), strict=True)
    assert torch.equal(other(_ids()).logits, base(_ids()).logits)


def test_gpt2_unconvert_restores_conv1d() -> None:
    """unconvert gives back transformers Conv1D modules (the original class) sharing the Parameters, and the
    forward equals the never-converted model's exactly."""
    base = _gpt2()
    model = lowprec.convert(copy.deepcopy(base), "fp8-tensorwise")
    weights = {n: model.get_submodule(n).weight for n in GPT2_CONV1D}
    lowprec.unconvert(model)
    conv1d = transformers.pytorch_utils.Conv1D
    for n in GPT2_CONV1D:
        mod = model.get_submodule(n)
        assert type(mod) is conv1d and mod.weight is weights[n]
        assert (mod.nf, mod.nx) == (base.get_submodule(n).nf, base.get_submodule(n).nx)
    with torch.no_grad():
        assert torch.equal(model(_ids()).logits, base(_ids()).logits)
    with pytest.raises(UsageError):
        conversion_report(model)


def test_gpt2_fp32_recipe_is_bit_identical_to_unconverted() -> None:
    """The fp32 recipe emulates nothing; on GPT-2 its loss and gradients equal the unconverted model's exactly
    (checked on this CPU build: the emulated Conv1D runs ``x @ (W^T)^T`` on a contiguous W^T copy where Conv1D runs
    ``addmm(b, x, W)``, and the float32 results agree bit for bit)."""
    base = _gpt2()
    conv = lowprec.convert(copy.deepcopy(base), "fp32")
    assert {n for n, m in conv.named_modules() if isinstance(m, EmulatedLinear)} == set(GPT2_CONV1D) | {"lm_head"}
    loss, grads = _loss_and_grads(conv, _ids())
    loss_ref, grads_ref = _loss_and_grads(base, _ids())
    assert torch.equal(loss, loss_ref)
    for n, g in grads.items():
        assert torch.equal(g, grads_ref[n]), n


def test_gpt2_report_and_no_warning() -> None:
    """A plain GPT-2 (Conv1D, Embedding, LayerNorm, tied lm_head) converts without a warning; the report lists the
    eight Conv1Ds as converted with the recipe, and lm_head as kept by fp8-tensorwise's "*lm_head*" pattern, its
    weight shared with the token embedding."""
    model = _gpt2()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lowprec.convert(model, "fp8-tensorwise")
    report = conversion_report(model)
    assert [e.name for e in report.converted] == GPT2_CONV1D
    assert all(e.kind == "conv1d" and e.type == "Conv1D" and e.recipe.startswith("fp8-tensorwise")
               for e in report.converted)
    assert report["lm_head"].status == "kept" and report["lm_head"].reason == "keep_high_precision '*lm_head*'"
    assert "transformer.wte" in report["lm_head"].note
    assert report.unknown == () and report.unemulated == ()
    text = str(report)
    assert "8 converted, 1 kept" in text and "transformer.h.1.mlp.c_proj" in text and "lm_head" in text
    assert model.lm_head.weight is model.transformer.wte.weight


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_gpt2_converted_compiles() -> None:
    """torch.compile of a converted GPT-2 (about 100 s on 2 CPU cores, hence slow): the compiled loss equals the
    eager one to float32 rounding (inductor may fuse and reorder float32 work outside the emulated GEMMs) and its
    gradients are finite.  Dynamo itself reads ``.grad`` of a non-leaf tensor while tracing the model and warns;
    that warning is ignored here (not raised by lowprec code)."""
    model = lowprec.convert(_gpt2(), "fp8-tensorwise")
    eager = model(_ids(), labels=_ids()).loss.detach()
    compiled = torch.compile(model)
    t0 = time.perf_counter()
    loss = compiled(_ids(), labels=_ids()).loss
    loss.backward()
    assert time.perf_counter() - t0 < 600
    torch.testing.assert_close(loss.detach(), eager, rtol=1e-5, atol=1e-6)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


# ------------------------------------------------------------------------------------------------ tied heads
def test_llama_tied_head_survives_and_keep_rule_applies() -> None:
    """Llama with tie_word_embeddings: converting the head (fp32 recipe, no keep rules) keeps it the same
    Parameter as the embedding; keep_high_precision=("lm_head",) leaves the head an nn.Linear, listed as kept."""
    model = _llama()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    lowprec.convert(model, "fp32")
    assert type(model.lm_head) is EmulatedLinear
    assert model.lm_head.weight is model.model.embed_tokens.weight
    loss, _ = _loss_and_grads(model, _ids())
    assert torch.isfinite(loss)

    model = _llama()
    recipe = lowprec.Recipe(name="fp8-keep-head", linear=lowprec.recipes.get("fp8-tensorwise").linear,
                            keep_high_precision=("lm_head",))
    lowprec.convert(model, recipe)
    assert type(model.lm_head) is nn.Linear
    assert model.lm_head.weight is model.model.embed_tokens.weight
    report = conversion_report(model)
    entry = report["lm_head"]
    assert (entry.status, entry.kind, entry.reason) == ("kept", "linear", "keep_high_precision 'lm_head'")
    assert "model.embed_tokens" in entry.note
    projections = [f"model.layers.{i}.{p}" for i in range(2) for p in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    assert [e.name for e in report.converted] == projections
    assert report.unknown == ()


# ---------------------------------------------------------------------------------------- MoE and unknown modules
def test_mixtral_converts_its_experts_and_keeps_the_router() -> None:
    """Mixtral's experts (3-D gate_up_proj / down_proj) are converted (EmulatedExperts, kind "experts"); its router
    (a 2-D weight used through F.linear) stays float32 by design and is listed as kept, so nothing is warned about.
    Oracle for the bits: tests/test_nn_experts.py (EmulatedExperts equals a per-expert EmulatedLinear loop)."""
    model = _mixtral()
    ids = _ids()
    before = model(input_ids=ids, labels=ids).loss
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lowprec.convert(model, "fp8-tensorwise")
    report = conversion_report(model)
    assert report.unknown == ()
    assert report["model.layers.0.mlp.experts"].kind == "experts"
    assert report["model.layers.0.mlp.experts"].status == "converted"
    assert isinstance(model.model.layers[0].mlp.experts, EmulatedExperts)
    gate = report["model.layers.0.mlp.gate"]
    assert (gate.kind, gate.status) == ("router", "kept") and "float32 by design" in gate.reason
    assert {e.name for e in report.converted} == {f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"} | {
        "model.layers.0.mlp.experts"}
    loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss) and not torch.equal(loss, before)
    loss.backward()
    assert model.model.layers[0].mlp.experts.gate_up_proj.grad is not None
    lowprec.unconvert(model)
    assert type(model.model.layers[0].mlp.experts).__name__ == "MixtralExperts"
    assert torch.equal(model(input_ids=ids, labels=ids).loss, before)


class _OddExperts(nn.Module):
    """An expert module of a layout convert does not know (one 3-D weight [E, out, in], dense mixture)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 8, 8) * 0.1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.einsum("eoi,bti->bto", self.weight, h) / 4


class _Moe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.experts = _OddExperts()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.experts(self.proj(h))


def test_unknown_experts_warn_error_or_are_kept() -> None:
    """An expert module convert does not know warns (naming it, its 3-D parameter and the fix); on_unknown="error"
    raises UsageError leaving the model untouched; "ignore" converts silently; naming it in keep_high_precision
    moves it to "kept", no warning."""
    model = _Moe()
    with pytest.warns(UserWarning, match=r"1 module\(s\) that may carry GEMMs were left in float32") as record:
        lowprec.convert(model, "fp8-tensorwise")
    assert len(record) == 1
    message = str(record[0].message)
    assert "experts (_OddExperts, 3-D parameter weight [4, 8, 8])" in message and "keep_high_precision" in message
    assert [e.name for e in conversion_report(model).unknown] == ["experts"]
    assert "1 unknown" in str(conversion_report(model))
    lowprec.unconvert(model)
    with pytest.raises(UsageError, match="keep_high_precision") as err:
        lowprec.convert(model, "fp8-tensorwise", on_unknown="error")
    assert "experts" in str(err.value)
    assert not any(isinstance(m, EmulatedLinear) for m in model.modules())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lowprec.convert(model, "fp8-tensorwise", on_unknown="ignore")
        assert len(conversion_report(model).unknown) == 1
        lowprec.unconvert(model)
        fp8 = lowprec.recipes.get("fp8-tensorwise")
        recipe = lowprec.Recipe(name="fp8-odd-kept", linear=fp8.linear,
                                keep_high_precision=(*fp8.keep_high_precision, "experts"))
        lowprec.convert(model, recipe)
    report = conversion_report(model)
    assert report.unknown == ()
    assert report["experts"].status == "kept" and report["experts"].reason == "keep_high_precision 'experts'"
    with pytest.raises(ValueError, match="on_unknown"):
        lowprec.convert(_Moe(), "fp8-tensorwise", on_unknown="loud")  # type: ignore[arg-type]


class _Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.norm = nn.LayerNorm(8)
        self.rms = nn.RMSNorm(8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.proj = nn.Linear(8, 8)
        self.mha = nn.MultiheadAttention(8, 2)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.rms(self.norm(self.embed(ids)))
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.proj(self.mha(h, h, h)[0]) * self.scale


def test_detection_plain_modules_and_convolutions() -> None:
    """Embedding, LayerNorm, RMSNorm and 1-D parameters are not GEMMs: not listed.  A convolution is a GEMM lowprec
    does not emulate: listed as "unemulated" without a warning.  nn.MultiheadAttention (2-D in_proj_weight) and its
    out_proj (an nn.Linear subclass that convert does not swap) are unknown and warned about."""
    model = _Custom()
    with pytest.warns(UserWarning, match=r"2 module\(s\)") as record:
        lowprec.convert(model, "fp32")
    assert len(record) == 1
    report = conversion_report(model)
    assert [(e.name, e.status) for e in report.entries] == [
        ("conv", "unemulated"), ("proj", "converted"), ("mha", "unknown"), ("mha.out_proj", "unknown"),
    ]
    assert report["mha"].params == ("2-D parameter in_proj_weight [24, 8]",)
    assert report["conv"].kind == "convolution"
    model(torch.randint(0, 10, (2, 5)))  # still runs


def test_keep_types_matches_the_module_itself() -> None:
    """keep_types names the class of an enclosing module or of the module itself ("MultiheadAttention" keeps mha
    and its out_proj; "Linear" keeps proj), each listed as kept with the class named."""
    model = _Custom()
    recipe = lowprec.Recipe(name="keep", keep_types=("MultiheadAttention", "Linear"))
    with pytest.raises(UsageError, match="converts no module"):
        lowprec.convert(model, recipe)
    recipe = lowprec.Recipe(name="keep", keep_types=("MultiheadAttention",))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lowprec.convert(model, recipe)
    report = conversion_report(model)
    assert report["mha"].reason == report["mha.out_proj"].reason == "keep_types 'MultiheadAttention'"
    assert report["proj"].status == "converted"


def test_convert_with_attention_emulates_q_k_and_p_v() -> None:
    """A recipe with attention ("fp8-tensorwise+attn") makes convert switch the transformers model to the "lowprec"
    attention implementation and the report say how Q K^T and P V run; without it the report says attention is not
    emulated.  Oracle: the same model converted without attention, then ``emulate_attention`` by hand with the
    same recipe: equal loss and gradients; unconvert restores sdpa and the float32 loss."""
    from lowprec.nn import emulate_attention

    ids = _ids()
    ref = _llama()
    before = ref(input_ids=ids, labels=ids).loss
    lowprec.convert(ref, "fp8-tensorwise")
    assert conversion_report(ref).attention.startswith("not emulated")
    assert "'fp8-tensorwise+attn' emulates them" in str(conversion_report(ref))
    no_attn = ref(input_ids=ids, labels=ids).loss
    assert emulate_attention(ref, lowprec.recipes.get("fp8-tensorwise+attn"))
    hand = ref(input_ids=ids, labels=ids).loss
    hand.backward()

    model = _llama()
    lowprec.convert(model, "fp8-tensorwise+attn")
    report = conversion_report(model)
    assert report.attention.startswith("emulated per tensor: scores Q K^T e4m3fn*e4m3fn")
    assert "softmax float32" in str(report) and model.config._attn_implementation == "lowprec"
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.equal(loss, hand) and not torch.equal(loss, no_attn)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    lowprec.unconvert(model)
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(model(input_ids=ids, labels=ids).loss, before)


def test_an_override_naming_the_router_emulates_it() -> None:
    """Routers stay float32 unless the recipe says otherwise: an override naming them ("*.mlp.gate") converts
    their GEMM.  Oracle: an EmulatedLinear built from an nn.Linear holding a copy of the router weight gives the same
    router logits and the same weight gradient; the router keeps its module path, Parameter and state-dict key,
    and unconvert gives back a MixtralTopKRouter with the float32 output.  A stochastic recipe is refused."""
    fp8 = lowprec.recipes.get("fp8-tensorwise")
    recipe = lowprec.Recipe(name="fp8-router", linear=fp8.linear, keep_high_precision=fp8.keep_high_precision,
                            overrides=(("*.mlp.gate", fp8.linear),))
    model = _mixtral()
    router = model.model.layers[0].mlp.gate
    weight = router.weight
    h = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(3))
    ref_logits = router(h)[0]
    keys = set(model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lowprec.convert(model, recipe)
    entry = conversion_report(model)["model.layers.0.mlp.gate"]
    assert (entry.kind, entry.status) == ("router", "converted") and "override '*.mlp.gate'" in entry.recipe
    assert model.model.layers[0].mlp.gate is router and router.weight is weight and set(model.state_dict()) == keys

    shell = nn.Linear(32, 4, bias=False)
    shell.weight = nn.Parameter(weight.detach().clone())
    hand = EmulatedLinear.from_linear(shell, fp8.linear, seed=recipe.seed, name="model.layers.0.mlp.gate")
    logits, scores, indices = router(h)
    expect = hand(h.reshape(-1, 32))
    assert torch.equal(logits, expect) and not torch.equal(logits, ref_logits)
    assert torch.equal(indices, torch.topk(torch.softmax(expect, -1), 2, dim=-1).indices)
    logits.square().sum().backward()
    expect.square().sum().backward()
    assert torch.equal(weight.grad, shell.weight.grad)
    lowprec.unconvert(model)
    assert type(model.model.layers[0].mlp.gate).__name__ == "MixtralTopKRouter"
    assert torch.equal(router(h)[0], ref_logits)

    stochastic = lowprec.recipes.get("nvfp4")  # stochastic rounding of the gradients
    assert any(op.spec is not None and op.spec.rounding == "stochastic" for op in stochastic.linear.operands().values())
    bad = lowprec.Recipe(name="sr-router", linear=fp8.linear, overrides=(("*.mlp.gate", stochastic.linear),))
    untouched = _mixtral()
    with pytest.raises(UsageError, match="router 'model.layers.0.mlp.gate'.*stochastic"):
        lowprec.convert(untouched, bad)
    assert not any(isinstance(m, EmulatedLinear) for m in untouched.modules())  # refused before any change
