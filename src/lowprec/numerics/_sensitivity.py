"""Layer sensitivity: how much a model's output suffers when one layer (or one group of layers) is quantized.

Quantizing a linear layer's forward GEMM ``y = x @ W^T`` (``[B,K] @ [K,N] -> [B,N]``) with a ``QuantSpec`` replaces
``x`` and ``W`` by ``Q(x)`` and ``Q(W)`` (blocks and rows along the reduction dimension ``K``), which adds an error
``e`` to ``y``.  The error travels through the rest of the network, is amplified or damped by it, and arrives at
the model's output.  *Sensitivity analysis* measures what arrives: for each layer ``l`` (all other layers kept in
float32), on a fixed set of evaluation batches,

* ``sqnr_db = 10 log10( sum f(x)^2 / sum (f(x) - f_l(x))^2 )``: the output signal-to-quantization-noise ratio
  (``f`` the float32 model, ``f_l`` the model with layer ``l`` quantized, sums over every output element of every
  batch; each extra mantissa bit buys about 6 dB); and
* ``loss_delta = loss(f_l) - loss(f)``: the change of the mean task loss over the same batches.

Why one layer at a time.  If the layers' quantization errors are small and uncorrelated, the output noise power of
a model with *several* quantized layers is close to the sum of the per-layer noise powers ``10^(-sqnr_l / 10)``
(a first-order expansion of ``f`` around the float32 weights and activations).  That additivity is what lets
``lowprec.numerics.choose_precision`` pick a format per layer from one table of single-layer measurements instead
of trying every combination.  It is a model, not a law: errors that push a layer's activations into another
regime (saturating a block, flipping many ReLUs) add super-linearly, which is why the chosen mix should be checked
with real training runs and the accuracy judge (``docs/precision.md``).

What is and is not quantized here.  Only the forward GEMM operands (input and weight) of ``nn.Linear`` modules,
with float32 accumulation and outputs; biases, norms, convolutions and the gradients are untouched, because
sensitivity is a property of the trained model's forward function.  The model should be trained first: a freshly
initialised network is a different function (``lowprec sensitivity`` trains the config in float32 first).

Cost: one float32 forward pass over the batches, plus one emulated forward pass per (layer group, spec).

Training probe (gradient-aware, ``lowprec.numerics.training_probe``, ``--metric probe``).  The forward SQNR can
misrank what matters for *training*: training also quantizes the two backward GEMMs of every layer (gradients
with stochastic rounding, block scales over the batch for the weight gradient), and small per-step errors act
over the whole run.  The probe measures that directly and fills ``probe_delta``: the final evaluation loss of a
training run with only this group trained in the spec minus that of a float32 run with the same seed and steps.
It costs one training run per (group, spec, probe seed); ``choose_precision(metric="probe")`` then minimises the
summed loss changes (additive to first order, like the noise powers).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .. import formats
from .._batches import call_model, output_tensor
from .._errors import UsageError
from ..quant import QuantSpec
from ._tensor_stats import spec_name

Batch = Any
"""A batch by lowprec's batch contract (``lowprec._batches``): ``(*inputs, target)``, a dict (``model(**batch)``,
Hugging Face style) or a tensor."""
LossFn = Callable[[Any, Any], torch.Tensor]
GROUP_BY = ("layer", "block")
METRICS = ("sqnr", "probe")
_FLOATS = ("sqnr_db", "loss", "loss_delta", "probe_delta")


def _noise(db: float) -> float:
    if math.isnan(db):
        return math.inf
    return 0.0 if db == math.inf else 10.0 ** (-db / 10.0)


_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerSensitivity:
    """What quantizing one layer group's forward GEMMs with one spec does to the model output."""

    name: str
    """The group's name (the module's qualified name when grouping by layer)."""
    modules: tuple[str, ...]
    """Qualified names of the ``nn.Linear`` modules quantized together."""
    shapes: tuple[tuple[int, int], ...]
    """Weight shape ``(out_features, in_features)`` of each module, in ``modules`` order."""
    spec: str
    """Spec label (``QuantSpec.names()`` entry, an element format name such as "bfloat16", or "float32")."""
    sqnr_db: float
    """Output SQNR in dB against the float32 model (inf: output unchanged; -inf: non-finite output)."""
    loss: float
    """Mean task loss over the evaluation batches with this group quantized."""
    loss_delta: float
    """``loss`` minus the float32 model's loss on the same batches (positive: worse)."""
    probe_delta: float = math.nan
    """Training probe (``lowprec.numerics.training_probe``): final task loss of training runs with this group's
    three GEMMs in ``spec`` as in training (every other layer float32) minus that of float32 runs with the same
    seeds and steps, averaged over the probe seeds (positive: worse); NaN when not measured."""

    @property
    def params(self) -> int:
        """Weight elements of the group (biases are not quantized)."""
        return sum(a * b for a, b in self.shapes)

    @property
    def noise(self) -> float:
        """Relative output noise power ``10^(-sqnr_db / 10)``: additive across layers to first order."""
        return _noise(self.sqnr_db)

    def cost(self, metric: str) -> float:
        """What ``choose_precision`` adds up and minimises: the relative output noise power ``noise`` ("sqnr") or
        the probe's loss change ``probe_delta`` ("probe")."""
        _check_metric(metric)
        if metric == "sqnr":
            return self.noise
        if math.isnan(self.probe_delta):
            raise UsageError(f"row {self.name!r}/{self.spec} has no probe_delta: run training_probe on the table "
                             "first (metric 'probe')")
        return self.probe_delta

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (infinite SQNRs as the strings "inf"/"-inf")."""
        out = dataclasses.asdict(self)
        out["modules"], out["shapes"] = list(self.modules), [list(s) for s in self.shapes]
        for k in _FLOATS:
            if not math.isfinite(out[k]):
                out[k] = repr(out[k])
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LayerSensitivity:
        """Inverse of ``to_dict``."""
        kw = dict(data)
        kw["modules"] = tuple(kw["modules"])
        kw["shapes"] = tuple((int(a), int(b)) for a, b in kw["shapes"])
        for k in _FLOATS:
            if k in kw:
                kw[k] = float(kw[k])
        return cls(**kw)


def resolve_candidate(candidate: str | QuantSpec | None) -> tuple[str, QuantSpec | None]:
    """``(label, spec)`` for a spec name (``QuantSpec.names()``), a block spec name with another block size
    (``"mxfp4/b64"``: mxfp4 with one E8M0 scale per 64 elements, 4.125 bits), an element format name applied
    elementwise (``"bfloat16"``, alias ``"bf16"``; round to nearest, no scaling), ``"float32"``/``None`` (not
    quantized), or a ``QuantSpec``.  ValueError lists what is accepted."""
    if candidate is None:
        return "float32", None
    if isinstance(candidate, QuantSpec):
        return spec_name(candidate), candidate
    if not isinstance(candidate, str):
        raise UsageError(f"spec must be a QuantSpec or a name; got {type(candidate).__name__}")
    if candidate in QuantSpec.names():
        return candidate, QuantSpec.named(candidate)
    base, sep, block = candidate.partition("/b")
    if sep and base in QuantSpec.names() and QuantSpec.named(base).scaling == "block":
        if not block.isdigit() or int(block) < 1:
            raise UsageError(f"spec {candidate!r}: the block size after '/b' must be a positive int, e.g. {base}/b64")
        if int(block) == QuantSpec.named(base).block_size:
            return base, QuantSpec.named(base)
        return f"{base}/b{int(block)}", dataclasses.replace(QuantSpec.named(base), block_size=int(block))
    name = _ALIASES.get(candidate, candidate)
    if name == "float32":
        return "float32", None
    if name in formats.names() and formats.get(name).kind == "float" and formats.get(name).signed:
        return name, QuantSpec(elem=name, scaling="none", saturate=False)
    raise UsageError(f"unknown spec {candidate!r}: use a spec name ({', '.join(QuantSpec.names())}), a block spec "
                     "with another block size (mxfp4/b64), an element "
                     "format applied elementwise (bfloat16 or bf16, float16, float8_e4m3fn, ...), or float32")


def linear_names(model: nn.Module) -> list[str]:
    """Qualified names of the ``nn.Linear`` modules of ``model`` (exact type, as ``lowprec.convert`` swaps them)."""
    return [n for n, m in model.named_modules() if type(m) is nn.Linear and n]


def group_layers(names: Iterable[str], by: str | int = "layer") -> dict[str, tuple[str, ...]]:
    """Group module names by name prefix: ``"layer"`` (each alone), ``"block"`` (up to and including the first
    all-digit component: ``blocks.0.attn.qkv`` -> ``blocks.0``; names without one stay alone) or an int ``d``
    (the first ``d`` dot-separated components).  Groups keep the order of first appearance."""
    if by not in GROUP_BY and not (isinstance(by, int) and not isinstance(by, bool) and by >= 1):
        raise UsageError(f"group_by must be one of {', '.join(GROUP_BY)} or a positive int (name depth); got {by!r}")
    out: dict[str, list[str]] = {}
    for name in names:
        parts = name.split(".")
        if by == "layer":
            key = name
        elif by == "block":
            idx = next((i for i, p in enumerate(parts) if p.isdigit()), None)
            key = name if idx is None else ".".join(parts[: idx + 1])
        else:
            key = ".".join(parts[: int(by)])
        out.setdefault(key, []).append(name)
    return {k: tuple(v) for k, v in out.items()}


def forward_only(spec: QuantSpec | None) -> Any:
    """A ``LinearRecipe`` quantizing the forward GEMM's input and weight with ``spec``, everything else float32."""
    from ..recipes import Gemm, LinearRecipe, Operand

    return LinearRecipe(forward=Gemm(a=Operand(spec=spec), b=Operand(spec=spec)))


