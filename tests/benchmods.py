"""The bench scripts as modules for the tests. bench/ goes on sys.path only while one is imported: left
there, its profile.py would shadow the standard library's (cProfile, which torch and transformers
import, then fails in every later test of the same worker)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

BENCH = str(Path(__file__).resolve().parent.parent / "bench")


def bench_module(name: str):
    """bench/NAME.py imported (with the bench modules it imports itself, some of which put bench/ on
    the path again as scripts do: every entry goes)."""
    sys.path.insert(0, BENCH)
    try:
        return importlib.import_module(name)
    finally:
        sys.path[:] = [p for p in sys.path if str(Path(p).resolve()) != BENCH]
