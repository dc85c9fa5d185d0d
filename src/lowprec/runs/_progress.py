"""A dependency-free progress bar on stderr: redrawn in place on a terminal, a line every 10% otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``update(step, **values)`` after each step; ``close()`` at the end."""

    def __init__(self, label: str, total: int, *, start: int = 0, enabled: bool = True,
                 stream: TextIO | None = None) -> None:
        self.label, self.total, self.start = label, total, start
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = self.enabled and self.stream.isatty()
        self.t0 = time.perf_counter()
        self._next_line = start + max(1, total // 10)
        self._last_draw = 0.0

    def update(self, step: int, **values: float) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty and (now - self._last_draw >= 0.1 or step == self.total):
            self._last_draw = now
            self.stream.write("\r" + self._line(step, now, values) + "\x1b[K")
            self.stream.flush()
        elif not self.tty and (step >= self._next_line or step == self.total):
            self._next_line = step + max(1, self.total // 10)
            self.stream.write(self._line(step, now, values) + "\n")
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
