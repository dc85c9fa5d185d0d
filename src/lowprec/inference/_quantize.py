"""``quantize_model``: emulated (fake-quantized) inference of a whole model under a ``Scheme``.

Every ``nn.Linear`` that ``plan(model, scheme)`` selects is replaced, in place, by a ``QuantizedLinear``:

* its weight is quantized and dequantized once, at conversion (``fake_quantize_weight``), and stored as the
  buffer ``weight`` in the layer's dtype; the forward never re-quantizes it.  The original weight is kept as the
  non-persistent buffer ``original_weight`` (not in ``state_dict``; it follows ``.to()``) so that
  ``unquantize_model`` gives back an ``nn.Linear`` with the same values bit for bit;
* its input is fake-quantized on every call by the scheme's ``input_activations``: dynamic schemes compute their
  scales from each input (per token, per tensor, per group: ``fake_quantize_activation``), static ones use the
  per-tensor scale fixed by calibration (buffer ``input_scale``, float32); NVFP4's ``dynamic="local"`` uses the
  calibrated global scale (buffer ``input_global_scale``) with group scales from each input (``_local``);
* then ``F.linear(x_hat, weight, bias)``.

Serving semantics: weights and bias are buffers, so no gradient reaches them; use ``lowprec.nn`` for
quantization-aware training.

Calibration (static activation schemes) runs the *original* model, before any layer is replaced, in eval mode
under ``torch.no_grad``, over ``calibration_data`` by lowprec's batch contract (``lowprec._batches.call_model``:
a dict is ``model(**batch)``, a tuple ``(*inputs, target)`` is ``model(*inputs)``, a tensor is ``model(batch)``).
A forward pre-hook on each statically quantized layer observes its input; ``_calibrate`` explains what each
algorithm (``"max"``, ``"percentile"``, ``"mse"``) chooses.  The weight- and activation-aware algorithms
``"gptq"``, ``"awq"`` and ``"smoothquant"`` observe every quantized layer's inputs in the same way and are
explained in ``_algorithms``.  The model is left untouched when anything fails.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._batches import call_model
from .._errors import UsageError
from . import _affine, _algorithms, _calibrate, _fold, _kvcache, _local, _plan
from ._scheme import Scheme, TensorScheme
from ._sync import Sync


def _affine_view(ts: TensorScheme) -> TensorScheme:
    """The weight-shaped scheme ``_affine`` applies to ``x`` reshaped to ``[tokens, K]`` (token = a row)."""
    g = "channel" if ts.granularity == "token" else ts.granularity
    return dataclasses.replace(ts, granularity=g, dynamic=False)


def fake_quantize_activation(x: torch.Tensor, ts: TensorScheme, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize-dequantize an activation ``x [..., K]`` with ``ts`` (``x``'s shape and dtype).

    ``scale`` given (static per-tensor, float32): ``_calibrate.fake_quantize_static``; for NVFP4's
    ``dynamic="local"`` it is the calibrated global scale, and the group scales come from ``x``
    (``_local.fake_quantize_local``).  Otherwise dynamic: integer
    schemes and float formats with float32 scales apply ``_affine``'s rules to ``x`` viewed as ``[tokens, K]``
    (``"token"``: one scale per row, ``amax / 127.5`` for int8, ``amax / 448`` for e4m3; ``"tensor"``: one for the
    whole input; ``"group"``/``"block"`` ``(1, b)``: one per group along ``K``); MX and NVFP4 are
    ``lowprec.quant.fake_quantize`` with ``ts.quant_spec()``.  ``_affine``'s in-place forms compute the same bits as
    the plain tensor operations (``_calibrate.fake_quantize_static``, ``_affine._reference_fake_quantize_*``).
    """
    if scale is not None:
        if ts.dynamic == "local":
            return _local.fake_quantize_local(x, scale, ts)
        return _affine.fake_quantize_static(x, scale, ts)
    if ts.scale_format != "float32":
        from ..quant import fake_quantize

        return fake_quantize(x, ts.quant_spec())
    x2 = x.reshape(-1, x.shape[-1])
    view = _affine_view(ts)
    out = _affine.fake_quantize_int(x2, view) if ts.is_int else _affine.fake_quantize_float(x2, view)
    return out.reshape(x.shape)


