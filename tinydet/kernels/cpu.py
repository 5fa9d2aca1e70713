"""CPU kernels (numba). Every rule of DETERMINISM.md holds here:

- a thread owns whole outputs (a panel of 64 matrix rows for a tile of tokens, a (token, head) pair, a
  token) and computes each completely; `prange` only splits outputs, never a sum;
- each reduction runs in one order fixed by its length alone;
- fastmath is off everywhere (no FMA contraction, no reassociation);
- transcendentals come from `mathfn` (or `v_exp32`, the same arithmetic lane by lane).

Compensated summation: the matrix products sum plain over 64-long k-blocks and add the block partials
with Kahan compensation (DETERMINISM.md: ~8x lower error than plain fp32 at ~0.83x its speed).
RMSNorm's sum of squares, attention's q.k dots, the softmax denominator and the weighted sum of V use
per-element Kahan compensation.

Weights are packed into panels `Wp[N/64, K, 64]` (zero-padded rows): the inner loop runs over 64
independent outputs. One matmul kernel serves a single token (decode) and many (prefill): each output's
arithmetic is identical in both, so prefill and decode logits are bit-identical.

Speed (SmolLM2-135M on 2 cores: decode at the memory bandwidth, prefill near the FPU's mul+add rate):
- The hot loops use explicit 64-lane float32 vectors (`_F32V`, an LLVM `<64 x float>`: four zmm
  registers on AVX-512, sixteen xmm on a generic x86-64), so running sums stay in registers. Every
  vector operation is the scalar IEEE operation lane by lane, with no fast-math flags: the vector width
  changes speed, never bits.
- fp16 values are widened by the CPU's F16C conversion where the compile target has it, else by the
  integer trick of `f16_to_f32`; both are exact, so both give the same bits.
- Matrix products: one token runs a 64-lane panel per k step (each thread an equal run of half
  panels, so 9 panels split 4.5 / 4.5 over two threads); several tokens run tiles of 4 tokens x 64
  lanes (16 accumulators), jobs being (panel, chunk of tiles). The residual add and SwiGLU are applied
  by the thread that computed the outputs, in the same region.
- Attention: keys are cached with 64 positions side by side (`rope_store`), so q.k runs 64 positions
  per vector; the weighted sum of V runs 64 dims per vector; exp runs 64 lanes at a time (`v_exp32`).
- `forward.forward_layers` runs every layer in one call with these kernels.

The vector kernels read raw pointers without bounds checks: callers pass C-contiguous arrays of the
documented shapes (`matmul` checks its arguments).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, models, overload, register_model

from . import mathfn
from .mathfn import exp32, sincos64

PANEL = 64  # outputs per panel
KBLOCK = 64  # k-block length of the block-Kahan sum
LANES = 64  # width of the vector type (= PANEL)
TILE = 4  # tokens sharing one pass over a panel's weights in prefill (bits do not depend on it)
CHUNK_TILES = 8  # token tiles per matmul job in prefill (bits do not depend on it)
ATILE = 64  # cache positions per tile of the transposed key cache

f32 = np.float32


@intrinsic
def _u32_as_f32(typingctx, x):
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def _f32_as_u32(typingctx, x):
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@njit(cache=True)
def f16_to_f32(h):
    """IEEE binary16 bits (uint16) -> float32, exactly, by integer widening (no F16C needed).

    The half's exponent and mantissa bits, shifted into float32 position, are the value times 2**-112
    (the bias difference), normal or subnormal alike; one exact multiply by 2**112 restores it. Only
    inf/NaN need their exponent forced to all ones. Branch-free, so the matmul loop vectorizes."""
    h = np.uint32(h)
    em = (h & np.uint32(0x7FFF)) << np.uint32(13)
    bits = _f32_as_u32(_u32_as_f32(em) * f32(5.192296858534828e33))
    if (h & np.uint32(0x7C00)) == np.uint32(0x7C00):
        bits = em | np.uint32(0x7F800000)
    return _u32_as_f32(bits | ((h & np.uint32(0x8000)) << np.uint32(16)))


@njit(cache=True)
def f32_to_f16(x):
    """float32 -> IEEE binary16 bits (uint16), round to nearest even (as NumPy's astype(float16))."""
    f = _f32_as_u32(f32(x))
    sign = f & np.uint32(0x80000000)
    f = f ^ sign
    if f >= np.uint32(143 << 23):  # >= 65536.0: inf, NaN, or overflow
        o = np.uint32(0x7E00) if f > np.uint32(0x7F800000) else np.uint32(0x7C00)
    elif f < np.uint32(113 << 23):  # result is subnormal or zero
        # Adding 0.5 aligns the half's subnormal LSB with float32's ULP: the float add rounds (RNE).
        magic = np.uint32(126 << 23)
        o = _f32_as_u32(_u32_as_f32(f) + _u32_as_f32(magic)) - magic
    else:
        mant_odd = (f >> np.uint32(13)) & np.uint32(1)
        f = f + np.uint32(((15 - 127) << 23) & 0xFFFFFFFF) + np.uint32(0xFFF) + mant_odd
        o = f >> np.uint32(13)
    return np.uint16(o | (sign >> np.uint32(16)))


def widen(v):
    """Storage element -> float32 (identity for float32, binary16 bits for uint16)."""


@overload(widen, inline="always")
def _widen(v):
    if v == types.float32:
        return lambda v: v
    if v == types.uint16:
        return lambda v: f16_to_f32(v)


def narrow(x, like):
    """float32 -> the storage type of `like`'s array (float32 or binary16 bits)."""


@overload(narrow, inline="always")
def _narrow(x, like):
    if like.dtype == types.float32:
        return lambda x, like: f32(x)
    if like.dtype == types.uint16:
        return lambda x, like: f32_to_f16(x)


@njit(cache=True)
def to_f16_bits(a):
    """float32 array -> binary16 bits, RNE; the one place weights are rounded to fp16."""
    flat = a.ravel()
    out = np.empty(flat.size, np.uint16)
    for i in range(flat.size):
        out[i] = f32_to_f16(flat[i])
    return out.reshape(a.shape)


@njit(cache=True)
def from_f16_bits(a):
    flat = a.ravel()
    out = np.empty(flat.size, np.float32)
    for i in range(flat.size):
        out[i] = f16_to_f32(flat[i])
    return out.reshape(a.shape)


# ---------------------------------------------------------------------------------------------------
# 64-lane (and 32-lane) float32 vector types and the operations the kernels need. Every operation is
# the IEEE operation lane by lane, with no fast-math flags: LLVM neither contracts nor reassociates.

_F = ir.FloatType()
_D = ir.DoubleType()
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_VF = ir.VectorType(_F, LANES)
_VD = ir.VectorType(_D, LANES)
_VI32 = ir.VectorType(_I32, LANES)
_VI64 = ir.VectorType(_I64, LANES)


class _F32VType(types.Type):
    def __init__(self, lanes):
        self.lanes = lanes
        super().__init__(name=f"tinydet.f32x{lanes}")


_F32V = _F32VType(LANES)
_F32V32 = _F32VType(LANES // 2)  # half a panel (decode splits one panel between two threads)


@register_model(_F32VType)
class _F32VModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, ir.VectorType(_F, fe_type.lanes))


def _splat(ty, value):
    return ir.Constant(ty, [ir.Constant(ty.element, value)] * ty.count)


def _ptr(context, builder, aty, aval, idx, idx_ty, elem_ty):
    """Pointer (as elem_ty*) to element `idx` (flat) of C-contiguous array aval."""
    ary = context.make_array(aty)(context, builder, aval)
    i = context.cast(builder, idx, idx_ty, types.intp)
    return builder.bitcast(builder.gep(ary.data, [i]), elem_ty.as_pointer())


def _c_array(a, *dtypes):
    return isinstance(a, types.Array) and a.layout == "C" and a.dtype in dtypes


def target_has(context, feature: str) -> bool:
    """Whether the compile target has a CPU feature ("f16c", "fma", "avx512f"). The features are part
    of numba's cache key, so a cached kernel always matches this choice; NUMBA_CPU_NAME=generic
    compiles with none of them."""
    feats = getattr(context.codegen(), "_tm_features", "") or ""
    return f"+{feature}" in feats.split(",")


def _target_has_f16c(context) -> bool:
    """Whether the target converts half -> float in hardware. A generic x86-64 target has no F16C and
    LLVM would lower `fpext half` there to a runtime call the JIT cannot resolve."""
    return target_has(context, "f16c")


def _widen_half_int(builder, h16):
    """<64 x i16> binary16 bits -> <64 x float> exactly, by `f16_to_f32`'s integer trick."""
    n = h16.type.count
    vi, vf = ir.VectorType(_I32, n), ir.VectorType(_F, n)
    h = builder.zext(h16, vi)
    em = builder.shl(builder.and_(h, _splat(vi, 0x7FFF)), _splat(vi, 13))
    bits = builder.bitcast(builder.fmul(builder.bitcast(em, vf), _splat(vf, 5.192296858534828e33)), vi)
    special = builder.icmp_unsigned("==", builder.and_(h, _splat(vi, 0x7C00)), _splat(vi, 0x7C00))
    bits = builder.select(special, builder.or_(em, _splat(vi, 0x7F800000)), bits)
    sign = builder.shl(builder.and_(h, _splat(vi, 0x8000)), _splat(vi, 16))
    return builder.bitcast(builder.or_(bits, sign), vf)


def _widen_half(context, builder, h16):
    if _target_has_f16c(context):
        n = h16.type.count
        return builder.fpext(builder.bitcast(h16, ir.VectorType(ir.HalfType(), n)), ir.VectorType(_F, n))  # exact
    return _widen_half_int(builder, h16)


def _vec_ops(vt):
    """zero, splat and load intrinsics for the vector type vt."""
    vf = ir.VectorType(_F, vt.lanes)
    vh = ir.VectorType(_I16, vt.lanes)

    @intrinsic
    def zero(typingctx):
        def codegen(context, builder, sig, args):
            return _splat(vf, 0.0)

        return vt(), codegen

    @intrinsic
    def splat(typingctx, x):
        if x != types.float32:
            return None

        def codegen(context, builder, sig, args):
            v = builder.insert_element(ir.Constant(vf, ir.Undefined), args[0], ir.Constant(_I32, 0))
            return builder.shuffle_vector(v, ir.Constant(vf, ir.Undefined),
                                          ir.Constant(ir.VectorType(_I32, vt.lanes), [0] * vt.lanes))

        return vt(types.float32), codegen

    @intrinsic
    def load(typingctx, arr, idx):
        if not (_c_array(arr, types.float32, types.uint16) and isinstance(idx, types.Integer)):
            return None
        half = arr.dtype == types.uint16

        def codegen(context, builder, sig, args):
            if half:
                p = _ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], vh)
                return _widen_half(context, builder, builder.load(p, align=2))
            p = _ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], vf)
            return builder.load(p, align=4)

        return vt(arr, idx), codegen

    return zero, splat, load


