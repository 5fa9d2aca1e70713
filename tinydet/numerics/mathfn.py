"""tinydet's own transcendental functions (exp, log, sin, cos, tanh), built from + - * / and floor only.

NumPy's and libm's exp/sin/cos give different bits on different CPU dispatch paths, so the forward
pass and the sampler use these. Each is computed in float64 (about 1 ulp of float64) and callers that
work in float32 round the result once. No FMA is involved: fastmath stays off, so LLVM never fuses.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

# ln 2 split so that k * LN2_HI is exact for |k| < 2**20 (fdlibm's constants).
LN2_HI = 6.93147180369123816490e-01
LN2_LO = 1.90821492927058770002e-10
INV_LN2 = 1.44269504088896338700e+00
# pi/2 split into three 33-bit pieces: Cody-Waite reduction stays exact for |x| < ~1e6.
PIO2_1 = 1.57079632673412561417e+00
PIO2_2 = 6.07710050630396597660e-11
PIO2_3 = 2.02226624871116645580e-21
INV_PIO2 = 6.36619772367581382433e-01

# Taylor coefficients 1/n! as exact float64 roundings, written out so no libm is involved.
_EXP_C = (1.0, 1.0, 1 / 2, 1 / 6, 1 / 24, 1 / 120, 1 / 720, 1 / 5040, 1 / 40320, 1 / 362880,
          1 / 3628800, 1 / 39916800, 1 / 479001600, 1 / 6227020800)
E0, E1, E2, E3, E4, E5, E6, E7, E8, E9, E10, E11, E12, E13 = _EXP_C


@njit(cache=True)
def exp64(x):
    """e**x for float64 x. Range reduction x = k ln2 + r, |r| <= ln2/2, a degree-13 Taylor
    polynomial (truncation < 1e-18), then an exact scaling by 2**k."""
    if x != x:
        return x
    if x > 709.782712893384:
        return np.inf
    if x < -745.1332191019412:
        return 0.0
    k = math.floor(x * INV_LN2 + 0.5)
    r = (x - k * LN2_HI) - k * LN2_LO
    p = E13
    p = p * r + E12
    p = p * r + E11
    p = p * r + E10
    p = p * r + E9
    p = p * r + E8
    p = p * r + E7
    p = p * r + E6
    p = p * r + E5
    p = p * r + E4
    p = p * r + E3
    p = p * r + E2
    p = p * r + E1
    p = p * r + E0
    return math.ldexp(p, int(k))


@njit(cache=True)
def exp32(x):
    """e**x for a float32 argument, rounded once to float32."""
    return np.float32(exp64(np.float64(x)))


@njit(cache=True)
def tanh64(x):
    """tanh for float64 x: 1 - 2 / (e**(2|x|) + 1) with exp64, the sign of x. Near 0 the absolute error
    stays ~1e-16 (the relative error grows; GELU adds the result to 1, soft-capping multiplies it by
    the cap). NaN gives NaN."""
    neg = x < 0.0
    a = -0.0 - x if neg else x
    t = 1.0 - 2.0 / (exp64(2.0 * a) + 1.0)
    return -0.0 - t if neg else t


@njit(cache=True)
def tanh32(x):
    """tanh for a float32 argument: tanh64, rounded once to float32."""
    return np.float32(tanh64(np.float64(x)))


@njit(cache=True)
def log64(x):
    """Natural log for finite x > 0: x = m 2**e with m in [sqrt(1/2), sqrt(2)), then
    log m = 2 atanh(s), s = (m-1)/(m+1), |s| < 0.172, by its odd series."""
    m, e = math.frexp(x)  # exact: m in [0.5, 1)
    if m < 0.7071067811865476:
        m = m * 2.0
        e -= 1
    s = (m - 1.0) / (m + 1.0)
    z = s * s
    # sum_{j=0}^{13} z^j / (2j+1); the next term is below 1e-22.
    p = 1.0 / 27.0
    p = p * z + 1.0 / 25.0
    p = p * z + 1.0 / 23.0
    p = p * z + 1.0 / 21.0
    p = p * z + 1.0 / 19.0
    p = p * z + 1.0 / 17.0
    p = p * z + 1.0 / 15.0
    p = p * z + 1.0 / 13.0
    p = p * z + 1.0 / 11.0
    p = p * z + 1.0 / 9.0
    p = p * z + 1.0 / 7.0
    p = p * z + 1.0 / 5.0
    p = p * z + 1.0 / 3.0
    p = p * z + 1.0
    return e * LN2_HI + (2.0 * s * p + e * LN2_LO)


@njit(cache=True)
def _sin_kernel(r):
    # sin on |r| <= pi/4: Taylor to r**21 (truncation < 1e-22).
    z = r * r
    p = -1.0 / 51090942171709440000.0
    p = p * z + 1.0 / 121645100408832000.0
    p = p * z - 1.0 / 355687428096000.0
    p = p * z + 1.0 / 1307674368000.0
    p = p * z - 1.0 / 6227020800.0
    p = p * z + 1.0 / 39916800.0
    p = p * z - 1.0 / 362880.0
    p = p * z + 1.0 / 5040.0
    p = p * z - 1.0 / 120.0
    p = p * z + 1.0 / 6.0
    return r - r * z * p


@njit(cache=True)
def _cos_kernel(r):
    # cos on |r| <= pi/4: Taylor to r**20.
    z = r * r
    p = 1.0 / 2432902008176640000.0
    p = p * z - 1.0 / 6402373705728000.0
    p = p * z + 1.0 / 20922789888000.0
    p = p * z - 1.0 / 87178291200.0
    p = p * z + 1.0 / 479001600.0
    p = p * z - 1.0 / 3628800.0
    p = p * z + 1.0 / 40320.0
    p = p * z - 1.0 / 720.0
    p = p * z + 1.0 / 24.0
    return 1.0 - (0.5 * z - z * z * p)


@njit(cache=True)
def sincos64(x):
    """(sin x, cos x) for float64 |x| < 1e6, by Cody-Waite reduction modulo pi/2."""
    k = math.floor(x * INV_PIO2 + 0.5)
    r = ((x - k * PIO2_1) - k * PIO2_2) - k * PIO2_3
    s = _sin_kernel(r)
    c = _cos_kernel(r)
    q = int(k) & 3
    if q == 0:
        return s, c
    if q == 1:
        return c, -s
    if q == 2:
        return -s, -c
    return -c, s
