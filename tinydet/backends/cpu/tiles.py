"""Rows times 64 outputs, for every storage type's products: a buffer holds weight k of output j at
[off + 64k + j] (a float panel, float32 or fp16 bits, or a pair of quantized panels dequantized into
float32), and each output's sum runs in the one order of every matrix product:

    s = c = 0; for each k-block [k0, k0 + 64): part = 0, then part = part + w[k] * x[t, k] for k in
    order; then y = part - c; z = s + y; c = (z - s) - y; s = z.

A tile runs that for 1, 2, 4 or 6 tokens at once over 64 outputs, or for 4 or 8 tokens over 32 of them
(`rows_half`: a few rows read an fp16 panel once, each weight widened once for all of them), so each
weight vector is loaded once per tile; tokens past the end of a range repeat the last row (computed,
never stored). Neither the tile nor the schedule enters any output's arithmetic.
"""

from __future__ import annotations

from numba import njit

from .simd import HALF, KBLOCK, LANES, at, kahan, v32_load, v32_splat, v32_zero, v_add, v_get, v_load, v_mul, v_splat, v_store, \
    v_zero


@njit(cache=True, inline="always")
def put(out, t, n0, n_out, v, width):
    """out[t, n0 : n0 + width] = v (a vector of `width` lanes), clipped at n_out."""
    if n0 + width <= n_out:
        v_store(out, t * out.shape[1] + n0, v)
    else:
        for j in range(max(0, n_out - n0)):
            out[t, n0 + j] = v_get(v, j)


@njit(cache=True, inline="always")
def dot1(x, r0, K, buf, off):
    """Row x[r0 : r0 + K] (flat offset) times the 64 outputs at buf[off:]."""
    s0 = v_zero()
    c0 = v_zero()
    for k0 in range(0, K, KBLOCK):
        a0 = v_zero()
        for k in range(k0, min(K, k0 + KBLOCK)):
            a0 = v_add(a0, v_mul(v_load(buf, off + k * LANES), v_splat(at(x, r0 + k))))
        s0, c0 = kahan(a0, s0, c0)
    return s0


@njit(cache=True, inline="always")
def dot1_half(x, r0, K, buf, off):
    """dot1 for the 32 outputs whose lanes start at buf[off:] (row stride still 64)."""
    s0 = v32_zero()
    c0 = v32_zero()
    for k0 in range(0, K, KBLOCK):
        a0 = v32_zero()
        for k in range(k0, min(K, k0 + KBLOCK)):
            a0 = v_add(a0, v_mul(v32_load(buf, off + k * LANES), v32_splat(at(x, r0 + k))))
        s0, c0 = kahan(a0, s0, c0)
    return s0


@njit(cache=True, inline="always")
def dot2(x, r0, r1, K, buf, off):
    s0 = v_zero()
    c0 = v_zero()
    s1 = v_zero()
    c1 = v_zero()
    for k0 in range(0, K, KBLOCK):
        a0 = v_zero()
        a1 = v_zero()
        for k in range(k0, min(K, k0 + KBLOCK)):
            w = v_load(buf, off + k * LANES)
            a0 = v_add(a0, v_mul(w, v_splat(at(x, r0 + k))))
            a1 = v_add(a1, v_mul(w, v_splat(at(x, r1 + k))))
        s0, c0 = kahan(a0, s0, c0)
        s1, c1 = kahan(a1, s1, c1)
    return s0, s1


@njit(cache=True, inline="always")
def dot4(x, r0, r1, r2, r3, K, buf, off):
    s0 = v_zero()
    c0 = v_zero()
    s1 = v_zero()
    c1 = v_zero()
    s2 = v_zero()
    c2 = v_zero()
    s3 = v_zero()
    c3 = v_zero()
    for k0 in range(0, K, KBLOCK):
        a0 = v_zero()
        a1 = v_zero()
        a2 = v_zero()
        a3 = v_zero()
        for k in range(k0, min(K, k0 + KBLOCK)):
            w = v_load(buf, off + k * LANES)
            a0 = v_add(a0, v_mul(w, v_splat(at(x, r0 + k))))
            a1 = v_add(a1, v_mul(w, v_splat(at(x, r1 + k))))
            a2 = v_add(a2, v_mul(w, v_splat(at(x, r2 + k))))
            a3 = v_add(a3, v_mul(w, v_splat(at(x, r3 + k))))
        s0, c0 = kahan(a0, s0, c0)
        s1, c1 = kahan(a1, s1, c1)
        s2, c2 = kahan(a2, s2, c2)
        s3, c3 = kahan(a3, s3, c3)
    return s0, s1, s2, s3


