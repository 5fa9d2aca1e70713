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


# The sources that decide a result's bits: the kernels, model formats and architectures, tokenizers,
# chat templates, the engine, sampling and log-probabilities. Not the CLI, server, registry or tools.
BIT_SOURCES = ("backends", "arch", "formats", "tokenizer", "engine", "config.py", "chat.py", "sampling.py",
               "logprobs.py", "hashing.py")


def source_hash() -> str:
    """SHA-256 over the files of BIT_SOURCES (relative name and bytes, sorted): it changes with any
    edit that could change a result, and with nothing else."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for name in BIT_SOURCES:
        p = root / name
        for f in sorted(f for f in p.rglob("*") if f.suffix in (".py", ".cu")) if p.is_dir() else [p]:
            h.update(f.relative_to(root).as_posix().encode() + b"\0")
            h.update(f.read_bytes())
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
