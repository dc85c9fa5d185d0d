"""The batch contract every part of lowprec follows (the runners, the zoo's ``Task``, sensitivity analysis):
how a batch is fed to a model and which part of it is the target.

* a dict (``{"input_ids": ..., "labels": ...}``, Hugging Face style): ``model(**batch)``; the target is the dict;
* a tuple or list ``(*inputs, target)``: ``model(*inputs)``; the target is the last element (``(x, y)``:
  ``model(x)``);
* anything else (a tensor): ``model(batch)``; the target is the batch itself.

Kept here, below ``runs`` and ``numerics``, so both call models the same way without importing each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ._errors import UsageError


def call_model(model: torch.nn.Module, batch: Any) -> tuple[Any, Any]:
    """``(model output, target)`` for ``batch`` by the batch contract; UsageError for a tuple with fewer than two
    elements (there is no target)."""
    if isinstance(batch, Mapping):
        return model(**batch), batch
    if isinstance(batch, tuple | list):
        if len(batch) < 2:
            raise UsageError(f"a tuple batch is (*inputs, target), at least two elements; got {len(batch)}: "
                             "return a dict or a tensor for a model that needs no target")
        return model(*batch[:-1]), batch[-1]
    return model(batch), batch


def output_tensor(output: Any) -> torch.Tensor:
    """The tensor a model's output is compared by: the output itself when it is a tensor, else its ``logits``
    (a Hugging Face ``ModelOutput`` or a dict holding ``"logits"``).  UsageError otherwise."""
    if isinstance(output, torch.Tensor):
        return output
    logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise UsageError(f"the model returned a {type(output).__name__} with no tensor to compare: return a tensor, or "
                     "an output with .logits (a Hugging Face ModelOutput) or a dict with 'logits'")
