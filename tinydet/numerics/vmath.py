"""tinydet's own exp and tanh (`mathfn`) lane by lane on 64-lane float32 vectors: the same float64
operations in the same order, rounded once to float32, so a value gets the same bits in a vector lane
as in the scalar tail of a loop."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import mathfn
from .simd import _F32V, _I32, _VD, _VF, _VI64, LANES, _splat, broadcast


def _dconst(x):
    return _splat(_VD, float(x))


def _exp64_lanes(builder, x):
    """mathfn.exp64 lane by lane on <64 x double> x, rounded to float (see v_exp32 for the range
    handling)."""
    return builder.fptrunc(_exp64_lanes_d(builder, x), _VF)


def _exp64_lanes_d(builder, x):
    """mathfn.exp64 lane by lane on <64 x double> x, as doubles (inputs clamped to [-708, 709])."""
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
    # k is a whole number in [-1021, 1023]: added to 1.5 * 2**52 it is the low bits of the double, read
    # back by an integer subtraction - fptosi's value exactly, where AVX2 has no vector double -> int64
    # conversion (LLVM converts lane by lane there: exp took 1.27x the time)
    magic = _dconst(6755399441055744.0)
    ki = builder.sub(builder.bitcast(builder.fadd(k, magic), _VI64), builder.bitcast(magic, _VI64))
    scale = builder.bitcast(builder.shl(builder.add(ki, _splat(_VI64, 1023)), _splat(_VI64, 52)), _VD)
    return builder.select(nan, x, builder.fmul(p, scale))


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
        mv = broadcast(builder, _VD, args[1])
        return _exp64_lanes(builder, builder.fsub(builder.fpext(args[0], _VD), mv))

    return _F32V(v, m), codegen


@intrinsic
def v_exp64_sum_sub(typingctx, v, m):
    """sum_j exp64(v_j - m) over the lanes, in float64, added lane 0 first (log-probabilities'
    normalizer). The clamp at -708 adds exp(-708) < 1e-307 where exp64 gives 0: nothing, beside the
    term exp(0) = 1 that the sum always holds when m is the row's max."""
    if not (v == _F32V and m == types.float64):
        return None

    def codegen(context, builder, sig, args):
        e = _exp64_lanes_d(builder, builder.fsub(builder.fpext(args[0], _VD), broadcast(builder, _VD, args[1])))
        s = builder.extract_element(e, ir.Constant(_I32, 0))
        for j in range(1, LANES):
            s = builder.fadd(s, builder.extract_element(e, ir.Constant(_I32, j)))
        return s

    return types.float64(v, m), codegen


@intrinsic
def v_tanh32(typingctx, v):
    """mathfn.tanh32 lane by lane: in float64, t = 1 - 2 / (e**(2|x|) + 1) with e** as exp64, the sign
    of x, rounded once to float32. exp64's clamp at 709 changes nothing: beyond it t is 1.0 either way."""
    if v != _F32V:
        return None

    def codegen(context, builder, sig, args):
        x = builder.fpext(args[0], _VD)
        neg = builder.fcmp_ordered("<", x, _dconst(0.0))
        a = builder.select(neg, builder.fsub(_dconst(-0.0), x), x)
        e = _exp64_lanes_d(builder, builder.fmul(_dconst(2.0), a))
        t = builder.fsub(_dconst(1.0), builder.fdiv(_dconst(2.0), builder.fadd(e, _dconst(1.0))))
        return builder.fptrunc(builder.select(neg, builder.fsub(_dconst(-0.0), t), t), _VF)

    return _F32V(v), codegen
