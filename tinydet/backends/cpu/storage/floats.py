"""Float panels (kinds "f32" and "f16"): W[N, K] as Wp[ceil(N/64), K, 64] of float32, or of fp16 bits
(uint16) widened exactly where read (`packing.layout.pack_panels`). The storage is the array itself (stacked
over layers: (L, P, K, 64)); a mixed storage's float part is (tag, panels, None, None, None, None).

A float panel is two decode units of 32 outputs and one prefill group of 64. fp32 panels are tiled
straight from memory; fp16 panels, for many tokens, are widened once per group into a float32 buffer
(`prefill_group`), and for a few, read by the decode split (`few_rows`)."""

from __future__ import annotations

from numba import njit, types
from numba.extending import overload

from ....numerics.simd import HALF, LANES, v_load, v_store, widen
from ..tiles import buffered, dot, put, rows_for, tiles_for
from .common import act_alloc, act_rows, prefetch_panels, quantizes  # noqa: F401 (x as it is)

# fp16 panels: from this many tokens on, widened once per group into a float32 buffer (`prefill_group`);
# fewer are read directly by `gemv_units` (`few_rows`).
HALF_WIDEN = 16


def units(w):
    return lambda w: 2 * w.shape[0]


def groups(w):
    return lambda w: w.shape[0]


def tiling(w, T):
    # fp32 panels are read from memory (`tiles.SHAPES` "direct"): 8 tiles per job, and a job as small
    # as one tile where that evens out the threads' share (a second reader of a panel finds it in the
    # shared cache). A dequantized pair, or an fp16 panel widened, sits in a cache-resident buffer
    # ("buffered"): up to 16 tiles per job so that each panel is converted once for many tokens, and
    # no job under 3 tiles, since each job converts its group again (8 decoding sequences, AVX2 build,
    # Q4_1: the 9 groups of wo and down as 9 jobs of 8 rows, not 18 of 6 or 2, 0.91-0.92x the time;
    # fp32's 8-row jobs 1.05x the time of two of 4 rows).
    if w.dtype == types.uint16:
        return buffered_tiling(w, T)
    direct = rows_for("direct")
    return lambda w, T: (direct(T), 8, 1)


def buffered_tiling(w, T):
    """`tiling` of a storage whose groups are converted into the float32 buffer."""
    buffered = rows_for("buffered")
    return lambda w, T: (buffered(T), 16, 3)


def few_rows(w, T):
    # fp16 panels under HALF_WIDEN rows: the decode split over 32-output units, each unit's weights
    # widened once for every row (`tiles.tiles_for("few")`), instead of once per 4-row tile.
    if w.dtype == types.uint16:
        return lambda w, T: T < HALF_WIDEN
    return lambda w, T: False


def gemv_at(x, w, p0, n_out, out, u0, u1, c0):
    raise NotImplementedError("gemv_at is for jitted code")


@overload(gemv_at)
def _gemv_at(x, w, p0, n_out, out, u0, u1, c0):
    """gemv_units on the panels from p0 on of w, writing output u * 32 + j at column c0 + u * 32 + j
    (clipped at n_out)."""
    panel, half = dot(1, LANES), dot(1, HALF)

    @njit(inline="always")
    def one_row(x, t, w, p0, n_out, out, u0, u1, c0):
        # Two halves of one panel in the range run as one panel. Decode gives each thread an equal
        # run of units, so a panel count that does not split evenly is balanced by halving one panel.
        K = x.shape[1]
        u = u0
        while u < u1:
            p = u // 2
            if u % 2 == 0 and u + 2 <= u1:
                put(out, t, c0 + p * LANES, n_out, panel(x, (t * K,), K, w, (p0 + p) * K * LANES)[0], LANES)
                u += 2
            else:
                hoff = (u % 2) * HALF
                s = half(x, (t * K,), K, w, (p0 + p) * K * LANES + hoff)[0]
                put(out, t, c0 + p * LANES + hoff, n_out, s, HALF)
                u += 1

    if w.dtype != types.uint16:
        # fp32 panels: one row (decode), or a few as a segment of mixed storage whose other types take
        # a few rows (`few_rows`), row by row; not the few-rows tiles, which cost 20 s of compiling
        # and only a batch on fp16 panels gains from
        def rows(x, w, p0, n_out, out, u0, u1, c0):
            for t in range(x.shape[0]):
                one_row(x, t, w, p0, n_out, out, u0, u1, c0)
        return rows
    few = tiles_for("few")

    def panels(x, w, p0, n_out, out, u0, u1, c0):
        # A few rows (`few_rows`) run half panels, several rows a pass.
        if x.shape[0] > 1:
            K = x.shape[1]
            for u in range(u0, u1):
                few(x, 0, x.shape[0], w, (p0 + u // 2) * K * LANES + (u % 2) * HALF, c0 + u * HALF, n_out, out)
            return
        one_row(x, 0, w, p0, n_out, out, u0, u1, c0)
    return panels


def gemv_units(x, w, n_out, out, u0, u1):
    return lambda x, w, n_out, out, u0, u1: gemv_at(x, w, 0, n_out, out, u0, u1, 0)


@njit(inline="always")
def _fill_at(w, p0, g, wbuf):
    """Panel p0 + g of w as float32 in wbuf[k * 64 + lane], widened exactly or copied."""
    K = w.shape[1]
    for k in range(K):
        v_store(wbuf, k * LANES, v_load(w, ((p0 + g) * K + k) * LANES))


def prefill_group(x, w, g, ta, tb, n_out, out, wbuf):
    if w.dtype == types.uint16:
        # fp16 panels: for a prompt's many tokens, the group's panel is widened (exactly) once into a
        # cache-resident float32 buffer instead of at every load of every tile (a batch of a few
        # decoding sequences, under HALF_WIDEN tokens, takes gemv_units instead: `few_rows`).
        def half(x, w, g, ta, tb, n_out, out, wbuf):
            _fill_at(w, 0, g, wbuf)
            prefetch_panels(w, g + 1, g + 2)  # the next group (`quantized.prefetch_at`)
            buffered(x, ta, tb, wbuf, 0, g * LANES, n_out, out)
        return half
    direct = tiles_for("direct")
    return lambda x, w, g, ta, tb, n_out, out, wbuf: direct(x, ta, tb, w, g * x.shape[1] * LANES, g * LANES, n_out, out)


def layer(w, li):
    return lambda w, li: w[li]


def embed_rows(table, ids, x):
    if table.ndim == 3:
        def panels(table, ids, x):
            for t in range(ids.shape[0]):
                p, j = ids[t] // LANES, ids[t] % LANES
                for i in range(x.shape[1]):
                    x[t, i] = widen(table[p, i, j])
        return panels

    def rows(table, ids, x):  # a (vocab, dim) table
        for t in range(ids.shape[0]):
            for i in range(x.shape[1]):
                x[t, i] = widen(table[ids[t], i])
    return rows


# A float part of a mixed storage (`mixed.py`): part = (tag, panels, None, None, None, None). One
# compiled function per panel type, shared by every kind with such a part (inlining each part's
# kernels into one function made the compile several times slower).

@njit(cache=True)
def seg_gemv(x, part, p0, n_out, out, u0, u1, c0):
    gemv_at(x, part[1], p0, n_out, out, u0, u1, c0)


@njit(cache=True)
def seg_fill(part, p0, g, wbuf):
    _fill_at(part[1], p0, g, wbuf)


@njit(cache=True)
def seg_prefetch(part, p0, g):
    prefetch_panels(part[1], p0 + g, p0 + g + 1)
