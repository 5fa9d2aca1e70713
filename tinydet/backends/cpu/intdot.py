"""The integer mode's block dot products (dtype "int8"): quantized weights (`packing/intpanels.py`) against
8-bit activations (`actq.py`), deterministic by construction.

Per output n of row t and per 32-element block b, with q the activation quants, dx their block scale,
bs their block sum, dw (and Q4_1's mw) the weight block's fp16 scale widened exactly:
  isum = the exact integer dot of the weight quants and q; weights enter unsigned (nibbles 0..15,
         Q5_0's 5-bit 0..31) and the offset is folded in after: isum = sum(n_i q_i) - 8 bs (Q4_0),
         - 16 bs (Q5_0); Q8_0's int8 quants enter as they are
  f    = float(isum) * (dw * dx)                                 Q8_0, Q4_0, Q5_0, MXFP4
  f    = float(isum) * (dw * dx) + float(bs) * (mw * dx)         Q4_1 (isum without offset)
each product rounded on its own (no FMA). MXFP4 (ggml's ggml_vec_dot_mxfp4_q8_0, with float32 dx): the
weight quants are its codes' values kvalues[code] (-12..12) plus 12, looked up per byte (`iv_mx`), so
0..24 enter unsigned and isum = sum(u_i q_i) - 12 bs = sum(kvalues_i q_i); dw = 2^(e - 128) from the
exponent byte's bits (`qblocks.v_e8m0`, exact), |isum| <= 32 * 12 * 127. The K-quants take activations in blocks of 256 (dx per
256) and per super-block of 256, with sc, mn the sub-blocks' 6-bit scales and mins (Q6_K: int8 scales
per 16 elements) and dot_j the exact integer dot of sub-block j's unsigned quants with q:
  Q4_K, Q5_K  isum = sum_j sc_j * dot_j, msum = sum_j mn_j * bs_j (j over 8 sub-blocks of 32)
              f = float(isum) * (d * dx) - float(msum) * (dmin * dx)
  Q6_K        isum = sum_g sc_g * (dot_g - 32 bs_g) (g over 16 groups of 16), f = float(isum) * (d * dx)
The output is the Kahan sum (`simd.kahan`) of the f of blocks (super-blocks) 0, 1, 2, ... in order.
|isum| <= 32 * 128 * 127 < 2^24 for the 32-blocks, so float(isum) is exact there; the K-quants' sums
stay under 2^31 (8 * 63 * 32 * 31 * 127; 16 * 128 * 16 * 32 * 127) and are rounded once to float32 (to
nearest even, on every ISA).

The integer dot of a 32-bit lane (4 unsigned bytes a times 4 signed bytes b, added to an int32) is
one rule with three lowerings, chosen by the compile target (`simd.target_has`) and equal on every
input the kernels give them (a <= 128, -127 <= b <= 127, so nothing overflows or saturates; Q6_K's
6-bit quants are 0..63, pairs at most 2 * 63 * 127):
  AVX-512 VNNI  vpdpbusd (u8 x s8 pairs summed in 32 bits, no saturation)
  AVX2          vpmaddubsw (pairs summed in 16 bits: at most 2 * 128 * 127 = 32512 < 32767) then
                vpmaddwd with ones; the quants of at most 6 bits keep the pairs in 16 bits over
                several words (`iv_dot16`: 8 words of 4-bit quants, 4 of 5-bit, 2 of 6-bit, each
                half under 32767) and fold them once by vpmaddwd against the sub-block's scale
                (`iv_fold`), where the 32-bit lowerings multiply (1B Q4_K_M down and gate
                projections, 128 rows: 0.57-0.75x the time)
  elsewhere     plain LLVM vector integer IR (widen, multiply, add), any target
MXFP4's code -> kvalue + 12 lookup (`iv_mx`) likewise: vpshufb on AVX-512BW (zmm) and AVX2 (ymm), each
128-bit lane holding the 16-entry table; elsewhere integer byte arithmetic on the code's bits; the same
bytes (quants of at most 24: pairs at most 2 * 24 * 127 = 6096, five calls' halves under 32767).
Q8_0's signed weights enter as |w| against q with w's sign (|w| <= 128: -128 is a valid int8). Integer
sums are exact, so the lowering changes speed only, never a bit.

Work split: decode gives each thread a run of 32-output units (one panel each), prefill gives jobs of
(64 outputs, a run of token tiles), as for every storage (`matmul.py`); a tile of R rows loads each
weight word once for R rows. Neither enters any output's arithmetic.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from .qblocks import KVALUES_MXFP4, v_e8m0
from ...numerics.simd import (HALF, _F32V32, _c_array, _ptr, _splat, broadcast, kahan, target_has, target_isa, v32_load,
                              v32_splat, v32_zero, v_add, v_mul, v_sub, widen)
from .tiles import put

_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_VI = ir.VectorType(_I32, HALF)  # 32 lanes of int32: one quantized panel's outputs


class _I32VType(types.Type):
    def __init__(self):
        super().__init__(name=f"tinydet.i32x{HALF}")


_IV = _I32VType()


@register_model(_I32VType)
class _I32VModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VI)


@intrinsic
def iv_zero(typingctx):
    return _IV(), lambda context, builder, sig, args: _splat(_VI, 0)


@intrinsic
def iv_load(typingctx, arr, idx):
    """32 int32 lanes from arr[idx:] (flat; uint32 words, or int8 bytes 4 to a lane)."""
    if not (_c_array(arr, types.uint32, types.int8) and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], _VI), align=4)

    return _IV(arr, idx), codegen


@intrinsic
def iv_word(typingctx, arr, idx):
    """The 4 bytes arr[idx : idx + 4] (int8, flat) as one int32, in every lane."""
    if not (_c_array(arr, types.int8) and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], _I32)
        return broadcast(builder, _VI, builder.load(p, align=1))

    return _IV(arr, idx), codegen


def _int_binop(name):
    def impl(typingctx, a, b):
        if a != _IV or not (b == _IV or isinstance(b, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            y = args[1]
            if b != _IV:  # a scalar: every lane
                y = broadcast(builder, _VI, builder.trunc(context.cast(builder, y, sig.args[1], types.int64), _I32))
            return getattr(builder, name)(args[0], y)

        return _IV(a, b), codegen

    impl.__name__ = f"iv_{name}"
    return intrinsic(impl)


iv_and = _int_binop("and_")
iv_or = _int_binop("or_")
iv_sub = _int_binop("sub")
iv_shl = _int_binop("shl")
iv_shr = _int_binop("lshr")
iv_add = _int_binop("add")
iv_mul = _int_binop("mul")


@intrinsic
def iv_bytes(typingctx, arr, idx):
    """32 bytes arr[idx:] (flat) as int32 lanes: uint8 zero-extended, int8 sign-extended."""
    if not (_c_array(arr, types.uint8, types.int8) and isinstance(idx, types.Integer)):
        return None
    signed = arr.dtype == types.int8

    def codegen(context, builder, sig, args):
        v = builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], ir.VectorType(_I8, HALF)),
                         align=1)
        return builder.sext(v, _VI) if signed else builder.zext(v, _VI)

    return _IV(arr, idx), codegen


@intrinsic
def iv_float(typingctx, v):
    """The lanes as float32 (exact below 2^24)."""
    if v != _IV:
        return None
    return _F32V32(v), lambda context, builder, sig, args: builder.sitofp(args[0], ir.VectorType(ir.FloatType(), HALF))


def _halves(builder, v, n):
    """v (<32 x i32>) cut into 32 / n vectors of n lanes."""
    und = ir.Constant(v.type, ir.Undefined)
    return [builder.shuffle_vector(v, und, ir.Constant(ir.VectorType(_I32, n), list(range(c, c + n))))
            for c in range(0, HALF, n)]


def _join(builder, parts):
    while len(parts) > 1:
        nxt = []
        for a, b in zip(parts[::2], parts[1::2]):
            n = a.type.count
            nxt.append(builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, 2 * n), list(range(2 * n)))))
        parts = nxt
    return parts[0]


def _declare(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _vnni(context) -> bool:
    return target_has(context, "avx512vnni") and target_has(context, "avx512f")


def _maddubs(builder, acc, a, b):
    """vpmaddubsw over each 8-lane part of a and b: [(acc's part, the part's 16-bit pair sums)]."""
    v32b, v16h = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16)
    fn = _declare(builder, "llvm.x86.avx2.pmadd.ub.sw", v16h, [v32b, v32b])
    return [(s, builder.call(fn, [builder.bitcast(x, v32b), builder.bitcast(y, v32b)]))
            for s, x, y in zip(*(_halves(builder, v, 8) for v in (acc, a, b)))]


def _dot_ub_sb(context, builder, acc, a, b):
    """acc + per lane the sum of 4 products of a's unsigned bytes and b's signed bytes (module docstring)."""
    if _vnni(context):
        v16 = ir.VectorType(_I32, 16)
        fn = _declare(builder, "llvm.x86.avx512.vpdpbusd.512", v16, [v16, v16, v16])
        parts = [builder.call(fn, [s, x, y]) for s, x, y in zip(*(_halves(builder, v, 16) for v in (acc, a, b)))]
        return _join(builder, parts)
    if target_has(context, "avx2"):
        v8, v16h = ir.VectorType(_I32, 8), ir.VectorType(_I16, 16)
        maddwd = _declare(builder, "llvm.x86.avx2.pmadd.wd", v8, [v16h, v16h])
        ones = _splat(v16h, 1)
        return _join(builder, [builder.add(s, builder.call(maddwd, [pairs, ones]))
                               for s, pairs in _maddubs(builder, acc, a, b)])
    n = 4 * HALF
    vb, vw = ir.VectorType(_I8, n), ir.VectorType(_I32, n)
    prod = builder.mul(builder.zext(builder.bitcast(a, vb), vw), builder.sext(builder.bitcast(b, vb), vw))
    und = ir.Constant(vw, ir.Undefined)
    four = [builder.shuffle_vector(prod, und, ir.Constant(_VI, list(range(i, n, 4)))) for i in range(4)]
    return builder.add(acc, builder.add(builder.add(four[0], four[1]), builder.add(four[2], four[3])))


def _pairs16(context) -> bool:
    """Whether `iv_dot16` keeps vpmaddubsw's 16-bit pair sums (AVX2 without AVX-512 VNNI)."""
    return target_has(context, "avx2") and not _vnni(context)


