"""Fault injection: bit flips in a chosen weight, gradient or activation, on a chosen rank and step.

A ``Fault`` says where (``target``: ``"weight"`` or ``"grad"`` of a named parameter, or the output
``"activation"`` of a named module; ``index``: the element, in row-major order), what (``bit`` of the element's
IEEE representation in its own dtype; ``mode``: ``"flip"`` XORs it, ``"set"`` / ``"clear"`` force it: a stuck bit),
when (``step``; ``persistent``: every step from it on, a faulty chip, else that step only, a transient upset) and
on which ``rank`` (None: every rank).  A ``FaultInjector`` applies a list of them to a model at the points a
training step passes, which the training loop calls:

* ``before_forward(step)``: weight faults change the parameter's stored value in place (memory is corrupted: a
  transient weight fault stays in the weights until they are restored from a snapshot, which is how a replay
  tells it from a persistent one; a persistent one is re-applied every step, so it survives optimizer updates);
* activation faults, armed for the step, change the module's output on that step's forward (an out-of-place
  copy, so autograd sees the faulty value as the layer's result);
* ``after_backward(step)``: gradient faults change ``param.grad`` in place (after DDP's all-reduce: the reduced
  gradient of this rank alone, what a cross-replica check must catch).

Every application is an ``Injection`` record (rank, step, target, tensor, index, bit, value before and after),
kept in ``injector.injections`` for the run's event log.  A flipped exponent bit (``bit`` 30 of a float32: 1.0
becomes inf, 0.5 becomes 2^127) is the classic silent-data-corruption signature; low mantissa bits are the
faults no loss curve shows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .._checks import check_int
from .._errors import UsageError
from ._digest import local
from ._fault import Fault, Mode

_INT_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
             torch.float16: torch.int16}
_BITS = {torch.float32: 32, torch.float64: 64, torch.bfloat16: 16, torch.float16: 16}


@dataclasses.dataclass(frozen=True)
class Injection:
    """One application of a fault."""

    rank: int
    step: int
    target: str
    tensor: str
    index: int
    bit: int
    before: float
    after: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def alter_bit(t: torch.Tensor, index: int, bit: int, mode: Mode = "flip") -> tuple[float, float]:
    """Change bit ``bit`` of element ``index`` (row-major) of ``t`` in place; ``(value before, value after)``.

    A DTensor (an FSDP2/HSDP parameter or gradient) is altered in this rank's local shard, ``index`` counting the
    shard's elements: a fault is in one device's memory, and no collective runs."""
    t = local(t)
    if t.dtype not in _INT_VIEW:
        raise UsageError(f"fault injection: tensors of dtype {t.dtype} are not supported (float32, float64, "
                         "bfloat16, float16)")
    if not t.is_contiguous():
        raise UsageError("fault injection: the tensor must be contiguous")
    nbits = _BITS[t.dtype]
    if not 0 <= bit < nbits:
        raise UsageError(f"fault injection: bit {bit} is outside a {t.dtype} element (bits 0..{nbits - 1})")
    if not 0 <= index < t.numel():
        raise UsageError(f"fault injection: index {index} is outside a tensor of {t.numel()} elements")
    flat = t.detach().view(-1)
    ints = flat.view(_INT_VIEW[t.dtype])
    mask = 1 << bit
    if mask >= 1 << (nbits - 1):  # the sign bit, as a signed integer of that width
        mask -= 1 << nbits
    m = torch.tensor(mask, dtype=ints.dtype, device=ints.device)
    before = float(flat[index])
    with torch.no_grad():
        cur = ints[index]
        new = cur ^ m if mode == "flip" else (cur | m if mode == "set" else cur & ~m)
        ints[index] = new
    return before, float(flat[index])


class FaultInjector:
    """Applies ``faults`` to ``model`` on ``rank`` (module docstring); ``remove()`` takes its hooks off."""

    def __init__(self, model: nn.Module, faults: Iterable[Fault], *, rank: int = 0) -> None:
        self.model = model
        self.faults = tuple(faults)
        self.rank = check_int(rank, "rank", 0)
        self.injections: list[Injection] = []
        params = dict(model.named_parameters())
        modules = dict(model.named_modules())
        self._step: int | None = None
        self._replay = False
        self._hooks = []
        for f in self.faults:
            if not isinstance(f, Fault):
                raise UsageError(f"FaultInjector: faults must be Fault objects; got {type(f).__name__}")
            if f.target in ("weight", "grad"):
                if f.tensor not in params:
                    raise UsageError(f"Fault.tensor={f.tensor!r} is not a parameter of the model; parameters: "
                                     f"{', '.join(list(params)[:8])}{'...' if len(params) > 8 else ''}")
                numel = params[f.tensor].numel()
            else:
                if f.tensor not in modules:
                    raise UsageError(f"Fault.tensor={f.tensor!r} is not a module of the model (activation faults "
                                     "name the module whose output they change)")
                numel = None
            if numel is not None and f.index >= numel:
                raise UsageError(f"Fault.index={f.index} is outside {f.tensor!r} ({numel} elements)")
        for name in {f.tensor for f in self.faults if f.target == "activation"}:
            self._hooks.append(modules[name].register_forward_hook(self._activation_hook(name)))
        self._params = params

    def _record(self, f: Fault, step: int, before: float, after: float) -> None:
        self.injections.append(Injection(self.rank, step, f.target, f.tensor, f.index, f.bit, before, after))

    def _activation_hook(self, name: str) -> Any:
        def hook(_m: nn.Module, _args: Any, out: Any) -> Any:
            step = self._step
            if step is None or not isinstance(out, torch.Tensor):
                return None
            todo = [f for f in self.faults if f.target == "activation" and f.tensor == name
                    and f.active(step, self.rank) and (f.persistent or not self._replay)]
            if not todo:
                return None
            out = out.clone()
            for f in todo:
                if f.index >= out.numel():
                    raise UsageError(f"Fault.index={f.index} is outside the output of {name!r} ({out.numel()} "
                                     "elements at this step)")
                before, after = alter_bit(out, f.index, f.bit, f.mode)
                self._record(f, step, before, after)
            return out
        return hook

    def before_forward(self, step: int, *, replay: bool = False) -> None:
        """Apply this step's weight faults and arm its activation faults.

        ``replay``: the step is being computed again (a rerun, or this rank computing another rank's shard): a
        transient fault does not happen again, a persistent one does (a faulty unit); weights are not altered
        again (their memory still holds whatever the first computation of the step left there)."""
        self._step = step
        self._replay = replay
        for f in self.faults:
            if f.target == "weight" and f.active(step, self.rank) and not replay:
                before, after = alter_bit(self._params[f.tensor].data, f.index, f.bit, f.mode)
                self._record(f, step, before, after)

    def after_backward(self, step: int, *, replay: bool = False) -> None:
        """Apply this step's gradient faults (``param.grad`` must exist) and disarm the activation faults;
        ``replay`` as in ``before_forward``."""
        for f in self.faults:
            if f.target == "grad" and f.active(step, self.rank) and (f.persistent or not replay):
                g = self._params[f.tensor].grad
                if g is None:
                    raise UsageError(f"fault on the gradient of {f.tensor!r} at step {step}: it has no .grad (call "
                                     "after_backward after loss.backward())")
                before, after = alter_bit(g, f.index, f.bit, f.mode)
                self._record(f, step, before, after)
        self._step = None

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
