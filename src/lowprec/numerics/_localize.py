"""NaN/Inf localisation: the first module and tensor of a training step that held a non-finite value.

A non-finite loss or gradient norm says *that* a step went wrong, not *where*.  IEEE 754 arithmetic propagates
non-finite values: ``inf - inf``, ``0 * inf`` and anything with a NaN give NaN, so once one tensor holds an inf or
a NaN, everything computed from it may too.  Looking at the model after the fact shows the spread; the *source*
is the first tensor, in execution order, that is non-finite while everything it was computed from was finite.

``localize_nonfinite`` runs one step (a callable doing forward and backward) under hooks that test every tensor as
it is produced and keep the first hit:

    phase     role          tensor                                     hook
    forward   input         a tensor argument entering a module        forward pre-hook
              parameter     a parameter of the module (recurse=False)  forward pre-hook
              output        what the module returned                   forward hook
    loss      loss          the value ``run_step`` returns             after ``run_step``
    backward  grad_output   dL/d(output) of a module                   tensor hook on the output
              grad_input    dL/d(input): what the module's backward    tensor hook on the input
                            produced for its input
              grad_<name>   dL/d(parameter), e.g. grad_weight          tensor hook on the parameter

Forward hooks of a module run after those of its submodules, so the *innermost* module that produced a value is
named.  A non-root module receiving a non-finite input that no hooked module returned got it from functional code
in an enclosing module's forward (``torch.exp`` between two layers); the hit says so in ``detail``.  In backward a
gradient that is both a module's ``grad_input`` and the previous module's ``grad_output`` (a ``Sequential``) is
attributed to the consumer that computed it (``grad_input``).  Forward hits precede the loss, which precedes the
backward hits, so ``run_step`` should run one forward and one backward.

Nothing a hook does changes a value (no hook returns anything), so the replayed step computes the same bits as an
unhooked one.  Cost: one ``isfinite`` reduction and host sync per tensor while hooks are installed, and nothing
at all otherwise; the runner therefore checks only the loss and the gradient norm every step, and replays a step
under these hooks when one of them is non-finite (see ``docs/debugging.md``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch import nn

Phase = Literal["forward", "loss", "backward"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Localization:
    """Where the first non-finite value of a step came from, and what it looked like."""

    module: str
    """Qualified module name ("" is the model itself: its input, or a loss computed outside every module)."""
    module_type: str
    """The module's class name ("" for the loss)."""
    role: str
    """"input", "parameter", "output", "loss", "grad_output", "grad_input" or "grad_<parameter name>"."""
    tensor: str
    """Which tensor of the role: "args[0]", "output", "output[1]", a parameter name, "loss"."""
    phase: Phase
    """"forward", "loss" or "backward"."""
    step: int | None
    """The step as the caller numbers it (the runner: the 1-based step whose loss is logged)."""
    shape: tuple[int, ...]
    dtype: str
    numel: int
    nan: int
    """Number of NaN elements."""
    posinf: int
    neginf: int
    finite_amax: float | None
    """Largest finite magnitude (None when no element is finite)."""
    first_index: tuple[int, ...]
    """Index of the first non-finite element (row-major order)."""
    detail: str = ""
    """Extra context, e.g. which enclosing module's code produced a non-finite input."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict (tuples as lists), e.g. for a run store event payload."""
        d = dataclasses.asdict(self)
        d["shape"], d["first_index"] = list(self.shape), list(self.first_index)
        return d

    def describe(self) -> str:
        """One line: role, module, step, shape and the value summary."""
        return describe_payload(self.to_dict())


def describe_payload(p: dict[str, Any]) -> str:
    """``Localization.describe`` of a ``to_dict`` payload (as stored in a "nonfinite" event)."""
    where = "the loss" if p["role"] == "loss" else (
        "the model's input" if p["role"] == "input" and not p["module"] else
        f"{p['role']} of module {p['module'] or '<model>'!r} ({p['module_type']})")
    step = "" if p.get("step") is None else f" at step {p['step']}"
    step += "" if p.get("rank") is None else f" on rank {p['rank']}"  # a data-parallel run's replay
    amax = "none" if p.get("finite_amax") is None else f"{p['finite_amax']:.4g}"
    text = (f"{where}{step}: shape {list(p['shape'])} {p['dtype']}, {p['nan']} NaN, {p['posinf']} +inf, "
            f"{p['neginf']} -inf, finite amax {amax}, first at index {tuple(p['first_index'])}")
    return text + (f" ({p['detail']})" if p.get("detail") else "")


def nonfinite_summary(t: torch.Tensor) -> dict[str, Any] | None:
    """None when every element of ``t`` is finite (or ``t`` is not floating point); else the counts of NaN, +inf
    and -inf, the largest finite magnitude and the first non-finite index (row-major), as ``Localization``
    fields."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return None
    t = t.detach()
    bad = ~torch.isfinite(t)
    if not bool(bad.any()):
        return None
    finite = t[~bad]
    return {
        "shape": tuple(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "numel": t.numel(),
        "nan": int(torch.isnan(t).sum()), "posinf": int(torch.isposinf(t).sum()),
        "neginf": int(torch.isneginf(t).sum()),
        "finite_amax": float(finite.abs().max()) if finite.numel() else None,
        "first_index": tuple(int(i) for i in torch.nonzero(bad)[0].tolist()) if t.dim() else (),
    }


def _tensors(obj: Any, label: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(label, tensor) for every tensor in nested tuples/lists/dicts."""
    if isinstance(obj, torch.Tensor):
        yield label, obj
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{label}[{i}]")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{label}[{k!r}]")


