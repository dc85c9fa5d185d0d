"""NaN/Inf localisation: the library on hand-built models, and the runner's check, replay and event end to end.

Oracles: faults injected by construction (``_faulty_tasks``: a module that overflows at a known step, a custom
autograd function whose backward writes one NaN at a known index), whose module, role, step, counts and first
index are known before anything runs; hand-worked float32 arithmetic for the value summaries; the same step run
without hooks (bitwise-equal gradients: the hooks change nothing); the original step's loss and gradient norm
(the replay must reproduce them bit for bit, ``replay_exact``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _faulty_tasks import NanGrad, Overflow
from torch import nn

from lowprec.accuracy import Criteria, RunData, build_baseline, judge
from lowprec.numerics import localize_nonfinite, nonfinite_summary
from lowprec.runs._config import RunConfig
from lowprec.runs._runner import run_config
from lowprec.runs._store import RunStore


def _identity_linear(n: int) -> nn.Linear:
    lin = nn.Linear(n, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(n))
    return lin


def _step(model: nn.Module, x: torch.Tensor):
    def run() -> torch.Tensor:
        loss = model(x).sum()
        loss.backward()
        return loss

    return run


def test_forward_overflow_is_named_with_exact_summary() -> None:
    """Oracle: hand-worked float32 products.  x = [1, -2, 0, 2^-13] through an identity linear, then x * 2^100 *
    2^40: 1 -> +inf, -2 -> -inf, 0 -> 0, 2^-13 -> 2^127 (finite).  The later ReLU, linear and backward are
    non-finite too, but the first hit in execution order is the amp module's output."""
    model = nn.Sequential(_identity_linear(4), Overflow(0), nn.ReLU(), nn.Linear(4, 2))
    x = torch.tensor([[1.0, -2.0, 0.0, 2.0**-13]])
    loc = localize_nonfinite(model, _step(model, x), step=7)
    assert loc is not None
    assert (loc.module, loc.module_type, loc.role, loc.phase, loc.step) == ("1", "Overflow", "output", "forward", 7)
    assert (loc.shape, loc.nan, loc.posinf, loc.neginf, loc.first_index) == ((1, 4), 0, 1, 1, (0, 0))
    assert loc.finite_amax == 2.0**127
    assert "output of module '1' (Overflow) at step 7" in loc.describe()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())  # hooks removed


