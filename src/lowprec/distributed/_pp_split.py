"""Splitting a converted model into pipeline stages by hand: a chain of named pieces, cut at named split points.

A pipeline-parallel model is a composition ``f = f_{S-1} o ... o f_1 o f_0`` of S stages, stage ``s`` on rank
``s``; the activation between two stages is the only thing sent forward, its gradient the only thing sent back.
Here a model is described as a chain of *pieces* ``[(name, module), ...]`` with ``x_{i+1} = module_i(x_i)``, and a
stage is a run of consecutive pieces.  The chain comes from (first that applies):

* ``order=["layers.0", "act", "layers.1", "act", "head"]``: module paths in the order the forward calls them, for
  a sequential model whose forward is such a loop (the zoo's ``mlp-digits``; a parameter-free module such as a
  shared activation may appear more than once);
* the model's own ``pipeline_pieces()`` method (the zoo GPT: ``embed`` (token + position embeddings),
  ``blocks.0`` ... ``blocks.{L-1}``, ``ln_f``, ``lm_head``);
* the children of an ``nn.Sequential``.

Split points name the piece that *begins* a stage (torch's ``SplitPoint.BEGINNING``): ``split_points=["blocks.1"]``
puts everything before ``blocks.1`` on stage 0.  Without split points, ``n_stages`` cuts the chain into
non-empty runs whose largest parameter count is as small as it can be (parameters stand in for work and memory:
a transformer block's GEMMs scale with its weights; ties go to the earliest cut), found by dynamic programming
over the cut positions.

Emulated numerics are keyed by the whole model: ``convert`` names every ``EmulatedLinear`` (``lowprec_name``, which
seeds its stochastic-rounding streams) by its path in the whole model, so convert *before* splitting and the
pieces keep those names whatever stage they land on.  Stages hold the model's own modules (no copies): training a
stage trains the model object on that rank.  A parameter shared by two stages (a head tied to the token
embedding) would need its two gradients summed across ranks; that is refused here with the fix.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn

from .._errors import UsageError

Piece = tuple[str, nn.Module]


def pipeline_pieces(model: nn.Module, order: Sequence[str] | None = None) -> list[Piece]:
    """``model`` as a chain of named pieces (module docstring): from ``order`` (module paths in call order), the
    model's ``pipeline_pieces()`` method, or an ``nn.Sequential``'s children."""
    if order is not None:
        if isinstance(order, str) or not order:
            raise UsageError(f"order must be a non-empty list of module paths in call order; got {order!r}")
        names = {n for n, _ in model.named_modules() if n}
        pieces = []
        for path in order:
            if path not in names:
                raise UsageError(f"order names module {path!r}, which the model does not have; its modules are "
                                 f"{_some(sorted(names))}")
            pieces.append((path, model.get_submodule(path)))
        return pieces
    own = getattr(model, "pipeline_pieces", None)
    if callable(own):
        return [(str(n), m) for n, m in own()]
    if isinstance(model, nn.Sequential):
        return list(model.named_children())
    raise UsageError(f"a {type(model).__name__} has no pipeline_pieces() method and is not an nn.Sequential; pass "
                     f"order=[module paths in the order its forward calls them] (e.g. ['layers.0', 'act', 'head'])")


def _some(names: Sequence[str], n: int = 12) -> str:
    return ", ".join(repr(x) for x in names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "")


class StageModule(nn.Module):
    """One pipeline stage: its pieces run in order, ``x -> piece_k(...piece_j(x))``.

    ``piece_names`` are the pieces' names in the whole model; the modules are the model's own (shared objects), so
    their ``lowprec_name``\\ s, buffers (``lp_step``, amax histories) and parameters are those of the whole model.
    """

    def __init__(self, pieces: Sequence[Piece], index: int, n_stages: int) -> None:
        super().__init__()
        self.piece_names = [n for n, _ in pieces]
        self.pieces = nn.ModuleList(m for _, m in pieces)
        self.index, self.n_stages = index, n_stages

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for piece in self.pieces:
            x = piece(x)
        return x

    def extra_repr(self) -> str:
        return f"stage {self.index} of {self.n_stages}: {', '.join(self.piece_names)}"


def _balanced_cuts(weights: list[int], n_stages: int) -> list[int]:
    """Cut positions splitting ``weights`` into ``n_stages`` non-empty runs with the smallest largest run sum.

    ``best[k][i]``: the smallest possible largest sum when the first ``i`` pieces form ``k`` runs; O(S n^2)."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for k in range(1, n_stages + 1):
        for i in range(k, n - (n_stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    cuts, i = [], n
    for k in range(n_stages, 1, -1):
        i = cut[k][i]
        cuts.append(i)
    return cuts[::-1]


def _cut_points(names: list[str], weights: list[int], n_stages: int | None,
                split_points: Sequence[str] | None) -> list[int]:
    """Indices into the chain where stages 1..S-1 begin."""
    if split_points is not None:
        if isinstance(split_points, str):
            raise UsageError(f"split_points must be a list of piece names; got the string {split_points!r}")
        cuts = []
        for sp in split_points:
            hits = [i for i, n in enumerate(names) if n == sp]
            if len(hits) != 1:
                what = "does not name a piece" if not hits else f"names {len(hits)} pieces (a module called twice)"
                raise UsageError(f"split point {sp!r} {what}; the pieces are {_some(names)}")
            cuts.append(hits[0])
        if cuts != sorted(set(cuts)) or (cuts and cuts[0] == 0):
            raise UsageError(f"split_points must be distinct pieces after the first, in call order; got "
                             f"{list(split_points)} (pieces: {_some(names)})")
        if n_stages is not None and n_stages != len(cuts) + 1:
            raise UsageError(f"n_stages = {n_stages} but {len(cuts)} split points make {len(cuts) + 1} stages; "
                             f"give one split point fewer than the stages, or leave n_stages out")
        return cuts
    if n_stages is None or isinstance(n_stages, bool) or not isinstance(n_stages, int) or n_stages < 1:
        raise UsageError(f"n_stages must be a positive int (or give split_points); got {n_stages!r}")
    if n_stages > len(names):
        raise UsageError(f"n_stages = {n_stages} is more stages than the model has pieces ({len(names)}: "
                         f"{_some(names)}); use at most {len(names)} stages, or a model with more blocks")
    return _balanced_cuts(weights, n_stages)


def _check_no_shared_parameters(stages: list[StageModule]) -> None:
    """A parameter object reachable from two stages (e.g. ``tie_head=True``) is a UsageError naming both."""
    owner: dict[int, tuple[int, str]] = {}
    for stage in stages:
        for name, piece in zip(stage.piece_names, stage.pieces, strict=True):
            for pname, p in piece.named_parameters():
                where = f"{name}.{pname}" if pname else name
                first = owner.setdefault(id(p), (stage.index, where))
                if first[0] != stage.index:
                    raise UsageError(
                        f"parameter {where!r} (stage {stage.index}) is the same tensor as {first[1]!r} (stage "
                        f"{first[0]}): a tied weight across pipeline stages (tie_head=True ties lm_head to "
                        f"tok_embed) would need its gradients summed across ranks, which is not done; put both on "
                        f"one stage (split_points) or untie them (tie_head=False)")


def split_stages(model: nn.Module, *, n_stages: int | None = None, split_points: Sequence[str] | None = None,
                 order: Sequence[str] | None = None) -> list[StageModule]:
    """Every stage of ``model`` (already converted), cut at ``split_points`` or into ``n_stages`` runs balanced by
    parameter count (module docstring).

    Returns S ``StageModule``\\ s over the model's own modules; composing them in order computes ``model(x)``
    (for a chain that mirrors the forward).  Errors (``UsageError``): unknown or repeated split points, more stages
    than pieces, a parameter shared across stages.
    """
    pieces = pipeline_pieces(model, order)
    names = [n for n, _ in pieces]
    weights = [sum(p.numel() for p in m.parameters()) for _, m in pieces]
    cuts = _cut_points(names, weights, n_stages, split_points)
    bounds = [0, *cuts, len(pieces)]
    stages = [StageModule(pieces[a:b], s, len(bounds) - 1) for s, (a, b) in enumerate(itertools.pairwise(bounds))]
    _check_no_shared_parameters(stages)
    return stages


def split_microbatches(t: torch.Tensor, n: int, *, what: str = "batch") -> list[torch.Tensor]:
    """``t`` cut along dim 0 into ``n`` equal consecutive microbatches: microbatch ``m`` is rows
    ``[m*B/n, (m+1)*B/n)``, a function of the batch (itself of (seed, step)) and ``m`` only.  The same cut as
    ``torch.distributed.pipelining``'s default chunking (``tensor_split`` on dim 0) when ``n`` divides ``B``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UsageError(f"microbatches must be a positive int; got {n!r}")
    if t.dim() == 0 or t.shape[0] % n:
        size = t.shape[0] if t.dim() else "a 0-d tensor"
        raise UsageError(f"microbatches = {n} does not divide the {what} size {size}; choose a microbatch count "
                         f"that divides it (equal microbatches keep the loss mean and the gradient scaling exact)")
    return list(t.tensor_split(n, dim=0))
