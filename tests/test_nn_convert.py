"""``convert``/``unconvert``, ``EmulatedLinear`` and ``functional.matmul``.

Oracles: plain PyTorch (``nn.Linear``, ``x @ W.t() + b``, ``a @ b`` and autograd) for the float32 recipe; the
documented rules of ``convert`` (which modules are swapped, which errors are raised); the state-dict contract in
the ``_linear`` docstring; a second identical run for determinism; the eager path for ``torch.compile``; the
torchao float8 SQNR floor from ``lowprec.testing.TOLERANCES`` for fp8; Higham's a-priori bound
``|fl(sum) - sum| <= gamma_n * sum |terms|``, ``gamma_n = n u / (1 - n u)``, for float32 reductions whose order
differs from autograd's.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowprec
import lowprec.optim  # not imported by ``import lowprec``
from lowprec.nn import EmulatedLinear
from lowprec.nn.functional import matmul
from lowprec.recipes import Gemm, LinearRecipe, Recipe
from lowprec.testing import TOLERANCES, assert_bitwise_equal, sqnr_db


# ------------------------------------------------------------------------------------------------ models
class Attn(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.proj(torch.tanh(q) * k + v)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = Attn(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class Net(nn.Module):
    """Linears at several depths, with and without bias, plus an embedding-like and a head linear."""

    def __init__(self, d: int = 8, vocab: int = 5) -> None:
        super().__init__()
        self.embed = nn.Linear(vocab, d)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.lm_head(h)


LINEAR_NAMES = [
    "embed", "blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.0", "blocks.0.mlp.2",
    "blocks.1.attn.qkv", "blocks.1.attn.proj", "blocks.1.mlp.0", "blocks.1.mlp.2", "lm_head",
]


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _linears(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def _converted(model: nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, EmulatedLinear)}


def _fp32_with(**changes: object) -> Recipe:
    return dataclasses.replace(lowprec.recipes.get("fp32"), name="fp32-custom", **changes)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ convert / unconvert
def test_convert_swaps_every_linear_sharing_parameters() -> None:
    """With no keep rules every nn.Linear becomes an EmulatedLinear holding the very same Parameter objects (so an
    optimizer built before conversion still steps the model), in place; the model's parameter list is unchanged.

    Oracle: identity of the Parameter objects and the list of Linear names written out above.
    """
    model = _net()
    before = _linears(model)
    assert sorted(before) == sorted(LINEAR_NAMES)
    params_before = list(model.parameters())
    out = lowprec.convert(model, "fp32")
    assert out is model
    assert _converted(model) == set(LINEAR_NAMES)
    for name, old in before.items():
        new = model.get_submodule(name)
        assert type(new) is EmulatedLinear
        assert new.weight is old.weight
        assert new.bias is old.bias  # None for the bias-free projections
        assert (new.in_features, new.out_features) == (old.in_features, old.out_features)
    assert model.get_submodule("blocks.0.attn.proj").bias is None
    params_after = list(model.parameters())
    assert len(params_after) == len(params_before)
    assert all(a is b for a, b in zip(params_after, params_before, strict=True))
    assert model.lowprec_recipe == lowprec.recipes.get("fp32")


def test_keep_high_precision_patterns() -> None:
    """fnmatch patterns in keep_high_precision leave matching linears alone: the fp8-tensorwise defaults keep
    "embed" and "lm_head"; a custom pattern keeps one block's MLP (oracle: fnmatch on the names listed above)."""
    model = _net()
    lowprec.convert(model, "fp8-tensorwise")
    assert _converted(model) == set(LINEAR_NAMES) - {"embed", "lm_head"}
    assert type(model.embed) is nn.Linear and type(model.lm_head) is nn.Linear

    model = _net()
    lowprec.convert(model, _fp32_with(keep_high_precision=("blocks.1.mlp.*", "embed")))
    assert _converted(model) == set(LINEAR_NAMES) - {"blocks.1.mlp.0", "blocks.1.mlp.2", "embed"}


def test_keep_types() -> None:
    """keep_types names module classes whose linears (at any depth below them) stay plain: "Attn" keeps both
    attention projections of both blocks, "Block" keeps everything inside the blocks (oracle: the model layout)."""
    model = _net()
    lowprec.convert(model, _fp32_with(keep_types=("Attn",)))
    attn = {n for n in LINEAR_NAMES if ".attn." in n}
    assert _converted(model) == set(LINEAR_NAMES) - attn

    model = _net()
    lowprec.convert(model, _fp32_with(keep_types=("Block",)))
    assert _converted(model) == {"embed", "lm_head"}


