"""The CPU backend's operations besides the matrix product: RMSNorm, RoPE with the KV-cache write,
attention, the gated activations, and the small element-wise steps. Every rule of the determinism
contract (docs/determinism.md) holds: a thread owns whole outputs (a row, a (token, head) pair) and
computes each completely, each reduction runs in one order fixed by its length alone, fastmath is off,
and transcendentals come from `mathfn` (or their lane-by-lane twins in `vmath`).

RMSNorm's sum of squares, attention's q.k dots, the softmax denominator and the weighted sum of V use
per-element Kahan compensation. With one token an operation runs on the calling thread, with more the
rows are split over threads.

Keys are cached with 64 positions side by side (k_cache[slot, kv_head, pos // 64, d, pos % 64]), so
q.k runs 64 positions per vector; values by KV head, then position (v_cache[slot, kv_head, pos, d]),
so the weighted sum of V runs 64 dims per vector and reads a head's values as one run of memory (by
position across all heads, a pass's 128 bytes a row sat 2 KB apart and decode after 4,096 positions
read them at half the speed).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .gqa import ATILE, attend2, attend4, chunking, exp_from_max, scaled
from ...numerics.mathfn import exp32, sincos64, tanh32
from ...numerics.simd import (LANES, VECTORS, f32, kahan, kahan1, narrow, prefetch_row, target_isa, v_add, v_div,
                              v_gather, v_get, v_load, v_max_range, v_mul, v_neg, v_splat, v_sqrt, v_store, v_zero,
                              widen)
from ...numerics.vmath import v_exp32, v_tanh32

SILU, GELU_TANH, SWIGLU_OAI = 0, 1, 2  # the gated activations (ModelConfig.activation)
ACTIVATIONS = {"silu": SILU, "gelu_tanh": GELU_TANH, "swiglu_oai": SWIGLU_OAI}
OAI_ALPHA, OAI_LIMIT = f32(1.702), f32(7.0)  # gpt-oss's clamped SwiGLU (arch/gptoss.py)

# GELU's tanh approximation, as PyTorch computes it in float32: 0.5 x (1 + tanh(b (x + k x^3)))
GELU_B = f32(1.41421356237309504880 * 1.12837916709551257390 * 0.5)  # sqrt(2) * (2 / sqrt(pi)) / 2
GELU_K = f32(0.044715)


# ---------------------------------------------------------------------------------------------------
# RMSNorm: out = (x * (1 / sqrt(mean(x^2) + eps))) * w, the sum of squares a Kahan sum in index order.

@njit(cache=True, inline="always")
def _rms_inv(x, t, i0, n, eps):
    """1 / sqrt(mean(x[t, i0 : i0 + n]^2) + eps)."""
    s = f32(0.0)
    c = f32(0.0)
    for i in range(i0, i0 + n):
        s, c = kahan1(x[t, i] * x[t, i], s, c)
    return f32(1.0) / np.sqrt(s / f32(n) + eps)


@njit(cache=True, inline="always")
def _rms_tile(x, t0, nt, w, eps, out):
    """RMSNorm of rows t0 .. t0 + nt - 1 (nt <= 64) at once, one row per lane: `_rms_inv`'s operations."""
    D = x.shape[1]
    s = v_zero()
    c = v_zero()
    for i in range(D):
        xv = v_gather(x, t0 * D + i, D, nt)
        s, c = kahan(v_mul(xv, xv), s, c)
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
    """out[t] = x[t] / sqrt(mean(x[t]**2) + eps) * w for every row t of x (T, D)."""
    if x.shape[0] == 1:
        inv = _rms_inv(x, 0, 0, x.shape[1], eps)
        for i in range(x.shape[1]):
            out[0, i] = (x[0, i] * inv) * w[i]
    else:
        _rmsnorm_rows(x, w, eps, out)


# ---------------------------------------------------------------------------------------------------
# RoPE and the cache write.

@njit(cache=True, inline="always")
def _head_norm(qkv, t, base, head_dim, w, eps):
    """QK-norm: RMSNorm of qkv[t, base : base + head_dim] in place where w has that length (else none:
    an empty w, or one over another span)."""
    if w.shape[0] == head_dim:
        inv = _rms_inv(qkv, t, base, head_dim, eps)
        for d in range(head_dim):
            qkv[t, base + d] = (qkv[t, base + d] * inv) * w[d]