# v_zero(), v_splat(x): 64 lanes of 0 / of x; v_load(arr, idx): arr[idx : idx + 64] as float32 (flat
# index into a C-contiguous array; float32 as stored, binary16 bits widened exactly). v32_*: 32 lanes.
v_zero, v_splat, v_load = _vec_ops(_F32V)
v32_zero, v32_splat, v32_load = _vec_ops(_F32V32)


def _binop(name):
    def impl(typingctx, a, b):
        if not (isinstance(a, _F32VType) and a == b):
            return None

        def codegen(context, builder, sig, args):
            return getattr(builder, name)(args[0], args[1])  # plain IEEE op, no fast-math flags

        return a(a, b), codegen

    impl.__name__ = f"v_{name}"
    return intrinsic(impl)


v_add = _binop("fadd")
v_sub = _binop("fsub")
v_mul = _binop("fmul")
v_div = _binop("fdiv")


@intrinsic
def v_store(typingctx, arr, idx, v):
    """arr[idx : idx + lanes] = v (C-contiguous float32, flat index)."""
    if not (_c_array(arr, types.float32) and isinstance(idx, types.Integer) and isinstance(v, _F32VType)):
        return None

    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], ir.VectorType(_F, v.lanes))
        builder.store(args[2], p, align=4)
        return context.get_dummy_value()

    return types.none(arr, idx, v), codegen


