"""An independent NumPy reference of the integer mode's rules (backends/cpu/actq.py, intdot.py), written
from the rules and GGUF's block format, not from the kernels: quants read from the file's bytes as
integers, exact integer block dots, float32 scaling in the stated order (one NumPy op per rounding, so no FMA),
np.rint for the rounding, Kahan over the blocks in order."""

from __future__ import annotations

import numpy as np

f32 = np.float32
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "MXFP4": 17}
OFFSET = {"Q8_0": 0, "Q4_0": 8, "Q4_1": 0, "Q5_0": 16, "MXFP4": 0}
# MXFP4's codes as ggml's kvalues_mxfp4: the E2M1 values doubled (their half is in the scale 2^(e - 128))
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int64)


def quantize(x: np.ndarray, B: int = 32):
    """x (T, K) float32 -> q (T, K) int64 in element order, d (T, K / B) float32 (NaN: a non-finite
    block), by the rule: d = amax / 127, q = rint(x * (127 / amax)) clamped to +-127; amax < 2^-64: zeros."""
    T, K = x.shape
    xb = x.reshape(T, K // B, B).astype(f32)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        a = np.abs(xb)
        bad = ~np.isfinite(a).all(axis=2)
        amax = np.where(np.isfinite(a), a, f32(0)).max(axis=2)
        zero = amax < f32(2.0 ** -64)
        d = np.where(bad, f32(np.nan), np.where(zero, f32(0), amax / f32(127))).astype(f32)
        inv = np.where(bad | zero, f32(1), f32(127) / np.where(zero, f32(1), amax)).astype(f32)
        q = np.clip(np.rint(xb * inv[:, :, None]), -127, 127)
        q = np.where((bad | zero)[:, :, None], 0, q)
    return q.astype(np.int64).reshape(T, K), d


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(f32)


def block_quants(raw: np.ndarray, name: str, n: int, k: int):
    """The file's blocks (n, row bytes) -> (quants (n, k) int64 as the integer dot takes them: unsigned
    for Q4_0/Q4_1/Q5_0, signed for Q8_0 and MXFP4 (its codes' kvalues); d (n, k/32) float32; m (n, k/32) float32 or None)."""
    b = np.asarray(raw, np.uint8).reshape(n, k // 32, BLOCK_BYTES[name])
    if name == "MXFP4":  # signed quants kvalues[code]; d = 2^(e - 128), exact in float32 (subnormal for e < 2)
        d = np.ldexp(1.0, b[:, :, 0].astype(np.int64) - 128).astype(f32)
        qs = b[:, :, 1:17]
        return KVALUES_MXFP4[np.concatenate([qs & 15, qs >> 4], axis=2)].reshape(n, k), d, None
    d = _f16(b[:, :, 0:2])
    m = _f16(b[:, :, 2:4]) if name == "Q4_1" else None
    if name == "Q8_0":
        q = b[:, :, 2:34].view(np.int8).astype(np.int64)
    else:
        qs = b[:, :, {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6}[name]:][:, :, :16]
        q = np.concatenate([qs & 15, qs >> 4], axis=2).astype(np.int64)  # byte i: element i low, 16 + i high
        if name == "Q5_0":
            h = np.ascontiguousarray(b[:, :, 2:6]).view("<u4")[:, :, 0].astype(np.int64)
            q = q | (((h[:, :, None] >> np.arange(32)) & 1) << 4)
    return q.reshape(n, k), d, m


def block_dots(qb: np.ndarray, wb: np.ndarray) -> np.ndarray:
    """Integer dots of every block: qb (T, nb, B), wb (n, nb, B) int64 -> (nb, T, n) int64. Computed with
    float64 products (BLAS, for speed), which are exact here: every product and every partial sum is an
    integer below 2^53 (|q| <= 127, |w| <= 128, B <= 32), so no order of the sum can round."""
    assert np.abs(qb).max(initial=0) <= 127 and np.abs(wb).max(initial=0) <= 128 and qb.shape[2] <= 32
    a = np.ascontiguousarray(qb.transpose(1, 0, 2), np.float64)  # contiguous: BLAS per block
    b = np.ascontiguousarray(wb.transpose(1, 2, 0), np.float64)
    return np.rint(np.stack([a[i] @ b[i] for i in range(a.shape[0])])).astype(np.int64)  # (faster than batched @)


def product(x: np.ndarray, raw: np.ndarray, name: str, n: int, k: int) -> np.ndarray:
    """out (T, n) float32 of the integer mode's rules."""
    q, dx = quantize(x)
    wq, dw, mw = block_quants(raw, name, n, k)
    T, nb = x.shape[0], k // 32
    qb = q.reshape(T, nb, 32)
    wb = wq.reshape(n, nb, 32)
    bs = qb.sum(axis=2)  # (T, nb)
    dots = block_dots(qb, wb)  # (nb, T, n)
    s = np.zeros((T, n), f32)
    c = np.zeros((T, n), f32)
    with np.errstate(invalid="ignore", over="ignore"):
        for b in range(nb):
            isum = dots[b] - OFFSET[name] * bs[:, b:b + 1]  # int64, exact
            assert np.abs(isum).max(initial=0) < 2 ** 24
            f = isum.astype(f32) * (dw[None, :, b] * dx[:, b:b + 1])
            if name == "Q4_1":
                f = f + bs[:, b:b + 1].astype(f32) * (mw[None, :, b] * dx[:, b:b + 1])
            y = f - c
            z = s + y
            c = (z - s) - y
            s = z
    return s


# --- the K-quants, against activations in blocks of 256 (Q8_K) ------------------------------------------

K_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def k_block_quants(raw: np.ndarray, name: str, n: int, k: int):
    """The file's K-quant blocks -> (quants (n, k) int64 unsigned: 0..15, 0..31, Q6_K 0..63; per 32-element
    sub-block (Q6_K: per 16) the integer scale sc and (Q4_K/Q5_K) min mn (n, k/32 or k/16) int64;
    d and dmin (n, k/256) float32, dmin None for Q6_K). Element order is formats.dequant's."""
    ns = k // 256
    b = np.asarray(raw, np.uint8).reshape(n, ns, K_BLOCK_BYTES[name])
    if name == "Q6_K":
        ql, qh = b[:, :, 0:128].astype(np.int64), b[:, :, 128:192].astype(np.int64)
        sc = b[:, :, 192:208].view(np.int8).astype(np.int64).reshape(n, -1)
        d = _f16(b[:, :, 208:210])
        q = np.empty((n, ns, 256), np.int64)
        for h in range(2):
            L, H = ql[:, :, 64 * h:64 * h + 64], qh[:, :, 32 * h:32 * h + 32]
            base = 128 * h
            q[:, :, base:base + 32] = (L[:, :, :32] & 15) | ((H & 3) << 4)
            q[:, :, base + 32:base + 64] = (L[:, :, 32:] & 15) | (((H >> 2) & 3) << 4)
            q[:, :, base + 64:base + 96] = (L[:, :, :32] >> 4) | (((H >> 4) & 3) << 4)
            q[:, :, base + 96:base + 128] = (L[:, :, 32:] >> 4) | (((H >> 6) & 3) << 4)
        return q.reshape(n, k), sc, None, d, None
    d, dmin = _f16(b[:, :, 0:2]), _f16(b[:, :, 2:4])
    s = b[:, :, 4:16].astype(np.int64)
    sc = np.empty((n, ns, 8), np.int64)
    mn = np.empty((n, ns, 8), np.int64)
    for j in range(8):
        if j < 4:
            sc[:, :, j], mn[:, :, j] = s[:, :, j] & 63, s[:, :, j + 4] & 63
        else:
            sc[:, :, j] = (s[:, :, j + 4] & 15) | ((s[:, :, j - 4] >> 6) << 4)
            mn[:, :, j] = (s[:, :, j + 4] >> 4) | ((s[:, :, j] >> 6) << 4)
    qs = b[:, :, 16 if name == "Q4_K" else 48:][:, :, :128].astype(np.int64).reshape(n, ns, 4, 32)
    q = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, ns, 256)  # 64-element chunk c: low, then high nibbles
    if name == "Q5_K":
        qh = b[:, :, 16:48].astype(np.int64)  # bit i of byte l: element l of sub-block i
        q = q | (((qh[:, :, None, :] >> np.arange(8)[None, None, :, None]) & 1) << 4).reshape(n, ns, 256)
    return q.reshape(n, k), sc.reshape(n, -1), mn.reshape(n, -1), d, dmin


def k_product(x: np.ndarray, raw: np.ndarray, name: str, n: int, k: int) -> np.ndarray:
    """out (T, n) float32 of the integer mode's K-quant rules."""
    q, dx = quantize(x, 256)
    wq, sc, mn, d, dmin = k_block_quants(raw, name, n, k)
    T, ns = x.shape[0], k // 256
    sub = 16 if name == "Q6_K" else 32
    qb = q.reshape(T, k // sub, sub)
    wb = wq.reshape(n, k // sub, sub)
    s = np.zeros((T, n), f32)
    c = np.zeros((T, n), f32)
    with np.errstate(invalid="ignore", over="ignore"):
        for S in range(ns):
            isum = np.zeros((T, n), np.int64)
            msum = np.zeros((T, n), np.int64)
            g0 = S * (256 // sub)
            dots = block_dots(qb[:, g0:g0 + 256 // sub], wb[:, g0:g0 + 256 // sub])
            for j in range(256 // sub):
                g = g0 + j
                bs = qb[:, g, :].sum(axis=1)[:, None]
                dot = dots[j]
                if name == "Q6_K":
                    isum += sc[None, :, g] * (dot - 32 * bs)
                else:
                    isum += sc[None, :, g] * dot
                    msum += mn[None, :, g] * bs
            assert np.abs(isum).max(initial=0) < 2 ** 31 and np.abs(msum).max(initial=0) < 2 ** 31
            f = isum.astype(f32) * (d[None, :, S] * dx[:, S:S + 1])
            if name != "Q6_K":
                f = f - msum.astype(f32) * (dmin[None, :, S] * dx[:, S:S + 1])
            y = f - c
            z = s + y
            c = (z - s) - y
            s = z
    return s


# --- any matrix of the types above --------------------------------------------------------------------

def matrix_product(x: np.ndarray, raw: np.ndarray, name: str, n: int, k: int) -> np.ndarray:
    """out (T, n) float32 of the integer mode's rules for a matrix of GGML type `name`, raw (n, row bytes)."""
    if name in BLOCK_BYTES:
        return product(x, raw, name, n, k)
    if name in K_BLOCK_BYTES:
        return k_product(x, raw, name, n, k)
    raise ValueError(f"no integer rule for {name}")

