"""``EmulatedExperts``: transformers' Mixtral-layout MoE experts with recipe-emulated per-expert GEMMs.

Oracles: a per-expert loop of ``EmulatedLinear`` modules (weights: copies of ``gate_up_proj[e]`` and
``down_proj[e]``, names ``{name}.{e}.{proj}``) for every recipe, bit for bit in output and in the gradients of
hidden_states, gate_up_proj, down_proj and top_k_weights; the original transformers module (eager experts
implementation, plain autograd) for the float32 recipe; the state-dict contract of the module docstring.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lowprec
from lowprec import UsageError
from lowprec.nn import EmulatedLinear
from lowprec.nn._experts import EmulatedExperts, is_experts

transformers = pytest.importorskip("transformers")

H, INTER, E, K, T = 32, 64, 4, 2, 24


def _lin(name: str) -> lowprec.recipes.LinearRecipe:
    return lowprec.recipes.get(name).linear


def _mixtral(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(hidden_size=H, intermediate_size=INTER, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=E, num_experts_per_tok=K,
                                     vocab_size=128)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _qwen3(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(hidden_size=H, intermediate_size=INTER, moe_intermediate_size=INTER,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                      num_experts=E, num_experts_per_tok=K, vocab_size=128, head_dim=8)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _qwen2(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)  # shared_expert (an MLP of nn.Linear) and shared_expert_gate are left to ``convert``
    cfg = transformers.Qwen2MoeConfig(hidden_size=H, intermediate_size=INTER, moe_intermediate_size=INTER,
                                      shared_expert_intermediate_size=INTER, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, num_experts=E,
                                      num_experts_per_tok=K, vocab_size=128)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _experts(model: nn.Module) -> nn.Module:
    return model.model.layers[0].mlp.experts


def _routing(seed: int, starve: int | None = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random hidden states and top-k routing; expert ``starve`` receives no token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    allowed = [e for e in range(E) if e != starve]
    idx = torch.stack([torch.tensor(allowed)[torch.randperm(len(allowed), generator=g)[:K]] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    return x, idx, w


def _eager_original(mod: nn.Module, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The transformers module's own eager loop (whatever ``config._experts_implementation`` says)."""
    fwd = type(mod).forward
    return fwd.__wrapped__(mod, x, idx, w)  # type: ignore[no-any-return]


class _Reference(nn.Module):
    """Per-expert loop of EmulatedLinear modules over copies of the expert weights (the oracle)."""

    def __init__(self, mod: nn.Module, rec: lowprec.recipes.LinearRecipe, seed: int, name: str) -> None:
        super().__init__()
        self.act_fn = mod.act_fn
        self.gu = nn.ModuleList()
        self.dn = nn.ModuleList()
        for e in range(E):
            for lst, p, proj in ((self.gu, mod.gate_up_proj, "gate_up_proj"), (self.dn, mod.down_proj, "down_proj")):
                lin = nn.Linear(p.shape[2], p.shape[1], bias=False)
                lin.weight = nn.Parameter(p[e].detach().clone())
                lst.append(EmulatedLinear.from_linear(lin, rec, seed=seed, name=f"{name}.{e}.{proj}"))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(E):
            top_k_pos, token_idx = torch.where(idx.t() == e)  # the original's row order: by (k, token)
            if token_idx.numel() == 0:
                continue
            gate, up = self.gu[e](x[token_idx]).chunk(2, -1)
            y = self.dn[e](self.act_fn(gate) * up) * w[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, y)
        return out

    def grads(self) -> tuple[torch.Tensor, torch.Tensor]:
        def g(lst: nn.ModuleList) -> torch.Tensor:
            return torch.stack([m.weight.grad if m.weight.grad is not None else torch.zeros_like(m.weight)
                                for m in lst])
        return g(self.gu), g(self.dn)


