"""Exact dequantization of GGUF/ggml tensor types to float32, with NumPy.

`dequantize(raw, ggml_type, shape)` turns a tensor's raw bytes into a new C-contiguous float32 array.
The result is bit-for-bit identical to `gguf.quants.dequantize` (gguf-py, the reference the tests
compare against): every float operation below is the same IEEE float32 operation, on the same
operands, in the same order as gguf-py performs it — fp16 scales widened with NumPy's float16->float32
cast, then only elementwise `*`, `+`, `-` in float32 (no reductions, no float64, no fused
multiply-add). Those are correctly rounded on every IEEE machine, so every non-NaN result is the same
on any CPU. (Which NaN bit pattern comes out of NaN inputs, or of inf * 0, is the CPU's rule: on x86
the first operand's payload wins and inf * 0 gives 0xFFC00000. Keeping gguf-py's operand order keeps
even those bits equal to gguf-py's on the same machine.) Order matters even where it looks cosmetic:
`(d * q) + m` rounds once (the product is exact) while `d * (q + m / d)` would round twice;
`x - dm` and `x + (-dm)` give NaNs of opposite sign; `m + d * q` picks the other NaN's payload.

All multi-byte fields are little-endian (GGUF's byte order). Block layouts are those of llama.cpp's
ggml-common.h; `ggml_half` is an IEEE binary16 scale. Work is vectorized over blocks and done in
chunks of blocks so temporaries stay small (a few hundred KiB) whatever the tensor's size.
"""

from __future__ import annotations

import operator
from typing import Callable

import numpy as np

from .ggml import GGML_TYPE_IDS, GGML_TYPES

__all__ = ["dequantize", "SUPPORTED_TYPES"]

_U8 = np.uint8
_F32 = np.float32

# Elements per chunk of blocks: big enough that NumPy's per-call overhead is negligible, small enough
# that the uint8/float32 temporaries of one chunk stay in cache.
_CHUNK_ELEMENTS = 1 << 16


def _f16(cols: np.ndarray) -> np.ndarray:
    """(n, 2) uint8 little-endian fp16 bytes -> (n, 1) float32, widened exactly as gguf-py does
    (`.view(np.float16).astype(np.float32)`: subnormals become normal float32, +-inf stay inf, NaN
    keeps its sign and payload)."""
    return cols.view("<f2").astype(_F32)


def _nibbles(qs: np.ndarray, q: np.ndarray) -> None:
    """Unpack (n, 16) bytes into q (n, 32) float32: low nibbles of qs[0..15] are elements 0..15,
    high nibbles elements 16..31 (ggml's Q4_0/Q4_1/Q5_0/Q5_1 order)."""
    np.bitwise_and(qs, _U8(0x0F), out=q[:, :16], casting="unsafe")
    np.right_shift(qs, _U8(4), out=q[:, 16:], casting="unsafe")


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """(n, 4) bytes of a little-endian uint32 -> (n, 32) uint8 of its bits, bit j at column j."""
    return np.unpackbits(qh, axis=1, bitorder="little")


# F32 (0): 4 bytes per element, IEEE binary32. Copied bit-for-bit.
def _deq_f32(flat: np.ndarray, out: np.ndarray) -> None:
    out.view(_U8)[:] = flat


# F16 (1): 2 bytes per element, IEEE binary16; NumPy's float16->float32 cast (gguf: .astype(float32)).
def _deq_f16(flat: np.ndarray, out: np.ndarray) -> None:
    out[:] = flat.view("<f2")


# BF16 (30): 2 bytes per element, the high 16 bits of an IEEE binary32; widened by a 16-bit shift
# (gguf: (int16 -> int32) << 16, the same bits).
def _deq_bf16(flat: np.ndarray, out: np.ndarray) -> None:
    bits = out.view(np.uint32)
    bits[:] = flat.view("<u2")
    bits <<= np.uint32(16)


# Q8_0 (8): block_q8_0, 32 elements in 34 bytes: ggml_half d; int8 qs[32].
# y[j] = qs[j] * d (gguf: `x * d`).
def _deq_q8_0(b: np.ndarray, out: np.ndarray) -> None:
    d = _f16(b[:, 0:2])
    x = b[:, 2:34].view(np.int8).astype(_F32)
    np.multiply(x, d, out=out)


# Q4_0 (2): block_q4_0, 32 elements in 18 bytes: ggml_half d; uint8 qs[16] (nibbles).
# y[j] = d * ((qs[j] & 0xF) - 8), y[j+16] = d * ((qs[j] >> 4) - 8) (gguf: `d * q`).
def _deq_q4_0(b: np.ndarray, out: np.ndarray) -> None:
    d = _f16(b[:, 0:2])
    q = np.empty(out.shape, _F32)
    _nibbles(b[:, 2:18], q)
    q -= _F32(8)  # small integers: exact, same values as gguf's int8 subtraction
    np.multiply(d, q, out=out)


