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
                            a parameter used outside its module's      torch function mode (first use of
                            forward (``x + self.pos_embed.weight``)    a parameter not checked yet)
              output        what the module returned                   forward hook
    loss      loss          the value ``run_step`` returns             after ``run_step``
    backward  grad_output   dL/d(output) of a module                   tensor hook on the output
              grad_input    dL/d(input): what the module's backward    tensor hook on the input
                            produced for its input
                            ... as the module's own full backward      a full backward hook of the module,
                            hooks left it                              after the user's (modules with some)
              grad_<name>   dL/d(parameter), e.g. grad_weight          tensor hook on the parameter, and a
                                                                       post-accumulate-grad hook (``.grad``)
              grad_hook     what a ``Tensor.register_hook`` hook       the hook, wrapped when the step
                            registered during the step returned        registers it (torch function mode)

Forward hooks of a module run after those of its submodules, so the *innermost* module that produced a value is
named.  A non-root module receiving a non-finite input that no hooked module returned got it from functional code
in an enclosing module's forward (``torch.exp`` between two layers); the hit says so in ``detail``.  In backward a
gradient that is both a module's ``grad_input`` and the previous module's ``grad_output`` (a ``Sequential``) is
attributed to the consumer that computed it (``grad_input``).  Forward hits precede the loss, which precedes the
backward hits, so ``run_step`` should run one forward and one backward.