def test_module_filter() -> None:
    """module_filter(module, name) returning False leaves that linear alone; it is called with the module and its
    qualified name (oracle: the filter's own record of its calls)."""
    seen: list[tuple[str, int]] = []

    def only_wide(mod: nn.Module, name: str) -> bool:
        seen.append((name, mod.out_features))
        assert mod is _linears(model)[name]
        return mod.out_features > 8

    model = _net()
    lowprec.convert(model, "fp32", module_filter=only_wide)
    assert sorted(n for n, _ in seen) == sorted(LINEAR_NAMES)
    assert _converted(model) == {n for n, width in seen if width > 8}
    assert _converted(model) == {"blocks.0.attn.qkv", "blocks.0.mlp.0", "blocks.1.attn.qkv", "blocks.1.mlp.0"}


def test_overrides_apply_first_match() -> None:
    """Per-module overrides: the first matching pattern's LinearRecipe is used, others get recipe.linear (oracle:
    the Recipe.overrides docstring)."""
    bf16 = lowprec.recipes.get("bf16").linear
    mx = lowprec.recipes.get("mxfp8").linear
    recipe = _fp32_with(overrides=(("blocks.0.mlp.*", bf16), ("blocks.*", mx)))
    model = _net()
    lowprec.convert(model, recipe)
    for name in LINEAR_NAMES:
        m = model.get_submodule(name)
        want = bf16 if name.startswith("blocks.0.mlp.") else mx if name.startswith("blocks.") else recipe.linear
        assert m.recipe == want, name


