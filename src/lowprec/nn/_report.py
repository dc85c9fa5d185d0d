"""``ConversionReport``: what ``lowprec.convert`` did to each GEMM-carrying module of a model.

``convert`` attaches one to the model; ``lowprec.nn.conversion_report(model)`` returns it and ``print(report)``
shows a table.  Every module that owns (directly) a floating Parameter of two or more dimensions, other than an
embedding lookup, is a candidate GEMM and is listed in exactly one of four groups:

* ``converted``: swapped for an emulated module (``kind`` "linear" for ``nn.Linear``, "conv1d" for transformers'
  ``Conv1D``, or a kind added to ``lowprec.nn.CONVERTERS``); ``recipe`` says which ``LinearRecipe`` it follows.
* ``kept``: a module lowprec could convert (or an unknown one, below) that the recipe keeps in float32 on purpose:
  ``reason`` names the ``keep_high_precision`` pattern, the ``keep_types`` class or the ``module_filter``.
* ``unemulated``: convolutions (``nn.Conv1d/2d/3d`` and transposed): GEMMs lowprec knows but does not emulate; they
  run in float32 and ``convert`` does not warn about them.
* ``unknown``: modules whose GEMMs lowprec cannot see: a Parameter with three or more dimensions (MoE expert
  weights ``[E, out, in]``) or a 2-D Parameter in a module type no converter handles (a router ``weight`` used
  through ``F.linear``, ``nn.MultiheadAttention``'s ``in_proj_weight``).  They may or may not be GEMMs (a learned
  positional table is not); they stay in float32, and ``convert`` warns (``on_unknown``).  Listing one in
  ``Recipe.keep_high_precision`` (or its class in ``keep_types``) moves it to ``kept``: float32 on purpose.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from torch import nn

from .._errors import UsageError

Status = Literal["converted", "kept", "unemulated", "unknown"]
"""``ModuleEntry.status``: the report group a module belongs to."""


@dataclasses.dataclass(frozen=True)
class ModuleEntry:
    """One GEMM-carrying module of a converted model."""

    name: str
    """Qualified module name (as in ``model.named_modules()``)."""
    type: str
    """Class name of the original module (e.g. "Linear", "Conv1D", "MixtralExperts")."""
    kind: str
    """Converter kind ("linear", "conv1d", ...) for converted and kept modules; "convolution" for unemulated
    ones; "unknown" for the rest."""
    status: Status
    recipe: str = ""
    """Converted modules: the recipe followed, e.g. "fp8-tensorwise (fwd e4m3fn*e4m3fn, ...)" or an override."""
    reason: str = ""
    """Why the module was kept, unemulated or flagged unknown."""
    params: tuple[str, ...] = ()
    """Its own Parameters of 2+ dimensions as "name [shape]"."""
    note: str = ""
    """Extra facts, e.g. "weight shared with model.embed_tokens" for a tied head."""


@dataclasses.dataclass(frozen=True)
class ConversionReport:
    """What ``convert(model, recipe)`` did, group by group (see the module docstring); ``str()`` is a table."""

    recipe: str
    """Name of the recipe the model was converted with."""
    entries: tuple[ModuleEntry, ...]
    """Every GEMM-carrying module, in ``named_modules`` order."""
    attention: str = ""
    """How attention's ``Q K^T`` and ``P V`` GEMMs run: "emulated per tensor: ..." or "not emulated (...)"."""

    def _group(self, status: Status) -> tuple[ModuleEntry, ...]:
        return tuple(e for e in self.entries if e.status == status)

    @property
    def converted(self) -> tuple[ModuleEntry, ...]:
        return self._group("converted")

    @property
    def kept(self) -> tuple[ModuleEntry, ...]:
        return self._group("kept")

    @property
    def unemulated(self) -> tuple[ModuleEntry, ...]:
        return self._group("unemulated")

    @property
    def unknown(self) -> tuple[ModuleEntry, ...]:
        return self._group("unknown")

    def __getitem__(self, name: str) -> ModuleEntry:
        """The entry of module ``name``; KeyError when it carries no GEMM (or does not exist)."""
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(name)

    def __str__(self) -> str:
        counts = ", ".join(f"{len(self._group(s))} {s}" for s in ("converted", "kept", "unemulated", "unknown"))
        head = f"lowprec conversion with recipe {self.recipe!r}: {counts}"
        if self.attention:
            head += f"\nattention: {self.attention}"
        rows = [("module", "type", "status", "kind", "recipe / reason")]
        for e in self.entries:
            detail = e.recipe if e.status == "converted" else e.reason
            if e.note:
                detail = f"{detail}; {e.note}" if detail else e.note
            rows.append((e.name or "<root>", e.type, e.status, e.kind, detail))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [head] + ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4]
                          for r in rows]
        return "\n".join(line.rstrip() for line in lines)


def describe_unknown(entries: tuple[ModuleEntry, ...], limit: int = 10) -> str:
    """``name (Type, 3-D parameter gate_up_proj [4, 128, 32])`` for each entry, the first ``limit`` of them."""
    parts = [f"{e.name or '<root>'} ({e.type}, {', '.join(e.params)})" for e in entries[:limit]]
    if len(entries) > limit:
        parts.append(f"and {len(entries) - limit} more")
    return "; ".join(parts)


def conversion_report(model: nn.Module) -> ConversionReport:
    """The ``ConversionReport`` that ``lowprec.convert`` attached to ``model``.

    Raises ``UsageError`` when ``model`` was not converted (or has been unconverted since).
    """
    report = getattr(model, "lowprec_conversion_report", None)
    if not isinstance(report, ConversionReport):
        raise UsageError("model has no conversion report: it was not converted with lowprec.convert "
                         "(or lowprec.unconvert has been called since)")
    return report
