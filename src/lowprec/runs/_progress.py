"""A dependency-free progress bar on stderr: redrawn in place on a terminal; otherwise (a log file, CI, a pipe)
one line every 10% of the steps or every ``interval_s`` seconds (30 by default), whichever comes first, so a slow
run still says how far it is."""

from __future__ import annotations

import sys
import time
from typing import TextIO

INTERVAL_S = 30.0
"""Without a terminal, the longest time between two progress lines."""


class Progress:
    """``update(step, **values)`` after each step; ``note(text)`` for a one-off line; ``close()`` at the end.

    Each line has the step (``step/total``), the rate (steps per second since the start), the time left and the
    values (``loss``)."""

    def __init__(self, label: str, total: int, *, start: int = 0, enabled: bool = True,
                 stream: TextIO | None = None, interval_s: float = INTERVAL_S) -> None:
        self.label, self.total, self.start = label, total, start
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = self.enabled and self.stream.isatty()
        self.interval_s = interval_s
        self.t0 = time.perf_counter()
        self._next_line = start + max(1, total // 10)
        self._last_draw = 0.0
        self._last_line = self.t0

    def update(self, step: int, **values: float) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty and (now - self._last_draw >= 0.1 or step == self.total):
            self._last_draw = now
            self.stream.write("\r" + self._line(step, now, values) + "\x1b[K")
            self.stream.flush()
        elif not self.tty and (step >= self._next_line or step == self.total
                               or now - self._last_line >= self.interval_s):
            self._next_line = step + max(1, self.total // 10)
            self._last_line = now
            self.stream.write(self._line(step, now, values) + "\n")
            self.stream.flush()

    def note(self, text: str) -> None:
        """Print ``text`` on a line of its own (on a terminal, above the bar, which the next update redraws)."""
        if not self.enabled:
            return
        self.stream.write(("\r\x1b[K" if self.tty else "") + f"{self.label}: {text}\n")
        self.stream.flush()

    def _line(self, step: int, now: float, values: dict[str, float]) -> str:
        frac = step / max(1, self.total)
        filled = int(20 * frac)
        rate = (step - self.start) / max(1e-9, now - self.t0)
        eta = (self.total - step) / rate if rate > 0 else 0.0
        extras = "  ".join(f"{k} {v:.4g}" for k, v in values.items())
        return (f"{self.label} [{'#' * filled}{'.' * (20 - filled)}] {step}/{self.total} "
                f"{rate:.1f} it/s eta {eta:.0f}s  {extras}")

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