Four paths around those hooks are covered too.  A parameter whose module's forward does not run before it is used
(a GPT's position embedding, ``self.pos_embed.weight[:t]`` in the parent's forward) is checked at its first use by
a ``TorchFunctionMode`` active during the forward, and named as that module's ``parameter`` with the enclosing
module in ``detail`` (a non-finite parameter the step never uses is never named).  A module's own full backward
hooks (``register_full_backward_hook``, or global ones) run after the tensor hooks on its inputs and may replace
its ``grad_input``; for modules that have such hooks the localiser adds one of its own, last in line, that checks
what the hooks returned.  A gradient made non-finite after accumulation (a ``post_accumulate_grad`` hook writing
into ``.grad``) is caught by a post-accumulate-grad hook of ours, registered after the user's.  A hook the step
itself registers with ``Tensor.register_hook`` (a parent hooking its child's output) would run after ours on that
tensor, so the mode wraps it: one that receives a finite gradient and returns a non-finite one is named
(``grad_hook``, the module whose forward registered it).  The limits that remain are in ``docs/debugging.md``.

Nothing a hook does changes a value (the localiser's hooks return nothing; a wrapped user hook returns what the
user's returns), so the replayed step computes the same bits as an unhooked one.  Cost: one ``isfinite`` reduction
and host sync per tensor while hooks are installed, plus one Python call per torch function during the step (the
mode: a dictionary lookup per tensor argument until every parameter has been checked once, then one comparison),
and nothing at all otherwise; the runner therefore checks only the loss and
the gradient norm every step, and replays a step under these hooks when one of them is non-finite (see
``docs/debugging.md``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch import nn
from torch.nn.modules import module as _module
from torch.overrides import TorchFunctionMode

from .._errors import UsageError
from .._payloads import describe_payload as describe_payload

Phase = Literal["forward", "loss", "backward"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Localization:
    """Where the first non-finite value of a step came from, and what it looked like."""

    module: str
    """Qualified module name ("" is the model itself: its input, or a loss computed outside every module)."""
    module_type: str
    """The module's class name ("" for the loss)."""
    role: str
    """"input", "parameter", "output", "loss", "grad_output", "grad_input", "grad_<parameter name>" or
    "grad_hook" (a gradient a ``Tensor.register_hook`` hook registered during the step returned non-finite)."""
    tensor: str
    """Which tensor of the role: "args[0]", "output", "output[1]", a parameter name, "loss",
    "Tensor.register_hook"."""
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


def _is_dtensor(t: torch.Tensor) -> bool:
    """A ``torch.distributed.tensor.DTensor`` (FSDP2's sharded parameters), told by its ``placements``."""
    return hasattr(t, "placements") and hasattr(t, "to_local")


class _Localizer:
    """The hooks of ``localize_nonfinite`` and the first hit of each phase."""

    def __init__(self, model: nn.Module, step: int | None) -> None:
        self.step = step
        self.names = {id(m): n for n, m in model.named_modules()}
        self.root = model
        self.hits: dict[str, Localization] = {}
        self.stack: list[nn.Module] = []
        self.checked_params: set[int] = set()
        self.own_hook = False
        # id(tensor) -> (tensor, [(module, role, label)]): one grad hook per tensor, every role it plays
        self.grad_roles: dict[int, tuple[torch.Tensor, list[tuple[nn.Module, str, str]]]] = {}
        self.handles: list[Any] = []
        for m in model.modules():
            self.handles.append(m.register_forward_pre_hook(self._pre))
            self.handles.append(m.register_forward_hook(self._post))
        # the last module listing a (tied) parameter owns it
        self.owners = {id(p): (m, n) for m in model.modules() for n, p in m.named_parameters(recurse=False)}
        self.own_params = {id(m): [id(p) for p in m.parameters(recurse=False)] for m in model.modules()}
        # id(parameter) -> parameter: not checked yet (by its module's pre-hook or at a use elsewhere).  Sharded
        # (DTensor) parameters are left to the pre-hooks, which see them unsharded: FSDP2 all-gathers first, and
        # hands the post-accumulate-grad hooks the reduce-scattered gradient, which holds every rank's
        # contribution (a NaN of another rank's replay) and cannot be summarised without a collective
        local = [p for p in model.parameters() if not _is_dtensor(p)]
        self.unchecked: dict[int, torch.Tensor] = {id(p): p for p in local}
        for p in model.parameters():
            if p.requires_grad:
                m, n = self.owners[id(p)]
                self.handles.append(p.register_hook(functools.partial(self._param_grad, m, n)))
        for p in local:
            if p.requires_grad:
                m, n = self.owners[id(p)]
                self.handles.append(p.register_post_accumulate_grad_hook(
                    functools.partial(self._param_accumulated, m, n)))
        # after every full backward hook of a module (the global ones run first, then the module's own, in the
        # order registered): only where the module has some, so no module gets a backward wrapper it lacked
        self.full_flags: list[tuple[nn.Module, bool | None]] = []
        global_full = bool(getattr(_module, "_global_backward_hooks", None)) and bool(
            getattr(_module, "_global_is_full_backward_hook", None))
        for m in model.modules():
            flag = getattr(m, "_is_full_backward_hook", None)
            if (flag is True and m._backward_hooks) or (global_full and flag is not False):
                self.full_flags.append((m, flag))
                self.handles.append(m.register_full_backward_hook(self._after_backward_hooks))

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        for m, flag in self.full_flags:  # register_full_backward_hook sets it; a module may use either kind later
            m._is_full_backward_hook = flag
        self.handles, self.grad_roles, self.full_flags, self.unchecked = [], {}, [], {}

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
            for key in self.own_params.get(id(module), ()):
                self.unchecked.pop(key, None)
            for name, p in module.named_parameters(recurse=False):
                self.unchecked.pop(id(p), None)
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

    def _param_use(self, values: Any) -> None:
        """The mode's check: the first use of a parameter that no module pre-hook has checked (its module's
        forward has not run, or never runs: the parameter is used by code in another module's forward)."""
        for v in values:
            if isinstance(v, (list, tuple)):
                self._param_use(v)
                continue
            if isinstance(v, dict):
                self._param_use(tuple(v.values()))
                continue
            p = self.unchecked.pop(id(v), None)
            if p is None or "forward" in self.hits:
                continue
            s = nonfinite_summary(p)
            if s is not None:
                module, name = self.owners[id(p)]
                outer = self.stack[-1] if self.stack else None
                where = ("by code outside every module's forward" if outer is None else
                         f"by code in the forward of {self.names.get(id(outer), '') or '<model>'!r} "
                         f"({type(outer).__name__})")
                self._hit("forward", module, "parameter", name, s,
                          f"non-finite before the step ran; used outside its module's forward, {where}")
                return

    # -- backward --------------------------------------------------------------------------------------------
    def _watch_grad(self, t: torch.Tensor, module: nn.Module, role: str, label: str) -> None:
        if not (t.requires_grad and t.is_floating_point()):
            return
        key = id(t)
        if key not in self.grad_roles:
            self.grad_roles[key] = (t, [])
            self.own_hook = True  # not a user's hook: _ParameterUse must not wrap it
            try:
                self.handles.append(t.register_hook(functools.partial(self._tensor_grad, key)))
            finally:
                self.own_hook = False
        self.grad_roles[key][1].append((module, role, label))

    def _wrap_tensor_hook(self, hook: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
        """A user's ``Tensor.register_hook`` hook, registered during the forward, made to report a gradient it
        received finite and returned (or left, when it returns None) non-finite.  It returns what ``hook``
        returns: the gradient is the user's."""
        owner = self.stack[-1] if self.stack else None
        where = ("by code outside every module's forward" if owner is None else
                 f"in the forward of {self.names.get(id(owner), '') or '<model>'!r} ({type(owner).__name__})")

        def checked(grad: torch.Tensor) -> Any:
            out = hook(grad)
            if "backward" not in self.hits and nonfinite_summary(grad) is None:
                s = nonfinite_summary(out if isinstance(out, torch.Tensor) else grad)
                if s is not None:
                    self._hit("backward", owner, "grad_hook", "Tensor.register_hook", s,
                              f"made non-finite by a Tensor.register_hook hook registered {where}: the gradient "
                              f"it received was finite")
            return out

        return checked

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

    def _param_accumulated(self, module: nn.Module, name: str, p: torch.Tensor) -> None:
        if "backward" not in self.hits and p.grad is not None:
            s = nonfinite_summary(p.grad)
            if s is not None:
                self._hit("backward", module, f"grad_{name}", name, s,
                          "non-finite in .grad after accumulation, though the gradient computed in this step was "
                          "finite: a post-accumulate-grad hook, or a .grad from before the step, made it so")

    def _after_backward_hooks(self, module: nn.Module, grad_input: tuple[Any, ...],
                              grad_output: tuple[Any, ...]) -> None:
        # the tensor hooks on the inputs saw these gradients finite (or there would be a hit): the module's own
        # (or global) full backward hooks, which ran before this one, replaced them
        if "backward" in self.hits:
            return
        for i, g in enumerate(grad_input):
            s = nonfinite_summary(g) if isinstance(g, torch.Tensor) else None
            if s is not None:
                self._hit("backward", module, "grad_input", f"args[{i}]", s,
                          "made non-finite by a backward hook of the module (register_full_backward_hook or a "
                          "global module backward hook): the module's backward computed it finite")
                return


class _ParameterUse(TorchFunctionMode):
    """During the forward, hand every torch function's tensor arguments to ``_Localizer._param_use`` (while some
    parameter is unchecked), and wrap the hooks the step registers with ``Tensor.register_hook``
    (``_Localizer._wrap_tensor_hook``); in backward ``_current_graph_task_id`` is set and nothing is done."""

    def __init__(self, loc: _Localizer) -> None:
        super().__init__()
        self.loc = loc

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        loc = self.loc
        if torch._C._current_graph_task_id() == -1:  # not inside a backward pass
            if loc.unchecked and "forward" not in loc.hits:
                loc._param_use(args)
                if kwargs:
                    loc._param_use(tuple(kwargs.values()))
            if func is _REGISTER_HOOK and not loc.own_hook and len(args) == 2 and callable(args[1]):
                args = (args[0], loc._wrap_tensor_hook(args[1]))
        return func(*args, **kwargs)


_REGISTER_HOOK = torch.Tensor.register_hook


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
        raise UsageError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if not callable(run_step):
        raise UsageError("run_step must be a callable running one forward and backward (and returning the loss)")
    loc = _Localizer(model, step)
    try:
        with _ParameterUse(loc):
            loss = run_step()
    finally:
        loc.close()
    if "forward" in loc.hits:
        return loc.hits["forward"]
    if isinstance(loss, torch.Tensor) and (s := nonfinite_summary(loss)) is not None:
        return Localization(module="", module_type="", role="loss", tensor="loss", phase="loss", step=step,
                            detail="every module output was finite: the loss function produced it", **s)
    return loc.hits.get("backward")
