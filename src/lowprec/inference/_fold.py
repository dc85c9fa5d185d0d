"""Folding SmoothQuant / AWQ channel scales into the norm before the layers (``options={"fold": True}``).

Both algorithms divide a layer's input by per-channel factors ``s`` and multiply its weight by them:
``(x / s) (W diag(s))^T = x W^T``.  Kept per layer, ``x / s`` is an extra operation (the ``smooth`` buffer) that
no checkpoint format stores.  When the input ``x`` is the output of a normalisation ``y = n(x) * w + b`` with a
per-channel affine ``w`` (LayerNorm, RMSNorm), the division folds into it: ``w' = w / s``, ``b' = b / s``, and the
model stays one of plain norms and linears, which ``save_quantized`` stores.  As llm-compressor's mappings
(``input_layernorm -> q/k/v_proj``, ``post_attention_layernorm -> gate/up_proj``), every quantized layer reading
the same norm output shares one ``s``, computed from all of them.

Which layers read which norm is found while calibrating, not declared: a forward hook on every module with a 1-D
``weight`` whose class name contains ``Norm`` remembers its output tensor, and a quantized layer whose input *is*
that tensor (the same object, in every calibration batch) reads it.  Layers reading anything else (attention
outputs, activations) keep a per-layer ``smooth``.  Because another consumer of the norm output (a residual, an
unquantized module) would silently see ``y / s``, the fold is verified: the float model with the folded norms and
scaled weights (no quantization) must reproduce the original model's output on the first calibration batch
within ``1e-4`` relative L2 error for float32 models (``2e-2`` for 16-bit ones; a wrong fold moves it by the
spread of ``s``, orders of magnitude more); otherwise ``UsageError`` names the norm.

``unquantize_model`` restores the norms' original parameters bit for bit (kept as ``_lowprec_unfolded``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .._errors import UsageError

_ATTR = "_lowprec_unfolded"


def _norms(model: nn.Module) -> dict[str, nn.Module]:
    out = {}
    for n, m in model.named_modules():
        w = getattr(m, "weight", None)
        if "Norm" in type(m).__name__ and isinstance(w, torch.Tensor) and w.dim() == 1:
            out[n] = m
    return out


class NormEdges:
    """While installed, records which quantized layer's input is which norm's output (module docstring)."""

    def __init__(self, model: nn.Module, layers: dict[str, nn.Module]) -> None:
        self.model = model
        self.layers = layers
        self.norms = _norms(model)
        self.reads: dict[str, set[str | None]] = {n: set() for n in layers}
        self.first_call: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self._outputs: dict[int, tuple[str, torch.Tensor]] = {}
        self._handles: list[Any] = []

    def install(self) -> None:
        def norm_hook(name: str) -> Any:
            def hook(_m: nn.Module, _a: Any, out: Any) -> None:
                if isinstance(out, torch.Tensor):
                    self._outputs[id(out)] = (name, out)
            return hook

        def layer_hook(name: str) -> Any:
            def hook(_m: nn.Module, args: tuple[Any, ...]) -> None:
                x = args[0] if args else None
                hit = self._outputs.get(id(x)) if isinstance(x, torch.Tensor) else None
                self.reads[name].add(hit[0] if hit is not None and hit[1] is x else None)
            return hook

        def model_hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._outputs.clear()
            if self.first_call is None:
                self.first_call = (args, dict(kwargs))

        self._handles = [m.register_forward_hook(norm_hook(n)) for n, m in self.norms.items()]
        self._handles += [m.register_forward_pre_hook(layer_hook(n)) for n, m in self.layers.items()]
        self._handles.append(self.model.register_forward_pre_hook(model_hook, with_kwargs=True))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._outputs.clear()

    def groups(self) -> dict[str, list[str]]:
        """norm name -> the quantized layers (plan order) that read its output in every calibration batch."""
        out: dict[str, list[str]] = {}
        for layer, seen in self.reads.items():
            if len(seen) == 1:
                (norm,) = seen
                if norm is not None:
                    out.setdefault(norm, []).append(layer)
        return out


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise UsageError("fold=True: cannot verify the fold: the model's output is neither a tensor, a tuple of "
                     f"tensors nor has .logits (got {type(out).__name__}); use fold=False")


def _fold_params(norm: nn.Module, s: torch.Tensor) -> dict[str, torch.Tensor]:
    new = {}
    for name in ("weight", "bias"):
        p = getattr(norm, name, None)
        if isinstance(p, torch.Tensor):
            new[name] = (p.detach().float() / s).to(p.dtype)
    return new


def _assign(module: nn.Module, values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, v in values.items():
            getattr(module, name).copy_(v)


def verify(model: nn.Module, call: tuple[tuple[Any, ...], dict[str, Any]], norms: dict[str, nn.Module],
           scales: dict[str, torch.Tensor], layers: dict[str, list[nn.Linear]]) -> None:
    """UsageError unless the float model with every norm in ``scales`` folded (``w / s``) and its layers scaled
    (``W diag(s)``) gives the original output on the first calibration call ``(args, kwargs)`` (module docstring).
    The model is restored."""
    def run() -> torch.Tensor:
        with torch.no_grad():
            return _first_tensor(model(*call[0], **call[1])).detach().float().clone()

    def rel(groups: Iterable[str]) -> float:
        saved: list[tuple[nn.Module, dict[str, torch.Tensor]]] = []
        try:
            for g in groups:
                saved.append((norms[g], {k: getattr(norms[g], k).detach().clone() for k in ("weight", "bias")
                                         if isinstance(getattr(norms[g], k, None), torch.Tensor)}))
                _assign(norms[g], _fold_params(norms[g], scales[g]))
                for lin in layers[g]:
                    saved.append((lin, {"weight": lin.weight.detach().clone()}))
                    _assign(lin, {"weight": (lin.weight.detach().float() * scales[g]).to(lin.weight.dtype)})
            got = run()
        finally:
            for m, vals in reversed(saved):
                _assign(m, vals)
        return float((got - ref).norm() / ref.norm().clamp(min=1e-30))

    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        ref = run()
        dtype = next((p.dtype for p in model.parameters()), torch.float32)
        tol = 1e-4 if dtype in (torch.float32, torch.float64) else 2e-2
        if rel(scales) <= tol:
            return
        for g in scales:
            err = rel([g])
            if err > tol:
                raise UsageError(f"fold=True: folding the smoothing factors into {g!r} changes the float model's "
                                 f"output (relative L2 error {err:.3g} > {tol:g} on the first calibration batch): "
                                 "its output has another consumer besides the layers "
                                 f"{[getattr(x, 'name', '?') for x in layers[g]]}; use fold=False")
        raise UsageError(f"fold=True: the folds together change the float model's output beyond {tol:g}; use "
                         "fold=False")
    finally:
        for m, mode in modes.items():
            m.training = mode


def fold(norm: nn.Module, s: torch.Tensor) -> None:
    """``w / s``, ``b / s`` on ``norm`` in place, keeping the originals for ``unfold``."""
    setattr(norm, _ATTR, {k: getattr(norm, k).detach().clone() for k in ("weight", "bias")
                          if isinstance(getattr(norm, k, None), torch.Tensor)})
    _assign(norm, _fold_params(norm, s))


def unfold_all(model: nn.Module) -> None:
    """Restore every folded norm's parameters (bit for bit)."""
    for m in model.modules():
        saved = getattr(m, _ATTR, None)
        if saved is not None:
            _assign(m, saved)
            delattr(m, _ATTR)


def is_folded(module: nn.Module) -> bool:
    return hasattr(module, _ATTR)
