"""The fault-injection matrix of issue 19 (docs/debugging.md "Detection matrix"): every scenario, the fault it
injects into a real torchrun run and what the checks must report.  Shared by the torchrun worker
(``_dist_reliability_worker.py``), its test (``test_dist_reliability.py``) and the docs table.

Every scenario trains mlp-digits (10 steps, data parallel) with every check on every step (fingerprints, sampled
replays, reduced-gradient and weight checksums) and stops at a persistent fault, so the first "rerun" or "sdc"
event is the detection.  Transient faults are attributed from what the rerun changed, at any world size;
persistent ones by a vote among the ranks that computed the same shard, which needs three ranks (``world = 3``)
unless the fault is gross enough that the faulty rank's result is the non-finite or larger one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

REASONS = {"N": "nonfinite", "G": "gradients disagree", "R": "sampled replay", "C": "weights differ"}
"""What rejects or examines the step: a non-finite loss or gradient norm, the replicas' reduced-gradient
checksums, the sampled replay; or, after the step, the replicas' weight checksums (an "sdc" event)."""


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    reason: str
    """The check that finds it (a ``REASONS`` value)."""
    world: int
    fault: dict[str, Any]
    verdict: str
    tensor: str
    strategy: str = "ddp"
    mesh: tuple[int, int] | None = None
    """HSDP's (replicas, shards)."""
    blamed: tuple[int, ...] = ()
    """The ranks the alarm must name, when not the faulty rank alone (a weight checksum tie of two replicas)."""

    @property
    def rank(self) -> int:
        return int(self.fault["rank"])

    @property
    def ranks(self) -> list[int]:
        return list(self.blamed or (self.rank,))

    @property
    def layout(self) -> str:
        return self.strategy.upper() + (f" {self.mesh[0]}x{self.mesh[1]}" if self.mesh else "")

    @property
    def step(self) -> int:
        return int(self.fault["step"])


def _s(name: str, reason: str, world: int, target: str, tensor: str, rank: int, step: int, bit: int, *,
       persistent: bool = False, index: int = 5, verdict: str | None = None, expect: str | None = None,
       strategy: str = "ddp", mesh: tuple[int, int] | None = None, blamed: tuple[int, ...] = ()) -> Scenario:
    fault = {"target": target, "tensor": tensor, "rank": rank, "step": step, "bit": bit, "index": index,
             "persistent": persistent}
    verdict = verdict or ("sdc" if reason == "C" else "persistent" if persistent or target == "weight"
                          else "transient")
    return Scenario(name, REASONS[reason], world, fault, verdict,
                    expect or (tensor if reason == "C" else f"{target}:{tensor}"), strategy, mesh, blamed)


