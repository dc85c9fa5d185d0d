"""Automatic precision: choose a number format per layer under an average-bits budget.

The problem.  Layer group ``l`` (weights of ``n_l`` elements) can take one of the candidate specs ``c``; storing
its weights in ``c`` costs ``bits_l(c)`` bits (elements *and* scales: an MX block of 32 four-bit elements carries
one 8-bit E8M0 scale, so mxfp4 costs ``4 + 8/32 = 4.25`` bits per element; NVFP4 ``4 + 8/16 = 4.5`` plus one
float32 per tensor; an elementwise bf16 operand 16; float32 32).  Quantizing group ``l`` with ``c`` alone adds a
relative output noise power ``p_l(c) = 10^(-SQNR_l(c) / 10)`` (``lowprec.numerics.sensitivity_table``).  Choose
one ``c_l`` per group to

    minimise   sum_l p_l(c_l)                         (predicted output noise: additive to first order)
    subject to sum_l bits_l(c_l) <= budget_bits * sum_l n_l

which is a multiple-choice knapsack problem.  The predicted SQNR of the mix is ``-10 log10(sum_l p_l)``.  With
``metric="probe"`` the cost of a choice is instead its training-probe loss change ``probe_delta`` (one training
run with only that group in ``c``; ``training_probe``), and the summed change is minimised under the same budget.

Why weight the budget by parameter count.  The average is taken over weight elements (each group's share is its
``n_l = out_features * in_features``).  That is the model's storage and memory traffic for weights, and it is also
the share of GEMM work: every linear of a dense model sees the same rows (batch x tokens), so layer ``l``'s
forward GEMM costs ``rows * n_l`` multiply-adds and its operand bytes scale with ``n_l`` as well.  Weighting by
GEMM *operand* element count instead (``rows*K + n_l``) would make the budget depend on the batch size.

Solver.  Exact Pareto dynamic programming: after each group, keep only the (total bits, total noise) pairs that
no other pair beats on both; the answer is the lowest-noise pair within the budget.  Bits are exact integers
(element bits times elements plus scale bits times scales), so no rounding enters the budget check.  The frontier
stays small for the models this library trains (a few hundred pairs for tens of layers and four candidates); if
it ever exceeds ``max_states``, the solver falls back to the classic greedy (best noise reduction per extra bit
first) and says so (``PrecisionPlan.exact is False``).

The plan becomes a ``Recipe`` with one override per module (``PrecisionPlan.to_recipe``); each module's three
GEMMs use its spec for every operand, with stochastic rounding on the gradient operand of sub-8-bit formats (round
to nearest on fp4/fp6 gradients is biased), float32 accumulation, and float32 master weights.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Callable, Sequence
from typing import Any

from .._errors import UsageError
from ..quant import QuantSpec
from ..recipes import Gemm, LinearRecipe, Operand, Recipe
from ._sensitivity import LayerSensitivity, _check_metric, resolve_candidate


def storage_bits(spec: QuantSpec | None, shape: tuple[int, int]) -> int:
    """Exact bits to store a ``[rows, cols]`` GEMM operand (reduction dim ``cols`` last) quantized with ``spec``:
    elements plus every scale (block, tile, row and tensor scales; None: float32)."""
    rows, cols = shape
    n = rows * cols
    if spec is None:
        return 32 * n
    elem, sbits = spec.format.bits, spec.scale_spec.bits
    if spec.scaling == "none":
        scales = 0
    elif spec.scaling == "tensor":
        scales = 1
    elif spec.scaling == "axis":
        scales = rows if spec.axis in (-1, 1) else cols
    elif spec.scaling == "block":
        bs = spec.block_size or 1
        scales = rows * -(-cols // bs) if spec.axis in (-1, 1) else cols * -(-rows // bs)
    else:  # tile
        a, b = spec.tile or (1, 1)
        scales = -(-rows // a) * -(-cols // b)
    extra = 32 if spec.tensor_scale else 0
    return elem * n + sbits * scales + extra


def bits_per_element(spec: str | QuantSpec | None, shape: tuple[int, int] = (32, 32)) -> float:
    """Average bits per element of a ``shape`` operand in ``spec`` (mxfp4: 4.25; nvfp4 on 32x32: 4.53125)."""
    _, resolved = resolve_candidate(spec)
    return storage_bits(resolved, shape) / (shape[0] * shape[1])


def min_bits_per_element(spec: str | QuantSpec | None) -> float:
    """The fewest bits per element ``spec`` costs on an operand of any shape (a lower bound of ``storage_bits`` /
    elements): its element bits, plus one scale per block or tile for block and tile scaling (tensor, row and
    column scales cost next to nothing on a large operand).  mxfp4: 4.25; nvfp4: 4.5; float32: 32."""
    _, resolved = resolve_candidate(spec)
    if resolved is None:
        return 32.0
    elem, sbits = resolved.format.bits, resolved.scale_spec.bits
    if resolved.scaling == "block":
        return elem + sbits / (resolved.block_size or 1)
    if resolved.scaling == "tile":
        a, b = resolved.tile or (1, 1)
        return elem + sbits / (a * b)
    return float(elem)


def check_budget(budget_bits: float, candidates: Sequence[str | QuantSpec | None]) -> None:
    """ValueError when no model can meet ``budget_bits`` with ``candidates``: the budget is below the cheapest
    candidate's ``min_bits_per_element``.  Needs no model, so ``lowprec autoprecision`` calls it before calibrating
    (``choose_precision`` checks the exact cost of the measured layers afterwards)."""
    if not candidates:
        raise UsageError("no candidate specs: name at least one")
    costs = {resolve_candidate(c)[0]: min_bits_per_element(c) for c in candidates}
    cheapest = min(costs, key=lambda k: costs[k])
    if budget_bits < costs[cheapest]:
        raise UsageError(f"budget_bits={budget_bits} is below the cheapest mix of {list(costs)} on any model: "
                         f"{cheapest}, the cheapest, costs at least {costs[cheapest]:g} bits per weight element, "
                         f"scales included; raise the budget (--budget-bits) to >= {costs[cheapest]:g} or add a "
                         "cheaper candidate (--candidates)")


def training_linear(spec: QuantSpec | None) -> LinearRecipe:
    """All three GEMMs of a linear with every operand in ``spec``; the gradient operand rounds stochastically when
    the element format has fewer than 8 bits.  None: float32 (the default ``LinearRecipe``)."""
    if spec is None:
        return LinearRecipe()
    g = dataclasses.replace(spec, rounding="stochastic") if spec.format.bits < 8 else spec

    def gemm(a: QuantSpec, b: QuantSpec) -> Gemm:
        return Gemm(a=Operand(spec=a), b=Operand(spec=b))

    return LinearRecipe(forward=gemm(spec, spec), grad_input=gemm(g, spec), grad_weight=gemm(g, spec))


def _literal(name: str) -> str:
    """An fnmatch pattern matching exactly ``name``."""
    return "".join(f"[{c}]" if c in "*?[]" else c for c in name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrecisionPlan:
    """A spec per layer group, chosen under an average-bits budget."""

    assignment: tuple[tuple[str, str], ...]
    """(group name, spec label) per group, in model order."""
    modules: tuple[tuple[str, tuple[str, ...]], ...]
    """(group name, module names) per group."""
    budget_bits: float
    """The requested average bits per weight element."""
    average_bits: float
    """The plan's average bits per weight element (elements and scales), <= ``budget_bits``."""
    predicted_sqnr_db: float
    """``-10 log10(sum of the chosen groups' noise powers)`` (inf when every choice is exact)."""
    exact: bool
    """True when the Pareto solver ran to completion (the optimum of the model); False after greedy fallback."""
    metric: str = "sqnr"
    """What the plan minimises: "sqnr" (the summed output noise powers) or "probe" (the summed training-probe loss
    changes, ``LayerSensitivity.probe_delta``)."""
    predicted_loss_delta: float = math.nan
    """Sum of the chosen rows' ``probe_delta`` (the additive prediction of the training loss change); NaN when the
    table has no probe."""

    def spec_of(self, group: str) -> str:
        """The spec label chosen for ``group``."""
        return dict(self.assignment)[group]

    def to_recipe(self, *, name: str = "autoprecision", keep_high_precision: Sequence[str] = (),
                  seed: int = 0) -> Recipe:
        """A ``Recipe`` with one override per module (an exact-name pattern), ``linear`` float32 for the rest."""
        overrides = []
        for group, label in self.assignment:
            lin = training_linear(resolve_candidate(label)[1])
            overrides += [(_literal(m), lin) for m in dict(self.modules)[group]]
        return Recipe(name=name, overrides=tuple(overrides), keep_high_precision=tuple(keep_high_precision),
                      seed=seed)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {"assignment": [list(a) for a in self.assignment],
                "modules": [[g, list(m)] for g, m in self.modules], "budget_bits": self.budget_bits,
                "average_bits": self.average_bits, "predicted_sqnr_db": repr(self.predicted_sqnr_db)
                if not math.isfinite(self.predicted_sqnr_db) else self.predicted_sqnr_db, "exact": self.exact,
                "metric": self.metric, "predicted_loss_delta": self.predicted_loss_delta
                if math.isfinite(self.predicted_loss_delta) else repr(self.predicted_loss_delta)}