def _run(fn, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fn(x, idx, w)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    (out * g).sum().backward()
    assert x.grad is not None and w.grad is not None
    return out.detach(), x.grad, w.grad


def _assert_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, what
    assert torch.equal(a, b), f"{what}: max |diff| {(a - b).abs().max().item()}"


RECIPES = ["fp8-tensorwise", "mxfp8", "bf16-sr", "fp8-rowwise", "nvfp4"]


# ------------------------------------------------------------------------------------------------ detection
def test_is_experts_detects_mixtral_layout_only() -> None:
    model = _mixtral()
    names = {n for n, m in model.named_modules() if is_experts(m)}
    assert names == {"model.layers.0.mlp.experts"}  # not the router, not the block, not linears

    class FakeExperts(nn.Module):  # transposed (gpt_oss-like) layout
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.zeros(E, H, 2 * INTER))
            self.down_proj = nn.Parameter(torch.zeros(E, INTER, H))
            self.act_fn = torch.tanh

    assert not is_experts(FakeExperts())
    with pytest.raises(UsageError, match="Mixtral-layout"):
        EmulatedExperts.from_module(FakeExperts(), _lin("fp8-tensorwise"), seed=0, name="x")


# ------------------------------------------------------------------------------------------------ bit exactness
@pytest.mark.parametrize("recipe", RECIPES)
def test_equals_per_expert_emulated_linear_loop(recipe: str) -> None:
    mod = _experts(_mixtral())
    ref = _Reference(mod, _lin(recipe), seed=5, name="moe")
    em = EmulatedExperts.from_module(mod, _lin(recipe), seed=5, name="moe")
    x, idx, w = _routing(1, starve=3)
    want = _run(ref, x, idx, w)
    got = _run(em, x, idx, w)
    for what, a, b in zip(("output", "grad hidden_states", "grad top_k_weights"), got, want, strict=True):
        _assert_equal(a, b, f"{recipe} {what}")
    gu_ref, dn_ref = ref.grads()
    assert em.gate_up_proj.grad is not None and em.down_proj.grad is not None
    _assert_equal(em.gate_up_proj.grad, gu_ref, f"{recipe} grad gate_up_proj")
    _assert_equal(em.down_proj.grad, dn_ref, f"{recipe} grad down_proj")
    assert not em.gate_up_proj.grad[3].any() and not em.down_proj.grad[3].any()  # the starved expert
    assert em.gate_up_proj.grad[0].any()
    assert not torch.equal(got[0], _eager_original(mod, x, idx, w).detach())  # it does emulate something


def test_stochastic_streams_follow_the_step_and_the_expert() -> None:
    mod = _experts(_mixtral())
    rec = _lin("nvfp4")  # stochastic rounding of dY in both backward GEMMs
    em = EmulatedExperts.from_module(mod, rec, seed=5, name="moe")
    ref = _Reference(mod, rec, seed=5, name="moe")
    x, idx, w = _routing(2, starve=None)
    first = _run(em, x, idx, w)[1]
    second = _run(em, x, idx, w)[1]
    assert not torch.equal(first, second)  # step 2 draws new bits
    assert int(em.lp_step) == 2
    for m in [*ref.gu, *ref.dn]:  # the reference at the same step
        m.lp_step.fill_(1)
    _assert_equal(second, _run(ref, x, idx, w)[1], "step 2")
    other = EmulatedExperts.from_module(mod, rec, seed=5, name="other")  # other module name: other streams
    assert not torch.equal(_run(other, x, idx, w)[1], first)
    em.eval()
    _assert_equal(_run(em, x, idx, w)[1], second, "eval reuses the step")
    assert int(em.lp_step) == 2


def test_delayed_scaling_keeps_per_expert_histories() -> None:
    mod = _experts(_mixtral())
    rec = _lin("fp8-delayed")
    em = EmulatedExperts.from_module(mod, rec, seed=0, name="moe")
    ref = _Reference(mod, rec, seed=0, name="moe")
    for step, starve in enumerate((3, 0, None)):
        x, idx, w = _routing(10 + step, starve=starve)
        for a, b in zip(_run(em, x, idx, w), _run(ref, x, idx, w), strict=True):
            _assert_equal(a, b, f"step {step}")
    for proj, lst in (("gate_up_proj", ref.gu), ("down_proj", ref.dn)):
        for role in ("input", "weight", "grad_output"):
            hist = getattr(em, f"amax_history_{proj}_{role}")
            assert hist.shape[0] == E
            _assert_equal(hist, torch.stack([getattr(m, f"amax_history_{role}") for m in lst]), f"{proj} {role}")
    assert not em.amax_history_gate_up_proj_input[3, 2]  # expert 3 had no token in step 0 (oldest entry)


