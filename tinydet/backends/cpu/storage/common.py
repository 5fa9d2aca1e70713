"""Pieces the storage kinds share: prefetching panels, a stack's layer of an optional array, and the
activations of every kind that takes the rows of x as they are (all but the integer mode's).

Like every kind module's functions, the interface functions here take the arguments' numba types
and return the implementation (`loaders.py` overloads with them)."""

from __future__ import annotations

from numba import types
from numba.extending import overload

from ....numerics.simd import prefetch


def prefetch_panels(a, p0, p1):
    raise NotImplementedError("prefetch_panels is for jitted code")


@overload(prefetch_panels, inline="always")
def _prefetch_panels(a, p0, p1):
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


def pick(a, li):
    raise NotImplementedError("pick is for jitted code")


@overload(pick, inline="always")
def _pick(a, li):
    """a[li], or None for a None slot."""
    if isinstance(a, types.NoneType):
        return lambda a, li: None
    return lambda a, li: a[li]


# The activations of a kind that reads x itself.

def act_alloc(x, w):
    return lambda x, w: x


def act_rows(x, w, xa, t0, t1):
    return lambda x, w, xa, t0, t1: None


def quantizes(w):
    return lambda w: False
