"""Matrix products straight from GGUF's quantized blocks (Q8_0, Q4_0, Q4_1), in the panel layout of
`tinydet.qpack`, bit-identical to `cpu.matmul` over the dequantized matrix.

Each weight is dequantized inside the kernel by exactly the float32 operations `quants.dequantize`
performs, on the same operands, in the same order (fp16 scales widened exactly):
  Q8_0  w = q * d                     (q = the int8 quant, converted exactly)
  Q4_0  w = d * q                     (q = nibble - 8, an exact small integer, converted exactly)
  Q4_1  w = (d * q) + m               (q = the nibble, converted exactly)
and then enters `cpu.matmul`'s sum unchanged: per output, `part = part + w * x[t, k]` in k order
within each 64-long k-block, the block partials added in block order with Kahan compensation
(y = part - c; z = s + y; c = (z - s) - y; s = z; from s = c = 0). No fastmath, no reassociation, and
no FMA where it could change a bit (LLVM never contracts fmul/fadd without fast-math flags, and none
are set). The one fused multiply-add is Q4_1's (d * q) + m where the target has FMA: d is an fp16
value and q a 4-bit integer, so d * q is exact in float32 and fusing skips a rounding that rounds
nothing (`v_dq_add`). (quants.py subtracts
Q4_0's 8 in float32, `float(nibble) - 8.0`; that subtraction is exact for all 16 nibbles, so doing it
on the integer before the exact conversion gives the same float for every input; the tests run all 16.)

Work split (never a sum): decode (T = 1) gives one job per panel of LANES outputs, each weight
dequantized and used at once. With T > 1 a job is a pair of panels (64 outputs) and a chunk of tokens:
it dequantizes the pair once into a thread-local float32 buffer (the same values, by the same
operations) and runs tiles of 6 tokens (the rest by 4, 2 or 1) over it. Neither the thread count, the
chunking nor the tiling enters any output's arithmetic, so prefill and decode give the same bits.

Speed: the kernels use explicit float32 vectors (LLVM `<32 x float>` and `<64 x float>`, two and four
zmm registers on AVX-512) so that partial sums, scales and mins stay in registers across the k loop;
auto-vectorized loops kept them in memory and were bound by loads and stores. Each vector operation is
the scalar IEEE operation applied lane by lane, so the vector width changes speed, never bits (a
generic x86-64 target splits the vectors into SSE registers and gives the same results). Decode is
compute-bound here (dequantizing costs more instructions than the bytes it saves take to load), hence
32-lane panels (even work split over 2 or 3 threads for 576-row matrices) and 4-bit quants regrouped
into 32-bit words of 8: per 16 weights one shift, then either a mask and an exact int -> float
conversion (any target) or, where the compile target has AVX-512F, one `vpermps` lookup in the
16-entry table of those same floats (0.0 .. 15.0, or -8.0 .. 7.0 for Q4_0). Both give the quant's
exact float; the tests compare the AVX-512 build with a NUMBA_CPU_NAME=generic one.

The jitted kernels read raw pointers without bounds checks: call them through `qmatmul`, which checks
shapes and types, or check as it does.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, models, overload, register_model

from .cpu import _c_array, _ptr, _splat, _widen_half, chunk_range, f16_to_f32, split_chunks, target_has

LANES = 32  # outputs per panel of the native layout (decode's vector width)
WIDE = 2 * LANES  # outputs per prefill job (two panels) and its vector width
KBLOCK = 64  # k-block of the block-Kahan sum (= cpu.KBLOCK; the tests check it)
QBLOCK = 32  # elements per quant block
TILE = 6  # tokens per prefill tile (bits do not depend on it)
CHUNK_TILES = 16  # tiles per prefill job, at most, where the threads can still share the jobs evenly
# (each job dequantizes its pair of panels once; bits do not depend on it)

Q8_0, Q4_0, Q4_1 = 8, 2, 3  # ggml type ids

# ---------------------------------------------------------------------------------------------------
# Float32 vector types of LANES and WIDE lanes and the operations the kernels need: each an IEEE
# operation lane by lane, with no fast-math flags.

_F = ir.FloatType()
_I32 = ir.IntType(32)


def _vec(ty, n=LANES):
    return ir.VectorType(ty, n)


class _VecType(types.Type):
    def __init__(self, n):
        self.n = n
        super().__init__(name=f"tinydet.qcpu.f32x{n}")


_F32V = _VecType(LANES)
_F32W = _VecType(WIDE)


@register_model(_VecType)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _vec(_F, fe_type.n))


def _vector_ops(vt):
    """zero, splat, add, sub, mul, load, store for the vector type vt."""
    n = vt.n
    lt = _vec(_F, n)

    @intrinsic
    def zero(typingctx):
        return vt(), lambda context, builder, sig, args: _splat(lt, 0.0)

    @intrinsic
    def splat(typingctx, x):
        if x != types.float32:
            return None

        def codegen(context, builder, sig, args):
            v = builder.insert_element(ir.Constant(lt, ir.Undefined), args[0], ir.Constant(_I32, 0))
            return builder.shuffle_vector(v, ir.Constant(lt, ir.Undefined), ir.Constant(_vec(_I32, n), [0] * n))

        return vt(types.float32), codegen

    def binop(name):
        def impl(typingctx, a, b):
            if a != vt or b != vt:
                return None
            return vt(vt, vt), lambda context, builder, sig, args: getattr(builder, name)(args[0], args[1])

        return intrinsic(impl)

    @intrinsic
    def load(typingctx, arr, idx):
        """arr[idx : idx + n] (C-contiguous float32, flat index)."""
        if not (_c_array(arr, types.float32) and isinstance(idx, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            return builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], lt), align=4)

        return vt(arr, idx), codegen

    @intrinsic
    def store(typingctx, arr, idx, v):
        """arr[idx : idx + n] = v (C-contiguous float32, flat index)."""
        if not (_c_array(arr, types.float32) and isinstance(idx, types.Integer) and v == vt):
            return None

        def codegen(context, builder, sig, args):
            builder.store(args[2], _ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], lt), align=4)
            return context.get_dummy_value()

        return types.none(arr, idx, v), codegen

    return zero, splat, binop("fadd"), binop("fsub"), binop("fmul"), load, store


v_zero, v_splat, v_add, v_sub, v_mul, v_load, v_store = _vector_ops(_F32V)
w_zero, w_splat, w_add, w_sub, w_mul, w_load, w_store = _vector_ops(_F32W)


@intrinsic
def v_scale(typingctx, arr, idx):
    """LANES scales from arr[idx:]: fp16 bits (uint16) widened exactly, or float32 as stored."""
    if not (isinstance(arr, types.Array) and arr.layout == "C" and isinstance(idx, types.Integer)):
        return None
    if arr.dtype == types.float32:
        def codegen(context, builder, sig, args):
            ptr = _ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], _vec(_F))
            return builder.load(ptr, align=4)
    elif arr.dtype == types.uint16:
        def codegen(context, builder, sig, args):
            ptr = _ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], _vec(ir.IntType(16)))
            return _widen_half(context, builder, builder.load(ptr, align=2))  # F16C or integer: exact
    else:
        return None
    return _F32V(arr, idx), codegen


@intrinsic
def v_q8(typingctx, arr, idx):
    """LANES int8 quants from arr[idx:] as float32 (exact)."""
    if not (_c_array(arr, types.int8) and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ptr = _ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], _vec(ir.IntType(8)))
        return builder.sitofp(builder.sext(builder.load(ptr, align=1), _vec(_I32)), _vec(_F))

    return _F32V(arr, idx), codegen


def _permvar_table(builder, idx, table):
    """<LANES x i32> indices (low 4 bits used) -> <LANES x float> table[idx & 15], by AVX-512's vpermps
    on 16 lanes at a time. An exact table lookup: the same floats as the conversion it replaces."""
    v16f = _vec(_F, 16)
    v16i = _vec(_I32, 16)
    fnty = ir.FunctionType(v16f, [v16f, v16i])
    fn = builder.module.globals.get("llvm.x86.avx512.permvar.sf.512") or ir.Function(
        builder.module, fnty, "llvm.x86.avx512.permvar.sf.512")
    tab = ir.Constant(v16f, [ir.Constant(_F, float(t)) for t in table])
    parts = []
    for c in range(LANES // 16):
        sub = builder.shuffle_vector(idx, ir.Constant(idx.type, ir.Undefined),
                                     ir.Constant(v16i, list(range(16 * c, 16 * c + 16))))
        parts.append(builder.call(fn, [tab, sub]))
    while len(parts) > 1:
        n = parts[0].type.count
        parts = [builder.shuffle_vector(parts[i], parts[i + 1], ir.Constant(_vec(_I32, 2 * n), list(range(2 * n))))
                 for i in range(0, len(parts), 2)]
    return parts[0]


def _nibble(minus8: bool):
    def impl(typingctx, arr, idx, shift):
        if not (_c_array(arr, types.uint32) and isinstance(idx, types.Integer)
                and isinstance(shift, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            vi = _vec(_I32)
            ptr = _ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], vi)
            sh = context.cast(builder, args[2], sig.args[2], types.uint32)
            shv = builder.insert_element(ir.Constant(vi, ir.Undefined), sh, ir.Constant(_I32, 0))
            shv = builder.shuffle_vector(shv, ir.Constant(vi, ir.Undefined), ir.Constant(vi, [0] * LANES))
            word = builder.lshr(builder.load(ptr, align=4), shv)
            if target_has(context, "avx512f") and LANES % 16 == 0:
                # one permute instead of mask + convert (the kernel is compute-bound: ~9% faster)
                return _permvar_table(builder, word, [q - 8 if minus8 else q for q in range(16)])
            q = builder.and_(word, _splat(vi, 15))
            if minus8:
                q = builder.sub(q, _splat(vi, 8))
            return builder.sitofp(q, _vec(_F))

        return _F32V(arr, idx, shift), codegen

    return intrinsic(impl)


@intrinsic
def v_dq_add(typingctx, d, q, m):
    """(d * q) + m lane by lane, for d an fp16 value (11 significant bits) and q a 4-bit integer: their
    product has at most 15 significant bits, so it is exact in float32 and rounding it first (mul, then
    add) gives the same float as rounding d * q + m once (a fused multiply-add). Where the compile
    target has FMA, one fused instruction; elsewhere the mul and the add. The same bits either way (a
    NaN's payload aside, which no operation here promises)."""
    if not (d == _F32V and q == _F32V and m == _F32V):
        return None

    def codegen(context, builder, sig, args):
        a, b, c = args
        if target_has(context, "fma"):
            vt = _vec(_F)
            name = f"llvm.fma.v{LANES}f32"
            fn = builder.module.globals.get(name) or ir.Function(builder.module, ir.FunctionType(vt, [vt, vt, vt]), name)
            return builder.call(fn, [a, b, c])
        return builder.fadd(builder.fmul(a, b), c)

    return _F32V(d, q, m), codegen


v_nib = _nibble(False)  # (arr[idx : idx + LANES] >> shift) & 15 as float32: 0..15 (Q4_1)
v_nib_m8 = _nibble(True)  # the same minus 8: -8..7 (Q4_0)


# ---------------------------------------------------------------------------------------------------
# Dequantized weights, LANES at a time. Per panel p and quant block b the scales are at
# [(p * nb + b) * LANES]; Q8_0's quant k at [(p * K + k) * LANES]; Q4_x's word g of block b at
# [((p * nb + b) * 4 + g) * LANES], its nibble i (bits 4i..4i+3) being element 8g + i of the block.

@njit(cache=True, inline="always")
def _w_q8_0(qs, p, K, k, db):
    return v_mul(v_q8(qs, (p * K + k) * LANES), db)  # q * d


@njit(cache=True, inline="always")
def _w_q4_0(qs, base, i, db):
    return v_mul(db, v_nib_m8(qs, base, 4 * i))  # d * (q - 8)


@njit(cache=True, inline="always")
def _w_q4_1(qs, base, i, db, mb):
    return v_dq_add(db, v_nib(qs, base, 4 * i), mb)  # (d * q) + m, d * q exact


@njit(cache=True, inline="always")
def _kahan(part, s, c):
    """One block partial into the compensated sum: returns (s, c)."""
    y = v_sub(part, c)
    z = v_add(s, y)
    return z, v_sub(v_sub(z, s), y)


@njit(cache=True, inline="always")
def _wkahan(part, s, c):
    y = w_sub(part, c)
    z = w_add(s, y)
    return z, w_sub(w_sub(z, s), y)


@njit(cache=True, inline="always")
def _put(out, t, n0, n_out, v, res):
    """out[t, n0 : n0 + LANES] = v (clipped at n_out); then res[t, n] = res[t, n] + out[t, n] there."""
    n1 = min(n_out, n0 + LANES)
    if n1 - n0 == LANES:
        v_store(out, t * out.shape[1] + n0, v)
    else:
        buf = np.empty(LANES, np.float32)
        v_store(buf, 0, v)
        for j in range(n1 - n0):
            out[t, n0 + j] = buf[j]
    if res is not None:
        for j in range(n0, n1):
            res[t, j] = res[t, j] + out[t, j]


@njit(cache=True, inline="always")
def _wput(out, t, n0, n_out, v, res):
    """As _put for WIDE outputs."""
    n1 = min(n_out, n0 + WIDE)
    if n1 - n0 == WIDE:
        w_store(out, t * out.shape[1] + n0, v)
    else:
        buf = np.empty(WIDE, np.float32)
        w_store(buf, 0, v)
        for j in range(n1 - n0):
            out[t, n0 + j] = buf[j]
    if res is not None:
        for j in range(n0, n1):
            res[t, j] = res[t, j] + out[t, j]


# ---------------------------------------------------------------------------------------------------
# Tiles over a dequantized pair of panels wbuf[K * WIDE] (weight k of output n0 + j at k * WIDE + j).

@njit(cache=True, inline="always")
def _tile1(x, t, wbuf, n0, n_out, out, res):
    K = x.shape[1]
    s0 = w_zero()
    c0 = w_zero()
    for k0 in range(0, K, KBLOCK):
        a0 = w_zero()
        for k in range(k0, min(K, k0 + KBLOCK)):
            a0 = w_add(a0, w_mul(w_load(wbuf, k * WIDE), w_splat(x[t, k])))
        s0, c0 = _wkahan(a0, s0, c0)
    _wput(out, t, n0, n_out, s0, res)


@njit(cache=True, inline="always")
def _tile2(x, t, wbuf, n0, n_out, out, res):
    K = x.shape[1]
    s0 = w_zero()
    c0 = w_zero()
    s1 = w_zero()
    c1 = w_zero()
    for k0 in range(0, K, KBLOCK):
        a0 = w_zero()
        a1 = w_zero()
        for k in range(k0, min(K, k0 + KBLOCK)):
            w = w_load(wbuf, k * WIDE)
            a0 = w_add(a0, w_mul(w, w_splat(x[t, k])))
            a1 = w_add(a1, w_mul(w, w_splat(x[t + 1, k])))
        s0, c0 = _wkahan(a0, s0, c0)
        s1, c1 = _wkahan(a1, s1, c1)
    _wput(out, t, n0, n_out, s0, res)
    _wput(out, t + 1, n0, n_out, s1, res)


@njit(cache=True, inline="always")
def _tile4(x, t, tb, wbuf, n0, n_out, out, res):
    """Tokens t .. t+3; rows at or past tb repeat row tb - 1: computed, never stored."""
    K = x.shape[1]
    r1 = min(t + 1, tb - 1)
    r2 = min(t + 2, tb - 1)
    r3 = min(t + 3, tb - 1)
    s0 = w_zero()
    c0 = w_zero()
    s1 = w_zero()
    c1 = w_zero()
    s2 = w_zero()
    c2 = w_zero()
    s3 = w_zero()
    c3 = w_zero()
    for k0 in range(0, K, KBLOCK):
        a0 = w_zero()
        a1 = w_zero()
        a2 = w_zero()
        a3 = w_zero()
        for k in range(k0, min(K, k0 + KBLOCK)):
            w = w_load(wbuf, k * WIDE)
            a0 = w_add(a0, w_mul(w, w_splat(x[t, k])))
            a1 = w_add(a1, w_mul(w, w_splat(x[r1, k])))
            a2 = w_add(a2, w_mul(w, w_splat(x[r2, k])))
            a3 = w_add(a3, w_mul(w, w_splat(x[r3, k])))
        s0, c0 = _wkahan(a0, s0, c0)
        s1, c1 = _wkahan(a1, s1, c1)
        s2, c2 = _wkahan(a2, s2, c2)
        s3, c3 = _wkahan(a3, s3, c3)
    _wput(out, t, n0, n_out, s0, res)
    _wput(out, t + 1, n0, n_out, s1, res)
    _wput(out, t + 2, n0, n_out, s2, res)
    if tb - t > 3:
        _wput(out, t + 3, n0, n_out, s3, res)


@njit(cache=True, inline="always")
def _tile6(x, t, tb, wbuf, n0, n_out, out, res):
    """Tokens t .. t+5; rows at or past tb repeat row tb - 1: computed, never stored."""
    K = x.shape[1]
    r1 = min(t + 1, tb - 1)
    r2 = min(t + 2, tb - 1)
    r3 = min(t + 3, tb - 1)
    r4 = min(t + 4, tb - 1)
    r5 = min(t + 5, tb - 1)
    s0 = w_zero()
    c0 = w_zero()
    s1 = w_zero()
    c1 = w_zero()
    s2 = w_zero()
    c2 = w_zero()
    s3 = w_zero()
    c3 = w_zero()
    s4 = w_zero()
    c4 = w_zero()
    s5 = w_zero()
    c5 = w_zero()
    for k0 in range(0, K, KBLOCK):
        a0 = w_zero()
        a1 = w_zero()
        a2 = w_zero()
        a3 = w_zero()
        a4 = w_zero()
        a5 = w_zero()
        for k in range(k0, min(K, k0 + KBLOCK)):
            w = w_load(wbuf, k * WIDE)
            a0 = w_add(a0, w_mul(w, w_splat(x[t, k])))
            a1 = w_add(a1, w_mul(w, w_splat(x[r1, k])))
            a2 = w_add(a2, w_mul(w, w_splat(x[r2, k])))
            a3 = w_add(a3, w_mul(w, w_splat(x[r3, k])))
            a4 = w_add(a4, w_mul(w, w_splat(x[r4, k])))
            a5 = w_add(a5, w_mul(w, w_splat(x[r5, k])))
        s0, c0 = _wkahan(a0, s0, c0)
        s1, c1 = _wkahan(a1, s1, c1)
        s2, c2 = _wkahan(a2, s2, c2)
        s3, c3 = _wkahan(a3, s3, c3)
        s4, c4 = _wkahan(a4, s4, c4)
        s5, c5 = _wkahan(a5, s5, c5)
    m = tb - t
    _wput(out, t, n0, n_out, s0, res)
    _wput(out, t + 1, n0, n_out, s1, res)
    _wput(out, t + 2, n0, n_out, s2, res)
    if m > 3:
        _wput(out, t + 3, n0, n_out, s3, res)
    if m > 4:
        _wput(out, t + 4, n0, n_out, s4, res)
    if m > 5:
        _wput(out, t + 5, n0, n_out, s5, res)


@njit(cache=True, inline="always")
def _tiles(x, ta, tb, wbuf, n0, n_out, out, res):
    """Tokens ta..tb-1 over one dequantized pair of panels: tiles of 6, the rest by 4, 2 or 1."""
    t = ta
    while t < tb:
        m = tb - t
        if m == 1:
            _tile1(x, t, wbuf, n0, n_out, out, res)
            t += 1
        elif m == 2:
            _tile2(x, t, wbuf, n0, n_out, out, res)
            t += 2
        elif m <= 4:
            _tile4(x, t, tb, wbuf, n0, n_out, out, res)
            t += 4
        else:
            _tile6(x, t, tb, wbuf, n0, n_out, out, res)
            t += TILE


@njit(cache=True, inline="always")
def _wbuf(K, P, j):
    """The dequantized-pair buffer of job pair j; a missing second panel (P odd) reads as zeros."""
    if 2 * j + 1 < P:
        return np.empty(K * WIDE, np.float32)
    return np.zeros(K * WIDE, np.float32)




# ---------------------------------------------------------------------------------------------------
# The kernels: out[t, n] = sum_k x[t, k] * W[n, k] (n < n_out), and, when res is an array,
# res[t, n] = res[t, n] + out[t, n] afterwards (the residual add, by the thread that computed the
# output). x (T, K), out (T, >= n_out), res (T, >= n_out): C-contiguous float32. nth, the thread
# count, only shapes the split of prefill work. (numba.get_num_threads() inside a kernel would keep
# numba from caching it.)

@njit(parallel=True, cache=True)
def matmul_q8_0(x, qs, d, n_out, out, res, nth):
    """Q8_0 panels: qs (P, K, LANES) int8, d (P, K/32, LANES) uint16 fp16 bits or float32."""
    T, K = x.shape
    P = qs.shape[0]
    nb = K // QBLOCK
    if T == 1:
        for p in prange(P):
            s0 = v_zero()
            c0 = v_zero()
            for k0 in range(0, K, KBLOCK):
                a0 = v_zero()
                for b in range(k0 // QBLOCK, min(K, k0 + KBLOCK) // QBLOCK):
                    db = v_scale(d, (p * nb + b) * LANES)
                    for k in range(b * QBLOCK, b * QBLOCK + QBLOCK):
                        a0 = v_add(a0, v_mul(_w_q8_0(qs, p, K, k, db), v_splat(x[0, k])))
                s0, c0 = _kahan(a0, s0, c0)
            _put(out, 0, p * LANES, n_out, s0, res)
    else:
        J = (P + 1) // 2
        C = split_chunks(T, J, nth, TILE, CHUNK_TILES)
        for job in prange(J * C):
            j = job // C
            ta, tb = chunk_range(T, C, job % C, TILE)
            wbuf = _wbuf(K, P, j)
            for h in range(min(2, P - 2 * j)):
                p = 2 * j + h
                for b in range(nb):
                    db = v_scale(d, (p * nb + b) * LANES)
                    for k in range(b * QBLOCK, b * QBLOCK + QBLOCK):
                        v_store(wbuf, k * WIDE + h * LANES, _w_q8_0(qs, p, K, k, db))
            _tiles(x, ta, tb, wbuf, j * WIDE, n_out, out, res)


@njit(parallel=True, cache=True)
def matmul_q4_0(x, qs, d, n_out, out, res, nth):
    """Q4_0 panels: qs (P, K/32, 4, LANES) uint32 (8 nibbles each), d (P, K/32, LANES)."""
    T, K = x.shape
    P = qs.shape[0]
    nb = K // QBLOCK
    if T == 1:
        for p in prange(P):
            s0 = v_zero()
            c0 = v_zero()
            for k0 in range(0, K, KBLOCK):
                a0 = v_zero()
                for b in range(k0 // QBLOCK, min(K, k0 + KBLOCK) // QBLOCK):
                    db = v_scale(d, (p * nb + b) * LANES)
                    for g in range(4):
                        base = ((p * nb + b) * 4 + g) * LANES
                        kg = b * QBLOCK + 8 * g
                        for i in range(8):
                            a0 = v_add(a0, v_mul(_w_q4_0(qs, base, i, db), v_splat(x[0, kg + i])))
                s0, c0 = _kahan(a0, s0, c0)
            _put(out, 0, p * LANES, n_out, s0, res)
    else:
        J = (P + 1) // 2
        C = split_chunks(T, J, nth, TILE, CHUNK_TILES)
        for job in prange(J * C):
            j = job // C
            ta, tb = chunk_range(T, C, job % C, TILE)
            wbuf = _wbuf(K, P, j)
            for h in range(min(2, P - 2 * j)):
                p = 2 * j + h
                for b in range(nb):
                    db = v_scale(d, (p * nb + b) * LANES)
                    for g in range(4):
                        base = ((p * nb + b) * 4 + g) * LANES
                        kg = b * QBLOCK + 8 * g
                        for i in range(8):
                            v_store(wbuf, (kg + i) * WIDE + h * LANES, _w_q4_0(qs, base, i, db))
            _tiles(x, ta, tb, wbuf, j * WIDE, n_out, out, res)


@njit(parallel=True, cache=True)
def matmul_q4_1(x, qs, d, m, n_out, out, res, nth):
    """Q4_1 panels: as Q4_0, with mins m (P, K/32, LANES)."""
    T, K = x.shape
    P = qs.shape[0]
    nb = K // QBLOCK
    if T == 1:
        for p in prange(P):
            s0 = v_zero()
            c0 = v_zero()
            for k0 in range(0, K, KBLOCK):
                a0 = v_zero()
                for b in range(k0 // QBLOCK, min(K, k0 + KBLOCK) // QBLOCK):
                    db = v_scale(d, (p * nb + b) * LANES)
                    mb = v_scale(m, (p * nb + b) * LANES)
                    for g in range(4):
                        base = ((p * nb + b) * 4 + g) * LANES
                        kg = b * QBLOCK + 8 * g
                        for i in range(8):
                            a0 = v_add(a0, v_mul(_w_q4_1(qs, base, i, db, mb), v_splat(x[0, kg + i])))
                s0, c0 = _kahan(a0, s0, c0)
            _put(out, 0, p * LANES, n_out, s0, res)
    else:
        J = (P + 1) // 2
        C = split_chunks(T, J, nth, TILE, CHUNK_TILES)
        for job in prange(J * C):
            j = job // C
            ta, tb = chunk_range(T, C, job % C, TILE)
            wbuf = _wbuf(K, P, j)
            for h in range(min(2, P - 2 * j)):
                p = 2 * j + h
                for b in range(nb):
                    db = v_scale(d, (p * nb + b) * LANES)
                    mb = v_scale(m, (p * nb + b) * LANES)
                    for g in range(4):
                        base = ((p * nb + b) * 4 + g) * LANES
                        kg = b * QBLOCK + 8 * g
                        for i in range(8):
                            v_store(wbuf, (kg + i) * WIDE + h * LANES, _w_q4_1(qs, base, i, db, mb))
            _tiles(x, ta, tb, wbuf, j * WIDE, n_out, out, res)


def q_mm(x, qs, d, m, n_out, out, res, nth):
    """For jitted callers (e.g. a whole forward pass in one njit function): the kernel for the packed
    arrays' type, chosen at compile time. qs int8 -> Q8_0 (m None); qs uint32 with m None -> Q4_0,
    with m an array -> Q4_1. `res` None or a residual to add the outputs into; `nth` the thread
    count (work split only). No checks (see `check`)."""
    raise NotImplementedError("q_mm is for jitted code; from Python call qmatmul")


@overload(q_mm)
def _q_mm(x, qs, d, m, n_out, out, res, nth):
    if isinstance(qs, types.Array) and qs.dtype == types.int8 and isinstance(m, types.NoneType):
        return lambda x, qs, d, m, n_out, out, res, nth: matmul_q8_0(x, qs, d, n_out, out, res, nth)
    if isinstance(qs, types.Array) and qs.dtype == types.uint32:
        if isinstance(m, types.NoneType):
            return lambda x, qs, d, m, n_out, out, res, nth: matmul_q4_0(x, qs, d, n_out, out, res, nth)
        return lambda x, qs, d, m, n_out, out, res, nth: matmul_q4_1(x, qs, d, m, n_out, out, res, nth)
    return None


def q_mm_layer(x, qs, d, m, li, n_out, out, res, nth):
    """q_mm on layer li of arrays stacked over layers (`qpack.stack`): qs[li], d[li], m[li] (m None
    for Q8_0 and Q4_0)."""
    raise NotImplementedError("q_mm_layer is for jitted code; from Python call qmatmul")


@overload(q_mm_layer)
def _q_mm_layer(x, qs, d, m, li, n_out, out, res, nth):
    if isinstance(m, types.NoneType):
        return lambda x, qs, d, m, li, n_out, out, res, nth: q_mm(x, qs[li], d[li], None, n_out, out, res, nth)
    return lambda x, qs, d, m, li, n_out, out, res, nth: q_mm(x, qs[li], d[li], m[li], n_out, out, res, nth)


# ---------------------------------------------------------------------------------------------------
# Python entry points.

def _f32_2d(a, what):
    if not (isinstance(a, np.ndarray) and a.dtype == np.float32 and a.ndim == 2 and a.flags.c_contiguous):
        raise TypeError(f"qmatmul: {what} must be a C-contiguous float32 2-D array")


def check(x, qp, n_out, out, res=None):
    """Raise unless qmatmul(x, qp, n_out, out, res) is safe (the kernels read raw pointers)."""
    _f32_2d(x, "x (T, K)")
    _f32_2d(out, "out (T, n_out)")
    T, K = x.shape
    P = qp.qs.shape[0]
    if K != qp.k or K % QBLOCK or out.shape[0] != T or not 0 < n_out <= min(out.shape[1], qp.n):
        raise ValueError(f"qmatmul: x {x.shape}, out {out.shape}, n_out {n_out} do not fit W ({qp.n}, {qp.k})")
    if res is not None:
        _f32_2d(res, "res (T, n_out)")
        if res.shape[0] != T or res.shape[1] < n_out:
            raise ValueError(f"qmatmul: res {res.shape} does not fit out {out.shape}")
    nb = K // QBLOCK
    t = qp.ggml_type
    if t == Q8_0:
        want = (np.int8, (P, K, LANES))
    elif t in (Q4_0, Q4_1):
        want = (np.uint32, (P, nb, 4, LANES))
    else:
        raise ValueError(f"qmatmul: unsupported ggml type {t}")
    scales = [qp.d] + ([qp.m] if t == Q4_1 else [])
    if (qp.qs.dtype, qp.qs.shape) != want or not qp.qs.flags.c_contiguous or P * LANES < qp.n or any(
            not isinstance(s, np.ndarray) or s.dtype not in (np.uint16, np.float32) or s.shape != (P, nb, LANES)
            or not s.flags.c_contiguous for s in scales) or (t != Q4_1 and qp.m is not None):
        raise ValueError("qmatmul: the packed arrays do not have qpack's layout")


def qmatmul(x, qp, n_out, out, res=None):
    """out[t, n] = sum_k x[t, k] * W[n, k] for W a `qpack.QPanels`, n < n_out: the contract of
    `cpu.matmul(x, wp, n_out, out)` and, bit for bit, its result on the dequantized matrix. With `res`
    (T, >= n_out) float32, also res[t, n] = res[t, n] + out[t, n] (as cpu.add_inplace(res, out))."""
    check(x, qp, n_out, out, res)
    if x.shape[0] == 0:
        return
    t = qp.ggml_type
    nth = numba.get_num_threads()
    if t == Q4_1:
        matmul_q4_1(x, qp.qs, qp.d, qp.m, n_out, out, res, nth)
    elif t == Q8_0:
        matmul_q8_0(x, qp.qs, qp.d, n_out, out, res, nth)
    else:
        matmul_q4_0(x, qp.qs, qp.d, n_out, out, res, nth)


# ---------------------------------------------------------------------------------------------------
# Embedding rows straight from the packed table.

def s_scale(v):
    """A packed scale -> float32 (fp16 bits widened exactly, float32 as stored)."""


@overload(s_scale)
def _s_scale(v):
    if v == types.float32:
        return lambda v: v
    if v == types.uint16:
        return lambda v: f16_to_f32(v)
    return None


@njit(cache=True)
def _embed_q8_0(qs, d, ids, out):
    for t in range(ids.shape[0]):
        p, j = ids[t] // LANES, ids[t] % LANES
        for k in range(out.shape[1]):
            out[t, k] = np.float32(qs[p, k, j]) * s_scale(d[p, k // QBLOCK, j])  # q * d


@njit(cache=True)
def _embed_q4_0(qs, d, ids, out):
    for t in range(ids.shape[0]):
        p, j = ids[t] // LANES, ids[t] % LANES
        for k in range(out.shape[1]):
            b, e = k // QBLOCK, k % QBLOCK
            q = np.int32((qs[p, b, e // 8, j] >> np.uint32(4 * (e % 8))) & np.uint32(15)) - np.int32(8)
            out[t, k] = s_scale(d[p, b, j]) * np.float32(q)  # d * (q - 8)


@njit(cache=True)
def _embed_q4_1(qs, d, m, ids, out):
    for t in range(ids.shape[0]):
        p, j = ids[t] // LANES, ids[t] % LANES
        for k in range(out.shape[1]):
            b, e = k // QBLOCK, k % QBLOCK
            q = np.int32((qs[p, b, e // 8, j] >> np.uint32(4 * (e % 8))) & np.uint32(15))
            out[t, k] = (s_scale(d[p, b, j]) * np.float32(q)) + s_scale(m[p, b, j])  # (d * q) + m


def embed(qp, ids, out):
    """out[t] = row ids[t] of the packed matrix W, dequantized exactly as `quants.dequantize` gives it
    (so a quantized token table can stay quantized, and serve as the tied output matrix too)."""
    ids = np.ascontiguousarray(ids, np.int64).reshape(-1)
    _f32_2d(out, "out (T, k)")
    if out.shape != (ids.shape[0], qp.k):
        raise ValueError(f"embed: out {out.shape} does not fit {ids.shape[0]} rows of {qp.k}")
    if ids.size and (ids.min() < 0 or ids.max() >= qp.n):
        raise ValueError(f"embed: row ids must lie in [0, {qp.n})")
    check(np.empty((0, qp.k), np.float32), qp, qp.n, np.empty((0, qp.n), np.float32))
    if qp.ggml_type == Q8_0:
        _embed_q8_0(qp.qs, qp.d, ids, out)
    elif qp.ggml_type == Q4_0:
        _embed_q4_0(qp.qs, qp.d, ids, out)
    else:
        _embed_q4_1(qp.qs, qp.d, qp.m, ids, out)
