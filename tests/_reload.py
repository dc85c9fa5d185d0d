"""Shared by the inference checkpoint tests: a checkpoint loaded into a freshly quantized model reproduces the
model it was saved from."""

from __future__ import annotations

from typing import Any

import torch

from lowprec import inference as I


def assert_reloads(path: Any, scheme: I.Scheme, fresh: Any, model: Any, input_ids: torch.Tensor) -> None:
    """``load_quantized(path)`` gives back ``scheme``, and its state loaded (strict) into ``fresh`` (the same
    architecture, quantized with other scales) gives ``model``'s logits on ``input_ids`` bit for bit."""
    state, back = I.load_quantized(path)
    assert back == scheme
    fresh.load_state_dict(state, strict=True)
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=input_ids).logits, model(input_ids=input_ids).logits)