@intrinsic
def v_get(typingctx, v, i):
    """Lane i of v."""
    if not (isinstance(v, _F32VType) and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.extract_element(args[0], context.cast(builder, args[1], sig.args[1], types.int32))

    return types.float32(v, i), codegen


@intrinsic
def at(typingctx, arr, idx):
    """arr[idx] (flat index into a C-contiguous float32 array, no bounds or sign checks)."""
    if not (_c_array(arr, types.float32) and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], _F), align=4)

    return types.float32(arr, idx), codegen


def _splat_i64(builder, v):
    return builder.shuffle_vector(builder.insert_element(ir.Constant(_VI64, ir.Undefined), v, ir.Constant(_I32, 0)),
                                  ir.Constant(_VI64, ir.Undefined), ir.Constant(_VI32, [0] * LANES))


@intrinsic
def v_gather(typingctx, arr, base, stride, n):
    """Lane j: arr[base + min(j, n - 1) * stride] (flat, C-contiguous float32): a column of up to 64
    rows, the last row repeated in the lanes past n."""
    if not (_c_array(arr, types.float32) and all(isinstance(a, types.Integer) for a in (base, stride, n))):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        b, st, nn = (context.cast(builder, a, t, types.int64) for a, t in zip(args[1:], sig.args[1:]))
        lane = ir.Constant(_VI64, list(range(LANES)))
        last = _splat_i64(builder, builder.sub(nn, ir.Constant(_I64, 1)))
        j = builder.select(builder.icmp_signed("<", lane, last), lane, last)
        off = builder.add(builder.mul(j, _splat_i64(builder, st)), _splat_i64(builder, b))
        addr = builder.add(_splat_i64(builder, builder.ptrtoint(ary.data, _I64)), builder.shl(off, _splat(_VI64, 2)))
        pty = ir.VectorType(_F.as_pointer(), LANES)
        mask_ty = ir.VectorType(ir.IntType(1), LANES)
        fnty = ir.FunctionType(_VF, [pty, _I32, mask_ty, _VF])
        fn = cgutils.get_or_insert_function(builder.module, fnty, f"llvm.masked.gather.v{LANES}f32.v{LANES}p0")
        return builder.call(fn, [builder.inttoptr(addr, pty), ir.Constant(_I32, 4), ir.Constant(mask_ty, [1] * LANES),
                                 ir.Constant(_VF, ir.Undefined)])

    return _F32V(arr, base, stride, n), codegen


@intrinsic
def v_sqrt(typingctx, v):
    """Correctly rounded square root lane by lane (as np.sqrt on a float32)."""
    if v != _F32V:
        return None

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF]), f"llvm.sqrt.v{LANES}f32")
        return builder.call(fn, [args[0]])

    return _F32V(v), codegen


@intrinsic
def v_neg(typingctx, v):
    """-v as numba negates a float: -0.0 - v."""
    if v != _F32V:
        return None

    def codegen(context, builder, sig, args):
        return builder.fsub(_splat(_VF, -0.0), args[0])

    return _F32V(v), codegen


