"""Where tinydet keeps what it makes: one cache root for models, compiled kernels and PTX."""
from __future__ import annotations

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
