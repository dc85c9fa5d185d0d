"""Reliability at scale (issue 19): injected faults, the rerun diagnosis, spike detection, the skip ledger and exact
tensor digests; ``lowprec run`` uses them through ``[reliability]`` and ``[[faults]]`` (docs/debugging.md).

* ``Fault`` / ``FaultInjector``: bit flips (or stuck bits) in a chosen weight, gradient or activation, on a chosen
  rank and step, transient or persistent, each application recorded as an ``Injection``; ``alter_bit`` is the
  primitive.
* ``ReliabilityConfig``: the ``[reliability]`` table (checks and policies).
* ``diagnose`` / ``Computation`` / ``Diagnosis``: transient, persistent or reproducible, from the computations of a
  rejected step (original, rerun, swapped shards).
* ``SpikeDetector``: the judge's robust rule or Megatron-LM's early maximum, online.
* ``SkipLedger``: batches a rollback skips, steps whose update was skipped.
* ``digest`` / ``ModuleFingerprints``: exact positional digests of tensor bits, per module output.

Reduction error at scale is ``lowprec.distributed.simulate_reduction``.  Importing this package needs no torch;
the torch-based names load on first use.
"""

import typing as _typing

from .. import _lazy
from ._config import ReliabilityConfig as ReliabilityConfig
from ._fault import Fault as Fault
from ._ledger import SkipLedger as SkipLedger

if _typing.TYPE_CHECKING:
    from ._diagnose import Computation as Computation
    from ._diagnose import Diagnosis as Diagnosis
    from ._diagnose import diagnose as diagnose
    from ._digest import ModuleFingerprints as ModuleFingerprints
    from ._digest import digest as digest
    from ._faults import FaultInjector as FaultInjector
    from ._faults import Injection as Injection
    from ._faults import alter_bit as alter_bit
    from ._spike import SpikeDetector as SpikeDetector

__all__ = ["Computation", "Diagnosis", "Fault", "FaultInjector", "Injection", "ModuleFingerprints",
           "ReliabilityConfig", "SkipLedger", "SpikeDetector", "alter_bit", "diagnose", "digest"]

_TORCH_ATTRS: _lazy.LazyTable = {
    "Computation": ("._diagnose", "Computation"),
    "Diagnosis": ("._diagnose", "Diagnosis"),
    "diagnose": ("._diagnose", "diagnose"),
    "ModuleFingerprints": ("._digest", "ModuleFingerprints"),
    "digest": ("._digest", "digest"),
    "FaultInjector": ("._faults", "FaultInjector"),
    "Injection": ("._faults", "Injection"),
    "alter_bit": ("._faults", "alter_bit"),
    "SpikeDetector": ("._spike", "SpikeDetector"),
}

if not _typing.TYPE_CHECKING:
    __getattr__, __dir__ = _lazy.attach(__name__, _TORCH_ATTRS, globals())
