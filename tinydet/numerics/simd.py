"""The one vector layer of tinydet's numba kernels (the CPU backend's, log-probabilities'): float32
vectors of 64 lanes (a panel's width) and 32 (half of one; a quantized panel), fp16 widening and
narrowing, and the compensated-sum step.

Every vector operation is the scalar IEEE operation lane by lane, with no fast-math flags, so LLVM
neither contracts nor reassociates: the vector width changes speed, never bits. An LLVM `<64 x float>`
is four zmm registers on AVX-512, eight ymm on AVX2 and sixteen xmm on a generic x86-64; running sums
stay in registers, where auto-vectorized loops kept them in memory.

fp16 values are widened by the CPU's F16C conversion where the compile target has it, else by the
integer trick of `f16_to_f32`; both are exact, so both give the same bits. (A generic x86-64 target
has no F16C and LLVM would lower `fpext half` there to a runtime call the JIT cannot resolve.)

The loads and stores read raw pointers without bounds checks: callers pass C-contiguous arrays.
`vmath.py` has mathfn's functions lane by lane.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, models, overload, register_model


LANES = 64  # the vector width: outputs per float panel
HALF = LANES // 2  # outputs per half panel (decode balance) and per quantized panel
KBLOCK = 64  # k-block length of the block-Kahan sum of every matrix product

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
# Vector types and operations.

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
_F32V32 = _F32VType(HALF)


@register_model(_F32VType)
class _F32VModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, ir.VectorType(_F, fe_type.lanes))


def _splat(ty, value):
    return ir.Constant(ty, [ir.Constant(ty.element, value)] * ty.count)


def broadcast(builder, ty, x):
    """The vector of type `ty` with every lane the scalar value x (LLVM's splat idiom: insert into
    lane 0, then shuffle lane 0 everywhere)."""
    v = builder.insert_element(ir.Constant(ty, ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(ty, ir.Undefined), ir.Constant(ir.VectorType(_I32, ty.count),
                                                                                [0] * ty.count))


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


def target_isa() -> str:
    """The vector unit of the CPU numba compiles for: "avx512" (32 zmm registers), "avx2" (16 ymm) or
    "sse" (16 xmm: a generic x86-64, or any other CPU). Only tile shapes depend on it, never bits."""
    from numba.core.registry import cpu_target

    ctx = cpu_target.target_context
    if target_has(ctx, "avx512f"):
        return "avx512"
    return "avx2" if target_has(ctx, "avx2") else "sse"


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
    if target_has(context, "f16c"):  # exact either way
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
            return broadcast(builder, vf, args[0])

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
# index into a C-contiguous array; float32 as stored, binary16 bits widened exactly). v32_*: 32 lanes,
# v16_*: 16. v_add, v_sub, v_mul, v_div, v_store and v_get take any width.
v_zero, v_splat, v_load = _vec_ops(_F32V)
v32_zero, v32_splat, v32_load = _vec_ops(_F32V32)
_F32V16 = _F32VType(16)
v16_zero, v16_splat, v16_load = _vec_ops(_F32V16)
VECTORS = {64: (v_zero, v_splat, v_load), 32: (v32_zero, v32_splat, v32_load), 16: (v16_zero, v16_splat, v16_load)}


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
def prefetch(typingctx, arr, idx):
    """A hint to bring the cache line of arr[idx] (flat, C-contiguous) toward the core, to be read
    soon (llvm.prefetch); it changes no value and faults on no address."""
    if not (isinstance(arr, types.Array) and arr.layout == "C" and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        i8p = ir.IntType(8).as_pointer()
        p = _ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], context.get_data_type(sig.args[0].dtype))
        fnty = ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32])
        fn = builder.module.declare_intrinsic("llvm.prefetch", [i8p], fnty)
        # read, keep in all cache levels, data cache
        builder.call(fn, [builder.bitcast(p, i8p), ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return types.none(arr, idx), codegen


@njit(cache=True, inline="always")
def prefetch_row(arr, idx):
    """`prefetch` for the cache lines of the LANES elements at arr[idx:] (one vector's load)."""
    step = 64 // arr.itemsize
    for j in range(0, LANES, step):
        prefetch(arr, idx + j)


@intrinsic
def v_get(typingctx, v, i):
    """Lane i of v."""
    if not (isinstance(v, _F32VType) and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.extract_element(args[0], context.cast(builder, args[1], sig.args[1], types.int32))

    return types.float32(v, i), codegen


@intrinsic
def v_rows_acc(typingctx, a, w, x, xi, K):
    """a + (w, w, ...) * (x[xi] x 32, x[xi + K] x 32, ...): a of 32R lanes holds R rows' 32-lane sums
    (row i in lanes 32i ..), w the 32 weights they share, x[xi + i K] row i's element; each lane's one
    multiply and one add as `v_add(a, v_mul(w, v32_splat(...)))` does them (no FMA)."""
    if not (isinstance(a, _F32VType) and isinstance(w, _F32VType) and w.lanes == HALF and a.lanes // HALF in (2, 4, 8)
            and a.lanes % HALF == 0
            and _c_array(x, types.float32) and isinstance(xi, types.Integer) and isinstance(K, types.Integer)):
        return None
    R = a.lanes // HALF

    def codegen(context, builder, sig, args):
        acc, wv, arr, i0, k = args
        idx = context.cast(builder, i0, sig.args[3], types.intp)
        step = context.cast(builder, k, sig.args[4], types.intp)
        parts = []
        for i in range(R):  # each row's element broadcast on its own (one vbroadcastss from memory)
            at_i = builder.add(idx, builder.mul(step, ir.Constant(idx.type, i)))
            xe = builder.load(_ptr(context, builder, sig.args[2], arr, at_i, types.intp, _F), align=4)
            parts.append(builder.fadd(_part_of(builder, acc, i), builder.fmul(wv, broadcast(builder, wv.type, xe))))
        while len(parts) > 1:  # the rows' sums side by side again
            parts = [_concat(builder, parts[j], parts[j + 1]) for j in range(0, len(parts), 2)]
        return parts[0]

    return a(a, w, x, xi, K), codegen


def _part_of(builder, v, i):
    """Lanes 32i .. 32i + 31 of the LLVM vector v."""
    return builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined),
                                  ir.Constant(ir.VectorType(_I32, HALF), list(range(i * HALF, i * HALF + HALF))))