@njit(cache=True)
def _rope_row(qkv, t, q_dim, kv_dim, head_dim, cos, sin, rotate, pos, slot, k_cache, v_cache, q_out, qn, kn, eps):
    half = head_dim // 2
    n_q = q_dim // head_dim
    n_kv = kv_dim // head_dim
    p = pos[t]
    s = slot[t]
    pt = p // ATILE
    pl = p % ATILE
    if qn.shape[0] != head_dim:  # norms over the whole of q and of k (OLMoE), not over each head
        _head_norm(qkv, t, 0, q_dim, qn, eps)
        _head_norm(qkv, t, q_dim, kv_dim, kn, eps)
    for h in range(n_q + n_kv):
        base = h * head_dim
        if h < n_q:
            _head_norm(qkv, t, base, head_dim, qn, eps)
        else:
            _head_norm(qkv, t, base, head_dim, kn, eps)
        for i in range(half):
            x0 = qkv[t, base + i]
            x1 = qkv[t, base + i + half]
            r0 = x0
            r1 = x1
            if rotate:  # else NoPE: q and k as projected (not a rotation by 0, whose products could round)
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
    for g in range(n_kv):
        for i in range(head_dim):
            v_cache[s, g, p, i] = narrow(qkv[t, q_dim + kv_dim + g * head_dim + i], v_cache)


@njit(parallel=True, cache=True)
def _rope_rows(qkv, q_dim, kv_dim, head_dim, cos, sin, rotate, pos, slot, k_cache, v_cache, q_out, qn, kn, eps):
    for t in prange(qkv.shape[0]):  # t as int64: the outlined loop's index is uint64 (one compile)
        _rope_row(qkv, np.int64(t), q_dim, kv_dim, head_dim, cos, sin, rotate, pos, slot, k_cache, v_cache, q_out, qn,
                  kn, eps)


@njit(cache=True)
def rope_store(qkv, q_dim, kv_dim, head_dim, cos, sin, rotate, pos, slot, k_cache, v_cache, q_out, qn, kn, eps):
    """For each row t (position pos[t] of sequence slot[t]): QK-norm each head of q and k where qn / kn
    are given ((head_dim,) each; (q_dim,) and (kv_dim,): all of q and of k at once; empty: none), rotate
    q and k (HF's half-split layout: pairs (i, i + hd/2)) unless `rotate` is false (a NoPE layer), write
    q to q_out and k, v into the layer's cache, rounded there once if the cache is fp16."""
    if qkv.shape[0] == 1:
        _rope_row(qkv, np.int64(0), q_dim, kv_dim, head_dim, cos, sin, rotate, pos, slot, k_cache, v_cache, q_out, qn,
                  kn, eps)
    else:
        _rope_rows(qkv, q_dim, kv_dim, head_dim, cos, sin, rotate, pos, slot, k_cache, v_cache, q_out, qn, kn, eps)


@njit(cache=True)
def rope_tables(n_pos, inv_freq, cos, sin):
    """cos/sin[pos, i] of pos * inv_freq[i], in float64 with tinydet's own sincos, rounded once."""
    for p in range(n_pos):
        for i in range(inv_freq.shape[0]):
            s, c = sincos64(np.float64(p) * inv_freq[i])
            cos[p, i] = np.float32(c)
            sin[p, i] = np.float32(s)


# ---------------------------------------------------------------------------------------------------
# Attention.

