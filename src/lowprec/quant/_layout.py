"""Which dimensions a spec's scaling groups span, as pure Python shared by the PyTorch and JAX quantizers.

``check_layout`` says whether a spec fits an array of a given shape (with the same message for torch and JAX);
``reduce_dims`` names the dimensions of the grouped view (see ``lowprec.quant._groups``) an amax is taken over.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._errors import UsageError

if TYPE_CHECKING:
    import torch

    from ._spec import QuantSpec


def check_layout(shape: torch.Size | tuple[int, ...], spec: QuantSpec) -> None:
    """Raise ``ValueError`` naming the argument when ``spec`` does not fit a tensor of ``shape``."""
    ndim = len(shape)
    if spec.scaling in ("axis", "block") and (ndim == 0 or not -ndim <= spec.axis < ndim):
        raise UsageError(
            f"QuantSpec.axis={spec.axis} is out of range for a tensor of {ndim} dimension(s) "
            f"(shape {tuple(shape)}); use an axis in [{-ndim}, {ndim - 1}]"
        )
    if spec.scaling == "tile" and ndim < 2:
        raise UsageError(
            f"QuantSpec.tile={spec.tile} needs a tensor with at least 2 dimensions; got shape {tuple(shape)}"
        )


def reduce_dims(spec: QuantSpec, ndim: int) -> tuple[int, ...]:
    """Dimensions of the grouped view to take the amax over."""
    if spec.scaling == "tensor":
        return tuple(range(ndim))
    if spec.scaling == "axis":
        return (spec.axis % ndim,)
    if spec.scaling == "block":
        return (-1,)
    return (-3, -1)  # tile
