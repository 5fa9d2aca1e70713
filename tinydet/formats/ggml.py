"""The one table of GGML tensor types tinydet knows: type id -> name and block layout.

GGUF files name a tensor's storage by these ids; safetensors' F32/F16/BF16 map onto the same three
ids, so every reader and the native kernels speak one vocabulary. Block layouts are llama.cpp's
(ggml-common.h); dequantization lives in `dequant.py`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GGMLType:
    name: str
    block_size: int  # elements per block
    type_size: int  # bytes per block


GGML_TYPES = {
    0: GGMLType("F32", 1, 4),
    1: GGMLType("F16", 1, 2),
    2: GGMLType("Q4_0", 32, 18),
    3: GGMLType("Q4_1", 32, 20),
    6: GGMLType("Q5_0", 32, 22),
    7: GGMLType("Q5_1", 32, 24),
    8: GGMLType("Q8_0", 32, 34),
    12: GGMLType("Q4_K", 256, 144),
    13: GGMLType("Q5_K", 256, 176),
    14: GGMLType("Q6_K", 256, 210),
    30: GGMLType("BF16", 1, 2),
    39: GGMLType("MXFP4", 32, 17),  # gpt-oss's expert weights: an E8M0 exponent byte, 16 bytes of E2M1 nibbles
}
GGML_TYPE_IDS = {t.name: i for i, t in GGML_TYPES.items()}

F32, F16, BF16 = GGML_TYPE_IDS["F32"], GGML_TYPE_IDS["F16"], GGML_TYPE_IDS["BF16"]
Q8_0, Q4_0, Q4_1 = GGML_TYPE_IDS["Q8_0"], GGML_TYPE_IDS["Q4_0"], GGML_TYPE_IDS["Q4_1"]
MXFP4 = GGML_TYPE_IDS["MXFP4"]


def row_bytes(ggml_type: int, row_length: int) -> int:
    """Bytes of one row of `row_length` elements (a whole number of blocks)."""
    t = GGML_TYPES[ggml_type]
    return row_length // t.block_size * t.type_size