def _pv_passes(W: int):
    """pv(scores, lo, n, v_cache, vi, vrow, d0, d1, out, oi, den, have, se, has_sink) -> (den, have):
    dims d0..d1 (a multiple of W lanes apart) of the weighted sum of V, W dims a pass: per d, the Kahan
    sum over positions lo..n-1 in order of scores[i] * v[vi + i vrow + d], divided by den and stored
    at out[oi + d]. Until `have`, the first pass also sums den (the scores, Kahan in position order,
    then the sink's numerator se where has_sink): a scalar chain riding beside W independent ones. W changes which dims share a pass, never a dim's
    operations, so every width gives the same bits."""
    Z, S, L = VECTORS[W]

    def pv(scores, lo, n, v_cache, vi, vrow, d0, d1, out, oi, den, have, se, has_sink):
        for d in range(d0, d1, W):
            acc = Z()
            cmp = Z()
            if have:
                for i in range(lo, n):
                    acc, cmp = kahan(v_mul(S(scores[i]), L(v_cache, vi + i * vrow + d)), acc, cmp)
            else:
                dc = f32(0.0)
                for i in range(lo, n):
                    e = scores[i]
                    den, dc = kahan1(e, den, dc)
                    acc, cmp = kahan(v_mul(S(e), L(v_cache, vi + i * vrow + d)), acc, cmp)
                if has_sink:
                    den, dc = kahan1(se, den, dc)
                have = True
            v_store(out, oi + d, v_div(acc, S(den)))
        return den, have

    return njit(inline="always")(pv)


# Head dims in passes of 64 lanes, then 32 and 16 (Phi-3's 96 = 64 + 32), the rest one dim at a time.
# (64 lanes of sums and compensations are the whole register file of AVX2's 16 ymm; 32-lane passes
# measured no faster there: bench/README.md, "Attention per vector unit".)
_pv64, _pv32, _pv16 = (_pv_passes(w) for w in (64, 32, 16))


@njit(cache=True, inline="always")
def _attend(q, k_cache, v_cache, pos, slot, n_heads, n_kv_heads, head_dim, scale, score_cap, window, sinks, out, t,
            h, scores):
    """Row t, head h: scores over positions lo..pos[t] of sequence slot[t] (lo = 0, or the first of the
    last `window` positions), softmax, weighted sum of V. With sinks (n_heads,) (else empty), head h's
    sink logit joins the softmax's max (after the scores) and its denominator (after the positions'
    terms), and nothing of V: gpt-oss's attention sinks.

    q.k: per position, Kahan over d in order (64 positions at a time, one per lane), times the scale,
    soft-capped where score_cap != 0 (`gqa.scaled`). The running max
    is a float64 holding a float32 (as the scalar `m = -np.inf; if s > m: m = s`), and exp32 takes
    the float64 difference. The denominator is a Kahan sum over positions in order; the weighted sum
    of V a Kahan sum over positions in order per d (`_pv_passes`)."""
    group = n_heads // n_kv_heads
    sl = slot[t]
    n = pos[t] + 1
    lo = max(0, n - window) if window > 0 else 0
    qo = h * head_dim
    g = h // group
    kt = k_cache.shape[2]
    j0 = lo // ATILE
    nt = (n + ATILE - 1) // ATILE
    kbase = (sl * n_kv_heads + g) * kt * head_dim * ATILE
    vscale = v_splat(scale)
    mv = v_splat(f32(-np.inf))
    for j in range(j0, nt):
        s = v_zero()
        c = v_zero()
        kb = kbase + j * head_dim * ATILE
        for d in range(head_dim):
            prefetch_row(k_cache, kb + (head_dim + d) * ATILE)  # the next tile's
            s, c = kahan(v_mul(v_splat(q[t, qo + d]), v_load(k_cache, kb + d * ATILE)), s, c)
        s = scaled(s, vscale, score_cap)
        v_store(scores, j * ATILE, s)
        mv = v_max_range(mv, s, lo - j * ATILE, n - j * ATILE)
    se = exp_from_max(scores, 0, j0, nt, mv, sinks, h)
    has_sink = sinks.shape[0] > 0
    vrow = head_dim
    vi = (sl * n_kv_heads + g) * v_cache.shape[2] * head_dim
    oi = t * out.shape[1] + qo
    d1 = head_dim - head_dim % 64
    d2 = d1 + (head_dim - d1) // 32 * 32
    d3 = d2 + (head_dim - d2) // 16 * 16
    den, have = _pv64(scores, lo, n, v_cache, vi, vrow, 0, d1, out, oi, f32(0.0), False, se, has_sink)
    den, have = _pv32(scores, lo, n, v_cache, vi, vrow, d1, d2, out, oi, den, have, se, has_sink)
    den, have = _pv16(scores, lo, n, v_cache, vi, vrow, d2, d3, out, oi, den, have, se, has_sink)
    if d3 < head_dim:
        if not have:
            dc = f32(0.0)
            for i in range(lo, n):
                den, dc = kahan1(scores[i], den, dc)
            if has_sink:
                den, dc = kahan1(se, den, dc)
        nd = head_dim - d3
        acc1 = np.zeros(nd, np.float32)
        cmp1 = np.zeros(nd, np.float32)
        for i in range(lo, n):
            p = scores[i]
            for d in range(nd):
                acc1[d], cmp1[d] = kahan1(p * widen(v_cache[sl, g, i, d3 + d]), acc1[d], cmp1[d])
        for d in range(nd):
            out[t, qo + d3 + d] = acc1[d] / den