class QuantizedLinear(nn.Module):
    """An ``nn.Linear`` under a scheme, for emulated inference (module docstring).

    Buffers: ``weight`` (fake-quantized once), ``bias`` (or None), ``original_weight`` (non-persistent),
    ``input_scale`` (static activation schemes only: the calibrated float32 per-tensor scale, shape ``[1]`` as
    compressed-tensors and vLLM store it),
    ``input_global_scale`` (NVFP4 ``dynamic="local"`` only: the calibrated float32 ``[1]`` global scale
    ``448 * 6 / c``, compressed-tensors' name; the constructor takes it as ``input_scale``), ``smooth`` (None,
    or a float32 ``[in_features]`` per-input-channel divisor: SmoothQuant, and AWQ when the inputs are quantized;
    the forward computes ``x / smooth`` before the activation quantizer and ``weight`` is the quantized
    ``original_weight * smooth``), ``weight_scale`` / ``weight_zero_point`` (non-persistent; None, or for GPTQ the
    float32 scales and zero points its weight was quantized with, ``_algorithms.gptq_weight``; otherwise the
    scales follow from ``fake_quantize_weight``).

    ``quantized_weight`` given (GPTQ, AWQ): it is ``weight`` as it is (cast to the layer's dtype), instead of
    ``fake_quantize_weight(original_weight * smooth)``.  ``algorithm`` names the calibration algorithm that made
    the layer (``quantize_model``'s), so that ``save_quantized`` can say why a weight cannot be stored."""

    weight: torch.Tensor
    original_weight: torch.Tensor
    bias: torch.Tensor | None
    input_scale: torch.Tensor | None
    input_global_scale: torch.Tensor | None
    smooth: torch.Tensor | None
    folded: torch.Tensor | None
    weight_scale: torch.Tensor | None
    weight_zero_point: torch.Tensor | None

    def __init__(self, linear: nn.Linear, *, name: str = "", group: str = "", weights: TensorScheme | None = None,
                 input_activations: TensorScheme | None = None, input_scale: torch.Tensor | None = None,
                 smooth: torch.Tensor | None = None, quantized_weight: torch.Tensor | None = None,
                 weight_scale: torch.Tensor | None = None, weight_zero_point: torch.Tensor | None = None,
                 algorithm: str = "max", folded: torch.Tensor | None = None) -> None:
        super().__init__()
        self.algorithm = algorithm
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.name = name
        self.group = group
        self.weights = weights
        self.input_activations = input_activations
        w = linear.weight.detach()
        self._weight_requires_grad = linear.weight.requires_grad
        if smooth is not None and tuple(smooth.shape) != (self.in_features,):
            raise UsageError(f"QuantizedLinear {name!r}: smooth must be [{self.in_features}] (in_features); got "
                             f"{list(smooth.shape)}")
        with torch.no_grad():
            if quantized_weight is not None:
                wq = quantized_weight.detach().to(w.dtype).clone()
            else:
                factor = smooth if smooth is not None else folded
                base = w if factor is None else w.float() * factor.float()
                wq = (base.clone() if weights is None else _plan.fake_quantize_weight(base, weights)).to(w.dtype)
        self.register_buffer("weight", wq)
        self.register_buffer("original_weight", w, persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        calibrated = input_activations is not None and input_activations.dynamic in (False, "local")
        if calibrated and input_scale is None:
            raise UsageError(f"QuantizedLinear {name!r}: a static or 'local' activation scheme needs input_scale")
        local = input_activations is not None and input_activations.dynamic == "local"
        scale = None if input_scale is None else input_scale.detach().float().reshape(1).clone()
        self.register_buffer("input_scale", None if local else scale)
        self.register_buffer("input_global_scale", scale if local else None)
        self.register_buffer("smooth", None if smooth is None else smooth.detach().float().clone())
        self.register_buffer("folded", None if folded is None else folded.detach().float().clone(), persistent=False)
        self.register_buffer("weight_scale", None if weight_scale is None else weight_scale.detach().float().clone(),
                             persistent=False)
        self.register_buffer("weight_zero_point", None if weight_zero_point is None else
                             weight_zero_point.detach().float().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise UsageError(f"layer {self.name!r} expects inputs [..., {self.in_features}] (in_features); got "
                             f"{list(x.shape)}")
        if self.smooth is not None:
            x = (x / self.smooth).to(x.dtype)
        if self.input_activations is not None:
            scale = self.input_scale if self.input_global_scale is None else self.input_global_scale
            x = fake_quantize_activation(x, self.input_activations, scale)
        return F.linear(x, self.weight, self.bias)

    def to_linear(self) -> nn.Linear:
        """An ``nn.Linear`` with the original weight and bias (values bit for bit; new Parameters)."""
        w = self.original_weight
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device=w.device,
                        dtype=w.dtype)
        lin.weight = nn.Parameter(w, requires_grad=self._weight_requires_grad)
        if self.bias is not None:
            lin.bias = nn.Parameter(self.bias)
        return lin

    def extra_repr(self) -> str:
        act = "none" if self.input_activations is None else (
            f"{self.input_activations.format}/{self.input_activations.granularity}"
            f"/{ {False: 'static', 'local': 'local'}.get(self.input_activations.dynamic, 'dynamic')}")
        wts = "none" if self.weights is None else f"{self.weights.format}/{self.weights.granularity}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weights={wts}, input_activations={act}" + (", smooth=True" if self.smooth is not None else ""))


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _check_static(name: str, ts: TensorScheme) -> None:
    if ts.dynamic is False and (ts.granularity != "tensor" or ts.scale_format != "float32" or not ts.symmetric):
        raise UsageError(f"layer {name!r}: static (dynamic=False) input activations are calibrated per tensor with a "
                         f"float32 scale, symmetric; got granularity={ts.granularity!r}, scale_format="
                         f"{ts.scale_format!r}, symmetric={ts.symmetric}: use granularity='tensor' or dynamic=True")


