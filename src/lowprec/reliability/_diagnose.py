"""Telling a transient fault from a persistent one from the data: the rerun state machine's decision.

The runner computes a rejected step up to three times, every rank taking part each time, and describes each
computation by a ``Computation`` (who computed which batch shard: local loss, gradient norm, digests of the
gradients and weights it ended with, and optionally its modules' output fingerprints):

1. the original step;
2. the *rerun*: the same step again, in place, from the same state (buffers, random generator, same batch);
3. if the rerun reproduced the original: the *swap*: rank ``r`` computes the batch shard of rank ``r + 1`` (mod
   W), so every shard is computed by a second rank.

``diagnose`` decides (Megatron-LM's rerun state machine, with the second run on another rank done in place instead
of from a checkpoint on other nodes):

* the rerun differs from the original on some rank: **transient** (the fault did not repeat).  The rank is the
  one whose local loss changed (a forward fault: every rank's reduced gradients change with it), else whose module
  output fingerprints changed (a forward fault too small to change the loss's bits), else whose gradients changed
  (a fault after the reduction); the tensor is the first module whose output fingerprint changed, else (a fault
  after the reduction) the gradients that changed;
* the rerun reproduces it, and some shard computed by two ranks differs, or the replicas' weights or reduced
  gradients (identical by construction under DDP, and within each group of HSDP replicas) disagree:
  **persistent**, on the rank common to every disagreement; with two ranks every disagreement involves both, and
  the faulty one is taken to be the one whose result is further from acceptable (non-finite, else the larger loss
  or gradient norm: the direction of a rejection) -- an assumption, stated in the diagnosis;
* otherwise **reproducible**: the data or the numerics (a single process cannot tell these from a persistent
  fault of its own device, and says so).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from typing import Any, Literal

from ._digest import first_difference

Verdict = Literal["transient", "persistent", "reproducible"]


@dataclasses.dataclass(frozen=True)
class Computation:
    """One rank's computation of one batch shard of the step."""

    rank: int
    shard: int
    loss: float
    grad_norm: float
    grads: tuple[int, ...] = ()
    """Digests of this rank's gradients after the step's reduction, one per parameter (``_digest.digests``)."""
    weights: tuple[int, ...] = ()
    modules: tuple[tuple[str, int], ...] = ()
    """Module output fingerprints in call order (empty unless ``[reliability] fingerprints``)."""
    grad_norms: tuple[float, ...] = ()
    """L2 norm of each gradient: gradient clipping scales every gradient of a rank by one factor, so the tensor a
    fault hit is the one whose norm changed by another factor than the rest."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Computation:
        return cls(rank=d["rank"], shard=d["shard"], loss=d["loss"], grad_norm=d["grad_norm"],
                   grads=tuple(d["grads"]), weights=tuple(d["weights"]),
                   modules=tuple((n, v) for n, v in d["modules"]), grad_norms=tuple(d.get("grad_norms", ())))


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """The verdict on a rejected step (an event payload: ``to_dict``)."""

    verdict: Verdict
    ranks: tuple[int, ...]
    """The rank(s) the fault is attributed to (empty when reproducible)."""
    tensors: tuple[str, ...]
    """What differed: ``"activation:<module>"``, ``"grad:<param>"``, ``"weight:<param>"``; may be empty."""
    differed: dict[str, list[str]]
    """Per rank (a string key), what differed, in words."""
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "ranks": list(self.ranks), "tensors": list(self.tensors),
                "differed": self.differed, "detail": self.detail}


def _same(a: float, b: float) -> bool:
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b) or (math.isnan(a) and math.isnan(b))


def _badness(c: Computation) -> tuple[int, float, int, float]:
    """Orders computations by how far from acceptable they are: non-finite loss, loss, non-finite norm, norm."""
    lf = math.isfinite(c.loss)
    nf = math.isfinite(c.grad_norm)
    return (0 if lf else 1, c.loss if lf else 0.0, 0 if nf else 1, c.grad_norm if nf else 0.0)


def _changes(a: Computation, b: Computation, names: Sequence[str]) -> list[str]:
    """What differs between two computations of the same shard, in words."""
    out = []
    if not _same(a.loss, b.loss):
        out.append(f"loss {a.loss!r} vs {b.loss!r}")
    module = _module_diff(a, b)
    if module is not None:
        out.append(f"first module output that differs: {module}")
    if not _same(a.grad_norm, b.grad_norm):
        out.append(f"gradient norm {a.grad_norm!r} vs {b.grad_norm!r}")
    g = [names[i] for i, (x, y) in enumerate(zip(a.grads, b.grads, strict=False)) if x != y]
    if g:
        out.append(f"gradients of {_few(g)}")
    w = [names[i] for i, (x, y) in enumerate(zip(a.weights, b.weights, strict=False)) if x != y]
    if w:
        out.append(f"weights {_few(w)}")
    return out


def _module_diff(a: Computation, b: Computation) -> str | None:
    """The first module whose output differs between two computations of one shard (None: none, or no
    fingerprints)."""
    return first_difference(list(a.modules), list(b.modules)) if a.modules and b.modules else None


def _changed_grads(a: Computation, b: Computation) -> list[int]:
    """Indices of the gradients a fault changed between two computations: those whose digests differ, less the
    ones only gradient clipping rescaled (when every gradient differs, the ones whose norm ratio is the common
    one, the median ratio, within 1e-5)."""
    idx = [i for i, (x, y) in enumerate(zip(a.grads, b.grads, strict=True)) if x != y]
    if len(idx) < 2 or len(a.grad_norms) != len(a.grads) or len(b.grad_norms) != len(b.grads):
        return idx
    ratios = {i: a.grad_norms[i] / b.grad_norms[i] for i in idx if b.grad_norms[i] > 0}
    finite = sorted(v for v in ratios.values() if math.isfinite(v))
    if not finite:
        return idx
    common = finite[len(finite) // 2]
    odd = [i for i in idx if i not in ratios or not math.isfinite(ratios[i])
           or abs(ratios[i] - common) > 1e-5 * abs(common)]
    return odd or idx


def _few(names: list[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def odd_ranks(values: Sequence[Sequence[int]],
              computations: Sequence[Computation] | None) -> tuple[list[int], list[int]]:
    """Replicas that must agree (one digest row per rank): (odd ranks, indices of the columns that disagree).

    A rank is odd when it differs from the strict majority of a column; a column without one (two replicas that
    disagree) names the rank whose gradient norm is further from acceptable (non-finite, else larger; the
    losses are of different shards), or, without computations to judge, every rank of the column."""
    if len(values) < 2 or not values[0]:
        return [], []
    cols = [i for i in range(len(values[0])) if len({row[i] for row in values}) > 1]
    odd: set[int] = set()
    for i in cols:
        counts = Counter(row[i] for row in values)
        top, n = counts.most_common(1)[0]
        if 2 * n > len(values):
            odd.update(r for r, row in enumerate(values) if row[i] != top)
        elif computations is not None:  # replicas compute different shards: only their gradient norms compare
            odd.add(max(range(len(values)), key=lambda r: _badness(computations[r])[2:]))
        else:
            odd.update(range(len(values)))
    return sorted(odd), cols


def replica_groups(strategy: str, world: int, mesh_shape: tuple[int, int] | None = None) -> list[list[int]]:
    """The groups of ranks that hold identical weights and reduced gradients, so their digests must agree.

    DDP: every rank, one group.  HSDP on a ``(replicas, shards)`` mesh (rank ``r * shards + s`` is replica ``r``
    of shard ``s``, the row-major order of ``init_device_mesh``): one group per shard position, its ``replicas``
    ranks holding the same shard.  FSDP2 (one replica) and a single process: none."""
    if world < 2:
        return []
    if strategy == "ddp":
        return [list(range(world))]
    if strategy == "hsdp":
        reps, shards = mesh_shape or (1, world)
        if reps * shards != world:
            raise ValueError(f"replica_groups: mesh {mesh_shape} does not hold {world} ranks")
        return [[r * shards + s for r in range(reps)] for s in range(shards)] if reps > 1 else []
    return []


def odd_in_groups(values: Sequence[Sequence[int]], groups: Sequence[Sequence[int]],
                  computations: Sequence[Computation] | None = None) -> tuple[list[int], list[int]]:
    """``odd_ranks`` within each group of replicas (``values`` and ``computations`` indexed by global rank):
    (odd global ranks, indices of the columns that disagree in some group)."""
    odd: set[int] = set()
    cols: set[int] = set()
    for g in groups:
        sub = [values[r] for r in g]
        o, c = odd_ranks(sub, None if computations is None else [computations[r] for r in g])
        odd.update(g[i] for i in o)
        cols.update(c)
    return sorted(odd), sorted(cols)


def diagnose(original: Sequence[Computation], rerun: Sequence[Computation],
             swapped: Sequence[Computation] | None, *, names: Sequence[str],
             replicas: bool | Sequence[Sequence[int]]) -> Diagnosis:
    """The verdict from the computations of every rank (module docstring).  ``original[r]`` / ``rerun[r]``: rank
    r on its own shard; ``swapped[r]``: rank r on shard ``(r + 1) % W`` (None: not run, one process);
    ``names``: the parameters the digests follow; ``replicas``: the groups of ranks that hold identical weights
    and reduced gradients, so their digests must agree (``replica_groups``; True: every rank, as under DDP;
    False: none)."""
    world = len(original)
    diffs = {str(o.rank): _changes(o, r, names) for o, r in zip(original, rerun, strict=True)}
    diffs = {k: v for k, v in diffs.items() if v}
    if diffs:
        pairs = list(zip(original, rerun, strict=True))
        by_loss = [o.rank for o, r in pairs if not _same(o.loss, r.loss)]
        by_module = [o.rank for o, r in pairs if _module_diff(o, r) is not None]
        ranks = by_loss or by_module or [int(k) for k in diffs]
        tensors: list[str] = []
        for k in ranks:
            o, r = original[k], rerun[k]
            m = _module_diff(o, r)
            if m is not None:
                tensors.append(f"activation:{m}")
            elif not (by_loss or by_module):
                tensors += [f"grad:{names[i]}" for i in _changed_grads(o, r)]
        how = ("its local loss" if by_loss else "its modules' outputs" if by_module
               else "its gradients after the reduction")
        return Diagnosis("transient", tuple(ranks), tuple(dict.fromkeys(tensors)), diffs,
                         f"not reproducible: running the step again from the same state changed {how} on rank(s) "
                         f"{', '.join(map(str, ranks))}; a fault that did not repeat")
    if swapped is None or world < 2:
        return Diagnosis("reproducible", (), (), {},
                         "reproducible: the step gives the same result when run again; in one process the data, "
                         "the numerics and a persistent fault of this device cannot be told apart")
    suspects: list[set[int]] = []
    tensors = []
    differed: dict[str, list[str]] = {}
    groups = [list(range(world))] if replicas is True else [] if replicas is False else [list(g) for g in replicas]
    if groups:
        for field, kind in (("weights", "weight"), ("grads", "grad")):
            rows = [getattr(c, field) for c in rerun]
            odd, cols = odd_in_groups(rows, groups, rerun)
            if odd:
                suspects.append(set(odd))
                tensors += [f"{kind}:{names[i]}" for i in cols]
                for k in odd:
                    differed.setdefault(str(k), []).append(f"its {field} differ from the other replicas' in "
                                                           f"{_few([names[i] for i in cols])}")
    pairs = []
    for c in swapped:
        owner = rerun[c.shard]
        changes = _changes(owner, c, names)
        changes = [x for x in changes if not x.startswith(("weights", "gradients", "gradient norm"))]
        if changes:  # the shard's forward differs between the two ranks that computed it
            pairs.append((owner, c))
            differed.setdefault(f"shard {c.shard}", []).append(
                f"rank {owner.rank} and rank {c.rank} computing it: " + "; ".join(changes))
            module = _module_diff(owner, c)
            if module is not None:
                tensors.append(f"activation:{module}")
    if pairs:
        if world >= 3:
            suspects.append(set.intersection(*({a.rank, b.rank} for a, b in pairs)))
        else:
            suspects.append({max(p, key=_badness).rank for p in pairs})
    if not suspects:
        return Diagnosis("reproducible", (), (), {},
                         f"reproducible on another rank: each of the {world} batch shards gives the same result "
                         "computed by a second rank, so the data or the numerics caused it, not a device")
    common = set.intersection(*suspects) or set.union(*suspects)
    blamed = tuple(sorted(common))
    how = ("every disagreement involves both ranks of two; attributed to the one whose result is further from "
           "acceptable (non-finite, else larger)") if world == 2 else "the rank common to every disagreement"
    return Diagnosis("persistent", blamed, tuple(dict.fromkeys(tensors)), differed,
                     f"persistent: the rerun reproduces the step, but rank(s) {', '.join(map(str, blamed))} compute "
                     f"differently from the others ({how}); a fault that follows the rank")
