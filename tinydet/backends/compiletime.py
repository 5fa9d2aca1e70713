"""How long numba has held its compiler lock in this process: compiling kernels (a first run, or a dtype
or weight type not run before) or loading them from its cache at their first call. The engine takes
this time out of a request's prefill and decode and reports it apart (`Generation.compile_seconds`),
so that a first run's speeds are the model's, not the compiler's."""

from __future__ import annotations

import threading
import time

from numba.core import event


class _CompileClock(event.Listener):
    """Wall time with at least one compiler-lock event open, summed (nested and concurrent events once)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open = 0
        self._since = 0.0
        self._total = 0.0

    def on_start(self, ev):
        with self._lock:
            if self._open == 0:
                self._since = time.perf_counter()
            self._open += 1

    def on_end(self, ev):
        with self._lock:
            self._open -= 1
            if self._open == 0:
                self._total += time.perf_counter() - self._since

    def seconds(self) -> float:
        with self._lock:
            return self._total + (time.perf_counter() - self._since if self._open else 0.0)


_clock = _CompileClock()
# numba opens this event around every compile and every load from its cache, and at no other time.
event.register("numba:compiler_lock", _clock)


def compile_seconds() -> float:
    """Seconds this process has spent in numba's compiler so far (a clock: take differences)."""
    return _clock.seconds()