# The heads of a KV group together (`gqa.py`) where 32 zmm registers hold their chains; AVX2's 16 ymm
# would spill them, so other targets run a head at a time. Either way the same bits.
_GROUPED = target_isa() == "avx512"


@njit(parallel=True, cache=True)
def attention(q, k_cache, v_cache, pos, slot, n_heads, n_kv_heads, head_dim, scale, score_cap, window, sinks, out,
              nth):
    """Causal grouped-query attention: row t attends to positions 0..pos[t] (with `window` > 0, the
    last `window` of them) of sequence slot[t]; each score is q.k times `scale`, then with `score_cap`
    != 0 soft-capped to cap * tanh(score / cap); `sinks` (n_heads,) each head's sink logit, or empty
    (`_attend`). A work item is a row's head, or a chunk of the heads
    of one KV group (`gqa.chunking`); scores, softmax and the weighted sum of V run over cache positions
    in order, so a row's result depends neither on how its prompt was chunked nor on which other
    sequences share the batch. `nth`, the thread count, only shapes the split of work."""
    T = q.shape[0]
    cap = k_cache.shape[2] * ATILE
    group = n_heads // n_kv_heads
    cw, U = chunking(T, n_heads, n_kv_heads, head_dim, nth) if _GROUPED else (1, group)
    per_row = n_kv_heads * U
    for job in prange(T * per_row):  # job as int64: the outlined loop's index is uint64
        _attention_job(q, k_cache, v_cache, pos, slot, n_heads, n_kv_heads, head_dim, scale, score_cap, window, sinks,
                       out, np.int64(job), T, per_row, U, cw, cap)


@njit(cache=True)
def _attention_job(q, k_cache, v_cache, pos, slot, n_heads, n_kv_heads, head_dim, scale, score_cap, window, sinks,
                   out, job, T, per_row, U, cw, cap):
    # A function of its own, called from attention's parallel loop: numba types a prange body twice
    # (in the function, then as its outlined loop), and compiled what the body inlines both times.
    # Rows are taken from both ends in turn (0, T-1, 1, T-2, ...): in a prompt, later rows attend to
    # more positions, and this keeps contiguous runs of jobs equally costly.
    group = n_heads // n_kv_heads
    i = job // per_row
    t = i // 2 if i % 2 == 0 else T - 1 - i // 2
    g = job % per_row // U
    u = job % U
    full = group // cw
    if u < full and cw > 1:
        scores = np.empty(cw * cap, np.float32)
        if cw == 4:
            attend4(q, k_cache, v_cache, pos, slot, n_heads, n_kv_heads, head_dim, scale, score_cap, window, sinks, out,
                    t, g * group + 4 * u, scores)
        else:
            attend2(q, k_cache, v_cache, pos, slot, n_heads, n_kv_heads, head_dim, scale, score_cap, window, sinks, out,
                    t, g * group + 2 * u, scores)
    else:
        scores = np.empty(cap, np.float32)
        h = g * group + (u if cw == 1 else full * cw + u - full)
        _attend(q, k_cache, v_cache, pos, slot, n_heads, n_kv_heads, head_dim, scale, score_cap, window, sinks, out, t,
                h, scores)


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


# ---------------------------------------------------------------------------------------------------
# Gated activations: act = f(gate) * up, f(g) = g / (1 + e**-g) (SiLU) or 0.5 g (1 + tanh(b (g + k g^3)))
# (GELU-tanh); 64 lanes at a time, the scalar tail by the same operations.

