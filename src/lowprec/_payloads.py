"""Readable text for event payloads the run store holds (pure Python, so the judge and the report, which never
import torch, can describe them)."""

from __future__ import annotations

from typing import Any


def describe_payload(p: dict[str, Any]) -> str:
    """``Localization.describe`` of a ``to_dict`` payload (as stored in a "nonfinite" event)."""
    where = "the loss" if p["role"] == "loss" else (
        "the model's input" if p["role"] == "input" and not p["module"] else
        f"{p['role']} of module {p['module'] or '<model>'!r} ({p['module_type']})")
    step = "" if p.get("step") is None else f" at step {p['step']}"
    step += "" if p.get("rank") is None else f" on rank {p['rank']}"  # a data-parallel run's replay
    amax = "none" if p.get("finite_amax") is None else f"{p['finite_amax']:.4g}"
    text = (f"{where}{step}: shape {list(p['shape'])} {p['dtype']}, {p['nan']} NaN, {p['posinf']} +inf, "
            f"{p['neginf']} -inf, finite amax {amax}, first at index {tuple(p['first_index'])}")
    return text + (f" ({p['detail']})" if p.get("detail") else "")
