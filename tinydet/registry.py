"""Known models (models/*.toml), the download cache and name resolution. (Minimal: paths only.)"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ModelFormatError

DEFAULT_MODEL = "smollm2-135m-instruct"


def resolve_model(model: str | os.PathLike, verify: bool = False) -> Path:
    """A GGUF path or HF directory as given; a known model's name -> its cached file."""
    path = Path(model)
    if not path.exists():
        raise ModelFormatError(path, "path", "no such file")
    return path