def test_fp32_recipe_equals_original_module() -> None:
    mod = _experts(_mixtral())
    em = EmulatedExperts.from_module(mod, _lin("fp32"), seed=0, name="moe")
    x, idx, w = _routing(3, starve=1)
    got = _run(em, x, idx, w)
    gu, dn = em.gate_up_proj.grad.clone(), em.down_proj.grad.clone()  # type: ignore[union-attr]
    em.gate_up_proj.grad = em.down_proj.grad = None
    want = _run(lambda *a: _eager_original(mod, *a), x, idx, w)
    for what, a, b in zip(("output", "grad hidden_states", "grad top_k_weights"), got, want, strict=True):
        _assert_equal(a, b, f"fp32 {what}")
    _assert_equal(gu, mod.gate_up_proj.grad, "fp32 grad gate_up_proj")
    _assert_equal(dn, mod.down_proj.grad, "fp32 grad down_proj")


# ------------------------------------------------------------------------------------------------ whole models
def _swap(model: nn.Module, recipe: str) -> list[EmulatedExperts]:
    out = []
    for layer in model.model.layers:
        name = f"model.layers.{layer.self_attn.layer_idx}.mlp.experts"
        layer.mlp.experts = EmulatedExperts.from_module(layer.mlp.experts, _lin(recipe), seed=0, name=name)
        out.append(layer.mlp.experts)
    return out


@pytest.mark.parametrize("build", [_mixtral, _qwen2, _qwen3])
def test_whole_model_loss_state_dict_and_round_trip(build) -> None:
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    base = build()
    keys = list(base.state_dict())
    params = {n: p for n, p in base.named_parameters()}
    ref_loss = base(input_ids=ids, labels=ids).loss
    originals = [layer.mlp.experts for layer in base.model.layers]
    _swap(base, "fp8-tensorwise")
    assert list(base.state_dict()) == keys
    assert {n: p for n, p in base.named_parameters()}.keys() == params.keys()
    assert all(p is params[n] for n, p in base.named_parameters())
    assert isinstance(base.model.layers[0].mlp.gate.weight, nn.Parameter)  # the router: untouched
    loss = base(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss) and loss.item() != ref_loss.item()
    loss.backward()
    assert base.model.layers[0].mlp.experts.gate_up_proj.grad is not None
    for layer, orig in zip(base.model.layers, originals, strict=True):
        layer.mlp.experts = layer.mlp.experts.to_module()
        assert layer.mlp.experts is orig
    assert all(p is params[n] for n, p in base.named_parameters())
    assert torch.equal(base(input_ids=ids, labels=ids).loss, ref_loss)


def test_bf16_module_deepcopy_and_hooks() -> None:
    mod = _experts(_mixtral()).to(torch.bfloat16)
    calls: list[int] = []
    mod.register_forward_hook(lambda *_: calls.append(1))
    rec = _lin("fp8-tensorwise")
    em = EmulatedExperts.from_module(mod, rec, seed=0, name="moe")
    ref = _Reference(mod, rec, seed=0, name="moe")
    x, idx, w = _routing(4)
    got = _run(em, x.bfloat16(), idx, w.bfloat16())
    assert calls == [1]  # the original's hooks moved over
    for what, a, b in zip(("output", "grad hidden_states", "grad top_k_weights"), got,
                          _run(ref, x.bfloat16(), idx, w.bfloat16()), strict=True):
        _assert_equal(a, b, f"bf16 {what}")
    assert em.gate_up_proj.grad is not None and em.gate_up_proj.grad.dtype == torch.bfloat16
    _assert_equal(em.gate_up_proj.grad, ref.grads()[0], "bf16 grad gate_up_proj")
    twin = copy.deepcopy(em)
    assert twin.gate_up_proj is not em.gate_up_proj
    _assert_equal(twin(x.bfloat16(), idx, w.bfloat16()), got[0], "deepcopy")
    assert twin.to_module().gate_up_proj is twin.gate_up_proj
