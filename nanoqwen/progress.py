"""A dependency-free progress bar on stderr for every wait longer than a second (packing, verifying)."""

from __future__ import annotations

import sys
import time

from .units import size


class Progress:
    """``p = Progress(total_bytes, "pack"); p(n)`` per n bytes done; ``p.close()`` prints the final line.
    On a terminal the bar redraws in place at most 10 times a second; elsewhere (logs, CI) a line per 10%."""

    def __init__(self, total: int, label: str, stream=None):
        self.total, self.label = max(int(total), 1), label
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.done, self.t0, self._last, self._last_decile = 0, time.perf_counter(), 0.0, 0

    def __call__(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        decile = 10 * self.done // self.total
        if self.tty and now - self._last >= 0.1:
            self._last = now
            self.stream.write("\r" + self._line(now))
            self.stream.flush()
        elif not self.tty and decile > self._last_decile and self.done < self.total and now - self.t0 > 1:
            self._last_decile = decile
            self.stream.write(self._line(now) + "\n")

    def _line(self, now: float) -> str:
        frac = min(self.done / self.total, 1.0)
        dt = max(now - self.t0, 1e-9)
        rate = self.done / dt
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
        return (f"{self.label} [{bar}] {100 * frac:5.1f}% {size(self.done)}/{size(self.total)} "
                f"{size(rate)}/s {dt:.0f}s elapsed, ETA {eta:.0f}s")

    def close(self) -> None:
        self.stream.write(("\r" if self.tty else "") + self._line(time.perf_counter()) + "\n")
        self.stream.flush()
