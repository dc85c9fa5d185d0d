"""Reliability at scale: injected faults to test detection against (issue 19).

* ``Fault`` / ``FaultInjector``: bit flips (or stuck bits) in a chosen weight, gradient or activation, on a chosen
  rank and step, transient or persistent, each application recorded as an ``Injection``; ``alter_bit`` is the
  primitive.

Detection (replays, spike rollback, cross-replica checks) builds on these; reduction error at scale is
``lowprec.distributed.simulate_reduction``.
"""

from ._faults import Fault as Fault
from ._faults import FaultInjector as FaultInjector
from ._faults import Injection as Injection
from ._faults import alter_bit as alter_bit

__all__ = ["Fault", "FaultInjector", "Injection", "alter_bit"]
