"""The attention kernel against the contract's order written out in NumPy float32 element-wise operations
(each correctly rounded, none reassociated), bit for bit: per position, q.k a Kahan sum over d in
order, times the scale; the max; exp of the float64 difference (tinydet's own exp); the denominator
and each dim's weighted sum of V Kahan sums over positions in order. Head dims that run in passes of
64, 32 and 16 lanes and one dim at a time (Phi-3's 96 = 64 + 32, 80 = 64 + 16, 8 and 40 with a scalar
tail), with and without a sliding window, fp32 and fp16 caches; with Gemma 2's soft cap on the
scores (cap * tanh(score / cap) after the scale, tinydet's own tanh), on every path; and with gpt-oss's
sinks (a logit per head joining the max after the scores and the denominator after the positions)."""

from __future__ import annotations

import numpy as np
import pytest

from tinydet.backends.cpu import ops
from tinydet.numerics.mathfn import exp64, tanh32

f32 = np.float32


def kahan(part, s, c):
    y = part - c
    z = s + y
    return z, (z - s) - y


def reference(q, k, v, pos, n_heads, n_kv, D, scale, window, cap=0.0, sinks=None):
    """q (T, n_heads D); k, v (positions, n_kv, D) float32 (fp16 values widened): (T, n_heads D)."""
    out = np.zeros(q.shape, np.float32)
    group = n_heads // n_kv
    for t, p in enumerate(pos):
        n = p + 1
        lo = max(0, n - window) if window > 0 else 0
        for h in range(n_heads):
            g = h // group
            kk = k[lo:n, g]  # (positions, D)
            s = np.zeros(n - lo, np.float32)
            c = np.zeros(n - lo, np.float32)
            for d in range(D):
                s, c = kahan(q[t, h * D + d] * kk[:, d], s, c)
            s = s * scale
            if cap:
                s = np.array([tanh32(f32(x) / f32(cap)) for x in s], np.float32) * f32(cap)
            m = float(np.max(s))
            if sinks is not None and sinks[h] > m:
                m = float(sinks[h])
            e = np.array([f32(exp64(float(x) - m)) for x in s], np.float32)
            den, dc = f32(0.0), f32(0.0)
            acc = np.zeros(D, np.float32)
            cmp = np.zeros(D, np.float32)
            for i in range(n - lo):
                den, dc = kahan(e[i], den, dc)
                acc, cmp = kahan(e[i] * v[lo + i, g], acc, cmp)
            if sinks is not None:
                den, dc = kahan(f32(exp64(float(sinks[h]) - m)), den, dc)
            out[t, h * D:(h + 1) * D] = acc / den
    return out


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("D", [8, 40, 64, 80, 96, 112, 128])
@pytest.mark.parametrize("window", [0, 50])
def test_attention_gives_the_contract_order_bit_for_bit(D, window, dtype):
    check_attention(D, window, dtype, 4, 2, 2)


@pytest.mark.parametrize("n_heads, n_kv", [(8, 2), (14, 2), (8, 1)])
@pytest.mark.parametrize("nth", [1, 2, 64])
@pytest.mark.parametrize("D", [32, 64])
def test_grouped_heads_give_the_contract_order_bit_for_bit(n_heads, n_kv, nth, D):
    # chunks of 4 or 2 heads (nth decides which), and the heads a group leaves over run alone
    check_attention(D, 50 if nth == 2 else 0, "fp16" if n_kv == 1 else "fp32", n_heads, n_kv, nth)


@pytest.mark.parametrize("D, n_heads, n_kv, nth", [(40, 4, 2, 2), (64, 4, 2, 2), (32, 8, 2, 1), (32, 8, 2, 64),
                                                   (64, 14, 2, 2)])
def test_soft_capped_scores_bit_for_bit(D, n_heads, n_kv, nth):
    # one head at a time (40: a scalar tail), chunks of 2 and 4 heads, and a group's leftover heads
    check_attention(D, 50, "fp32", n_heads, n_kv, nth, cap=1.5)


def test_soft_cap_changes_the_scores():
    with pytest.raises(AssertionError):
        check_attention(64, 0, "fp32", 4, 2, 2, cap=1.5, ref_cap=0.0)


@pytest.mark.parametrize("D, n_heads, n_kv, nth, window", [(40, 4, 2, 2, 0), (64, 4, 2, 2, 50), (32, 8, 2, 1, 0),
                                                           (32, 8, 2, 64, 50), (64, 14, 2, 2, 0), (8, 4, 4, 2, 50)])
def test_sinks_bit_for_bit(D, n_heads, n_kv, nth, window):
    # a head at a time (40, 8: scalar tails), chunks of 2 and 4 heads, a group's leftover heads
    check_attention(D, window, "fp32", n_heads, n_kv, nth, sinks=True)


def test_sinks_change_the_output():
    with pytest.raises(AssertionError):
        check_attention(64, 0, "fp32", 4, 2, 2, sinks=True, ref_sinks=False)


def check_attention(D, window, dtype, n_heads, n_kv, nth, cap=0.0, ref_cap=None, sinks=False, ref_sinks=None):
    rng = np.random.default_rng(D * 10 + window + n_heads)
    ctx = 192
    pos = np.array([0, 63, 64, 130], np.int64)
    k = rng.standard_normal((ctx, n_kv, D)).astype(np.float32)
    v = rng.standard_normal((ctx, n_kv, D)).astype(np.float32)
    q = rng.standard_normal((len(pos), n_heads * D)).astype(np.float32)
    if dtype == "fp16":
        k, v = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
    # the caches' layouts: keys (slot, kv_head, pos // 64, d, pos % 64), values (slot, kv_head, pos, d)
    kc = np.ascontiguousarray(k.reshape(ctx // 64, 64, n_kv, D).transpose(2, 0, 3, 1))[None]
    vc = np.ascontiguousarray(v.transpose(1, 0, 2))[None]
    if dtype == "fp16":
        kc, vc = kc.astype(np.float16).view(np.uint16), vc.astype(np.float16).view(np.uint16)
    out = np.full(q.shape, np.nan, np.float32)
    scale = f32(1.0 / np.sqrt(D))
    # sinks around the scores' size, some above every score of a row (positions 0 and 63 are short rows)
    sk = (rng.standard_normal(n_heads) * 2.0).astype(np.float32) if sinks else np.zeros(0, np.float32)
    ops.attention(q, kc, vc, pos, np.zeros(len(pos), np.int64), n_heads, n_kv, D, scale, f32(cap), window, sk, out,
                  nth)
    ref = reference(q, k, v, pos, n_heads, n_kv, D, scale, window, cap if ref_cap is None else ref_cap,
                    sk if (sinks if ref_sinks is None else ref_sinks) else None)
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32)), np.abs(out - ref).max()