def _sqnr_db(ref: Sequence[torch.Tensor], got: Sequence[torch.Tensor]) -> float:
    signal = sum(float(r.double().square().sum()) for r in ref)
    noise = sum(float((r.double() - g.double()).square().sum()) for r, g in zip(ref, got, strict=True))
    if math.isnan(noise) or math.isinf(noise):
        return -math.inf
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(signal / noise) if signal > 0 else -math.inf


@torch.no_grad()
def _forward(model: nn.Module, batches: Sequence[Batch], loss_fn: LossFn) -> tuple[list[torch.Tensor], float]:
    outs, losses = [], []
    for batch in batches:
        out, target = call_model(model, batch)
        outs.append(output_tensor(out).detach().to(torch.float32))
        losses.append(float(loss_fn(out, target)))
    return outs, sum(losses) / len(losses)


class _Probe:
    """A private float32 copy of the model with its reference outputs, for quantizing groups one at a time."""

    def __init__(self, model: nn.Module, batches: Sequence[Batch], loss_fn: LossFn) -> None:
        from ..nn import EmulatedLinear

        if any(isinstance(m, EmulatedLinear) for m in model.modules()):
            raise UsageError("model is converted (it has EmulatedLinear modules): pass the float32 model, "
                             "e.g. after lowprec.unconvert(model)")
        self.batches = list(batches)
        if not self.batches:
            raise UsageError("batches must hold at least one batch")
        self.model = copy.deepcopy(model).eval()
        self.loss_fn = loss_fn
        self.ref, self.ref_loss = _forward(self.model, self.batches, loss_fn)
        self.shapes = {n: m.weight.shape for n, m in self.model.named_modules() if type(m) is nn.Linear}

    def measure(self, name: str, modules: tuple[str, ...], label: str, spec: QuantSpec | None) -> LayerSensitivity:
        from ..nn import convert, unconvert
        from ..recipes import Recipe

        wanted = set(modules)
        convert(self.model, Recipe(name="sensitivity", linear=forward_only(spec)),
                module_filter=lambda _m, n: n in wanted)
        try:
            outs, loss = _forward(self.model, self.batches, self.loss_fn)
        finally:
            unconvert(self.model)
        shapes = tuple((int(self.shapes[m][0]), int(self.shapes[m][1])) for m in modules)
        return LayerSensitivity(name=name, modules=modules, shapes=shapes, spec=label,
                                sqnr_db=_sqnr_db(self.ref, outs), loss=loss, loss_delta=loss - self.ref_loss)


