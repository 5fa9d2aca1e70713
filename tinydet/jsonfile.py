"""JSON files of a model directory (config.json, tokenizer_config.json, a shard index, a safetensors
header): parsed strictly, every problem a ModelFormatError naming the file and the field. And the
one writer of tinydet's own JSON files (golden hashes, rollout records)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import ModelFormatError


def reject_duplicates(path: Path, field: str):
    def hook(pairs):
        out = {}
        for k, v in pairs:
            if k in out:
                raise ModelFormatError(path, field, f"duplicate key {k!r} in the JSON")
            out[k] = v
        return out
    return hook


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def one_line(e: Exception) -> str:
    s = str(e).strip().splitlines()
    return s[0] if s else type(e).__name__


def read_json(path: Path, field: str, required: bool = True) -> dict | None:
    if not path.is_file():
        if required:
            raise ModelFormatError(path, field, "missing")
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ModelFormatError(path, field, f"is not valid UTF-8 ({e.reason})") from None
    try:
        data = json.loads(text, object_pairs_hook=reject_duplicates(path, field))
    except json.JSONDecodeError as e:
        raise ModelFormatError(path, field, f"is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        # json's decoder recurses once per nesting level: a few thousand '[' exhaust the stack.
        raise ModelFormatError(path, field, "is nested too deeply") from None
    if not isinstance(data, dict):
        raise ModelFormatError(path, field, "expected a JSON object")
    return data


def write_json(path, obj) -> None:
    """Write `obj` as indented JSON, through a temporary file renamed over `path`: a reader never sees
    half a file, and an old one stays whole until the new one is complete."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(path)
