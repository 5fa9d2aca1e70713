"""GGUF's quantized blocks kept as the file stores them (kind "native", one ggml type per kind:
`packing.layout.NATIVE_TYPES`), in the quantized panels of `packing/layout.py`: the storage (tag, qs, d, m, sc, qh),
stacked over layers on every array's first axis. `qblocks.py` reads each type's blocks as float32,
exactly the values `formats.dequant` gives, so every type computes the float32 matrix's bits.

A quantized panel (32 rows) is one decode unit; a prefill group of 64 outputs is a pair of panels,
dequantized once into a float32 buffer and tiled like float panels. A few rows (under Q_DEQUANTIZE)
dequantize each panel in registers instead, a few rows at a time (`few_rows`)."""

from __future__ import annotations

from functools import lru_cache

from numba import njit
from numba.extending import overload

from ....packing.layout import QBLOCK
from ..qblocks import q_dequantize_pair, q_element, q_rows, q_unit, q_unit_pair
from ....numerics.simd import HALF, LANES, target_isa, v_part
from ..tiles import buffered, put
from .common import act_alloc, act_rows, pick, prefetch_panels, quantizes  # noqa: F401 (x as it is)
from .floats import buffered_tiling

# Quantized panels (and kinds mixing them with float panels): dequantized into the buffer from this
# many tokens on; fewer dequantize each panel in registers for a few rows at a time (SmolLM2's w13,
# 3072 x 576 Q4_1, 2 threads: AVX-512 8 rows 182 against 289 us, 16 rows 351 against 404; AVX2 4 rows
# 154 against 194 us, 8 rows 304 against 285).
Q_DEQUANTIZE = {"avx512": 17, "avx2": 8, "sse": 8}

# Rows a quantized panel's weights are dequantized once for under `few_rows` (`qblocks.q_rows`): each
# row keeps 3 vectors of 32 lanes, 6 zmm on AVX-512, 12 ymm on AVX2, where 4 rows spill yet beat 2
# (w13 above, 8 rows: 304 against 357 us).
Q_ROWS = {"avx512": 4, "avx2": 4, "sse": 2}


def units(w):
    return lambda w: w[1].shape[0]


def groups(w):
    return lambda w: (w[1].shape[0] + 1) // 2


tiling = buffered_tiling  # each group's pair dequantized into the buffer


def few_rows(w, T):
    limit = Q_DEQUANTIZE[target_isa()]
    return lambda w, T: T < limit


@lru_cache(maxsize=None)
def _few_quantized():
    """f(x, w, p0, n_out, out, u0, u1, c0): every row of x times units u0 .. u1 of quantized panels, a
    panel at a time, its rows Q_ROWS at a time (the remainder by pairs, then alone)."""
    R = Q_ROWS[target_isa()]
    sizes = sorted({R, 2, 1}, reverse=True)
    src = ["def f(x, w, p0, n_out, out, u0, u1, c0):", "    T = x.shape[0]", "    for u in range(u0, u1):",
           "        n0 = c0 + u * HALF", "        t = 0", "        while t < T:"]
    for j, n in enumerate(sizes):
        src.append(f"            {'if' if j == 0 else 'elif'} T - t >= {n}:" if n > 1 else "            else:")
        src.append(f"                s = rows{n}(x, w, p0 + u, t)")
        src += [f"                put(out, t + {i}, n0, n_out, v_part(s, {i}), HALF)" for i in range(n)]
        src.append(f"                t += {n}")
    scope = {"HALF": HALF, "put": put, "v_part": v_part, **{f"rows{n}": q_rows(n) for n in sizes}}
    exec("\n".join(src), scope)  # noqa: S102 (generated from the lines above)
    return njit(inline="always")(scope["f"])


def _gemv_at(x, w, p0, n_out, out, u0, u1, c0):
    raise NotImplementedError("_gemv_at is for jitted code")


@overload(_gemv_at)
def _gemv_at_impl(x, w, p0, n_out, out, u0, u1, c0):
    """gemv_units on the panels from p0 on of w, writing output u * 32 + j at column c0 + u * 32 + j
    (clipped at n_out)."""
    few_q = _few_quantized()

    def quantized(x, w, p0, n_out, out, u0, u1, c0):
        if x.shape[0] > 1:  # a few rows (`few_rows`)
            few_q(x, w, p0, n_out, out, u0, u1, c0)
            return
        u = u0
        while u + 2 <= u1:  # two panels at a time (`q_unit_pair`), an odd last one alone
            s0, s1 = q_unit_pair(x, w, p0 + u)
            put(out, 0, c0 + u * HALF, n_out, s0, HALF)
            put(out, 0, c0 + u * HALF + HALF, n_out, s1, HALF)
            u += 2
        if u < u1:
            put(out, 0, c0 + u * HALF, n_out, q_unit(x, w, p0 + u), HALF)
    return quantized


# One compiled function per type, for every product that reads it: the matrices of the type, and the
# segments of that type of every mixed storage (`mixed.py`; inlining each part's kernels into one
# function made the compile several times slower).

@njit(cache=True)
def seg_gemv(x, w, p0, n_out, out, u0, u1, c0):
    _gemv_at(x, w, p0, n_out, out, u0, u1, c0)


@njit(cache=True)
def seg_fill(w, p0, g, wbuf):
    """Group g of the panels from p0 on (even) of w dequantized into wbuf[k * 64 + lane]."""
    pair = p0 // 2 + g
    if 2 * pair + 1 >= w[1].shape[0]:
        wbuf[:] = 0  # no second panel: zero weights
    q_dequantize_pair(w, pair, wbuf)


@njit(cache=True)
def seg_prefetch(w, p0, g):
    """Prefetch what `seg_fill(w, p0, g, ...)` reads. A job dequantizes its group, then spends the
    tiles' time on it without touching memory; prefetching the next group then lets the next fill
    find its weights in cache instead of waiting on DRAM (a batch of 8 decoding sequences, AVX2
    build: Q4_1 products 0.83-0.96x the time)."""
    q0 = p0 + 2 * g
    prefetch_panels(w[1], q0, q0 + 2)
    prefetch_panels(w[2], q0, q0 + 2)
    prefetch_panels(w[3], q0, q0 + 2)
    prefetch_panels(w[4], q0, q0 + 2)
    prefetch_panels(w[5], q0, q0 + 2)


def gemv_units(x, w, n_out, out, u0, u1):
    return lambda x, w, n_out, out, u0, u1: seg_gemv(x, w, 0, n_out, out, u0, u1, 0)


def prefill_group(x, w, g, ta, tb, n_out, out, wbuf):
    def quantized(x, w, g, ta, tb, n_out, out, wbuf):
        seg_fill(w, 0, g, wbuf)  # dequantized (a missing second panel: zeros)
        seg_prefetch(w, 0, g + 1)  # the next group
        buffered(x, ta, tb, wbuf, 0, g * LANES, n_out, out)
    return quantized


def layer(w, li):
    return lambda w, li: (w[0], w[1][li], w[2][li], pick(w[3], li), pick(w[4], li), pick(w[5], li))


def embed_rows(table, ids, x):
    def quantized(table, ids, x):
        for t in range(ids.shape[0]):
            p, j = ids[t] // HALF, ids[t] % HALF
            for k in range(x.shape[1]):
                x[t, k] = q_element(table, p, k // QBLOCK, k % QBLOCK, j)
    return quantized
