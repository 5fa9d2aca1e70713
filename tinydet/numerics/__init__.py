"""The ground floor of tinydet's arithmetic: numba code that the CPU backend, sampling and
log-probabilities share, and that gives the same bits on every machine (docs/determinism.md).

  mathfn.py   tinydet's own exp, log, sin, cos, tanh from + - * / (NumPy's and libm's differ by CPU)
  simd.py     the one vector layer (64- and 32-lane float32 vectors, fp16 widening, the Kahan step)
  vmath.py    mathfn's exp and tanh lane by lane on those vectors

Importing this package points numba's on-disk cache at its directory, so it happens before any kernel
of tinydet is compiled (every module with kernels imports from here first). numba's cache does not
notice edits to jitted helpers in other modules, so the directory is keyed by a hash of the sources
whose kernels call each other's (`KERNEL_SOURCES`) and the numba version: any edit there gets a fresh
cache instead of stale machine code.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from pathlib import Path

import numba

from ..paths import cache_base, file_lock

# The sources, under the package, whose kernels call jitted helpers of other modules: this package's,
# the packers' and the CPU backend's (sampling.py and logprobs.py call only this package's).
KERNEL_SOURCES = ("numerics", "packing", "backends/cpu")

_PACKAGE = Path(__file__).resolve().parent.parent


def _cache_key() -> str:
    h = hashlib.sha256(numba.__version__.encode())
    for src in sorted(p for d in KERNEL_SOURCES for p in (_PACKAGE / d).rglob("*.py")):
        h.update(src.relative_to(_PACKAGE).as_posix().encode())
        h.update(src.read_bytes())
    return h.hexdigest()[:16]


def _lock_cache_saves() -> None:
    """Make numba's cache safe for processes that compile at once (servers or replicas started
    together on a fresh cache, parallel test workers). numba's save reads a function's index, takes the
    first data file name the index does not use, then rewrites the index: two processes saving
    different signatures of one function at once both take `f.1.nbc`, and the index left behind can
    point one signature at the other's machine code. Here a save holds an exclusive lock on the index
    from reading it to rewriting it, and writes the data file before the index names it."""
    try:
        from numba.core.caching import IndexDataCacheFile
    except ImportError:  # a numba that moved its cache: numba's own save
        return
    if getattr(IndexDataCacheFile, "_tinydet_locked", False):
        return

    def save(self, key, data):
        os.makedirs(self._cache_path, exist_ok=True)
        with file_lock(self._index_path + ".lock"):
            overloads = self._load_index()
            name = overloads.get(key)
            if name is None:
                used = set(overloads.values())
                name = next(n for n in map(self._data_name, itertools.count(1)) if n not in used)
            self._save_data(name, data)
            if overloads.get(key) != name:
                overloads[key] = name
                self._save_index(overloads)

    IndexDataCacheFile.save = save
    IndexDataCacheFile._tinydet_locked = True


if not os.environ.get("NUMBA_CACHE_DIR"):
    numba.config.CACHE_DIR = str(cache_base() / "numba" / _cache_key())
_lock_cache_saves()