def test_convert_twice_raises() -> None:
    """A converted model cannot be converted again: ValueError telling the user to call unconvert."""
    model = _net()
    lowprec.convert(model, "fp32")
    with pytest.raises(ValueError, match="unconvert"):
        lowprec.convert(model, "fp8-tensorwise")
    # ... even when only a nested linear was converted.
    model = nn.Sequential(nn.Sequential(EmulatedLinear.from_linear(nn.Linear(2, 2), LinearRecipe())), nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unconvert"):
        lowprec.convert(model, "fp32")


def test_override_matching_nothing_raises() -> None:
    """An override whose pattern matches no module is an error naming the pattern (typo protection), and the model
    is left untouched."""
    model = _net()
    recipe = _fp32_with(overrides=(("blocks.*.mlp.*", LinearRecipe()), ("blocks.*.atn.*", LinearRecipe())))
    with pytest.raises(ValueError, match=r"blocks\.\*\.atn\.\*"):
        lowprec.convert(model, recipe)
    assert _converted(model) == set()


@pytest.mark.parametrize(
    ("model", "recipe"),
    [
        (nn.Sequential(nn.ReLU(), nn.Conv1d(2, 2, 1)), "fp32"),
        (nn.Sequential(nn.Linear(4, 4)), _fp32_with(keep_high_precision=("*",))),
        (nn.Sequential(nn.Linear(4, 4)), _fp32_with(keep_types=("Sequential",))),
        (nn.Linear(4, 4), "fp32"),
    ],
    ids=["no-linear", "all-kept", "kept-type", "bare-linear"],
)
def test_nothing_to_convert_raises(model: nn.Module, recipe: Recipe | str) -> None:
    """A model in which nothing would be converted raises ValueError (documented), rather than silently running
    in float32."""
    with pytest.raises(ValueError):
        lowprec.convert(model, recipe)


def test_module_filter_rejecting_everything_raises() -> None:
    """A module_filter that rejects every linear leaves nothing to convert: ValueError."""
    with pytest.raises(ValueError, match="converts no module"):
        lowprec.convert(_net(), "fp32", module_filter=lambda m, n: False)


def test_unconvert_restores_plain_linears() -> None:
    """unconvert puts back plain nn.Linear modules (exact type) sharing the same Parameters; the model's output is
    then bit-identical to the model before conversion (oracle: the unconverted model's own output)."""
    model = _net()
    x = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y0 = model(x)
    before = {n: (m.weight, m.bias) for n, m in _linears(model).items()}
    lowprec.convert(model, "mxfp8")
    with torch.no_grad():
        y_mx = model(x)
    assert not torch.equal(y_mx, y0)  # the conversion did change the numerics
    assert lowprec.unconvert(model) is model
    after = _linears(model)
    assert sorted(after) == sorted(before)
    for name, m in after.items():
        assert type(m) is nn.Linear
        assert m.weight is before[name][0] and m.bias is before[name][1]
    assert not hasattr(model, "lowprec_recipe")
    with torch.no_grad():
        assert_bitwise_equal(model(x), y0, context="after unconvert")
    with pytest.raises(ValueError):
        lowprec.unconvert(model)
    lowprec.convert(model, "fp32")  # convertible again


def test_convert_and_unconvert_keep_training_mode() -> None:
    """Swapping modules in place must not change train/eval mode: after model.eval(), convert and unconvert leave
    every module (the swapped linears included) in eval mode, and a model in training mode stays in training mode
    (oracle: the ``training`` flags before the swap)."""
    model = _net().eval()
    lowprec.convert(model, "fp32")
    assert [n for n, m in model.named_modules() if m.training] == []
    lowprec.unconvert(model)
    assert [n for n, m in model.named_modules() if m.training] == []
    model = _net().train()
    lowprec.convert(model, "fp32")
    assert all(m.training for m in model.modules())


# ------------------------------------------------------------------------------------------------ fp32 == PyTorch
class MLP(nn.Module):
    def __init__(self, k: int, h: int, n: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(k, h)
        self.fc2 = nn.Linear(h, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


FP32_SHAPES = [((5,), 8, 16, 4), ((2, 3), 12, 20, 6), ((128,), 256, 64, 32), ((4, 32), 256, 64, 16)]
FP32_IDS = ["tiny", "3d", "wide", "wide-3d"]


def _fp32_pair(batch: tuple[int, ...], k: int, h: int, n: int, seed: int = 0):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    plain = MLP(k, h, n)
    conv = copy.deepcopy(plain)
    lowprec.convert(conv, "fp32")
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(*batch, k, generator=g)
    gy = torch.randn(*batch, n, generator=g)
    return plain, conv, x, gy


@pytest.mark.parametrize(("batch", "k", "h", "n"), FP32_SHAPES, ids=FP32_IDS)
def test_fp32_recipe_matches_nn_linear_bitwise(batch: tuple[int, ...], k: int, h: int, n: int) -> None:
    """With the fp32 recipe a converted model is plain PyTorch: outputs, input gradients and every parameter
    gradient are bit-identical to the unconverted model's (oracle: nn.Linear, i.e. F.linear, and autograd).

    The "wide" shapes are large enough that F.linear's fused addmm and a matmul followed by a bias add can round
    differently.
    """
    plain, conv, x, gy = _fp32_pair(batch, k, h, n)
    xp, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    yp, yc = plain(xp), conv(xc)
    yp.backward(gy)
    yc.backward(gy)
    assert_bitwise_equal(yc, yp, context="output")
    assert_bitwise_equal(xc.grad, xp.grad, context="grad x")
    for (name, pp), (_, pc) in zip(plain.named_parameters(), conv.named_parameters(), strict=True):
        assert_bitwise_equal(pc.grad, pp.grad, context=f"grad {name}")


_F32_OUT = Gemm(output_format="float32")
_GEMM_PATH = LinearRecipe(forward=_F32_OUT, grad_input=_F32_OUT, grad_weight=_F32_OUT)


@pytest.mark.parametrize(("batch", "k", "h", "n"), FP32_SHAPES, ids=FP32_IDS)
def test_emulated_gemm_path_is_matmul_then_bias_bitwise(batch: tuple[int, ...], k: int, h: int, n: int) -> None:
    """Through the emulated-GEMM path (here a recipe whose only change is rounding each GEMM output to float32, a
    no-op on values), a converted linear computes ``x @ W.t()`` and then adds the bias in float32, as the
    ``_linear`` docstring says (torchao's convention), forward and backward, bit for bit.  (The fp32 recipe takes
    the F.linear path instead, see the test above; at the "wide" shapes the two differ in the last bit.)

    Oracle: the expression ``x2d @ W.t() + b`` written out in plain PyTorch, differentiated by autograd.
    """
    torch.manual_seed(0)
    plain = MLP(k, h, n)
    conv = copy.deepcopy(plain)
    lowprec.convert(conv, _fp32_with(linear=_GEMM_PATH))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*batch, k, generator=g)
    gy = torch.randn(*batch, n, generator=g)

    def ref_linear(t: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
        t2 = t.reshape(-1, t.shape[-1])
        return (t2 @ lin.weight.t() + lin.bias).reshape(*t.shape[:-1], lin.out_features)

    xr, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr = ref_linear(F.gelu(ref_linear(xr, plain.fc1)), plain.fc2)
    yc = conv(xc)
    yr.backward(gy)
    yc.backward(gy)
    assert_bitwise_equal(yc, yr, context="output")
    assert_bitwise_equal(xc.grad, xr.grad, context="grad x")
    for (name, pp), (_, pc) in zip(plain.named_parameters(), conv.named_parameters(), strict=True):
        assert_bitwise_equal(pc.grad, pp.grad, context=f"grad {name}")


# ------------------------------------------------------------------------------------------------ state dicts
def _mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


@pytest.mark.parametrize("recipe", ["fp32", "fp8-tensorwise", "mxfp8", "bf16"])
def test_state_dict_both_ways_without_buffers(recipe: str) -> None:
    """For recipes without delayed-scaling or stochastic buffers the converted state dict has exactly the plain
    keys, and state dicts load strictly both ways (plain -> converted, converted -> plain), copying the values
    (oracle: the plain model's state dict)."""
    src = _mlp(0)
    conv = lowprec.convert(_mlp(1), recipe)
    assert conv.load_state_dict(src.state_dict()) is not None
    assert list(conv.state_dict()) == list(src.state_dict())
    for k, v in src.state_dict().items():
        assert torch.equal(conv.state_dict()[k], v), k
    back = _mlp(2)
    back.load_state_dict(lowprec.convert(_mlp(3), recipe).state_dict())
    for k, v in _mlp(3).state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_state_dict_fp8_delayed_buffers() -> None:
    """fp8-delayed keeps ``amax_history_{input,weight,grad_output}`` buffers (length 16) per converted linear; they
    appear in the state dict, survive loading a plain state dict (strict), and travel to another converted model
    (oracle: the ``_linear`` docstring and hand-computed amaxes of one training step)."""
    conv = lowprec.convert(_mlp(0), "fp8-delayed")
    keys = list(conv.state_dict())
    for layer in ("0", "2"):
        for role in ("input", "weight", "grad_output"):
            assert f"{layer}.amax_history_{role}" in keys
            assert conv.state_dict()[f"{layer}.amax_history_{role}"].shape == (16,)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(5))
    conv(x).sum().backward()
    h = {k: v.clone() for k, v in conv.state_dict().items() if "amax_history" in k}
    assert float(h["0.amax_history_input"][0]) == float(x.abs().max())
    assert float(h["0.amax_history_weight"][0]) == float(conv[0].weight.detach().abs().max())
    assert float(h["2.amax_history_grad_output"][0]) == 1.0  # d(sum)/dy = 1 everywhere
    assert all(float(v[1:].abs().sum()) == 0 for v in h.values())

    plain_sd = _mlp(7).state_dict()
    plain_keys = list(plain_sd)
    conv.load_state_dict(plain_sd)  # strict
    assert list(plain_sd) == plain_keys  # the caller's dict is not modified
    for k, v in plain_sd.items():
        assert torch.equal(conv.state_dict()[k], v), k
    for k, v in h.items():
        assert torch.equal(conv.state_dict()[k], v), f"{k} changed by loading a plain state dict"

    other = lowprec.convert(_mlp(9), "fp8-delayed")
    other.load_state_dict(conv.state_dict())
    for k, v in conv.state_dict().items():
        assert torch.equal(other.state_dict()[k], v), k
    # A plain model does not know the buffers: strict loading must complain about exactly them.
    with pytest.raises(RuntimeError, match="amax_history"):
        _mlp(0).load_state_dict(conv.state_dict())


def test_state_dict_stochastic_step_buffer() -> None:
    """A recipe with stochastic operands (mxfp4: SR gradients) keeps an ``lp_step`` counter; it counts forward
    passes, is saved, and is kept when a plain state dict is loaded (oracle: the ``_linear`` docstring)."""
    conv = lowprec.convert(_mlp(0), "mxfp4")
    assert "0.lp_step" in conv.state_dict() and "2.lp_step" in conv.state_dict()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        conv(x).sum().backward()
    assert int(conv[0].lp_step) == 3
    conv.load_state_dict(_mlp(1).state_dict())
    assert int(conv[0].lp_step) == 3


# ------------------------------------------------------------------------------------------------ determinism
def _train(recipe: Recipe | str, steps: int = 3) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    lowprec.convert(model, recipe)
    opt = lowprec.optim.LowPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), recipe)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, t = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        opt.zero_grad()
        loss = F.mse_loss(model(x), t)
        opt.scale_loss(loss).backward()
        opt.step()
        losses.append(loss.detach())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_stochastic_training_is_deterministic() -> None:
    """Two identical 3-step runs with the mxfp4 recipe (stochastic-rounding gradients) give torch.equal losses and
    weights; changing only the recipe seed changes the weights, so the randomness is real but seeded
    (oracle: the second run)."""
    recipe = lowprec.recipes.get("mxfp4")
    losses1, w1 = _train(recipe)
    losses2, w2 = _train(recipe)
    for a, b in zip(losses1, losses2, strict=True):
        assert torch.equal(a, b)
    assert w1.keys() == w2.keys()
    for k in w1:
        assert torch.equal(w1[k], w2[k]), k
    _, w3 = _train(dataclasses.replace(recipe, seed=1))
    assert any(not torch.equal(w1[k], w3[k]) for k in w1 if k.endswith("weight"))


