"""The one table: storage kind -> the module that implements `loaders.py`'s interface for it (as
llama.cpp's type traits give each quant type one row). A quantized kind's module serves every ggml
type of its family, each type's blocks read by its row of `qblocks.READERS`."""

from __future__ import annotations

from . import floats, int8, intmixed, mixed, quantized
from .kinds import register

TABLE = {
    "f32": floats,  # float32 panels
    "f16": floats,  # fp16 bits, widened where read
    "native": quantized,  # GGUF's blocks of one ggml type, read as float32
    "int8": int8,  # GGUF's blocks against 8-bit activations, integer block dots
    "mixed": mixed,  # runs of rows of different native or float kinds
    "int8-mixed": intmixed,  # runs of rows of different integer or float kinds
}

register(TABLE)
