"""The matrix products and embeddings of the GPU backend, host side: a packed matrix kind on the device
(`_Matrix`: one launch per storage run of a layer), which kernel runs a product (gemv for a few rows,
gemm's tiles for more) and its launch shape, and `product` / `embed` for the tests. Integer parts (dtype
"int8") are launched by `intproducts.int_mm`."""

from __future__ import annotations

import numpy as np

from ...packing.intpanels import IntPanels
from ...packing.layout import MixedPanels, QPanels
from . import intproducts
from .intproducts import ActBuffers, embed_kernel, int_mm, is_int

BLOCK = 128
# The products (kernels.cu gemm, gemv): up to GEMV_ROWS rows (decode, small batches) run gemv, which
# reads each weight once for VROWS rows; more run gemm's 64 x 64 tiles.
GT, GTHREADS = 64, 256  # kernels.cu GT, GTHREADS
VROWS, VPART = 8, 8192  # kernels.cu VROWS, VPART
RTHREADS = 256  # rms_inv_rows' threads a block: they load its VROWS rows into shared memory
GEMV_ROWS = VROWS
AMAX_HD = 256  # kernels.cu AMAX_HD: the largest head_dim of `attend`


def blocks(n: int, block: int = BLOCK) -> int:
    return max(1, -(-int(n) // block))


class Matrix:
    """A packed matrix kind (`CPUWeights`' float panels, QPanels, IntPanels or MixedPanels; stacked over
    layers or not) on the device, as the launches of its product: per layer, one segment per storage
    run, (kernel suffix, (qs, d, m, sc, qh), first panel, first output, end output); an integer
    part's suffix is int_<type> (`intproducts`)."""

    def __init__(self, dev, w, n_out: int, stacked: bool, dummy):
        self.n_out = n_out
        layers = range(_n_layers(w) if stacked else 1)
        if isinstance(w, MixedPanels):
            parts = [_upload(dev, p, dummy) for p in w.parts]
            tab = w.table
            self.segments = []
            for li in layers:
                segs = []
                for s in range(tab.shape[1] - 1):
                    part, p0, c0, c1 = (int(v) for v in (tab[li, s, 0], tab[li, s, 1], tab[li, s, 2], tab[li, s + 1, 2]))
                    if part >= 0 and c0 < min(n_out, c1):
                        segs.append((*parts[part], p0, c0, min(n_out, c1)))
                self.segments.append(segs)
        else:
            name, arrays = _upload(dev, w, dummy)
            self.segments = [[(name, tuple(a[li] if stacked and a is not dummy else a for a in arrays), 0, 0, n_out)]
                             for li in layers]

    def layer(self, li: int | None) -> list:
        return self.segments[0 if li is None else li]


def _n_layers(w) -> int:
    if isinstance(w, MixedPanels):
        return w.table.shape[0]
    return (w.qs if isinstance(w, (QPanels, IntPanels)) else w).shape[0]


def _upload(dev, w, dummy) -> tuple:
    """(kernel suffix, five device arrays (dummy where absent)) of float panels, a (rows, K)
    table, QPanels or IntPanels."""
    if isinstance(w, IntPanels):
        return intproducts.upload(dev, w, dummy)
    if isinstance(w, QPanels):
        return w.type_name.lower(), tuple(dummy if a is None else dev.to_device(a) for a in (w.qs, w.d, w.m, w.sc, w.qh))
    kind = "f16" if w.dtype == np.uint16 else "f32"
    name = ("rows_" if w.ndim == 2 else "") + kind  # a (rows, K) table, or panels
    return name, (dev.to_device(w), dummy, dummy, dummy, dummy)


def _gemv_shape(T: int, K: int, N: int) -> tuple[int, int] | None:
    """gemv's outputs per block and threads per block for a T-row product of N outputs over K, or None
    where its chains' sums would not fit in shared memory (VPART; gemm then runs it). Blocks of 8-32
    outputs: wide enough for whole memory sectors of the panels' rows, narrow enough for a few hundred
    blocks where N allows."""
    nkb, rows = -(-K // 64), min(T, VROWS)
    tn = 32
    while tn > 1 and (tn * nkb * rows > VPART or (tn > 8 and -(-N // tn) < 264)):
        tn //= 2
    if tn * nkb * rows > VPART:
        return None
    return tn, min(GTHREADS, -(-tn * nkb // 32) * 32)


def mm(dev, x, segments: list, out, dummy, norm=None, inv=None, bias=None, epi: int = 0, act=None) -> None:
    """out[:, c0:n1] = x W^T for each segment of a matrix's layer (`Matrix.layer`), ended by kernels.cu's
    `epilogue` epi (1: + bias, 2: out += the product). With norm = (weights, eps), x is RMSNorm's input
    and the product takes its output: gemv computes 1 / rms per row in each block, gemm reads it from
    `inv` (a float32 buffer of T), filled here first. Integer parts (the int8 mode) take `act`, an
    `intproducts.ActBuffers` their quantized activations are made in (`intproducts.int_mm`)."""
    T, K = x.shape
    ints = [s for s in segments if is_int(s[0])]
    floats = [s for s in segments if not is_int(s[0])]
    nw, eps = norm if norm is not None else (dummy, 0.0)
    shapes = [_gemv_shape(T, K, n1 - c0) if T <= GEMV_ROWS else None for *_, c0, n1 in floats]
    if norm is not None and (ints or any(sh is None for sh in shapes)):  # 1 / rms per row, once
        rms_inv_rows(dev, x, eps, inv)
    if ints:
        int_mm(dev, x, ints, out, dummy, act, norm, inv, bias, epi)
    bias = dummy if bias is None else bias
    for (name, arrays, p0, c0, n1), shape in zip(floats, shapes):
        if shape is not None:
            tn, threads = shape
            dev.launch(f"gemv_{name}", (blocks(n1 - c0, tn), blocks(T, VROWS)), (threads,),
                       (x, T, K, *arrays, p0, c0, n1, out, out.shape[1], nw, int(norm is not None),
                        np.float32(eps), bias, epi, tn))
        else:
            dev.launch(f"gemm_{name}", (blocks(n1 - c0, GT), blocks(T, GT)), (GTHREADS,),
                       (x, T, K, *arrays, p0, c0, n1, out, out.shape[1], nw,
                        inv if norm is not None else dummy, int(norm is not None), bias, epi))


def rms_inv_rows(dev, x, eps, inv) -> None:
    """inv[t] = 1 / rms of row t of x (T, D), RMSNorm's chain (kernels.cu rms_inv_rows: VROWS rows a block)."""
    T, D = x.shape
    dev.launch("rms_inv_rows", (blocks(T, VROWS),), (RTHREADS,), (x, T, D, np.float32(eps), inv))


def embed_rows(dev, ids, T: int, K: int, segments: list, out) -> None:
    """out[t] = row ids[t] of the matrix whose segments are given (`Matrix.layer`)."""
    for name, arrays, p0, c0, n1 in segments:
        dev.launch(embed_kernel(name), (blocks(T * K),), (BLOCK,), (ids, T, K, *arrays, p0, c0, n1, out))


def product(dev, x: np.ndarray, w, n_out: int, layer: int | None = None, norm=None, bias=None,
            out=None) -> np.ndarray:
    """x W^T (n_out outputs) by the GPU kernels on `dev`, for W in a CPU backend storage: float panels
    QPanels or IntPanels (the int8 mode's integer products), or with `layer` a kind stacked over layers
    (MixedPanels too). With norm = (weights, eps)
    the product of RMSNorm(x); with `bias` (n_out) the bias added; with `out` (rows, n_out) the product
    added to it (a residual add)."""
    dummy = dev.to_device(np.zeros(1, np.float32))
    mat = Matrix(dev, w, n_out, layer is not None, dummy)
    res = dev.to_device(np.full((x.shape[0], n_out), np.nan, np.float32) if out is None else out.copy())
    put = (lambda a: None if a is None else dev.to_device(np.ascontiguousarray(a, np.float32)))
    inv = dev.to_device(np.full(x.shape[0], np.nan, np.float32))
    nrm = None if norm is None else (put(norm[0]), norm[1])
    act = ActBuffers(dev.xp, x.shape[0], x.shape[1])
    mm(dev, put(x), mat.layer(layer), res, dummy, nrm, inv, put(bias), 1 if bias is not None else 2 * (out is not None),
       act)
    return np.array(dev.to_host(res))


def embed(dev, w, ids, k: int) -> np.ndarray:
    """Rows `ids` of the matrix W (k columns) in a CPU backend storage, read by the GPU kernels."""
    n = w.n if isinstance(w, (QPanels, IntPanels)) else (w.shape[0] * 64 if w.ndim == 3 else w.shape[0])
    ids = np.ascontiguousarray(ids, np.int64)
    mat = Matrix(dev, w, n, False, dev.to_device(np.zeros(1, np.float32)))
    out = dev.to_device(np.full((ids.shape[0], k), np.nan, np.float32))
    embed_rows(dev, dev.to_device(ids), ids.shape[0], k, mat.layer(None), out)
    return np.array(dev.to_host(out))