# ------------------------------------------------------------------------------------------------ torch.compile
# torch 2.13's dynamo instantiates torch.autograd.Function() itself while tracing any custom autograd.Function
# (torch/_dynamo/side_effects.py), which warns; that warning is PyTorch's, not lowprec's.
_DYNAMO_FUNCTION_WARNING = (
    "ignore:<class 'torch.autograd.function.Function'> should not be instantiated:DeprecationWarning"
)


@pytest.mark.slow
@pytest.mark.filterwarnings(_DYNAMO_FUNCTION_WARNING)
@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "mxfp8", "h100-fp8"])
def test_compiled_model_matches_eager(recipe: str) -> None:
    """torch.compile(model) (inductor, default options) gives bit-identical outputs, input gradients and weight
    gradients to the eager converted model (oracle: the eager path).

    The linears have no bias: a bias gradient is a plain ``sum`` over the batch, which inductor reduces in a
    different order from eager PyTorch even for an unconverted nn.Linear, so it would test PyTorch, not lowprec.
    """
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(64, 32, bias=False), nn.ReLU(), nn.Linear(32, 16, bias=False))
    lowprec.convert(eager, recipe)
    comp_model = copy.deepcopy(eager)
    compiled = torch.compile(comp_model)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 64, generator=g)
    gy = torch.randn(8, 16, generator=g)
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    ye, yc = eager(xe), compiled(xc)
    assert_bitwise_equal(yc, ye, context=f"{recipe} output")
    ye.backward(gy)
    yc.backward(gy)
    assert_bitwise_equal(xc.grad, xe.grad, context=f"{recipe} grad x")
    for (name, pe), (_, pc) in zip(eager.named_parameters(), comp_model.named_parameters(), strict=True):
        assert_bitwise_equal(pc.grad, pe.grad, context=f"{recipe} grad {name}")