@njit(cache=True, inline="always")
def dot6(x, r0, r1, r2, r3, r4, r5, K, buf, off):
    s0 = v_zero()
    c0 = v_zero()
    s1 = v_zero()
    c1 = v_zero()
    s2 = v_zero()
    c2 = v_zero()
    s3 = v_zero()
    c3 = v_zero()
    s4 = v_zero()
    c4 = v_zero()
    s5 = v_zero()
    c5 = v_zero()
    for k0 in range(0, K, KBLOCK):
        a0 = v_zero()
        a1 = v_zero()
        a2 = v_zero()
        a3 = v_zero()
        a4 = v_zero()
        a5 = v_zero()
        for k in range(k0, min(K, k0 + KBLOCK)):
            w = v_load(buf, off + k * LANES)
            a0 = v_add(a0, v_mul(w, v_splat(at(x, r0 + k))))
            a1 = v_add(a1, v_mul(w, v_splat(at(x, r1 + k))))
            a2 = v_add(a2, v_mul(w, v_splat(at(x, r2 + k))))
            a3 = v_add(a3, v_mul(w, v_splat(at(x, r3 + k))))
            a4 = v_add(a4, v_mul(w, v_splat(at(x, r4 + k))))
            a5 = v_add(a5, v_mul(w, v_splat(at(x, r5 + k))))
        s0, c0 = kahan(a0, s0, c0)
        s1, c1 = kahan(a1, s1, c1)
        s2, c2 = kahan(a2, s2, c2)
        s3, c3 = kahan(a3, s3, c3)
        s4, c4 = kahan(a4, s4, c4)
        s5, c5 = kahan(a5, s5, c5)
    return s0, s1, s2, s3, s4, s5


@njit(cache=True, inline="always")
def tiles4(x, ta, tb, buf, off, n0, n_out, out):
    """out[ta:tb, n0 : n0 + 64] (clipped at n_out), 4 tokens per pass over the weights."""
    K = x.shape[1]
    for t in range(ta, tb, 4):
        r1 = min(t + 1, tb - 1)
        r2 = min(t + 2, tb - 1)
        r3 = min(t + 3, tb - 1)
        s0, s1, s2, s3 = dot4(x, t * K, r1 * K, r2 * K, r3 * K, K, buf, off)
        put(out, t, n0, n_out, s0, LANES)
        if t + 1 < tb:
            put(out, t + 1, n0, n_out, s1, LANES)
        if t + 2 < tb:
            put(out, t + 2, n0, n_out, s2, LANES)
        if t + 3 < tb:
            put(out, t + 3, n0, n_out, s3, LANES)


@njit(cache=True, inline="always")
def tiles6(x, ta, tb, buf, off, n0, n_out, out):
    """As tiles4 with 6 tokens per pass; the rest by 4, 2 or 1."""
    K = x.shape[1]
    t = ta
    while t < tb:
        m = tb - t
        if m == 1:
            put(out, t, n0, n_out, dot1(x, t * K, K, buf, off), LANES)
            t += 1
        elif m == 2:
            s0, s1 = dot2(x, t * K, (t + 1) * K, K, buf, off)
            put(out, t, n0, n_out, s0, LANES)
            put(out, t + 1, n0, n_out, s1, LANES)
            t += 2
        elif m <= 4:
            r3 = min(t + 3, tb - 1)
            s0, s1, s2, s3 = dot4(x, t * K, (t + 1) * K, (t + 2) * K, r3 * K, K, buf, off)
            put(out, t, n0, n_out, s0, LANES)
            put(out, t + 1, n0, n_out, s1, LANES)
            put(out, t + 2, n0, n_out, s2, LANES)
            if m > 3:
                put(out, t + 3, n0, n_out, s3, LANES)
            t += 4
        else:
            r4 = min(t + 4, tb - 1)
            r5 = min(t + 5, tb - 1)
            s0, s1, s2, s3, s4, s5 = dot6(x, t * K, (t + 1) * K, (t + 2) * K, (t + 3) * K, r4 * K, r5 * K, K, buf,
                                          off)
            put(out, t, n0, n_out, s0, LANES)
            put(out, t + 1, n0, n_out, s1, LANES)
            put(out, t + 2, n0, n_out, s2, LANES)
            put(out, t + 3, n0, n_out, s3, LANES)
            if m > 4:
                put(out, t + 4, n0, n_out, s4, LANES)
            if m > 5:
                put(out, t + 5, n0, n_out, s5, LANES)
            t += 6


