"""Activations to 8-bit blocks for the integer mode (dtype "int8"): one rule, the same on every ISA.

Each row of x (float32, length K) is cut into blocks of 32 elements (beside Q8_0/Q4_0/Q4_1/Q5_0
weights: llama.cpp's Q8_0 activations; 256 beside the K-quants, Q8_K). Per block, in float32:
  amax = max |x_i|                          (a max: the same in any order)
  amax < 2^-64 (zero included):  d = 0, every q = 0 (for a subnormal amax 127 / amax would overflow;
              such a block adds nothing measurable to any sum)
  else:       d = amax / 127, id = 127 / amax (two divisions, each rounded once)
              q_i = x_i * id rounded to nearest, ties to even, clamped to [-127, 127]
The rounding is the magic-number add and subtract, (v + 1.5 * 2^23) - 1.5 * 2^23, exact for
|v| < 2^22 (here |v| <= 127 and a rounding): np.rint's result and llama.cpp's x86 `_mm256_round_ps`
path. llama.cpp's reference `quantize_row_q8_0_ref` differs (1 / d, ties away from zero); one rule is
kept everywhere. d stays float32 where llama.cpp rounds Q8_0's to fp16: more accurate, not its bits.
A block holding a NaN or an infinity gets d = NaN and q = 0: its products are NaN, and so are the
outputs, whichever weights meet it (inf * 0 must not become a quant).

Stored per row t: xq[t] int8 (K,), each group of 8 elements in the order (0, 2, 4, 6, 1, 3, 5, 7) (the
nibble order of the weight words, `packing/intpanels.py`); xd[t] float32 (K / block,) the scales; xs[t] int32
(K / 16,) the integer sums of q over each 16 elements, for the weight offsets (Q4_0's -8, Q5_0's -16)
and mins (Q4_1) folded in after the integer dot.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ...numerics.simd import _f32_as_u32, _u32_as_f32

f32 = np.float32
TINY = np.float32(2.0 ** -64)  # blocks with a smaller amax are quantized as zeros


@njit(cache=True, inline="always")
def slot(k):
    """Where element k of a row is stored: groups of 8 as (0, 2, 4, 6, 1, 3, 5, 7)."""
    r = k & 7
    return (k - r) + (r & 1) * 4 + (r >> 1)


@njit(cache=True, inline="always")
def _q(v, inv):
    r = (v * inv + f32(12582912.0)) - f32(12582912.0)  # 1.5 * 2^23: round to nearest, ties to even
    return np.int8(min(max(r, f32(-127.0)), f32(127.0)))


@njit(cache=True)
def quantize_rows(x, t0, t1, B, xq, xd, xs):
    """Rows t0 .. t1 of x (T, K) into xq (T, K) int8, xd (T, K / B) float32, xs (T, K / 16) int32 by
    the module's rule with blocks of B (32 or 256; K a multiple of B)."""
    K = x.shape[1]
    for t in range(t0, t1):
        for b0 in range(0, K, B):
            # amax as the largest |x| bit pattern: for non-negative floats the integer order is the
            # float order, an integer max vectorizes, and NaN / infinity show as >= 0x7F800000
            m = np.uint32(0)
            for k in range(b0, b0 + B):
                m = max(m, _f32_as_u32(x[t, k]) & np.uint32(0x7FFFFFFF))
            amax = _u32_as_f32(m)
            if m >= np.uint32(0x7F800000) or amax < TINY:
                xd[t, b0 // B] = f32(np.nan) if m >= np.uint32(0x7F800000) else f32(0.0)
                xq[t, b0:b0 + B] = 0
            else:
                xd[t, b0 // B] = amax / f32(127.0)
                inv = f32(127.0) / amax
                for k0 in range(b0, b0 + B, 8):
                    for i in range(4):
                        xq[t, k0 + i] = _q(x[t, k0 + 2 * i], inv)
                        xq[t, k0 + 4 + i] = _q(x[t, k0 + 2 * i + 1], inv)
            for k0 in range(b0, b0 + B, 16):
                s = np.int32(0)
                for k in range(k0, k0 + 16):
                    s += np.int32(xq[t, k])
                xs[t, k0 // 16] = s


@njit(cache=True)
def quantize(x, B):
    """All rows of x (T, K) float32: (xq, xd, xs) as `quantize_rows` makes them."""
    T, K = x.shape
    xq = np.empty((T, K), np.int8)
    xd = np.empty((T, K // B), np.float32)
    xs = np.empty((T, K // 16), np.int32)
    quantize_rows(x, 0, T, B, xq, xd, xs)
    return xq, xd, xs