@pytest.mark.slow
@pytest.mark.filterwarnings(_DYNAMO_FUNCTION_WARNING)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning")
@pytest.mark.parametrize("recipe", ["nvfp4", "fp8-delayed"])
def test_compiled_training_state_matches_eager_over_steps(recipe: str) -> None:
    """Over several training steps, torch.compile(model) draws the same stochastic-rounding bits (nvfp4 rounds
    gradients stochastically, keyed by the ``lp_step`` buffer) and keeps the same amax histories (fp8-delayed) as
    eager: identical weight gradients and buffers at every step (oracle: the eager path).

    Regression: the step counter and the histories used to be updated in place in forward; AOTAutograd then
    recomputed the backward's keys from the already-advanced buffer, so the compiled backward drew the next step's
    random bits (step 1: weight gradients at 16 dB SQNR of eager's).
    """
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(64, 32, bias=False), nn.ReLU(), nn.Linear(32, 16, bias=False))
    lowprec.convert(eager, recipe)
    comp_model = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled = torch.compile(comp_model)
    g = torch.Generator().manual_seed(2)
    for step in range(3):
        x = torch.randn(8, 64, generator=g)
        eager(x).square().sum().backward()
        compiled(x).square().sum().backward()
        for (name, pe), pc in zip(eager.named_parameters(), comp_model.parameters(), strict=True):
            assert_bitwise_equal(pc.grad, pe.grad, context=f"{recipe} step {step} grad {name}")
            pe.grad = pc.grad = None
        for (name, be), bc in zip(eager.named_buffers(), comp_model.buffers(), strict=True):
            assert_bitwise_equal(bc, be, context=f"{recipe} step {step} buffer {name}")


