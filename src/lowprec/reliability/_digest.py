"""Exact digests of tensors: what replicas compare to find silent data corruption.

``digest(t)`` hashes the *bits* of ``t``: each element's IEEE representation ``v_i`` (its own width, as a signed
integer) times an odd weight ``w_i = (2 i + 1) mod 2^31``, summed in int64 with wrap-around::

    D(t) = sum_i v_i * w_i   (mod 2^64)

Changing one element by ``d = v'_i - v_i`` (any ``d != 0`` mod 2^64) changes ``D`` by ``d * w_i``, which is never 0
mod 2^64 because ``w_i`` is odd (invertible mod 2^64): **a change in one element is always detected**, whatever
bit flips.  Several changed elements cancel only if their weighted deltas sum to 0 mod 2^64 (for random damage, a
2^-64 event).  The weights depend on the position, so a permutation of elements is seen too.  Floating-point
sums would not do: a low mantissa bit of one element vanishes in the rounding of a float sum, and ``-0.0`` and
``NaN`` payloads compare equal or never equal.

``ModuleFingerprints`` records the digest of every module's output as a forward runs (hooks; about one extra pass
over each activation, so it is opt-in: ``[reliability] fingerprints``); comparing two runs of the same step names
the first module whose output differed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WEIGHTS: dict[tuple[int, str], torch.Tensor] = {}
_MOD = 2**31


def _weights(n: int, device: torch.device) -> torch.Tensor:
    key = (n, str(device))
    w = _WEIGHTS.get(key)
    if w is None:
        w = (torch.arange(n, dtype=torch.int64, device=device) * 2 + 1) % _MOD
        if len(_WEIGHTS) > 64:
            _WEIGHTS.clear()
        _WEIGHTS[key] = w
    return w


def local(t: torch.Tensor) -> torch.Tensor:
    """The local data of a DTensor (an FSDP2 shard), else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def digest(t: torch.Tensor) -> int:
    """The positional int64 digest of ``t``'s bits (module docstring); a DTensor digests its local shard."""
    t = local(t.detach())
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return 0
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    ints = flat.view(_INT[flat.element_size()]) if flat.is_floating_point() else flat
    return int((ints.to(torch.int64) * _weights(flat.numel(), flat.device)).sum())


def digests(tensors: Iterable[torch.Tensor | None]) -> list[int]:
    """``digest`` of each tensor (0 for None: a parameter without a gradient)."""
    return [0 if t is None else digest(t) for t in tensors]


class ModuleFingerprints:
    """Forward hooks recording ``(module name, digest of its output)`` in call order (tensor outputs, or the first
    tensor of a tuple); ``take()`` returns and clears them.  ``enabled`` switches recording off without removing
    the hooks."""

    def __init__(self, model: nn.Module) -> None:
        self.records: list[tuple[str, int]] = []
        self.enabled = True
        self._handles = [m.register_forward_hook(self._hook(name)) for name, m in model.named_modules() if name]

    def _hook(self, name: str) -> Any:
        def hook(_m: nn.Module, _args: Any, out: Any) -> None:
            if not self.enabled:
                return
            t = out if isinstance(out, torch.Tensor) else next(
                (o for o in out if isinstance(o, torch.Tensor)), None) if isinstance(out, tuple | list) else None
            if t is not None:
                self.records.append((name, digest(t)))
        return hook

    def take(self) -> list[tuple[str, int]]:
        out, self.records = self.records, []
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def first_difference(a: list[tuple[str, int]], b: list[tuple[str, int]]) -> str | None:
    """The first module (in call order) whose output digest differs between two fingerprint lists of the same
    computation, or None when they agree."""
    for (na, da), (nb, db) in zip(a, b, strict=False):
        if na != nb or da != db:
            return na
    if len(a) != len(b):
        return (a if len(a) > len(b) else b)[min(len(a), len(b))][0]
    return None
