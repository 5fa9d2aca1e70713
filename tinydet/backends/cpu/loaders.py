"""How the one matrix product (`matmul.py`) reads each storage type: float panels (float32 or fp16
bits) and GGUF's quantized blocks (Q8_0, Q4_0, Q4_1) in the panel layout of `layout.py`.

Every weight reaches the sum as exactly the float32 value `formats.dequant` gives it (`qblocks.py`
says how, type by type), so every storage type computes the bits of the float32 matrix.

A storage type provides, to the shared drivers:
  units(W)            decode units of 32 outputs (a float panel is two, a quantized panel one)
  groups(W)           prefill groups of 64 outputs (a float panel, or a pair of quantized panels)
  gemv_units(...)     token 0 times units u0 .. u1 (decode; the thread's share)
  prefill_group(...)  tokens ta .. tb times group g (prefill: quantized panels are dequantized, and
                      fp16 panels widened, once into a float32 buffer, then tiled like float panels)
  tiling(W)           (tokens per tile, tiles per job) for prefill: only the split of work
  layer(W, li)        layer li of a matrix kind stacked over layers
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from .layout import QBLOCK, QPanels, as_storage
from .qblocks import q_dequantize_pair, q_element, q_unit
from .simd import HALF, LANES, v_load, v_store, widen
from .tiles import dot1, dot1_half, put, tiles4, tiles6


# ---------------------------------------------------------------------------------------------------
# The storage interface (module docstring).

def units(w):
    raise NotImplementedError("units is for jitted code")


@overload(units)
def _units(w):
    if isinstance(w, types.BaseTuple):
        return lambda w: w[0].shape[0]
    return lambda w: 2 * w.shape[0]


def groups(w):
    raise NotImplementedError("groups is for jitted code")


@overload(groups)
def _groups(w):
    if isinstance(w, types.BaseTuple):
        return lambda w: (w[0].shape[0] + 1) // 2
    return lambda w: w.shape[0]


def tiling(w):
    raise NotImplementedError("tiling is for jitted code")


@overload(tiling)
def _tiling(w):
    # fp32 panels are read from memory: 4 tokens per pass (16 zmm accumulators) measured fastest.
    # A dequantized pair, or an fp16 panel widened, sits in a cache-resident buffer: 6 tokens, and up
    # to 16 tiles per job so that each panel is converted once for many tokens.
    if isinstance(w, types.BaseTuple) or w.dtype == types.uint16:
        return lambda w: (6, 16)
    return lambda w: (4, 8)


def gemv_units(x, w, n_out, out, u0, u1):
    raise NotImplementedError("gemv_units is for jitted code")


@overload(gemv_units)
def _gemv_units(x, w, n_out, out, u0, u1):
    if isinstance(w, types.BaseTuple):
        def quantized(x, w, n_out, out, u0, u1):
            for u in range(u0, u1):
                put(out, 0, u * HALF, n_out, q_unit(x, w[0], w[1], w[2], u), HALF)
        return quantized

    def panels(x, w, n_out, out, u0, u1):
        # Two halves of one panel in the range run as one panel. Decode gives each thread an equal
        # run of units, so a panel count that does not split evenly is balanced by halving one panel.
        K = x.shape[1]
        u = u0
        while u < u1:
            p = u // 2
            if u % 2 == 0 and u + 2 <= u1:
                put(out, 0, p * LANES, n_out, dot1(x, 0, K, w, p * K * LANES), LANES)
                u += 2
            else:
                hoff = (u % 2) * HALF
                put(out, 0, p * LANES + hoff, n_out, dot1_half(x, 0, K, w, p * K * LANES + hoff), HALF)
                u += 1
    return panels


def prefill_group(x, w, g, ta, tb, n_out, out):
    raise NotImplementedError("prefill_group is for jitted code")


@overload(prefill_group)
def _prefill_group(x, w, g, ta, tb, n_out, out):
    if isinstance(w, types.BaseTuple):
        def quantized(x, w, g, ta, tb, n_out, out):
            K = x.shape[1]
            wbuf = np.empty(K * LANES, np.float32) if 2 * g + 1 < w[0].shape[0] else np.zeros(K * LANES, np.float32)
            q_dequantize_pair(w[0], w[1], w[2], g, wbuf)
            tiles6(x, ta, tb, wbuf, 0, g * LANES, n_out, out)
        return quantized
    if w.dtype == types.uint16:
        # fp16 panels: for a prompt's many tokens, the group's panel is widened (exactly) once into a
        # cache-resident float32 buffer instead of at every load of every tile; a batch of a few
        # decoding sequences reads the panel directly (measured faster below 16 tokens).
        def half(x, w, g, ta, tb, n_out, out):
            K = x.shape[1]
            if tb - ta < 16:
                tiles4(x, ta, tb, w, g * K * LANES, g * LANES, n_out, out)
                return
            wbuf = np.empty(K * LANES, np.float32)
            for k in range(K):
                v_store(wbuf, k * LANES, v_load(w, (g * K + k) * LANES))
            tiles6(x, ta, tb, wbuf, 0, g * LANES, n_out, out)
        return half
    return lambda x, w, g, ta, tb, n_out, out: tiles4(x, ta, tb, w, g * x.shape[1] * LANES, g * LANES, n_out, out)


def layer(w, li):
    raise NotImplementedError("layer is for jitted code")


@overload(layer, inline="always")
def _layer(w, li):
    if isinstance(w, types.BaseTuple):
        if isinstance(w[2], types.NoneType):
            return lambda w, li: (w[0][li], w[1][li], None)
        return lambda w, li: (w[0][li], w[1][li], w[2][li])
    return lambda w, li: w[li]


# ---------------------------------------------------------------------------------------------------
# Rows of a matrix (an embedding table, or a tied output matrix serving as one), widened exactly.

def embed_rows(table, ids, x):
    """x[t] = row ids[t] of `table`: a float (vocab, dim) table, float panels, or quantized panels."""
    raise NotImplementedError("embed_rows is for jitted code")


@overload(embed_rows)
def _embed_rows(table, ids, x):
    if isinstance(table, types.BaseTuple):
        def quantized(table, ids, x):
            qs, d, m = table
            for t in range(ids.shape[0]):
                p, j = ids[t] // HALF, ids[t] % HALF
                for k in range(x.shape[1]):
                    x[t, k] = q_element(qs, d, m, p, k // QBLOCK, k % QBLOCK, j)
        return quantized
    if table.ndim == 3:
        def panels(table, ids, x):
            for t in range(ids.shape[0]):
                p, j = ids[t] // LANES, ids[t] % LANES
                for i in range(x.shape[1]):
                    x[t, i] = widen(table[p, i, j])
        return panels

    def rows(table, ids, x):
        for t in range(ids.shape[0]):
            for i in range(x.shape[1]):
                x[t, i] = widen(table[ids[t], i])
    return rows


@njit(cache=True)
def _embed(table, ids, x):
    embed_rows(table, ids, x)


def embed(w, ids, out) -> None:
    """out[t] = row ids[t] of the matrix W (float panels, a (vocab, dim) table or `QPanels`), widened or
    dequantized exactly as `formats.dequant` gives it (so a quantized token table can stay quantized,
    and serve as the tied output matrix too)."""
    ids = np.ascontiguousarray(ids, np.int64).reshape(-1)
    if not (isinstance(out, np.ndarray) and out.dtype == np.float32 and out.ndim == 2 and out.flags.c_contiguous):
        raise TypeError("embed: out must be a C-contiguous float32 2-D array")
    if isinstance(w, QPanels):
        w.check()
        n, k = w.n, w.k
    else:
        n, k = (w.shape[0] * LANES, w.shape[1]) if w.ndim == 3 else w.shape
    if out.shape != (ids.shape[0], k):
        raise ValueError(f"embed: out {out.shape} does not fit {ids.shape[0]} rows of {k}")
    if ids.size and (ids.min() < 0 or ids.max() >= n):
        raise ValueError(f"embed: row ids must lie in [0, {n})")
    _embed(as_storage(w), ids, out)