SCENARIOS = (
    # two ranks: transient faults (attributed by what the rerun changed) and gross persistent ones
    _s("grad-exp-r0", 'N', 2, "grad", "head.weight", 0, 3, 30),
    _s("grad-exp-r1", 'N', 2, "grad", "head.weight", 1, 5, 30),
    _s("grad-exp-l0-r1", 'G', 2, "grad", "layers.0.weight", 1, 7, 30, index=200),
    _s("grad-mantissa-r0", 'G', 2, "grad", "layers.1.bias", 0, 4, 2),
    _s("act-mantissa-r0", 'R', 2, "activation", "layers.0", 0, 4, 3, index=40),
    _s("act-mantissa-head-r1", 'R', 2, "activation", "head", 1, 6, 10, index=3),
    _s("act-exp-r0", 'N', 2, "activation", "layers.0", 0, 5, 30, index=11),
    _s("act-sign-r1", 'R', 2, "activation", "layers.1", 1, 2, 31, index=64),
    _s("grad-exp-persistent-r0", 'N', 2, "grad", "head.weight", 0, 4, 30, persistent=True),
    _s("grad-exp-persistent-r1", 'N', 2, "grad", "layers.0.bias", 1, 2, 30, persistent=True),
    _s("fsdp2-act-mantissa-r1", 'R', 2, "activation", "layers.1", 1, 4, 4, index=9, strategy="fsdp2"),
    # three ranks: persistent faults and corrupted memory, attributed by majority
    _s("weight-mantissa-r2", 'R', 3, "weight", "layers.0.weight", 2, 4, 5, index=100),
    _s("weight-exp-r1", 'N', 3, "weight", "head.bias", 1, 6, 30, index=2),
    _s("weight-mantissa-r0", 'R', 3, "weight", "layers.1.weight", 0, 3, 2, index=321),
    _s("grad-mantissa-persistent-r1", 'G', 3, "grad", "layers.1.weight", 1, 5, 6, persistent=True),
    _s("act-mantissa-persistent-r0", 'R', 3, "activation", "layers.1", 0, 3, 8, persistent=True, index=21),
    _s("act-mantissa-persistent-r2", 'R', 3, "activation", "layers.0", 2, 6, 14, persistent=True, index=77),
    _s("grad-mantissa-r2", 'G', 3, "grad", "head.bias", 2, 2, 1, index=4),
    _s("act-mantissa-head-r1-w3", 'R', 3, "activation", "head", 1, 7, 12, index=8),
    _s("grad-exp-r2", 'N', 3, "grad", "layers.1.weight", 2, 3, 30, index=1000),
    _s("act-exp-r0-w3", 'N', 3, "activation", "layers.1", 0, 2, 30, index=17),
    _s("weight-stuck-r2", 'R', 3, "weight", "layers.1.bias", 2, 5, 22, persistent=True, index=7),
    # the weight checksums alone (no replay, no gradient check: the step itself is not rejected)
    _s("checksum-weight-r1", 'C', 3, "weight", "layers.0.weight", 1, 3, 5, index=100),
    _s("checksum-weight-tie-r0", 'C', 2, "weight", "head.weight", 0, 4, 9, index=30, blamed=(0, 1)),
    # HSDP: replicas of each shard across the mesh's replicate dimension must agree
    _s("hsdp-checksum-weight-r2", 'C', 3, "weight", "layers.1.weight", 2, 4, 3, index=77, strategy="hsdp",
       mesh=(3, 1)),
    _s("hsdp-grad-mantissa-r0", 'G', 3, "grad", "layers.0.weight", 0, 3, 6, index=500, strategy="hsdp", mesh=(3, 1)),
    _s("hsdp-grad-persistent-r1", 'G', 3, "grad", "head.weight", 1, 5, 4, persistent=True, strategy="hsdp",
       mesh=(3, 1)),
    _s("hsdp4-checksum-weight-r1", 'C', 4, "weight", "layers.0.weight", 1, 3, 7, index=1234, strategy="hsdp",
       mesh=(2, 2), blamed=(1, 3)),
    _s("hsdp4-grad-mantissa-r3", 'G', 4, "grad", "layers.1.weight", 3, 2, 5, index=99, strategy="hsdp",
       mesh=(2, 2)),
    _s("hsdp4-act-mantissa-r2", 'R', 4, "activation", "layers.0", 2, 4, 6, index=13, strategy="hsdp",
       mesh=(2, 2)),
)
CHECKSUM_ONLY = "weights differ"
"""Scenarios of this reason run with the weight checksums alone (``replay_every`` and ``grad_check_every`` 0)."""

CLEAN_TASKS: dict[str, tuple[str, dict[str, object]]] = {
    "mlp-digits": ("mlp-digits", {}),
    "cnn-digits": ("cnn-digits", {}),
    "gpt-bytes": ("gpt-bytes", {}),
    "synthetic-regression": ("synthetic-regression", {}),
    "hf-llama": ("hf-causal-lm", {"family": "llama"}),
    "hf-mixtral": ("hf-causal-lm", {"family": "mixtral"}),
}
"""Every zoo task (hf-causal-lm as a dense and a mixture-of-experts family), by name: (model, model_options),
trained clean with every check on every step: not one alarm may be raised."""


def markdown_table() -> str:
    """The docs' detection table: each scenario's fault and what the checks reported (asserted by
    test_dist_reliability.py, so the table is what real runs measured)."""
    head = ("| # | ranks | layout | fault (target, tensor, element, bit) | on rank | step | kind | found by | verdict "
            "| attributed to |\n|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for i, s in enumerate(SCENARIOS, 1):
        f = s.fault
        kind = "persistent" if f["persistent"] else "transient"
        rows.append(f"| {i} | {s.world} | {s.layout} | {f['target']} `{f['tensor']}`[{f['index']}] bit "
                    f"{f['bit']} | {s.rank} | {s.step} | {kind} | {s.reason} | {s.verdict} | "
                    f"rank{'s' if len(s.ranks) > 1 else ''} {', '.join(map(str, s.ranks))}, step {s.step}, "
                    f"`{s.tensor}` |")
    return "\n".join([head, *rows])
