"""Matrix kinds whose rows are not all one storage type (kind "mixed", `packing.layout.MixedPanels`): layers of
different types, or a layer's rows in runs (segments) of different types, each segment starting at a
multiple of 64 outputs, so that every decode unit and prefill group lies in one segment and is read
exactly as a matrix of the segment's type would be.

The storage: (tag, table, then 6 slots per part), each part the storage tuple of its own kind, a
quantized one (`quantized.py`) or float panels' (tag, panels, None, None, None, None) (`floats.py`);
only the table has the layer axis. Each part is computed by its own kind's segment functions
(`seg_gemv`, `seg_fill`, `seg_prefetch`, found in the table by the part's tag: `part_call`)."""

from __future__ import annotations

from numba.extending import overload

from ....numerics.simd import LANES
from ..tiles import buffered
from .common import act_alloc, act_rows, quantizes  # noqa: F401 (x as it is)
from .kinds import module
from .quantized import few_rows, tiling  # noqa: F401 (those of its quantized parts, which float parts follow)


def part_slots(w) -> list[int]:
    """The first slot (its tag) of each part of a mixed storage tuple's numba type."""
    return list(range(2, len(w), 6))


def part_call(w, args: str, name: str, call: str):
    """f(w, i, <args>) calling, for a runtime part index i, the function `name` of part i's kind on
    `call` (formatted with {part}, the part's 6 slots as a tuple): numba needs each part's type spelled
    out, so one branch per part."""
    lines = [f"def f(w, i, {args}):"]
    scope = {}
    for n, o in enumerate(part_slots(w)):
        scope[f"fn{n}"] = getattr(module(w[o].kind), name)
        part = "(" + ", ".join(f"w[{o + j}]" for j in range(6)) + ")"
        lines.append(f"    {'if' if n == 0 else 'elif'} i == {n}:")
        lines.append(f"        fn{n}({call.format(part=part)})")
    exec("\n".join(lines), scope)  # noqa: S102 (generated from the templates of the callers below)
    return scope["f"]


def _part_gemv(w, i, x, p0, n_out, out, u0, u1, c0):
    raise NotImplementedError("_part_gemv is for jitted code")


def _part_fill(w, i, p0, g, wbuf):
    raise NotImplementedError("_part_fill is for jitted code")


def _part_prefetch(w, i, p0, g):
    raise NotImplementedError("_part_prefetch is for jitted code")


@overload(_part_gemv, inline="always")
def _part_gemv_impl(w, i, x, p0, n_out, out, u0, u1, c0):
    return part_call(w, "x, p0, n_out, out, u0, u1, c0", "seg_gemv", "x, {part}, p0, n_out, out, u0, u1, c0")


@overload(_part_fill, inline="always")
def _part_fill_impl(w, i, p0, g, wbuf):
    return part_call(w, "p0, g, wbuf", "seg_fill", "{part}, p0, g, wbuf")


@overload(_part_prefetch, inline="always")
def _part_prefetch_impl(w, i, p0, g):
    return part_call(w, "p0, g", "seg_prefetch", "{part}, p0, g")


def units(w):
    return lambda w: w[1][w[1].shape[0] - 1, 3]


def groups(w):
    return lambda w: (w[1][w[1].shape[0] - 1, 2] + LANES - 1) // LANES


def gemv_units(x, w, n_out, out, u0, u1):
    # Each segment's share of the units, read as its own storage type.
    def mixed(x, w, n_out, out, u0, u1):
        tab = w[1]
        for s in range(tab.shape[0] - 1):
            a = max(u0, tab[s, 3])
            b = min(u1, tab[s + 1, 3])
            if a < b and tab[s, 0] >= 0:
                _part_gemv(w, tab[s, 0], x, tab[s, 1], min(n_out, tab[s + 1, 2]), out, a - tab[s, 3],
                           b - tab[s, 3], tab[s, 2])
    return mixed


def prefill_group(x, w, g, ta, tb, n_out, out, wbuf):
    def mixed(x, w, g, ta, tb, n_out, out, wbuf):
        tab = w[1]
        for s in range(tab.shape[0] - 1):
            g0 = tab[s, 2] // LANES
            if tab[s, 0] >= 0 and g0 <= g < (tab[s + 1, 2] + LANES - 1) // LANES:
                # the group's weights as float32, then the one tiling of every dequantized pair
                _part_fill(w, tab[s, 0], tab[s, 1], g - g0, wbuf)
                _part_prefetch(w, tab[s, 0], tab[s, 1], g - g0 + 1)  # the next group (`quantized.seg_prefetch`)
                buffered(x, ta, tb, wbuf, 0, g * LANES, min(n_out, tab[s + 1, 2]), out)
    return mixed


def layer(w, li):  # the parts have no layer axis
    return lambda w, li: (w[0], w[1][li]) + w[2:]


def embed_rows(table, ids, x):
    raise TypeError("a token table of mixed storage types has no embedding rows")