@intrinsic
def v_max_first(typingctx, m, s, n):
    """Lanes j < n: s if s > m else m (the `if s > m: m = s` of a running max); lanes >= n keep m."""
    if not (m == _F32V and s == _F32V and isinstance(n, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        nn = builder.trunc(context.cast(builder, args[2], sig.args[2], types.int64), _I32)
        lane = ir.Constant(_VI32, list(range(LANES)))
        nv = builder.shuffle_vector(builder.insert_element(ir.Constant(_VI32, ir.Undefined), nn,
                                                           ir.Constant(_I32, 0)),
                                    ir.Constant(_VI32, ir.Undefined), ir.Constant(_VI32, [0] * LANES))
        valid = builder.icmp_signed("<", lane, nv)
        gt = builder.fcmp_ordered(">", args[1], args[0])
        return builder.select(builder.and_(valid, gt), args[1], args[0])

    return _F32V(m, s, n), codegen


def _dconst(x):
    return _splat(_VD, float(x))


def _exp64_lanes(builder, x):
    """mathfn.exp64 lane by lane on <64 x double> x (see v_exp32 for the range handling)."""
    nan = builder.fcmp_unordered("uno", x, x)
    xc = builder.select(builder.fcmp_ordered("<", x, _dconst(-708.0)), _dconst(-708.0), x)
    xc = builder.select(builder.fcmp_ordered(">", xc, _dconst(709.0)), _dconst(709.0), xc)
    xc = builder.select(nan, _dconst(0.0), xc)
    floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VD, [_VD]), f"llvm.floor.v{LANES}f64")
    k = builder.call(floor, [builder.fadd(builder.fmul(xc, _dconst(mathfn.INV_LN2)), _dconst(0.5))])
    r = builder.fsub(builder.fsub(xc, builder.fmul(k, _dconst(mathfn.LN2_HI))),
                     builder.fmul(k, _dconst(mathfn.LN2_LO)))
    p = _dconst(mathfn.E13)
    for c in (mathfn.E12, mathfn.E11, mathfn.E10, mathfn.E9, mathfn.E8, mathfn.E7, mathfn.E6, mathfn.E5,
              mathfn.E4, mathfn.E3, mathfn.E2, mathfn.E1, mathfn.E0):
        p = builder.fadd(builder.fmul(p, r), _dconst(c))
    ki = builder.fptosi(k, _VI64)
    scale = builder.bitcast(builder.shl(builder.add(ki, _splat(_VI64, 1023)), _splat(_VI64, 52)), _VD)
    return builder.fptrunc(builder.select(nan, x, builder.fmul(p, scale)), _VF)


@intrinsic
def v_exp32(typingctx, v):
    """mathfn.exp32 lane by lane: the float64 operations of exp64 (range reduction, degree-13 Horner
    polynomial, exact scaling by 2**k), rounded once to float32.

    Inputs are clamped to [-708, 709] first: there 2**k is a normal double and the scaling is one exact
    multiply, as ldexp's; outside it exp64's result rounds to float32 0 or inf either way, and the clamped
    input gives the same 0 (exp(-708) < 2**-150) or inf (exp(709) > float32 max). NaN gives NaN as exp64
    does (its own payload, rounded to float32)."""
    if v != _F32V:
        return None

    def codegen(context, builder, sig, args):
        return _exp64_lanes(builder, builder.fpext(args[0], _VD))

    return _F32V(v), codegen


@intrinsic
def v_exp32_sub(typingctx, v, m):
    """exp32(v - m) lane by lane with m float64 and the difference taken in float64, as the scalar
    `exp32(scores[i] - m)` does when m is a float64 running max."""
    if not (v == _F32V and m == types.float64):
        return None

    def codegen(context, builder, sig, args):
        mv = builder.shuffle_vector(builder.insert_element(ir.Constant(_VD, ir.Undefined), args[1],
                                                           ir.Constant(_I32, 0)),
                                    ir.Constant(_VD, ir.Undefined), ir.Constant(_VI32, [0] * LANES))
        return _exp64_lanes(builder, builder.fsub(builder.fpext(args[0], _VD), mv))

    return _F32V(v, m), codegen


# ---------------------------------------------------------------------------------------------------
# Matrix products. Per output (t, n): s = c = 0; for each k-block [k0, k0 + 64): part = 0, then
# part = part + W[n, k] * x[t, k] for k in order; then y = part - c; z = s + y; c = (z - s) - y; s = z.
# The tiles below run that sequence for 64 outputs (one panel, or half of one) and 1 or 4 tokens at
# once (four tokens: 16 zmm accumulators, measured faster here than 5 to 8).

@njit(cache=True, inline="always")
def _kahan(part, s, c):
    """One block partial into the compensated sum: returns (s, c)."""
    y = v_sub(part, c)
    z = v_add(s, y)
    return z, v_sub(v_sub(z, s), y)


@njit(cache=True, inline="always")
def _put(out, t, n0, n_out, v):
    """out[t, n0 : n0 + 64] = v, clipped at n_out (out C-contiguous float32)."""
    if n0 + LANES <= n_out:
        v_store(out, t * out.shape[1] + n0, v)
    else:
        for j in range(n_out - n0):
            out[t, n0 + j] = v_get(v, j)


@njit(cache=True, inline="always")
def _dot1(x, r0, K, wp, wo):
    """Panel at wp[wo:] times row x[r0 : r0 + K] (flat offsets)."""
    s0 = v_zero()
    c0 = v_zero()
    for k0 in range(0, K, KBLOCK):
        k1 = min(K, k0 + KBLOCK)
        a0 = v_zero()
        for k in range(k0, k1):
            a0 = v_add(a0, v_mul(v_load(wp, wo + k * LANES), v_splat(at(x, r0 + k))))
        s0, c0 = _kahan(a0, s0, c0)
    return s0


@njit(cache=True, inline="always")
def _dot1_half(x, r0, K, wp, wo):
    """_dot1 for 32 lanes: the half panel whose lanes start at wp[wo:] (row stride 64)."""
    s0 = v32_zero()
    c0 = v32_zero()
    for k0 in range(0, K, KBLOCK):
        k1 = min(K, k0 + KBLOCK)
        a0 = v32_zero()
        for k in range(k0, k1):
            a0 = v_add(a0, v_mul(v32_load(wp, wo + k * LANES), v32_splat(at(x, r0 + k))))
        s0, c0 = _kahan(a0, s0, c0)
    return s0