def pairs16() -> bool:
    """`_pairs16` for the target numba compiles for: the kernel templates fold their dots by it."""
    from numba.core.registry import cpu_target

    return _pairs16(cpu_target.target_context)


# The most iv_dot16 calls one accumulator may take before `iv_fold` when `pairs16()`: a 16-bit half
# holds 2 products per call, so n calls stay under 32767 while n * 2 * wmax * 127 does (weights at most
# wmax: 15 for 4-bit quants, 24 for MXFP4's kvalues + 12, 31 for 5-bit, 63 for Q6_K's 6-bit).
DOT16_CALLS = {15: 8, 24: 5, 31: 4, 63: 2}


@intrinsic
def iv_dot16(typingctx, acc, a, b):
    """As `iv_dot`, except that where `pairs16()` the sum is kept as two 16-bit halves per lane
    (vpmaddubsw's pairs added with vpaddw, without vpmaddwd): such a value is only read through
    `iv_fold`, after at most DOT16_CALLS calls, so that no half leaves the int16 range. Elsewhere it
    is `iv_dot` itself, and either way `iv_fold` gives the same integers."""
    if not (acc == _IV and a == _IV and b == _IV):
        return None

    def codegen(context, builder, sig, args):
        if not _pairs16(context):
            return _dot_ub_sb(context, builder, *args)
        v16h = ir.VectorType(_I16, 16)
        return _join(builder, [builder.bitcast(builder.add(builder.bitcast(s, v16h), pairs), s.type)
                               for s, pairs in _maddubs(builder, *args)])

    return _IV(acc, a, b), codegen


