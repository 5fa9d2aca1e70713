"""The integer mode's kinds of mixed types (dtype "int8"): a `packing.layout.MixedPanels` whose quantized parts
are `packing.intpanels.IntPanels` (a Q4_K_M file's wqkv, q and k Q4_K with v Q6_K in some layers; its ffn_down
Q4_K in some layers and Q6_K in others; [wq; wk] Q5_0 with wv Q8_0).

Each segment is computed as a matrix of its own type alone would be in this mode: an integer part by
the same kernels (`intdot.py`) against the same activation blocks, a float part (F16/F32 rows) by
native's float path on the float rows (`floats.py`), as is a native part of a type the integer mode
does not compute (`quantized.py`). The rows of x are quantized once per block size the kind's integer
parts take (32 and/or 256, `actq.py`), not once per segment: a row's blocks depend on the row and the
block size alone, so every segment of one block
size reads the same quants, whichever segments there are. Segments start at multiples of 64 outputs, so
the work split (decode units of 32 outputs, prefill groups of 64) never straddles two.

The storage tuple (kind "int8-mixed", `kinds.as_storage`): (tag, table, then 6 slots per part): an
integer part's own storage (tag, qs, d, m, sc, qh), a float part's (tag, panels, 4 Nones), as native's
(`mixed.py`); the table is MixedPanels'.
The activations the products take: (x, then xq, xd, xs of the 32-blocks, then of the 256-blocks), flat
as numba's parallel regions take no nested tuples; a block size the kind does not use as empty arrays.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..actq import quantize_rows
from ..intdot import K_KINDS, tile_rows
from ....numerics.simd import LANES
from ..tiles import buffered
from .kinds import module
from .mixed import groups, layer, part_slots, units  # noqa: F401 (as native's mixed kinds)


def _parts(w) -> list[tuple[int, str | None]]:
    """(first slot, the integer part's ggml type name, or None for a part read as float32: float
    panels, or native blocks of a type the integer mode does not compute) of each part."""
    return [(o, w[o].qtype if w[o].kind == "int8" else None) for o in part_slots(w)]


def blocks(w) -> tuple[bool, bool]:
    """Whether the kind's integer parts take activation blocks of 32, of 256."""
    kinds = [k for _, k in _parts(w) if k is not None]
    return any(k not in K_KINDS for k in kinds), any(k in K_KINDS for k in kinds)


def tiling(w, T):  # as the integer kinds' (`int8.tiling`)
    rows = tile_rows()
    return lambda w, T: (rows, 16, 3)


def few_rows(w, T):
    return lambda w, T: False


def quantizes(w):
    return lambda w: True


def act_alloc(x, w):
    """f(x, w) -> the activations as the module docstring says (arrays uninitialized)."""
    need32, need256 = blocks(w)

    def alloc(x, B, need):
        T, K = x.shape
        if not need:
            T = K = 0
        return (np.empty((T, K), np.int8), np.empty((T, K // B), np.float32), np.empty((T, K // 16), np.int32))

    alloc = njit(inline="always")(alloc)
    return lambda x, w: (x,) + alloc(x, 32, need32) + alloc(x, 256, need256)


def act_rows(x, w, xa, t0, t1):
    """f(x, w, xa, t0, t1): rows t0 .. t1 of x quantized, once for each block size the kind takes."""
    need32, need256 = blocks(w)

    def rows(x, w, xa, t0, t1):
        if need32:
            quantize_rows(x, t0, t1, 32, xa[1], xa[2], xa[3])
        if need256:
            quantize_rows(x, t0, t1, 256, xa[4], xa[5], xa[6])
    return rows


def _dispatch(w, body_int: str, body_float: str):
    """f(w, i, xa, p0, g_or_u..., ...) with one branch per part (numba needs each part's type spelled
    out): `body_int` / `body_float` formatted with {part} (the part's 6 slots as a tuple), {seg} (its
    kind's module, `storage.table`) and {xa} (its activations: x, or the 32- or 256-blocks)."""
    lines = ["def f(w, i, xa, p0, a, b, n_out, out, c0, ta, tb, wbuf):"]
    scope = {"buffered": buffered}
    for i, (o, kind) in enumerate(_parts(w)):
        lines.append(f"    {'if' if i == 0 else 'elif'} i == {i}:")
        part = "(" + ", ".join(f"w[{o + j}]" for j in range(6)) + ")"
        seg = module(w[o].kind)
        names = ("seg_gemv", "seg_fill", "seg_prefetch") if kind is None else ("seg_units", "seg_group")
        scope.update({f"{name}{i}": getattr(seg, name) for name in names})
        if kind is None:
            lines.append("        " + body_float.format(part=part, xa="xa[0]", i=i))
        else:
            xa = "(xa[4], xa[5], xa[6])" if kind in K_KINDS else "(xa[1], xa[2], xa[3])"
            lines.append("        " + body_int.format(part=part, xa=xa, i=i))
    exec("\n".join(lines), scope)  # noqa: S102 (generated from the templates of the callers below)
    return njit(inline="always")(scope["f"])


def gemv_units(x, w, n_out, out, u0, u1):
    """f(xa, w, n_out, out, u0, u1): decode units u0 .. u1, each segment's share read as its own
    storage."""
    part = _dispatch(w, "seg_units{i}({xa}, {part}, p0, n_out, out, a, b, c0)",
                     "seg_gemv{i}({xa}, {part}, p0, n_out, out, a, b, c0)")

    def units(x, w, n_out, out, u0, u1):  # x: the activations (module docstring)
        tab = w[1]
        for s in range(tab.shape[0] - 1):
            a = max(u0, tab[s, 3])
            b = min(u1, tab[s + 1, 3])
            if a < b and tab[s, 0] >= 0:
                part(w, tab[s, 0], x, tab[s, 1], a - tab[s, 3], b - tab[s, 3], min(n_out, tab[s + 1, 2]), out,
                     tab[s, 2], 0, 0, out)
    return units


def prefill_group(x, w, g, ta, tb, n_out, out, wbuf):
    """f(xa, w, g, ta, tb, n_out, out, wbuf): rows ta .. tb times group g (64 outputs) of the segment
    that holds it. A float part's group is filled into wbuf and tiled as native's (`mixed.py`)."""
    part = _dispatch(w, "seg_group{i}({xa}, {part}, p0, a, ta, tb, n_out, out, c0)",
                     "seg_fill{i}({part}, p0, a, wbuf)\n        seg_prefetch{i}({part}, p0, a + 1)\n"
                     "        buffered({xa}, ta, tb, wbuf, 0, c0 + a * 64, n_out, out)")

    def group(x, w, g, ta, tb, n_out, out, wbuf):  # x as for gemv_units
        tab = w[1]
        for s in range(tab.shape[0] - 1):
            g0 = tab[s, 2] // LANES
            if tab[s, 0] >= 0 and g0 <= g < (tab[s + 1, 2] + LANES - 1) // LANES:
                part(w, tab[s, 0], x, tab[s, 1], g - g0, 0, min(n_out, tab[s + 1, 2]), out, tab[s, 2], ta, tb, wbuf)
    return group


def embed_rows(table, ids, x):
    raise TypeError("a token table of mixed storage types has no embedding rows")
