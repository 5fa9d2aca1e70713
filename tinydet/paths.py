"""Where tinydet keeps what it makes: one cache root for models, compiled kernels and PTX, and the
lock processes take to share what is there."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path


def cache_base() -> Path:
    """`$TINYDET_CACHE_DIR`, else `$XDG_CACHE_HOME/tinydet` or `~/.cache/tinydet` (an empty variable
    counts as unset)."""
    base = os.environ.get("TINYDET_CACHE_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "tinydet"


@contextlib.contextmanager
def file_lock(path):
    """An exclusive lock (POSIX flock on `path`, created if missing) held for the block: one process
    at a time writes what others share (a download's .part file, numba's cache index). No lock on
    Windows."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
