"""numerics/__init__.py: numba's cache directory, set before any kernel of tinydet is decorated and keyed
by the sources whose kernels call one another's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tinydet import numerics


def test_kernels_outside_the_backend_cache_in_the_keyed_directory(tmp_path):
    """Sampling and log-probabilities import no backend: their kernels and numerics' still get the keyed
    directory (numba picks a kernel's cache directory when the kernel is decorated)."""
    env = {**os.environ, "TINYDET_CACHE_DIR": str(tmp_path)}
    env.pop("NUMBA_CACHE_DIR", None)
    code = ("import numba, tinydet.sampling as s, tinydet.logprobs, tinydet.numerics.mathfn as m\n"
            "print(numba.config.CACHE_DIR); print(s._draw._cache._cache_path); print(m.exp64._cache._cache_path)\n"
            "print('tinydet.backends' in __import__('sys').modules)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    cache_dir, draw, exp64, backend = out.stdout.split()
    assert Path(cache_dir) == tmp_path / "numba" / numerics._cache_key()
    assert Path(draw).is_relative_to(cache_dir) and Path(exp64).is_relative_to(cache_dir)
    assert backend == "False"


def test_the_cache_key_follows_the_kernel_sources(tmp_path, monkeypatch):
    """An edit under numerics/, packing/ or backends/cpu/ (a subpackage too) gives a new directory; one
    elsewhere does not."""
    files = ("numerics/mathfn.py", "packing/repack.py", "backends/cpu/ops.py", "backends/cpu/storage/q8.py", "api.py")
    for f in files:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("x = 1\n")
    monkeypatch.setattr(numerics, "_PACKAGE", tmp_path)
    keys = [numerics._cache_key()]
    for f in files:
        (tmp_path / f).write_text((tmp_path / f).read_text() + "y = 2\n")
        keys.append(numerics._cache_key())
    assert len(set(keys[:5])) == 5 and keys[5] == keys[4]
