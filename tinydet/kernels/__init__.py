"""Compute kernels. One backend per module; `cpu` (numba) is the only one so far.

numba's on-disk cache does not notice edits to jitted helpers in other modules, so the cache lives in
a directory keyed by a hash of every kernel source file and the numba version: any edit gets a fresh
cache instead of stale machine code.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numba

_HERE = Path(__file__).resolve().parent


def _cache_key() -> str:
    h = hashlib.sha256(numba.__version__.encode())
    for src in sorted(_HERE.glob("*.py")):
        h.update(src.name.encode())
        h.update(src.read_bytes())
    return h.hexdigest()[:16]


if not os.environ.get("NUMBA_CACHE_DIR"):
    _base = Path(os.environ.get("TINYDET_CACHE_DIR", Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tinydet"))
    numba.config.CACHE_DIR = str(_base / "numba" / _cache_key())


def on_first_compile(callback) -> None:
    """Call `callback()` once, when numba first compiles a kernel in this process (a cache miss: the
    first run on a machine, or of a dtype or weight type not run before). Loads from the cache do
    not count, so a warm start stays silent."""
    from numba.core import event

    class _Once(event.Listener):
        fired = False

        def on_start(self, ev):
            if not self.fired:
                self.fired = True
                callback()

        def on_end(self, ev):
            pass

    event.register("numba:compile", _Once())
