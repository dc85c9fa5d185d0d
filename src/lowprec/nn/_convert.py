"""``convert`` / ``unconvert``: swap GEMM-carrying modules for recipe-emulated ones and back, in place.

Which modules are swapped, and for what, is the table ``CONVERTERS``: one ``Converter`` per module kind, tried in
order, first match wins.  Built in:

    kind      matches                                   emulated as       restored by
    linear    type(m) is nn.Linear                      EmulatedLinear    EmulatedLinear.to_linear
    conv1d    transformers' Conv1D (GPT-2), W: [K, N]   EmulatedConv1D    EmulatedConv1D.to_conv1d

Adding a kind (MoE experts with 3-D weights, attention) is one entry: a predicate on the original module, a
builder ``build(module, linear_recipe, seed, name) -> emulated module`` (sharing the module's Parameter objects),
a predicate recognising the emulated module and ``restore(emulated) -> original module``.  ``convert`` applies the
recipe's keep rules to every kind alike, does not descend into a module a converter matched, and lists the result
in the model's ``ConversionReport`` (``lowprec.nn.conversion_report``; nn/_report.py).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import warnings
from collections.abc import Callable
from typing import Literal, cast

from torch import nn

from .. import recipes
from .._checks import check_literal
from .._errors import UsageError
from ..recipes import LinearRecipe, Operand, Recipe
from ._attention import emulate_attention, restore_attention
from ._experts import EmulatedExperts, is_experts
from ._linear import EmulatedConv1D, EmulatedLinear, is_hf_conv1d
from ._masked_inputs import mark_masked_inputs
from ._report import ConversionReport, ModuleEntry, describe_unknown
from ._router import build_router, check_router_recipe, is_emulated_router, is_router, restore_router

ModuleFilter = Callable[[nn.Module, str], bool]
OnUnknown = Literal["warn", "error", "ignore"]
"""``convert(on_unknown=...)``: what to do about modules that may carry GEMMs and that no converter handles."""


@dataclasses.dataclass(frozen=True)
class Converter:
    """One row of ``CONVERTERS``: how to emulate one kind of GEMM-carrying module and how to undo it."""

    kind: str
    """Short name shown in the conversion report ("linear", "conv1d", "experts", ...)."""
    matches: Callable[[nn.Module], bool]
    """True for an original (unconverted) module of this kind."""
    build: Callable[[nn.Module, LinearRecipe, int, str], nn.Module]
    """``build(module, linear_recipe, seed, qualified_name)``: the emulated module, sharing ``module``'s
    Parameter objects (so optimizers and state dicts are unchanged)."""
    is_emulated: Callable[[nn.Module], bool]
    """True for a module ``build`` returned (what ``unconvert`` restores and what makes a model "converted")."""
    restore: Callable[[nn.Module], nn.Module]
    """``restore(emulated)``: a module of the original class sharing the emulated module's Parameters."""


def _restore_linear(m: nn.Module) -> nn.Module:
    return cast(EmulatedLinear, m).to_linear()


def _restore_conv1d(m: nn.Module) -> nn.Module:
    return cast(EmulatedConv1D, m).to_conv1d()


def _build_linear(m: nn.Module, rec: LinearRecipe, seed: int, name: str) -> nn.Module:
    return EmulatedLinear.from_linear(cast(nn.Linear, m), rec, seed=seed, name=name)


def _build_conv1d(m: nn.Module, rec: LinearRecipe, seed: int, name: str) -> nn.Module:
    return EmulatedConv1D.from_conv1d(m, rec, seed=seed, name=name)


def _build_experts(m: nn.Module, rec: LinearRecipe, seed: int, name: str) -> nn.Module:
    return EmulatedExperts.from_module(m, rec, seed=seed, name=name)


def _restore_experts(m: nn.Module) -> nn.Module:
    return cast(EmulatedExperts, m).to_module()


CONVERTERS: list[Converter] = [
    Converter("linear", lambda m: type(m) is nn.Linear, _build_linear,
              lambda m: isinstance(m, EmulatedLinear) and not m.transposed_weight, _restore_linear),
    Converter("conv1d", is_hf_conv1d, _build_conv1d, lambda m: isinstance(m, EmulatedConv1D), _restore_conv1d),
    Converter("experts", is_experts, _build_experts, lambda m: isinstance(m, EmulatedExperts), _restore_experts),
]
"""The converters ``convert`` tries, in order (first match wins); append a ``Converter`` to add a module kind."""