@njit(cache=True, inline="always")
def dot4_half(x, r0, r1, r2, r3, K, buf, off):
    """dot4 for the 32 outputs whose lanes start at buf[off:] (row stride still 64)."""
    s0 = v32_zero()
    c0 = v32_zero()
    s1 = v32_zero()
    c1 = v32_zero()
    s2 = v32_zero()
    c2 = v32_zero()
    s3 = v32_zero()
    c3 = v32_zero()
    for k0 in range(0, K, KBLOCK):
        a0 = v32_zero()
        a1 = v32_zero()
        a2 = v32_zero()
        a3 = v32_zero()
        for k in range(k0, min(K, k0 + KBLOCK)):
            w = v32_load(buf, off + k * LANES)
            a0 = v_add(a0, v_mul(w, v32_splat(at(x, r0 + k))))
            a1 = v_add(a1, v_mul(w, v32_splat(at(x, r1 + k))))
            a2 = v_add(a2, v_mul(w, v32_splat(at(x, r2 + k))))
            a3 = v_add(a3, v_mul(w, v32_splat(at(x, r3 + k))))
        s0, c0 = kahan(a0, s0, c0)
        s1, c1 = kahan(a1, s1, c1)
        s2, c2 = kahan(a2, s2, c2)
        s3, c3 = kahan(a3, s3, c3)
    return s0, s1, s2, s3


@njit(cache=True, inline="always")
def dot8_half(x, r0, r1, r2, r3, r4, r5, r6, r7, K, buf, off):
    """8 rows times the 32 outputs whose lanes start at buf[off:] (row stride 64): 16 zmm of running
    block sums on AVX-512, each weight vector loaded (and widened) once for the 8 rows."""
    s0 = v32_zero()
    c0 = v32_zero()
    s1 = v32_zero()
    c1 = v32_zero()
    s2 = v32_zero()
    c2 = v32_zero()
    s3 = v32_zero()
    c3 = v32_zero()
    s4 = v32_zero()
    c4 = v32_zero()
    s5 = v32_zero()
    c5 = v32_zero()
    s6 = v32_zero()
    c6 = v32_zero()
    s7 = v32_zero()
    c7 = v32_zero()
    for k0 in range(0, K, KBLOCK):
        a0 = v32_zero()
        a1 = v32_zero()
        a2 = v32_zero()
        a3 = v32_zero()
        a4 = v32_zero()
        a5 = v32_zero()
        a6 = v32_zero()
        a7 = v32_zero()
        for k in range(k0, min(K, k0 + KBLOCK)):
            w = v32_load(buf, off + k * LANES)
            a0 = v_add(a0, v_mul(w, v32_splat(at(x, r0 + k))))
            a1 = v_add(a1, v_mul(w, v32_splat(at(x, r1 + k))))
            a2 = v_add(a2, v_mul(w, v32_splat(at(x, r2 + k))))
            a3 = v_add(a3, v_mul(w, v32_splat(at(x, r3 + k))))
            a4 = v_add(a4, v_mul(w, v32_splat(at(x, r4 + k))))
            a5 = v_add(a5, v_mul(w, v32_splat(at(x, r5 + k))))
            a6 = v_add(a6, v_mul(w, v32_splat(at(x, r6 + k))))
            a7 = v_add(a7, v_mul(w, v32_splat(at(x, r7 + k))))
        s0, c0 = kahan(a0, s0, c0)
        s1, c1 = kahan(a1, s1, c1)
        s2, c2 = kahan(a2, s2, c2)
        s3, c3 = kahan(a3, s3, c3)
        s4, c4 = kahan(a4, s4, c4)
        s5, c5 = kahan(a5, s5, c5)
        s6, c6 = kahan(a6, s6, c6)
        s7, c7 = kahan(a7, s7, c7)
    return s0, s1, s2, s3, s4, s5, s6, s7


@njit(cache=True, inline="always")
def rows_half(x, T, buf, off, n0, n_out, out):
    """out[0:T, n0 : n0 + 32] (clipped at n_out) for the 32 outputs whose lanes start at buf[off:]:
    8 rows per pass over the weights, the rest by 4 or 1."""
    K = x.shape[1]
    t = 0
    while t < T:
        m = T - t
        if m == 1:
            put(out, t, n0, n_out, dot1_half(x, t * K, K, buf, off), HALF)
            t += 1
        elif m <= 4:
            last = T - 1
            s = dot4_half(x, t * K, (t + 1) * K, min(t + 2, last) * K, min(t + 3, last) * K, K, buf, off)
            for i in range(4):
                if t + i < T:
                    put(out, t + i, n0, n_out, s[i], HALF)
            t += 4
        else:
            last = T - 1
            s = dot8_half(x, t * K, (t + 1) * K, (t + 2) * K, (t + 3) * K, (t + 4) * K, min(t + 5, last) * K,
                          min(t + 6, last) * K, min(t + 7, last) * K, K, buf, off)
            for i in range(8):
                if t + i < T:
                    put(out, t + i, n0, n_out, s[i], HALF)
            t += 8