def _observe(model: nn.Module, layers: dict[str, nn.Linear], observe: Callable[[str, torch.Tensor], None],
             calibration_data: Iterable[Any], batches: int | None, kv: Any = None) -> int:
    """Run ``model`` (eval mode, no grad) over ``calibration_data``, call ``observe(name, x)`` with every input
    ``x`` of every layer in ``layers`` (module docstring) and return the number of batches; UsageError for a batch
    a layer cannot take and a batch the model cannot run.  Modes are restored and hooks removed whatever
    happens.  ``kv``: an observer installed for the pass (``install()`` / ``remove()``): the attention layers' keys
    and values (``_kvcache.KVObserver``), or a list of observers."""
    extras = [x for x in (kv if isinstance(kv, list) else [kv]) if x is not None]
    current = [0]

    def hook_for(name: str, in_features: int) -> Any:
        def hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0] if args else None
            if not isinstance(x, torch.Tensor) or x.shape[-1:] != (in_features,):
                got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise UsageError(f"calibration batch {current[0]}: layer {name!r} expects inputs [..., {in_features}]"
                                 f" (in_features={in_features}); got {got}: check the calibration data's shape")
            observe(name, x)
        return hook

    hooks = [layers[n].register_forward_pre_hook(hook_for(n, layers[n].in_features)) for n in layers]
    modes = {m: m.training for m in model.modules()}
    count = 0
    try:
        for x in extras:
            x.install()
        model.eval()
        data = calibration_data if batches is None else itertools.islice(calibration_data, batches)
        with torch.no_grad():
            for i, batch in enumerate(data):
                current[0] = i
                try:
                    call_model(model, batch)
                except (RuntimeError, TypeError) as e:
                    raise UsageError(f"calibration batch {i}: the model cannot run on it ({type(e).__name__}: {e});"
                                     " check that the batches are what the model takes") from e
                count += 1
    finally:
        for h in hooks:
            h.remove()
        for x in extras:
            x.remove()
        for m, mode in modes.items():
            m.training = mode
    return count


