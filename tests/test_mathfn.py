"""tinydet's own transcendentals against mpmath-free references: Python's correctly rounded constants
and libm at a tolerance (libm is accurate; it is only not bit-reproducible across machines)."""

from __future__ import annotations

import math

import numpy as np

from tinydet.backends.cpu.mathfn import exp32, exp64, log64, sincos64, tanh32, tanh64
from tinydet.backends.cpu.simd import from_f16_bits, to_f16_bits


def ulps(a: float, b: float) -> float:
    return abs(a - b) / math.ulp(b) if b else abs(a)


def test_exp64_within_one_ulp():
    rng = np.random.default_rng(1)
    xs = np.concatenate([rng.uniform(-700, 700, 3000), rng.uniform(-1, 1, 3000), [0.0, 1.0, -1.0, 1e-300]])
    assert max(ulps(exp64(x), math.exp(x)) for x in xs) <= 2
    assert exp64(0.0) == 1.0 and exp64(1000.0) == math.inf and exp64(-1000.0) == 0.0
    assert math.isnan(exp64(math.nan))


def test_exp32_rounds_like_a_correct_float32_exp():
    rng = np.random.default_rng(2)
    xs = rng.uniform(-87, 88, 20000).astype(np.float32)
    bad = sum(exp32(x) != np.float32(math.exp(float(x))) for x in xs)
    assert bad <= 2  # libm itself is within ~0.5 ulp of float64; rounding to float32 can only tie rarely


def test_log64_and_sincos64():
    rng = np.random.default_rng(3)
    for x in np.concatenate([rng.uniform(1e-3, 1e6, 3000), [10000.0, 100000.0, 2.0, 1.0]]):
        assert ulps(log64(x), math.log(x)) <= 2
    for x in np.concatenate([rng.uniform(-10, 10, 3000), rng.uniform(0, 1e5, 3000), [0.0, math.pi / 2]]):
        s, c = sincos64(x)
        assert abs(s - math.sin(x)) <= 4e-16 and abs(c - math.cos(x)) <= 4e-16


def test_f16_widening_is_exact_for_all_bit_patterns():
    bits = np.arange(65536, dtype=np.uint16)
    ours = from_f16_bits(bits)
    ref = bits.view(np.float16).astype(np.float32)
    finite = ~np.isnan(ref)
    assert np.array_equal(ours[finite].view(np.uint32), ref[finite].view(np.uint32))
    assert np.isnan(ours[~finite]).all()


def test_f16_rounding_matches_numpy_round_to_nearest_even():
    rng = np.random.default_rng(4)
    bits = np.concatenate([
        rng.integers(0, 2**32, 2_000_000, dtype=np.uint64).astype(np.uint32),
        np.arange(0x33000000 - 500, 0x38800000 + 500, 3, dtype=np.uint32),  # subnormal halves and edges
        np.arange(0x477FE000 - 2000, 0x47800000 + 2000, dtype=np.uint32),  # near the overflow threshold
    ])
    x = bits.view(np.float32)
    with np.errstate(over="ignore"):
        ref = x.astype(np.float16).view(np.uint16)
    ours = to_f16_bits(x)
    ok = ~np.isnan(x)
    assert np.array_equal(ours[ok], ref[ok])
    assert np.isnan(ours[~ok].view(np.float16)).all()