@njit(cache=True, inline="always")
def _put_half(out, t, n0, n_out, v):
    if n0 + LANES // 2 <= n_out:
        v_store(out, t * out.shape[1] + n0, v)
    else:
        for j in range(max(0, n_out - n0)):
            out[t, n0 + j] = v_get(v, j)


@njit(cache=True, inline="always")
def _gemv_units(x, wp, n_out, out, u0, u1):
    """Token 0 times half-panel units u0 .. u1 - 1 (unit u: lanes 32 (u % 2) .. of panel u // 2); two
    halves of one panel in the range run as one panel. Decode gives each thread an equal run of units,
    so a panel count that does not split evenly is balanced by halving one panel."""
    K = x.shape[1]
    u = u0
    while u < u1:
        p = u // 2
        if u % 2 == 0 and u + 2 <= u1:
            _put(out, 0, p * LANES, n_out, _dot1(x, 0, K, wp, p * K * LANES))
            u += 2
        else:
            hoff = (u % 2) * (LANES // 2)
            _put_half(out, 0, p * LANES + hoff, n_out, _dot1_half(x, 0, K, wp, p * K * LANES + hoff))
            u += 1


@njit(cache=True, inline="always")
def _dot4(x, r0, r1, r2, r3, K, wp, wo):
    s0 = v_zero()
    c0 = v_zero()
    s1 = v_zero()
    c1 = v_zero()
    s2 = v_zero()
    c2 = v_zero()
    s3 = v_zero()
    c3 = v_zero()
    for k0 in range(0, K, KBLOCK):
        k1 = min(K, k0 + KBLOCK)
        a0 = v_zero()
        a1 = v_zero()
        a2 = v_zero()
        a3 = v_zero()
        for k in range(k0, k1):
            w = v_load(wp, wo + k * LANES)
            a0 = v_add(a0, v_mul(w, v_splat(at(x, r0 + k))))
            a1 = v_add(a1, v_mul(w, v_splat(at(x, r1 + k))))
            a2 = v_add(a2, v_mul(w, v_splat(at(x, r2 + k))))
            a3 = v_add(a3, v_mul(w, v_splat(at(x, r3 + k))))
        s0, c0 = _kahan(a0, s0, c0)
        s1, c1 = _kahan(a1, s1, c1)
        s2, c2 = _kahan(a2, s2, c2)
        s3, c3 = _kahan(a3, s3, c3)
    return s0, s1, s2, s3


@njit(cache=True, inline="always")
def _panel(x, wp, p, ta, tb, out, n_out):
    """out[ta:tb, 64p : 64p + 64] (clipped at n_out) = x[ta:tb] times panel p."""
    K = x.shape[1]
    wo = p * K * LANES
    n0 = p * LANES
    for t in range(ta, tb, TILE):
        # past tb the last row is repeated: computed, never stored
        r1 = min(t + 1, tb - 1)
        r2 = min(t + 2, tb - 1)
        r3 = min(t + 3, tb - 1)
        s0, s1, s2, s3 = _dot4(x, t * K, r1 * K, r2 * K, r3 * K, K, wp, wo)
        _put(out, t, n0, n_out, s0)
        if t + 1 < tb:
            _put(out, t + 1, n0, n_out, s1)
        if t + 2 < tb:
            _put(out, t + 2, n0, n_out, s2)
        if t + 3 < tb:
            _put(out, t + 3, n0, n_out, s3)


@njit(cache=True)
def split_chunks(T, P, nth, tile, chunk_tiles):
    """Token chunks per column of P jobs (panels) for T tokens in tiles of `tile`: about `chunk_tiles`
    tiles each and, where it is cheap, a job count the nth threads share evenly. Only the split of
    work depends on it, never any output's arithmetic."""
    if T == 1:
        return 1
    n_tiles = (T + tile - 1) // tile
    c = (n_tiles + chunk_tiles - 1) // chunk_tiles
    for extra in range(nth):
        if c + extra <= n_tiles and ((c + extra) * P) % nth == 0:
            return c + extra
    return c


@njit(cache=True, inline="always")
def chunk_range(T, C, c, tile):
    """Tokens [ta, tb) of chunk c of C (whole tiles but the last)."""
    n_tiles = (T + tile - 1) // tile
    return (c * n_tiles // C) * tile, min(T, ((c + 1) * n_tiles // C) * tile)


@njit(cache=True, inline="always")
def _swiglu_span(gu, t, ffn_dim, act, n0, n1):
    """act[t, n] = silu(gate) * up = (g / (1 + exp32(-g))) * u for n0 <= n < n1 (gu: [gate | up])."""
    one = v_splat(f32(1.0))
    n = n0
    while n + LANES <= n1:
        g = v_load(gu, t * 2 * ffn_dim + n)
        u = v_load(gu, t * 2 * ffn_dim + ffn_dim + n)
        v_store(act, t * ffn_dim + n, v_mul(v_div(g, v_add(one, v_exp32(v_neg(g)))), u))
        n += LANES
    for i in range(n, n1):
        g = gu[t, i]
        act[t, i] = (g / (f32(1.0) + exp32(-g))) * gu[t, ffn_dim + i]


MM_PLAIN, MM_RESIDUAL, MM_SWIGLU = 0, 1, 2


@njit(parallel=True, cache=True)
def _mm(x, wp, n_out, out, nth, mode, res, act):
    """out = x W^T, and then by `mode`:
    MM_PLAIN     nothing more;
    MM_RESIDUAL  res += out (each output added by the thread that computed it);
    MM_SWIGLU    out holds [gate | up] (n_out = 2 ffn_dim, ffn_dim % 64 == 0): act = silu(gate) * up;
                 a job computes gate and up of the same outputs and then their activation.

    One token (decode): each of the nth threads takes an equal run of half panels. More tokens: jobs
    of (panel, chunk of token tiles). Neither enters any output's arithmetic."""
    T = x.shape[0]
    P = wp.shape[0]
    parts = 2 if mode == MM_SWIGLU else 1
    Pj = P // parts  # panels per part; a swiglu job covers panel p of the gate and of the up part
    ffn_dim = n_out // 2
    if T == 1:
        U = 2 * Pj
        for th in prange(nth):
            u0 = th * U // nth
            u1 = (th + 1) * U // nth
            for part in range(parts):
                _gemv_units(x, wp, n_out, out, u0 + part * U, u1 + part * U)
            n0 = u0 * (LANES // 2)
            n1 = u1 * (LANES // 2)
            if mode == MM_RESIDUAL:
                for j in range(n0, min(n_out, n1)):
                    res[0, j] = res[0, j] + out[0, j]
            elif mode == MM_SWIGLU:
                _swiglu_span(out, 0, ffn_dim, act, n0, n1)
    else:
        C = split_chunks(T, Pj, nth, TILE, CHUNK_TILES)
        for job in prange(Pj * C):
            p = job // C
            ta, tb = chunk_range(T, C, job % C, TILE)
            for part in range(parts):
                _panel(x, wp, p + part * Pj, ta, tb, out, n_out)
            n0 = p * LANES
            if mode == MM_RESIDUAL:
                for t in range(ta, tb):
                    for j in range(n0, min(n_out, n0 + LANES)):
                        res[t, j] = res[t, j] + out[t, j]
            elif mode == MM_SWIGLU:
                for t in range(ta, tb):
                    _swiglu_span(out, t, ffn_dim, act, n0, n0 + LANES)


def _check_mm(x, wp, n_out, out):
    if not (isinstance(x, np.ndarray) and x.dtype == np.float32 and x.ndim == 2 and x.flags.c_contiguous):
        raise TypeError("matmul: x must be a C-contiguous float32 (T, K) array")
    if not (isinstance(out, np.ndarray) and out.dtype == np.float32 and out.ndim == 2 and out.flags.c_contiguous):
        raise TypeError("matmul: out must be a C-contiguous float32 (T, n_out) array")
    if not (isinstance(wp, np.ndarray) and wp.dtype in (np.float32, np.uint16) and wp.ndim == 3
            and wp.shape[2] == PANEL and wp.flags.c_contiguous):
        raise TypeError("matmul: wp must be C-contiguous panels (P, K, 64) of float32 or uint16")
    T, K = x.shape
    if wp.shape[1] != K or out.shape[0] != T or not 0 < n_out <= min(out.shape[1], wp.shape[0] * PANEL):
        raise ValueError(f"matmul: x {x.shape}, wp {wp.shape}, n_out {n_out}, out {out.shape} do not fit")


def matmul(x, wp, n_out, out):
    """out[t, n] = sum_k x[t, k] * W[n, k] for panel-packed wp[P, K, 64] (float32 or fp16 bits).

    Per output: plain float32 sums over k-blocks [0,64), [64,128), ... in k order, the block partials
    added in block order with Kahan compensation. Neither the token tile nor the thread count enters
    the arithmetic of any output."""
    _check_mm(x, wp, n_out, out)
    if x.shape[0]:
        _mm(x, wp, n_out, out, numba.get_num_threads(), MM_PLAIN, out, out)


# ---------------------------------------------------------------------------------------------------
# The other operations. Each has one serial body per output (a row, a (token, head) pair); with one
# token it runs on the calling thread, with more the rows are split over threads.

@njit(cache=True, inline="always")
def _rms_row(x, t, w, eps, out):
    D = x.shape[1]
    s = f32(0.0)
    c = f32(0.0)
    for i in range(D):
        y = x[t, i] * x[t, i] - c
        z = s + y
        c = (z - s) - y
        s = z
    inv = f32(1.0) / np.sqrt(s / f32(D) + eps)
    for i in range(D):
        out[t, i] = (x[t, i] * inv) * w[i]


@njit(cache=True, inline="always")
def _rms_tile(x, t0, nt, w, eps, out):
    """_rms_row for rows t0 .. t0 + nt - 1 (nt <= 64) at once, one row per lane."""
    D = x.shape[1]
    s = v_zero()
    c = v_zero()
    for i in range(D):
        xv = v_gather(x, t0 * D + i, D, nt)
        y = v_sub(v_mul(xv, xv), c)
        z = v_add(s, y)
        c = v_sub(v_sub(z, s), y)
        s = z
    inv = v_div(v_splat(f32(1.0)), v_sqrt(v_add(v_div(s, v_splat(f32(D))), v_splat(eps))))
    for r in range(nt):
        iv = v_get(inv, r)
        for i in range(D):
            out[t0 + r, i] = (x[t0 + r, i] * iv) * w[i]


@njit(parallel=True, cache=True)
def _rmsnorm_rows(x, w, eps, out):
    T = x.shape[0]
    n = (T + LANES - 1) // LANES
    n = max(n, min(T, 2 * ((n + 1) // 2)))  # an even job count where it costs nothing (two cores)
    for j in prange(n):
        t0 = j * T // n
        _rms_tile(x, t0, (j + 1) * T // n - t0, w, eps, out)


@njit(cache=True)
def rmsnorm(x, w, eps, out):
    """out[t] = x[t] / sqrt(mean(x[t]**2) + eps) * w. Sum of squares: Kahan, in index order."""
    if x.shape[0] == 1:
        _rms_row(x, 0, w, eps, out)
    else:
        _rmsnorm_rows(x, w, eps, out)


@njit(cache=True, inline="always")
def _rope_row(qkv, t, q_dim, kv_dim, head_dim, cos, sin, pos, slot, k_cache, v_cache, q_out):
    half = head_dim // 2
    n_q = q_dim // head_dim
    n_kv = kv_dim // head_dim
    p = pos[t]
    s = slot[t]
    pt = p // ATILE
    pl = p % ATILE
    for h in range(n_q + n_kv):
        base = h * head_dim
        for i in range(half):
            x0 = qkv[t, base + i]
            x1 = qkv[t, base + i + half]
            cs = cos[p, i]
            sn = sin[p, i]
            r0 = x0 * cs - x1 * sn
            r1 = x1 * cs + x0 * sn
            if h < n_q:
                q_out[t, base + i] = r0
                q_out[t, base + i + half] = r1
            else:
                g = h - n_q
                k_cache[s, g, pt, i, pl] = narrow(r0, k_cache)
                k_cache[s, g, pt, i + half, pl] = narrow(r1, k_cache)
    for i in range(kv_dim):
        v_cache[s, p, i] = narrow(qkv[t, q_dim + kv_dim + i], v_cache)


@njit(parallel=True, cache=True)
def _rope_rows(qkv, q_dim, kv_dim, head_dim, cos, sin, pos, slot, k_cache, v_cache, q_out):
    for t in prange(qkv.shape[0]):
        _rope_row(qkv, t, q_dim, kv_dim, head_dim, cos, sin, pos, slot, k_cache, v_cache, q_out)


@njit(cache=True)
def rope_store(qkv, q_dim, kv_dim, head_dim, cos, sin, pos, slot, k_cache, v_cache, q_out):
    """Rotate q and k of each row t (position pos[t] of sequence slot[t]; HF half-split layout: pairs
    (i, i + hd/2)), write q to q_out and k, v into the layer's cache, rounded there once if the cache
    is fp16. Keys go to k_cache[slot, kv_head, pos // 64, d, pos % 64] (positions along the vector
    lanes, for attention's dot products), values to v_cache[slot, pos, kv_dim]."""
    if qkv.shape[0] == 1:
        _rope_row(qkv, 0, q_dim, kv_dim, head_dim, cos, sin, pos, slot, k_cache, v_cache, q_out)
    else:
        _rope_rows(qkv, q_dim, kv_dim, head_dim, cos, sin, pos, slot, k_cache, v_cache, q_out)


@njit(cache=True, inline="always")
def _attend(q, k_cache, v_cache, pos, slot, n_heads, n_kv_heads, head_dim, scale, out, t, h, scores):
    """Row t, head h: scores over positions 0..pos[t] of sequence slot[t], softmax, weighted sum of V.

    q.k: per position, Kahan over d in order (64 positions at a time, one per lane). The running max
    is a float64 holding a float32 (as the scalar `m = -np.inf; if s > m: m = s`), and exp32 takes
    the float64 difference. The denominator is a Kahan sum over positions in order; the weighted sum
    of V a Kahan sum over positions in order per d (64 d at a time, one per lane, where head_dim
    allows)."""
    group = n_heads // n_kv_heads
    sl = slot[t]
    n = pos[t] + 1
    qo = h * head_dim
    g = h // group
    kt = k_cache.shape[2]
    nt = (n + ATILE - 1) // ATILE
    kbase = (sl * n_kv_heads + g) * kt * head_dim * ATILE
    vscale = v_splat(scale)
    mv = v_splat(f32(-np.inf))
    for j in range(nt):
        s = v_zero()
        c = v_zero()
        kb = kbase + j * head_dim * ATILE
        for d in range(head_dim):
            y = v_sub(v_mul(v_splat(q[t, qo + d]), v_load(k_cache, kb + d * ATILE)), c)
            z = v_add(s, y)
            c = v_sub(v_sub(z, s), y)
            s = z
        s = v_mul(s, vscale)
        v_store(scores, j * ATILE, s)
        mv = v_max_first(mv, s, n - j * ATILE)
    m = -np.inf
    for i in range(LANES):
        e = v_get(mv, i)
        if e > m:
            m = e
    for j in range(nt):
        v_store(scores, j * ATILE, v_exp32_sub(v_load(scores, j * ATILE), m))
    vo = g * head_dim
    vrow = v_cache.shape[2]
    vbase = sl * v_cache.shape[1] * vrow
    den = f32(0.0)
    dc = f32(0.0)
    if head_dim % LANES == 0:
        # the denominator's sum rides along with the first 64 dims' weighted sum (independent chains)
        acc = v_zero()
        cmp = v_zero()
        for i in range(n):
            e = scores[i]
            y = e - dc
            z = den + y
            dc = (z - den) - y
            den = z
            yv = v_sub(v_mul(v_splat(e), v_load(v_cache, vbase + i * vrow + vo)), cmp)
            zv = v_add(acc, yv)
            cmp = v_sub(v_sub(zv, acc), yv)
            acc = zv
        v_store(out, t * out.shape[1] + qo, v_div(acc, v_splat(den)))
        for d0 in range(LANES, head_dim, LANES):
            acc = v_zero()
            cmp = v_zero()
            for i in range(n):
                y = v_sub(v_mul(v_splat(scores[i]), v_load(v_cache, vbase + i * vrow + vo + d0)), cmp)
                z = v_add(acc, y)
                cmp = v_sub(v_sub(z, acc), y)
                acc = z
            v_store(out, t * out.shape[1] + qo + d0, v_div(acc, v_splat(den)))
    else:
        for i in range(n):
            e = scores[i]
            y = e - dc
            z = den + y
            dc = (z - den) - y
            den = z
        acc1 = np.zeros(head_dim, np.float32)
        cmp1 = np.zeros(head_dim, np.float32)
        for i in range(n):
            p = scores[i]
            for d in range(head_dim):
                y = p * widen(v_cache[sl, i, vo + d]) - cmp1[d]
                z = acc1[d] + y
                cmp1[d] = (z - acc1[d]) - y
                acc1[d] = z
        for d in range(head_dim):
            out[t, qo + d] = acc1[d] / den


@njit(parallel=True, cache=True)
def _attention_par(q, k_cache, v_cache, pos, slot, n_heads, n_kv_heads, head_dim, scale, out):
    T = q.shape[0]
    cap = k_cache.shape[2] * ATILE
    for job in prange(T * n_heads):
        # rows taken from both ends in turn (0, T-1, 1, T-2, ...): in a prompt, later rows attend to
        # more positions, and this keeps contiguous runs of jobs equally costly
        i = job // n_heads
        t = i // 2 if i % 2 == 0 else T - 1 - i // 2
        scores = np.empty(cap, np.float32)
        _attend(q, k_cache, v_cache, pos, slot, n_heads, n_kv_heads, head_dim, scale, out, t, job % n_heads,
                scores)


@njit(cache=True)
def attention(q, k_cache, v_cache, pos, slot, n_heads, n_kv_heads, head_dim, scale, out):
    """Causal grouped-query attention: row t attends to positions 0..pos[t] of sequence slot[t].

    One (row, head) pair per work item; scores, softmax and the weighted sum of V run over cache
    positions in order, so a row's result depends neither on how its prompt was chunked nor on
    which other sequences share the batch."""
    _attention_par(q, k_cache, v_cache, pos, slot, n_heads, n_kv_heads, head_dim, scale, out)


@njit(cache=True, inline="always")
def _swiglu_row(gu, t, ffn_dim, out):
    for i in range(ffn_dim):
        g = gu[t, i]
        out[t, i] = (g / (f32(1.0) + exp32(-g))) * gu[t, ffn_dim + i]


@njit(parallel=True, cache=True)
def _swiglu_rows(gu, ffn_dim, out):
    for t in prange(gu.shape[0]):
        _swiglu_row(gu, t, ffn_dim, out)


@njit(cache=True)
def swiglu(gu, ffn_dim, out):
    """out = silu(gate) * up, silu(g) = g / (1 + e**-g); gu holds [gate | up] per token."""
    if gu.shape[0] == 1:
        _swiglu_row(gu, 0, ffn_dim, out)
    else:
        _swiglu_rows(gu, ffn_dim, out)


@njit(cache=True)
def add_inplace(x, y):
    T, D = x.shape
    for t in range(T):
        for i in range(D):
            x[t, i] = x[t, i] + y[t, i]


@njit(cache=True)
def embed(table, ids, out):
    """out[t] = table[ids[t]] widened to float32 (exact)."""
    for t in range(ids.shape[0]):
        row = ids[t]
        for i in range(out.shape[1]):
            out[t, i] = widen(table[row, i])


@njit(cache=True)
def embed_panels(wp, ids, out):
    """out[t] = row ids[t] of the panel-packed matrix wp[P, K, 64] widened to float32 (exact): a tied
    output matrix serves as the embedding table too."""
    for t in range(ids.shape[0]):
        p = ids[t] // PANEL
        j = ids[t] % PANEL
        for i in range(out.shape[1]):
            out[t, i] = widen(wp[p, i, j])


@njit(cache=True)
def widen_rows(cache, slots, pos):
    """The cached keys at (slots[t], pos[t]) as float32 rows of kv_dim (for tracing what the cache
    holds), from a key cache (slot, kv_head, pos // 64, head_dim, pos % 64)."""
    hd = cache.shape[3]
    out = np.empty((pos.shape[0], cache.shape[1] * hd), np.float32)
    for t in range(pos.shape[0]):
        for g in range(cache.shape[1]):
            for d in range(hd):
                out[t, g * hd + d] = widen(cache[slots[t], g, pos[t] // ATILE, d, pos[t] % ATILE])
    return out


@njit(cache=True)
def rope_tables(n_pos, inv_freq, cos, sin):
    """cos/sin[pos, i] of pos * inv_freq[i], in float64 with tinydet's own sincos, rounded once."""
    for p in range(n_pos):
        for i in range(inv_freq.shape[0]):
            s, c = sincos64(np.float64(p) * inv_freq[i])
            cos[p, i] = np.float32(c)
            sin[p, i] = np.float32(s)


def aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on an `align`-byte boundary."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    buf = np.empty(n + align, np.uint8)
    off = (-buf.ctypes.data) % align
    return buf[off:off + n].view(dtype).reshape(shape)


def pack_panels(w: np.ndarray) -> np.ndarray:
    """W[N, K] -> Wp[ceil(N/64), K, 64], rows past N zero. Layout only: no arithmetic."""
    n, k = w.shape
    p = -(-n // PANEL)
    padded = np.zeros((p * PANEL, k), w.dtype)
    padded[:n] = w
    out = aligned_empty((p, k, PANEL), w.dtype)
    out[...] = padded.reshape(p, PANEL, k).transpose(0, 2, 1)
    return out