def _observe_all(model: nn.Module, layers: dict[str, nn.Linear], observe: Callable[[str, torch.Tensor], None],
                 calibration_data: Iterable[Any], batches: int | None, sync: Sync,
                 kv: Any = None) -> None:
    """``_observe`` on every rank of ``sync`` (``_sync``: the ranks agree on failure); UsageError when the whole
    group saw no batch."""
    count = sync.run(lambda: _observe(model, layers, observe, calibration_data, batches, kv), "calibration")
    if int(sync.all_reduce(torch.tensor([count], dtype=torch.int64), "sum")) == 0:
        raise UsageError("quantize_model: calibration_data is empty (no batch): pass at least one batch of "
                         "representative inputs" + (" on at least one rank" if sync.active else ""))


def _combine(value: Any, keep: bool, sync: Sync) -> Any:
    """One layer's observation combined over the ranks (``_sync``): the list of observed inputs gathered in rank
    order (``keep``), or the running amax (None: never reached) reduced by MAX."""
    if keep:
        combined = sync.cat(torch.cat(value) if value else torch.empty(0))
        return [combined] if combined.numel() else []
    amax = sync.all_reduce(torch.full((1,), -1.0) if value is None else value.reshape(1), "max")
    return None if float(amax) < 0 else amax.reshape(())


def calibrate(model: nn.Module, layers: dict[str, nn.Linear], static: dict[str, TensorScheme],
              calibration_data: Iterable[Any], *, algorithm: str = "max", percentile: float = 99.99,
              batches: int | None = None, sync: Sync | None = None,
              kv: _kvcache.KVObserver | None = None) -> dict[str, torch.Tensor]:
    """The float32 static input scale of every layer in ``static`` (name -> activation scheme) from running
    ``model`` over ``calibration_data`` (module docstring; ``_calibrate`` for the algorithms), combined over the
    ranks of ``sync`` (``_sync``)."""
    sync = sync or Sync()
    _calibrate.check_algorithm(algorithm, percentile)
    keep = algorithm != "max"
    seen: dict[str, Any] = {n: [] if keep else None for n in static}

    def observe(name: str, x: torch.Tensor) -> None:
        if keep:
            seen[name].append(x.detach().float().reshape(-1).clone())
        else:
            amax = x.detach().float().abs().amax()
            seen[name] = amax if seen[name] is None else torch.maximum(seen[name], amax)

    _observe_all(model, {n: layers[n] for n in static}, observe, calibration_data, batches, sync, kv)
    for n in static:  # the same order on every rank (the plan's)
        seen[n] = _combine(seen[n], keep, sync)
    missing = [n for n in static if seen[n] is None or (keep and not seen[n])]
    if missing:
        raise UsageError(f"quantize_model: the calibration batches never reached layer(s) {missing}: their static "
                         "input scales cannot be calibrated")
    return {n: _calibrate.scale_from_clip(_calibrate.clip_value(seen[n], ts, algorithm, percentile), ts)
            for n, ts in static.items()}


