"""Loss scaling: multiply the loss so small gradients survive a narrow format, divide the gradients after.

Dynamic scaling (the fp16 recipe; as torch.amp.GradScaler): if any gradient is inf/NaN the step is skipped and the
scale is multiplied by ``backoff_factor``; after ``growth_interval`` consecutive good steps it is multiplied by
``growth_factor``.  Static scaling keeps the scale fixed but still skips non-finite steps.  Powers of two keep the
scaling itself exact.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..recipes import LossScaling


class LossScaler:
    """State of loss scaling for one optimizer."""

    def __init__(self, config: LossScaling) -> None:
        self.config = config
        self.scale = float(config.init_scale) if config.kind != "none" else 1.0
        self.good_steps = 0
        self.skipped_steps = 0

    @property
    def enabled(self) -> bool:
        return self.config.kind != "none"

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (the loss itself when scaling is off)."""
        return loss * self.scale if self.enabled else loss

    def unscale_and_check(self, params: Iterable[torch.Tensor]) -> bool:
        """Divide gradients by the scale in place; True when every gradient is finite."""
        grads = [p.grad for p in params if p.grad is not None]
        if not self.enabled:
            return True
        inv = 1.0 / self.scale
        if grads and all(type(g) is torch.Tensor and g.device == grads[0].device and g.is_floating_point()
                         for g in grads):
            # One fused pass per gradient, as torch.amp.GradScaler: g *= inv in place, and the non-finite check.
            dev = grads[0].device
            found = torch.zeros(1, dtype=torch.float32, device=dev)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.full((1,), inv, device=dev))
            return not bool(found.item())
        finite = torch.ones((), dtype=torch.bool)  # DTensor shards, mixed devices: one gradient at a time
        for g in grads:
            g.mul_(inv)
            finite &= torch.isfinite(g).all().cpu()
        return bool(finite)

    def update(self, finite: bool) -> None:
        """Record the outcome of a step (dynamic: back off on overflow, grow after a run of good steps)."""
        if not self.enabled:
            return
        if not finite:
            self.skipped_steps += 1
            self.good_steps = 0
            if self.config.kind == "dynamic":
                self.scale *= self.config.backoff_factor
            return
        self.good_steps += 1
        if self.config.kind == "dynamic" and self.good_steps >= self.config.growth_interval:
            self.scale *= self.config.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])
