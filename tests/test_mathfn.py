"""tinydet's own transcendentals against mpmath-free references: Python's correctly rounded constants
and libm at a tolerance (libm is accurate; it is only not bit-reproducible across machines)."""

from __future__ import annotations

import math

import numpy as np

from tinydet.numerics.mathfn import exp32, exp64, log64, sincos64, tanh32, tanh64
from tinydet.numerics.simd import from_f16_bits, to_f16_bits


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


def test_tanh_is_accurate_and_odd():
    rng = np.random.default_rng(5)
    xs = np.concatenate([rng.uniform(-20, 20, 4000), rng.uniform(-1e-3, 1e-3, 1000), [0.0, 1e-300, 40.0, 400.0]])
    assert max(abs(tanh64(x) - math.tanh(x)) for x in xs) <= 4e-16
    assert all(tanh64(-x) == -tanh64(x) for x in xs) and tanh64(1e6) == 1.0 and math.isnan(tanh64(math.nan))
    x32 = rng.uniform(-10, 10, 20000).astype(np.float32)
    bad = sum(tanh32(x) != np.float32(math.tanh(float(x))) for x in x32)
    assert bad <= 20  # an absolute error of ~1e-16 can tip a float32 rounding near 0


def test_gated_activations_vector_lanes_equal_the_scalar_tail():
    """glu_span computes 64 outputs at a time with vector exp/tanh and the rest one by one: the same
    value must come out of both paths, for SiLU and GELU-tanh."""
    from tinydet.backends.cpu.ops import GELU_TANH, SILU, glu_rows

    rng = np.random.default_rng(6)
    g = np.concatenate([rng.standard_normal(3000) * 4, rng.uniform(-100, 100, 500),
                        [0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 200.0, -200.0, 1e30, -1e30]]).astype(np.float32)
    u = rng.standard_normal(g.shape[0]).astype(np.float32)
    ffn = 65  # lanes 0..63 by vector, 64 by the scalar tail
    gu = np.concatenate([np.repeat(g[:, None], ffn, 1), np.repeat(u[:, None], ffn, 1)], axis=1)
    for kind in (SILU, GELU_TANH):
        act = np.empty((g.shape[0], ffn), np.float32)
        glu_rows(np.ascontiguousarray(gu), ffn, act, kind)
        assert np.array_equal(act[:, :64].view(np.uint32), np.repeat(act[:, 64:].view(np.uint32), 64, 1)), kind
        g64 = g.astype(np.float64)
        with np.errstate(over="ignore"):
            ref = (g64 / (1 + np.exp(-g64)) if kind == SILU else
                   0.5 * g64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (g64 + 0.044715 * g64 ** 3)))) * u
        ok = np.isfinite(ref)
        assert np.allclose(act[ok, 64], ref[ok], rtol=1e-5, atol=1e-6), kind


def test_gpt_oss_clamped_swiglu_against_float64():
    """gpt-oss's activation (g = min(gate, 7), u = clamp(up, -7, 7), (u + 1) g sigmoid(1.702 g)) on
    gates and ups on both sides of the clamps, against the formula in float64; NaN stays NaN."""
    from tinydet.backends.cpu.ops import SWIGLU_OAI, glu_rows

    rng = np.random.default_rng(7)
    n = 4000
    g = np.concatenate([rng.uniform(-20, 20, n), [7.0, 7.5, -7.5, np.nan, 0.0]]).astype(np.float32)
    u = np.concatenate([rng.uniform(-20, 20, n), [7.5, -7.5, 7.0, 1.0, np.nan]]).astype(np.float32)
    act = np.empty((g.shape[0], 1), np.float32)
    glu_rows(np.ascontiguousarray(np.stack([g, u], 1)), 1, act, SWIGLU_OAI)
    gc = np.minimum(g.astype(np.float64), 7.0)
    uc = np.clip(u.astype(np.float64), -7.0, 7.0)
    ref = (uc + 1) * gc / (1 + np.exp(-1.702 * gc))
    ok = ~np.isnan(ref)
    assert (np.abs(g) > 7).sum() > 1000 and (np.abs(u) > 7).sum() > 1000  # both clamps bind
    assert np.allclose(act[ok, 0], ref[ok], rtol=2e-6, atol=1e-6)
    assert np.isnan(act[~ok, 0]).all() and (~ok).sum() == 2


def test_vector_exp_and_tanh_give_the_scalar_bits_over_the_whole_range():
    """v_exp32 and v_tanh32 (64 lanes) against the scalar exp32 / tanh32, bit for bit, over every power
    of two the float64 exp scales by (inputs -800..800, so k = -1021..1023 and the clamps) and the
    special values."""
    from numba import njit

    from tinydet.numerics.simd import LANES, v_load, v_neg, v_store
    from tinydet.numerics.vmath import v_exp32, v_tanh32

    @njit
    def f(x, e, t):
        for i in range(0, x.shape[0], LANES):
            v = v_load(x, i)
            v_store(e, i, v_exp32(v_neg(v)))
            v_store(t, i, v_tanh32(v))

    rng = np.random.default_rng(7)
    x = np.concatenate([rng.standard_normal(1000) * 4, rng.uniform(-800, 800, 3000), np.arange(-709, 710),
                        [0.0, -0.0, 1e-30, 88.0, -104.0, 1e30, -1e30, np.inf, -np.inf, np.nan]]).astype(np.float32)
    x = np.concatenate([x, np.zeros(-len(x) % LANES, np.float32)])
    e, t = np.empty_like(x), np.empty_like(x)
    f(x, e, t)
    assert np.array_equal(e.view(np.uint32), np.array([exp32(-v) for v in x], np.float32).view(np.uint32))
    assert np.array_equal(t.view(np.uint32), np.array([tanh32(v) for v in x], np.float32).view(np.uint32))
