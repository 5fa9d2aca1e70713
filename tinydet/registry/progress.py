"""The progress bar of a download, and the one-line notes pulling writes to stderr."""

from __future__ import annotations

import sys
import time


def _human(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _clock(seconds: float) -> str:
    s = int(seconds + 0.5)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class _Progress:
    """Bytes done/total, speed and time left on stderr: redrawn at most 10 times a second on a terminal;
    elsewhere one plain line when the transfer completes. Silent when disabled."""

    def __init__(self, label: str, total: int | None, start: int = 0, enabled: bool = True, stream=None):
        self.label, self.total, self.start, self.done = label, total, start, start
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = self.last = time.monotonic()
        self.width = 0

    def _rate(self, now: float) -> float:
        return (self.done - self.start) / max(now - self.t0, 1e-9)

    def _draw(self, now: float) -> None:
        rate = self._rate(now)
        if self.total:
            left = f"{_clock((self.total - self.done) / rate)} left" if rate > 0 else "--:-- left"
            line = (f"{self.label}: {_human(self.done)} / {_human(self.total)} "
                    f"{100 * self.done / self.total:3.0f}%  {_human(rate)}/s  {left}")
        else:
            line = f"{self.label}: {_human(self.done)}  {_human(rate)}/s"
        self.stream.write("\r" + line.ljust(self.width))
        self.width = len(line)
        self.stream.flush()

    def update(self, done: int) -> None:
        self.done = done
        if self.tty:
            now = time.monotonic()
            if now - self.last >= 0.1:
                self.last = now
                self._draw(now)

    def close(self, ok: bool = True) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self.tty:
            self._draw(now)
            self.stream.write("\n")
        elif ok:
            self.stream.write(f"{self.label}: {_human(self.done - self.start)} in {now - self.t0:.1f} s "
                              f"({_human(self._rate(now))}/s)\n")
        self.stream.flush()


def _say(progress: bool, text: str) -> None:
    if progress:
        sys.stderr.write(f"tinydet: {text}\n")
        sys.stderr.flush()
