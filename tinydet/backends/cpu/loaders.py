"""How the one matrix product (`matmul.py`) reads each storage type: float panels (float32 or fp16
bits) and GGUF's quantized blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K, MXFP4) in the panel layout of
`layout.py`.

Every weight reaches the sum as exactly the float32 value `formats.dequant` gives it (`qblocks.py`
says how, type by type), so every storage type computes the bits of the float32 matrix.

A storage type provides, to the shared drivers:
  units(W)            decode units of 32 outputs (a float panel is two, a quantized panel one)
  groups(W)           prefill groups of 64 outputs (a float panel, or a pair of quantized panels)
  gemv_units(...)     token 0 times units u0 .. u1 (decode; the thread's share), or every token where
                      few_rows(W, T) (a few rows on fp16 or quantized panels: a batch of decoding
                      sequences, a speculative check)
  prefill_group(...)  tokens ta .. tb times group g (prefill: quantized panels are dequantized, and
                      fp16 panels widened, once into a float32 buffer, then tiled like float panels)
  tiling(W, T)        (tokens per tile, tiles per job, fewest tiles per job) for T tokens: only the
                      split of work
  layer(W, li)        layer li of a matrix kind stacked over layers
  act_alloc(x, W)     what the products take as the rows: x itself, or for the integer mode's storage
  act_rows(...)       (`intdot.py`) arrays for x quantized to 8-bit blocks, which act_rows fills
  quantizes(W)        (`actq.py`), once per product; quantizes(W) says whether W needs it
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import njit, types
from numba.extending import overload

from .actq import quantize_rows
from . import intmixed
from .intdot import act_block, group_kernel, int_element, int_kind, tile_rows, units_kernel
from .intmixed import is_int_mixed
from .layout import QBLOCK, QPanels, as_storage
from .qblocks import q_dequantize_pair, q_element, q_rows, q_unit, q_unit_pair
from ...numerics.simd import HALF, LANES, prefetch, target_isa, v_load, v_part, v_store, widen
from .tiles import dot, put, rows_for, tiles_for

# fp16 panels: from this many tokens on, widened once per group into a float32 buffer (`prefill_group`);
# fewer are read directly by `gemv_units` (`few_rows`).
HALF_WIDEN = 16
# Quantized panels (and kinds mixing them with float panels): likewise dequantized into the buffer
# from this many tokens on; fewer dequantize each panel in registers for a few rows at a time
# (SmolLM2's w13, 3072 x 576 Q4_1, 2 threads: AVX-512 8 rows 182 against 289 us, 16 rows 351 against
# 404; AVX2 4 rows 154 against 194 us, 8 rows 304 against 285).
Q_DEQUANTIZE = {"avx512": 17, "avx2": 8, "sse": 8}


# ---------------------------------------------------------------------------------------------------
# The storage interface (module docstring).

def _is_mixed(w) -> bool:
    """A `layout.MixedPanels` storage: (table, 5 slots per part), `layout.as_storage`."""
    return (isinstance(w, types.BaseTuple) and len(w) > 1 and len(w) % 5 == 1 and isinstance(w[0], types.Array)
            and w[0].dtype == types.int64)


def units(w):
    raise NotImplementedError("units is for jitted code")


@overload(units)
def _units(w):
    if int_kind(w):
        return lambda w: w[1].shape[0]
    if is_int_mixed(w):
        return lambda w: w[1][w[1].shape[0] - 1, 3]
    if _is_mixed(w):
        return lambda w: w[0][w[0].shape[0] - 1, 3]
    if isinstance(w, types.BaseTuple):
        return lambda w: w[0].shape[0]
    return lambda w: 2 * w.shape[0]


def groups(w):
    raise NotImplementedError("groups is for jitted code")


@overload(groups)
def _groups(w):
    if int_kind(w):
        return lambda w: (w[1].shape[0] + 1) // 2
    if is_int_mixed(w):
        return lambda w: (w[1][w[1].shape[0] - 1, 2] + LANES - 1) // LANES
    if _is_mixed(w):
        return lambda w: (w[0][w[0].shape[0] - 1, 2] + LANES - 1) // LANES
    if isinstance(w, types.BaseTuple):
        return lambda w: (w[0].shape[0] + 1) // 2
    return lambda w: w.shape[0]


def tiling(w, T):
    raise NotImplementedError("tiling is for jitted code")


@overload(tiling)
def _tiling(w, T):
    if int_kind(w) or is_int_mixed(w):  # integer dots of a pair of panels: each job reads them once per tile of rows
        rows = tile_rows()
        return lambda w, T: (rows, 16, 3)
    # fp32 panels are read from memory (`tiles.SHAPES` "direct"): 8 tiles per job, and a job as small
    # as one tile where that evens out the threads' share (a second reader of a panel finds it in the
    # shared cache). A dequantized pair, or an fp16 panel widened, sits in a cache-resident buffer
    # ("buffered"): up to 16 tiles per job so that each panel is converted once for many tokens, and
    # no job under 3 tiles, since each job converts its group again (8 decoding sequences, AVX2 build,
    # Q4_1: the 9 groups of wo and down as 9 jobs of 8 rows, not 18 of 6 or 2, 0.91-0.92x the time;
    # fp32's 8-row jobs 1.05x the time of two of 4 rows).
    if isinstance(w, types.BaseTuple) or w.dtype == types.uint16:
        buffered = rows_for("buffered")
        return lambda w, T: (buffered(T), 16, 3)
    direct = rows_for("direct")
    return lambda w, T: (direct(T), 8, 1)


def few_rows(w, T):
    raise NotImplementedError("few_rows is for jitted code")


@overload(few_rows)
def _few_rows(w, T):
    # fp16 panels under HALF_WIDEN rows: the decode split over 32-output units, each unit's weights
    # widened once for every row (`tiles.tiles_for("few")`), instead of once per 4-row tile.
    if not isinstance(w, types.BaseTuple) and w.dtype == types.uint16:
        return lambda w, T: T < HALF_WIDEN
    if isinstance(w, types.BaseTuple) and not (int_kind(w) or is_int_mixed(w)):
        limit = Q_DEQUANTIZE[target_isa()]
        return lambda w, T: T < limit
    return lambda w, T: False


def _gemv_at(x, w, p0, n_out, out, u0, u1, c0):
    raise NotImplementedError("_gemv_at is for jitted code")


@overload(_gemv_at, inline="always")
def _gemv_at_impl(x, w, p0, n_out, out, u0, u1, c0):
    """gemv_units on the panels from p0 on (32-row quantized panels, or 64-row float panels) of w,
    writing output u * 32 + j at column c0 + u * 32 + j (clipped at n_out)."""
    if isinstance(w, types.BaseTuple):
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


# Rows a quantized panel's weights are dequantized once for under `few_rows` (`qblocks.q_rows`): each
# row keeps 3 vectors of 32 lanes, 6 zmm on AVX-512, 12 ymm on AVX2, where 4 rows spill yet beat 2
# (w13 above, 8 rows: 304 against 357 us).
Q_ROWS = {"avx512": 4, "avx2": 4, "sse": 2}


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


def _fill_at(w, p0, g, wbuf):
    raise NotImplementedError("_fill_at is for jitted code")


@overload(_fill_at, inline="always")
def _fill_at_impl(w, p0, g, wbuf):
    """Group g of the panels from p0 on (even for quantized panels) of w as float32 in
    wbuf[k * 64 + lane]: a quantized pair dequantized, float panels widened exactly or copied."""
    if isinstance(w, types.BaseTuple):
        def quantized(w, p0, g, wbuf):
            pair = p0 // 2 + g
            if 2 * pair + 1 >= w[0].shape[0]:
                wbuf[:] = 0  # no second panel: zero weights, as in prefill_group
            q_dequantize_pair(w, pair, wbuf)
        return quantized

    def panels(w, p0, g, wbuf):
        K = w.shape[1]
        for k in range(K):
            v_store(wbuf, k * LANES, v_load(w, ((p0 + g) * K + k) * LANES))
    return panels


def _prefetch_panels(a, p0, p1):
    raise NotImplementedError("_prefetch_panels is for jitted code")


@overload(_prefetch_panels, inline="always")
def _prefetch_panels_impl(a, p0, p1):
    """A prefetch of each cache line of panels p0 .. p1 (clipped) of `a` (panels on the first axis),
    or nothing for a None slot."""
    if isinstance(a, types.NoneType):
        return lambda a, p0, p1: None
    step = max(1, 64 // (a.dtype.bitwidth // 8))  # elements per 64-byte line

    def impl(a, p0, p1):
        P = a.shape[0]
        if P > 0:
            per = a.size // P
            for i in range(min(p0, P) * per, min(p1, P) * per, step):
                prefetch(a, i)
    return impl


def _prefetch_at(w, p0, g):
    raise NotImplementedError("_prefetch_at is for jitted code")


@overload(_prefetch_at, inline="always")
def _prefetch_at_impl(w, p0, g):
    """Prefetch what `_fill_at(w, p0, g, ...)` reads. A job dequantizes (or widens) its group, then
    spends the tiles' time on it without touching memory; prefetching the next group then lets the
    next fill find its weights in cache instead of waiting on DRAM (a batch of 8 decoding sequences,
    AVX2 build: Q4_1 products 0.83-0.96x the time)."""
    if isinstance(w, types.BaseTuple):
        def q3(w, p0, g):  # the pair of panels of every array of the storage (None slots: nothing)
            q0 = p0 + 2 * g
            _prefetch_panels(w[0], q0, q0 + 2)
            _prefetch_panels(w[1], q0, q0 + 2)
            _prefetch_panels(w[2], q0, q0 + 2)

        def q5(w, p0, g):
            q0 = p0 + 2 * g
            _prefetch_panels(w[0], q0, q0 + 2)
            _prefetch_panels(w[1], q0, q0 + 2)
            _prefetch_panels(w[2], q0, q0 + 2)
            _prefetch_panels(w[3], q0, q0 + 2)
            _prefetch_panels(w[4], q0, q0 + 2)
        return q3 if len(w) == 3 else q5
    return lambda w, p0, g: _prefetch_panels(w, p0 + g, p0 + g + 1)


# One compiled function per storage type for a segment of a mixed kind (`layout.MixedPanels`), shared
# by every kind that has a part of that type (inlining each part's kernels into one function made
# the compile several times slower).

@njit(cache=True)
def _seg_gemv(x, w, p0, n_out, out, u0, u1, c0):
    _gemv_at(x, w, p0, n_out, out, u0, u1, c0)


@njit(cache=True)
def _seg_fill(w, p0, g, wbuf):
    _fill_at(w, p0, g, wbuf)


@njit(cache=True)
def _seg_prefetch(w, p0, g):
    _prefetch_at(w, p0, g)


_ARGS = {"_seg_gemv": ("x, ", "p0, n_out, out, u0, u1, c0"), "_seg_fill": ("", "p0, g, wbuf"),
         "_seg_prefetch": ("", "p0, g")}


def _part_call(what: str, w):
    """f(w, i, ...) running what(..., part i of the mixed storage w, ...) for a runtime index i: numba
    needs each part's type spelled out, so one branch per part. Part i is the slots
    w[1 + 5i : 6 + 5i]: a quantized storage tuple (qs, d, m, sc, qh), or float panels and four Nones."""
    pre, args = _ARGS[what]
    lines = [f"def f(w, i, {pre}{args}):"]
    for i in range((len(w) - 1) // 5):
        o = 1 + 5 * i
        part = f"w[{o}]" if isinstance(w[o + 1], types.NoneType) else f"(w[{o}], w[{o + 1}], w[{o + 2}], w[{o + 3}], w[{o + 4}])"
        lines.append(f"    {'if' if i == 0 else 'elif'} i == {i}:")
        lines.append(f"        {what}({pre}{part}, {args})")
    env = {"_seg_gemv": _seg_gemv, "_seg_fill": _seg_fill, "_seg_prefetch": _seg_prefetch}
    exec("\n".join(lines), env)  # noqa: S102 (generated from the constants above)
    return env["f"]


def _mixed_gemv(w, i, x, p0, n_out, out, u0, u1, c0):
    raise NotImplementedError("_mixed_gemv is for jitted code")


def _mixed_fill(w, i, p0, g, wbuf):
    raise NotImplementedError("_mixed_fill is for jitted code")


def _mixed_prefetch(w, i, p0, g):
    raise NotImplementedError("_mixed_prefetch is for jitted code")


@overload(_mixed_gemv, inline="always")
def _mixed_gemv_impl(w, i, x, p0, n_out, out, u0, u1, c0):
    return _part_call("_seg_gemv", w)


@overload(_mixed_fill, inline="always")
def _mixed_fill_impl(w, i, p0, g, wbuf):
    return _part_call("_seg_fill", w)


@overload(_mixed_prefetch, inline="always")
def _mixed_prefetch_impl(w, i, p0, g):
    return _part_call("_seg_prefetch", w)


def gemv_units(x, w, n_out, out, u0, u1):
    raise NotImplementedError("gemv_units is for jitted code")


@overload(gemv_units)
def _gemv_units(x, w, n_out, out, u0, u1):
    if int_kind(w):
        kern = units_kernel(int_kind(w))
        return lambda x, w, n_out, out, u0, u1: kern(x, w, 0, n_out, out, u0, u1, 0)
    if is_int_mixed(w):
        return intmixed.gemv_units(w, _seg_gemv)
    if _is_mixed(w):
        # Each segment's share of the units, read as its own storage type (layout.MixedPanels).
        def mixed(x, w, n_out, out, u0, u1):
            tab = w[0]
            for s in range(tab.shape[0] - 1):
                a = max(u0, tab[s, 3])
                b = min(u1, tab[s + 1, 3])
                if a < b and tab[s, 0] >= 0:
                    _mixed_gemv(w, tab[s, 0], x, tab[s, 1], min(n_out, tab[s + 1, 2]), out, a - tab[s, 3],
                                b - tab[s, 3], tab[s, 2])
        return mixed
    if isinstance(w, types.BaseTuple):  # the type's kernel compiled once, for every mm that reads it
        return lambda x, w, n_out, out, u0, u1: _seg_gemv(x, w, 0, n_out, out, u0, u1, 0)
    return lambda x, w, n_out, out, u0, u1: _gemv_at(x, w, 0, n_out, out, u0, u1, 0)


def prefill_group(x, w, g, ta, tb, n_out, out, wbuf):
    raise NotImplementedError("prefill_group is for jitted code")


@overload(prefill_group)
def _prefill_group(x, w, g, ta, tb, n_out, out, wbuf):
    if int_kind(w):
        grp = group_kernel(int_kind(w))
        return lambda x, w, g, ta, tb, n_out, out, wbuf: grp(x, w, 0, g, ta, tb, n_out, out, 0)
    buffered = tiles_for("buffered")
    if is_int_mixed(w):
        return intmixed.prefill_group(w, _seg_fill, _seg_prefetch, buffered)
    if _is_mixed(w):
        def mixed(x, w, g, ta, tb, n_out, out, wbuf):
            tab = w[0]
            for s in range(tab.shape[0] - 1):
                g0 = tab[s, 2] // LANES
                if tab[s, 0] >= 0 and g0 <= g < (tab[s + 1, 2] + LANES - 1) // LANES:
                    # the group's weights as float32, then the one tiling of every dequantized pair
                    _mixed_fill(w, tab[s, 0], tab[s, 1], g - g0, wbuf)
                    _mixed_prefetch(w, tab[s, 0], tab[s, 1], g - g0 + 1)  # the next group (`_prefetch_at`)
                    buffered(x, ta, tb, wbuf, 0, g * LANES, min(n_out, tab[s + 1, 2]), out)
        return mixed
    if isinstance(w, types.BaseTuple):
        def quantized(x, w, g, ta, tb, n_out, out, wbuf):
            _seg_fill(w, 0, g, wbuf)  # dequantized (a missing second panel: zeros)
            _seg_prefetch(w, 0, g + 1)  # the next group (`_prefetch_at`)
            buffered(x, ta, tb, wbuf, 0, g * LANES, n_out, out)
        return quantized
    if w.dtype == types.uint16:
        # fp16 panels: for a prompt's many tokens, the group's panel is widened (exactly) once into a
        # cache-resident float32 buffer instead of at every load of every tile (a batch of a few
        # decoding sequences, under HALF_WIDEN tokens, takes gemv_units instead: `few_rows`).
        def half(x, w, g, ta, tb, n_out, out, wbuf):
            K = x.shape[1]
            for k in range(K):
                v_store(wbuf, k * LANES, v_load(w, (g * K + k) * LANES))
            _prefetch_at(w, 0, g + 1)  # the next group
            buffered(x, ta, tb, wbuf, 0, g * LANES, n_out, out)
        return half
    direct = tiles_for("direct")
    return lambda x, w, g, ta, tb, n_out, out, wbuf: direct(x, ta, tb, w, g * x.shape[1] * LANES, g * LANES, n_out, out)


def act_alloc(x, w):
    raise NotImplementedError("act_alloc is for jitted code")


@overload(act_alloc, inline="always")
def _act_alloc(x, w):
    if int_kind(w):
        B = act_block(w)
        return lambda x, w: (np.empty(x.shape, np.int8), np.empty((x.shape[0], x.shape[1] // B), np.float32),
                             np.empty((x.shape[0], x.shape[1] // 16), np.int32))
    if is_int_mixed(w):
        return intmixed.act_alloc(w)
    return lambda x, w: x


def act_rows(x, w, xa, t0, t1):
    raise NotImplementedError("act_rows is for jitted code")


@overload(act_rows, inline="always")
def _act_rows(x, w, xa, t0, t1):
    if int_kind(w):
        B = act_block(w)
        return lambda x, w, xa, t0, t1: quantize_rows(x, t0, t1, B, xa[0], xa[1], xa[2])
    if is_int_mixed(w):
        return intmixed.act_rows(w)
    return lambda x, w, xa, t0, t1: None


def quantizes(w):
    raise NotImplementedError("quantizes is for jitted code")


@overload(quantizes, inline="always")
def _quantizes(w):
    q = int_kind(w) is not None or is_int_mixed(w)
    return lambda w: q


def layer(w, li):
    raise NotImplementedError("layer is for jitted code")


@overload(layer, inline="always")
def _layer(w, li):
    if int_kind(w):
        return lambda w, li: (w[0], w[1][li], w[2][li], _pick(w[3], li), _pick(w[4], li), _pick(w[5], li))
    if is_int_mixed(w):  # the parts have no layer axis
        return lambda w, li: (w[0], w[1][li]) + w[2:]
    if _is_mixed(w):
        return lambda w, li: (w[0][li],) + w[1:]
    if isinstance(w, types.BaseTuple):
        if len(w) == 3:
            return lambda w, li: (w[0][li], w[1][li], _pick(w[2], li))
        return lambda w, li: (w[0][li], w[1][li], _pick(w[2], li), _pick(w[3], li), _pick(w[4], li))
    return lambda w, li: w[li]


def _pick(a, li):
    raise NotImplementedError("_pick is for jitted code")


@overload(_pick, inline="always")
def _pick_impl(a, li):
    if isinstance(a, types.NoneType):
        return lambda a, li: None
    return lambda a, li: a[li]


# ---------------------------------------------------------------------------------------------------
# Rows of a matrix (an embedding table, or a tied output matrix serving as one), widened exactly.

def embed_rows(table, ids, x):
    """x[t] = row ids[t] of `table`: a float (vocab, dim) table, float panels, or quantized panels."""
    raise NotImplementedError("embed_rows is for jitted code")


@overload(embed_rows)
def _embed_rows(table, ids, x):
    kind = int_kind(table)
    if kind == "Q8_0":  # the integer mode's regrouped quants
        def q8(table, ids, x):
            for t in range(ids.shape[0]):
                p, j = ids[t] // HALF, ids[t] % HALF
                for k in range(x.shape[1]):
                    x[t, k] = int_element(table, p, k // QBLOCK, k % QBLOCK, j)
        return q8
    if kind is not None:  # the integer mode's other types keep the native arrays
        def native(table, ids, x):
            embed_rows((table[1], table[2], table[3], table[4], table[5]), ids, x)
        return native
    if isinstance(table, types.BaseTuple):
        def quantized(table, ids, x):
            for t in range(ids.shape[0]):
                p, j = ids[t] // HALF, ids[t] % HALF
                for k in range(x.shape[1]):
                    x[t, k] = q_element(table, p, k // QBLOCK, k % QBLOCK, j)
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