# Q4_1 (3): block_q4_1, 32 elements in 20 bytes: ggml_half d; ggml_half m; uint8 qs[16] (nibbles).
# y[j] = (d * (qs[j] & 0xF)) + m, y[j+16] = (d * (qs[j] >> 4)) + m (gguf: `(d * qs) + m`).
def _deq_q4_1(b: np.ndarray, out: np.ndarray) -> None:
    d = _f16(b[:, 0:2])
    m = _f16(b[:, 2:4])
    q = np.empty(out.shape, _F32)
    _nibbles(b[:, 4:20], q)
    np.multiply(d, q, out=out)
    np.add(out, m, out=out)


# Q5_0 (6): block_q5_0, 32 elements in 22 bytes: ggml_half d; uint8 qh[4] (bit j of the little-endian
# uint32 = 5th bit of element j); uint8 qs[16] (low nibbles as Q4_0).
# y[j] = d * (((qs nibble) | (bit j << 4)) - 16) (gguf: `d * q`).
def _deq_q5_0(b: np.ndarray, out: np.ndarray) -> None:
    d = _f16(b[:, 0:2])
    hi = _high_bits32(b[:, 2:6])
    hi <<= _U8(4)
    q = np.empty(out.shape, _F32)
    _nibbles(b[:, 6:22], q)
    q += hi
    q -= _F32(16)
    np.multiply(d, q, out=out)


# Q5_1 (7): block_q5_1, 32 elements in 24 bytes: ggml_half d; ggml_half m; uint8 qh[4]; uint8 qs[16].
# y[j] = (d * ((qs nibble) | (bit j << 4))) + m (gguf: `(d * qs) + m`).
def _deq_q5_1(b: np.ndarray, out: np.ndarray) -> None:
    d = _f16(b[:, 0:2])
    m = _f16(b[:, 2:4])
    hi = _high_bits32(b[:, 4:8])
    hi <<= _U8(4)
    q = np.empty(out.shape, _F32)
    _nibbles(b[:, 8:24], q)
    q += hi
    np.multiply(d, q, out=out)
    np.add(out, m, out=out)


# MXFP4 (39): block_mxfp4, 32 elements in 17 bytes: uint8 e (an E8M0 exponent); uint8 qs[16] (nibbles,
# element order as Q4_0). y[j] = d * KVALUES_MXFP4[nibble], with d = 2^(e - 128): ggml's
# GGML_E8M0_TO_FP32_HALF (E8M0's 2^(e - 127), halved because kvalues are the E2M1 values doubled), built
# from bits as ggml and gguf-py build it: e < 2 the float32 subnormals 2^-128 (0x00200000) and 2^-127,
# else (e - 1) << 23. No special case for e = 255 (2^127, not NaN). d * q is exact unless it overflows
# (|q| * 2^(e - 128) >= 2^128, e.g. 12 at e >= 253: inf, as in gguf-py). Code 8 is +0, not -0.
KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
_KV_MXFP4 = np.array(KVALUES_MXFP4, _F32)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """E8M0 exponent bytes (uint8, any shape) -> float32 2^(e - 128), ggml's GGML_E8M0_TO_FP32_HALF."""
    e = e.astype(np.uint32)
    return np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23)).astype(np.uint32).view(_F32)