def _groups(model: nn.Module, groups: Mapping[str, Sequence[str]] | str | int | None) -> dict[str, tuple[str, ...]]:
    names = linear_names(model)
    if groups is None or isinstance(groups, (str, int)):
        resolved = group_layers(names, "layer" if groups is None else groups)
    else:
        resolved = {str(k): tuple(v) for k, v in groups.items()}
    if not resolved:
        raise UsageError("model has no nn.Linear module to analyse")
    for g, mods in resolved.items():
        bad = [m for m in mods if m not in names]
        if not mods or bad:
            raise UsageError(f"groups[{g!r}] must name nn.Linear modules of the model; bad: {bad or '(empty)'}; "
                             f"the linears are: {', '.join(names)}")
    return resolved


def _check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise UsageError(f"metric must be one of {', '.join(METRICS)}; got {metric!r}")


def _ranked(rows: list[LayerSensitivity], metric: str = "sqnr") -> list[LayerSensitivity]:
    _check_metric(metric)
    if metric == "probe":
        return sorted(rows, key=lambda r: (-r.cost("probe"), r.sqnr_db, r.name))
    return sorted(rows, key=lambda r: (r.sqnr_db, -r.loss_delta, r.name))


def sensitivity_table(model: nn.Module, batches: Sequence[Batch], loss_fn: LossFn,
                      specs: Sequence[str | QuantSpec | None], *,
                      groups: Mapping[str, Sequence[str]] | str | int | None = None) -> list[LayerSensitivity]:
    """One ``LayerSensitivity`` per (layer group, spec): the input of ``choose_precision``.

    Args:
        model: the trained float32 model (not modified: a private copy is quantized).
        batches: the fixed evaluation set: ``(inputs, targets)`` pairs, dicts (``model(**batch)``, Hugging Face
            style) or tensors; the model returns a tensor or an output with ``logits`` (what SQNR compares).
        loss_fn: ``(output, target) -> scalar tensor`` (the target: a tuple's last element, else the batch).
        specs: candidate specs (see ``resolve_candidate``), e.g. ``["mxfp4", "mxfp6_e2m3", "bf16"]``.
        groups: ``None``/"layer" (each ``nn.Linear`` alone), "block", a name depth, or ``{group: [module, ...]}``.

    Rows come group by group in model order, specs in the given order.
    """
    resolved = [resolve_candidate(s) for s in specs]
    if not resolved:
        raise UsageError("specs must name at least one spec")
    labels = [label for label, _ in resolved]
    if len(set(labels)) != len(labels):
        raise UsageError(f"specs must be distinct; got {labels}")
    probe = _Probe(model, batches, loss_fn)
    return [probe.measure(g, mods, label, spec)
            for g, mods in _groups(probe.model, groups).items() for label, spec in resolved]


def layer_sensitivity(model: nn.Module, batches: Sequence[Batch], loss_fn: LossFn, spec: str | QuantSpec, *,
                      groups: Mapping[str, Sequence[str]] | str | int | None = None) -> list[LayerSensitivity]:
    """Quantize each layer group's forward GEMMs with ``spec`` alone (all others float32); most sensitive first.

    The ranking is by output SQNR (lowest first), then by loss change (largest first).  See ``sensitivity_table``
    for the arguments and the module docstring for what is measured.
    """
    return _ranked(sensitivity_table(model, batches, loss_fn, [spec], groups=groups))


def ranked(rows: Iterable[LayerSensitivity], metric: str = "sqnr") -> list[LayerSensitivity]:
    """``rows`` most sensitive first: "sqnr" lowest output SQNR, then largest loss change; "probe" largest
    ``probe_delta``, then lowest output SQNR."""
    return _ranked(list(rows), metric)