@intrinsic
def iv_fold(typingctx, acc, s):
    """Per lane (the sum `iv_dot16` accumulated) * s, for |s| < 2^15: vpmaddwd against s in both
    16-bit halves where `pairs16()`, a 32-bit multiply elsewhere (s = 1: nothing)."""
    if acc != _IV or not (s == _IV or isinstance(s, types.IntegerLiteral)):
        return None

    def codegen(context, builder, sig, args):
        a, k = args[0], getattr(sig.args[1], "literal_value", None)
        if not _pairs16(context):
            return a if k == 1 else builder.mul(a, args[1] if k is None else _splat(_VI, k))
        if k is None:
            y = builder.or_(builder.and_(args[1], _splat(_VI, 0xFFFF)), builder.shl(args[1], _splat(_VI, 16)))
        else:
            y = _splat(_VI, (k & 0xFFFF) * 0x10001)
        v16h, v8 = ir.VectorType(_I16, 16), ir.VectorType(_I32, 8)
        maddwd = _declare(builder, "llvm.x86.avx2.pmadd.wd", v8, [v16h, v16h])
        return _join(builder, [builder.call(maddwd, [builder.bitcast(x, v16h), builder.bitcast(z, v16h)])
                               for x, z in zip(_halves(builder, a, 8), _halves(builder, y, 8))])

    return _IV(acc, s), codegen