def _weight_aware(model: nn.Module, entries: list[_plan.PlanEntry], calibration_data: Iterable[Any],
                  algorithm: str, options: dict[str, Any], batches: int | None,
                  sync: Sync, kv: _kvcache.KVObserver | None = None
                  ) -> tuple[dict[str, QuantizedLinear], dict[str, torch.Tensor]]:
    """The ``QuantizedLinear`` of every planned layer under ``"gptq"``, ``"awq"`` or ``"smoothquant"``
    (``_algorithms``), from one calibration pass (statistics combined over the ranks of ``sync``), and the
    factors to fold into norms (``_fold``: norm name -> ``s``; empty unless ``options["fold"]``); static
    activation scales are the ``"max"`` of each layer's (smoothed) inputs."""
    layers: dict[str, nn.Linear] = {e.name: e.module for e in entries}  # type: ignore[misc]
    stats = {n: _algorithms.LayerStats(need_gram=algorithm != "smoothquant") for n in layers}
    folding = bool(options.get("fold")) and algorithm in ("awq", "smoothquant")
    edges = _fold.NormEdges(model, dict(layers)) if folding else None
    _observe_all(model, layers, lambda n, x: stats[n].add(x), calibration_data, batches, sync, [kv, edges])
    if sync.active:
        for n, lin in layers.items():
            _algorithms.reduce_stats(stats[n], lin.in_features, lin.weight.device, sync)
    missing = [n for n in layers if stats[n].tokens == 0]
    if missing:
        raise UsageError(f"quantize_model: the calibration batches never reached layer(s) {missing}: algorithm="
                         f"{algorithm!r} needs their inputs")
    by_name = {e.name: e for e in entries}
    shared: dict[str, torch.Tensor] = {}  # layer -> its norm's factor
    folds: dict[str, torch.Tensor] = {}  # norm -> factor
    if edges is not None:
        groups = edges.groups()
        sync.check_same("the norm-to-layer folding groups (every rank needs calibration batches with fold=True)",
                        repr(sorted(groups.items())))
        for norm, names in groups.items():
            st = stats[names[0]]
            ws = [layers[n].weight.detach() for n in names]
            if algorithm == "smoothquant":
                assert st.amax is not None
                f = _algorithms.smoothquant_scale(st.amax, torch.cat([w.float() for w in ws]), options["alpha"])
            else:
                quantized = [n for n in names if by_name[n].weights is not None]
                if not quantized:
                    continue
                f = _algorithms.awq_search_group([layers[n].weight.detach() for n in quantized], st,
                                                 [by_name[n].weights for n in quantized],  # type: ignore[misc]
                                                 options["n_grid"])[0]
            folds[norm] = f
            shared.update({n: f for n in names})
        if folds:
            assert edges.first_call is not None
            _fold.verify(model, edges.first_call, edges.norms, folds,
                         {g: [layers[n] for n in names if n in shared] for g, names in groups.items() if g in folds})
    out: dict[str, QuantizedLinear] = {}
    for e in entries:
        lin, st, ts, act = layers[e.name], stats[e.name], e.weights, e.input_activations
        w = lin.weight.detach()
        smooth = qw = wscale = wzp = folded = None
        if folding:  # weight = Q(W diag(folded)) (QuantizedLinear); layers reading no norm: round to nearest
            folded = shared.get(e.name)
        elif algorithm == "smoothquant":
            smooth = _algorithms.smoothquant_scale(st.amax, w, options["alpha"])  # type: ignore[arg-type]
        elif ts is not None and algorithm == "gptq":
            qw, wscale, wzp = _algorithms.gptq_weight(w, _algorithms.hessian(st), ts, damp=options["damp"],
                                                       block_size=options["block_size"],
                                                       act_order=options["act_order"],
                                                       static_groups=options["static_groups"])
        elif ts is not None:  # awq
            s = _algorithms.awq_search(w, st, ts, options["n_grid"])[0]
            if act is None:
                qw = _algorithms.awq_weight(w, s, ts) / s
            else:
                smooth, qw = s, _algorithms.awq_weight(w, s, ts)
        scale = None
        if act is not None and act.dynamic in (False, "local"):
            assert st.amax is not None
            div = smooth if smooth is not None else folded
            amax = st.amax if div is None else (st.amax / div).to(st.dtype).float()
            scale = _calibrate.scale_from_clip(amax.max(), act)
        out[e.name] = QuantizedLinear(lin, name=e.name, group=e.group, weights=ts, input_activations=act,
                                      input_scale=scale, smooth=smooth, quantized_weight=qw, weight_scale=wscale,
                                      weight_zero_point=wzp, algorithm=algorithm, folded=folded)
    return out, folds


def _fingerprint(scheme: Scheme, entries: list[_plan.PlanEntry], algorithm: str, percentile: float,
                 options: dict[str, Any]) -> str:
    weights = {e.name: e.module.weight for e in entries}
    layers = ";".join(f"{n}:{list(w.shape)}:{w.dtype}" for n, w in weights.items() if isinstance(w, torch.Tensor))
    return f"{scheme.hash()}|{algorithm}|{percentile!r}|{sorted(options.items())!r}|{layers}"


