"""CPU kernels (numba). Every rule of DETERMINISM.md holds here:

- a thread owns whole outputs (a panel of 64 matrix rows, a (token, head) pair, a token) and computes
  each completely; `prange` only splits outputs, never a sum;
- each reduction runs in one order fixed by its length alone;
- fastmath is off everywhere (no FMA contraction, no reassociation);
- transcendentals come from `mathfn`.

Compensated summation: the matrix products sum plain over 64-long k-blocks and add the block partials
with Kahan compensation (DETERMINISM.md: ~8x lower error than plain fp32 at ~0.83x its speed).
RMSNorm's sum of squares, attention's q.k dots, the softmax denominator and the weighted sum of V use
per-element Kahan compensation (short sums; the cost is small next to the matrix products).

Weights are packed into panels `Wp[N/64, K, 64]` (zero-padded rows): the inner loop runs over 64
independent outputs, which LLVM vectorizes without reassociating anything. One matmul kernel serves a
single token (decode) and many (prefill): each output's arithmetic is identical in both, so prefill and
decode logits are bit-identical.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from .mathfn import exp32, sincos64

PANEL = 64  # outputs per panel
KBLOCK = 64  # k-block length of the block-Kahan sum
TOKEN_TILE = 4  # tokens sharing one pass over a panel's weights in prefill

f32 = np.float32


@intrinsic
def _u32_as_f32(typingctx, x):
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def _f32_as_u32(typingctx, x):
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@njit(cache=True)
def f16_to_f32(h):
    """IEEE binary16 bits (uint16) -> float32, exactly, by integer widening (no F16C needed).

    The half's exponent and mantissa bits, shifted into float32 position, are the value times 2**-112
    (the bias difference), normal or subnormal alike; one exact multiply by 2**112 restores it. Only
    inf/NaN need their exponent forced to all ones. Branch-free, so the matmul loop vectorizes."""
    h = np.uint32(h)
    em = (h & np.uint32(0x7FFF)) << np.uint32(13)
    bits = _f32_as_u32(_u32_as_f32(em) * f32(5.192296858534828e33))
    if (h & np.uint32(0x7C00)) == np.uint32(0x7C00):
        bits = em | np.uint32(0x7F800000)
    return _u32_as_f32(bits | ((h & np.uint32(0x8000)) << np.uint32(16)))


@njit(cache=True)
def f32_to_f16(x):
    """float32 -> IEEE binary16 bits (uint16), round to nearest even (as NumPy's astype(float16))."""
    f = _f32_as_u32(f32(x))
    sign = f & np.uint32(0x80000000)
    f = f ^ sign
    if f >= np.uint32(143 << 23):  # >= 65536.0: inf, NaN, or overflow
        o = np.uint32(0x7E00) if f > np.uint32(0x7F800000) else np.uint32(0x7C00)
    elif f < np.uint32(113 << 23):  # result is subnormal or zero
        # Adding 0.5 aligns the half's subnormal LSB with float32's ULP: the float add rounds (RNE).
        magic = np.uint32(126 << 23)
        o = _f32_as_u32(_u32_as_f32(f) + _u32_as_f32(magic)) - magic
    else:
        mant_odd = (f >> np.uint32(13)) & np.uint32(1)
        f = f + np.uint32(((15 - 127) << 23) & 0xFFFFFFFF) + np.uint32(0xFFF) + mant_odd
        o = f >> np.uint32(13)
    return np.uint16(o | (sign >> np.uint32(16)))


def widen(v):
    """Storage element -> float32 (identity for float32, binary16 bits for uint16)."""


@overload(widen, inline="always")
def _widen(v):
    if v == types.float32:
        return lambda v: v
    if v == types.uint16:
        return lambda v: f16_to_f32(v)


def narrow(x, like):
    """float32 -> the storage type of `like`'s array (float32 or binary16 bits)."""


@overload(narrow, inline="always")
def _narrow(x, like):
    if like.dtype == types.float32:
        return lambda x, like: f32(x)
    if like.dtype == types.uint16:
        return lambda x, like: f32_to_f16(x)


@njit(cache=True)
def to_f16_bits(a):
    """float32 array -> binary16 bits, RNE; the one place weights are rounded to fp16."""
    flat = a.ravel()
    out = np.empty(flat.size, np.uint16)
    for i in range(flat.size):
        out[i] = f32_to_f16(flat[i])
    return out.reshape(a.shape)


@njit(cache=True)
def from_f16_bits(a):
    flat = a.ravel()
    out = np.empty(flat.size, np.float32)
    for i in range(flat.size):
        out[i] = f16_to_f32(flat[i])
    return out.reshape(a.shape)


@njit(parallel=True, cache=True)
def matmul(x, wp, n_out, out):
    """out[t, n] = sum_k x[t, k] * W[n, k] for panel-packed wp[P, K, 64].

    Per output: plain float32 sums over k-blocks [0,64), [64,128), ... in k order, the block partials
    added in block order with Kahan compensation. Neither the token tile nor the thread count enters
    the arithmetic of any output."""
    T, K = x.shape
    P = wp.shape[0]
    n_tiles = (T + TOKEN_TILE - 1) // TOKEN_TILE
    for job in prange(P * n_tiles):
        p = job // n_tiles
        t0 = (job % n_tiles) * TOKEN_TILE
        nt = min(TOKEN_TILE, T - t0)
        s = np.zeros((TOKEN_TILE, PANEL), np.float32)
        c = np.zeros((TOKEN_TILE, PANEL), np.float32)
        part = np.empty((TOKEN_TILE, PANEL), np.float32)
        for k0 in range(0, K, KBLOCK):
            k1 = min(K, k0 + KBLOCK)
            part[:] = 0.0
            for k in range(k0, k1):
                for t in range(nt):
                    xv = x[t0 + t, k]
                    for j in range(PANEL):
                        part[t, j] += widen(wp[p, k, j]) * xv
            for t in range(nt):
                for j in range(PANEL):
                    y = part[t, j] - c[t, j]
                    z = s[t, j] + y
                    c[t, j] = (z - s[t, j]) - y
                    s[t, j] = z
        n0 = p * PANEL
        nj = min(PANEL, n_out - n0)
        for t in range(nt):
            for j in range(nj):
                out[t0 + t, n0 + j] = s[t, j]


@njit(parallel=True, cache=True)
def rmsnorm(x, w, eps, out):
    """out[t] = x[t] / sqrt(mean(x[t]**2) + eps) * w. Sum of squares: Kahan, in index order."""
    T, D = x.shape
    for t in prange(T):
        s = f32(0.0)
        c = f32(0.0)
        for i in range(D):
            y = x[t, i] * x[t, i] - c
            z = s + y
            c = (z - s) - y
            s = z
        inv = f32(1.0) / np.sqrt(s / f32(D) + eps)
        for i in range(D):
            out[t, i] = (x[t, i] * inv) * w[i]


@njit(parallel=True, cache=True)
def rope_store(qkv, q_dim, kv_dim, head_dim, cos, sin, pos, slot, k_cache, v_cache, q_out):
    """Rotate q and k of each row t (position pos[t] of sequence slot[t]; HF half-split layout: pairs
    (i, i + hd/2)), write q to q_out and k, v into the layer's cache (n_slots, capacity, kv_dim),
    rounded there once if the cache is fp16."""
    T = qkv.shape[0]
    half = head_dim // 2
    n_q = q_dim // head_dim
    n_kv = kv_dim // head_dim
    for t in prange(T):
        p = pos[t]
        s = slot[t]
        for h in range(n_q + n_kv):
            base = h * head_dim
            for i in range(half):
                x0 = qkv[t, base + i]
                x1 = qkv[t, base + i + half]
                cs = cos[p, i]
                sn = sin[p, i]
                r0 = x0 * cs - x1 * sn
                r1 = x1 * cs + x0 * sn
                if h < n_q:
                    q_out[t, base + i] = r0
                    q_out[t, base + i + half] = r1
                else:
                    kb = base - q_dim
                    k_cache[s, p, kb + i] = narrow(r0, k_cache)
                    k_cache[s, p, kb + i + half] = narrow(r1, k_cache)
        for i in range(kv_dim):
            v_cache[s, p, i] = narrow(qkv[t, q_dim + kv_dim + i], v_cache)


@njit(parallel=True, cache=True)
def attention(q, k_cache, v_cache, pos, slot, n_heads, n_kv_heads, head_dim, scale, out):
    """Causal grouped-query attention: row t attends to positions 0..pos[t] of sequence slot[t].

    One (row, head) pair per work item; scores, softmax and the weighted sum of V run over cache
    positions in order, so a row's result depends neither on how its prompt was chunked nor on
    which other sequences share the batch."""
    T = q.shape[0]
    group = n_heads // n_kv_heads
    for job in prange(T * n_heads):
        t = job // n_heads
        h = job % n_heads
        sl = slot[t]
        n = pos[t] + 1
        qo = h * head_dim
        ko = (h // group) * head_dim
        scores = np.empty(n, np.float32)
        m = -np.inf
        for i in range(n):
            s = f32(0.0)
            c = f32(0.0)
            for d in range(head_dim):
                y = q[t, qo + d] * widen(k_cache[sl, i, ko + d]) - c
                z = s + y
                c = (z - s) - y
                s = z
            s = s * scale
            scores[i] = s
            if s > m:
                m = s
        den = f32(0.0)
        dc = f32(0.0)
        for i in range(n):
            e = exp32(scores[i] - m)
            scores[i] = e
            y = e - dc
            z = den + y
            dc = (z - den) - y
            den = z
        acc = np.zeros(head_dim, np.float32)
        cmp = np.zeros(head_dim, np.float32)
        for i in range(n):
            p = scores[i]
            for d in range(head_dim):
                y = p * widen(v_cache[sl, i, ko + d]) - cmp[d]
                z = acc[d] + y
                cmp[d] = (z - acc[d]) - y
                acc[d] = z
        for d in range(head_dim):
            out[t, qo + d] = acc[d] / den


@njit(parallel=True, cache=True)
def swiglu(gu, ffn_dim, out):
    """out = silu(gate) * up, silu(g) = g / (1 + e**-g); gu holds [gate | up] per token."""
    T = gu.shape[0]
    for t in prange(T):
        for i in range(ffn_dim):
            g = gu[t, i]
            out[t, i] = (g / (f32(1.0) + exp32(-g))) * gu[t, ffn_dim + i]


@njit(parallel=True, cache=True)
def add_inplace(x, y):
    T, D = x.shape
    for t in prange(T):
        for i in range(D):
            x[t, i] = x[t, i] + y[t, i]


@njit(cache=True)
def embed(table, ids, out):
    """out[t] = table[ids[t]] widened to float32 (exact)."""
    for t in range(ids.shape[0]):
        row = ids[t]
        for i in range(out.shape[1]):
            out[t, i] = widen(table[row, i])


@njit(cache=True)
def widen_rows(cache, slots, pos):
    """cache[slots[t], pos[t]] as float32 rows (for tracing what the cache holds)."""
    out = np.empty((pos.shape[0], cache.shape[2]), np.float32)
    for t in range(pos.shape[0]):
        for i in range(cache.shape[2]):
            out[t, i] = widen(cache[slots[t], pos[t], i])
    return out


@njit(cache=True)
def rope_tables(n_pos, inv_freq, cos, sin):
    """cos/sin[pos, i] of pos * inv_freq[i], in float64 with tinydet's own sincos, rounded once."""
    for p in range(n_pos):
        for i in range(inv_freq.shape[0]):
            s, c = sincos64(np.float64(p) * inv_freq[i])
            cos[p, i] = np.float32(c)
            sin[p, i] = np.float32(s)


def pack_panels(w: np.ndarray) -> np.ndarray:
    """W[N, K] -> Wp[ceil(N/64), K, 64], rows past N zero. Layout only: no arithmetic."""
    n, k = w.shape
    p = -(-n // PANEL)
    padded = np.zeros((p * PANEL, k), w.dtype)
    padded[:n] = w
    return np.ascontiguousarray(padded.reshape(p, PANEL, k).transpose(0, 2, 1))