_MX_U = [v + 12 for v in KVALUES_MXFP4]  # MXFP4 code -> its value + 12: 0..24, unsigned for the byte dots


@intrinsic
def iv_mx(typingctx, v):
    """Each byte of v, an MXFP4 code 0..15, replaced by kvalues[code] + 12 (`_MX_U`). AVX-512BW / AVX2:
    vpshufb against the table in every 128-bit lane. Elsewhere in byte arithmetic: m = code & 7, its
    magnitude m + (m > 4 ? m - 4 : 0) + (m == 7 ? 2 : 0), then 12 minus it where bit 3 is set, else 12
    plus it. Integers either way: the same bytes."""
    if v != _IV:
        return None

    def codegen(context, builder, sig, args):
        if target_has(context, "avx512bw") or target_has(context, "avx2"):
            n, name = (64, "llvm.x86.avx512.pshuf.b.512") if target_has(context, "avx512bw") else (
                32, "llvm.x86.avx2.pshuf.b")
            vb, vn = ir.VectorType(_I8, 4 * HALF), ir.VectorType(_I8, n)
            fn = _declare(builder, name, vn, [vn, vn])
            table = ir.Constant(vn, [ir.Constant(_I8, _MX_U[i % 16]) for i in range(n)])
            b = builder.bitcast(args[0], vb)
            und = ir.Constant(vb, ir.Undefined)
            parts = [builder.call(fn, [table, builder.shuffle_vector(b, und, ir.Constant(
                ir.VectorType(_I32, n), list(range(c, c + n))))]) for c in range(0, 4 * HALF, n)]
            while len(parts) > 1:
                m = parts[0].type.count
                parts = [builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(_I32, 2 * m), list(range(2 * m))))
                         for x, y in zip(parts[::2], parts[1::2])]
            return builder.bitcast(parts[0], _VI)
        vb = ir.VectorType(_I8, 4 * HALF)
        c = builder.bitcast(args[0], vb)
        m = builder.and_(c, _splat(vb, 7))
        over4 = builder.select(builder.icmp_unsigned(">", m, _splat(vb, 4)), builder.sub(m, _splat(vb, 4)), _splat(vb, 0))
        seven = builder.select(builder.icmp_unsigned("==", m, _splat(vb, 7)), _splat(vb, 2), _splat(vb, 0))
        mag = builder.add(builder.add(m, over4), seven)
        neg = builder.icmp_unsigned("!=", builder.and_(c, _splat(vb, 8)), _splat(vb, 0))
        u = builder.select(neg, builder.sub(_splat(vb, 12), mag), builder.add(_splat(vb, 12), mag))
        return builder.bitcast(u, _VI)

    return _IV(v), codegen


@intrinsic
def iv_dot(typingctx, acc, a, b):
    """acc + per lane sum_i a_i * b_i over the lane's 4 bytes, a unsigned (<= 128), b signed (>= -127)."""
    if not (acc == _IV and a == _IV and b == _IV):
        return None
    return _IV(acc, a, b), lambda context, builder, sig, args: _dot_ub_sb(context, builder, *args)


@intrinsic
def iv_dot_signed(typingctx, acc, a, b):
    """acc + per lane sum_i a_i * b_i, a and b signed bytes (b >= -127): as |a| times b with a's sign."""
    if not (acc == _IV and a == _IV and b == _IV):
        return None

    def codegen(context, builder, sig, args):
        vb = ir.VectorType(_I8, 4 * HALF)
        a8, b8 = builder.bitcast(args[1], vb), builder.bitcast(args[2], vb)
        neg = builder.icmp_signed("<", a8, _splat(vb, 0))
        ua = builder.select(neg, builder.sub(_splat(vb, 0), a8), a8)  # -(-128) wraps to 128 unsigned: right
        sb = builder.select(neg, builder.sub(_splat(vb, 0), b8), b8)
        return _dot_ub_sb(context, builder, args[0], builder.bitcast(ua, _VI), builder.bitcast(sb, _VI))

    return _IV(acc, a, b), codegen