def solve_budget(values: Sequence[Sequence[float]], costs: Sequence[Sequence[int]], capacity: int, *,
                 max_states: int = 100_000) -> tuple[list[int], bool]:
    """Multiple-choice knapsack: one option per item minimising ``sum values[i][c_i]`` subject to
    ``sum costs[i][c_i] <= capacity`` (integer costs).  Returns ``(choices, exact)``; ties go to the lower cost.

    Exact Pareto DP while the frontier has at most ``max_states`` points, else the greedy fallback.  ValueError when
    even the cheapest choice of every item exceeds ``capacity``.
    """
    if len(values) != len(costs) or any(len(v) != len(c) or not v for v, c in zip(values, costs, strict=True)):
        raise UsageError("values and costs must have one non-empty row per item, of equal lengths")
    cheapest = sum(min(c) for c in costs)
    if cheapest > capacity:
        raise UsageError(f"the budget ({capacity} bits) is below the cheapest choice ({cheapest} bits)")
    frontier: list[tuple[int, float, tuple[int, ...]]] = [(0, 0.0, ())]
    for vals, cs in zip(values, costs, strict=True):
        nxt = sorted(((c0 + c, v0 + v, ch + (j,)) for c0, v0, ch in frontier
                      for j, (v, c) in enumerate(zip(vals, cs, strict=True)) if c0 + c <= capacity),
                     key=lambda s: (s[0], s[1]))
        frontier = []
        for state in nxt:  # keep strictly decreasing value as cost grows
            if not frontier or state[1] < frontier[-1][1]:
                frontier.append(state)
        if len(frontier) > max_states:
            return _greedy(values, costs, capacity), False
    best = min(frontier, key=lambda s: (s[1], s[0]))
    return list(best[2]), True