def _converter_for(m: nn.Module) -> Converter | None:
    return next((c for c in CONVERTERS if c.matches(m)), None)


ROUTER = Converter("router", is_router, build_router, is_emulated_router, restore_router)
"""MoE routers: not in ``CONVERTERS`` (they stay float32 by default); converted only when an override names them
(nn/_router.py)."""


def _emulated_by(m: nn.Module) -> Converter | None:
    return next((c for c in [*CONVERTERS, ROUTER] if c.is_emulated(m)), None)


def _keep_reason(name: str, mod: nn.Module, recipe: Recipe, ancestors: list[nn.Module]) -> str | None:
    """Why the recipe keeps module ``name`` in high precision (None: it does not)."""
    for p in recipe.keep_high_precision:
        if fnmatch.fnmatchcase(name, p):
            return f"keep_high_precision {p!r}"
    for m in [*ancestors, mod]:
        if type(m).__name__ in recipe.keep_types:
            return f"keep_types {type(m).__name__!r}"
    return None


def _override(name: str, recipe: Recipe) -> tuple[LinearRecipe, str] | None:
    """The first ``recipe.overrides`` entry whose pattern matches module ``name``: (its recipe, the pattern)."""
    for pattern, lin in recipe.overrides:
        if fnmatch.fnmatchcase(name, pattern):
            return lin, pattern
    return None


def _linear_recipe(name: str, recipe: Recipe) -> tuple[LinearRecipe, str]:
    """The LinearRecipe for module ``name`` and where it comes from (the recipe, or an override pattern)."""
    found = _override(name, recipe)
    if found is not None:
        return found[0], f"{recipe.name} override {found[1]!r}"
    return recipe.linear, recipe.name


def _operand_label(op: Operand) -> str:
    if op.spec is None:
        return "fp32"
    elem = op.spec.elem if isinstance(op.spec.elem, str) else getattr(op.spec.elem, "name", str(op.spec.elem))
    label = elem.removeprefix("float8_")
    if op.spec.scaling not in ("tensor", "none"):
        label += f"/{op.spec.scaling}"
    if op.scaling.kind == "delayed":
        label += "/delayed"
    return label


def attention_summary(recipe: Recipe) -> str:
    """The report's attention line: what ``Q K^T`` and ``P V`` follow, or that they are not emulated."""
    att = recipe.attention
    if att is None:
        return (f"not emulated (recipe {recipe.name!r} has no attention: Q K^T and P V run in the model's own "
                f"precision; recipes.with_attention(recipe) or '{recipe.name}+attn' emulates them)")
    return (f"emulated per {att.granularity}: scores Q K^T {recipe_summary(att.scores)}; values P V "
            f"{recipe_summary(att.values)}; softmax float32")


def recipe_summary(lin: LinearRecipe) -> str:
    """``e4m3fn*e4m3fn, e5m2*e4m3fn, e5m2*e4m3fn``: operand a * operand b of forward, grad_input and grad_weight
    (with " acc FMT" / " -> FMT" where the accumulator or output is not float32); "fp32" when nothing is
    emulated."""
    parts = []
    for g in (lin.forward, lin.grad_input, lin.grad_weight):
        text = f"{_operand_label(g.a)}*{_operand_label(g.b)}"
        if g.accumulator.format is not None:
            text += f" acc {g.accumulator.format}"
        if g.output_format is not None:
            text += f" -> {g.output_format}"
        parts.append(text)
    if all(p == "fp32*fp32" for p in parts):
        return "fp32"
    return ", ".join(parts)


def _gemm_params(mod: nn.Module) -> tuple[str, ...]:
    """``mod``'s own floating Parameters of 2+ dimensions, as "3-D parameter name [shape]"."""
    out = []
    for n, p in mod.named_parameters(recurse=False):
        if isinstance(p, nn.parameter.UninitializedParameter) or not p.is_floating_point() or p.dim() < 2:
            continue
        out.append(f"{p.dim()}-D parameter {n} {list(p.shape)}")
    return tuple(out)


ROUTER_REASON = ("MoE router: float32 by design (a rounded router logit can flip a token's top-k experts, a "
                 "discrete change no GEMM format budgets for); an override naming it emulates it")


_CONVS = (nn.modules.conv._ConvNd,)
_LOOKUPS = (nn.Embedding, nn.EmbeddingBag)


