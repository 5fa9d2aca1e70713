"""Model files in, one `Checkpoint` out: `open_checkpoint(path)` is the one dispatch.

A checkpoint is the config (dims and flags, `config.ModelConfig`), the tensors under canonical names
(`arch/`), the tokenizer and the file's metadata. Tensors are read lazily: a `Tensor` is a view of the
file's bytes in its stored type, dequantized on demand, so a backend can keep quantized blocks as they
are (native storage) or pack float panels a few rows at a time, and let each part of the file's pages
go once it is copied.

Readers: GGUF files (`gguf.py` the container, `gguf_model.py` the model in it) and Hugging Face
directories (`safetensors.py`, `hf_dir.py`), each giving a `checkpoint.py` `Checkpoint` of `Tensor`s;
`ggml.py` is the one table of storage types and `dequant.py` turns each into float32 exactly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from ..errors import ModelFormatError
from .checkpoint import Checkpoint, Tensor

__all__ = ["Checkpoint", "Tensor", "open_checkpoint"]


def open_checkpoint(path: str | os.PathLike, progress: Callable[[int, int, str], None] | None = None) -> Checkpoint:
    """A GGUF file or a Hugging Face directory (config.json + safetensors) -> its Checkpoint. A known
    model's name is the registry's to turn into a file first (`registry.resolve_model`, as `api.load`
    does). `progress(done, total, name)` is called as each tensor is found and checked, and once at the
    end."""
    path = Path(path)
    if not path.exists():
        raise ModelFormatError(path, "path", "no such file or directory")
    if path.is_file():
        from .pickles import refuse_pickle

        refuse_pickle(path)  # before any reader looks at it: a pickle is never opened
    if path.is_dir():
        from .hf_dir import open_hf_dir

        return open_hf_dir(path, progress)
    from .gguf_model import open_gguf

    return open_gguf(path, progress)
