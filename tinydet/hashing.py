"""Hashes that name results and files: SHA-256 over little-endian bytes (docs/determinism.md, rule 9)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

import numpy as np


def hash_ids(ids: Sequence[int]) -> str:
    """SHA-256 of token ids as int32 little-endian."""
    return hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest()


def hash_logits(rows: Sequence[np.ndarray]) -> str:
    """SHA-256 of float32 little-endian logits rows, in order."""
    h = hashlib.sha256()
    for r in rows:
        h.update(np.ascontiguousarray(r, dtype="<f4").tobytes())
    return h.hexdigest()


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file; of a directory, SHA-256 over "name<TAB>sha256" lines of its files, sorted."""
    path = Path(path)
    if path.is_dir():
        lines = [f"{p.relative_to(path).as_posix()}\t{file_sha256(p)}\n"
                 for p in sorted(path.rglob("*")) if p.is_file()]
        return hashlib.sha256("".join(lines).encode()).hexdigest()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()
