"""The integer mode (dtype "int8") of the GPU backend, host side: `packing.intpanels.IntPanels` on the device, the
activations' quantization buffers, and the launches of a product whose segments are integer parts
(kernels.cu `act_quant`, `imm_*`) beside float ones (`products.mm`'s gemv / gemm).

As on the CPU (`cpu/intmixed.py`), the rows of x are quantized once per product and block size (32
beside Q8_0/Q4_0/Q4_1/Q5_0/MXFP4, 256 beside the K-quants), and every integer segment of that block size
reads the same quants; float segments take x itself. With a fused RMSNorm, 1 / rms per row is in `inv`
(`products.mm` fills it first) and the quantization reads RMSNorm's output as it loads x (rms_scale's
operations): the CPU normalizes, then quantizes what it got, the same floats."""

from __future__ import annotations

import numpy as np

from ...packing.intpanels import IntPanels
from ...packing.layout import K_QUANTS
from ...packing.names import NATIVE_TYPES

IROWS, IOUT, ITHREADS = 8, 32, 256  # kernels.cu IROWS, IOUT (the largest tn), ITHREADS
PREFIX = "int_"  # a segment's kernel suffix for an integer part: int_<type>
K_NAMES = frozenset(NATIVE_TYPES[t].lower() for t in K_QUANTS)


def upload(dev, w: IntPanels, dummy) -> tuple:
    """(kernel suffix, five device arrays (dummy where absent)) of IntPanels, as `products._upload`."""
    arrays = tuple(dummy if a is None else dev.to_device(a) for a in (w.qs, w.d, w.m, w.sc, w.qh))
    return PREFIX + NATIVE_TYPES[w.ggml_type].lower(), arrays


def is_int(name: str) -> bool:
    return name.startswith(PREFIX)


def block_of(name: str) -> int:
    """Elements per activation block an integer segment takes."""
    return 256 if name[len(PREFIX):] in K_NAMES else 32


def embed_kernel(name: str) -> str:
    """The embedding kernel of a segment: an integer part's rows read from its arrays (Q8_0's regrouped)."""
    if not is_int(name):
        return f"embed_{name}"
    kind = name[len(PREFIX):]
    return "embed_q8_0i" if kind == "q8_0" else f"embed_{kind}"


def out_per_block(n: int) -> int:
    """imm's outputs per block for n outputs: 32 (whole 128-byte lines of a panel's words), halved down to
    8 (whole 32-byte sectors) while that leaves under 264 blocks (2 per SM of an H100), as gemv's tn."""
    tn = IOUT
    while tn > 8 and -(-n // tn) < 264:
        tn //= 2
    return tn


class ActBuffers:
    """Device buffers for up to `rows` rows of up to `k` activations quantized in blocks of 32 and of
    256: per block size (xq int8, xd float32, xs int32), flat (a product uses their first T * K)."""

    def __init__(self, xp, rows: int, k: int):
        n = max(rows, 1) * k
        self.rows, self.k = rows, k
        self.q = {B: (xp.zeros(n, np.int8), xp.zeros(max(n // B, 1), np.float32), xp.zeros(max(n // 16, 1), np.int32))
                  for B in (32, 256)}


def int_mm(dev, x, ints: list, out, dummy, act: ActBuffers, norm, inv, bias, epi: int) -> None:
    """out[:, c0:n1] = x W^T for the integer segments of a layer (`products.Matrix.layer`; its float
    segments are `products.mm`'s): x quantized once per block size they take, then their `imm_*`
    launches. With norm, `inv` holds 1 / rms per row already."""
    T, K = x.shape
    if T > act.rows or K > act.k:
        raise ValueError(f"int_mm: {T} x {K} activations do not fit the buffers ({act.rows} x {act.k})")
    nw = dummy if norm is None else norm[0]
    for B in sorted({block_of(s[0]) for s in ints}):
        xq, xd, xs = act.q[B]
        dev.launch("act_quant", (-(-T * (K // B) // 128),), (128,),
                   (x, T, K, B, nw, inv if norm is not None else dummy, int(norm is not None), xq, xd, xs))
    bias_arr = dummy if bias is None else bias
    for name, arrays, p0, c0, n1 in ints:
        xq, xd, xs = act.q[block_of(name)]
        tn = out_per_block(n1 - c0)
        dev.launch(f"imm_{name[len(PREFIX):]}", (-(-(n1 - c0) // tn), -(-T // IROWS)), (ITHREADS,),
                   (xq, xd, xs, T, K, *arrays, p0, c0, n1, out, out.shape[1], bias_arr, epi, tn))