def _greedy(values: Sequence[Sequence[float]], costs: Sequence[Sequence[int]], capacity: int) -> list[int]:
    choice = [min(range(len(c)), key=lambda j, c=c, v=v: (c[j], v[j]))  # type: ignore[misc]
              for v, c in zip(values, costs, strict=True)]
    spent = sum(c[j] for c, j in zip(costs, choice, strict=True))
    while True:
        best: tuple[float, int, int] | None = None
        for i, (v, c) in enumerate(zip(values, costs, strict=True)):
            for j in range(len(c)):
                dv, dc = v[choice[i]] - v[j], c[j] - c[choice[i]]
                if dv > 0 and spent + dc <= capacity:
                    ratio = math.inf if dc <= 0 else dv / dc
                    if best is None or ratio > best[0]:
                        best = (ratio, i, j)
        if best is None:
            return choice
        _, i, j = best
        spent += costs[i][j] - costs[i][choice[i]]
        choice[i] = j


def choose_precision(table: Sequence[LayerSensitivity], *, budget_bits: float,
                     candidates: Sequence[str] | None = None, max_states: int = 100_000,
                     metric: str = "sqnr") -> PrecisionPlan:
    """Choose a spec per layer group from a ``sensitivity_table`` to minimise the predicted output noise with an
    average of at most ``budget_bits`` bits per weight element (see the module docstring).

    ``candidates`` restricts the specs (labels as in the table; default: every spec in it).  Every group must have
    a row for every candidate.  ``metric`` is what is minimised: "sqnr" (the summed output noise powers, the
    default) or "probe" (the summed ``probe_delta``: fill them in with ``training_probe`` first).
    """
    _check_metric(metric)
    if isinstance(budget_bits, bool) or not isinstance(budget_bits, (int, float)) or not budget_bits > 0:
        raise UsageError(f"budget_bits must be a positive number of bits per element; got {budget_bits!r}")
    rows: dict[str, dict[str, LayerSensitivity]] = {}
    for r in table:
        rows.setdefault(r.name, {})[r.spec] = r
    if not rows:
        raise UsageError("table is empty: run sensitivity_table with at least one spec first")
    labels = list(candidates) if candidates is not None else list(dict.fromkeys(r.spec for r in table))
    for g, by_spec in rows.items():
        missing = [c for c in labels if c not in by_spec]
        if missing:
            raise UsageError(f"table has no row for group {g!r} with spec(s) {missing}; measure them first")
    groups = list(rows)
    values = [[rows[g][c].cost(metric) for c in labels] for g in groups]
    costs = [[sum(storage_bits(resolve_candidate(c)[1], s) for s in rows[g][c].shapes) for c in labels]
             for g in groups]
    elements = sum(rows[g][labels[0]].params for g in groups)
    capacity = math.floor(budget_bits * elements)
    try:
        choice, exact = solve_budget(values, costs, capacity, max_states=max_states)
    except ValueError:
        low = sum(min(c) for c in costs) / elements
        raise UsageError(f"budget_bits={budget_bits} is below the cheapest mix of {labels} ({low:.4g} bits per "
                         "element); raise the budget or add a cheaper candidate") from None
    chosen = [rows[g][labels[j]] for g, j in zip(groups, choice, strict=True)]
    return PrecisionPlan(
        assignment=tuple((r.name, r.spec) for r in chosen),
        modules=tuple((g, rows[g][labels[0]].modules) for g in groups),
        budget_bits=float(budget_bits),
        average_bits=sum(c[j] for c, j in zip(costs, choice, strict=True)) / elements,
        predicted_sqnr_db=_predicted_sqnr(chosen),
        exact=exact,
        metric=metric,
        predicted_loss_delta=sum(r.probe_delta for r in chosen),
    )


