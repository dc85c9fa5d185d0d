"""Emulating an MoE router's GEMM, when the recipe asks for it.

A transformers router (``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``, ...) multiplies the hidden states by its
2-D ``weight`` [experts, hidden] through ``F.linear`` and picks each token's top-k experts from the logits.  A
rounded logit can flip a discrete choice, so ``convert`` keeps routers float32 by default; a recipe that says
otherwise names the router in ``Recipe.overrides`` (e.g. ``("*.mlp.gate", fp8.linear)``), and then that router's
GEMM follows the override's ``LinearRecipe``: forward and both backward GEMMs, exactly those of an
``EmulatedLinear`` holding the router's weight.

The router keeps its own class behaviour (its softmax, top-k and normalisation differ between families): its class
is swapped for a subclass whose ``forward`` runs the original one inside a ``TorchFunctionMode`` that sends
``F.linear(x, self.weight)`` to a hidden ``EmulatedLinear`` sharing the weight Parameter.  The module path, the
Parameter and the state dict are unchanged, and ``unconvert`` swaps the class back.  The hidden module holds no
state of its own, so recipes that need some (delayed scaling's amax histories, stochastic rounding's step
counter) are refused for routers.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .._errors import UsageError
from ..recipes import LinearRecipe
from ._linear import EmulatedLinear

_HIDDEN = "_lowprec_router_linear"
_CLASSES: dict[type, type] = {}


def is_router(mod: nn.Module) -> bool:
    """A transformers MoE router: a class named ``*Router`` with a 2-D ``weight`` [experts, hidden] it multiplies
    through ``F.linear`` (``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``, ``DeepseekV3TopkRouter``, ...)."""
    w = getattr(mod, "weight", None)
    return type(mod).__name__.lower().endswith("router") and isinstance(w, nn.Parameter) and w.dim() == 2


class _RouterLinear(TorchFunctionMode):
    """Sends ``F.linear(x, router.weight[, bias])`` to the router's hidden ``EmulatedLinear``."""

    def __init__(self, router: nn.Module) -> None:
        super().__init__()
        self.router = router

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2 and args[1] is self.router.weight:
            out = self.router.__dict__[_HIDDEN](args[0])
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return out if bias is None else out + bias.to(out.dtype)
        return func(*args, **kwargs)


class EmulatedRouterMixin:
    """The forward of an emulated router: the original class's forward with its ``F.linear`` emulated."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with _RouterLinear(self):  # type: ignore[arg-type]
            return super().forward(*args, **kwargs)  # type: ignore[misc]


def _emulated_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Emulated{cls.__name__}", (EmulatedRouterMixin, cls), {"__module__": __name__})
    return _CLASSES[cls]


def check_router_recipe(recipe: LinearRecipe, name: str) -> None:
    """UsageError for a recipe that needs per-module state (delayed scaling, stochastic rounding), which a router's
    hidden ``EmulatedLinear`` does not keep; ``convert`` calls it before changing any module."""
    ops = recipe.operands().values()
    if any(op.scaling.kind == "delayed" or (op.spec is not None and op.spec.rounding == "stochastic") for op in ops):
        raise UsageError(f"router {name!r}: the override's recipe uses delayed scaling or stochastic rounding, which "
                         "need per-module state a router does not keep; give the router a recipe with current "
                         "scaling and round-to-nearest (or drop its override to keep it float32)")


def build_router(router: nn.Module, recipe: LinearRecipe, seed: int, name: str) -> nn.Module:
    """``router`` itself, its class swapped for the emulated subclass and a hidden ``EmulatedLinear`` sharing its
    weight (``check_router_recipe`` first)."""
    check_router_recipe(recipe, name)
    w = router.weight
    assert isinstance(w, nn.Parameter)
    shell = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(shell)
    shell.in_features, shell.out_features = int(w.shape[1]), int(w.shape[0])
    shell.weight = w
    shell.register_parameter("bias", None)
    lin = EmulatedLinear.from_linear(shell, recipe, seed=seed, name=name)
    router.__dict__[_HIDDEN] = lin
    router.__class__ = _emulated_class(type(router))
    return router


def is_emulated_router(mod: nn.Module) -> bool:
    return isinstance(mod, EmulatedRouterMixin)


def restore_router(router: nn.Module) -> nn.Module:
    """The router with its original class and no hidden module (the same object and Parameter)."""
    router.__dict__.pop(_HIDDEN, None)
    original = next(c for c in type(router).__mro__[1:] if not issubclass(c, EmulatedRouterMixin))
    router.__class__ = original  # type: ignore[assignment]
    return router


def router_linear(router: nn.Module) -> EmulatedLinear:
    """The hidden ``EmulatedLinear`` of an emulated router (its recipe, its name)."""
    lin = router.__dict__.get(_HIDDEN)
    if not isinstance(lin, EmulatedLinear):
        raise UsageError(f"{type(router).__name__} is not an emulated router")
    return lin


__all__ = ["EmulatedRouterMixin", "build_router", "check_router_recipe", "is_emulated_router", "is_router",
           "restore_router", "router_linear"]
