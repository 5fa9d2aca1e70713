"""Hashes that name results and files: SHA-256 over little-endian bytes (docs/determinism.md, rule 9)."""

from __future__ import annotations

import hashlib
import json
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


# The sources that decide a result's bits: the kernels and their arithmetic, the packed weights' layouts,
# RoPE's frequencies, model formats and architectures, tokenizers, chat templates and tool-call
# grammars, structured outputs, the engine, sampling and log-probabilities. Not the CLI, server,
# registry or tools.
BIT_SOURCES = ("numerics", "packing", "backends", "rope.py", "arch", "formats", "jsonfile.py", "tokenizer", "engine",
               "config.py", "chat", "structured.py", "sampling.py", "logprobs.py", "hashing.py")


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


def _stat_key(path: Path) -> str:
    st = path.stat()
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def _index_path() -> Path:
    from .paths import cache_base

    return cache_base() / "sha256-index.json"


def indexed_sha256(path: str | Path) -> str | None:
    """A model file's SHA-256 as `model_sha256` last recorded it, if the file is unchanged since (the same
    device, inode, size and modification time in nanoseconds), else None."""
    try:
        sha = json.loads(_index_path().read_text()).get(_stat_key(Path(path).resolve()))
    except (OSError, ValueError, AttributeError):
        return None
    return sha if isinstance(sha, str) else None


def model_sha256(path: str | Path) -> str:
    """`file_sha256`, remembered per file by stat (`indexed_sha256`) so that loading a large model again
    does not read it all again. A directory is hashed each time."""
    path = Path(path).resolve()
    if path.is_dir():
        return file_sha256(path)
    sha = indexed_sha256(path)
    if sha is None:
        sha = file_sha256(path)
        remember_sha256(path, sha)
    return sha


def remember_sha256(path: Path, sha: str) -> None:
    """Record `sha` as the SHA-256 of `path` as it is now (best effort: the index is a shortcut only)."""
    from .jsonfile import write_json
    from .paths import file_lock

    index_path = _index_path()
    try:
        key = _stat_key(Path(path).resolve())
        index_path.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(str(index_path) + ".lock"):
            try:
                index = json.loads(index_path.read_text())
                index = index if isinstance(index, dict) else {}
            except (OSError, ValueError):
                index = {}
            index[key] = sha
            write_json(index_path, index)
    except OSError:
        pass


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