# ---------------------------------------------------------------------------------------------------
# Kernels: R rows of activations times one 32-row panel. Storage tuple w = (tag, qs, d, m, sc, qh)
# (`packing/intpanels.py`); activations xa = (xq, xd, xs) (`actq.py`).

K_KINDS = ("Q4_K", "Q5_K", "Q6_K")


def act_block(qtype: str) -> int:
    """Elements per activation block beside weights of ggml type `qtype`: 256 (Q8_K) for the
    K-quants, else 32."""
    return 256 if qtype in K_KINDS else 32


_OFFSET = {"Q8_0": 0, "Q4_0": 8, "Q4_1": 0, "Q5_0": 16, "MXFP4": 12}
# Q5_0's 5th bits of a group of 8 (bits 8g .. 8g+7 of the block's word, shifted down) moved to bit 4 of
# the byte of their element: elements (0, 2, 4, 6) to bytes 0..3, (1, 3, 5, 7) likewise
_HI_EVEN = "iv_or(iv_or(iv_shl(iv_and(h, 1), 4), iv_shl(iv_and(h, 4), 10)), iv_or(iv_shl(iv_and(h, 16), 16), iv_shl(iv_and(h, 64), 22)))"
_HI_ODD = "iv_or(iv_or(iv_shl(iv_and(h, 2), 3), iv_shl(iv_and(h, 8), 9)), iv_or(iv_shl(iv_and(h, 32), 15), iv_shl(iv_and(h, 128), 21)))"
# Q6_K's high 2 bits of a group of 8 (bits 2e, 2e + 1 of h for element e): h's 4 nibbles spread to
# the 4 bytes (nibble k holds elements 2k and 2k + 1), then each half's 2 bits moved to bits 4, 5
_SPREAD6 = ["                h = iv_and(iv_or(h, iv_shl(h, 8)), 0x00FF00FF)",
            "                h = iv_and(iv_or(h, iv_shl(h, 4)), 0x0F0F0F0F)"]
_HI6_EVEN = "iv_and(iv_shl(h, 4), 0x30303030)"
_HI6_ODD = "iv_and(iv_shl(h, 2), 0x30303030)"


def _group_calls(wmax: int) -> int:
    """Nibble words (2 dot calls each) one accumulator takes before its fold: all 4 of a 32-element
    block unless `pairs16()` limits them (`DOT16_CALLS`)."""
    return DOT16_CALLS[wmax] // 2 if pairs16() else 4


