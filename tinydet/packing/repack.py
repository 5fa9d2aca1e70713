"""The packers' kernels: GGUF block rows moved into quantized panels (`layout.py`'s layout), in
parallel over panels. Layout only: bytes and bit fields are moved, nothing is computed, so the
thread count cannot change a bit (each output word belongs to one row, written by one thread).

Each storage type is described by tables (`plan`), so one kernel serves all of them:
  every 4-bit word (8 consecutive elements of a block) comes from 8 consecutive bytes of the
  stored unit (a block, or a K-quant super-block) at one shift; every high-bit word (32 elements of
  1 bit, or 16 of 2) likewise from consecutive bytes at one shift, or (Q5_0) from one stored uint32;
  scales, mins and 6-bit/int8 sub-block scales are bytes at fixed offsets of the unit, moved.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..formats.ggml import GGML_TYPE_IDS
from ..numerics.simd import HALF as QPANEL

_Q8_0, _Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q4_K, _Q5_K, _Q6_K, _MXFP4 = (
    GGML_TYPE_IDS[t] for t in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4"))


@dataclass(frozen=True)
class Plan:
    """Where each panel word of one stored unit comes from (offsets in bytes within the unit)."""

    unit_elems: int  # elements per stored unit (32, or 256 for K-quants)
    unit_bytes: int
    q8: bool  # Q8_0: quants are the bytes at offset 2 (qs int8 (P, k, 32))
    lo: np.ndarray  # (unit_elems / 8, 2) int64: first byte and shift of each 4-bit word
    hi: np.ndarray  # (words, 2) int64: first byte and shift of each high-bit word; (0, 2) if none
    hi_width: int  # bits per element in qh: 1 or 2 (0: none); -1: one stored uint32 at hi[0, 0]
    d_off: int
    m_off: int  # -1: no mins
    sc_off: int
    sc_len: int  # 0: no sub-block scales
    d_bytes: int = 2  # bytes of the scale d: 2 (fp16 bits, uint16), or 1 (MXFP4's E8M0 exponent, uint8)


def _lo_words(starts) -> np.ndarray:
    return np.array(starts, np.int64).reshape(-1, 2)


def plan(tid: int) -> Plan:
    """The tables of ggml type `tid` (one of layout.NATIVE_TYPES), per layout.py's docstring."""
    none = np.zeros((0, 2), np.int64)
    if tid == _Q8_0:
        return Plan(32, 34, True, none, none, 0, 0, -1, 0, 0)
    if tid == _MXFP4:  # e at byte 0, then nibbles as Q4_0 (byte i: element i low, 16 + i high)
        return Plan(32, 17, False, _lo_words([(1 + 8 * (g % 2), 4 * (g // 2)) for g in range(4)]), none, 0, 0, -1,
                    0, 0, 1)
    if tid in (_Q4_0, _Q4_1, _Q5_0, _Q5_1):  # byte i: element i low, 16 + i high
        off = {_Q4_0: 2, _Q4_1: 4, _Q5_0: 6, _Q5_1: 8}[tid]
        lo = _lo_words([(off + 8 * (g % 2), 4 * (g // 2)) for g in range(4)])
        size = {_Q4_0: 18, _Q4_1: 20, _Q5_0: 22, _Q5_1: 24}[tid]
        if tid == _Q5_0:  # bit e of the little-endian uint32 at bytes 2..5: element e
            return Plan(32, size, False, lo, _lo_words([(2, 0)]), -1, 0, -1, 0, 0)
        if tid == _Q5_1:  # d, m, then the high bits' uint32 at bytes 4..7
            return Plan(32, size, False, lo, _lo_words([(4, 0)]), -1, 0, 2, 0, 0)
        return Plan(32, size, False, lo, none, 0, 0, 2 if tid == _Q4_1 else -1, 0, 0)
    if tid in (_Q4_K, _Q5_K):  # element 64c + 32h + l: byte 32c + l of qs, nibble h
        off = 16 if tid == _Q4_K else 48
        lo = _lo_words([(off + 32 * c + 8 * w, 4 * h) for c in range(4) for h in range(2) for w in range(4)])
        if tid == _Q4_K:
            return Plan(256, 144, False, lo, none, 0, 0, 2, 4, 12)
        hi = _lo_words([(16, i) for i in range(8)])  # element 32i + l: bit i of qh byte l
        return Plan(256, 176, False, lo, hi, 1, 0, 2, 4, 12)
    # Q6_K: element 128h + 32q + l: ql byte 64h + 32(q & 1) + l, nibble q >> 1; its high 2 bits at
    # bits 2r of qh byte 128 + 32h + l for element 128h + 32r + l
    lo = _lo_words([(64 * h + 32 * (q & 1) + 8 * w, 4 * (q >> 1)) for h in range(2) for q in range(4)
                    for w in range(4)])
    hi = _lo_words([(128 + 32 * h + 16 * w, 2 * r) for h in range(2) for r in range(4) for w in range(2)])
    return Plan(256, 210, False, lo, hi, 2, 208, -1, 192, 16)


@intrinsic
def _u64(typingctx, arr, idx):
    """The 8 bytes of C-contiguous uint8 array `arr` from flat index idx, as a little-endian uint64
    (one unaligned load; no bounds check: callers stay inside a stored unit)."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.uint8 and arr.layout == "C"
            and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        i = context.cast(builder, args[1], sig.args[1], types.intp)
        v = builder.load(builder.bitcast(builder.gep(ary.data, [i]), ir.IntType(64).as_pointer()), align=1)
        if sys.byteorder == "big":
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v.type, [v.type]), "llvm.bswap.i64")
            v = builder.call(fn, [v])
        return v

    return types.uint64(arr, idx), codegen


_U = np.uint64


@njit(cache=True, inline="always")
def _gather4(x, sh):
    """The 4-bit fields at bit sh of each of x's 8 bytes, packed: byte i's at bits 4i."""
    x = (x >> _U(sh)) & _U(0x0F0F0F0F0F0F0F0F)
    x = (x | (x >> _U(4))) & _U(0x00FF00FF00FF00FF)
    x = (x | (x >> _U(8))) & _U(0x0000FFFF0000FFFF)
    return np.uint32((x | (x >> _U(16))) & _U(0xFFFFFFFF))


@njit(cache=True, inline="always")
def _gather2(x, sh):
    """The 2-bit fields at bit sh of each of x's 8 bytes, packed: byte i's at bits 2i (16 bits)."""
    x = (x >> _U(sh)) & _U(0x0303030303030303)
    x = (x | (x >> _U(6))) & _U(0x000F000F000F000F)
    x = (x | (x >> _U(12))) & _U(0x000000FF000000FF)
    return np.uint32((x | (x >> _U(24))) & _U(0xFFFF))


@njit(cache=True, inline="always")
def _gather1(x, sh):
    """Bit sh of each of x's 8 bytes, packed: byte i's at bit i (8 bits)."""
    x = (x >> _U(sh)) & _U(0x0101010101010101)
    x = (x | (x >> _U(7))) & _U(0x0003000300030003)
    x = (x | (x >> _U(14))) & _U(0x0000000F0000000F)
    return np.uint32((x | (x >> _U(28))) & _U(0xFF))


@njit(parallel=True, cache=True)
def _pack(raw, order, r0, unit_bytes, q8, lo, hi, hi_width, d_off, m_off, sc_off, sc_len, d_bytes,
          qs8, qs, qh, sc, d, m):
    """Rows i of a part (stored row order[i] of raw (R, row_bytes) uint8) into output rows r0 + i of
    the panels: row r at [r // 32, ..., r % 32]. Arrays a type lacks are passed empty. Every load
    stays inside one stored unit."""
    n = order.shape[0]
    rb = raw.shape[1]
    units = rb // unit_bytes
    p_first, p_end = r0 // QPANEL, (r0 + n + QPANEL - 1) // QPANEL
    nlo, nhi = lo.shape[0], hi.shape[0]
    for p in prange(p_first, p_end):
        for row in range(max(r0, p * QPANEL), min(r0 + n, (p + 1) * QPANEL)):
            j = row - p * QPANEL
            src = raw[order[row - r0]]
            base = order[row - r0] * rb
            for u in range(units):
                b = u * unit_bytes
                if d_bytes == 1:  # MXFP4's exponent byte (d uint8)
                    d[p, u, j] = src[b + d_off]
                else:
                    d[p, u, j] = np.uint16(src[b + d_off]) | (np.uint16(src[b + d_off + 1]) << np.uint16(8))
                if m_off >= 0:
                    m[p, u, j] = np.uint16(src[b + m_off]) | (np.uint16(src[b + m_off + 1]) << np.uint16(8))
                for c in range(sc_len):
                    sc[p, u * sc_len + c, j] = src[b + sc_off + c]
                if q8:
                    for e in range(32):
                        qs8[p, u * 32 + e, j] = src[b + 2 + e]
                for w in range(nlo):
                    qs[p, u * nlo + w, j] = _gather4(_u64(raw, base + b + lo[w, 0]), lo[w, 1])
                if hi_width < 0:  # one stored little-endian uint32
                    qh[p, u, j] = np.uint32(_u64(raw, base + b + hi[0, 0]) & _U(0xFFFFFFFF))
                elif hi_width == 2:  # 16 elements from 16 bytes
                    for w in range(nhi):
                        s = base + b + hi[w, 0]
                        qh[p, u * nhi + w, j] = (_gather2(_u64(raw, s), hi[w, 1])
                                                 | (_gather2(_u64(raw, s + 8), hi[w, 1]) << np.uint32(16)))
                elif hi_width == 1:  # 32 elements from 32 bytes
                    for w in range(nhi):
                        s = base + b + hi[w, 0]
                        word = np.uint32(0)
                        for q in range(4):
                            word |= _gather1(_u64(raw, s + 8 * q), hi[w, 1]) << np.uint32(8 * q)
                        qh[p, u * nhi + w, j] = word


def pack_rows(pl: Plan, raw: np.ndarray, order: np.ndarray, r0: int, out: dict) -> None:
    """Rows order[i] of raw (R, row_bytes) uint8 -> output rows r0 + i of the panel arrays `out`
    (layout._shapes' names, uint16 scales; MXFP4's uint8 exponents), in place."""
    P = out["d"].shape[0]
    e8, e32 = np.zeros((P, 0, QPANEL), np.int8), np.zeros((P, 0, QPANEL), np.uint32)

    def flat(name, empty):  # (P, ..., 32) -> (P, -1, 32), a view
        a = out.get(name)
        return empty if a is None else a.reshape(P, -1, QPANEL)

    qs = out["qs"]
    _pack(raw, order, r0, pl.unit_bytes, pl.q8, pl.lo, pl.hi, pl.hi_width, pl.d_off, pl.m_off, pl.sc_off,
          pl.sc_len, pl.d_bytes, (qs if pl.q8 else e8).view(np.uint8), e32 if pl.q8 else flat("qs", e32), flat("qh", e32),
          flat("sc", e8).view(np.uint8), out["d"], flat("m", np.zeros((P, 0, QPANEL), np.uint16)))


@njit(parallel=True, cache=True)
def _quiet_panels(bits):
    """The quiet bit (0x0200) set in every signaling-NaN fp16 pattern of bits (P, n), in place."""
    for p in prange(bits.shape[0]):
        for i in range(bits.shape[1]):
            v = bits[p, i]
            if (v & 0x7C00) == 0x7C00 and (v & 0x0200) == 0 and (v & 0x01FF) != 0:
                bits[p, i] = v | 0x0200


def quiet_snans(bits: np.ndarray) -> np.ndarray:
    """`bits` (uint16 fp16 patterns, C-contiguous, panels on the first axis) with every signaling NaN
    quieted, in place; returns it."""
    _quiet_panels(bits.reshape(bits.shape[0], -1))
    return bits


@njit(parallel=True, cache=True)
def _f16_rows(bits, order, g, out, nan):
    """Rows order[i] of bits (R, k) uint16 into float panels out (P, k, 64) at row g + i, moved as they
    are; nan[p] = 1 where a row of panel p (counted from g's) holds a NaN pattern."""
    n, k, lanes = order.shape[0], bits.shape[1], out.shape[2]
    p0 = g // lanes
    for p in prange(p0, (g + n + lanes - 1) // lanes):
        flag = 0
        for row in range(max(g, p * lanes), min(g + n, (p + 1) * lanes)):
            src = bits[order[row - g]]
            j = row - p * lanes
            for c in range(k):
                v = src[c]
                if (v & 0x7C00) == 0x7C00 and (v & 0x03FF) != 0:
                    flag = 1
                out[p, c, j] = v
        nan[p - p0] = flag


def f16_rows(bits: np.ndarray, order: np.ndarray, g: int, out: np.ndarray) -> bool:
    """Rows `order` of fp16 bits (R, k) moved into fp16 panels `out` from row g; False if any is a NaN
    (the caller then takes the float32 round trip for them)."""
    lanes = out.shape[2]
    nan = np.zeros((g + order.shape[0] + lanes - 1) // lanes - g // lanes, np.uint8)
    _f16_rows(bits, order, g, out, nan)
    return not nan.any()
