"""GGUF's quantized blocks (Q8_0, Q4_0, Q4_1) in quantized panels (`layout.py`), read as float32.

Every weight reaches the sum as exactly the float32 value `formats.dequant` gives it, by the same
operations on the same operands in the same order (fp16 scales widened exactly):
  F32   w                            (as stored)
  F16   w widened                    (exact)
  Q8_0  w = q * d                    (q = the int8 quant, converted exactly)
  Q4_0  w = d * q                    (q = nibble - 8, an exact small integer, converted exactly)
  Q4_1  w = (d * q) + m              (q = the nibble, converted exactly)
dequant.py subtracts Q4_0's 8 in float32 (`float(nibble) - 8.0`); that subtraction is exact for all 16
nibbles, so doing it on the integer before the exact conversion gives the same float. The one fused
multiply-add is Q4_1's (d * q) + m where the target has FMA: d is an fp16 value and q a 4-bit
integer, so d * q is exact in float32 and fusing skips a rounding that rounds nothing (`v_dq_add`).

Speed: decode of quantized panels is compute-bound here (dequantizing costs more instructions than the
bytes it saves take to load), hence 32-lane panels and 4-bit quants regrouped into 32-bit words of 8:
per 16 weights one shift, then either a mask and an exact int -> float conversion (any target) or,
where the compile target has AVX-512F, one `vpermps` lookup in the 16-entry table of those same floats.
Both give the quant's exact float; the tests compare the AVX-512 build with a NUMBA_CPU_NAME=generic one.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from .layout import QBLOCK
from .simd import (HALF, KBLOCK, LANES, _F32V32, _c_array, _ptr, _splat, at, broadcast, kahan, target_has, v32_load,
                   v32_splat, v32_zero, v_add, v_mul, v_store, widen)

# ---------------------------------------------------------------------------------------------------
# Quantized weights as 32-lane float vectors.

_F = ir.FloatType()
_I32 = ir.IntType(32)


def _vec(ty):
    return ir.VectorType(ty, HALF)


@intrinsic
def v_q8(typingctx, arr, idx):
    """32 int8 quants from arr[idx:] as float32 (exact)."""
    if not (_c_array(arr, types.int8) and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ptr = _ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], _vec(ir.IntType(8)))
        return builder.sitofp(builder.sext(builder.load(ptr, align=1), _vec(_I32)), _vec(_F))

    return _F32V32(arr, idx), codegen


def _permvar_table(builder, idx, table):
    """<32 x i32> indices (low 4 bits used) -> <32 x float> table[idx & 15], by AVX-512's vpermps on
    16 lanes at a time. An exact table lookup: the same floats as the conversion it replaces."""
    v16f = ir.VectorType(_F, 16)
    v16i = ir.VectorType(_I32, 16)
    fnty = ir.FunctionType(v16f, [v16f, v16i])
    fn = builder.module.globals.get("llvm.x86.avx512.permvar.sf.512") or ir.Function(
        builder.module, fnty, "llvm.x86.avx512.permvar.sf.512")
    tab = ir.Constant(v16f, [ir.Constant(_F, float(t)) for t in table])
    parts = [builder.call(fn, [tab, builder.shuffle_vector(idx, ir.Constant(idx.type, ir.Undefined),
                                                           ir.Constant(v16i, list(range(16 * c, 16 * c + 16))))])
             for c in range(HALF // 16)]
    return builder.shuffle_vector(parts[0], parts[1], ir.Constant(_vec(_I32), list(range(HALF))))


def _nibble(minus8: bool):
    def impl(typingctx, arr, idx, shift):
        if not (_c_array(arr, types.uint32) and isinstance(idx, types.Integer) and isinstance(shift, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            vi = _vec(_I32)
            ptr = _ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], vi)
            sh = context.cast(builder, args[2], sig.args[2], types.uint32)
            word = builder.lshr(builder.load(ptr, align=4), broadcast(builder, vi, sh))
            if target_has(context, "avx512f"):
                # one permute instead of mask + convert (the kernel is compute-bound: ~9% faster)
                return _permvar_table(builder, word, [q - 8 if minus8 else q for q in range(16)])
            q = builder.and_(word, _splat(vi, 15))
            if minus8:
                q = builder.sub(q, _splat(vi, 8))
            return builder.sitofp(q, _vec(_F))

        return _F32V32(arr, idx, shift), codegen

    return intrinsic(impl)


v_nib = _nibble(False)  # (arr[idx : idx + 32] >> shift) & 15 as float32: 0..15 (Q4_1)
v_nib_m8 = _nibble(True)  # the same minus 8: -8..7 (Q4_0)


@intrinsic
def v_dq_add(typingctx, d, q, m):
    """(d * q) + m lane by lane, for d an fp16 value (11 significant bits) and q a 4-bit integer: their
    product has at most 15 significant bits, so it is exact in float32 and rounding it first (mul, then
    add) gives the same float as rounding d * q + m once (a fused multiply-add). Where the compile
    target has FMA, one fused instruction; elsewhere the mul and the add. The same bits either way (a
    NaN's payload aside, which no operation here promises)."""
    if not (d == _F32V32 and q == _F32V32 and m == _F32V32):
        return None

    def codegen(context, builder, sig, args):
        a, b, c = args
        if target_has(context, "fma"):
            vt = _vec(_F)
            name = f"llvm.fma.v{HALF}f32"
            fn = builder.module.globals.get(name) or ir.Function(builder.module, ir.FunctionType(vt, [vt, vt, vt]), name)
            return builder.call(fn, [a, b, c])
        return builder.fadd(builder.fmul(a, b), c)

    return _F32V32(d, q, m), codegen


# Per panel p and quant block b the scales are at [(p * nb + b) * 32]; Q8_0's quant k at
# [(p * K + k) * 32]; Q4_x's word g of block b at [((p * nb + b) * 4 + g) * 32], its nibble i (bits
# 4i..4i+3) being element 8g + i of the block.

def mins(m, idx):
    """Q4_1's 32 mins at m[idx:], or None for a type without mins."""
    raise NotImplementedError("mins is for jitted code")


@overload(mins, inline="always")
def _mins(m, idx):
    if isinstance(m, types.NoneType):
        return lambda m, idx: None
    return lambda m, idx: v32_load(m, idx)


def w_q4(qs, base, i, db, mb):
    """Weights of nibble i of the 32 words at qs[base:]: d * (q - 8) (Q4_0, mb None) or (d * q) + m."""
    raise NotImplementedError("w_q4 is for jitted code")


@overload(w_q4, inline="always")
def _w_q4(qs, base, i, db, mb):
    if isinstance(mb, types.NoneType):
        return lambda qs, base, i, db, mb: v_mul(db, v_nib_m8(qs, base, 4 * i))  # d * (q - 8)
    return lambda qs, base, i, db, mb: v_dq_add(db, v_nib(qs, base, 4 * i), mb)  # (d * q) + m, d * q exact


@njit(cache=True, inline="always")
def _w_q8_0(qs, p, K, k, db):
    return v_mul(v_q8(qs, (p * K + k) * HALF), db)  # q * d


def acc(a, w, x, xi, wbuf, wi):
    """a + w * x[xi] (x an array: decode), or store w at wbuf[wi:] and return a (x None: dequantize)."""
    raise NotImplementedError("acc is for jitted code")


@overload(acc, inline="always")
def _acc(a, w, x, xi, wbuf, wi):
    if isinstance(x, types.NoneType):
        def store(a, w, x, xi, wbuf, wi):
            v_store(wbuf, wi, w)
            return a
        return store
    return lambda a, w, x, xi, wbuf, wi: v_add(a, v_mul(w, v32_splat(at(x, xi))))


def q_block(qs, d, m, p, b, x, r0, a, wbuf, woff):
    """Quant block b of panel p, its scales loaded once, each weight through `acc`: with x an array,
    a plus the products with x[r0 + 32b + j], j in order (decode); with x None, the weights of element
    j stored at wbuf[woff + 64 (32b + j):] (prefill's dequantized pair)."""
    raise NotImplementedError("q_block is for jitted code")


@overload(q_block, inline="always")
def _q_block(qs, d, m, p, b, x, r0, a, wbuf, woff):
    if qs.dtype == types.int8:
        def q8(qs, d, m, p, b, x, r0, a, wbuf, woff):
            K, nb = qs.shape[1], d.shape[1]
            db = v32_load(d, (p * nb + b) * HALF)
            for k in range(b * QBLOCK, b * QBLOCK + QBLOCK):
                a = acc(a, _w_q8_0(qs, p, K, k, db), x, r0 + k, wbuf, woff + k * LANES)
            return a
        return q8

    def q4(qs, d, m, p, b, x, r0, a, wbuf, woff):
        nb = d.shape[1]
        db = v32_load(d, (p * nb + b) * HALF)
        mb = mins(m, (p * nb + b) * HALF)
        for g in range(4):
            base = ((p * nb + b) * 4 + g) * HALF
            kg = b * QBLOCK + 8 * g
            for i in range(8):
                a = acc(a, w_q4(qs, base, i, db, mb), x, r0 + kg + i, wbuf, woff + (kg + i) * LANES)
        return a
    return q4


@njit(cache=True, inline="always")
def q_unit(x, qs, d, m, p):
    """Token 0 times quantized panel p: 32 outputs."""
    K = x.shape[1]
    s0 = v32_zero()
    c0 = v32_zero()
    for k0 in range(0, K, KBLOCK):
        a0 = v32_zero()
        for b in range(k0 // QBLOCK, min(K, k0 + KBLOCK) // QBLOCK):
            a0 = q_block(qs, d, m, p, b, x, 0, a0, x, 0)
        s0, c0 = kahan(a0, s0, c0)
    return s0


@njit(cache=True, inline="always")
def q_dequantize_pair(qs, d, m, g, wbuf):
    """Panels 2g and 2g + 1 dequantized into wbuf[k * 64 + lane] (a missing second panel: wbuf's zeros)."""
    P = qs.shape[0]
    zero = v32_zero()
    for h in range(min(2, P - 2 * g)):
        for b in range(d.shape[1]):
            q_block(qs, d, m, 2 * g + h, b, None, 0, zero, wbuf, h * HALF)


def q_element(qs, d, m, p, b, e, j):
    """Element 32b + e of row 32p + j, dequantized (a scalar, for embedding rows)."""
    raise NotImplementedError("q_element is for jitted code")


@overload(q_element, inline="always")
def _q_element_impl(qs, d, m, p, b, e, j):
    f32 = np.float32
    if qs.dtype == types.int8:
        return lambda qs, d, m, p, b, e, j: f32(qs[p, b * QBLOCK + e, j]) * widen(d[p, b, j])  # q * d
    if isinstance(m, types.NoneType):
        def q40(qs, d, m, p, b, e, j):
            q = np.int32((qs[p, b, e // 8, j] >> np.uint32(4 * (e % 8))) & np.uint32(15)) - np.int32(8)
            return widen(d[p, b, j]) * f32(q)  # d * (q - 8)
        return q40

    def q41(qs, d, m, p, b, e, j):
        q = np.int32((qs[p, b, e // 8, j] >> np.uint32(4 * (e % 8))) & np.uint32(15))
        return (widen(d[p, b, j]) * f32(q)) + widen(m[p, b, j])  # (d * q) + m
    return q41
