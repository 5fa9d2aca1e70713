"""Rows times a panel's outputs, for every storage type's products: a buffer holds weight k of output j
at [off + 64k + j] (a float panel, float32 or fp16 bits, or a pair of quantized panels dequantized into
float32), and each output's sum runs in the one order of every matrix product:

    s = c = 0; for each k-block [k0, k0 + 64): part = 0, then part = part + w[k] * x[t, k] for k in
    order; then y = part - c; z = s + y; c = (z - s) - y; s = z.

A tile runs that for R rows at once over W outputs (W lanes of one vector: 64, 32 or 16), so each
weight vector is loaded once per tile; rows past the end of a range repeat the last row (computed,
never stored). The tile shape is chosen per vector unit (`SHAPES`): R x W running block sums must fit
the registers (32 zmm on AVX-512, 16 ymm on AVX2) beside a weight vector. Neither the tile nor the
schedule enters any output's arithmetic, so every shape on every target gives the same bits.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import njit
from numba.extending import overload

from ...numerics.simd import KBLOCK, LANES, VECTORS, at, kahan, target_isa, v_add, v_get, v_mul, v_store

# Per vector unit, the tiles of each product: [(from T rows on, tiles)], the last entry whose T applies;
# tiles are (rows per pass, lanes) largest first. "direct": float32 panels read from memory;
# "buffered": a panel widened or dequantized into a cache-resident buffer; "few": a few rows times a
# 32-output unit (fp16 panels, `loaders.few_rows`). AVX-512 keeps 4-6 rows x 64 lanes (16-24 zmm of
# sums) and 8 x 32. AVX2 has 16 ymm: 6 rows x 16 lanes (12 ymm) once the product is compute-bound, and
# the rest of a range in tiles of 8 ymm of sums (4 x 16, 2 x 32, 1 x 64): fewer running sums than the
# add pipes have cycles of latency in flight leave them idle (2 x 16 ran 1.5x, 1 x 16 2.8x the time of
# 2 x 32, 1 x 64); a few rows read from memory stay at 4 x 64, bound by the memory; fp16's few rows
# 2 x 32 (8 ymm; 8 x 32 spilled) (measured: bench/README.md, "Tiles per vector unit" and "A few rows
# on AVX2").
_AVX2_MANY = ((6, 16), (4, 16), (2, 32), (1, 64))
SHAPES = {
    "avx512": {"direct": [(1, ((4, 64),))], "buffered": [(1, ((6, 64), (4, 64), (2, 64), (1, 64)))],
               "few": [(1, ((8, 32), (4, 32), (1, 32)))]},
    "avx2": {"direct": [(1, ((4, 64),)), (48, _AVX2_MANY)], "buffered": [(1, _AVX2_MANY)],
             "few": [(1, ((2, 32), (1, 32)))]},
}
SHAPES["sse"] = SHAPES["avx2"]  # 16 xmm: a generic x86-64 build is for checking bits, not for speed


@njit(cache=True, inline="always")
def put(out, t, n0, n_out, v, width):
    """out[t, n0 : n0 + width] = v (a vector of `width` lanes), clipped at n_out."""
    if n0 + width <= n_out:
        v_store(out, t * out.shape[1] + n0, v)
    else:
        for j in range(max(0, n_out - n0)):
            out[t, n0 + j] = v_get(v, j)


_ENV = {"KBLOCK": KBLOCK, "LANES": LANES, "at": at, "kahan": kahan, "v_add": v_add, "v_mul": v_mul}


def _compile(src: str, name: str, **env):
    scope = dict(_ENV, **env)
    exec(src, scope)  # noqa: S102 (generated from the templates in this file)
    return scope[name]


@lru_cache(maxsize=None)
def dot(R: int, W: int):
    """The jitted f(x, rows, K, buf, off): the R rows at flat offsets `rows` (a tuple) of x, each of
    length K, times the W outputs whose lanes start at buf[off:] (row stride 64): a tuple of R sums."""
    r = range(R)
    lines = ["def dot(x, rows, K, buf, off):"]
    lines += [f"    r{i} = rows[{i}]" for i in r] + [f"    s{i} = Z()\n    c{i} = Z()" for i in r]
    lines += ["    for k0 in range(0, K, KBLOCK):"] + [f"        a{i} = Z()" for i in r]
    lines += ["        for k in range(k0, min(K, k0 + KBLOCK)):", "            w = L(buf, off + k * LANES)"]
    lines += [f"            a{i} = v_add(a{i}, v_mul(w, S(at(x, r{i} + k))))" for i in r]
    lines += [f"        s{i}, c{i} = kahan(a{i}, s{i}, c{i})" for i in r]
    lines += [f"    return ({''.join(f's{i}, ' for i in r)})"]
    Z, S, L = VECTORS[W]
    return njit(inline="always")(_compile("\n".join(lines), "dot", Z=Z, S=S, L=L))


@lru_cache(maxsize=None)
def span(shapes: tuple, width: int):
    """The jitted out[ta:tb, n0 : n0 + width] (clipped at n_out) = x[ta:tb] times the `width` outputs
    whose lanes start at buf[off:], in tiles `shapes` ((R rows, W outputs), largest R first; each W
    divides width): full tiles of the largest, the rest by the smallest tile that covers it.
        f(x, ta, tb, buf, off, n0, n_out, out)"""
    if any(width % W for _, W in shapes):
        raise ValueError(f"tiles {shapes}: each tile's lanes must divide the span's {width}")
    lines = ["def f(x, ta, tb, buf, off, n0, n_out, out):", "    K = x.shape[1]", "    last = tb - 1",
             "    t = ta", "    while t < tb:", "        m = tb - t"]
    order = sorted(shapes)
    for i, (R, W) in enumerate(order):
        test = "if True:" if len(order) == 1 else "else:" if i == len(order) - 1 else f"{'if' if i == 0 else 'elif'} m <= {R}:"
        lines.append(f"        {test}")
        rows = "".join(f"min(t + {i}, last) * K, " for i in range(R))
        lines.append(f"            for j in range(0, {width}, {W}):")
        lines.append(f"                s = dot{R}(x, ({rows}), K, buf, off + j)")
        lines += [f"                if t + {i} < tb:\n                    put(out, t + {i}, n0 + j, n_out, s[{i}], {W})"
                  for i in range(R)]
        lines.append(f"            t += {R}")
    dots = {f"dot{R}": dot(R, W) for R, W in shapes}
    return njit(inline="always")(_compile("\n".join(lines), "f", put=put, **dots))


@lru_cache(maxsize=None)
def _by_rows(kind: str, isa: str):
    """(f, rows): f(x, ta, tb, buf, off, n0, n_out, out) as `span` with the tile of `kind` for T =
    x.shape[0] rows, and rows(T), the rows per pass of that tile (for the split of work)."""
    opts = SHAPES[isa][kind]
    width = LANES if kind != "few" else LANES // 2
    env = {f"s{i}": span(shapes, width) for i, (_, shapes) in enumerate(opts)}
    f = ["def f(x, ta, tb, buf, off, n0, n_out, out):", "    T = x.shape[0]"]
    r = ["def rows(T):"]
    for i in reversed(range(len(opts))):
        test = "if True:" if len(opts) == 1 else "else:" if i == 0 else f"{'if' if i == len(opts) - 1 else 'elif'} T >= {opts[i][0]}:"
        f += [f"    {test}", f"        s{i}(x, ta, tb, buf, off, n0, n_out, out)"]
        r += [f"    {test}", f"        return {opts[i][1][0][0]}"]
    return (njit(inline="always")(_compile("\n".join(f), "f", **env)),
            njit(inline="always")(_compile("\n".join(r), "rows")))


def tiles_for(kind: str):
    """The jitted tiles of `kind` ("direct", "buffered" over 64 outputs; "few" over 32) on the compile
    target: f(x, ta, tb, buf, off, n0, n_out, out) (as `span`)."""
    return _by_rows(kind, target_isa())[0]


def rows_for(kind: str):
    """The jitted rows(T): rows per pass of `tiles_for(kind)` for T rows."""
    return _by_rows(kind, target_isa())[1]


def _buffered(x, ta, tb, buf, off, n0, n_out, out):
    raise NotImplementedError("_buffered is for jitted code")


@overload(_buffered)
def _buffered_impl(x, ta, tb, buf, off, n0, n_out, out):
    f = tiles_for("buffered")
    return lambda x, ta, tb, buf, off, n0, n_out, out: f(x, ta, tb, buf, off, n0, n_out, out)


@njit(cache=True)
def buffered(x, ta, tb, buf, off, n0, n_out, out):
    """`tiles_for("buffered")` compiled once per target, for every storage whose groups are converted
    into the float32 buffer (quantized, mixed and fp16 panels), instead of inlined into each kind's
    product: the tiles are most of a prefill's code, and each storage type's product compiled them
    again (about 6 s of a quantized type's 36)."""
    _buffered(x, ta, tb, buf, np.int64(off), np.int64(n0), np.int64(n_out), out)
