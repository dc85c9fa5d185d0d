"""``Fault``: one fault to inject, as data (a ``[[faults]]`` table of a run config); no torch here, so a run config
(``lowprec.runs._config``) reads without importing torch.  Its semantics, and the injector: ``_faults``."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from .._checks import check_bool, check_int, check_literal, check_str
from .._errors import UsageError

Target = Literal["weight", "grad", "activation"]
Mode = Literal["flip", "set", "clear"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fault:
    """One injected fault (module docstring)."""

    target: Target
    tensor: str
    """A parameter's qualified name (``"fc1.weight"``) for weight / grad faults, a module's for activations."""
    step: int
    rank: int | None = None
    index: int = 0
    """The element (row-major) of the tensor; of a sharded (FSDP2/HSDP) parameter or gradient, of this rank's local
    shard."""
    bit: int = 30
    mode: Mode = "flip"
    persistent: bool = False

    def __post_init__(self) -> None:
        check_literal(self.target, "Fault.target", Target)
        check_str(self.tensor, "Fault.tensor", empty=self.target == "activation")
        check_int(self.step, "Fault.step", 0)
        if self.rank is not None:
            check_int(self.rank, "Fault.rank", 0)
        check_int(self.index, "Fault.index", 0)
        check_int(self.bit, "Fault.bit", 0, 63)
        check_literal(self.mode, "Fault.mode", Mode)
        check_bool(self.persistent, "Fault.persistent")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Fault:
        """A fault from a config table (``[[faults]]``); unknown keys are a UsageError naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise UsageError(f"[[faults]]: unknown key(s) {unknown}; valid: {', '.join(sorted(names))}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """The ``[[faults]]`` table of this fault (None rank left out: TOML has no null)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def active(self, step: int, rank: int) -> bool:
        """Whether this fault applies at ``step`` on ``rank``."""
        if self.rank is not None and self.rank != rank:
            return False
        return step >= self.step if self.persistent else step == self.step