# ------------------------------------------------------------------------------------------------ functional.matmul
def _ab(m: int, k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(k, n, generator=g), torch.randn(m, n, generator=g)


def test_matmul_fp32_equals_torch() -> None:
    """matmul(a, b, "fp32") is a @ b bit for bit, and its gradients equal autograd's for a @ b bit for bit
    (oracle: torch.matmul and autograd)."""
    a, b, go = _ab(16, 64, 24)
    a1, b1 = a.clone().requires_grad_(), b.clone().requires_grad_()
    a2, b2 = a.clone().requires_grad_(), b.clone().requires_grad_()
    out = matmul(a1, b1, "fp32")
    ref = a2 @ b2
    assert_bitwise_equal(out, ref, context="matmul fp32")
    out.backward(go)
    ref.backward(go)
    assert_bitwise_equal(a1.grad, a2.grad, context="grad a")
    assert_bitwise_equal(b1.grad, b2.grad, context="grad b")


def test_matmul_fp8_tensorwise_sqnr() -> None:
    """matmul with fp8-tensorwise (e4m3 operands, per-tensor scales) is within the torchao float8 SQNR floor of the
    float32 product (oracle: float32 PyTorch; bound TOLERANCES["sqnr_fp8_cast"]); it is not exact."""
    floor = TOLERANCES["sqnr_fp8_cast"].value
    for seed in range(3):
        a, b, _ = _ab(64, 128, 48, seed)
        out = matmul(a, b, "fp8-tensorwise")
        ref = a @ b
        s = sqnr_db(ref, out)
        assert floor <= s < float("inf"), f"seed {seed}: SQNR {s:.2f} dB"


def test_matmul_delayed_recipe_falls_back_to_current_scaling() -> None:
    """matmul is stateless: with fp8-delayed it uses current scaling, so it equals fp8-tensorwise (same specs,
    current scaling) bit for bit, forward and backward (oracle: the ``functional`` docstring)."""
    a, b, go = _ab(8, 32, 16, seed=4)
    outs, grads = [], []
    for r in ("fp8-delayed", "fp8-tensorwise"):
        a1, b1 = a.clone().requires_grad_(), b.clone().requires_grad_()
        o = matmul(a1, b1, r)
        o.backward(go)
        outs.append(o)
        grads.append((a1.grad, b1.grad))
    assert_bitwise_equal(outs[0], outs[1], context="output")
    assert_bitwise_equal(grads[0][0], grads[1][0], context="grad a")
    assert_bitwise_equal(grads[0][1], grads[1][1], context="grad b")


def _gamma(n: int) -> float:
    u = 2.0**-24
    return n * u / (1 - n * u)


@pytest.mark.parametrize("recipe", ["fp32", "fp8-tensorwise"])
def test_matmul_batched_broadcast(recipe: str) -> None:
    """[2,3,M,K] @ [K,N] broadcasts like torch.matmul: output [2,3,M,N], grad a [2,3,M,K], grad b [K,N] (summed
    over the broadcast batch).  For fp32 the forward is bitwise a @ b and the gradients are within Higham's
    float32 bound of the float64 products (the summation order over the batch is not autograd's); for fp8 the
    output stays within the torchao SQNR floor.  Oracle: torch.matmul/autograd shapes, float64 references."""
    g = torch.Generator().manual_seed(2)
    M, K, N = 5, 64, 7
    a = torch.randn(2, 3, M, K, generator=g).requires_grad_()
    b = torch.randn(K, N, generator=g).requires_grad_()
    go = torch.randn(2, 3, M, N, generator=g)
    out = matmul(a, b, recipe)
    assert out.shape == (2, 3, M, N) and out.dtype == torch.float32
    out.backward(go)
    assert a.grad is not None and b.grad is not None
    assert a.grad.shape == a.shape and b.grad.shape == b.shape
    ad, bd, gd = a.detach().double(), b.detach().double(), go.double()
    if recipe == "fp32":
        assert_bitwise_equal(out, a.detach() @ b.detach(), context="batched forward")
        ga_ref = gd @ bd.t()  # reduction over N
        gb_ref = torch.einsum("ijmk,ijmn->kn", ad, gd)  # reduction over 2*3*M
        ga_bound = _gamma(N) * (gd.abs() @ bd.abs().t())
        gb_bound = _gamma(2 * 3 * M) * torch.einsum("ijmk,ijmn->kn", ad.abs(), gd.abs())
        assert bool(((a.grad.double() - ga_ref).abs() <= ga_bound).all())
        assert bool(((b.grad.double() - gb_ref).abs() <= gb_bound).all())
    else:
        floor = TOLERANCES["sqnr_fp8_cast"].value
        assert sqnr_db(ad @ bd, out.detach()) >= floor


def test_matmul_broadcast_both_batched() -> None:
    """Broadcasting batch dims on both sides ([2,1,M,K] @ [3,K,N]) gives torch.matmul's output shape and gradients
    shaped like the inputs (oracle: torch.matmul's broadcasting rules); fp32 forward is bitwise a @ b."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(2, 1, 4, 16, generator=g).requires_grad_()
    b = torch.randn(3, 16, 5, generator=g).requires_grad_()
    out = matmul(a, b, "fp32")
    ref = a.detach() @ b.detach()
    assert out.shape == ref.shape == (2, 3, 4, 5)
    assert_bitwise_equal(out, ref, context="forward")
    out.sum().backward()
    assert a.grad.shape == a.shape and b.grad.shape == b.shape
    # d(sum)/da[i,0,m,k] = sum_{j,n} b[j,k,n]; d/db[j,k,n] = sum_{i,m} a[i,0,m,k]  (float64 references)
    ga_ref = b.detach().double().sum(dim=(0, 2)).expand(2, 1, 4, 16)
    gb_ref = a.detach().double().sum(dim=(0, 1, 2)).reshape(1, 16, 1).expand(3, 16, 5)
    ga_bound = _gamma(3 * 5) * b.detach().double().abs().sum(dim=(0, 2)).expand(2, 1, 4, 16)
    gb_bound = _gamma(2 * 4) * a.detach().double().abs().sum(dim=(0, 1, 2)).reshape(1, 16, 1).expand(3, 16, 5)
    assert bool(((a.grad.double() - ga_ref).abs() <= ga_bound).all())
    assert bool(((b.grad.double() - gb_ref).abs() <= gb_bound).all())


def test_matmul_rejects_bad_shapes() -> None:
    """Mismatched inner dimensions and 1-D operands raise ValueError naming the shapes."""
    with pytest.raises(ValueError, match="shapes"):
        matmul(torch.ones(2, 3), torch.ones(4, 5), "fp32")
    with pytest.raises(ValueError, match="2 dimensions"):
        matmul(torch.ones(3), torch.ones(3, 5), "fp32")


def test_matmul_accepts_linear_recipe() -> None:
    """A LinearRecipe can be passed directly; with only output rounding to bf16 the result is the float32 product
    a @ b cast to bf16 with round-to-nearest-even (oracle: torch's own bf16 cast)."""
    lin = LinearRecipe(forward=Gemm(output_format="bfloat16"))
    a, b, _ = _ab(4, 8, 3, seed=6)
    out = matmul(a, b, lin)
    assert_bitwise_equal(out, (a @ b).to(torch.bfloat16).float(), context="bf16 output rounding")


@pytest.mark.parametrize("recipe", ["fp8-delayed", "bf16-sr"])
def test_eval_mode_never_changes_training_state(recipe: str) -> None:
    """Oracle: the module's own buffers before and after.  Evaluating (model.eval()) records no amax history and
    advances no stochastic-rounding step, so a run that evaluates trains exactly like one that does not."""
    torch.manual_seed(0)
    m = lowprec.convert(torch.nn.Sequential(torch.nn.Linear(16, 8)), recipe)
    x = torch.randn(4, 16)
    m(x).sum().backward()  # one training step fills the state
    before = {k: v.clone() for k, v in m.state_dict().items()}
    m.eval()
    with torch.no_grad():
        y1, y2 = m(x * 3), m(x * 3)
    m.train()
    after = m.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    assert torch.equal(y1, y2)  # and evaluation is deterministic
