"""The integer mode's storage (kind "int8", one ggml type per kind: `packing.intpanels.INT_TYPES`): the
storage (tag, qs, d, m, sc, qh) of `packing.intpanels.IntPanels`, stacked over layers on every array's first
axis, multiplied by the integer block dots of `intdot.py` against the rows of x quantized to 8-bit
blocks (`actq.py`: 32 elements a block, 256 for the K-quants), once per product."""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.extending import overload

from ..actq import quantize_rows
from ..intdot import act_block, group_kernel, int_element, tile_rows, units_kernel
from ....packing.layout import QBLOCK
from ..qblocks import q_element
from ....numerics.simd import HALF
from .common import pick


def units(w):
    return lambda w: w[1].shape[0]


def groups(w):
    return lambda w: (w[1].shape[0] + 1) // 2


def tiling(w, T):
    # integer dots of a pair of panels: each job reads them once per tile of rows
    rows = tile_rows()
    return lambda w, T: (rows, 16, 3)


def few_rows(w, T):
    return lambda w, T: False


def gemv_units(x, w, n_out, out, u0, u1):
    kern = units_kernel(w[0].qtype)
    return lambda x, w, n_out, out, u0, u1: kern(x, w, 0, n_out, out, u0, u1, 0)


def prefill_group(x, w, g, ta, tb, n_out, out, wbuf):
    grp = group_kernel(w[0].qtype)
    return lambda x, w, g, ta, tb, n_out, out, wbuf: grp(x, w, 0, g, ta, tb, n_out, out, 0)


def act_alloc(x, w):
    """The rows' quants, block scales and sums of 16 (`actq.py`), uninitialized."""
    B = act_block(w[0].qtype)
    return lambda x, w: (np.empty(x.shape, np.int8), np.empty((x.shape[0], x.shape[1] // B), np.float32),
                         np.empty((x.shape[0], x.shape[1] // 16), np.int32))


def act_rows(x, w, xa, t0, t1):
    B = act_block(w[0].qtype)
    return lambda x, w, xa, t0, t1: quantize_rows(x, t0, t1, B, xa[0], xa[1], xa[2])


def quantizes(w):
    return lambda w: True


def layer(w, li):
    return lambda w, li: (w[0], w[1][li], w[2][li], pick(w[3], li), pick(w[4], li), pick(w[5], li))


def embed_rows(table, ids, x):
    # Q8_0's quants are regrouped (`int_element`); the other types keep the native arrays (`q_element`)
    element = int_element if table[0].qtype == "Q8_0" else q_element

    def rows(table, ids, x):
        for t in range(ids.shape[0]):
            p, j = ids[t] // HALF, ids[t] % HALF
            for k in range(x.shape[1]):
                x[t, k] = element(table, p, k // QBLOCK, k % QBLOCK, j)
    return rows


# An integer part of a mixed storage (`intmixed.py`): one compiled function per type, shared by every
# kind with a part of that type (as native's segments: inlining each part's kernels into one function
# compiles slowly).

def _int_units(xa, w, p0, n_out, out, u0, u1, c0):
    raise NotImplementedError("_int_units is for jitted code")


@overload(_int_units)
def _int_units_impl(xa, w, p0, n_out, out, u0, u1, c0):
    kern = units_kernel(w[0].qtype)
    return lambda xa, w, p0, n_out, out, u0, u1, c0: kern(xa, w, p0, n_out, out, u0, u1, c0)


def _int_group(xa, w, p0, g, ta, tb, n_out, out, c0):
    raise NotImplementedError("_int_group is for jitted code")


@overload(_int_group)
def _int_group_impl(xa, w, p0, g, ta, tb, n_out, out, c0):
    grp = group_kernel(w[0].qtype)
    return lambda xa, w, p0, g, ta, tb, n_out, out, c0: grp(xa, w, p0, g, ta, tb, n_out, out, c0)


@njit(cache=True)
def seg_units(xa, w, p0, n_out, out, u0, u1, c0):
    _int_units(xa, w, p0, n_out, out, u0, u1, c0)


@njit(cache=True)
def seg_group(xa, w, p0, g, ta, tb, n_out, out, c0):
    _int_group(xa, w, p0, g, ta, tb, n_out, out, c0)