def _deq_mxfp4(b: np.ndarray, out: np.ndarray) -> None:
    d = e8m0_half(b[:, 0:1])
    q = np.empty(out.shape, _U8)
    np.bitwise_and(b[:, 1:17], _U8(0x0F), out=q[:, :16])
    np.right_shift(b[:, 1:17], _U8(4), out=q[:, 16:])
    np.multiply(d, _KV_MXFP4[q], out=out)  # gguf: `d * qs.astype(float32)`


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and 8 six-bit mins of Q4_K/Q5_K, from the 12 packed bytes (ggml's
    get_scale_min_k4): for j < 4 sc = s[j] & 63, m = s[j+4] & 63; for j >= 4
    sc = (s[j+4] & 0xF) | ((s[j-4] >> 6) << 4), m = (s[j+4] >> 4) | ((s[j] >> 6) << 4)."""
    n = s.shape[0]
    lo_d, lo_m, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.empty((n, 8), _U8)
    mn = np.empty((n, 8), _U8)
    np.bitwise_and(lo_d, _U8(0x3F), out=sc[:, :4])
    np.bitwise_or(hi & _U8(0x0F), (lo_d >> _U8(2)) & _U8(0x30), out=sc[:, 4:])
    np.bitwise_and(lo_m, _U8(0x3F), out=mn[:, :4])
    np.bitwise_or(hi >> _U8(4), (lo_m >> _U8(2)) & _U8(0x30), out=mn[:, 4:])
    return sc, mn


def _k_type1(b: np.ndarray, out: np.ndarray, q: np.ndarray) -> None:
    """Q4_K/Q5_K: out (n, 8, 32) = ((d * sc) * q) - (dmin * m), each product/difference in float32
    (gguf: `d = d * sc; dm = dmin * m; d * qs - dm`)."""
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    dmin = _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (d * sc.astype(_F32)).reshape(n, 8, 1)
    ml = (dmin * mn.astype(_F32)).reshape(n, 8, 1)
    o = out.reshape(n, 8, 32)
    np.multiply(dl, q, out=o)
    np.subtract(o, ml, out=o)


# Q4_K (12): block_q4_K, 256 elements in 144 bytes: ggml_half d; ggml_half dmin; uint8 scales[12]
# (8 six-bit scales + 8 six-bit mins, packed as in _k_scale_min); uint8 qs[128]. Sub-block i (32
# elements) is the low (i even) or high (i odd) nibbles of qs[32*(i//2) : 32*(i//2)+32].
def _deq_q4_k(b: np.ndarray, out: np.ndarray) -> None:
    n = b.shape[0]
    qs = b[:, 16:144].reshape(n, 4, 32)
    q = np.empty((n, 4, 2, 32), _F32)
    np.bitwise_and(qs, _U8(0x0F), out=q[:, :, 0], casting="unsafe")
    np.right_shift(qs, _U8(4), out=q[:, :, 1], casting="unsafe")
    _k_type1(b, out, q.reshape(n, 8, 32))


# Q5_K (13): block_q5_K, 256 elements in 176 bytes: ggml_half d; ggml_half dmin; uint8 scales[12];
# uint8 qh[32] (bit i of qh[l] = 5th bit of element l of sub-block i); uint8 qs[128] (as Q4_K).
def _deq_q5_k(b: np.ndarray, out: np.ndarray) -> None:
    n = b.shape[0]
    qh = b[:, 16:48]
    qs = b[:, 48:176].reshape(n, 4, 32)
    ql = np.empty((n, 4, 2, 32), _U8)
    np.bitwise_and(qs, _U8(0x0F), out=ql[:, :, 0])
    np.right_shift(qs, _U8(4), out=ql[:, :, 1])
    ql = ql.reshape(n, 8, 32)
    # (n, 32, 8) bits, bit i of qh[l] at [l, i] -> sub-block-major (n, 8, 32)
    hi = np.unpackbits(qh[:, :, None], axis=2, bitorder="little").transpose(0, 2, 1)
    ql |= hi << _U8(4)
    _k_type1(b, out, ql.astype(_F32))


# Q6_K (14): block_q6_K, 256 elements in 210 bytes: uint8 ql[128] (low 4 bits); uint8 qh[64] (high 2
# bits); int8 scales[16] (one per 16 elements); ggml_half d. For half h (128 elements) and l < 32:
#   q[h*128 + l +  0] = (ql[h*64 + l]      & 0xF) | ((qh[h*32 + l] >> 0) & 3) << 4
#   q[h*128 + l + 32] = (ql[h*64 + l + 32] & 0xF) | ((qh[h*32 + l] >> 2) & 3) << 4
#   q[h*128 + l + 64] = (ql[h*64 + l]      >> 4)  | ((qh[h*32 + l] >> 4) & 3) << 4
#   q[h*128 + l + 96] = (ql[h*64 + l + 32] >> 4)  | ((qh[h*32 + l] >> 6) & 3) << 4
# y = (d * scales[k // 16]) * (q - 32) (gguf: `d = d * scales; d * q`).
def _deq_q6_k(b: np.ndarray, out: np.ndarray) -> None:
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 2, 32)  # [h][first/second 32 bytes][l]
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    q = np.empty((n, 2, 4, 32), _U8)
    np.bitwise_and(ql, _U8(0x0F), out=q[:, :, 0:2])
    np.right_shift(ql, _U8(4), out=q[:, :, 2:4])
    shifts = np.array([0, 2, 4, 6], _U8).reshape(1, 1, 4, 1)
    q |= ((qh >> shifts) & _U8(3)) << _U8(4)
    qf = q.reshape(n, 16, 16).astype(_F32)
    qf -= _F32(32)  # exact: same values as gguf's int8 subtraction
    sc = b[:, 192:208].view(np.int8).astype(_F32)
    d = _f16(b[:, 208:210])
    dl = (d * sc).reshape(n, 16, 1)
    np.multiply(dl, qf, out=out.reshape(n, 16, 16))


# ggml type id -> (elementwise kernel over the flat bytes) for the plain float types, or
# (kernel over (n_blocks, type_size) bytes writing (n_blocks, block_size) floats) for block types.
_ELEMENTWISE: dict[int, Callable[[np.ndarray, np.ndarray], None]] = {
    GGML_TYPE_IDS["F32"]: _deq_f32,
    GGML_TYPE_IDS["F16"]: _deq_f16,
    GGML_TYPE_IDS["BF16"]: _deq_bf16,
}
_BLOCKWISE: dict[int, Callable[[np.ndarray, np.ndarray], None]] = {
    GGML_TYPE_IDS["Q8_0"]: _deq_q8_0,
    GGML_TYPE_IDS["Q4_0"]: _deq_q4_0,
    GGML_TYPE_IDS["Q4_1"]: _deq_q4_1,
    GGML_TYPE_IDS["Q5_0"]: _deq_q5_0,
    GGML_TYPE_IDS["Q5_1"]: _deq_q5_1,
    GGML_TYPE_IDS["Q4_K"]: _deq_q4_k,
    GGML_TYPE_IDS["Q5_K"]: _deq_q5_k,
    GGML_TYPE_IDS["Q6_K"]: _deq_q6_k,
    GGML_TYPE_IDS["MXFP4"]: _deq_mxfp4,
}

#: ggml type ids `dequantize` accepts -> type name.
SUPPORTED_TYPES: dict[int, str] = {i: GGML_TYPES[i].name for i in sorted({**_ELEMENTWISE, **_BLOCKWISE})}


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """raw: the tensor's bytes as a uint8 array (possibly a read-only np.memmap slice, any leading shape, C-contiguous);
    ggml_type: ggml type id; shape: the tensor's numpy-order shape (last axis = row length).
    Returns a new C-contiguous float32 array of `shape`."""
    try:
        tid = operator.index(ggml_type)
    except TypeError:
        raise ValueError(f"ggml type must be an integer id, got {ggml_type!r}") from None
    if tid not in SUPPORTED_TYPES:
        supported = ", ".join(f"{name}({i})" for i, name in SUPPORTED_TYPES.items())
        raise ValueError(f"unsupported ggml type id {tid}; tinydet can dequantize: {supported}")
    t = GGML_TYPES[tid]

    try:
        shape = tuple(operator.index(s) for s in shape)
    except TypeError:
        raise ValueError(f"shape must be a tuple of integers, got {shape!r}") from None
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    n_elements = 1
    for s in shape:
        n_elements *= s
    if t.block_size > 1 and (not shape or shape[-1] % t.block_size):
        raise ValueError(f"{t.name} rows must be a multiple of {t.block_size} elements; shape {shape} is not")

    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8:
        raise TypeError(f"raw must be a uint8 numpy array, got {type(raw).__name__}"
                        + (f" of {raw.dtype}" if isinstance(raw, np.ndarray) else ""))
    n_blocks = n_elements // t.block_size
    expected = n_blocks * t.type_size
    if raw.size != expected:
        raise ValueError(f"{t.name} tensor of shape {shape} needs exactly {expected} bytes, got {raw.size}")

    flat = np.asarray(raw).reshape(-1)  # a view for C-contiguous input (np.asarray drops memmap-ness)
    out = np.empty(n_elements, _F32)
    if n_elements == 0:
        return out.reshape(shape)

    # inf/NaN scales are valid data (they give inf/NaN weights, as in gguf-py and ggml): no warnings.
    with np.errstate(all="ignore"):
        if tid in _ELEMENTWISE:
            kernel = _ELEMENTWISE[tid]
            step = _CHUNK_ELEMENTS * 4
            for start in range(0, n_elements, step):
                stop = min(start + step, n_elements)
                kernel(flat[start * t.type_size:stop * t.type_size], out[start:stop])
        else:
            kernel = _BLOCKWISE[tid]
            blocks = flat.reshape(n_blocks, t.type_size)
            out_blocks = out.reshape(n_blocks, t.block_size)
            step = max(1, _CHUNK_ELEMENTS // t.block_size)
            for start in range(0, n_blocks, step):
                stop = min(start + step, n_blocks)
                kernel(blocks[start:stop], out_blocks[start:stop])
    return out.reshape(shape)
