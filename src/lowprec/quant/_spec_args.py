"""Resolving a spec argument (a ``QuantSpec`` or a name) into a validated ``QuantSpec``, in pure Python.

``_resolve`` is the check every quantizer entry point makes (PyTorch and JAX alike, with the same message);
``resolve_spec`` is the stricter one for gradient communication, where a spec must fit a flat 1-D bucket and have a
storage layout to send (see ``lowprec.distributed._wire``).  Neither imports torch, so the JAX binding uses them
without it.
"""

from __future__ import annotations

import dataclasses

from .. import formats
from .._errors import UsageError
from ._spec import QuantSpec, Scaling
from ._storage import has_torch_dtype
from ._validate import check_rounding


def _resolve(spec: object) -> QuantSpec:
    if isinstance(spec, str):
        spec = QuantSpec.named(spec)
    if not isinstance(spec, QuantSpec):
        raise UsageError(f"spec must be a QuantSpec or a spec name; got {type(spec).__name__}")
    return spec


_SUPPORTED_SCALINGS: tuple[Scaling, ...] = ("none", "tensor", "block")


def resolve_spec(spec: object, rounding: object = None) -> QuantSpec:
    """The ``QuantSpec`` a hook sends gradients in, validated for flat gradient buckets.

    ``spec``: a ``QuantSpec``, a ``QuantSpec`` name ("fp8_e4m3_tensorwise", "mxfp8_e4m3", ...) or a format name:
    16- and 32-bit formats ("bfloat16", "float16", "float32") are sent unscaled, narrower formats ("float8_e4m3fn",
    "float8_e5m2", ...) with one shared float32 scale per bucket.  ``rounding`` (if not None) replaces the spec's.
    Raises ``ValueError`` naming the field that does not fit.
    """
    if isinstance(spec, str):
        if spec in QuantSpec.names():
            spec = QuantSpec.named(spec)
        elif spec in formats.names():
            fmt = formats.get(spec)
            spec = QuantSpec(elem=spec, scaling="none" if fmt.bits >= 16 else "tensor")
        else:
            raise UsageError(
                f"spec: unknown name {spec!r}; use a QuantSpec name ({', '.join(QuantSpec.names())}) or a format "
                f"name ({', '.join(formats.names())})"
            )
    if not isinstance(spec, QuantSpec):
        raise UsageError(f"spec must be a QuantSpec or a spec/format name; got {type(spec).__name__}")
    if rounding is not None:
        spec = dataclasses.replace(spec, rounding=check_rounding(rounding, "QuantSpec.rounding"))
    if spec.scaling not in _SUPPORTED_SCALINGS:
        raise UsageError(
            f"QuantSpec.scaling={spec.scaling!r} does not fit a gradient bucket (a flat 1-D buffer); use 'none', "
            "'tensor' (one shared scale per bucket) or 'block' (MX, NVFP4)"
        )
    if spec.scaling == "block" and spec.axis not in (0, -1):
        raise UsageError(f"QuantSpec.axis must be -1 or 0 for a flat gradient bucket; got {spec.axis}")
    fmt = spec.format
    if not has_torch_dtype(fmt) and fmt.bits > 8:
        raise UsageError(
            f"QuantSpec.elem={fmt.name!r} has no storage layout to send; use bfloat16, float16, float32 or a format "
            "of 8 bits or fewer"
        )
    if spec.scaling == "block" and not has_torch_dtype(spec.scale_spec):
        raise UsageError(f"QuantSpec.scale_format={spec.scale_spec.name!r} has no torch dtype to send scales in")
    return spec