@njit(cache=True, inline="always")
def _gelu(g):
    return (f32(0.5) * g) * (f32(1.0) + tanh32(GELU_B * (g + GELU_K * ((g * g) * g))))


@njit(cache=True, inline="always")
def _swiglu_oai(g, u):
    """gpt-oss's clamped SwiGLU, as transformers' GptOssExperts computes it in float32: g = min(g, 7),
    u = clamp(u, -7, 7) (a NaN stays NaN), (u + 1) * (g * sigmoid(1.702 g)), sigmoid(x) = 1 / (1 + e**-x)."""
    if g > OAI_LIMIT:
        g = OAI_LIMIT
    if u > OAI_LIMIT:
        u = OAI_LIMIT
    elif u < -OAI_LIMIT:
        u = -OAI_LIMIT
    return (u + f32(1.0)) * (g * (f32(1.0) / (f32(1.0) + exp32(-(g * OAI_ALPHA)))))


@njit(cache=True)
def glu_span(gu, ta, tb, ffn_dim, act, n0, n1, kind):
    """act[t, n] = f(gate, up) for rows ta <= t < tb and n0 <= n < n1, gu[t] = [gate | up]: f(gate) * up
    (SiLU, GELU-tanh: 64 lanes at a time, the tail one by one), or gpt-oss's (one by one)."""
    one = v_splat(f32(1.0))
    half = v_splat(f32(0.5))
    b = v_splat(GELU_B)
    k = v_splat(GELU_K)
    for t in range(ta, tb):
        if kind == SWIGLU_OAI:
            for i in range(n0, n1):
                act[t, i] = _swiglu_oai(gu[t, i], gu[t, ffn_dim + i])
            continue
        n = n0
        while n + LANES <= n1:
            g = v_load(gu, t * 2 * ffn_dim + n)
            u = v_load(gu, t * 2 * ffn_dim + ffn_dim + n)
            if kind == SILU:
                f = v_div(g, v_add(one, v_exp32(v_neg(g))))
            else:
                f = v_mul(v_mul(half, g), v_add(one, v_tanh32(v_mul(b, v_add(g, v_mul(k, v_mul(v_mul(g, g), g)))))))
            v_store(act, t * ffn_dim + n, v_mul(f, u))
            n += LANES
        for i in range(n, n1):
            g = gu[t, i]
            f = g / (f32(1.0) + exp32(-g)) if kind == SILU else _gelu(g)
            act[t, i] = f * gu[t, ffn_dim + i]


@njit(parallel=True, cache=True)
def glu_rows(gu, ffn_dim, act, kind):
    """glu_span over every row, a row per thread; one row runs on the calling thread."""
    T = gu.shape[0]
    if T == 1:
        glu_span(gu, np.int64(0), np.int64(1), ffn_dim, act, np.int64(0), ffn_dim, kind)
    else:
        for t in prange(T):
            glu_span(gu, np.int64(t), np.int64(t + 1), ffn_dim, act, np.int64(0), ffn_dim, kind)


# ---------------------------------------------------------------------------------------------------
# Element-wise steps.

@njit(cache=True)
def add_rows(x, y):
    """x += y (a residual add, for the passes that do not fuse it into a matrix product)."""
    T, D = x.shape
    for t in range(T):
        for i in range(D):
            x[t, i] = x[t, i] + y[t, i]


@njit(cache=True)
def add_bias(x, b):
    """x[t] += b: a projection's bias, added to each finished output (one rounding)."""
    for t in range(x.shape[0]):
        for i in range(x.shape[1]):
            x[t, i] = x[t, i] + b[i]


@njit(cache=True)
def scale_rows(x, s):
    """x *= s (the embedding scale)."""
    for t in range(x.shape[0]):
        for i in range(x.shape[1]):
            x[t, i] = x[t, i] * s


@njit(cache=True)
def softcap(x, n, cap):
    """x[:, :n] = cap * tanh(x / cap) (final logit soft-capping), as three float32 steps."""
    for t in range(x.shape[0]):
        for i in range(n):
            x[t, i] = tanh32(x[t, i] / cap) * cap
