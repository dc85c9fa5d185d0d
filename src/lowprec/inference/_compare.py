"""Paired outputs of a reference and a quantized model on the same held-out inputs, per token.

``compare(reference, candidate, data)`` runs both models (and, for the three-way mode, a bfloat16 copy of the
reference) on every batch, in eval mode under ``torch.no_grad``, by lowprec's batch contract
(``lowprec._batches``), and keeps per *token* (a position whose output is a distribution over ``V`` classes;
a classifier's example is one token) in float64:

    p = softmax(reference logits)          q = softmax(candidate logits)
    KL(p || q) = sum_v p_v (log p_v - log q_v)     ("forward": the reference's view, llama.cpp's KLD)
    KL(q || p) = sum_v q_v (log q_v - log p_v)     ("reverse")
    top-1 agreement: argmax q == argmax p          (torch.argmax: the first of tied maxima)
    NLL_ref = -log p[target], NLL_cand = -log q[target]    (positions with a target only)

with ``0 log 0 = 0`` and KL clamped at 0 from below (float64 rounding of a sum of terms that is >= 0 in exact
arithmetic).  Targets: a dict batch with ``labels`` of the logits' ``[B, T]`` shape is a Hugging Face causal LM
(the model shifts: position ``t`` predicts ``labels[t + 1]``, and ``-100`` is ignored); a tuple ``(*inputs,
target)`` with an integer target of the logits' leading shape is aligned as given (the zoo's language models
are pre-shifted; a classifier's ``[B]`` labels); anything else has no targets (no perplexity).  An
``attention_mask`` in a dict batch drops padded positions from every metric.

Each token remembers its example (a row of a batch, numbered across batches), the unit the judge resamples.
Logit tolerances (``{5: (atol, rtol), 50: ..., "all": ...}``, the vLLM-Neuron/NxDI map): for each key ``k``,
the candidate's logits at the reference's top-``k`` classes must satisfy ``|c - r| <= atol + rtol * |r|``; the
worst ``|c - r| / (atol + rtol |r|)`` and where it occurred are kept, and the number of tokens over 1.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from .._batches import call_model, output_tensor
from .._errors import UsageError

IGNORE_INDEX = -100
"""Targets equal to this are not scored (PyTorch's ``cross_entropy`` and Hugging Face's convention)."""

TolKey = int | str
Tolerances = Mapping[TolKey, tuple[float, float]]


def check_tolerances(tolerances: object, field: str = "logit_tolerances") -> dict[TolKey, tuple[float, float]]:
    """The tolerance map, validated: keys positive ints (top-k) or ``"all"``, values ``(atol, rtol) >= 0``."""
    if tolerances is None:
        return {}
    if not isinstance(tolerances, Mapping):
        raise UsageError(f"{field} must be a mapping such as {{5: (1e-5, 0.02), 'all': (1e-5, 0.05)}}; got "
                         f"{type(tolerances).__name__}")
    out: dict[TolKey, tuple[float, float]] = {}
    for key, value in tolerances.items():
        k: TolKey
        if key == "all":
            k = "all"
        elif isinstance(key, str) and key.isdigit():
            k = int(key)
        elif isinstance(key, int) and not isinstance(key, bool):
            k = key
        else:
            raise UsageError(f"{field}: key {key!r} must be a positive int (top-k) or 'all'")
        if isinstance(k, int) and k < 1:
            raise UsageError(f"{field}: key {key!r} must be a positive int (top-k) or 'all'")
        ok = isinstance(value, tuple | list) and len(value) == 2 and all(
            isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 and np.isfinite(v) for v in value)
        if not ok or not any(float(v) > 0 for v in value):
            raise UsageError(f"{field}[{key!r}] must be (atol, rtol), two finite numbers >= 0, not both 0; got "
                             f"{value!r}")
        out[k] = (float(value[0]), float(value[1]))
    return out


@dataclasses.dataclass
class ToleranceCheck:
    """The worst logit error relative to its allowance for one key of the tolerance map."""

    key: TolKey
    atol: float
    rtol: float
    tokens: int = 0
    violations: int = 0
    worst_ratio: float = 0.0
    """max ``|c - r| / (atol + rtol |r|)`` over the checked logits (<= 1: within tolerance)."""
    worst: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Where: example, position, class, reference and candidate logits."""

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "atol": self.atol, "rtol": self.rtol, "tokens": self.tokens,
                "violations": self.violations, "worst_ratio": self.worst_ratio, "worst": self.worst}


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Per-token paired outputs (module docstring).  Arrays are float64 (``agree``: bool), one entry per token,
    in the order the batches gave them; ``example`` numbers each token's example from 0."""

    example: np.ndarray
    kl: np.ndarray
    """KL(reference || candidate), nats."""
    kl_reverse: np.ndarray
    """KL(candidate || reference), nats."""
    agree: np.ndarray
    has_target: np.ndarray
    """bool: the token has a target (NLL defined)."""
    nll_ref: np.ndarray
    nll_cand: np.ndarray
    kl_bf16: np.ndarray | None
    """KL(reference || bfloat16 copy of the reference), the three-way mode's noise floor; None without it."""
    tolerances: tuple[ToleranceCheck, ...]
    batches: int
    kind: str = "logits"
    """"logits" (distributions over classes) or "embedding" (vectors compared by direction and distance; the
    distribution fields are then NaN and the next four hold the statistics)."""
    cosine: np.ndarray | None = None
    """Embedding mode: cosine similarity of candidate and reference vectors."""
    sq_err: np.ndarray | None = None
    """Embedding mode: ``|c - r|^2``."""
    sq_ref: np.ndarray | None = None
    """Embedding mode: ``|r|^2``."""
    sq_err_bf16: np.ndarray | None = None
    """Embedding mode, three-way: ``|b - r|^2`` of the bfloat16 copy."""

    @property
    def n_tokens(self) -> int:
        return int(self.kl.size)

    @property
    def n_examples(self) -> int:
        return int(self.example.max()) + 1 if self.example.size else 0


