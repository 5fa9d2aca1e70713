"""The NumPy quantized-panel packer that `layout.pack_parts` used before its numba kernel
(`packing/repack.py`), kept as the reference the kernel is held to, byte for byte: the same
regrouping written another way (whole-array shifts, reductions and transposes)."""

from __future__ import annotations

import numpy as np

from tinydet.packing import layout
from tinydet.packing.layout import K_QUANTS, MXFP4, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, QBLOCK, QK_K, QPANEL
from tinydet.formats.ggml import GGML_TYPES

_NIBBLE_SHIFTS = np.arange(0, 32, 4, dtype=np.uint32)
_PAIR_SHIFTS = np.arange(0, 32, 2, dtype=np.uint32)
_BIT_SHIFTS = np.arange(32, dtype=np.uint32)


def _words(vals, shifts):
    v = vals.astype(np.uint32).reshape(vals.shape[0], -1, shifts.size) << shifts
    return np.bitwise_or.reduce(v, axis=2)


def _low4(tid, b):
    n = b.shape[0]
    if tid in (Q4_0, Q4_1, Q5_0, Q5_1, MXFP4):
        raw_q = b[:, :, {Q4_0: 2, Q4_1: 4, Q5_0: 6, Q5_1: 8, MXFP4: 1}[tid]:][:, :, :16]
        return np.concatenate([raw_q & np.uint8(15), raw_q >> np.uint8(4)], axis=2).reshape(n, -1)
    if tid in (Q4_K, Q5_K):
        qs = b[:, :, 16 if tid == Q4_K else 48:][:, :, :128].reshape(n, -1, 4, 1, 32)
        return np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=3).reshape(n, -1)
    ql = b[:, :, 0:128].reshape(n, -1, 2, 2, 32)
    return np.concatenate([ql & np.uint8(15), ql >> np.uint8(4)], axis=3).reshape(n, -1)


def _high(tid, b):
    n = b.shape[0]
    if tid in (Q5_0, Q5_1):  # the 32 high bits after the scale (and Q5_1's min)
        o = 2 if tid == Q5_0 else 4
        return np.unpackbits(b[:, :, o:o + 4], axis=2, bitorder="little").reshape(n, -1)
    if tid == Q5_K:
        bits_ = np.unpackbits(b[:, :, 16:48, None], axis=3, bitorder="little")
        return np.ascontiguousarray(bits_.transpose(0, 1, 3, 2)).reshape(n, -1)
    qh = b[:, :, 128:192].reshape(n, -1, 2, 1, 32)
    return ((qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & np.uint8(3)).reshape(n, -1)


def _fields(tid, c):
    m = c.shape[0]

    def bits(o):
        return np.ascontiguousarray(c[:, :, o:o + 2]).view("<u2")[:, :, 0].astype(np.uint16)

    if tid == Q8_0:
        f = {"qs": c[:, :, 2:34].reshape(m, -1).view(np.int8)}
    else:
        f = {"qs": _words(_low4(tid, c), _NIBBLE_SHIFTS).reshape(m, -1, 4)}
    if tid in (Q5_0, Q5_1, Q5_K):
        f["qh"] = _words(_high(tid, c), _BIT_SHIFTS)
    elif tid == Q6_K:
        f["qh"] = _words(_high(tid, c), _PAIR_SHIFTS).reshape(m, -1, 2)
    if tid == Q6_K:
        f["d"], f["sc"] = bits(208), c[:, :, 192:208].view(np.int8)
    elif tid == MXFP4:  # the E8M0 exponent byte
        f["d"] = c[:, :, 0]
    else:
        f["d"] = bits(0)
        if tid in (Q4_1, Q5_1, Q4_K, Q5_K):
            f["m"] = bits(2)
        if tid in (Q4_K, Q5_K):
            f["sc"] = c[:, :, 4:16]
    return f


def _into_panels(dst, r0, a):
    m = a.shape[0]
    full = -(-m // QPANEL) * QPANEL
    if full != m:
        a = np.concatenate([a, np.zeros((full - m,) + a.shape[1:], a.dtype)])
    dst[r0 // QPANEL:(r0 + full) // QPANEL] = np.moveaxis(a.reshape((full // QPANEL, QPANEL) + a.shape[1:]), 1, -1)


def _scale_storage(bits):
    """fp16 scale bits with every signaling NaN quieted (its quiet bit, 0x0200, set)."""
    snan = ((bits & 0x7C00) == 0x7C00) & ((bits & 0x03FF) != 0) & ((bits & 0x0200) == 0)
    return np.where(snan, bits | 0x0200, bits).astype(np.uint16)


def pack_parts(parts, tid, k):
    """[(raw, order), ...] -> the QPanels today's kernel must reproduce byte for byte."""
    t = GGML_TYPES[tid]
    row_bytes = k // t.block_size * t.type_size
    blocks = []
    for raw, order in parts:
        rows = np.asarray(raw).reshape(-1, row_bytes)
        blocks.append(rows if order is None else rows[np.asarray(order)])
    rows = np.concatenate(blocks)
    n = rows.shape[0]
    P = -(-n // QPANEL)
    b = rows.reshape(n, k // t.block_size, t.type_size)
    nb, ns = k // QBLOCK, k // QK_K
    scale = (P, ns if tid in K_QUANTS else nb, QPANEL)
    shapes = {"qs": (np.int8, (P, k, QPANEL)) if tid == Q8_0 else (np.uint32, (P, nb, 4, QPANEL)),
              "d": (np.uint8, scale) if tid == MXFP4 else (np.uint16, scale)}
    if tid in (Q4_1, Q5_1, Q4_K, Q5_K):
        shapes["m"] = (np.uint16, scale)
    if tid in (Q4_K, Q5_K):
        shapes["sc"] = (np.uint8, (P, ns, 12, QPANEL))
    if tid == Q6_K:
        shapes["sc"] = (np.int8, (P, ns, 16, QPANEL))
    if tid in (Q5_0, Q5_1, Q5_K):
        shapes["qh"] = (np.uint32, (P, nb, QPANEL))
    if tid == Q6_K:
        shapes["qh"] = (np.uint32, (P, nb, 2, QPANEL))
    out = {name: np.zeros(shape, dt) for name, (dt, shape) in shapes.items()}
    for name, a in _fields(tid, b).items():
        _into_panels(out[name], 0, a)
    for name in ("d", "m"):
        if name in out and out[name].dtype == np.uint16:
            out[name] = _scale_storage(out[name])
    return layout.QPanels(tid, n, k, out["qs"], out["d"], out.get("m"), out.get("sc"), out.get("qh"))
