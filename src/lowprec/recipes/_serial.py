"""Recipe <-> plain dicts (JSON, TOML).  Unknown keys are errors that name the key and the allowed ones.

``None`` values are left out of dicts (TOML has no null); every field whose value can be None defaults to None.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, TypeVar, get_type_hints

from .._errors import UsageError
from ..quant._spec import QuantSpec
from . import _recipe as R

T = TypeVar("T")

# Nested dataclass fields, by (class, field) -> class.
_NESTED: dict[tuple[type, str], type] = {
    (R.Operand, "scaling"): R.Scaling,
    (R.Gemm, "a"): R.Operand,
    (R.Gemm, "b"): R.Operand,
    (R.Gemm, "accumulator"): R.Accumulator,
    (R.LinearRecipe, "forward"): R.Gemm,
    (R.LinearRecipe, "grad_input"): R.Gemm,
    (R.LinearRecipe, "grad_weight"): R.Gemm,
    (R.Recipe, "linear"): R.LinearRecipe,
    (R.Recipe, "weights"): R.Weights,
    (R.Recipe, "optimizer"): R.OptimizerState,
    (R.Recipe, "loss_scaling"): R.LossScaling,
    (R.Recipe, "grad_comm"): R.GradComm,
    (R.Recipe, "fallback"): R.Fallback,
    (R.Recipe, "attention"): R.Attention,
    (R.Attention, "scores"): R.LinearRecipe,
    (R.Attention, "values"): R.LinearRecipe,
}
_SPEC_FIELDS = {(R.Operand, "spec"), (R.OptimizerState, "exp_avg"), (R.OptimizerState, "exp_avg_sq"),
                (R.OptimizerState, "grad"), (R.GradComm, "spec")}


def _to_plain(obj: Any) -> Any:
    if isinstance(obj, QuantSpec):
        return {k: v for k, v in obj.to_dict().items() if v is not None}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {}
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if v is None:
                continue
            if isinstance(obj, R.Recipe) and f.name == "overrides":
                out[f.name] = [{"pattern": p, "linear": _to_plain(lr)} for p, lr in v]
                continue
            out[f.name] = _to_plain(v)
        return out
    if isinstance(obj, tuple):
        return [_to_plain(v) for v in obj]
    return obj


def _from_plain(cls: type[T], data: Any, path: str) -> T:
    if not isinstance(data, dict):
        raise UsageError(f"{path} must be a table/object; got {type(data).__name__} {data!r}")
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    extra = sorted(set(data) - names)
    if extra:
        raise UsageError(f"{path}: unknown key(s) {extra}; allowed: {sorted(names)}")
    hints = get_type_hints(cls)
    kw: dict[str, Any] = {}
    for key, value in data.items():
        sub = f"{path}.{key}"
        if (cls, key) in _NESTED:
            kw[key] = _from_plain(_NESTED[(cls, key)], value, sub)
        elif (cls, key) in _SPEC_FIELDS:
            kw[key] = _spec(value, sub)
        elif cls is R.Fallback and key == "to" and isinstance(value, dict):  # a LinearRecipe table, or a name
            kw[key] = _from_plain(R.LinearRecipe, value, sub)
        elif cls is R.Recipe and key == "overrides":
            kw[key] = tuple(_override(item, f"{sub}[{i}]") for i, item in enumerate(value))
        elif "tuple" in str(hints.get(key)) and isinstance(value, list):
            kw[key] = tuple(value)
        else:
            kw[key] = value
    try:
        return cls(**kw)
    except ValueError as e:
        raise UsageError(f"{path}: {e}") from None


def _spec(value: Any, path: str) -> QuantSpec:
    if isinstance(value, str):
        try:
            return QuantSpec.named(value)
        except ValueError as e:
            raise UsageError(f"{path}: {e}") from None
    if not isinstance(value, dict):
        raise UsageError(f"{path} must be a spec name or a table of QuantSpec fields; got {value!r}")
    try:
        return QuantSpec.from_dict(value)
    except (ValueError, TypeError) as e:
        raise UsageError(f"{path}: {e}") from None


def _override(item: Any, path: str) -> tuple[str, R.LinearRecipe]:
    if not isinstance(item, dict) or set(item) != {"pattern", "linear"}:
        raise UsageError(f"{path} must be a table with exactly the keys 'pattern' and 'linear'; got {item!r}")
    return str(item["pattern"]), _from_plain(R.LinearRecipe, item["linear"], f"{path}.linear")


def recipe_to_dict(recipe: R.Recipe) -> dict[str, Any]:
    """Plain, JSON/TOML-ready data."""
    out = _to_plain(recipe)
    assert isinstance(out, dict)
    return out


def recipe_from_dict(data: dict[str, Any]) -> R.Recipe:
    """Inverse of ``recipe_to_dict``; errors name the dotted path of the bad key (e.g. ``recipe.linear.forward``)."""
    return _from_plain(R.Recipe, data, "recipe")


# ------------------------------------------------------------------------------------------------ TOML writer
def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # TOML rejects JSON's surrogate-pair escapes
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise UsageError(f"cannot write {type(v).__name__} to TOML")


def _toml_key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isascii() and k.replace("_", "").replace("-", "").isalnum() \
        else json.dumps(k, ensure_ascii=False)


def dict_to_toml(data: dict[str, Any], prefix: str = "") -> str:
    """A TOML document for nested dicts of scalars, lists of scalars, and lists of tables."""
    scalars, tables, arrays = [], [], []
    for k, v in data.items():
        key = _toml_key(k)
        if isinstance(v, dict):
            tables.append((key, v))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            arrays.append((key, v))
        else:
            scalars.append(f"{key} = {_toml_value(v)}")
    lines = list(scalars)
    for key, v in tables:
        name = f"{prefix}{key}"
        body = dict_to_toml(v, name + ".")
        lines.append(f"\n[{name}]\n{body}" if any(not isinstance(x, dict) for x in v.values()) or not v
                     else body)
    for key, items in arrays:
        name = f"{prefix}{key}"
        for item in items:
            lines.append(f"\n[[{name}]]\n{dict_to_toml(item, name + '.')}")
    return "\n".join(line for line in lines if line != "") + ("\n" if not prefix else "")
