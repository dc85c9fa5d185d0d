"""``[reliability]``: what a training run checks, and what follows a rejected step.

A step is *rejected* when its global loss or gradient norm is non-finite (and no loss scaler will skip it) or its
loss is a spike (``spike``).  With ``rerun`` (the default) the step is first run again in place, with the same
data and state, and diagnosed (``lowprec.reliability.diagnose``):

* **transient**: the rerun differs from the original (a fault that did not repeat); ``on_transient`` follows:
  "continue" with the rerun's result (default), "skip" the step's update, or "stop" the run;
* **persistent**: the rerun reproduces the original, but another rank computing this rank's batch shard does not:
  the fault follows a rank (its memory or its arithmetic); ``on_persistent``: "stop" (default: Megatron-LM's
  choice, so the job is rescheduled without the faulty device), "rollback" to the last checkpoint (reloads the
  weights: cures corrupted memory, not a faulty unit), "skip", or "continue";
* **reproducible**: another rank reproduces it too, so it is the data or the numerics.  A non-finite step then
  follows ``on_nonfinite``: "stop" (default: the run ends "diverged", with the non-finite value localised),
  "skip" or "rollback"; a spike follows ``on_spike``: "rollback" (default), "skip", "continue" or "stop".

"rollback" reloads the newest checkpoint (``checkpoint.interval`` must be set), records the batches
``[b - skip_before, b + skip_after]`` around the rejected step's batch ``b`` in the skip ledger (in the run store;
it survives restarts), and trains on from the checkpoint without them, as PaLM did for its loss spikes.  At most
``max_rollbacks`` rollbacks per run (then the run stops): a persistent fault would otherwise roll back forever.

Silent-data-corruption checks (data-parallel runs; the runner's side: ``lowprec.runs._reliable``), each every N
steps (0: off): ``checksum_every`` compares every replica's weight digests (DDP; HSDP: the replicas of each
shard), ``grad_check_every`` the reduced gradients' digests (likewise), ``replay_every`` runs a step again and
compares loss, gradient norm and gradient digests (any layout, one process included).  A mismatch is an "sdc"
event naming the ranks and tensors; ``on_sdc`` says whether the run "stop"s (default) or "continue"s.
``fingerprints`` records a digest of every module's output on every step (one extra pass over each activation:
opt-in), so a transient fault is attributed to the module whose
output changed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from .._checks import check_bool, check_float, check_int, check_literal, literal_values
from .._errors import UsageError

SpikeRule = Literal["off", "robust", "early-max"]
TransientPolicy = Literal["continue", "skip", "stop"]
PersistentPolicy = Literal["stop", "rollback", "skip", "continue"]
NonfinitePolicy = Literal["stop", "skip", "rollback"]
SpikePolicy = Literal["rollback", "skip", "continue", "stop"]
SdcPolicy = Literal["stop", "continue"]
DEFAULT_CHECK_EVERY = 100
"""Default interval of the weight and gradient checksums (their measured cost: docs/debugging.md)."""
DEFAULT_REPLAY_EVERY = 500
"""Default interval of the deterministic step replay (one extra forward and backward per interval)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReliabilityConfig:
    """The ``[reliability]`` table (module docstring)."""

    rerun: bool = True
    spike: SpikeRule = "off"
    """Loss-spike rule: "robust" (the judge's), "early-max" (Megatron-LM's), or "off"."""
    spike_factor: float | None = None
    """"robust": how many times the median the loss must exceed (default 1.5, the judge's); "early-max": the
    multiple of the early maximum (default 10, Megatron-LM's)."""
    spike_window: int = 20
    spike_mad: float = 10.0
    spike_samples: int = 100
    """"early-max": the first this many steps set the maximum."""
    on_transient: TransientPolicy = "continue"
    on_persistent: PersistentPolicy = "stop"
    on_nonfinite: NonfinitePolicy = "stop"
    on_spike: SpikePolicy = "rollback"
    skip_before: int = 0
    skip_after: int = 0
    max_rollbacks: int = 5
    checksum_every: int = DEFAULT_CHECK_EVERY
    grad_check_every: int = DEFAULT_CHECK_EVERY
    replay_every: int = DEFAULT_REPLAY_EVERY
    on_sdc: SdcPolicy = "stop"
    fingerprints: bool = False

    def __post_init__(self) -> None:
        check_bool(self.rerun, "reliability.rerun")
        check_literal(self.spike, "reliability.spike", SpikeRule)
        if self.spike_factor is not None:
            check_float(self.spike_factor, "reliability.spike_factor", 1.0, open_lo=True)
        check_int(self.spike_window, "reliability.spike_window", 2)
        check_float(self.spike_mad, "reliability.spike_mad", 0.0)
        check_int(self.spike_samples, "reliability.spike_samples", 1)
        check_literal(self.on_transient, "reliability.on_transient", TransientPolicy)
        check_literal(self.on_persistent, "reliability.on_persistent", PersistentPolicy)
        check_literal(self.on_nonfinite, "reliability.on_nonfinite", NonfinitePolicy)
        check_literal(self.on_spike, "reliability.on_spike", SpikePolicy)
        for f in ("skip_before", "skip_after", "checksum_every", "grad_check_every", "replay_every"):
            check_int(getattr(self, f), f"reliability.{f}", 0)
        check_int(self.max_rollbacks, "reliability.max_rollbacks", 0)
        check_literal(self.on_sdc, "reliability.on_sdc", SdcPolicy)
        check_bool(self.fingerprints, "reliability.fingerprints")

    @property
    def factor(self) -> float:
        """``spike_factor`` or the rule's default."""
        if self.spike_factor is not None:
            return self.spike_factor
        return 10.0 if self.spike == "early-max" else 1.5

    def rolls_back(self) -> bool:
        """Whether some rejected step can roll back (so checkpoints are needed)."""
        return "rollback" in (self.on_persistent, self.on_nonfinite) or (
            self.spike != "off" and self.on_spike == "rollback")

    def to_dict(self) -> dict[str, Any]:
        """The fields that differ from the defaults (an all-default table is ``{}``: a run config without a
        ``[reliability]`` table keeps the data, and the digest, it had before the table existed)."""
        default = ReliabilityConfig()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}


def check_rollback(config: ReliabilityConfig, checkpoint_interval: int) -> None:
    """A policy that rolls back needs checkpoints on an interval: refused before any work otherwise."""
    if config.rolls_back() and not checkpoint_interval:
        which = [f"reliability.{k} = \"rollback\"" for k in ("on_persistent", "on_nonfinite", "on_spike")
                 if getattr(config, k) == "rollback" and (k != "on_spike" or config.spike != "off")]
        raise UsageError(f"{', '.join(which)} rolls back to the last checkpoint, but checkpoint.interval is 0 (only "
                         "the end of the run is saved): set checkpoint.interval = N, or choose \"skip\" / \"stop\"")


POLICIES = {"on_transient": literal_values(TransientPolicy), "on_persistent": literal_values(PersistentPolicy),
            "on_nonfinite": literal_values(NonfinitePolicy), "on_spike": literal_values(SpikePolicy)}
