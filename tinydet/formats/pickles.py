"""Pickle checkpoints are refused, never opened: unpickling a file runs whatever code it names.

PyTorch's `torch.save` files (pytorch_model.bin, *.pt, *.pth, *.ckpt) are pickles, either bare (they
start with pickle's PROTO opcode, 0x80, and a protocol number) or in a zip archive with a `data.pkl`
member. A file is recognised by its name or its first bytes (and a zip's list of members, which is
read without unpickling anything); a GGUF file wins whatever its name, as llama.cpp's old `.bin`
names for GGUF files are still about.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

from ..errors import ModelFormatError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
_ZIP_MAGIC = b"PK\x03\x04"


def pickle_reason(path: str | Path) -> str | None:
    """Why `path` is a pickle checkpoint ("its name", "its first bytes", "its data.pkl member"), or
    None. Reads at most the first bytes and, for a zip, its directory."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        head = b""
    if head == b"GGUF":
        return None
    # PROTO then a protocol number 2..5 (protocols 0 and 1 have no magic; the suffix catches them)
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "it starts with pickle's magic bytes"
    if head == _ZIP_MAGIC:
        try:
            with zipfile.ZipFile(path) as z:
                if any(n == "data.pkl" or n.endswith("/data.pkl") or n.endswith(".pkl") for n in z.namelist()):
                    return "it is a zip archive with a pickle (data.pkl) in it, as torch.save writes"
        except (zipfile.BadZipFile, OSError, ValueError):
            pass
    if path.suffix.lower() in PICKLE_SUFFIXES:
        return f"its name ends in {path.suffix}, a pickle checkpoint's suffix"
    return None


def refuse_pickle(path: str | Path, field: str = "weights") -> None:
    """Raise ModelFormatError if `path` is a pickle checkpoint (see `pickle_reason`)."""
    reason = pickle_reason(path)
    if reason is not None:
        raise ModelFormatError(path, field, f"a pickle checkpoint ({reason}): tinydet never unpickles a file, because "
                                            "unpickling can run arbitrary code; use a safetensors "
                                            "(model.safetensors) or GGUF file instead")