def _ksource(kind: str, R: int) -> str:
    """`_source` for the K-quants: per super-block of 256, isum = sum_j sc_j * dot_j over its 32-element
    sub-blocks (Q6_K: its 16 groups of 16, (q6 - 32) folded in by the group sums), msum = sum_j mn_j *
    bs_j, f = float(isum) * (d * dx) - float(msum) * (dmin * dx) (Q6_K: no msum)."""
    r = range(R)
    L = ["def f(xa, w, p, rows, n0, n_out, out, t_lim):",
         "    xq, xd, xs = xa", "    qs, d, m, sc, qh = w[1], w[2], w[3], w[4], w[5]",
         "    K = xq.shape[1]", "    nb = K // 32", "    ns = K // 256"]
    L += [f"    r{i} = rows[{i}]\n    s{i} = v32_zero()\n    c{i} = v32_zero()" for i in r]
    L += ["    for S in range(ns):", "        ps = p * ns + S"]
    L += [f"        i{i} = iv_zero()\n        m{i} = iv_zero()" for i in r]
    L += ["        for j in range(8):", "            b = S * 8 + j", "            pb = p * nb + b"]
    if kind == "Q6_K":
        fold = _group_calls(63) == 1  # 16-bit halves: fold each word's 2 calls
        L += ["            for hh in range(2):", "                hw = iv_load(qh, (pb * 2 + hh) * 32)",
              "                scg = iv_bytes(sc, (ps * 16 + 2 * j + hh) * 32)"]
        L += [f"                a{i} = iv_zero()" for i in r]
        L += ["                for gg in range(2):", "                    g = 2 * hh + gg",
              "                    w = iv_load(qs, (pb * 4 + g) * 32)",
              "                    h = iv_and(iv_shr(hw, 16 * gg), 0xFFFF)"]
        L += ["    " + x for x in _SPREAD6]
        L += [f"                    w0 = iv_or(iv_and(w, 0x0F0F0F0F), {_HI6_EVEN})",
              f"                    w1 = iv_or(iv_and(iv_shr(w, 4), 0x0F0F0F0F), {_HI6_ODD})"]
        dot = "iv_dot16" if fold else "iv_dot"
        for i in r:
            e = (f"{dot}({dot}({'iv_zero()' if fold else f'a{i}'}, w0, iv_word(xq, r{i} * K + b * 32 + 8 * g)), w1, "
                 f"iv_word(xq, r{i} * K + b * 32 + 8 * g + 4))")
            L.append(f"                    a{i} = iv_add(a{i}, iv_fold({e}, scg))" if fold else f"                    a{i} = {e}")
        if fold:  # a = sum_g sc_g dot_g already: the offset's part, sc_g * 32 bs_g, apart
            L += [f"                i{i} = iv_sub(iv_add(i{i}, a{i}), iv_mul(scg, 32 * xs[r{i}, 2 * b + hh]))" for i in r]
        else:
            L += [f"                i{i} = iv_add(i{i}, iv_mul(iv_sub(a{i}, 32 * xs[r{i}, 2 * b + hh]), scg))" for i in r]
        L += ["        dw = v32_load(d, ps * 32)"]
        for i in r:
            L += [f"        dx = v32_splat(xd[r{i}, S])",
                  f"        s{i}, c{i} = kahan(v_mul(iv_float(i{i}), v_mul(dw, dx)), s{i}, c{i})"]
    else:
        G = _group_calls(31 if kind == "Q5_K" else 15)
        fold = pairs16()  # 16-bit halves: each run of G words folded by its scale, no 32-bit multiply
        L += ["            o = ps * 12 * 32",
              "            if j < 4:",
              "                scj = iv_and(iv_bytes(sc, o + j * 32), 63)",
              "                mnj = iv_and(iv_bytes(sc, o + (j + 4) * 32), 63)",
              "            else:",
              "                hi = iv_bytes(sc, o + (j + 4) * 32)",
              "                scj = iv_or(iv_and(hi, 15), iv_shl(iv_shr(iv_bytes(sc, o + (j - 4) * 32), 6), 4))",
              "                mnj = iv_or(iv_shr(hi, 4), iv_shl(iv_shr(iv_bytes(sc, o + j * 32), 6), 4))"]
        if kind == "Q5_K":
            L.append("            hb = iv_load(qh, pb * 32)")
        L += [f"            for gh in range({4 // G}):"]
        L += [f"                a{i} = iv_zero()" for i in r]
        L += [f"                for g2 in range({G}):", f"                    g = {G} * gh + g2",
              "                    w = iv_load(qs, (pb * 4 + g) * 32)",
              "                    w0 = iv_and(w, 0x0F0F0F0F)", "                    w1 = iv_and(iv_shr(w, 4), 0x0F0F0F0F)"]
        if kind == "Q5_K":
            L += ["                    h = iv_and(iv_shr(hb, 8 * g), 0xFF)", f"                    w0 = iv_or(w0, {_HI_EVEN})",
                  f"                    w1 = iv_or(w1, {_HI_ODD})"]
        dot = "iv_dot16" if fold else "iv_dot"
        L += [f"                    a{i} = {dot}({dot}(a{i}, w0, iv_word(xq, r{i} * K + b * 32 + 8 * g)), w1, "
              f"iv_word(xq, r{i} * K + b * 32 + 8 * g + 4))" for i in r]
        L += [f"                i{i} = iv_add(i{i}, {'iv_fold' if fold else 'iv_mul'}(a{i}, scj))" for i in r]
        L += [f"            m{i} = iv_add(m{i}, iv_mul(mnj, xs[r{i}, 2 * b] + xs[r{i}, 2 * b + 1]))" for i in r]
        L += ["        dw = v32_load(d, ps * 32)", "        mw = v32_load(m, ps * 32)"]
        for i in r:
            L += [f"        dx = v32_splat(xd[r{i}, S])",
                  f"        f = v_sub(v_mul(iv_float(i{i}), v_mul(dw, dx)), v_mul(iv_float(m{i}), v_mul(mw, dx)))",
                  f"        s{i}, c{i} = kahan(f, s{i}, c{i})"]
    for i in r:
        L.append(f"    if r{i} < t_lim:\n        put(out, r{i}, n0, n_out, s{i}, 32)")
    return "\n".join(L)


