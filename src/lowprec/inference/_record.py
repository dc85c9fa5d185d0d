"""Inference verdicts in the run store: one run per judged candidate, so they sit beside the training runs.

``record_verdict`` writes a run in group ``"inference"`` (by default) whose config says what was judged (kind
``"inference-judgement"``, the reference and candidate names, the criteria and their hash, the scheme when
given), the judge's statistics as scalars at step 0 (``inference/kl_mean``, ``inference/top1``, ...), and the
whole verdict as one ``inference_verdict`` event; the run is ``completed``.  ``load_verdicts`` reads them back.
"""

from __future__ import annotations

import platform
from typing import Any

from .._errors import UsageError
from .._version import __version__
from ._judge import InferenceVerdict

KIND = "inference-judgement"
EVENT = "inference_verdict"
GROUP = "inference"


def _scalars(v: InferenceVerdict) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in v.metrics.items():
        if isinstance(value, dict) and "value" in value:
            out[f"inference/{key}"] = float(value["value"])
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[f"inference/{key}"] = float(value)
    greedy = v.metrics.get("greedy")
    if isinstance(greedy, dict):
        out["inference/greedy_mean_matched"] = float(greedy["mean_matched"])
    return out


def record_verdict(store: Any, verdict: InferenceVerdict, *, name: str | None = None, group: str = GROUP,
                   scheme: Any = None, extra: dict[str, Any] | None = None) -> str:
    """Store ``verdict`` as a completed run (module docstring) and return its run id.  ``scheme``: the
    ``lowprec.inference.Scheme`` the candidate was quantized with; ``extra``: more JSON-able config (e.g. the
    calibration algorithm)."""
    if not isinstance(verdict, InferenceVerdict):
        raise UsageError(f"record_verdict: verdict must be an InferenceVerdict; got {type(verdict).__name__}")
    import torch

    config: dict[str, Any] = {"kind": KIND, "reference": verdict.reference, "candidate": verdict.candidate,
                              "criteria": verdict.criteria, "criteria_hash": verdict.criteria_hash,
                              **(extra or {})}
    if scheme is not None:
        config["scheme"] = scheme.to_dict()
        config["scheme_hash"] = scheme.hash()
    manifest = {"kind": KIND, "lowprec_version": __version__, "torch_version": torch.__version__,
                "python": platform.python_version(), "examples": verdict.n_examples, "tokens": verdict.n_tokens}
    run_id: str = store.create_run(name=name or verdict.candidate, config=config, manifest=manifest, group=group)
    try:
        store.log_scalars(run_id, 0, _scalars(verdict))
        store.add_event(run_id, step=0, kind=EVENT, payload=verdict.to_dict())
    except BaseException as e:
        store.finish_run(run_id, status="failed", error=f"{type(e).__name__}: {e}")
        raise
    store.finish_run(run_id, status="completed")
    return run_id


def load_verdicts(store: Any, *, group: str | None = GROUP) -> list[tuple[str, InferenceVerdict]]:
    """``(run id, verdict)`` of every stored inference judgement (in ``group``; None: any group), oldest first."""
    out = []
    for rec in reversed(store.list_runs(group=group)):
        if rec.config.get("kind") != KIND:
            continue
        events = store.events(rec.run_id, EVENT)
        if events:
            out.append((rec.run_id, InferenceVerdict.from_dict(events[-1]["payload"])))
    return out
