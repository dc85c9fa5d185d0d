"""KV cache quantization: the keys and values an attention layer stores, at a calibrated per-tensor scale.

A scheme's ``kv_cache`` (compressed-tensors' top-level ``kv_cache_scheme``; vLLM's ``kv_cache_dtype="fp8"`` with
checkpoint scales) quantizes what each attention layer writes into its cache: the key states after the rotary
embedding and the value states, ``[batch, kv_heads, tokens, head_dim]``, each with one float32 scale per layer,
``k_scale`` and ``v_scale`` (buffers ``[1]`` on the attention module: ``model.layers.N.self_attn.k_scale`` in a
checkpoint, the names vLLM loads).  The scale is calibrated like a static activation scale (``_calibrate``:
clipping value ``c``, ``c / 448`` for e4m3, ``c / 127.5`` for int8), and every call quantizes
``k^ = Q(clamp(k / k_scale, -max, max)) * k_scale`` (``_calibrate.fake_quantize_static``) before the keys enter
the cache and the attention, so a cached generation reads back exactly what a quantized cache holds.

Which modules: every module whose class name ends in ``Attention`` and whose ``forward`` takes a Hugging Face
cache (a parameter ``cache``, ``past_key_values`` or ``past_key_value``) and calls its ``update(key_states,
value_states, layer_idx, ...)``: the attention of transformers' decoder models.  As compressed-tensors'
``QuantizedKVCache`` does, a forward pre-hook hands the layer a wrapper in place of its cache (or of None); the
wrapper's ``update`` quantizes (or, during calibration, observes) the states and passes them to the real cache,
if there is one.  Other models (the zoo's GPT computes attention without a cache) get a ``UsageError``.

Supported: ``granularity="tensor"``, ``dynamic=False``, symmetric, float32 scales, formats ``float8_e4m3fn``
(vLLM's fp8 cache) and ``int8``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from .._errors import UsageError
from . import _calibrate
from ._scheme import TensorScheme

CACHE_PARAMS = ("cache", "past_key_values", "past_key_value")
_ATTR = "_lowprec_kv_hook"


def check_kv_scheme(ts: TensorScheme) -> None:
    """UsageError unless ``ts`` is a KV cache scheme this module runs (module docstring)."""
    if (ts.granularity != "tensor" or ts.dynamic is not False or not ts.symmetric or ts.scale_format != "float32"
            or ts.format not in ("float8_e4m3fn", "int8")):
        raise UsageError(f"Scheme.kv_cache: quantize_model runs static per-tensor float8_e4m3fn or int8 KV caches "
                         f"(granularity='tensor', dynamic=False, symmetric, float32 scales); got format="
                         f"{ts.format!r}, granularity={ts.granularity!r}, dynamic={ts.dynamic!r}, symmetric="
                         f"{ts.symmetric}, scale_format={ts.scale_format!r}")


def _cache_param(module: nn.Module) -> str | None:
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((p for p in CACHE_PARAMS if p in params), None)


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The attention modules whose cache ``kv_cache`` quantizes (module docstring), by qualified name."""
    return {n: m for n, m in model.named_modules()
            if type(m).__name__.endswith("Attention") and _cache_param(m) is not None}


def find_attention(model: nn.Module) -> dict[str, nn.Module]:
    """``attention_modules``, or UsageError when the model has none."""
    found = attention_modules(model)
    if not found:
        raise UsageError("Scheme.kv_cache: the model has no attention module that takes a Hugging Face cache (a "
                         f"module named '*Attention' whose forward takes one of {', '.join(CACHE_PARAMS)}); "
                         "KV cache quantization needs one: remove kv_cache from the scheme for this model")
    return found


