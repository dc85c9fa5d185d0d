"""``convert`` / ``unconvert``: swap ``nn.Linear`` modules for recipe-emulated ones and back, in place."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable

from torch import nn

from .. import recipes
from .._errors import UsageError
from ..recipes import LinearRecipe, Recipe
from ._linear import EmulatedLinear
from ._masked_inputs import mark_masked_inputs

ModuleFilter = Callable[[nn.Module, str], bool]


def _kept(name: str, recipe: Recipe, ancestors: list[nn.Module]) -> bool:
    if any(fnmatch.fnmatchcase(name, p) for p in recipe.keep_high_precision):
        return True
    return any(type(m).__name__ in recipe.keep_types for m in ancestors)


def _linear_recipe(name: str, recipe: Recipe) -> LinearRecipe:
    for pattern, lin in recipe.overrides:
        if fnmatch.fnmatchcase(name, pattern):
            return lin
    return recipe.linear


def _set_child(root: nn.Module, qualname: str, new: nn.Module) -> None:
    parent_name, _, child = qualname.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def convert(model: nn.Module, recipe: Recipe | str, *, module_filter: ModuleFilter | None = None) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place) by an ``EmulatedLinear`` following ``recipe``.

    Linears are left alone when their qualified name matches ``recipe.keep_high_precision``, when an enclosing
    module's class is in ``recipe.keep_types``, or when ``module_filter(module, name)`` returns False.  Parameters
    are shared, not copied.  Returns ``model``.

    Raises ``ValueError`` when the model is already converted, when a per-module override names no module of the
    model, or when nothing would be converted.
    """
    recipe = recipes.get(recipe)
    if not isinstance(model, nn.Module):
        raise UsageError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    done = [n for n, m in model.named_modules() if isinstance(m, EmulatedLinear)]
    if done:
        raise UsageError(
            f"model is already converted (module {done[0] or '<root>'!r} is an EmulatedLinear); "
            "call lowprec.unconvert(model) first"
        )
    names = [n for n, _ in model.named_modules()]
    for pattern, _ in recipe.overrides:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise UsageError(
                f"recipe {recipe.name!r} has an override for {pattern!r}, which matches no module of this model; "
                f"module names are: {', '.join(n for n in names if n)[:2000]}"
            )
    targets: list[tuple[str, nn.Linear]] = []

    def walk(mod: nn.Module, prefix: str, ancestors: list[nn.Module]) -> None:
        for child_name, child in mod.named_children():
            name = f"{prefix}{child_name}"
            if type(child) is nn.Linear and not _kept(name, recipe, ancestors + [mod]):
                if module_filter is None or module_filter(child, name):
                    targets.append((name, child))
            walk(child, name + ".", ancestors + [mod])

    if type(model) is nn.Linear:
        raise UsageError("convert() swaps submodules; wrap a bare nn.Linear in a container (e.g. nn.Sequential)")
    walk(model, "", [])
    if not targets:
        raise UsageError(
            f"recipe {recipe.name!r} converts no module of this model: it has no nn.Linear outside "
            f"keep_high_precision={list(recipe.keep_high_precision)} / keep_types={list(recipe.keep_types)} "
            "and the module_filter"
        )
    for name, lin in targets:
        _set_child(model, name, EmulatedLinear.from_linear(lin, _linear_recipe(name, recipe), seed=recipe.seed,
                                                           name=name))
    mark_masked_inputs(model)
    model.lowprec_recipe = recipe  # type: ignore[assignment]
    return model


def unconvert(model: nn.Module) -> nn.Module:
    """Replace every ``EmulatedLinear`` by a plain ``nn.Linear`` sharing its parameters (in place); returns model.

    Raises ``ValueError`` when the model has no converted module.
    """
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, EmulatedLinear)]
    if not targets:
        raise UsageError("model has no lowprec-converted module; nothing to unconvert")
    for name, mod in targets:
        _set_child(model, name, mod.to_linear())
    if hasattr(model, "lowprec_recipe"):
        del model.lowprec_recipe
    return model
