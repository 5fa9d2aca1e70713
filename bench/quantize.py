"""Quantize float32 rows to GGML block types, vectorised in NumPy, for `make_random_gguf.py`.

    blocks = quantize(x, "Q4_K")   # x: (rows, cols) float32 -> (rows, row_bytes) uint8

Q8_0 and Q4_0 come from the `gguf` package (`gguf.quants.quantize`, llama.cpp's reference rule).
The `gguf` package cannot quantize K-quants, so Q4_K and Q6_K are written here with a plain rule
(not llama.cpp's iterative search, which fits each sub-block's scale and min a little better):

- Q4_K (super-block of 256 = 8 sub-blocks of 32): x ~ d*sc*q - dmin*m, q in 0..15, sc and m 6-bit.
  Each sub-block's min is taken <= 0 (as llama.cpp does) and its scale is (max - min) / 15; the
  super-block's fp16 d and dmin are the largest scale and -min over 63; sc rounds its scale *up* to a
  multiple of d (so that 15 steps still cover the sub-block), m rounds to nearest.
- Q6_K (256 = 16 sub-blocks of 16): x ~ d*sc*(q - 32), q in 0..63, sc int8. Each sub-block's scale
  is max|x| / 31; the fp16 d is the largest scale over 127; sc rounds its scale up to a multiple of d.

Every step is elementwise IEEE arithmetic or a rounding (no reductions whose order could vary), so the
bytes depend on the input alone. The error bound that follows from the rule (checked by
tests/test_make_random_gguf.py against `gguf.quants.dequantize`): |x - x'| <= step / 2 + dmin / 2 for
Q4_K, where step = d*sc of the sub-block, and <= step / 2 for Q6_K.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType

QK_K = 256
TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_K", "Q6_K")


def _f16(x: np.ndarray) -> np.ndarray:
    """Round to fp16 (nearest even), back as float32: the value the file will hold."""
    return x.astype(np.float16).astype(np.float32)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den, 0 where den is 0 (an all-zero sub-block)."""
    return np.divide(num, den, out=np.zeros(np.broadcast_shapes(num.shape, den.shape), np.float32),
                     where=den > 0)


def _as_blocks(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] % QK_K:
        raise ValueError(f"K-quants need rows of a multiple of {QK_K} values, got shape {x.shape}")
    return x.reshape(-1, QK_K)


def _bytes(*parts: np.ndarray) -> np.ndarray:
    """Concatenate per-block fields (each (n_blocks, ...)) into (n_blocks, block_bytes) uint8."""
    return np.concatenate([np.ascontiguousarray(p).view(np.uint8).reshape(len(p), -1) for p in parts], axis=1)


def q4_k(x: np.ndarray) -> np.ndarray:
    """(rows, cols) float32 -> (rows, cols / 256 * 144) uint8 of block_q4_K: fp16 d, fp16 dmin,
    12 bytes of packed 6-bit scales and mins, 128 bytes of 4-bit q (element 64j + l in the low nibble of
    byte 32j + l, element 64j + 32 + l in its high nibble)."""
    rows = x.shape[0]
    s = _as_blocks(x).reshape(-1, 8, 32)  # (blocks, sub-block, element)
    lo = np.minimum(s.min(axis=2), 0)
    scale = (s.max(axis=2) - lo) / np.float32(15)  # (blocks, 8)
    d = _f16(scale.max(axis=1) / np.float32(63))  # (blocks,)
    dmin = _f16(-lo.min(axis=1) / np.float32(63))
    sc = np.minimum(np.ceil(_ratio(scale, d[:, None])), 63)
    m = np.minimum(np.round(_ratio(-lo, dmin[:, None])), 63)
    step = d[:, None] * sc  # the float32 products the dequantizer forms
    off = dmin[:, None] * m
    q = np.clip(np.round(_ratio(s + off[..., None], step[..., None])), 0, 15).astype(np.uint8)
    q = q.reshape(-1, 4, 2, 32)  # (blocks, j, low/high half of the 64, l)
    qs = q[:, :, 0, :] | (q[:, :, 1, :] << 4)
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    packed = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
                             m[:, :4] | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)], axis=1)
    out = _bytes(d.astype(np.float16), dmin.astype(np.float16), packed, qs)
    return out.reshape(rows, -1)


def q6_k(x: np.ndarray) -> np.ndarray:
    """(rows, cols) float32 -> (rows, cols / 256 * 210) uint8 of block_q6_K: ql[128] (low 4 bits),
    qh[64] (high 2 bits), int8 scales[16] (one per 16 elements, in order), fp16 d. In each half of 128,
    element 32k + l (k = 0..3) has its low bits in ql[l + 32 (k & 1)] (nibble k >> 1) and its high
    bits in qh[l] at bit 2k."""
    rows = x.shape[0]
    s = _as_blocks(x).reshape(-1, 16, 16)
    scale = np.abs(s).max(axis=2) / np.float32(31)  # (blocks, 16)
    d = _f16(scale.max(axis=1) / np.float32(127))
    sc = np.minimum(np.ceil(_ratio(scale, d[:, None])), 127)
    step = d[:, None] * sc
    q = (np.clip(np.round(_ratio(s, step[..., None])), -32, 31) + 32).astype(np.uint8)
    a = q.reshape(-1, 2, 4, 32)  # (blocks, half, k, l)
    ql = np.concatenate([(a[:, :, 0] & 0xF) | ((a[:, :, 2] & 0xF) << 4),
                         (a[:, :, 1] & 0xF) | ((a[:, :, 3] & 0xF) << 4)], axis=2)  # (blocks, half, 64)
    qh = (a[:, :, 0] >> 4) | ((a[:, :, 1] >> 4) << 2) | ((a[:, :, 2] >> 4) << 4) | ((a[:, :, 3] >> 4) << 6)
    out = _bytes(ql, qh, sc.astype(np.int8), d.astype(np.float16))
    return out.reshape(rows, -1)


def quantize(x: np.ndarray, type_name: str) -> np.ndarray:
    """x (rows, cols) float32 -> the rows stored as `type_name`: F32/F16 as such, block types as
    (rows, row_bytes) uint8."""
    if type_name == "F32":
        return np.ascontiguousarray(x, dtype=np.float32)
    if type_name == "F16":
        return x.astype(np.float16)  # IEEE round to nearest even
    if type_name in ("Q8_0", "Q4_0"):
        return gguf.quants.quantize(np.ascontiguousarray(x, dtype=np.float32), GGMLQuantizationType[type_name])
    if type_name == "Q4_K":
        return q4_k(x)
    if type_name == "Q6_K":
        return q6_k(x)
    raise ValueError(f"cannot quantize to {type_name!r} (one of {', '.join(TYPES)})")