def test_backward_nan_is_named_as_the_producing_modules_grad_input() -> None:
    """Oracle: ``_NanBackward`` writes exactly one NaN at [0, 1] of the gradient of its input.  That tensor is
    also dL/d(output of linear '0'); the module that computed it (NanGrad '1', grad_input) is named."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), NanGrad(0), nn.Linear(4, 2))
    loc = localize_nonfinite(model, _step(model, torch.randn(2, 3)))
    assert loc is not None
    assert (loc.module, loc.module_type, loc.role, loc.phase, loc.tensor) == ("1", "NanGrad", "grad_input",
                                                                              "backward", "args[0]")
    assert (loc.shape, loc.nan, loc.posinf, loc.neginf, loc.first_index) == ((2, 4), 1, 0, 0, (0, 1))


def test_parameter_loss_input_and_functional_code() -> None:
    """Oracle: where each fault was put by hand: an inf weight (role parameter), log(-1) in the loss (role loss),
    a NaN in the batch (the model's input), and exp(100) computed between two submodules in a parent's forward
    (the next submodule's input, with the parent named in ``detail``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    with torch.no_grad():
        model[1].weight[1, 2] = math.inf
    loc = localize_nonfinite(model, _step(model, torch.randn(2, 3)))
    assert loc is not None and (loc.module, loc.role, loc.tensor, loc.posinf) == ("1", "parameter", "weight", 1)

    model = nn.Sequential(nn.Linear(3, 2))

    def log_loss() -> torch.Tensor:
        loss = torch.log(model(torch.ones(1, 3)).sum() * 0 - 1)
        loss.backward()
        return loss

    loc = localize_nonfinite(model, log_loss)
    assert loc is not None and (loc.module, loc.role, loc.phase, loc.nan) == ("", "loss", "loss", 1)

    x = torch.tensor([[0.0, math.nan, 1.0]])
    loc = localize_nonfinite(model, _step(model, x))
    assert loc is not None and (loc.module, loc.role, loc.first_index) == ("", "input", (0, 1))
    assert "the model's input" in loc.describe()

    class Exp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.exp(self.a(x) * 0 + 100))

    model = Exp()
    loc = localize_nonfinite(model, _step(model, torch.ones(1, 2)))
    assert loc is not None and (loc.module, loc.role, loc.posinf) == ("b", "input", 2)
    assert "'<model>' (Exp)" in loc.detail


def test_finite_step_returns_none_and_changes_no_bit() -> None:
    """Oracle: the same step without hooks (bitwise-equal loss and gradients)."""
    def grads(hooked: bool) -> list[torch.Tensor]:
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
        run = _step(model, torch.randn(4, 5))
        if hooked:
            assert localize_nonfinite(model, run) is None
        else:
            run()
        return [p.grad for p in model.parameters()]

    for a, b in zip(grads(True), grads(False), strict=True):
        assert torch.equal(a, b)
    assert nonfinite_summary(torch.ones(3)) is None and nonfinite_summary(torch.tensor([1, 2])) is None
    with pytest.raises(ValueError, match="run_step must be a callable"):
        localize_nonfinite(nn.Linear(2, 2), None)  # type: ignore[arg-type]


# ----------------------------------------------- the four inexact cases of issue 14: hooks and parameters
def _poison(t: torch.Tensor, index: tuple[int, ...] = (0, 1), value: float = math.nan) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


def test_nan_from_a_modules_own_full_backward_hook_is_named() -> None:
    """Oracle: the hook writes exactly one NaN at [0, 1] of module '1''s grad_input (dL/d its input) and nothing
    else is non-finite.  Before the fix the localiser checked that gradient before the module's hook ran and
    blamed the previous module's grad_output ('0')."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].register_full_backward_hook(lambda mod, gi, go: (_poison(gi[0]),))
    loc = localize_nonfinite(model, _step(model, torch.randn(2, 3)))
    assert loc is not None
    assert (loc.module, loc.module_type, loc.role, loc.tensor, loc.phase) == ("1", "Linear", "grad_input",
                                                                              "args[0]", "backward")
    assert (loc.shape, loc.nan, loc.posinf, loc.neginf, loc.first_index) == ((2, 4), 1, 0, 0, (0, 1))
    assert "backward hook" in loc.detail
    # the user's hook still runs and still changes the gradient: the localiser only observes
    assert torch.isnan(model[0].weight.grad).any()
    assert list(model[1]._backward_hooks) and len(model[1]._backward_hooks) == 1  # ours removed
    # a full backward *pre*-hook replaces the module's grad_output: named as that
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].register_full_backward_pre_hook(lambda mod, go: (_poison(go[0], (1, 2)),))
    loc = localize_nonfinite(model, _step(model, torch.randn(2, 3)))
    assert loc is not None and (loc.module, loc.role, loc.first_index) == ("1", "grad_output", (1, 2))


def test_nan_from_a_global_full_backward_hook_is_named() -> None:
    """Oracle: a global module hook (``register_module_full_backward_hook``) that poisons only module '1''s
    grad_input, with an inf this time, at [1, 0]."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 2))
    target = model[2]

    def hook(mod: nn.Module, gi: tuple, go: tuple) -> tuple | None:
        return (_poison(gi[0], (1, 0), math.inf),) if mod is target else None

    handle = nn.modules.module.register_module_full_backward_hook(hook)
    try:
        # an input that needs a gradient: a global hook wraps every module, the first one too
        loc = localize_nonfinite(model, _step(model, torch.randn(2, 3, requires_grad=True)))
    finally:
        handle.remove()
    assert loc is not None
    assert (loc.module, loc.role, loc.tensor, loc.posinf, loc.first_index) == ("2", "grad_input", "args[0]", 1,
                                                                              (1, 0))


def test_nan_from_a_tensor_hook_in_a_parents_forward_is_named() -> None:
    """Oracle: the parent registers a hook on its child's output that writes one NaN at [0, 1] of dL/dh; the
    child 'a' and the consumer 'b' computed their gradients finite.  Before the fix the localiser's hook on h ran
    first (it was registered when 'a' returned), so the NaN was first seen in 'a''s bias gradient."""

    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            h.register_hook(_poison)
            return self.b(h)

    torch.manual_seed(0)
    model = Parent()
    loc = localize_nonfinite(model, _step(model, torch.randn(2, 3)))
    assert loc is not None
    assert (loc.module, loc.module_type, loc.role, loc.phase) == ("", "Parent", "grad_hook", "backward")
    assert (loc.shape, loc.nan, loc.first_index) == ((2, 4), 1, (0, 1))
    assert "Tensor.register_hook" in loc.detail and "'<model>' (Parent)" in loc.detail
    assert torch.isnan(model.a.bias.grad).any()  # the hook still did what it does


class _TinyGPT(nn.Module):
    """The zoo's GPT layout in miniature: a position embedding module whose forward never runs (its weight is
    used in the parent's forward), or a position ``nn.Parameter`` of the parent itself."""

    def __init__(self, own_parameter: bool = False) -> None:
        super().__init__()
        self.tok_embed = nn.Embedding(11, 4)
        if own_parameter:
            self.pos = nn.Parameter(torch.randn(5, 4))
        else:
            self.pos_embed = nn.Embedding(5, 4)
        self.block = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4))
        self.head = nn.Linear(4, 11)

    def position(self, t: int) -> torch.Tensor:
        return self.pos[:t] if hasattr(self, "pos") else self.pos_embed.weight[:t]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_embed(idx) + self.position(idx.shape[1])
        return self.head(self.block(x))


