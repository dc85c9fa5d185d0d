"""Greedy generation against the reference: how many tokens the quantized model generates before it first
chooses differently, and by how much it prefers its own choice there.

For each prompt the reference generates ``max_new_tokens`` tokens greedily (argmax of the last position's
logits, the whole sequence recomputed at each step, batch size 1, no cache).  The candidate is then run step by
step on the same prefixes (teacher forcing with the reference's tokens, again batch size 1, so that dynamic
per-tensor activation scales see exactly the inputs a served request would): up to its first divergence this is
the candidate's own greedy generation.  At step ``i`` the candidate chooses ``c = argmax l`` of its logits ``l``;
when ``c`` differs from the reference token ``r`` the *gap* is ``l[c] - l[r] >= 0`` (AWS NxDI's
``max(logits) - logits[expected]``).  A divergence with ``gap <= gap_tolerance`` is a near tie, tolerated: the
reference token is kept and generation goes on.  The first divergence with a larger gap ends the comparison of
that prompt: ``matched`` is the number of tokens generated before it (``max_new_tokens`` when there is none).
The reference's own margin (its top-1 minus top-2 logit) at that step is kept too: a divergence where the
reference itself was nearly tied says little about the candidate.

A model is called as ``model(input_ids=ids)`` when its ``forward`` takes ``input_ids`` (Hugging Face), else
``model(ids)``, with ``ids`` of shape ``[1, length]``; its output is the logits or has ``.logits``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .._batches import output_tensor
from .._errors import UsageError


@dataclasses.dataclass(frozen=True)
class GreedyResult:
    """One prompt's comparison (module docstring)."""

    prompt: int
    """Index of the prompt."""
    matched: int
    """Tokens generated before the first divergence beyond the tolerance (``max_new_tokens`` if none)."""
    max_new_tokens: int
    divergence: int | None
    """The step of that divergence, or None."""
    gap: float | None
    """``l[c] - l[r]`` of the candidate's logits at that divergence."""
    reference_margin: float | None
    """The reference's top-1 minus top-2 logit at that step."""
    tolerated: int
    """Divergences within the tolerance before it (near ties, generation continued)."""
    reference_tokens: tuple[int, ...]
    candidate_token: int | None
    """The candidate's choice at the divergence."""

    @property
    def full_match(self) -> bool:
        return self.divergence is None

    def to_dict(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "matched": self.matched, "max_new_tokens": self.max_new_tokens,
                "divergence": self.divergence, "gap": self.gap, "reference_margin": self.reference_margin,
                "tolerated": self.tolerated, "reference_tokens": list(self.reference_tokens),
                "candidate_token": self.candidate_token}


def _caller(model: nn.Module) -> Any:
    try:
        takes_ids = "input_ids" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes_ids = False

    def call(ids: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=ids) if takes_ids else model(ids)
        logits = output_tensor(out)
        if logits.dim() != 3 or logits.shape[:2] != ids.shape:
            raise UsageError(f"greedy generation: a language model must return logits [1, length, vocab] for input "
                             f"ids [1, length]; got {list(logits.shape)} for {list(ids.shape)}")
        return logits[0, -1].detach().double()

    return call


def _check_prompts(prompts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(prompts, torch.Tensor):
        prompts = list(prompts) if prompts.dim() == 2 else [prompts]
    if not isinstance(prompts, Sequence) or not prompts:
        raise UsageError("greedy generation: prompts must be a non-empty list of 1-D integer token tensors")
    out = []
    for i, p in enumerate(prompts):
        if not isinstance(p, torch.Tensor) or p.dim() != 1 or p.is_floating_point() or p.numel() == 0:
            raise UsageError(f"greedy generation: prompts[{i}] must be a non-empty 1-D integer tensor of token ids; "
                             f"got {getattr(p, 'dtype', type(p).__name__)} {list(getattr(p, 'shape', []))}")
        out.append(p.long())
    return out


def greedy_divergence(reference: nn.Module, candidate: nn.Module, prompts: Sequence[torch.Tensor], *,
                      max_new_tokens: int = 16, gap_tolerance: float = 1e-3) -> list[GreedyResult]:
    """Compare greedy generation of ``candidate`` with ``reference`` on each prompt (module docstring)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise UsageError(f"greedy generation: max_new_tokens must be a positive int; got {max_new_tokens!r}")
    if isinstance(gap_tolerance, bool) or not isinstance(gap_tolerance, int | float) or not gap_tolerance >= 0:
        raise UsageError(f"greedy generation: gap_tolerance must be a number >= 0 (logits); got {gap_tolerance!r}")
    plist = _check_prompts(prompts)
    modes = {m: m.training for model in (reference, candidate) for m in model.modules()}
    ref_call, cand_call = _caller(reference), _caller(candidate)
    results = []
    try:
        reference.eval()
        candidate.eval()
        with torch.no_grad():
            for pi, prompt in enumerate(plist):
                seq = prompt.clone()
                tokens: list[int] = []
                margins: list[float] = []
                for _ in range(max_new_tokens):
                    logits = ref_call(seq[None])
                    top2 = logits.topk(min(2, logits.numel())).values
                    tok = int(logits.argmax())
                    margins.append(float(top2[0] - top2[-1]))
                    tokens.append(tok)
                    seq = torch.cat([seq, torch.tensor([tok], dtype=seq.dtype)])
                results.append(_follow(cand_call, prompt, tokens, margins, pi, float(gap_tolerance)))
    finally:
        for m, mode in modes.items():
            m.training = mode
    return results


def _follow(cand_call: Any, prompt: torch.Tensor, tokens: list[int], margins: list[float], pi: int,
            tol: float) -> GreedyResult:
    n = len(tokens)
    tolerated = 0
    seq = prompt
    for i, ref_tok in enumerate(tokens):
        logits = cand_call(seq[None])
        choice = int(logits.argmax())
        if choice != ref_tok:
            gap = float(logits[choice] - logits[ref_tok])
            if not gap <= tol:  # NaN logits are never a near tie
                return GreedyResult(pi, i, n, i, gap, margins[i], tolerated, tuple(tokens), choice)
            tolerated += 1
        seq = torch.cat([seq, torch.tensor([ref_tok], dtype=seq.dtype)])
    return GreedyResult(pi, n, n, None, None, None, tolerated, tuple(tokens), None)
