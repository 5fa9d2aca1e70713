"""Host threads a forward pass may use: numba's pool bounds them, whichever device computes (the CPU
backend's kernels and the GPU backends' host-side work both run on it)."""

from __future__ import annotations

import os

import numba

from ..errors import TinydetError


def default_threads() -> int:
    """The CPUs this process may use, up to numba's pool size."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    return max(1, min(n, numba.config.NUMBA_NUM_THREADS))


def check_threads(threads: int | None) -> int:
    if threads is None:
        return default_threads()
    limit = numba.config.NUMBA_NUM_THREADS
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= limit:
        raise TinydetError(f"threads: expected an integer from 1 to {limit} (NUMBA_NUM_THREADS), found {threads!r}")
    return threads