def bf16_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` in bfloat16 (parameters and floating buffers): "the same model run in bf16"."""
    return copy.deepcopy(model).to(torch.bfloat16)


def _cast_floats(batch: Any, dtype: torch.dtype) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, Mapping):
        return {k: _cast_floats(v, dtype) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(_cast_floats(v, dtype) for v in batch)
    return batch


def _logits(model: nn.Module, batch: Any, what: str, index: int) -> torch.Tensor:
    try:
        out, _ = call_model(model, batch)
    except (RuntimeError, TypeError, ValueError) as e:
        raise UsageError(f"batch {index}: the {what} model cannot run on it ({type(e).__name__}: {e}); check that "
                         "the batches are what the model takes") from e
    logits = output_tensor(out)
    if logits.dim() < 2 or not logits.is_floating_point():
        raise UsageError(f"batch {index}: the {what} model's output must be floating-point logits [batch, ..., "
                         f"classes]; got {logits.dtype} {list(logits.shape)}")
    if logits.dim() == 2:
        logits = logits[:, None, :]
    return logits.reshape(logits.shape[0], -1, logits.shape[-1]).detach().double()


def _targets(batch: Any, logits: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(targets [B, T] or None, valid [B, T] bool)`` by the rules of the module docstring."""
    b, t = logits.shape[:2]
    valid = torch.ones(b, t, dtype=torch.bool)
    if isinstance(batch, Mapping):
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor) and tuple(mask.shape) == (b, t):
            valid = mask.detach().cpu().bool()
        labels = batch.get("labels")
        if isinstance(labels, torch.Tensor) and not labels.is_floating_point():
            labels = labels.detach().cpu().long()
            if tuple(labels.shape) == (b, t):
                shifted = torch.full((b, t), IGNORE_INDEX, dtype=torch.long)
                shifted[:, :-1] = labels[:, 1:]
                return shifted, valid
            if tuple(labels.shape) == (b,) and t == 1:
                return labels[:, None], valid
        return None, valid
    if isinstance(batch, tuple | list):
        target = batch[-1]
        if isinstance(target, torch.Tensor) and not target.is_floating_point() and target.numel() == b * t:
            return target.detach().cpu().long().reshape(b, t), valid
    return None, valid


class _Collector:
    def __init__(self, tolerances: dict[TolKey, tuple[float, float]], kind: str = "logits") -> None:
        self.kind = kind
        self.parts: dict[str, list[np.ndarray]] = {k: [] for k in (
            "example", "kl", "kl_reverse", "agree", "has_target", "nll_ref", "nll_cand", "kl_bf16", "cosine",
            "sq_err", "sq_ref", "sq_err_bf16")}
        self.checks = [ToleranceCheck(k, *v) for k, v in tolerances.items()]
        self.examples = 0

    def add_embedding(self, ref: torch.Tensor, cand: torch.Tensor, bf16: torch.Tensor | None,
                      valid: torch.Tensor) -> None:
        """Vectors ``[B, T, D]``: cosine similarity and squared distances per token (float64)."""
        b, t, _ = ref.shape
        sel = valid.reshape(-1)
        r, c = ref.reshape(b * t, -1)[sel], cand.reshape(b * t, -1)[sel]
        n = int(sel.sum())
        ex = (torch.arange(b)[:, None].expand(b, t).reshape(-1) + self.examples)[sel]
        self.parts["example"].append(ex.numpy())
        self.parts["cosine"].append(torch.nn.functional.cosine_similarity(c, r, dim=-1, eps=1e-30).numpy())
        self.parts["sq_err"].append((c - r).square().sum(-1).numpy())
        self.parts["sq_ref"].append(r.square().sum(-1).numpy())
        if bf16 is not None:
            lo = bf16.reshape(b * t, -1)[sel]
            self.parts["sq_err_bf16"].append((lo - r).square().sum(-1).numpy())
        for key in ("kl", "kl_reverse", "nll_ref", "nll_cand"):
            self.parts[key].append(np.full(n, np.nan))
        self.parts["agree"].append(np.zeros(n, dtype=bool))
        self.parts["has_target"].append(np.zeros(n, dtype=bool))
        self.examples += b

    def add(self, ref: torch.Tensor, cand: torch.Tensor, bf16: torch.Tensor | None, targets: torch.Tensor | None,
            valid: torch.Tensor) -> None:
        b, t, v = ref.shape
        lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(cand, -1)
        kl = _kl(lp, lq)
        sel = valid.reshape(-1)
        ex = (torch.arange(b)[:, None].expand(b, t).reshape(-1) + self.examples)[sel]
        self.parts["example"].append(ex.numpy())
        self.parts["kl"].append(kl.reshape(-1)[sel].numpy())
        self.parts["kl_reverse"].append(_kl(lq, lp).reshape(-1)[sel].numpy())
        self.parts["agree"].append((ref.argmax(-1) == cand.argmax(-1)).reshape(-1)[sel].numpy())
        if targets is not None:
            has = (targets != IGNORE_INDEX) & (targets >= 0) & (targets < v)
            idx = torch.where(has, targets, 0)[..., None]
            self.parts["has_target"].append(has.reshape(-1)[sel].numpy())
            self.parts["nll_ref"].append((-lp.gather(-1, idx)[..., 0]).reshape(-1)[sel].numpy())
            self.parts["nll_cand"].append((-lq.gather(-1, idx)[..., 0]).reshape(-1)[sel].numpy())
        else:
            n = int(sel.sum())
            self.parts["has_target"].append(np.zeros(n, dtype=bool))
            self.parts["nll_ref"].append(np.full(n, np.nan))
            self.parts["nll_cand"].append(np.full(n, np.nan))
        if bf16 is not None:
            self.parts["kl_bf16"].append(_kl(lp, torch.log_softmax(bf16, -1)).reshape(-1)[sel].numpy())
        for check in self.checks:
            self._tolerance(check, ref, cand, valid)
        self.examples += b

    def _tolerance(self, check: ToleranceCheck, ref: torch.Tensor, cand: torch.Tensor, valid: torch.Tensor) -> None:
        v = ref.shape[-1]
        k = v if check.key == "all" else min(int(check.key), v)
        top = ref.topk(k, dim=-1).indices
        r, c = ref.gather(-1, top), cand.gather(-1, top)
        ratio = (c - r).abs() / (check.atol + check.rtol * r.abs())
        ratio = torch.where(torch.isnan(ratio), torch.inf, ratio)  # a NaN logit is never within tolerance
        worst_tok = ratio.amax(-1).masked_fill(~valid, -1.0)
        check.tokens += int(valid.sum())
        check.violations += int((worst_tok > 1.0).sum())
        m = float(worst_tok.max())
        if m > check.worst_ratio or not check.worst:
            flat = int(worst_tok.reshape(-1).argmax())
            bi, ti = divmod(flat, ref.shape[1])
            j = int(ratio[bi, ti].argmax())
            cls = int(top[bi, ti, j])
            check.worst_ratio = m
            check.worst = {"example": self.examples + bi, "position": ti, "class": cls,
                           "reference": float(ref[bi, ti, cls]), "candidate": float(cand[bi, ti, cls])}

    def result(self, batches: int) -> Comparison:
        def cat(key: str, dtype: Any) -> np.ndarray:
            parts = self.parts[key]
            return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)

        return Comparison(example=cat("example", np.int64), kl=cat("kl", np.float64),
                          kl_reverse=cat("kl_reverse", np.float64), agree=cat("agree", bool),
                          has_target=cat("has_target", bool), nll_ref=cat("nll_ref", np.float64),
                          nll_cand=cat("nll_cand", np.float64),
                          kl_bf16=cat("kl_bf16", np.float64) if self.parts["kl_bf16"] else None,
                          tolerances=tuple(self.checks), batches=batches, kind=self.kind,
                          **{k: cat(k, np.float64) if self.parts[k] else None
                             for k in ("cosine", "sq_err", "sq_ref", "sq_err_bf16")})


def _kl(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last dim from log-probabilities, ``0 log 0 = 0``, clamped at 0."""
    p = lp.exp()
    terms = torch.where(p > 0, p * (lp - lq), torch.zeros_like(p))
    return terms.sum(-1).clamp(min=0.0)


def compare(reference: nn.Module, candidate: nn.Module, data: Iterable[Any], *, bf16: nn.Module | str | None = None,
            logit_tolerances: Tolerances | None = None, batches: int | None = None,
            output: str = "logits") -> Comparison:
    """Run ``reference`` and ``candidate`` (and ``bf16``: a model, ``"auto"`` for ``bf16_copy(reference)``, or
    None) on every batch of ``data`` and return the per-token ``Comparison`` (module docstring).  ``output``:
    ``"logits"`` (distributions) or ``"embedding"`` (the outputs are vectors: sentence embeddings, hidden states;
    cosine similarity and squared distances per row instead of KL).

    Raises ``UsageError`` for an empty ``data``, batches a model cannot run, outputs that are not logits, and
    reference and candidate outputs of different shapes.  The models' train/eval modes are restored."""
    for what, m in (("reference", reference), ("candidate", candidate)):
        if not isinstance(m, nn.Module):
            raise UsageError(f"compare: {what} must be a torch.nn.Module; got {type(m).__name__}")
    if batches is not None and (isinstance(batches, bool) or not isinstance(batches, int) or batches < 1):
        raise UsageError(f"compare: batches must be a positive int or None; got {batches!r}")
    if output not in ("logits", "embedding"):
        raise UsageError(f"compare: output must be 'logits' or 'embedding'; got {output!r}")
    tols = check_tolerances(logit_tolerances)
    if tols and output == "embedding":
        raise UsageError("compare: logit_tolerances apply to logits, not to output='embedding'")
    noise: nn.Module | None
    if bf16 == "auto":
        noise = bf16_copy(reference)
    elif bf16 is None or isinstance(bf16, nn.Module):
        noise = bf16
    else:
        raise UsageError(f"compare: bf16 must be a model, 'auto' or None; got {bf16!r}")
    models = [m for m in (reference, candidate, noise) if m is not None]
    modes = {m: m.training for model in models for m in model.modules()}
    collector = _Collector(tols, output)
    count = 0
    try:
        for model in models:
            model.eval()
        with torch.no_grad():
            for i, batch in enumerate(data if batches is None else itertools.islice(data, batches)):
                ref = _logits(reference, batch, "reference", i)
                cand = _logits(candidate, batch, "candidate", i)
                if ref.shape != cand.shape:
                    raise UsageError(f"batch {i}: reference logits {list(ref.shape)} and candidate logits "
                                     f"{list(cand.shape)} differ in shape: compare the same model quantized")
                low = None if noise is None else _logits(noise, _cast_floats(batch, torch.bfloat16), "bf16", i)
                targets, valid = _targets(batch, ref)
                if output == "embedding":
                    collector.add_embedding(ref, cand, low, valid)
                else:
                    collector.add(ref, cand, low, targets, valid)
                count += 1
    finally:
        for m, mode in modes.items():
            m.training = mode
    if count == 0:
        raise UsageError("compare: the held-out data is empty (no batch): pass at least one batch")
    result = collector.result(count)
    if result.n_tokens == 0:
        raise UsageError("compare: every position of the held-out data is masked out (attention_mask all 0)")
    return result
