"""``plan(model, scheme)``: which config group quantizes which module, checked against each layer's shape; and
``fake_quantize_weight``: the dequantized weight a serving kernel computes with.

Matching (compressed-tensors' rule, with fnmatch instead of ``re:`` regexes, as ``lowprec.nn.convert``): a
candidate is an ``nn.Linear`` or a module whose class name some target or ignore entry names.  An entry matches a
module when it equals the module's class name or ``fnmatch.fnmatchcase(qualified_name, entry)``.  ``ignore``
wins; otherwise the first config group with a matching target applies.  An entry that matches no module at all
is an error (a typo would otherwise silently quantize, or skip, nothing), except the ignore entry ``"lm_head"``
(``OPTIONAL_IGNORES``): every preset skips the conventional output head, and a model without one (an encoder, a
classifier) has nothing to skip.
"""

from __future__ import annotations

import fnmatch
from typing import NamedTuple

import torch
from torch import nn

from .._errors import UsageError
from ..quant._spec import QuantSpec
from ._scheme import ConfigGroup, Scheme, TensorScheme

OPTIONAL_IGNORES: tuple[str, ...] = ("lm_head",)
"""Ignore entries that may match no module (module docstring)."""


class PlanEntry(NamedTuple):
    """One module a scheme quantizes."""

    name: str
    """Qualified module name (``model.named_modules()``)."""
    module: nn.Module
    group: str
    """Name of the config group that applies."""
    weights: TensorScheme | None
    input_activations: TensorScheme | None


def _matches(entry: str, name: str, module: nn.Module) -> bool:
    return entry == type(module).__name__ or fnmatch.fnmatchcase(name, entry)


def _unknown(entry: str, field: str, names: list[str]) -> UsageError:
    shown = ", ".join(repr(n) for n in names[:40]) + (", ..." if len(names) > 40 else "")
    return UsageError(f"{field}: unknown module pattern {entry!r}: it matches no module name or class; module "
                      f"names are {shown}; fix the pattern or remove it")


def plan(model: nn.Module, scheme: Scheme) -> list[PlanEntry]:
    """The modules of ``model`` that ``scheme`` quantizes, in ``named_modules`` order.

    Raises ``UsageError`` for a target or ignore entry that matches no module, and for a scheme that does not fit
    a layer's weight shape (``check_fit``).
    """
    if not isinstance(scheme, Scheme):
        raise UsageError(f"plan(model, scheme): scheme must be a lowprec.inference.Scheme; got {type(scheme).__name__}")
    modules = [(n, m) for n, m in model.named_modules() if n]
    names = [n for n, _ in modules]
    entries = [(e, f"Scheme.ignore[{i}]") for i, e in enumerate(scheme.ignore)]
    for gi, grp in enumerate(scheme.config_groups):
        entries += [(e, f"Scheme.config_groups[{gi}].targets[{ti}]") for ti, e in enumerate(grp.targets)]
    for entry, field in entries:
        if entry in OPTIONAL_IGNORES and field.startswith("Scheme.ignore"):
            continue
        if not any(_matches(entry, n, m) for n, m in modules):
            raise _unknown(entry, field, names)
    class_names = {e for e, _ in entries}
    out: list[PlanEntry] = []
    for name, module in modules:
        if not (isinstance(module, nn.Linear) or type(module).__name__ in class_names):
            continue
        if any(_matches(e, name, module) for e in scheme.ignore):
            continue
        group = next((g for g in scheme.config_groups if any(_matches(t, name, module) for t in g.targets)), None)
        if group is None:
            continue
        _check_module(name, module, group, scheme)
        out.append(PlanEntry(name, module, group.name, group.weights, group.input_activations))
    return out


def _check_module(name: str, module: nn.Module, group: ConfigGroup, scheme: Scheme) -> None:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise UsageError(f"module {name!r} ({type(module).__name__}) matched config group {group.name!r} but has no "
                         "2-D weight [out_features, in_features]; add it to Scheme.ignore")
    gi = scheme.config_groups.index(group)
    for role in ("weights", "input_activations"):
        ts = getattr(group, role)
        if ts is not None:
            check_fit(ts, tuple(weight.shape), field=f"Scheme.config_groups[{gi}].{role}", module=name,
                      activation=role != "weights")


def check_fit(ts: TensorScheme, weight_shape: tuple[int, ...], *, field: str = "TensorScheme", module: str = "",
              activation: bool = False) -> None:
    """UsageError when ``ts`` does not fit a layer with weight ``[N, K]``: a group size must divide K (kernels for
    int4 groups, MX (32) and NVFP4 (16) blocks need whole groups along the reduction dimension); a weight block
    ``(a, b)`` must divide ``[N, K]``; activation blocks ``(1, b)`` must have ``b`` dividing K."""
    if len(weight_shape) != 2:
        raise UsageError(f"{field}: a weight shape must be [out_features, in_features]; got {list(weight_shape)}")
    n, k = weight_shape
    where = f" of module {module!r}" if module else ""
    fix = f" or add {module!r} to Scheme.ignore" if module else ""
    if ts.granularity in ("group", "tensor_group"):
        g = int(ts.group_size or 0)
        if k % g:
            raise UsageError(f"{field}.group_size={g} does not divide in_features={k}{where} (weight [{n}, {k}]); "
                             f"choose a group size that divides {k}{fix}")
    if ts.granularity == "block":
        a, b = ts.block or (1, 1)
        if activation and a != 1:
            raise UsageError(f"{field}.block={ts.block!r}: activation blocks are (1, cols) tiles of one token, "
                             f"e.g. (1, 128)")
        if k % b or (not activation and n % a):
            raise UsageError(f"{field}.block={ts.block!r} does not divide the weight [{n}, {k}]{where}; choose a "
                             f"block dividing it{fix}")


def weight_spec(ts: TensorScheme, weight_shape: tuple[int, ...]) -> QuantSpec:
    """The ``QuantSpec`` for a weight ``[N, K]`` quantized with the symmetric float scheme ``ts``, after
    ``check_fit``.  ``fake_quantize(w, weight_spec(ts, w.shape)) == fake_quantize_weight(w, ts)`` bit for bit for
    narrow scale formats (MX, NVFP4); with float32 scales QuantSpec follows the training convention (see
    ``TensorScheme.quant_spec``).  Integer schemes raise: use ``fake_quantize_weight``."""
    ts.check_role("weights", "TensorScheme")
    check_fit(ts, tuple(weight_shape))
    return ts.quant_spec()


def fake_quantize_weight(weight: torch.Tensor, ts: TensorScheme) -> torch.Tensor:
    """Quantize and dequantize a weight ``[N, K]`` (float32, bfloat16 or float16) with ``ts``: the values a
    serving kernel computes with, in ``weight``'s shape and dtype.

    Integer formats and float formats with float32 scales follow torchao's inference primitives (``_affine``);
    MX and NVFP4 (narrow scale formats) are ``lowprec.quant.fake_quantize`` with ``ts.quant_spec()``.
    """
    from . import _affine

    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise UsageError(f"fake_quantize_weight: weight must be a 2-D tensor [out_features, in_features]; got "
                         f"{getattr(weight, 'shape', type(weight).__name__)}")
    ts.check_role("weights", "TensorScheme")
    check_fit(ts, tuple(weight.shape))
    if ts.is_int:
        return _affine.fake_quantize_int(weight, ts)
    if ts.scale_format == "float32":
        return _affine.fake_quantize_float(weight, ts)
    from ..quant import fake_quantize

    return fake_quantize(weight, ts.quant_spec())
