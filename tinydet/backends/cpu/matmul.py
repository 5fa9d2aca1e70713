"""The one matrix product of the CPU backend, for every storage type (`loaders.py`): out = x W^T.

Per output (t, n): plain float32 sums over k-blocks [0, 64), [64, 128), ... in k order, the block
partials added in block order with Kahan compensation (docs/determinism.md: ~8x lower error than plain
fp32 at ~0.83x its speed). Neither the token count, the tile, the thread count nor the storage type
enters any output's arithmetic, so prefill and decode give the same bits, and native storage gives
fp32's bits (each weight is dequantized to exactly the float32 value fp32 stores).

The integer mode's storage (`intdot.py`) computes its own rule instead: each row of x is first
quantized to 8-bit blocks (`actq.py`, a run of rows per thread), then the same split of outputs runs
the integer block dots.

Work split (never a sum): one token (decode), or a few on fp16 or quantized panels (a batch of
decoding sequences, a speculative check: `loaders.few_rows`), gives each of the nth threads an equal run of 32-output units; more tokens give
jobs of (a group of 64 outputs, a chunk of token tiles), each thread an equal run of them, and the
groups left over from an even share split by rows, a part for each thread. After its outputs, a job
applies the epilogue to them, in the same parallel region:
  MM_PLAIN     nothing more;
  MM_RESIDUAL  res += out (each output added by the thread that computed it);
  MM_GLU       out holds [gate | up] (n_out = 2 ffn_dim, ffn_dim % 64 == 0): act = f(gate) * up with
               f SiLU or GELU-tanh; a job computes gate and up of the same outputs, then their product.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ...packing.intpanels import IntPanels
from ...packing.layout import QPanels
from .loaders import act_alloc, act_rows, few_rows, quantizes, gemv_units, groups, prefill_group, tiling, units
from .ops import glu_span
from .storage.kinds import as_storage
from ...numerics.simd import HALF, LANES

MM_PLAIN, MM_RESIDUAL, MM_GLU = 0, 1, 2


@njit(cache=True)
def split_chunks(T, G, nth, tile, chunk_tiles, min_tiles):
    """Token chunks per column of G jobs (output groups) for T tokens in tiles of `tile`: about
    `chunk_tiles` tiles each and, where chunks keep `min_tiles` tiles, a job count the nth threads
    share evenly. Only the split of work depends on it, never any output's arithmetic."""
    if T == 1:
        return 1
    n_tiles = (T + tile - 1) // tile
    c = (n_tiles + chunk_tiles - 1) // chunk_tiles
    for extra in range(nth):
        if (extra == 0 or (c + extra) * min_tiles <= n_tiles) and ((c + extra) * G) % nth == 0:
            return c + extra
    return c