class _CacheWrapper:
    """Stands in for the layer's cache for one call: ``update`` transforms the states, then the real cache (if any)
    stores them."""

    def __init__(self, transform: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                 cache: Any) -> None:
        self._transform = transform
        self._cache = cache

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._transform(key_states, value_states)
        if self._cache is None:
            return k, v
        return self._cache.update(k, v, *args, **kwargs)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        cache = self.__dict__.get("_cache")
        if cache is not None:
            return getattr(cache, name)
        raise AttributeError(f"the layer's cache has no attribute {name!r} (no cache was passed to it)")


def hook(module: nn.Module, transform: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
         ) -> torch.utils.hooks.RemovableHandle:
    """A forward pre-hook on ``module`` replacing its cache argument by a ``_CacheWrapper`` around it."""
    primary = _cache_param(module)
    assert primary is not None

    def pre(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        name = next((p for p in CACHE_PARAMS if p in kwargs), primary)
        kwargs[name] = _CacheWrapper(transform, kwargs.get(name))
        return args, kwargs

    return module.register_forward_pre_hook(pre, with_kwargs=True)


class KVObserver:
    """Observes the keys and values of ``modules`` while installed: per module and ``"k"``/``"v"``, the running
    amax (a tensor, or None when never reached) or, with ``keep``, the list of flattened float32 states."""

    def __init__(self, modules: dict[str, nn.Module], keep: bool) -> None:
        self.modules = modules
        self.keep = keep
        self.seen: dict[str, dict[str, Any]] = {n: {"k": [] if keep else None, "v": [] if keep else None}
                                                for n in modules}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def _transform_for(self, name: str) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        def transform(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            for key, t in (("k", k), ("v", v)):
                if self.keep:
                    self.seen[name][key].append(t.detach().float().reshape(-1).clone())
                else:
                    a = t.detach().float().abs().amax()
                    old = self.seen[name][key]
                    self.seen[name][key] = a if old is None else torch.maximum(old, a)
            return k, v
        return transform

    def install(self) -> None:
        self._handles = [hook(m, self._transform_for(n)) for n, m in self.modules.items()]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def scales(self, ts: TensorScheme, algorithm: str, percentile: float, combine: Callable[[Any, bool], Any]
               ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``(k_scale, v_scale)`` per module from what was seen, each combined over the ranks by ``combine(value,
        keep)`` first (``_quantize._combine``); UsageError for a module the calibration never reached."""
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        missing = []
        for name in self.modules:  # the same order on every rank
            pair = []
            for key in ("k", "v"):
                value = combine(self.seen[name][key], self.keep)
                if value is None or (self.keep and not value):
                    missing.append(name)
                    break
                pair.append(_calibrate.scale_from_clip(_calibrate.clip_value(value, ts, algorithm, percentile), ts))
            else:
                out[name] = (pair[0], pair[1])
        if missing:
            raise UsageError(f"quantize_model: the calibration batches never reached the KV cache of "
                             f"{sorted(set(missing))}: its k_scale / v_scale cannot be calibrated (does the model "
                             "call cache.update? transformers' attention does)")
        return out


def attach(module: nn.Module, ts: TensorScheme, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """Give ``module`` the buffers ``k_scale`` / ``v_scale`` (float32 ``[1]``) and the quantizing hook."""
    module.register_buffer("k_scale", k_scale.detach().float().reshape(1).clone())
    module.register_buffer("v_scale", v_scale.detach().float().reshape(1).clone())

    def transform(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (_calibrate.fake_quantize_static(k, module.k_scale, ts),  # type: ignore[arg-type]
                _calibrate.fake_quantize_static(v, module.v_scale, ts))  # type: ignore[arg-type]

    setattr(module, _ATTR, (hook(module, transform), ts))


def is_attached(module: nn.Module) -> bool:
    return hasattr(module, _ATTR)


def detach(module: nn.Module) -> None:
    """Undo ``attach``: the hook and both buffers go."""
    handle, _ = getattr(module, _ATTR)
    handle.remove()
    delattr(module, _ATTR)
    for name in ("k_scale", "v_scale"):
        if name in module._buffers:
            del module._buffers[name]


def attached(model: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    return ((n, m) for n, m in model.named_modules() if is_attached(m))
