"""The integer mode's kinds of mixed types (dtype "int8"): a `layout.MixedPanels` whose quantized parts
are `intpanels.IntPanels` (a Q4_K_M file's wqkv, q and k Q4_K with v Q6_K in some layers; its ffn_down
Q4_K in some layers and Q6_K in others; [wq; wk] Q5_0 with wv Q8_0).

Each segment is computed as a matrix of its own type alone would be in this mode: an integer part by
the same kernels (`intdot.py`) against the same activation blocks, a float part (F16/F32 rows) by
native's float path on the float rows (`loaders.py`, whose functions are passed in here). The rows of x
are quantized once per block size the kind's integer parts take (32 and/or 256, `actq.py`), not once
per segment: a row's blocks depend on the row and the block size alone, so every segment of one block
size reads the same quants, whichever segments there are. Segments start at multiples of 64 outputs, so
the work split (decode units of 32 outputs, prefill groups of 64) never straddles two.

The storage tuple (`layout.as_storage`): (tag, table, then 6 slots per part): an integer part's own
storage (tag, qs, d, m, sc, qh), a float part's panels and five Nones. `tag` (an empty bool array) and
the int64 table in slot 1 tell it from every other storage; the table is MixedPanels'.
The activations the products take: (x, then xq, xd, xs of the 32-blocks, then of the 256-blocks), flat
as numba's parallel regions take no nested tuples; a block size the kind does not use as empty arrays.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from .actq import quantize_rows
from .intdot import K_KINDS, group_kernel, int_kind, units_kernel
from ...numerics.simd import LANES


def is_int_mixed(w) -> bool:
    """The numba type of this module's storage tuple."""
    return (isinstance(w, types.BaseTuple) and len(w) >= 8 and (len(w) - 2) % 6 == 0
            and isinstance(w[0], types.Array) and w[0].dtype == types.boolean
            and isinstance(w[1], types.Array) and w[1].dtype == types.int64)


def _parts(w) -> list[tuple[int, str | None]]:
    """(first slot, the integer part's ggml type name or None for float panels) of each part."""
    out = []
    for o in range(2, len(w), 6):
        out.append((o, int_kind(types.Tuple(w[o:o + 6])) if isinstance(w[o], types.Array)
                    and w[o].dtype == types.boolean else None))
    return out


def blocks(w) -> tuple[bool, bool]:
    """Whether the kind's integer parts take activation blocks of 32, of 256."""
    kinds = [k for _, k in _parts(w) if k is not None]
    return any(k not in K_KINDS for k in kinds), any(k in K_KINDS for k in kinds)