class _Localizer:
    """The hooks of ``localize_nonfinite`` and the first hit of each phase."""

    def __init__(self, model: nn.Module, step: int | None) -> None:
        self.step = step
        self.names = {id(m): n for n, m in model.named_modules()}
        self.root = model
        self.hits: dict[str, Localization] = {}
        self.stack: list[nn.Module] = []
        self.checked_params: set[int] = set()
        # id(tensor) -> (tensor, [(module, role, label)]): one grad hook per tensor, every role it plays
        self.grad_roles: dict[int, tuple[torch.Tensor, list[tuple[nn.Module, str, str]]]] = {}
        self.handles: list[Any] = []
        for m in model.modules():
            self.handles.append(m.register_forward_pre_hook(self._pre))
            self.handles.append(m.register_forward_hook(self._post))
        owners = {id(p): (m, n) for m in model.modules() for n, p in m.named_parameters(recurse=False)}
        for p in model.parameters():
            if p.requires_grad:
                m, n = owners[id(p)]
                self.handles.append(p.register_hook(functools.partial(self._param_grad, m, n)))

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles, self.grad_roles = [], {}

    def _hit(self, phase: Phase, module: nn.Module | None, role: str, label: str, summary: dict[str, Any],
             detail: str = "") -> None:
        self.hits[phase] = Localization(
            module=self.names.get(id(module), "") if module is not None else "",
            module_type=type(module).__name__ if module is not None else "", role=role, tensor=label,
            phase=phase, step=self.step, detail=detail, **summary)

    # -- forward ---------------------------------------------------------------------------------------------
    def _pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if "forward" not in self.hits:
            for label, t in _tensors(args, "args"):
                s = nonfinite_summary(t)
                if s is not None:
                    outer = self.stack[-1] if self.stack else None
                    detail = ("" if outer is None else
                              f"no hooked module returned it: produced by code in the forward of "
                              f"{self.names.get(id(outer), '') or '<model>'!r} ({type(outer).__name__})")
                    self._hit("forward", module, "input", label, s, detail)
                    break
        if "forward" not in self.hits and id(module) not in self.checked_params:
            self.checked_params.add(id(module))
            for name, p in module.named_parameters(recurse=False):
                s = nonfinite_summary(p)
                if s is not None:
                    self._hit("forward", module, "parameter", name, s, "non-finite before the step ran")
                    break
        self.stack.append(module)

    def _post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self.stack and self.stack[-1] is module:
            self.stack.pop()
        if "forward" not in self.hits:
            for label, t in _tensors(output, "output"):
                s = nonfinite_summary(t)
                if s is not None:
                    self._hit("forward", module, "output", label, s)
                    break
        if torch.is_grad_enabled() and "backward" not in self.hits:
            for label, t in _tensors(args, "args"):
                self._watch_grad(t, module, "grad_input", label)
            for label, t in _tensors(output, "output"):
                self._watch_grad(t, module, "grad_output", label)

    # -- backward --------------------------------------------------------------------------------------------
    def _watch_grad(self, t: torch.Tensor, module: nn.Module, role: str, label: str) -> None:
        if not (t.requires_grad and t.is_floating_point()):
            return
        key = id(t)
        if key not in self.grad_roles:
            self.grad_roles[key] = (t, [])
            self.handles.append(t.register_hook(functools.partial(self._tensor_grad, key)))
        self.grad_roles[key][1].append((module, role, label))

    def _tensor_grad(self, key: int, grad: torch.Tensor) -> None:
        if "backward" in self.hits or key not in self.grad_roles:
            return
        s = nonfinite_summary(grad)
        if s is None:
            return
        roles = self.grad_roles[key][1]
        # the consumer that computed dL/dx (grad_input, innermost first) before the producer that receives it
        module, role, label = next((r for r in roles if r[1] == "grad_input"), roles[0])
        self._hit("backward", module, role, label, s)

    def _param_grad(self, module: nn.Module, name: str, grad: torch.Tensor) -> None:
        if "backward" not in self.hits:
            s = nonfinite_summary(grad)
            if s is not None:
                self._hit("backward", module, f"grad_{name}", name, s)


def localize_nonfinite(model: nn.Module, run_step: Callable[[], torch.Tensor | None], *,
                       step: int | None = None) -> Localization | None:
    """Run ``run_step()`` (one forward and backward of ``model``) under hooks on every module and parameter, and
    return the first non-finite tensor in execution order, or None when every tensor stayed finite.

    ``run_step`` returns the loss (a tensor; it is checked between the forward and the backward hits) or None.
    The hooks change no value, so to localise a failure seen in training, restore the state of the start of the
    failing step (parameters, buffers, random generator) and pass a ``run_step`` that computes that step again;
    ``step`` is only recorded.  Hooks are removed before returning, also when ``run_step`` raises.

    Example::

        loc = localize_nonfinite(model, lambda: (l := loss_fn(model(x), y)).backward() or l, step=7)
        if loc is not None:
            print(loc.describe())   # e.g. "output of module 'layers.1' (EmulatedLinear) at step 7: ..."
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if not callable(run_step):
        raise ValueError("run_step must be a callable running one forward and backward (and returning the loss)")
    loc = _Localizer(model, step)
    try:
        loss = run_step()
    finally:
        loc.close()
    if "forward" in loc.hits:
        return loc.hits["forward"]
    if isinstance(loss, torch.Tensor) and (s := nonfinite_summary(loss)) is not None:
        return Localization(module="", module_type="", role="loss", tensor="loss", phase="loss", step=step,
                            detail="every module output was finite: the loss function produced it", **s)
    return loc.hits.get("backward")