def _gpt_step(model: nn.Module) -> Callable[[], torch.Tensor]:
    idx = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    return _step(model, idx)


def test_nan_in_a_position_embedding_used_outside_its_module_is_named() -> None:
    """Oracle: one NaN put at [2, 3] of the position embedding's weight.  Before the fix the embedding module
    never ran, so its weight was never checked, and the NaN was first seen as the input of 'block'."""
    torch.manual_seed(0)
    model = _TinyGPT()
    with torch.no_grad():
        model.pos_embed.weight[2, 3] = math.nan
    loc = localize_nonfinite(model, _gpt_step(model))
    assert loc is not None
    assert (loc.module, loc.module_type, loc.role, loc.tensor, loc.phase) == ("pos_embed", "Embedding",
                                                                              "parameter", "weight", "forward")
    assert (loc.shape, loc.nan, loc.first_index) == ((5, 4), 1, (2, 3))
    assert "outside its module's forward" in loc.detail and "'<model>' (_TinyGPT)" in loc.detail
    # the parent's own parameter: checked when the parent's forward starts
    model = _TinyGPT(own_parameter=True)
    with torch.no_grad():
        model.pos[0, 0] = -math.inf
    loc = localize_nonfinite(model, _gpt_step(model))
    assert loc is not None and (loc.module, loc.role, loc.tensor, loc.neginf) == ("", "parameter", "pos", 1)
    # a non-finite parameter that the step never uses is not blamed (the step is finite)
    model = _TinyGPT()
    model.unused = nn.Linear(2, 2)
    with torch.no_grad():
        model.unused.weight[0, 0] = math.nan
    assert localize_nonfinite(model, _gpt_step(model)) is None