def _source(kind: str, R: int) -> str:
    """f(xa, w, p, rows, n0, n_out, out, t_lim): rows (a tuple of R row indices of xa) times panel p,
    each row's 32 outputs written at out[row, n0:] (clipped at n_out) where row < t_lim."""
    r = range(R)
    L = ["def f(xa, w, p, rows, n0, n_out, out, t_lim):",
         "    xq, xd, xs = xa", "    qs, d, m, qh = w[1], w[2], w[3], w[5]",
         "    K = xq.shape[1]", "    nb = K // 32", "    ns = K // 16"]
    L += [f"    r{i} = rows[{i}]\n    s{i} = v32_zero()\n    c{i} = v32_zero()" for i in r]
    L += ["    for b in range(nb):", "        pb = p * nb + b"]
    L += [f"        a{i} = iv_zero()" for i in r]
    if kind == "Q5_0":
        L.append("        hb = iv_load(qh, pb * 32)")
    fold = kind != "Q8_0" and pairs16()  # 16-bit halves, folded after each run of G words
    G = _group_calls({"Q5_0": 31, "MXFP4": 24}.get(kind, 15)) if fold else 4
    L.append(f"        for gh in range({4 // G}):")
    L += [f"            e{i} = iv_zero()" for i in r] if fold else []
    L += [f"            for g2 in range({G}):", f"                g = {G} * gh + g2"]
    if kind == "Q8_0":
        L += ["                w0 = iv_load(qs, (pb * 8 + 2 * g) * 128)",
              "                w1 = iv_load(qs, (pb * 8 + 2 * g + 1) * 128)"]
        dot = "iv_dot_signed"
    else:
        L += ["                w = iv_load(qs, (pb * 4 + g) * 32)", "                w0 = iv_and(w, 0x0F0F0F0F)",
              "                w1 = iv_and(iv_shr(w, 4), 0x0F0F0F0F)"]
        if kind == "Q5_0":
            L += ["                h = iv_and(iv_shr(hb, 8 * g), 0xFF)", f"                w0 = iv_or(w0, {_HI_EVEN})",
                  f"                w1 = iv_or(w1, {_HI_ODD})"]
        if kind == "MXFP4":  # codes -> kvalues + 12
            L += ["                w0 = iv_mx(w0)", "                w1 = iv_mx(w1)"]
        dot = "iv_dot16" if fold else "iv_dot"
    for i in r:
        acc = f"e{i}" if fold else f"a{i}"
        L.append(f"                {acc} = {dot}({dot}({acc}, w0, iv_word(xq, r{i} * K + b * 32 + 8 * g)), w1, "
                 f"iv_word(xq, r{i} * K + b * 32 + 8 * g + 4))")
    L += [f"            a{i} = iv_add(a{i}, iv_fold(e{i}, 1))" for i in r] if fold else []
    L.append(f"        dw = {'v_e8m0' if kind == 'MXFP4' else 'v32_load'}(d, pb * 32)")
    if kind == "Q4_1":
        L.append("        mw = v32_load(m, pb * 32)")
    for i in r:
        L.append(f"        dx = v32_splat(xd[r{i}, b])")
        if _OFFSET[kind] or kind == "Q4_1":
            L.append(f"        bs = xs[r{i}, 2 * b] + xs[r{i}, 2 * b + 1]")
        if _OFFSET[kind]:
            L.append(f"        a{i} = iv_sub(a{i}, {_OFFSET[kind]} * bs)")
        f = f"v_mul(iv_float(a{i}), v_mul(dw, dx))"
        if kind == "Q4_1":
            f = f"v_add({f}, v_mul(v32_splat(np.float32(bs)), v_mul(mw, dx)))"
        L.append(f"        s{i}, c{i} = kahan({f}, s{i}, c{i})")
    for i in r:
        L.append(f"    if r{i} < t_lim:\n        put(out, r{i}, n0, n_out, s{i}, 32)")
    return "\n".join(L)