def _plan(model: nn.Module, recipe: Recipe, module_filter: ModuleFilter | None
          ) -> tuple[list[tuple[str, nn.Module, Converter, LinearRecipe]], list[ModuleEntry]]:
    """The modules to convert (name, module, converter, linear recipe) and the report entries, without changing
    ``model``."""
    owners: dict[int, list[str]] = {}
    for mname, m in model.named_modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), []).append(mname)
    targets: list[tuple[str, nn.Module, Converter, LinearRecipe]] = []
    entries: list[ModuleEntry] = []

    def shared(name: str, mod: nn.Module) -> str:
        notes = []
        for pname, p in mod.named_parameters(recurse=False):
            others = [o for o in owners.get(id(p), []) if o != name]
            if others:
                notes.append(f"{pname} shared with {', '.join(o or '<root>' for o in others)}")
        return "; ".join(notes)

    def visit(mod: nn.Module, name: str, ancestors: list[nn.Module]) -> bool:
        """Classify ``mod``; True when a converter handled it (its children are then not visited)."""
        conv = _converter_for(mod)
        params = _gemm_params(mod)
        tname = type(mod).__name__
        if conv is not None:
            reason = _keep_reason(name, mod, recipe, ancestors)
            if reason is None and module_filter is not None and not module_filter(mod, name):
                reason = "module_filter"
            note = shared(name, mod)
            if reason is not None:
                entries.append(ModuleEntry(name, tname, conv.kind, "kept", reason=reason, params=params, note=note))
            else:
                lin, source = _linear_recipe(name, recipe)
                summary = recipe_summary(lin)
                entries.append(ModuleEntry(name, tname, conv.kind, "converted", recipe=f"{source} ({summary})",
                                           params=params, note=note))
                targets.append((name, mod, conv, lin))
            return True
        if not params or isinstance(mod, _LOOKUPS):
            return False
        if isinstance(mod, _CONVS):
            entries.append(ModuleEntry(name, tname, "convolution", "unemulated", params=params,
                                       reason="convolution: lowprec emulates linear GEMMs only; runs in float32"))
            return False
        if is_router(mod):
            override = _override(name, recipe)
            reason = _keep_reason(name, mod, recipe, ancestors) or (ROUTER_REASON if override is None else None)
            if reason is None and module_filter is not None and not module_filter(mod, name):
                reason = "module_filter"
            if reason is not None:
                entries.append(ModuleEntry(name, tname, "router", "kept", params=params, reason=reason))
            else:
                assert override is not None
                lin, pattern = override
                check_router_recipe(lin, name)  # before any module is changed
                entries.append(ModuleEntry(name, tname, "router", "converted", params=params,
                                           recipe=f"{recipe.name} override {pattern!r} ({recipe_summary(lin)})"))
                targets.append((name, mod, ROUTER, lin))
            return True
        reason = _keep_reason(name, mod, recipe, ancestors)
        if reason is not None:
            entries.append(ModuleEntry(name, tname, "unknown", "kept", reason=reason, params=params))
        else:
            entries.append(ModuleEntry(name, tname, "unknown", "unknown", params=params,
                                       reason=f"{', '.join(params)}: may carry GEMMs no converter handles"))
        return False

    def walk(mod: nn.Module, prefix: str, ancestors: list[nn.Module]) -> None:
        for child_name, child in mod.named_children():
            name = f"{prefix}{child_name}"
            if not visit(child, name, ancestors + [mod]):
                walk(child, name + ".", ancestors + [mod])

    if _converter_for(model) is not None:
        raise UsageError(f"convert() swaps submodules; wrap a bare {type(model).__name__} in a container "
                         "(e.g. nn.Sequential)")
    visit(model, "", [])
    walk(model, "", [])
    return targets, entries