def _predicted_sqnr(rows: Sequence[LayerSensitivity]) -> float:
    noise = sum(r.noise for r in rows)
    return math.inf if noise == 0 else -10.0 * math.log10(noise)


def uniform_plan(table: Sequence[LayerSensitivity], spec: str, *, metric: str = "sqnr") -> PrecisionPlan:
    """Every group in ``spec`` (a label present in ``table``): the uniform arm to compare a chosen mix against."""
    rows = [r for r in table if r.spec == spec]
    if not rows:
        raise UsageError(f"table has no rows for spec {spec!r}; it has {sorted({r.spec for r in table})}")
    cost = sum(storage_bits(resolve_candidate(spec)[1], s) for r in rows for s in r.shapes)
    elements = sum(r.params for r in rows)
    return PrecisionPlan(assignment=tuple((r.name, spec) for r in rows),
                         modules=tuple((r.name, r.modules) for r in rows), budget_bits=cost / elements,
                         average_bits=cost / elements, predicted_sqnr_db=_predicted_sqnr(rows), exact=True,
                         metric=metric, predicted_loss_delta=sum(r.probe_delta for r in rows))


def plan_table(plan: PrecisionPlan, table: Sequence[LayerSensitivity]) -> list[dict[str, Any]]:
    """Per group: chosen spec, weight elements, bits per element, the single-layer SQNR and loss change of that
    choice and its probe loss change (NaN without a probe)."""
    by = {(r.name, r.spec): r for r in table}
    out = []
    for g, label in plan.assignment:
        r = by[(g, label)]
        bits = sum(storage_bits(resolve_candidate(label)[1], s) for s in r.shapes) / r.params
        out.append({"group": g, "spec": label, "params": r.params, "bits": bits, "sqnr_db": r.sqnr_db,
                    "loss_delta": r.loss_delta, "probe_delta": r.probe_delta})
    return out


def matches(recipe: Recipe, module: str) -> LinearRecipe | None:
    """The override of ``recipe`` that ``lowprec.convert`` applies to ``module`` (first match), or None."""
    for pattern, lin in recipe.overrides:
        if fnmatch.fnmatchcase(module, pattern):
            return lin
    return None


def probe_recipe(row: LayerSensitivity) -> Recipe | None:
    """The recipe of ``row``'s training probe: its modules' three GEMMs in its spec as in training
    (``training_linear``), every other linear float32; None for a float32 row (nothing quantized)."""
    spec = resolve_candidate(row.spec)[1]
    if spec is None:
        return None
    lin = training_linear(spec)
    return Recipe(name=f"probe {row.name} {row.spec}", overrides=tuple((_literal(m), lin) for m in row.modules))


def training_probe(table: Sequence[LayerSensitivity], train_loss: Callable[[Recipe | None, int], float], *,
                   seeds: Sequence[int]) -> list[LayerSensitivity]:
    """``table`` with ``probe_delta`` measured by training: the gradient-aware sensitivity.

    The output SQNR measures a trained model's forward pass; training also quantizes the two backward GEMMs, and
    their errors (gradient operands with stochastic rounding, block scales of gradients) act on the whole run.
    The probe measures that directly: for every seed, ``train_loss(None, seed)`` is the final task loss of a
    float32 training run, and ``train_loss(probe_recipe(row), seed)`` that of the same run with only the row's
    modules trained in its spec; ``probe_delta`` is the difference averaged over ``seeds``.  Cost: one training
    run per (row, seed) plus one float32 run per seed.  Same seeds and data for both runs, so the difference is
    paired; with one or two seeds it is still noisy (stochastic rounding), which is why the judge decides.

    ``train_loss(recipe, seed) -> float`` trains from initialisation (e.g. ``lowprec.runs``' runner with the
    recipe, a short ``steps``) and returns the final evaluation loss.
    """
    seeds = list(seeds)
    if not seeds:
        raise UsageError("seeds must name at least one probe seed")
    ref = {s: float(train_loss(None, s)) for s in seeds}
    out = []
    for row in table:
        recipe = probe_recipe(row)
        deltas = [0.0 if recipe is None else float(train_loss(recipe, s)) - ref[s] for s in seeds]
        out.append(dataclasses.replace(row, probe_delta=sum(deltas) / len(deltas)))
    return out