def test_nan_gradient_of_a_position_embedding_is_named() -> None:
    """Oracles: (1) a ``post_accumulate_grad`` hook that writes one NaN into ``pos_embed.weight.grad`` at [4, 0]
    after accumulation (before the fix nothing was found: every gradient had been checked before it); (2) a
    tensor hook on the weight that returns an inf gradient; (3) sqrt of a zero position entry in the parent's
    forward: finite forward, inf * 0 = NaN in its backward, first seen in the parameter's own gradient."""
    torch.manual_seed(0)
    model = _TinyGPT()

    def poison_grad(p: torch.Tensor) -> None:
        assert p.grad is not None
        p.grad[4, 0] = math.nan

    model.pos_embed.weight.register_post_accumulate_grad_hook(poison_grad)
    loc = localize_nonfinite(model, _gpt_step(model))
    assert loc is not None
    assert (loc.module, loc.role, loc.tensor, loc.phase, loc.nan, loc.first_index) == (
        "pos_embed", "grad_weight", "weight", "backward", 1, (4, 0))
    assert "accumulat" in loc.detail

    model = _TinyGPT()
    model.pos_embed.weight.register_hook(lambda g: _poison(g, (1, 1), math.inf))
    loc = localize_nonfinite(model, _gpt_step(model))
    assert loc is not None and (loc.module, loc.role, loc.posinf, loc.first_index) == ("pos_embed", "grad_weight",
                                                                                       1, (1, 1))

    class SqrtPos(_TinyGPT):
        def position(self, t: int) -> torch.Tensor:
            return torch.sqrt(self.pos_embed.weight[:t].abs())

    model = SqrtPos()
    with torch.no_grad():
        model.pos_embed.weight[3, 2] = 0.0
    loc = localize_nonfinite(model, _gpt_step(model))
    assert loc is not None and (loc.module, loc.role, loc.first_index) == ("pos_embed", "grad_weight", (3, 2))


def _cfg(tmp_path: Path, model: str, step: int, seeds: tuple[int, ...] = (0,)) -> RunConfig:
    return RunConfig(model=f"_faulty_tasks:{model}", steps=8, eval_interval=4, seeds=seeds, threads=1,
                     model_options={"step": step}, store=str(tmp_path / "runs.db"))


@pytest.mark.parametrize(("model", "module", "role", "loss_finite"), [
    ("overflow_at", "layers.1.amp", "output", False),
    ("nan_grad_at", "layers.1.bad", "grad_input", True),
])
def test_run_records_nonfinite_event_and_judge_names_it(tmp_path: Path, model: str, module: str, role: str,
                                                         loss_finite: bool) -> None:
    """Oracle: the injected fault (batch 3, so logged step 4; ``nan_grad_at`` keeps the loss finite, so only the
    gradient-norm check can catch it), and the original step's loss/norm for the replay (``replay_exact``).  A
    replay without the buffer snapshot would not reproduce the fault: the faulty modules count their calls in a
    buffer."""
    with RunStore(str(tmp_path / "runs.db")) as store:
        base = run_config(_cfg(tmp_path, model, 10**6, seeds=(1, 2)), store=store, progress=False)
        (rid,) = run_config(_cfg(tmp_path, model, 3), store=store, progress=False)
        (ev,) = store.events(rid, kind="nonfinite")
        (div,) = store.events(rid, kind="diverged")
        assert ev["step"] == div["step"] == 4 and store.get_run(rid).status == "diverged"
        p = ev["payload"]
        assert (p["module"], p["role"], p["step"], p["found"], p["replay_exact"]) == (module, role, 4, True, True)
        assert p["shape"] == [64, 128]
        assert math.isfinite(float(p["loss"])) == loss_finite and math.isnan(float(p["grad_norm"]))
        assert not store.events(base[0], kind="nonfinite")
        baseline = build_baseline("ref", [RunData.from_store(store, r) for r in base],
                                  criteria=Criteria(min_loss_drop=0.0))  # 8 steps: about the event, not training
        verdict = judge(baseline, [RunData.from_store(store, rid)])
    (div_result,) = [r for r in verdict.results if r.name == "divergence"]
    assert not div_result.passed
    assert f"{role} of module '{module}'" in div_result.reason and "at step 4" in div_result.reason