def _concat(builder, a, b):
    n = a.type.count
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, 2 * n), list(range(2 * n))))


@intrinsic
def v_part(typingctx, v, i):
    """Lanes 32i .. 32i + 31 of v (i a constant)."""
    if not (isinstance(v, _F32VType) and isinstance(i, types.IntegerLiteral) and v.lanes >= HALF * (i.literal_value + 1)):
        return None
    return _F32V32(v, i), lambda context, builder, sig, args: _part_of(builder, args[0], sig.args[1].literal_value)


@lru_cache(maxsize=None)
def rows_zero(R: int):
    """v_zero for R rows of 32 lanes (`v_rows_acc`)."""
    return _vec_ops(_F32VType(R * HALF))[0]


@intrinsic
def at(typingctx, arr, idx):
    """arr[idx] (flat index into a C-contiguous float32 array, no bounds or sign checks)."""
    if not (_c_array(arr, types.float32) and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], _F), align=4)

    return types.float32(arr, idx), codegen


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
        last = broadcast(builder, _VI64, builder.sub(nn, ir.Constant(_I64, 1)))
        j = builder.select(builder.icmp_signed("<", lane, last), lane, last)
        off = builder.add(builder.mul(j, broadcast(builder, _VI64, st)), broadcast(builder, _VI64, b))
        addr = builder.add(broadcast(builder, _VI64, builder.ptrtoint(ary.data, _I64)), builder.shl(off, _splat(_VI64, 2)))
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
    """-v as numba negates a float: -0.0 - v (any lane count)."""
    if not isinstance(v, _F32VType):
        return None

    def codegen(context, builder, sig, args):
        return builder.fsub(_splat(args[0].type, -0.0), args[0])

    return v(v), codegen


@intrinsic
def v_max_range(typingctx, m, s, lo, hi):
    """Lanes lo <= j < hi: s if s > m else m (the `if s > m: m = s` of a running max); others keep m."""
    if not (m == _F32V and s == _F32V and isinstance(lo, types.Integer) and isinstance(hi, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        lane = ir.Constant(_VI32, list(range(LANES)))

        def splat_i32(v, ty):
            return broadcast(builder, _VI32, builder.trunc(context.cast(builder, v, ty, types.int64), _I32))

        valid = builder.and_(builder.icmp_signed(">=", lane, splat_i32(args[2], sig.args[2])),
                             builder.icmp_signed("<", lane, splat_i32(args[3], sig.args[3])))
        gt = builder.fcmp_ordered(">", args[1], args[0])
        return builder.select(builder.and_(valid, gt), args[1], args[0])

    return _F32V(m, s, lo, hi), codegen


# ---------------------------------------------------------------------------------------------------
# The compensated sum shared by every matrix product: per output, plain float32 partial sums over
# 64-long k-blocks, each added into (s, c) by one Kahan step, in block order from s = c = 0.

@njit(cache=True, inline="always")
def kahan(part, s, c):
    """One term (a block partial, or a product for per-element Kahan) into the compensated sum s, c
    (vectors of either width): y = part - c; z = s + y; c = (z - s) - y; s = z. Returns (s, c)."""
    y = v_sub(part, c)
    z = v_add(s, y)
    return z, v_sub(v_sub(z, s), y)


@njit(cache=True, inline="always")
def kahan1(part, s, c):
    """`kahan` for float32 scalars: the same operations."""
    y = part - c
    z = s + y
    return z, (z - s) - y