def act_alloc(w):
    """f(x, w) -> the activations as the module docstring says (arrays uninitialized)."""
    need32, need256 = blocks(w)

    def alloc(x, B, need):
        T, K = x.shape
        if not need:
            T = K = 0
        return (np.empty((T, K), np.int8), np.empty((T, K // B), np.float32), np.empty((T, K // 16), np.int32))

    alloc = njit(inline="always")(alloc)
    return lambda x, w: (x,) + alloc(x, 32, need32) + alloc(x, 256, need256)


def act_rows(w):
    """f(x, w, xa, t0, t1): rows t0 .. t1 of x quantized, once for each block size the kind takes."""
    need32, need256 = blocks(w)

    def rows(x, w, xa, t0, t1):
        if need32:
            quantize_rows(x, t0, t1, 32, xa[1], xa[2], xa[3])
        if need256:
            quantize_rows(x, t0, t1, 256, xa[4], xa[5], xa[6])
    return rows


def _int_units(xa, w, p0, n_out, out, u0, u1, c0):
    raise NotImplementedError("_int_units is for jitted code")


@overload(_int_units, inline="always")
def _int_units_impl(xa, w, p0, n_out, out, u0, u1, c0):
    kern = units_kernel(int_kind(w))
    return lambda xa, w, p0, n_out, out, u0, u1, c0: kern(xa, w, p0, n_out, out, u0, u1, c0)


def _int_group(xa, w, p0, g, ta, tb, n_out, out, c0):
    raise NotImplementedError("_int_group is for jitted code")


@overload(_int_group, inline="always")
def _int_group_impl(xa, w, p0, g, ta, tb, n_out, out, c0):
    grp = group_kernel(int_kind(w))
    return lambda xa, w, p0, g, ta, tb, n_out, out, c0: grp(xa, w, p0, g, ta, tb, n_out, out, c0)


# One compiled function per integer type, shared by every kind with a part of that type (as native's
# segments, `loaders._seg_gemv`: inlining each part's kernels into one function compiles slowly).

@njit(cache=True)
def seg_units(xa, w, p0, n_out, out, u0, u1, c0):
    _int_units(xa, w, p0, n_out, out, u0, u1, c0)


@njit(cache=True)
def seg_group(xa, w, p0, g, ta, tb, n_out, out, c0):
    _int_group(xa, w, p0, g, ta, tb, n_out, out, c0)


def _dispatch(w, body_int: str, body_float: str, env: dict):
    """f(w, i, xa, p0, g_or_u..., ...) with one branch per part (numba needs each part's type spelled
    out): `body_int` / `body_float` formatted with {part} (the part's slots as a tuple, or its panels)
    and {xa} (its activations: the 32- or 256-blocks)."""
    lines = ["def f(w, i, xa, p0, a, b, n_out, out, c0, ta, tb, wbuf):"]
    for i, (o, kind) in enumerate(_parts(w)):
        lines.append(f"    {'if' if i == 0 else 'elif'} i == {i}:")
        if kind is None:
            lines.append("        " + body_float.format(part=f"w[{o}]", xa="xa[0]"))
        else:
            part = "(" + ", ".join(f"w[{o + j}]" for j in range(6)) + ")"
            xa = "(xa[4], xa[5], xa[6])" if kind in K_KINDS else "(xa[1], xa[2], xa[3])"
            lines.append("        " + body_int.format(part=part, xa=xa))
    scope = dict(env, seg_units=seg_units, seg_group=seg_group)
    exec("\n".join(lines), scope)  # noqa: S102 (generated from the templates of the callers below)
    return njit(inline="always")(scope["f"])


def gemv_units(w, float_gemv):
    """f(xa, w, n_out, out, u0, u1): decode units u0 .. u1, each segment's share read as its own
    storage; `float_gemv(x, panels, p0, n_out, out, u0, u1, c0)` is native's for float parts."""
    part = _dispatch(w, "seg_units({xa}, {part}, p0, n_out, out, a, b, c0)",
                     "float_gemv({xa}, {part}, p0, n_out, out, a, b, c0)", {"float_gemv": float_gemv})

    def units(x, w, n_out, out, u0, u1):  # x: the activations (module docstring)
        tab = w[1]
        for s in range(tab.shape[0] - 1):
            a = max(u0, tab[s, 3])
            b = min(u1, tab[s + 1, 3])
            if a < b and tab[s, 0] >= 0:
                part(w, tab[s, 0], x, tab[s, 1], a - tab[s, 3], b - tab[s, 3], min(n_out, tab[s + 1, 2]), out,
                     tab[s, 2], 0, 0, out)
    return units


def prefill_group(w, float_fill, float_prefetch, buffered):
    """f(xa, w, g, ta, tb, n_out, out, wbuf): rows ta .. tb times group g (64 outputs) of the segment
    that holds it. A float part's group is filled into wbuf and tiled as native's (`float_fill(panels,
    p0, g, wbuf)`, `float_prefetch(panels, p0, g)`, `buffered(x, ta, tb, wbuf, 0, n0, n_out, out)`)."""
    part = _dispatch(w, "seg_group({xa}, {part}, p0, a, ta, tb, n_out, out, c0)",
                     "float_fill({part}, p0, a, wbuf)\n        float_prefetch({part}, p0, a + 1)\n"
                     "        buffered({xa}, ta, tb, wbuf, 0, c0 + a * 64, n_out, out)",
                     {"float_fill": float_fill, "float_prefetch": float_prefetch, "buffered": buffered})

    def group(x, w, g, ta, tb, n_out, out, wbuf):  # x as for gemv_units
        tab = w[1]
        for s in range(tab.shape[0] - 1):
            g0 = tab[s, 2] // LANES
            if tab[s, 0] >= 0 and g0 <= g < (tab[s + 1, 2] + LANES - 1) // LANES:
                part(w, tab[s, 0], x, tab[s, 1], g - g0, 0, min(n_out, tab[s + 1, 2]), out, tab[s, 2], ta, tb, wbuf)
    return group