def quantize_model(model: nn.Module, scheme: Scheme, calibration_data: Iterable[Any] | None = None, *,
                   algorithm: str = "max", percentile: float = 99.99, batches: int | None = None,
                   options: dict[str, Any] | None = None, distributed_sync: bool = True,
                   process_group: Any = None) -> nn.Module:
    """Replace, in place, every ``nn.Linear`` that ``plan(model, scheme)`` selects by a ``QuantizedLinear``
    (fake-quantized weights once, fake-quantized inputs on every call) and return ``model``.

    Args:
        calibration_data: an iterable of batches (lowprec's batch contract: dict, ``(*inputs, target)`` tuple, or
            tensor), required when a layer's input activations are static (``dynamic=False``), ignored otherwise.
        algorithm: how static scales are chosen: ``"max"`` (no clipping), ``"percentile"`` (clip the largest
            ``1 - percentile/100`` of magnitudes) or ``"mse"`` (least mean squared fake-quantization error over
            a grid of 100 clipping ratios from 0.5 to 1.0 of the range); ``lowprec.inference._calibrate``.
            Or a weight/activation-aware algorithm (``lowprec.inference._algorithms``), which needs
            ``calibration_data`` for every scheme: ``"gptq"`` (weights minimising the layer's output error by
            column-wise error compensation with the inverse Hessian), ``"awq"`` (per-input-channel scales
            ``mean|x|^a`` protecting salient channels, ``a`` searched for the least output error) or
            ``"smoothquant"`` (per-input-channel ``x / s``, ``W diag(s)``: activation outliers move into the
            weights).  With these, static activation scales are the ``"max"`` of each layer's input (after the
            ``x / s`` of SmoothQuant, and of AWQ when the scheme quantizes inputs).
        percentile: for ``"percentile"``, in (0, 100].
        batches: use at most this many calibration batches (None: all).
        options: the parameters of ``"gptq"`` (``damp`` = 0.01: dampening fraction of ``mean(diag(H))``;
            ``block_size`` = 128: columns per lazy-update block; ``act_order`` = False: columns by decreasing
            ``diag(H)``; ``static_groups`` = False: True takes group scales from the original weight instead of
            the updated one), ``"awq"`` (``n_grid`` = 20: exponents ``0, 1/n_grid, ..``) or ``"smoothquant"``
            (``alpha`` = 0.5 in [0, 1]); both also ``fold`` = False: True shares ``s`` among the layers reading
            one norm and folds it into the norm (``_fold``), so the model can be saved.  A dict with any of
            these keys, the rest default.  None for the others.
        distributed_sync: under ``torch.distributed`` with more than one rank, combine the calibration
            statistics of all ranks of ``process_group`` (None: the default group), each calibrating on its own
            batches, so that every rank gets the same scales and weights (``lowprec.inference._sync``).  When it
            calibrates, ``quantize_model`` is then a collective: call it on every rank.  False: each rank
            calibrates on its own batches alone.

    Raises ``UsageError`` for a scheme that selects nothing or a module that is not an ``nn.Linear``, an already
    quantized model, a static scheme without calibration data or with an empty one, a calibration batch whose
    shape a layer cannot take (naming the layer and its ``in_features``), an unknown algorithm, a bad option, GPTQ
    on MX / NVFP4 weights.  On error the model is unchanged.  ``unquantize_model`` undoes it.
    """
    if not isinstance(model, nn.Module):
        raise UsageError(f"quantize_model: model must be a torch.nn.Module; got {type(model).__name__}")
    if any(isinstance(m, QuantizedLinear) or _kvcache.is_attached(m) or _fold.is_folded(m) for m in model.modules()):
        raise UsageError("quantize_model: the model already holds QuantizedLinear layers; call "
                         "lowprec.inference.unquantize_model(model) first")
    aware = algorithm in _algorithms.WEIGHT_ALGORITHMS
    if not aware:
        _calibrate.check_algorithm(algorithm, percentile)
    opts = _algorithms.check_options(algorithm, options)  # type: ignore[arg-type]
    if batches is not None and (isinstance(batches, bool) or not isinstance(batches, int) or batches < 1):
        raise UsageError(f"quantize_model: batches must be a positive int or None; got {batches!r}")
    sync = Sync.resolve(distributed_sync, process_group)
    entries = _plan.plan(model, scheme)
    if not entries:
        raise UsageError(f"quantize_model: scheme {scheme.name!r} selects no module of this model; check its targets")
    for e in entries:
        if type(e.module) is not nn.Linear:
            raise UsageError(f"quantize_model: module {e.name!r} is a {type(e.module).__name__}; only nn.Linear is "
                             "quantized: add it to Scheme.ignore")
        if e.input_activations is not None:
            _check_static(e.name, e.input_activations)
        _algorithms.check_weights(algorithm, e.name, e.weights)
    kv_ts = scheme.kv_cache
    attn: dict[str, nn.Module] = {}
    if kv_ts is not None:
        _kvcache.check_kv_scheme(kv_ts)
        attn = _kvcache.find_attention(model)
        if calibration_data is None:
            raise UsageError(f"quantize_model: scheme {scheme.name!r} quantizes the KV cache with calibrated "
                             "k_scale / v_scale and needs calibration_data; pass batches of representative inputs")
    kv_algorithm = algorithm if algorithm in _calibrate.ALGORITHMS else "max"
    kv = _kvcache.KVObserver(attn, keep=kv_algorithm != "max") if attn else None
    static = {e.name: e.input_activations for e in entries
              if e.input_activations is not None and e.input_activations.dynamic in (False, "local")}
    if aware and calibration_data is None:
        raise UsageError(f"quantize_model: algorithm={algorithm!r} needs calibration_data (the layers' inputs); "
                         "pass batches of representative inputs")
    if static and calibration_data is None:
        raise UsageError(f"quantize_model: scheme {scheme.name!r} has static input activations (layers "
                         f"{sorted(static)[:5]}{'...' if len(static) > 5 else ''}) and needs calibration_data; "
                         "pass batches of representative inputs, or use a dynamic scheme (e.g. 'fp8-dynamic')")
    if aware or static or kv is not None:
        sync.check_same("the model, scheme and algorithm", _fingerprint(scheme, entries, algorithm, percentile, opts)
                        + "|" + ";".join(attn))
    assert calibration_data is not None or not (aware or static or kv is not None)
    if aware:
        new, folds = _weight_aware(model, entries, calibration_data,  # type: ignore[arg-type]
                                   algorithm, opts, batches, sync, kv)
    else:
        folds = {}
        scales: dict[str, torch.Tensor] = {}
        layers = {e.name: e.module for e in entries}
        if static:
            scales = calibrate(model, layers, static, calibration_data,  # type: ignore[arg-type]
                               algorithm=algorithm, percentile=percentile, batches=batches, sync=sync, kv=kv)
        elif kv is not None:
            _observe_all(model, {}, lambda n, x: None, calibration_data,  # type: ignore[arg-type]
                         batches, sync, kv)
        new = {e.name: QuantizedLinear(e.module, name=e.name, group=e.group,  # type: ignore[arg-type]
                                       weights=e.weights, input_activations=e.input_activations,
                                       input_scale=scales.get(e.name), algorithm=algorithm)
               for e in entries}
    kv_scales = {} if kv is None else kv.scales(kv_ts, kv_algorithm, percentile,  # type: ignore[arg-type]
                                                lambda v, keep: _combine(v, keep, sync))
    for name, module in new.items():
        _set_module(model, name, module)
    for name, f in folds.items():
        _fold.fold(model.get_submodule(name), f)
    for name, (k_scale, v_scale) in kv_scales.items():
        _kvcache.attach(attn[name], kv_ts, k_scale, v_scale)  # type: ignore[arg-type]
    return model


def unquantize_model(model: nn.Module) -> nn.Module:
    """Replace, in place, every ``QuantizedLinear`` by an ``nn.Linear`` with its original weight and bias (bit for
    bit), remove the KV cache quantizers (hooks, ``k_scale`` / ``v_scale``), and return ``model``."""
    names = [n for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    if isinstance(model, QuantizedLinear):
        raise UsageError("unquantize_model: pass the model holding the QuantizedLinear, not the layer itself; "
                         "use layer.to_linear()")
    for _, m in list(_kvcache.attached(model)):
        _kvcache.detach(m)
    _fold.unfold_all(model)
    for name in names:
        _set_module(model, name, model.get_submodule(name).to_linear())  # type: ignore[operator]
    return model
