"""How the one matrix product (`matmul.py`) reads each storage kind: float panels (float32 or fp16
bits), GGUF's quantized blocks in the panel layout of `packing/layout.py` (native), the integer mode's, and
kinds mixing them by runs of rows. Each kind is implemented by its own module under `storage/`, found
in one table (`storage/table.py`) by the kind's tag (`storage/kinds.py`): the functions below are one
dispatch each.

Every weight reaches the sum as exactly the float32 value `formats.dequant` gives it (`qblocks.py`
says how, type by type), so every float or native storage computes the bits of the float32 matrix.

A storage kind provides, to the shared drivers:
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
  embed_rows(W, ...)  rows of W (a token table) widened or dequantized exactly
Each takes the arguments' numba types and returns the implementation (an overload's body).
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.extending import overload

from ...packing.layout import QPanels
from ...numerics.simd import LANES
from .storage.kinds import as_storage, impl
from .storage.table import TABLE  # noqa: F401 (fills the table `impl` reads)


# ---------------------------------------------------------------------------------------------------
# The storage interface (module docstring): each function dispatches once, on the storage's kind (the
# tag in its first slot, or float panels' element type), to that kind's module (`storage/table.py`).

def units(w):
    raise NotImplementedError("units is for jitted code")


@overload(units)
def _units(w):
    return impl(w).units(w)


def groups(w):
    raise NotImplementedError("groups is for jitted code")


@overload(groups)
def _groups(w):
    return impl(w).groups(w)


def tiling(w, T):
    raise NotImplementedError("tiling is for jitted code")


@overload(tiling)
def _tiling(w, T):
    return impl(w).tiling(w, T)


def few_rows(w, T):
    raise NotImplementedError("few_rows is for jitted code")


@overload(few_rows)
def _few_rows(w, T):
    return impl(w).few_rows(w, T)


def gemv_units(x, w, n_out, out, u0, u1):
    raise NotImplementedError("gemv_units is for jitted code")


@overload(gemv_units)
def _gemv_units(x, w, n_out, out, u0, u1):
    return impl(w).gemv_units(x, w, n_out, out, u0, u1)


def prefill_group(x, w, g, ta, tb, n_out, out, wbuf):
    raise NotImplementedError("prefill_group is for jitted code")


@overload(prefill_group)
def _prefill_group(x, w, g, ta, tb, n_out, out, wbuf):
    return impl(w).prefill_group(x, w, g, ta, tb, n_out, out, wbuf)


def act_alloc(x, w):
    raise NotImplementedError("act_alloc is for jitted code")


@overload(act_alloc, inline="always")
def _act_alloc(x, w):
    return impl(w).act_alloc(x, w)


def act_rows(x, w, xa, t0, t1):
    raise NotImplementedError("act_rows is for jitted code")


@overload(act_rows, inline="always")
def _act_rows(x, w, xa, t0, t1):
    return impl(w).act_rows(x, w, xa, t0, t1)


def quantizes(w):
    raise NotImplementedError("quantizes is for jitted code")


@overload(quantizes, inline="always")
def _quantizes(w):
    return impl(w).quantizes(w)


def layer(w, li):
    raise NotImplementedError("layer is for jitted code")


@overload(layer, inline="always")
def _layer(w, li):
    return impl(w).layer(w, li)


def embed_rows(table, ids, x):
    """x[t] = row ids[t] of `table`: a float (vocab, dim) table, float panels, or quantized panels."""
    raise NotImplementedError("embed_rows is for jitted code")


@overload(embed_rows)
def _embed_rows(table, ids, x):
    return impl(table).embed_rows(table, ids, x)


# ---------------------------------------------------------------------------------------------------
# Rows of a matrix (an embedding table, or a tied output matrix serving as one), widened exactly.

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
