"""GGUF's quantized blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MXFP4) in quantized panels
(`packing/layout.py`), read as float32.

Every weight reaches the sum as exactly the float32 value `formats.dequant` gives it, by the same
operations on the same operands in the same order (fp16 scales widened exactly; q below is the quant
as an integer, converted exactly):
  F32   w                            (as stored)
  F16   w widened                    (exact)
  Q8_0  w = q * d                    (q = the int8 quant)
  Q4_0  w = d * q                    (q = nibble - 8)
  Q4_1  w = (d * q) + m              (q = the nibble)
  Q5_0  w = d * q                    (q = (nibble | 5th bit << 4) - 16)
  Q5_1  w = (d * q) + m              (q = nibble | 5th bit << 4)
  Q4_K  w = (dl * q) - ml            dl = d * sc, ml = dmin * mn (sc, mn: the sub-block's 6-bit scale
  Q5_K                               and min); q = the nibble (Q5_K: | 5th bit << 4)
  Q6_K  w = dl * q                   dl = d * sc (sc: the 16 elements' int8 scale);
                                     q = (nibble | high 2 bits << 4) - 32
  MXFP4 w = d * q                    d = 2^(e - 128) built from e's bits (`v_e8m0`, dequant.e8m0_half);
                                     q = kvalues[nibble], the E2M1 code's value doubled (`v_mx`)
dequant.py subtracts Q4_0's 8 (Q5_0's 16, Q6_K's 32) in float32 (`float(q) - 8.0`); that subtraction is
exact for every quant, so doing it on the integer before the exact conversion gives the same float.
The fused multiply-adds are Q4_1's and Q5_1's (d * q) + m and Q4_K/Q5_K's (dl * q) + (-ml) where the target has
FMA: d is an fp16 value (11 significant bits) and q a 4- or 5-bit integer, so d * q is exact in float32;
dl = d * sc has at most 11 + 6 significant bits and is exact, and dl * q (q < 32) has at most 22, so
it is exact too: fusing skips a rounding that rounds nothing (`v_dq_add`).

Speed: decode of quantized panels is compute-bound here (dequantizing costs more instructions than the
bytes it saves take to load), hence 32-lane panels and 4-bit quants regrouped into 32-bit words of 8.
Where the compile target has AVX-512F, nibble i of a word is one shift and one `vpermps` lookup in the
16-entry table of the quants' floats. Elsewhere nibbles 0..6 are one mask, word & (15 << 4i), converted:
the exact float q * 2^4i, which meets the scale pre-multiplied by 2^-4i (`v_nib_scale`); MXFP4's
codes, not integers, are looked up the same way on AVX-512F and elsewhere computed from the code's bits
in integers (`v_mx`), each weight then d * q with d unscaled; the 5- and
6-bit quants' high bits are moved next to their nibble in one shift (`v_hiq`). Both factors are exact
(a power of two moves the exponent of an fp16 scale, at least 2^-24, nowhere near float32's
subnormals) and their product is the same real number as d * q, so the same float. AVX2 build, one
thread, decode products against the shift: Q4_0/Q4_1 0.87-0.89x the time, Q4_K 0.77-0.92x, Q5_0 0.91x,
Q5_K 0.86x, Q6_K 0.92x. The tests compare the AVX-512 build with a NUMBA_CPU_NAME=generic one.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from ...packing.layout import QBLOCK
from ...numerics.simd import (HALF, KBLOCK, LANES, _F32V32, _c_array, _ptr, _splat, at, broadcast, kahan, rows_zero,
                              target_has, target_isa, v32_load, v32_splat, v32_zero, v_add, v_mul, v_neg, v_rows_acc,
                              v_store, widen)

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
    def impl(typingctx, arr, idx, i):
        if not (_c_array(arr, types.uint32) and isinstance(idx, types.Integer) and isinstance(i, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            vi = _vec(_I32)
            ptr = _ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], vi)
            word = builder.load(ptr, align=4)
            four_i = builder.mul(context.cast(builder, args[2], sig.args[2], types.uint32), ir.Constant(_I32, 4))
            if target_has(context, "avx512f"):
                # one permute instead of mask + convert (the kernel is compute-bound: ~9% faster)
                return _permvar_table(builder, builder.lshr(word, broadcast(builder, vi, four_i)),
                                      [q - 8 if minus8 else q for q in range(16)])
            # q * 2^4i in place, no shift; the top nibble shifted down (its mask would set the sign bit)
            top = builder.icmp_unsigned("==", four_i, ir.Constant(_I32, 28))
            q = builder.select(top, builder.lshr(word, _splat(vi, 28)),
                               builder.and_(word, broadcast(builder, vi, builder.shl(ir.Constant(_I32, 15), four_i))))
            if minus8:
                eight = builder.select(top, ir.Constant(_I32, 8), builder.shl(ir.Constant(_I32, 8), four_i))
                q = builder.sub(q, broadcast(builder, vi, eight))
            return builder.sitofp(q, _vec(_F))

        return _F32V32(arr, idx, i), codegen

    return intrinsic(impl)


# Nibble i (0..7) of the 32 words at arr[idx:] as float32: q (AVX-512F) or q * 2^4i (i < 7, elsewhere);
# multiply it by v_nib_scale(d, i), never by d itself.
v_nib = _nibble(False)  # q = 0..15 (Q4_1, Q4_K)
v_nib_m8 = _nibble(True)  # q = the nibble minus 8: -8..7 (Q4_0)


@intrinsic
def v_nib_scale(typingctx, d, i):
    """The scale that multiplies v_nib(..., i): d (AVX-512F) or d * 2^-4i (i < 7) elsewhere, exact for
    any d that is a product of an fp16 value and a small integer (at least 2^-24 unless zero)."""
    if not (d == _F32V32 and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        if target_has(context, "avx512f"):
            return args[0]
        four_i = builder.mul(context.cast(builder, args[1], sig.args[1], types.uint32), ir.Constant(_I32, 4))
        exp = builder.select(builder.icmp_unsigned("==", four_i, ir.Constant(_I32, 28)), ir.Constant(_I32, 127),
                             builder.sub(ir.Constant(_I32, 127), four_i))
        scale = builder.bitcast(builder.shl(exp, ir.Constant(_I32, 23)), _F)  # 2^-4i, or 1 for the top nibble
        return builder.fmul(args[0], broadcast(builder, _vec(_F), scale))

    return _F32V32(d, i), codegen


# MXFP4's E2M1 codes as the integers ggml's kvalues_mxfp4 gives them (formats.dequant.KVALUES_MXFP4)
KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


@intrinsic
def v_mx(typingctx, arr, idx, i):
    """The values kvalues[code] of MXFP4 codes, nibble i (0..7) of the 32 words at arr[idx:], as float32
    (exact small integers; code 8 gives +0, as ggml's table). AVX-512F: a `vpermps` lookup in the table
    of their floats. Elsewhere in integers from the code's bits: m = code & 7 is the magnitude's code,
    m + max(m - 4, 0) + 2 (m == 7) its value (0, 1, 2, 3, 4, 6, 8, 12), negated where bit 3 is set,
    then converted: the same floats."""
    if not (_c_array(arr, types.uint32) and isinstance(idx, types.Integer) and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        vi = _vec(_I32)
        ptr = _ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], vi)
        word = builder.load(ptr, align=4)
        four_i = builder.mul(context.cast(builder, args[2], sig.args[2], types.uint32), ir.Constant(_I32, 4))
        code = builder.lshr(word, broadcast(builder, vi, four_i))
        if target_has(context, "avx512f"):
            return _permvar_table(builder, code, KVALUES_MXFP4)
        code = builder.and_(code, _splat(vi, 15))
        m = builder.and_(code, _splat(vi, 7))
        over4 = builder.select(builder.icmp_signed(">", m, _splat(vi, 4)), builder.sub(m, _splat(vi, 4)), _splat(vi, 0))
        seven = builder.select(builder.icmp_signed("==", m, _splat(vi, 7)), _splat(vi, 2), _splat(vi, 0))
        mag = builder.add(builder.add(m, over4), seven)
        neg = builder.icmp_signed("!=", builder.and_(code, _splat(vi, 8)), _splat(vi, 0))
        return builder.sitofp(builder.select(neg, builder.sub(_splat(vi, 0), mag), mag), _vec(_F))

    return _F32V32(arr, idx, i), codegen


def _e8m0_bits(builder, e):
    """i32 (vector or scalar) exponents e (0..255) -> the bits of float32 2^(e - 128): ggml's
    GGML_E8M0_TO_FP32_HALF, e < 2 the subnormals 0x00200000 << e, else (e - 1) << 23."""
    def c(v):
        return _splat(e.type, v) if isinstance(e.type, ir.VectorType) else ir.Constant(e.type, v)

    small = builder.icmp_unsigned("<", e, c(2))
    # e & 1 is e where e < 2; a shift by e itself would be poison for e >= 32 (unselected, but kept clear)
    return builder.select(small, builder.shl(c(0x00200000), builder.and_(e, c(1))),
                          builder.shl(builder.sub(e, c(1)), c(23)))


@intrinsic
def v_e8m0(typingctx, arr, idx):
    """32 MXFP4 exponent bytes arr[idx:] (uint8) as float32 scales 2^(e - 128) (`_e8m0_bits`): exact."""
    if not (_c_array(arr, types.uint8) and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ptr = _ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], _vec(ir.IntType(8)))
        e = builder.zext(builder.load(ptr, align=1), _vec(_I32))
        return builder.bitcast(_e8m0_bits(builder, e), _vec(_F))

    return _F32V32(arr, idx), codegen


@intrinsic
def e8m0(typingctx, e):
    """One MXFP4 exponent byte (uint8) as the float32 scale 2^(e - 128) (`_e8m0_bits`)."""
    if e != types.uint8:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(_e8m0_bits(builder, builder.zext(args[0], _I32)), _F)

    return types.float32(e), codegen


@intrinsic
def v_dq_add(typingctx, d, q, m):
    """(d * q) + m lane by lane, where d * q is exact in float32: d an fp16 value (11 significant bits)
    or one times a 6-bit scale (17), either times a power of two (`v_nib_scale`), and q an integer below
    32 in magnitude, or one times a power of two: at most 22 significant bits. Rounding the exact
    product first (mul, then add) gives the same float as rounding d * q + m once (a fused multiply-
    add). Where the compile target has FMA, one fused instruction; elsewhere the mul and the add. The
    same bits either way (a NaN's payload aside, which no operation here promises)."""
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


@intrinsic
def v_hiq(typingctx, lo, li, i, hi, hi_idx, hpre, hbit, hmask, sub):
    """A 5- or 6-bit quant of 32 lanes as float32: its nibble i (0..7) of the words at lo[li:] and its
    high bits (hmask 1 or 3) at bit hbit of the words at hi[hi_idx:] shifted right by hpre (uint32
    arrays), minus sub. AVX-512F: q = ((lo >> 4i) & 15 | ((hi >> hpre >> hbit) & hmask) << 4) - sub.
    Elsewhere, for i < 7, q * 2^4i with the nibble masked in place and the high bits moved next to it in
    one shift (as `v_nib`; multiply by v_nib_scale(d, i)). Exact either way: q * 2^4i < 2^30."""
    ints = (li, i, hi_idx, hpre, hbit, hmask, sub)
    if not (_c_array(lo, types.uint32) and _c_array(hi, types.uint32)
            and all(isinstance(a, types.Integer) for a in ints)):
        return None

    def codegen(context, builder, sig, args):
        vi = _vec(_I32)
        u = [context.cast(builder, args[n], sig.args[n], types.uint32) for n in (2, 5, 6, 7, 8)]
        i, hpre, hbit, hmask, sub = u
        word = builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], vi), align=4)
        hw = builder.load(_ptr(context, builder, sig.args[3], args[3], args[4], sig.args[4], vi), align=4)
        hh = builder.lshr(hw, broadcast(builder, vi, hpre))
        four_i = builder.mul(i, ir.Constant(_I32, 4))
        # q itself (AVX-512F, and the top nibble, whose in-place quant would not fit an int32)
        q = builder.and_(builder.lshr(word, broadcast(builder, vi, four_i)), _splat(vi, 15))
        h = builder.and_(builder.lshr(hh, broadcast(builder, vi, hbit)), broadcast(builder, vi, hmask))
        q = builder.sub(builder.or_(q, builder.shl(h, _splat(vi, 4))), broadcast(builder, vi, sub))
        if target_has(context, "avx512f"):
            return builder.sitofp(q, _vec(_F))
        top = builder.icmp_unsigned("==", i, ir.Constant(_I32, 7))
        up = builder.select(top, ir.Constant(_I32, 0), builder.sub(builder.add(four_i, ir.Constant(_I32, 4)), hbit))
        qi = builder.and_(word, broadcast(builder, vi, builder.shl(ir.Constant(_I32, 15), four_i)))
        hi_in = builder.shl(builder.and_(hh, broadcast(builder, vi, builder.shl(hmask, hbit))),
                            broadcast(builder, vi, up))
        qi = builder.sub(builder.or_(qi, hi_in), broadcast(builder, vi, builder.shl(sub, four_i)))
        return builder.sitofp(builder.select(top, q, qi), _vec(_F))

    return _F32V32(lo, li, i, hi, hi_idx, hpre, hbit, hmask, sub), codegen


