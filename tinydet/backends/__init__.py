"""Backends: where a model's forward pass runs. `base.py` says what a backend does; `cpu/` is the
numba CPU backend, the only one so far (a GPU backend is a sibling of it)."""

from __future__ import annotations

from .base import Backend, KVCache

__all__ = ["Backend", "KVCache", "load_backend"]


def load_backend(name: str, config, tensors: dict, dtype: str, threads: int | None) -> Backend:
    """Pack a checkpoint's tensors on backend `name` ("cpu")."""
    if name == "cpu":
        from .cpu import CPUBackend

        return CPUBackend(config, tensors, dtype, threads)
    from ..errors import TinydetError

    raise TinydetError(f"backend: expected 'cpu', found {name!r}")