def _set_child(root: nn.Module, qualname: str, new: nn.Module) -> None:
    parent_name, _, child = qualname.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def convert(model: nn.Module, recipe: Recipe | str, *, module_filter: ModuleFilter | None = None,
            on_unknown: OnUnknown = "warn") -> nn.Module:
    """Replace every ``nn.Linear`` and transformers ``Conv1D`` of ``model`` (in place) by emulated modules
    (``EmulatedLinear``, ``EmulatedConv1D``; the kinds of ``CONVERTERS``) following ``recipe``.  Returns ``model``.

    Modules are left alone when their qualified name matches ``recipe.keep_high_precision``, when their class or
    an enclosing module's class is in ``recipe.keep_types``, or when ``module_filter(module, name)`` returns
    False.  Parameters are shared, not copied, so tied weights (a head sharing the embedding's Parameter, as
    transformers' ``tie_word_embeddings``) stay tied and optimizers built before still step the model.

    Attention: with ``recipe.attention`` set (``recipes.with_attention``, or a name such as
    "fp8-tensorwise+attn"), ``emulate_attention`` runs the model's ``Q K^T`` and ``P V`` GEMMs with it (a
    transformers model through its attention registry, any other through its ``F.scaled_dot_product_attention``
    calls); without it attention runs unemulated, and the report says so.

    What was done is recorded: ``lowprec.nn.conversion_report(model)`` lists each converted, kept, unemulated
    (convolutions) and unknown module (nn/_report.py).  Unknown modules own a Parameter of 3+ dimensions (MoE
    experts) or a 2-D Parameter in a module type no converter handles (a router's ``weight`` used through
    ``F.linear``): they may carry GEMMs that stay in float32.  ``on_unknown`` says what to do about them:
    "warn" (default) emits one ``UserWarning`` naming them, "error" raises ``UsageError`` before changing the
    model, "ignore" only records them in the report.  Listing them in ``keep_high_precision`` keeps them in
    float32 on purpose, without a warning.

    Raises ``UsageError`` (a ``ValueError``) when the model is already converted, when a per-module override names
    no module of the model, or when nothing would be converted.
    """
    recipe = recipes.get(recipe)
    check_literal(on_unknown, "on_unknown", OnUnknown)
    if not isinstance(model, nn.Module):
        raise UsageError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    done = [(n, m) for n, m in model.named_modules() if _emulated_by(m) is not None]
    if done:
        raise UsageError(
            f"model is already converted (module {done[0][0] or '<root>'!r} is an {type(done[0][1]).__name__}); "
            "call lowprec.unconvert(model) first"
        )
    names = [n for n, _ in model.named_modules()]
    for pattern, _ in recipe.overrides:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise UsageError(
                f"recipe {recipe.name!r} has an override for {pattern!r}, which matches no module of this model; "
                f"module names are: {', '.join(n for n in names if n)[:2000]}"
            )
    targets, entries = _plan(model, recipe, module_filter)
    report = ConversionReport(recipe=recipe.name, entries=tuple(entries), attention=attention_summary(recipe))
    unknown = report.unknown
    if unknown and on_unknown == "error":
        raise UsageError(
            f"{len(unknown)} module(s) may carry GEMMs that lowprec cannot emulate and would stay in float32: "
            f"{describe_unknown(unknown)}.  Keep them in float32 on purpose by adding their names to "
            "Recipe.keep_high_precision (or their classes to keep_types), or pass on_unknown='warn' or 'ignore'"
        )
    if not targets:
        kinds = ", ".join(c.kind for c in CONVERTERS)
        raise UsageError(
            f"recipe {recipe.name!r} converts no module of this model: it has no module of a converted kind "
            f"({kinds}) outside keep_high_precision={list(recipe.keep_high_precision)} / "
            f"keep_types={list(recipe.keep_types)} and the module_filter"
        )
    for name, mod, conv, lin in targets:
        _set_child(model, name, conv.build(mod, lin, recipe.seed, name))
    emulate_attention(model, recipe)  # nothing when recipe.attention is None
    mark_masked_inputs(model)
    model.lowprec_recipe = recipe  # type: ignore[assignment]
    model.lowprec_conversion_report = report  # type: ignore[assignment]
    if unknown and on_unknown == "warn":
        warnings.warn(
            f"{len(unknown)} module(s) that may carry GEMMs were left in float32: {describe_unknown(unknown)}.  "
            "lowprec emulates the GEMMs of nn.Linear, transformers Conv1D and Mixtral-layout MoE experts only; add "
            "these names to Recipe.keep_high_precision to keep them in float32 on purpose, or pass "
            "on_unknown='ignore'.  lowprec.nn.conversion_report(model) lists every module",
            UserWarning, stacklevel=2,
        )
    return model


def unconvert(model: nn.Module) -> nn.Module:
    """Replace every emulated module by one of its original class (``nn.Linear``, transformers ``Conv1D``, ...)
    sharing its parameters (in place); returns model.

    Raises ``UsageError`` (a ``ValueError``) when the model has no converted module.
    """
    targets = [(n, m, c) for n, m in model.named_modules() if (c := _emulated_by(m)) is not None]
    if not targets:
        raise UsageError("model has no lowprec-converted module; nothing to unconvert")
    for name, mod, conv in targets:
        _set_child(model, name, conv.restore(mod))
    restore_attention(model)
    for attr in ("lowprec_recipe", "lowprec_conversion_report"):
        if hasattr(model, attr):
            delattr(model, attr)
    return model

