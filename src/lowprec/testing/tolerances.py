"""Every numeric tolerance the test suite uses, in one table, each with where it comes from.

Bit-exact comparisons need no entry: they are the default.  Entries are for comparisons against references that
are not exact by design (statistical tests, SQNR floors of lossy formats).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tolerance:
    """A named acceptance bound."""

    value: float
    """The bound (meaning given by ``unit``)."""
    unit: str
    """"sigma" (standard deviations of a stated null distribution) or "dB" (SQNR floor)."""
    source: str
    """Why this number: its false-failure rate or the reference it is taken from."""


TOLERANCES: dict[str, Tolerance] = {
    "stochastic_sigma": Tolerance(
        value=6.0,
        unit="sigma",
        source="two-sided normal bound on a binomial/mean estimate: false-failure rate 2e-9 per check",
    ),
    "sqnr_fp8_cast": Tolerance(value=25.0, unit="dB", source="torchao float8 cast test floor"),
    "sqnr_mx_fp8": Tolerance(value=18.0, unit="dB", source="torchao MX cast test floor (e4m3)"),
    "sqnr_mx_fp6_fp4": Tolerance(value=13.0, unit="dB", source="torchao MX cast test floor (fp6/fp4)"),
}
