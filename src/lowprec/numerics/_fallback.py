"""Automatic per-layer precision fallback: watch the sampled statistics, move a failing layer up.

A low-precision recipe usually fails in a few layers, not everywhere: the layer whose inputs are tiny (values
below the format's smallest subnormal quantize to zero, ``underflow_pct``), whose gradients span more binades than
the format has (underflow and saturation), or whose tensors simply lose too much signal (``sqnr_db``; each
mantissa bit is worth about 6 dB).  Moving just those layers to a wider format keeps most of the speed and memory
of the recipe; moving everything throws it away.

``FallbackController`` applies a ``lowprec.recipes.Fallback`` policy to the statistics ``StatsObserver`` samples.
For every (layer, tensor role, statistic) it counts *consecutive* sampled steps on which the statistic crosses its
threshold (``underflow_pct > t``, ``overflow_pct > t``, ``sqnr_db < t``; a NaN statistic does not cross); when a
count reaches ``patience`` the layer's ``LinearRecipe`` is replaced by ``policy.target()`` for the rest of the run.
Consecutive samples, not one, because a single step can be an outlier (a rare batch); the price is latency: a layer
falls back ``patience`` samples, i.e. about ``patience * every`` steps, after it started failing.

The swap keeps the module object, its ``Parameter`` objects and every buffer it had (a buffer the new recipe does
not use stays, unused), and adds the buffers the new recipe needs (amax histories, the stochastic-rounding step
counter), so optimizers keep working.  A checkpoint therefore must carry the decisions: ``state_dict`` holds them
with the consecutive counts, and ``load_state_dict`` re-applies the swaps *before* the model's state dict is loaded,
so a resumed run has the same modules, the same buffers and the same counts, and continues bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torch import nn

from .._errors import UsageError
from .._layer_stats import parse_stat_key
from ..nn import EmulatedLinear
from ..recipes import Fallback
from ._observer import ROLES, role_spec
from ._tensor_stats import spec_name

WATCHED: tuple[str, ...] = ("underflow_pct", "overflow_pct", "sqnr_db")
"""The statistics a ``Fallback`` policy can watch, in the order ties are reported."""


def _crosses(stat: str, value: float, threshold: float) -> bool:
    if math.isnan(value):
        return False
    return value < threshold if stat == "sqnr_db" else value > threshold


class FallbackController:
    """Apply a ``Fallback`` policy to the ``EmulatedLinear`` layers of ``model`` from sampled statistics.

    Usage (what ``lowprec run`` does when the recipe has a ``fallback``)::

        ctl = FallbackController(model, recipe.fallback, seed=recipe.seed)
        obs = StatsObserver(model, every=50)
        for step in range(steps):
            obs.step(step); train_one_step(step)
            for s, stats in obs.pop_scalars().items():
                for event in ctl.update(s, stats):    # layers swapped in place; event payloads returned
                    print(event)
    """

    def __init__(self, model: nn.Module, policy: Fallback, *, seed: int = 0) -> None:
        if not isinstance(policy, Fallback):
            raise UsageError(f"policy must be a lowprec.recipes.Fallback; got {type(policy).__name__}")
        self.policy = policy
        self.seed = seed
        self.target = policy.target()
        self.layers = {name or m.lowprec_name or "linear": m for name, m in model.named_modules()
                       if isinstance(m, EmulatedLinear)}
        if not self.layers:
            raise UsageError("the model has no EmulatedLinear layers; convert it first with lowprec.convert")
        self.thresholds = {s: getattr(policy, s) for s in WATCHED if getattr(policy, s) is not None}
        self.streaks: dict[tuple[str, str, str], list[int]] = {}
        """(module, role, statistic) -> the steps of the current run of crossing samples."""
        self.decisions: dict[str, int] = {}
        """module -> step of the sample that made it fall back."""

    def update(self, step: int, scalars: Mapping[str, float]) -> list[dict[str, Any]]:
        """Feed the statistics of one sampled step (keys ``stats/<module>/<role>/<stat>`` as
        ``StatsObserver.pop_scalars`` gives them; what-if keys are ignored).  Layers that reach ``patience`` are
        swapped now; returns one "fallback" event payload per swapped layer."""
        seen: dict[tuple[str, str, str], float] = {}
        for key, value in scalars.items():
            parsed = parse_stat_key(key)
            if parsed is None:
                continue
            module, role, stat, what_if = parsed
            if what_if is not None or stat not in self.thresholds:
                continue
            if module in self.decisions or module not in self.layers:
                continue
            seen[(module, role, stat)] = float(value)
        due: dict[str, tuple[str, str, float]] = {}
        order = {r: i for i, r in enumerate(ROLES)}
        for k in sorted(seen, key=lambda k: (k[0], order.get(k[1], len(order)), WATCHED.index(k[2]))):
            module, role, stat = k
            if _crosses(stat, seen[k], self.thresholds[stat]):
                self.streaks.setdefault(k, []).append(step)
                if len(self.streaks[k]) >= self.policy.patience and module not in due:
                    due[module] = (role, stat, seen[k])
            else:
                self.streaks.pop(k, None)
        return [self._fall_back(module, step, *why) for module, why in due.items()]

    def _fall_back(self, module: str, step: int, role: str, stat: str, value: float) -> dict[str, Any]:
        layer = self.layers[module]
        old = layer.recipe
        samples = self.streaks[(module, role, stat)][-self.policy.patience:]
        self._swap(module)
        self.decisions[module] = step
        self.streaks = {k: v for k, v in self.streaks.items() if k[0] != module}
        return {"module": module, "role": role, "statistic": stat, "value": value,
                "threshold": self.thresholds[stat], "patience": self.policy.patience, "sampled_steps": samples,
                "from_spec": spec_name(role_spec(old, role)), "to_spec": spec_name(role_spec(self.target, role)),
                "to": self.policy.to if isinstance(self.policy.to, str) else "custom LinearRecipe", "step": step}

    def _swap(self, module: str) -> None:
        layer = self.layers[module]
        layer._setup(self.target, self.seed, layer.lowprec_name)  # keeps Parameters and existing buffers

    def apply(self, decisions: Mapping[str, int]) -> None:
        """Swap the layers of ``decisions`` (module -> step of the deciding sample) that have not fallen back yet:
        decisions taken elsewhere, by the process whose statistics are watched (a data-parallel run's rank 0,
        whose choices every replica must follow) or by the run a checkpoint was saved from.  ValueError when a
        layer is not in the model."""
        for module, step in decisions.items():
            if module not in self.layers:
                raise UsageError(f"fallback state names layer {module!r}, which the model does not have")
            if module not in self.decisions:
                self._swap(module)
                self.decisions[module] = int(step)

    # -- checkpoints -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The decisions and the running counts (plain lists, ``torch.load(weights_only=True)``-safe)."""
        return {"decisions": [[m, s] for m, s in self.decisions.items()],
                "streaks": [[m, r, st, list(v)] for (m, r, st), v in self.streaks.items()]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Re-apply the saved decisions (swap those layers now: call this before loading the model's state dict)
        and restore the counts.  ValueError when a saved layer is not in the model."""
        self.apply(dict(state.get("decisions", [])))
        self.streaks = {(m, r, st): [int(x) for x in v] for m, r, st, v in state.get("streaks", [])}