_ENV = dict(np=np, iv_zero=iv_zero, iv_load=iv_load, iv_word=iv_word, iv_and=iv_and, iv_or=iv_or, iv_sub=iv_sub,
            iv_shl=iv_shl, iv_shr=iv_shr, iv_add=iv_add, iv_mul=iv_mul, iv_bytes=iv_bytes, v_sub=v_sub, iv_float=iv_float, iv_dot=iv_dot, iv_dot_signed=iv_dot_signed,
            iv_dot16=iv_dot16, iv_fold=iv_fold, iv_mx=iv_mx, v_e8m0=v_e8m0,
            v32_zero=v32_zero, v32_load=v32_load, v32_splat=v32_splat, v_add=v_add, v_mul=v_mul, kahan=kahan, put=put)


@lru_cache(maxsize=None)
def panel_rows(kind: str, R: int):
    """The jitted R-row kernel of `_source` for the type `kind`."""
    scope = dict(_ENV)
    exec((_ksource if kind in K_KINDS else _source)(kind, R), scope)  # noqa: S102 (generated from the templates above)
    return njit(inline="always")(scope["f"])


# Rows per prefill tile: R rows keep 3R running vectors of 32 lanes (the dot, the Kahan pair); 32 zmm
# on AVX-512 hold 4 rows (2 zmm each) beside the weight words. 16 ymm on AVX2 hold one or two, yet 4
# rows there spread a word's unpacking over more dots for what the spills cost (1B Q6_K down
# projection, 128 rows: 22-23 ms against 26; the 4-bit types alike, 13-14 ms).
TILE_ROWS = {"avx512": 4, "avx2": 4, "sse": 2}


def tile_rows() -> int:
    return TILE_ROWS[target_isa()]


@lru_cache(maxsize=None)
def _kernels(kind: str):
    one, two, many, R = panel_rows(kind, 1), panel_rows(kind, 2), panel_rows(kind, tile_rows()), tile_rows()
    rows = "".join(f"min(t + {i}, last), " for i in range(R))
    src = ["def units(xa, w, p0, n_out, out, u0, u1, c0):",
           "    for u in range(u0, u1):",
           "        one(xa, w, p0 + u, (0,), c0 + u * 32, n_out, out, 1)",
           "def group(xa, w, p0, g, ta, tb, n_out, out, c0):",
           "    P = w[1].shape[0]",
           "    last = tb - 1",
           "    for i in range(2):",
           "        p = p0 + 2 * g + i",
           "        n0 = c0 + (2 * g + i) * 32",
           "        t = ta if p < P and n0 < n_out else tb",  # no panel, or only padding rows past n_out
           "        while t < tb:",
           f"            if tb - t >= {R}:",
           f"                many(xa, w, p, ({rows}), n0, n_out, out, tb)",
           f"                t += {R}",
           "            elif tb - t >= 2:",  # a tile's remainder by pairs, then alone
           "                two(xa, w, p, (t, t + 1), n0, n_out, out, tb)",
           "                t += 2",
           "            else:",
           "                one(xa, w, p, (t,), n0, n_out, out, tb)",
           "                t += 1"]
    scope = {"one": one, "two": two, "many": many}
    exec("\n".join(src), scope)  # noqa: S102
    return njit(inline="always")(scope["units"]), njit(inline="always")(scope["group"])


def units_kernel(kind: str):
    """f(xa, w, p0, n_out, out, u0, u1, c0): row 0 of xa times panels p0 + u0 .. p0 + u1 (decode),
    panel p0 + u's outputs written from column c0 + 32 u on (clipped at n_out)."""
    return _kernels(kind)[0]


def group_kernel(kind: str):
    """f(xa, w, p0, g, ta, tb, n_out, out, c0): rows ta .. tb times panels p0 + 2g, p0 + 2g + 1
    (prefill; those past the storage's end, or whose outputs all lie past n_out, skipped), written
    from column c0 + 64 g on (clipped at n_out)."""
    return _kernels(kind)[1]


@njit(cache=True, inline="always")
def int_element(w, p, b, e, j):
    """Element 32b + e of row 32p + j of a Q8_0 integer-mode storage as float32: q * d, the value
    `formats.dequant` gives it (the other types keep the native arrays: `qblocks.q_element`)."""
    r = e % 8
    return np.float32(w[1][p, b, 2 * (e // 8) + (r & 1), j, r >> 1]) * widen(w[2][p, b, j])
