"""Memory-mapped model files: read-only maps, and letting go of pages once their bytes are copied."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np


def map_file(path: Path) -> np.memmap:
    """The whole file as a read-only uint8 array backed by the page cache."""
    return np.memmap(path, dtype=np.uint8, mode="r")


def release_pages(data: np.memmap, lo: int, hi: int) -> None:
    """Drop the pages of bytes lo..hi of a mapped file from this process's resident memory once they
    have been used (a later read faults them back in from the page cache: correct, only slower), so
    loading a model does not hold the file resident on top of the packed weights."""
    mm = getattr(data, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = mmap.PAGESIZE
    start = lo // page * page
    end = min(len(mm), -(-hi // page) * page)
    if end <= start:
        return
    try:
        mm.madvise(mmap.MADV_DONTNEED, start, end - start)
    except (OSError, ValueError):  # advice only: a platform that refuses it keeps the pages
        pass