def _k_scale_min(is_min: bool):
    """An intrinsic (sc, base, j) -> 32 lanes of the exact float of sub-block j's (0..7) 6-bit scale
    (or min) of Q4_K/Q5_K, from the 12 packed bytes at sc[base + 32 t:] (t = 0..11, a uint8 array):
    ggml's get_scale_min_k4, as `formats.dequant._k_scale_min`:
      scale: j < 4: B[j] & 63;     j >= 4: (B[j + 4] & 15) | ((B[j - 4] >> 6) << 4)
      min:   j < 4: B[j + 4] & 63; j >= 4: (B[j + 4] >> 4) | ((B[j] >> 6) << 4)"""
    def impl(typingctx, sc, base, j):
        if not (_c_array(sc, types.uint8) and isinstance(base, types.Integer) and isinstance(j, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            vi = _vec(_I32)
            ip = ir.IntType(64)
            b0 = context.cast(builder, args[1], sig.args[1], types.int64)
            jj = context.cast(builder, args[2], sig.args[2], types.int64)
            lt4 = builder.icmp_signed("<", jj, ir.Constant(ip, 4))

            def byte(t):  # 32 lanes of byte t, zero-extended
                idx = builder.add(b0, builder.mul(t, ir.Constant(ip, HALF)))
                p = _ptr(context, builder, sig.args[0], args[0], idx, types.int64, _vec(ir.IntType(8)))
                return builder.zext(builder.load(p, align=1), vi)

            j4 = builder.add(jj, ir.Constant(ip, 4))
            if is_min:
                a, b = byte(j4), byte(jj)
                hi_part = builder.lshr(a, _splat(vi, 4))
            else:
                a = byte(builder.select(lt4, jj, j4))
                b = byte(builder.select(lt4, jj, builder.sub(jj, ir.Constant(ip, 4))))
                hi_part = builder.and_(a, _splat(vi, 15))
            high = builder.or_(hi_part, builder.shl(builder.lshr(b, _splat(vi, 6)), _splat(vi, 4)))
            v = builder.select(lt4, builder.and_(a, _splat(vi, 63)), high)
            return builder.sitofp(v, _vec(_F))

        return _F32V32(sc, base, j), codegen

    return intrinsic(impl)


v_k_scale = _k_scale_min(False)
v_k_min = _k_scale_min(True)


# Per panel p and quant block b (32 elements; K-quant sub-block j = b % 8 of super-block s = b // 8) the
# scales are at [(p * nb + b) * 32] (K-quants: [(p * ns + s) * 32]); Q8_0's quant k at [(p * K + k) * 32];
# the nibble word g of block b at [((p * nb + b) * 4 + g) * 32], its nibble i (bits 4i..4i+3) being
# element 8g + i of the block; Q5_0/Q5_1/Q5_K's high bits of block b at [(p * nb + b) * 32] (bit e: element
# e); Q6_K's at [((p * nb + b) * 2 + h) * 32] (bits 2i, 2i + 1: element 16h + i); K-quant scale byte t
# of super-block s at [((p * ns + s) * T + t) * 32] (T = 12, Q6_K 16).
#
# The functions below take a quantized storage tuple w = (tag, qs, d, m, sc, qh) (`storage.kinds`,
# None where the type has no such array): the tag's numba type names the ggml type (w[0].qtype).

def mins(m, idx):
    """Q4_1's 32 mins at m[idx:], or None for a type without mins."""
    raise NotImplementedError("mins is for jitted code")


@overload(mins, inline="always")
def _mins(m, idx):
    if isinstance(m, types.NoneType):
        return lambda m, idx: None
    return lambda m, idx: v32_load(m, idx)


def w_q4(qs, base, i, db, mb):
    """Weights of nibble i of the 32 words at qs[base:], db being `v_nib_scale(d, i)`: d * (q - 8) (Q4_0,
    mb None) or (d * q) + m (Q4_1; Q4_K: dl and -ml, `_k1_scales`)."""
    raise NotImplementedError("w_q4 is for jitted code")


@overload(w_q4, inline="always")
def _w_q4(qs, base, i, db, mb):
    if isinstance(mb, types.NoneType):
        return lambda qs, base, i, db, mb: v_mul(db, v_nib_m8(qs, base, i))  # d * (q - 8)
    return lambda qs, base, i, db, mb: v_dq_add(db, v_nib(qs, base, i), mb)  # (d * q) + m


@njit(cache=True, inline="always")
def _k1_scales(w, p, b):
    """Q4_K/Q5_K block b of panel p: its 32 scales dl = d * sc and negated mins -(dmin * mn), the
    weights being (dl * q) + (-ml), which is (dl * q) - ml in IEEE arithmetic, zeros' signs included."""
    d, dm, sc = w[2], w[3], w[4]
    s = p * d.shape[1] + b // 8
    j = b % 8
    dl = v_mul(v32_load(d, s * HALF), v_k_scale(sc, s * 12 * HALF, j))  # d * sc
    return dl, v_neg(v_mul(v32_load(dm, s * HALF), v_k_min(sc, s * 12 * HALF, j)))  # -(dmin * mn)


@njit(cache=True, inline="always")
def nib_scales(db):
    """v_nib_scale(db, i) for the eight nibbles, computed once for the elements that share db."""
    return (v_nib_scale(db, 0), v_nib_scale(db, 1), v_nib_scale(db, 2), v_nib_scale(db, 3),
            v_nib_scale(db, 4), v_nib_scale(db, 5), v_nib_scale(db, 6), v_nib_scale(db, 7))


@njit(cache=True, inline="always")
def nib_block(qs, pb, kb, db, mb, x, r0, a, wbuf, woff):
    """`q_block` for a block of 4-bit quants, its nibble words at qs[pb * 4 * 32:], scale db and mins mb
    (`w_q4`), element e at k = kb + e. The eight nibbles are written out, each index a constant: as a
    loop LLVM kept them a loop, with a mask, a select and a scale computed at run time each pass; so
    the eight scales (`v_nib_scale`) are computed once a block."""
    d0, d1, d2, d3, d4, d5, d6, d7 = nib_scales(db)
    for g in range(4):
        base = (pb * 4 + g) * HALF
        k = kb + 8 * g
        wi = woff + k * LANES
        a = acc(a, w_q4(qs, base, 0, d0, mb), x, r0 + k, wbuf, wi)
        a = acc(a, w_q4(qs, base, 1, d1, mb), x, r0 + k + 1, wbuf, wi + LANES)
        a = acc(a, w_q4(qs, base, 2, d2, mb), x, r0 + k + 2, wbuf, wi + 2 * LANES)
        a = acc(a, w_q4(qs, base, 3, d3, mb), x, r0 + k + 3, wbuf, wi + 3 * LANES)
        a = acc(a, w_q4(qs, base, 4, d4, mb), x, r0 + k + 4, wbuf, wi + 4 * LANES)
        a = acc(a, w_q4(qs, base, 5, d5, mb), x, r0 + k + 5, wbuf, wi + 5 * LANES)
        a = acc(a, w_q4(qs, base, 6, d6, mb), x, r0 + k + 6, wbuf, wi + 6 * LANES)
        a = acc(a, w_q4(qs, base, 7, d7, mb), x, r0 + k + 7, wbuf, wi + 7 * LANES)
    return a


@njit(cache=True, inline="always")
def mx_block(qs, pb, kb, db, x, r0, a, wbuf, woff):
    """`q_block` for a block of MXFP4 codes, its words at qs[pb * 4 * 32:], scale db: each weight d * q
    (`v_mx`), element e at k = kb + e; written out as `nib_block`, each nibble index a constant."""
    for g in range(4):
        base = (pb * 4 + g) * HALF
        k = kb + 8 * g
        wi = woff + k * LANES
        a = acc(a, v_mul(db, v_mx(qs, base, 0)), x, r0 + k, wbuf, wi)
        a = acc(a, v_mul(db, v_mx(qs, base, 1)), x, r0 + k + 1, wbuf, wi + LANES)
        a = acc(a, v_mul(db, v_mx(qs, base, 2)), x, r0 + k + 2, wbuf, wi + 2 * LANES)
        a = acc(a, v_mul(db, v_mx(qs, base, 3)), x, r0 + k + 3, wbuf, wi + 3 * LANES)
        a = acc(a, v_mul(db, v_mx(qs, base, 4)), x, r0 + k + 4, wbuf, wi + 4 * LANES)
        a = acc(a, v_mul(db, v_mx(qs, base, 5)), x, r0 + k + 5, wbuf, wi + 5 * LANES)
        a = acc(a, v_mul(db, v_mx(qs, base, 6)), x, r0 + k + 6, wbuf, wi + 6 * LANES)
        a = acc(a, v_mul(db, v_mx(qs, base, 7)), x, r0 + k + 7, wbuf, wi + 7 * LANES)
    return a


def w_hi(qs, base, i, qh, hidx, hpre, hbit, hmask, sub, db, mb):
    """Weights of the 5- or 6-bit quants `v_hiq`, db being `v_nib_scale(d, i)`: d * q (mb None; Q5_0,
    Q6_K) or (dl * q) + (-ml) (Q5_K, `_k1_scales`)."""
    raise NotImplementedError("w_hi is for jitted code")


@overload(w_hi, inline="always")
def _w_hi(qs, base, i, qh, hidx, hpre, hbit, hmask, sub, db, mb):
    if isinstance(mb, types.NoneType):
        return lambda qs, base, i, qh, hidx, hpre, hbit, hmask, sub, db, mb: v_mul(
            db, v_hiq(qs, base, i, qh, hidx, hpre, hbit, hmask, sub))
    return lambda qs, base, i, qh, hidx, hpre, hbit, hmask, sub, db, mb: v_dq_add(
        db, v_hiq(qs, base, i, qh, hidx, hpre, hbit, hmask, sub), mb)


def hi_group(qs, base, qh, hidx, hpre, hstep, hmask, sub, ds, mb, x, xi, a, wbuf, wi):
    """`q_block` for 8 consecutive 5- or 6-bit quants (`w_hi`): nibble i of the words at qs[base:],
    element i's high bits at bit hpre + hstep * i of the words at qh[hidx:], scales ds (`nib_scales`),
    products with x[xi + i] or stored at wbuf[wi + 64 i:]. Written out, as `nib_block`, so that every
    shift is a constant; on AVX-512F (no in-place nibbles, every scale ds[0]) a loop, whose code ran
    those types' decode in 0.96-1.00x the time of the written-out one."""
    raise NotImplementedError("hi_group is for jitted code")


@overload(hi_group, inline="always")
def _hi_group(qs, base, qh, hidx, hpre, hstep, hmask, sub, ds, mb, x, xi, a, wbuf, wi):
    return _hi_loop if target_isa() == "avx512" else _hi_written


def _hi_loop(qs, base, qh, hidx, hpre, hstep, hmask, sub, ds, mb, x, xi, a, wbuf, wi):
    for i in range(8):
        a = acc(a, w_hi(qs, base, i, qh, hidx, 0, hpre + hstep * i, hmask, sub, ds[0], mb), x, xi + i, wbuf,
                wi + i * LANES)
    return a


def _hi_written(qs, base, qh, hidx, hpre, hstep, hmask, sub, ds, mb, x, xi, a, wbuf, wi):
    a = acc(a, w_hi(qs, base, 0, qh, hidx, hpre, 0, hmask, sub, ds[0], mb), x, xi, wbuf, wi)
    a = acc(a, w_hi(qs, base, 1, qh, hidx, hpre, hstep, hmask, sub, ds[1], mb), x, xi + 1, wbuf, wi + LANES)
    a = acc(a, w_hi(qs, base, 2, qh, hidx, hpre, 2 * hstep, hmask, sub, ds[2], mb), x, xi + 2, wbuf, wi + 2 * LANES)
    a = acc(a, w_hi(qs, base, 3, qh, hidx, hpre, 3 * hstep, hmask, sub, ds[3], mb), x, xi + 3, wbuf, wi + 3 * LANES)
    a = acc(a, w_hi(qs, base, 4, qh, hidx, hpre, 4 * hstep, hmask, sub, ds[4], mb), x, xi + 4, wbuf, wi + 4 * LANES)
    a = acc(a, w_hi(qs, base, 5, qh, hidx, hpre, 5 * hstep, hmask, sub, ds[5], mb), x, xi + 5, wbuf, wi + 5 * LANES)
    a = acc(a, w_hi(qs, base, 6, qh, hidx, hpre, 6 * hstep, hmask, sub, ds[6], mb), x, xi + 6, wbuf, wi + 6 * LANES)
    a = acc(a, w_hi(qs, base, 7, qh, hidx, hpre, 7 * hstep, hmask, sub, ds[7], mb), x, xi + 7, wbuf, wi + 7 * LANES)
    return a


@njit(cache=True, inline="always")
def q5_block(qs, qh, pb, kb, db, mb, sub, x, r0, a, wbuf, woff):
    """`q_block` for a block of 5-bit quants (Q5_0: sub 16, mb None; Q5_1: sub 0, mb its mins; Q5_K:
    sub 0), its words at
    qs[pb * 4 * 32:], the 5th bits (bit e: element e) at qh[pb * 32:]."""
    ds = nib_scales(db)
    for g in range(4):
        k = kb + 8 * g
        a = hi_group(qs, (pb * 4 + g) * HALF, qh, pb * HALF, 8 * g, 1, 1, sub, ds, mb, x, r0 + k, a, wbuf,
                     woff + k * LANES)
    return a


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
    if a.lanes > HALF:  # a few rows (`q_rows`): row i's element at xi + i * K
        return lambda a, w, x, xi, wbuf, wi: v_rows_acc(a, w, x, xi, x.shape[1])
    return lambda a, w, x, xi, wbuf, wi: v_add(a, v_mul(w, v32_splat(at(x, xi))))


def k_quant1(qs, qh, p, b, e, j):
    """Q4_K's nibble or Q5_K's 5-bit quant of one element (e of block b, row 32p + j), as a uint32."""
    raise NotImplementedError("k_quant1 is for jitted code")


@overload(k_quant1, inline="always")
def _k_quant1(qs, qh, p, b, e, j):
    u32 = np.uint32
    if isinstance(qh, types.NoneType):
        return lambda qs, qh, p, b, e, j: (qs[p, b, e // 8, j] >> u32(4 * (e % 8))) & u32(15)
    return lambda qs, qh, p, b, e, j: (((qs[p, b, e // 8, j] >> u32(4 * (e % 8))) & u32(15))
                                       | (((qh[p, b, j] >> u32(e)) & u32(1)) << u32(4)))


def n_blocks(w):
    """Blocks of 32 elements per row of a quantized storage tuple."""
    raise NotImplementedError("n_blocks is for jitted code")


@overload(n_blocks, inline="always")
def _n_blocks(w):
    if w[0].qtype == "Q8_0":
        return lambda w: w[1].shape[1] // QBLOCK
    return lambda w: w[1].shape[1]


def q_block(w, p, b, x, r0, a, wbuf, woff):
    """Quant block b of panel p of the storage tuple w, its scales loaded once, each weight through
    `acc`: with x an array, a plus the products with x[r0 + 32b + j], j in order (decode); with x None,
    the weights of element j stored at wbuf[woff + 64 (32b + j):] (prefill's dequantized pair)."""
    raise NotImplementedError("q_block is for jitted code")


@overload(q_block, inline="always")
def _q_block(w, p, b, x, r0, a, wbuf, woff):
    return READERS[w[0].qtype][0]


@njit(cache=True, inline="always")
def q_unit(x, w, p):
    """Token 0 times quantized panel p of the storage tuple w: 32 outputs."""
    K = x.shape[1]
    s0 = v32_zero()
    c0 = v32_zero()
    for k0 in range(0, K, KBLOCK):
        a0 = v32_zero()
        for b in range(k0 // QBLOCK, min(K, k0 + KBLOCK) // QBLOCK):
            a0 = q_block(w, p, b, x, 0, a0, x, 0)
        s0, c0 = kahan(a0, s0, c0)
    return s0


@lru_cache(maxsize=None)
def q_rows(R: int):
    """f(x, w, p, t0): tokens t0 .. t0 + R - 1 times quantized panel p, as one vector of 32R lanes (row
    i's 32 outputs in lanes 32i .., `simd.v_part`): each weight dequantized once for the R rows, and
    each row's outputs by `q_unit`'s operations in its order (a few rows, as speculative decoding's
    checks and small batches give)."""
    zero = rows_zero(R)

    def f(x, w, p, t0):
        K = x.shape[1]
        r0 = t0 * K
        s = zero()
        c = zero()
        for k0 in range(0, K, KBLOCK):
            a = zero()
            for b in range(k0 // QBLOCK, min(K, k0 + KBLOCK) // QBLOCK):
                a = q_block(w, p, b, x, r0, a, x, 0)
            s, c = kahan(a, s, c)
        return s

    return njit(inline="always")(f)


@njit(cache=True, inline="always")
def q_unit_pair(x, w, p):
    """`q_unit` of panels p and p + 1, their blocks taken in turn: the same operations per output, but
    two independent accumulators, so one panel's adds no longer wait on each other's latency alone
    (decode of 1B-shaped matrices, one thread, AVX-512: Q4_0 0.81-0.83x the time, Q8_0 0.79-0.80x)."""
    K = x.shape[1]
    s0 = v32_zero()
    c0 = v32_zero()
    s1 = v32_zero()
    c1 = v32_zero()
    for k0 in range(0, K, KBLOCK):
        a0 = v32_zero()
        a1 = v32_zero()
        for b in range(k0 // QBLOCK, min(K, k0 + KBLOCK) // QBLOCK):
            a0 = q_block(w, p, b, x, 0, a0, x, 0)
            a1 = q_block(w, p + 1, b, x, 0, a1, x, 0)
        s0, c0 = kahan(a0, s0, c0)
        s1, c1 = kahan(a1, s1, c1)
    return s0, s1


@njit(cache=True, inline="always")
def q_dequantize_pair(w, g, wbuf):
    """Panels 2g and 2g + 1 dequantized into wbuf[k * 64 + lane] (a missing second panel: wbuf's zeros)."""
    P = w[1].shape[0]
    zero = v32_zero()
    for h in range(min(2, P - 2 * g)):
        for b in range(n_blocks(w)):
            q_block(w, 2 * g + h, b, None, 0, zero, wbuf, h * HALF)


def q_element(w, p, b, e, j):
    """Element 32b + e of row 32p + j of the storage tuple w, dequantized (a scalar, for embedding rows)."""
    raise NotImplementedError("q_element is for jitted code")


@overload(q_element, inline="always")
def _q_element(w, p, b, e, j):
    return READERS[w[0].qtype][1]


# ---------------------------------------------------------------------------------------------------
# Each type's readers: (its `q_block`, its `q_element`), one row of READERS per type.

_f32, _u32 = np.float32, np.uint32


def _q8_0_block(w, p, b, x, r0, a, wbuf, woff):
    qs, d = w[1], w[2]
    K, nb = qs.shape[1], d.shape[1]
    db = v32_load(d, (p * nb + b) * HALF)
    for k in range(b * QBLOCK, b * QBLOCK + QBLOCK):
        a = acc(a, _w_q8_0(qs, p, K, k, db), x, r0 + k, wbuf, woff + k * LANES)
    return a


def _q8_0_element(w, p, b, e, j):
    return _f32(w[1][p, b * QBLOCK + e, j]) * widen(w[2][p, b, j])  # q * d


def _q4_block(w, p, b, x, r0, a, wbuf, woff):  # Q4_0 and Q4_1 (mins m, or None)
    qs, d, m = w[1], w[2], w[3]
    nb = d.shape[1]
    db = v32_load(d, (p * nb + b) * HALF)
    return nib_block(qs, p * nb + b, b * QBLOCK, db, mins(m, (p * nb + b) * HALF), x, r0, a, wbuf, woff)


def _q4_0_element(w, p, b, e, j):
    q = np.int32((w[1][p, b, e // 8, j] >> _u32(4 * (e % 8))) & _u32(15)) - np.int32(8)
    return widen(w[2][p, b, j]) * _f32(q)  # d * (q - 8)


def _q4_1_element(w, p, b, e, j):
    q = np.int32((w[1][p, b, e // 8, j] >> _u32(4 * (e % 8))) & _u32(15))
    return (widen(w[2][p, b, j]) * _f32(q)) + widen(w[3][p, b, j])  # (d * q) + m


def _mxfp4_block(w, p, b, x, r0, a, wbuf, woff):
    qs, d = w[1], w[2]
    pb = p * d.shape[1] + b
    return mx_block(qs, pb, b * QBLOCK, v_e8m0(d, pb * HALF), x, r0, a, wbuf, woff)


_KV_MXFP4 = np.array(KVALUES_MXFP4, np.float32)


def _mxfp4_element(w, p, b, e, j):
    code = (w[1][p, b, e // 8, j] >> _u32(4 * (e % 8))) & _u32(15)
    return e8m0(w[2][p, b, j]) * _KV_MXFP4[code]  # d * q


def _q5_0_block(w, p, b, x, r0, a, wbuf, woff):
    qs, d, qh = w[1], w[2], w[5]
    pb = p * d.shape[1] + b
    return q5_block(qs, qh, pb, b * QBLOCK, v32_load(d, pb * HALF), None, 16, x, r0, a, wbuf, woff)  # d * q


def _q5_0_element(w, p, b, e, j):
    lo = (w[1][p, b, e // 8, j] >> _u32(4 * (e % 8))) & _u32(15)
    hi = (w[5][p, b, j] >> _u32(e)) & _u32(1)
    q = np.int32(lo | (hi << _u32(4))) - np.int32(16)
    return widen(w[2][p, b, j]) * _f32(q)  # d * q


def _q5_1_block(w, p, b, x, r0, a, wbuf, woff):
    qs, d, m, qh = w[1], w[2], w[3], w[5]
    pb = p * d.shape[1] + b
    return q5_block(qs, qh, pb, b * QBLOCK, v32_load(d, pb * HALF), v32_load(m, pb * HALF), 0, x, r0, a, wbuf,
                    woff)  # (d * q) + m


def _q5_1_element(w, p, b, e, j):
    lo = (w[1][p, b, e // 8, j] >> _u32(4 * (e % 8))) & _u32(15)
    hi = (w[5][p, b, j] >> _u32(e)) & _u32(1)
    q = np.int32(lo | (hi << _u32(4)))
    return (widen(w[2][p, b, j]) * _f32(q)) + widen(w[3][p, b, j])  # (d * q) + m


def _q4_k_block(w, p, b, x, r0, a, wbuf, woff):
    dl, nml = _k1_scales(w, p, b)
    return nib_block(w[1], p * w[1].shape[1] + b, b * QBLOCK, dl, nml, x, r0, a, wbuf, woff)


def _q5_k_block(w, p, b, x, r0, a, wbuf, woff):
    qs, qh = w[1], w[5]
    dl, nml = _k1_scales(w, p, b)
    return q5_block(qs, qh, p * qs.shape[1] + b, b * QBLOCK, dl, nml, 0, x, r0, a, wbuf, woff)  # (dl * q) - ml


def _k_type1_element(w, p, b, e, j):  # Q4_K and Q5_K (qh None for Q4_K)
    qs, d, dm, sc, qh = w[1], w[2], w[3], w[4], w[5]
    s, jj = b // 8, b % 8
    if jj < 4:
        scale = sc[p, s, jj, j] & np.uint8(63)
        mn = sc[p, s, jj + 4, j] & np.uint8(63)
    else:
        scale = (sc[p, s, jj + 4, j] & np.uint8(15)) | ((sc[p, s, jj - 4, j] >> np.uint8(6)) << np.uint8(4))
        mn = (sc[p, s, jj + 4, j] >> np.uint8(4)) | ((sc[p, s, jj, j] >> np.uint8(6)) << np.uint8(4))
    q = k_quant1(qs, qh, p, b, e, j)
    dl = widen(d[p, s, j]) * _f32(scale)  # d * sc
    ml = widen(dm[p, s, j]) * _f32(mn)  # dmin * mn
    return (dl * _f32(np.int32(q))) - ml


def _q6_k_block(w, p, b, x, r0, a, wbuf, woff):
    qs, d, sc, qh = w[1], w[2], w[4], w[5]
    pb = p * qs.shape[1] + b
    s = p * d.shape[1] + b // 8
    t = 2 * (b % 8)
    db = v32_load(d, s * HALF)
    for h in range(2):  # elements 16h..16h+15: d * sc, sc the int8 scale of the 16
        ds = nib_scales(v_mul(db, v_q8(sc, (s * 16 + t + h) * HALF)))
        for g in range(2 * h, 2 * h + 2):
            k = b * QBLOCK + 8 * g
            a = hi_group(qs, (pb * 4 + g) * HALF, qh, (pb * 2 + h) * HALF, 16 * (g % 2), 2, 3, 32, ds, None,
                         x, r0 + k, a, wbuf, woff + k * LANES)  # dl * q
    return a


def _q6_k_element(w, p, b, e, j):
    qs, d, sc, qh = w[1], w[2], w[4], w[5]
    s = b // 8
    lo = (qs[p, b, e // 8, j] >> _u32(4 * (e % 8))) & _u32(15)
    hi = (qh[p, b, e // 16, j] >> _u32(2 * (e % 16))) & _u32(3)
    q = np.int32(lo | (hi << _u32(4))) - np.int32(32)
    dl = widen(d[p, s, j]) * _f32(sc[p, s, 2 * (b % 8) + e // 16, j])  # d * sc
    return dl * _f32(q)


#: ggml type name -> (its q_block, its q_element): the weights of a quantized storage of that type.
READERS = {
    "Q8_0": (_q8_0_block, _q8_0_element),
    "Q4_0": (_q4_block, _q4_0_element),
    "Q4_1": (_q4_block, _q4_1_element),
    "Q5_0": (_q5_0_block, _q5_0_element),
    "Q5_1": (_q5_1_block, _q5_1_element),
    "Q4_K": (_q4_k_block, _k_type1_element),
    "Q5_K": (_q5_k_block, _k_type1_element),
    "Q6_K": (_q6_k_block, _q6_k_element),
    "MXFP4": (_mxfp4_block, _mxfp4_element),
}
