"""``StatsObserver``: quantization statistics of every tensor an ``EmulatedLinear`` touches, on sampled steps.

Per converted linear layer ``y = x @ W^T`` and sampled step, six tensors are observed (2-D, reduction dim last,
as ``EmulatedLinear`` quantizes them; see ``lowprec.nn._linear``):

    role          tensor                          spec it is measured against (the recipe's)
    input         x            [B,K]              forward.a.spec
    weight        W            [N,K]              forward.b.spec
    output        y            [B,N]              forward.output_format (None: float32)
    grad_output   dL/dy        [B,N]              grad_input.a.spec (dY in dx = dY @ W, reduction dim N last)
    grad_input    dL/dx        [B,K]              grad_input.output_format
    grad_weight   dL/dW        [N,K]              grad_weight.output_format

plus, for the GEMM operands (input, weight, grad_output), any ``what_if`` specs: "how would this tensor fare in
mxfp4?" without training in mxfp4.  The statistics are ``tensor_stats``' (SQNR, under/overflow, dynamic range,
scales).  Two approximations, both on purpose: delayed-scaling operands are measured with current scaling (the
amax history is the module's state, not the tensor's), and stochastic-rounding operands with seed 0.

How it observes without touching training: a forward hook per module reads ``x``, ``W`` and ``y`` and, on
sampled steps only, registers a hook on ``y``'s autograd node (``_LinearFn``'s backward), which receives that
GEMM's ``dL/dy`` and the gradients it returns, ``dL/dx`` and ``dL/dW`` (this module's contribution, before any
accumulation into ``.grad``).  No hook returns a value and nothing is modified in place, so losses and
parameters are bitwise those of a run without the observer; no random state is drawn.  ``nn.Module``'s full
backward hooks are deliberately not used: they wrap inputs and outputs in extra autograd nodes on every step and
warn on a first layer, whose input needs no gradient.  On steps that are not sampled the cost is one Python call
per layer and forward.

Memory: a record is held only until ``pop_scalars`` returns it (the runner drains the observer after every step
and writes the values to the run store, where ``records_from_scalars`` reads them back), so a run of any length
holds at most the records of the steps since the last ``pop_scalars``: about 0.7 KiB per record, and a sampled
step makes ``layers x (6 + 3 x len(what_if))`` records (minus a first layer's ``grad_input``).
``keep_history=True`` keeps every record for ``records()`` and ``scalars()`` after popping, and grows by that
much per sampled step for the whole run (1.25 KiB per step for a 3-layer MLP at ``every = 10``: 1.2 GiB per
million steps); it is meant for short interactive runs, not for ``lowprec run``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .._errors import UsageError
from .._layer_stats import LayerStat as LayerStat
from .._layer_stats import records_from_scalars as records_from_scalars
from .._layer_stats import stat_key
from .._layer_stats import worst_layers as worst_layers
from ..nn import EmulatedLinear
from ..quant import QuantSpec
from ..recipes import LinearRecipe
from ._tensor_stats import resolve_spec, spec_name, tensor_stats

ROLES: tuple[str, ...] = ("input", "weight", "output", "grad_output", "grad_input", "grad_weight")
"""The observed tensors of a linear layer, in the order they appear in a training step."""
OPERAND_ROLES: tuple[str, ...] = ("input", "weight", "grad_output")
"""The roles that are GEMM operands: the ones ``what_if`` specs are applied to."""


def _format_spec(fmt: str | None) -> QuantSpec | None:
    return None if fmt is None else QuantSpec(elem=fmt, scaling="none")


def role_spec(recipe: LinearRecipe, role: str) -> QuantSpec | None:
    """The spec ``recipe`` quantizes tensor ``role`` with (see the module docstring's table)."""
    specs = {
        "input": lambda: recipe.forward.a.spec,
        "weight": lambda: recipe.forward.b.spec,
        "output": lambda: _format_spec(recipe.forward.output_format),
        "grad_output": lambda: recipe.grad_input.a.spec,
        "grad_input": lambda: _format_spec(recipe.grad_input.output_format),
        "grad_weight": lambda: _format_spec(recipe.grad_weight.output_format),
    }
    if role not in specs:
        raise UsageError(f"role must be one of {ROLES}; got {role!r}")
    return specs[role]()


def _check_what_if(what_if: Mapping[str, QuantSpec | str] | None) -> dict[str, QuantSpec]:
    if what_if is None:
        return {}
    if not isinstance(what_if, Mapping):
        raise UsageError(f"what_if must be a dict of name -> QuantSpec or spec name; got {type(what_if).__name__}")
    out: dict[str, QuantSpec] = {}
    for name, spec in what_if.items():
        if not isinstance(name, str) or not name or any(c in name for c in "/@ "):
            raise UsageError(f"what_if names must be non-empty strings without '/', '@' or spaces; got {name!r}")
        try:
            resolved = resolve_spec(spec)
        except ValueError as e:
            raise UsageError(f"what_if[{name!r}]: {e}") from None
        if resolved is None:
            raise UsageError(f"what_if[{name!r}] must be a QuantSpec or a spec name, not None")
        out[name] = resolved
    return out


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the 2-D GEMM operand ``[rows, last dim]`` (a view where possible)."""
    return t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t


class StatsObserver:
    """Record ``tensor_stats`` of every ``EmulatedLinear``'s tensors on every ``every``-th step.

    Usage, in a training loop::

        obs = StatsObserver(model, every=50, what_if={"mxfp4": "mxfp4"})
        for step in range(steps):
            obs.step(step)                # before the forward; samples when step % every == 0
            loss = loss_fn(model(x), y); loss.backward(); opt.step()
            for s, values in obs.pop_scalars().items():
                store.log_scalars(run_id, s, values)
        obs.close()

    Only forward passes with gradients enabled are recorded (evaluation under ``torch.no_grad`` is not), and per
    step the first forward/backward of each layer (later micro-batches of gradient accumulation are skipped).

    Records are released once ``pop_scalars`` has returned them, so memory stays bounded however long the run;
    ``records()`` and ``scalars()`` then refuse (RuntimeError) rather than return a partial history.  Without
    ``pop_scalars`` they return every record, as with ``keep_history=True``, which keeps all records after
    popping too (memory grows with the run: see the module docstring).
    """

    def __init__(self, model: nn.Module, *, every: int = 50,
                 what_if: Mapping[str, QuantSpec | str] | None = None, keep_history: bool = False) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise UsageError(f"every must be a positive int (sample every N-th step); got {every!r}")
        if not isinstance(keep_history, bool):
            raise UsageError(f"keep_history must be a bool; got {keep_history!r}")
        self.every = every
        self.keep_history = keep_history
        """Keep records after ``pop_scalars`` has returned them (for ``records()``/``scalars()``)."""
        self.what_if = _check_what_if(what_if)
        layers = [(name, m) for name, m in model.named_modules() if isinstance(m, EmulatedLinear)]
        if not layers:
            raise UsageError("the model has no EmulatedLinear layers; convert it first with lowprec.convert")
        self._step: int | None = None
        self._records: list[dict[str, Any]] = []
        self._pending = 0  # index into _records of the first record not yet returned by pop_scalars
        self._released = 0  # records returned by pop_scalars and dropped (keep_history=False)
        self._seen: set[tuple[int, str, str]] = set()
        self._handles = [
            m.register_forward_hook(functools.partial(self._on_forward, name or m.lowprec_name or "linear"))
            for name, m in layers
        ]

    # -- the training loop's side ----------------------------------------------------------------------------
    def step(self, step: int) -> None:
        """Announce the step about to run (before its forward); it is sampled when ``step % every == 0``."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise UsageError(f"step must be a non-negative int; got {step!r}")
        self._step = step if step % self.every == 0 else None
        if self._step is not None:
            self._seen = {k for k in self._seen if k[0] == step}  # keep the bookkeeping to one step

    def close(self) -> None:
        """Remove the hooks; the records stay readable.  Backward hooks already registered for a forward pass
        that has not run its backward yet still record it."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._step = None

    def __enter__(self) -> StatsObserver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- hooks -----------------------------------------------------------------------------------------------
    def _on_forward(self, name: str, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        step = self._step
        if step is None or not torch.is_grad_enabled() or (step, name, "input") in self._seen:
            return
        assert isinstance(module, EmulatedLinear)
        self._observe(step, name, module.recipe, "input", _flat(args[0]))
        self._observe(step, name, module.recipe, "weight", module.linear_weight())  # [N, K] (Conv1D: W^T)
        self._observe(step, name, module.recipe, "output", _flat(output))
        if output.grad_fn is not None:
            output.grad_fn.register_hook(functools.partial(self._on_backward, step, name, module.recipe))

    def _on_backward(self, step: int, name: str, recipe: LinearRecipe, grad_inputs: tuple[Any, ...],
                     grad_outputs: tuple[Any, ...]) -> None:
        # _LinearFn.backward: grad_outputs = (dL/dy,), grad_inputs = (dL/dx, dL/dW, dL/db, None)
        tensors = {"grad_output": grad_outputs[0], "grad_input": grad_inputs[0], "grad_weight": grad_inputs[1]}
        for role, t in tensors.items():
            if isinstance(t, torch.Tensor):
                self._observe(step, name, recipe, role, _flat(t))

    def _observe(self, step: int, name: str, recipe: LinearRecipe, role: str, t: torch.Tensor) -> None:
        key = (step, name, role)
        if key in self._seen:
            return
        self._seen.add(key)
        spec = role_spec(recipe, role)
        specs: list[tuple[str, QuantSpec | None, str | None]] = [(spec_name(spec), spec, None)]
        if role in OPERAND_ROLES:
            specs += [(spec_name(s), s, label) for label, s in self.what_if.items()]
        with torch.no_grad():
            for label, s, what_if in specs:
                self._records.append({"step": step, "module": name, "role": role, "spec": label,
                                      "what_if": what_if, "stats": tensor_stats(t, s)})

    # -- results ---------------------------------------------------------------------------------------------
    @property
    def retained(self) -> int:
        """Number of records held in memory now (those not yet popped, plus the popped ones with
        ``keep_history``)."""
        return len(self._records)

    def _history(self, what: str) -> list[dict[str, Any]]:
        if self._released:
            raise RuntimeError(
                f"StatsObserver.{what}: {self._released} records were released after pop_scalars returned them "
                f"(memory stays bounded); pass keep_history=True to keep the whole history in memory, or read it "
                f"back from the run store with records_from_scalars(store.scalars(run_id))")
        return self._records

    def records(self) -> list[dict[str, Any]]:
        """Every record so far: dicts with ``step``, ``module``, ``role``, ``spec`` (the spec's name, "float32"
        for unquantized), ``what_if`` (None for the recipe's own spec, else the what-if name) and ``stats``
        (``tensor_stats``' dict).  RuntimeError once ``pop_scalars`` has released records (without
        ``keep_history``)."""
        return [dict(r, stats=dict(r["stats"])) for r in self._history("records()")]

    def scalars(self) -> dict[int, dict[str, float]]:
        """All records as ``{step: {key: value}}`` for ``RunStore.log_scalars``; keys are
        ``stats/<module>/<role>/<stat>`` for the recipe's spec and ``stats/<module>/<role>@<what_if>/<stat>``
        for a what-if spec (``records_from_scalars`` inverts this).  RuntimeError once ``pop_scalars`` has
        released records (without ``keep_history``)."""
        return _to_scalars(self._history("scalars()"))

    def pop_scalars(self) -> dict[int, dict[str, float]]:
        """``scalars()`` of the records added since the last ``pop_scalars`` (for logging as training goes).
        Without ``keep_history`` the returned records are dropped from memory."""
        new = self._records[self._pending:]
        if self.keep_history:
            self._pending = len(self._records)
        else:
            self._released += len(new)
            self._records, self._pending = [], 0
        return _to_scalars(new)


def _to_scalars(records: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for r in records:
        row = out.setdefault(r["step"], {})
        for stat, v in r["stats"].items():
            row[stat_key(r["module"], r["role"], stat, r["what_if"])] = v
    return out