@njit(cache=True, inline="always")
def chunk_range(T, C, c, tile):
    """Tokens [ta, tb) of chunk c of C (whole tiles but the last)."""
    n_tiles = (T + tile - 1) // tile
    return (c * n_tiles // C) * tile, min(T, ((c + 1) * n_tiles // C) * tile)


@njit(cache=True)
def _epilogue(out, ta, tb, n0, n1, n_out, mode, res, act, kind):
    """The mode's epilogue on outputs n0..n1 of rows ta..tb (one call per job)."""
    if mode == MM_RESIDUAL:
        for t in range(ta, tb):
            for j in range(n0, min(n_out, n1)):
                res[t, j] = res[t, j] + out[t, j]
    elif mode == MM_GLU:
        glu_span(out, ta, tb, n_out // 2, act, n0, n1, kind)


# Each parallel loop's body is a function of its own, its indices int64: numba types a prange body
# twice (in the function, then as its outlined loop, where the index is uint64), and compiled what the
# body inlines both times, each type of index once more (the decode kernels of fp32: 44 s of 96).

@njit(cache=True)
def _quantize_rows(x, w, xa, th, nth):
    T = x.shape[0]
    act_rows(x, w, xa, th * T // nth, (th + 1) * T // nth)


@njit(cache=True)
def units_span(xa, T, w, n_out, out, u0, u1, parts, mode, res, act, kind):
    """Units u0 .. u1 of the T rows of xa (`act_alloc`'s), then the mode's epilogue on their outputs:
    a decode job's work, also run by the mixture's experts (`moe.py`), with the same bits."""
    U = units(w) // parts  # a GLU's unit u of the gate goes with unit U + u of the up part
    for part in range(parts):
        gemv_units(xa, w, n_out, out, u0 + part * U, u1 + part * U)
    _epilogue(out, np.int64(0), T, u0 * HALF, u1 * HALF, n_out, mode, res, act, kind)


@njit(cache=True)
def _units_job(x, xa, w, n_out, out, th, nth, parts, mode, res, act, kind):
    U = units(w) // parts
    units_span(xa, x.shape[0], w, n_out, out, th * U // nth, (th + 1) * U // nth, parts, mode, res, act, kind)


@njit(cache=True)
def _group_jobs(x, xa, w, n_out, out, th, nth, parts, mode, res, act, kind, wbuf):
    T = x.shape[0]
    G = groups(w) // parts
    tile, chunk_tiles, min_tiles = tiling(w, T)
    C = split_chunks(T, G, nth, tile, chunk_tiles, min_tiles)
    # Where the G C jobs do not share out evenly, the last r groups are not chunked but split by
    # rows, a part for each thread (each part converts the group again, once).
    r = G % nth if (G * C) % nth else 0
    per = (G - r) * C // nth
    buf = wbuf[th, :x.shape[1] * LANES]  # this product's K (a lone last panel zeroes it all)
    for j in range(per + r):
        if j < per:
            g = (th * per + j) // C
            ta, tb = chunk_range(T, C, (th * per + j) % C, tile)
        else:
            g = G - r + j - per
            ta, tb = chunk_range(T, nth, th, 1)
        if ta < tb:
            for part in range(parts):
                prefill_group(xa, w, g + part * G, ta, tb, n_out, out, buf)
            _epilogue(out, ta, tb, g * LANES, g * LANES + LANES, n_out, mode, res, act, kind)


@njit(cache=True)
def mm(x, w, n_out, out, nth, mode, res, act, kind, wbuf):
    """out[t, n] = sum_k x[t, k] W[n, k] for n < n_out, then the epilogue of `mode` (module docstring);
    `res` and `act` are its arrays (any float32 array where unused), `kind` the GLU's activation
    (ops.SILU or ops.GELU_TANH). x (T, K), out (T, >= n_out): C-contiguous float32; `w` a storage of
    loaders.py. `nth`, the thread count, only shapes the split of work. `wbuf`, from `scratch(nth,
    >= K)`, holds each thread's group of weights as float32. No checks (see `matmul`)."""
    # mode and kind passed on as values, not constants: a storage type's product compiles once.
    _mm(x, w, n_out, out, nth, np.int64(mode), res, act, np.int64(kind), wbuf)


@njit(parallel=True, cache=True)
def _mm(x, w, n_out, out, nth, mode, res, act, kind, wbuf):
    T = x.shape[0]
    parts = 2 if mode == MM_GLU else 1
    xa = act_alloc(x, w)  # the rows as the storage's products take them (x, or its 8-bit blocks)
    if quantizes(w):  # each row quantized once, a run of rows per thread (rows are independent)
        if T > 1:
            for th in prange(nth):
                _quantize_rows(x, w, xa, np.int64(th), nth)
        else:
            act_rows(x, w, xa, 0, T)
    if T == 1 or few_rows(w, T):
        for th in prange(nth):
            _units_job(x, xa, w, n_out, out, np.int64(th), nth, parts, mode, res, act, kind)
    else:
        for th in prange(nth):
            _group_jobs(x, xa, w, n_out, out, np.int64(th), nth, parts, mode, res, act, kind, wbuf)


@njit(cache=True)
def scratch(nth, K):
    """mm's `wbuf` for nth threads and rows of up to K: allocated once per pass, not per job. A job's
    buffer is 150-400 KB, past glibc's first mmap threshold: wherever that threshold stays fixed (any
    of MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_ set), each job mapped and
    unmapped its own pages (a 1024-token prefill, Q4_1: 630,000 page faults and 1.7x the time).
    Storages read in place never write it, so its pages are never touched."""
    return np.empty((nth, K * LANES), np.float32)


def _f32_2d(a, what):
    if not (isinstance(a, np.ndarray) and a.dtype == np.float32 and a.ndim == 2 and a.flags.c_contiguous):
        raise TypeError(f"matmul: {what} must be a C-contiguous float32 2-D array")


def check(x, w, n_out, out, res=None) -> None:
    """Raise unless matmul(x, w, n_out, out, res) is safe: the kernels read raw pointers."""
    _f32_2d(x, "x (T, K)")
    _f32_2d(out, "out (T, n_out)")
    T, K = x.shape
    if isinstance(w, (QPanels, IntPanels)):
        w.check()
        n, k = w.n, w.k
    elif (isinstance(w, np.ndarray) and w.dtype in (np.float32, np.uint16) and w.ndim == 3 and w.shape[2] == LANES
          and w.flags.c_contiguous):
        n, k = w.shape[0] * LANES, w.shape[1]
    else:
        raise TypeError("matmul: w must be C-contiguous panels (P, K, 64) of float32 or uint16, QPanels or IntPanels")
    if K != k or out.shape[0] != T or not 0 < n_out <= min(out.shape[1], n):
        raise ValueError(f"matmul: x {x.shape}, out {out.shape}, n_out {n_out} do not fit W ({n}, {k})")
    if res is not None:
        _f32_2d(res, "res (T, n_out)")
        if res.shape[0] != T or res.shape[1] < n_out:
            raise ValueError(f"matmul: res {res.shape} does not fit out {out.shape}")


def matmul(x, w, n_out, out, res=None, threads: int | None = None) -> None:
    """out[t, n] = sum_k x[t, k] * W[n, k] for n < n_out, W float panels (P, K, 64) (float32 or fp16
    bits, `packing.layout.pack_panels`) or `QPanels`; with `res` (T, >= n_out) float32, then also
    res[t, n] = res[t, n] + out[t, n]. The same bits for every storage of the same values."""
    import numba

    check(x, w, n_out, out, res)
    if x.shape[0]:
        nth = numba.get_num_threads() if threads is None else threads
        mm(x, as_storage(w), n_out, out, nth, MM_PLAIN if res is None else MM_RESIDUAL,
           out if res is None else res, out, 0, scratch(nth, x.shape[1]))
