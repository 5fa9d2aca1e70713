"""Attention for several query heads of one KV group at once (`ops.attention` on AVX-512).

Each head's arithmetic is `ops._attend`'s, operation for operation and in the same order: q.k a Kahan
sum over d per position, times the scale; the running max per lane in tile order, then over the lanes;
exp of the float64 difference; the denominator and each dim's weighted sum of V Kahan sums over
positions in order. Two things change, neither a bit:
- the keys of a tile and the values of a position are read once for the NH heads of a chunk instead
  of once per head. A head's keys and values at 4,096 positions are 2 MB (head_dim 64), and the heads
  of a group, one after another, read them again each time, from DRAM;
- the heads' Kahan chains are interleaved. A Kahan step is four dependent adds, so one head's few
  vector chains wait on latency; NH heads give NH times as many independent chains.
The weighted sum of V runs 32 dims a pass (NH heads' sums and compensations: 4 NH zmm registers), so
head dims that are multiples of 32 take this path; `ops.attention` sends the others to `_attend`.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ...numerics.simd import (LANES, f32, kahan, kahan1, v32_load, v32_splat, v32_zero, v_div, v_get, v_load,
                              v_max_range, v_mul, prefetch, prefetch_row, v_splat, v_store, v_zero)
from ...numerics.mathfn import exp32
from ...numerics.vmath import v_exp32_sub, v_tanh32

ATILE = 64  # cache positions per tile of the transposed key cache
PV_LANES = 32  # dims per pass of the grouped weighted sum of V


@njit(cache=True, inline="always")
def scaled(s, vscale, score_cap):
    """A tile of q.k sums times the scale, then soft-capped where score_cap != 0 (Gemma 2's attention
    logits: cap * tanh(s / cap), as three float32 steps with tinydet's tanh, as `ops.softcap` does the
    final logits). Without a cap, the scale's one multiply and nothing else."""
    s = v_mul(s, vscale)
    if score_cap != 0:
        c = v_splat(score_cap)
        s = v_mul(v_tanh32(v_div(s, c)), c)
    return s


@njit(cache=True, inline="always")
def _qk_pair(q, t, qa, qb, k_cache, kb, head_dim):
    """q.k of the heads at q[t, qa:], q[t, qb:] with the 64 keys of one tile (`ops._attend`'s chain)."""
    sa = v_zero()
    ca = v_zero()
    sb = v_zero()
    cb = v_zero()
    for d in range(head_dim):
        kv = v_load(k_cache, kb + d * ATILE)
        prefetch_row(k_cache, kb + (head_dim + d) * ATILE)  # the next tile's
        sa, ca = kahan(v_mul(v_splat(q[t, qa + d]), kv), sa, ca)
        sb, cb = kahan(v_mul(v_splat(q[t, qb + d]), kv), sb, cb)
    return sa, sb


def _pv_source(NH: int, pf: int = 16) -> str:
    """pv(sc, cap, lo, n, v_cache, vi, vrow, hd, out, oi, se, has_sink): for NH heads (head h's
    scores at sc[h cap:], its output at out[oi + h hd:]), each dim's Kahan sum over positions lo..n-1
    of score * v, 32 dims a pass, divided by the head's denominator (a Kahan sum of its scores in
    position order, summed beside the first pass, then, with has_sink, of its sink's se[h]). Written
    out per head: numba has no arrays of vectors."""
    H = range(NH)
    L = ["def pv(sc, cap, lo, n, v_cache, vi, vrow, hd, out, oi, se, has_sink):"]
    L += [f"    n{h} = f32(0.0)" for h in H]
    L += ["    for d in range(0, hd, PV_LANES):"]
    L += [f"        a{h} = v32_zero()\n        c{h} = v32_zero()" for h in H]
    L += ["        if d == 0:"]
    L += [f"            m{h} = f32(0.0)" for h in H]
    fetch = [f"                prefetch(v_cache, vi + (i + {pf}) * vrow + d)",
             f"                prefetch(v_cache, vi + (i + {pf}) * vrow + d + 16)"] if pf else []
    L += ["            for i in range(lo, n):", "                vv = v32_load(v_cache, vi + i * vrow + d)"] + fetch
    for h in H:
        L += [f"                e{h} = sc[{h} * cap + i]", f"                n{h}, m{h} = kahan1(e{h}, n{h}, m{h})",
              f"                a{h}, c{h} = kahan(v_mul(v32_splat(e{h}), vv), a{h}, c{h})"]
    L += ["            if has_sink:"]
    L += [f"                n{h}, m{h} = kahan1(se[{h}], n{h}, m{h})" for h in H]
    L += ["        else:", "            for i in range(lo, n):", "                vv = v32_load(v_cache, vi + i * vrow + d)"] + fetch
    L += [f"                a{h}, c{h} = kahan(v_mul(v32_splat(sc[{h} * cap + i]), vv), a{h}, c{h})" for h in H]
    L += [f"        v_store(out, oi + {h} * hd + d, v_div(a{h}, v32_splat(n{h})))" for h in H]
    return "\n".join(L)


def _pv(NH: int, pf: int = 16):
    env = {"prefetch": prefetch, "f32": f32, "kahan": kahan, "kahan1": kahan1, "v32_load": v32_load, "v32_splat": v32_splat,
           "v32_zero": v32_zero, "v_div": v_div, "v_mul": v_mul, "v_store": v_store, "PV_LANES": PV_LANES}
    exec(_pv_source(NH, pf), env)  # noqa: S102 (generated from the constants above)
    return njit(inline="always")(env["pv"])


@njit(cache=True, inline="always")
def exp_from_max(scores, base, j0, nt, mv, sinks, h):
    """Tiles j0 .. nt - 1 of the scores at scores[base:] replaced by exp32(s - m), m the largest lane
    of mv: the softmax numerators of head h, its running max kept as the scalar loop keeps it (a
    float64 holding a float32, as `ops._attend` documents). With sinks (n_heads,) (else empty), head
    h's sink logit joins the max last, and its numerator exp32(sink - m) is returned (else 0)."""
    m = -np.inf
    for i in range(LANES):
        e = v_get(mv, i)
        if e > m:
            m = e
    if sinks.shape[0] and sinks[h] > m:
        m = sinks[h]
    for j in range(j0, nt):
        v_store(scores, base + j * ATILE, v_exp32_sub(v_load(scores, base + j * ATILE), m))
    return exp32(sinks[h] - m) if sinks.shape[0] else f32(0.0)


def _attend_heads(NH: int):
    """attend(q, k_cache, v_cache, pos, slot, n_heads, n_kv_heads, head_dim, scale, score_cap, window, sinks,
    out, t, h0, scores): `ops._attend` for row t and heads h0 .. h0 + NH - 1 (one KV group; NH even),
    `scores` holding NH times the cache's capacity."""
    pv = _pv(NH)

    def attend(q, k_cache, v_cache, pos, slot, n_heads, n_kv_heads, head_dim, scale, score_cap, window, sinks, out,
               t, h0, scores):
        group = n_heads // n_kv_heads
        sl = slot[t]
        n = pos[t] + 1
        lo = max(0, n - window) if window > 0 else 0
        g = h0 // group
        kt = k_cache.shape[2]
        cap = kt * ATILE
        j0 = lo // ATILE
        nt = (n + ATILE - 1) // ATILE
        kbase = (sl * n_kv_heads + g) * kt * head_dim * ATILE
        vscale = v_splat(scale)
        for j in range(j0, nt):  # a tile's keys read once, for every head of the chunk
            kb = kbase + j * head_dim * ATILE
            for hp in range(0, NH, 2):
                sa, sb = _qk_pair(q, t, (h0 + hp) * head_dim, (h0 + hp + 1) * head_dim, k_cache, kb, head_dim)
                v_store(scores, hp * cap + j * ATILE, scaled(sa, vscale, score_cap))
                v_store(scores, (hp + 1) * cap + j * ATILE, scaled(sb, vscale, score_cap))
        se = np.empty(NH, np.float32)  # the sinks' numerators
        for h in range(NH):
            mv = v_splat(f32(-np.inf))
            for j in range(j0, nt):
                mv = v_max_range(mv, v_load(scores, h * cap + j * ATILE), lo - j * ATILE, n - j * ATILE)
            se[h] = exp_from_max(scores, h * cap, j0, nt, mv, sinks, h0 + h)
        pv(scores, cap, lo, n, v_cache, (sl * n_kv_heads + g) * v_cache.shape[2] * head_dim, head_dim, head_dim, out,
           t * out.shape[1] + h0 * head_dim, se, sinks.shape[0] > 0)

    return njit(inline="always")(attend)


attend2, attend4 = _attend_heads(2), _attend_heads(4)


@njit(cache=True, inline="always")
def chunking(T, n_heads, n_kv_heads, head_dim, nth):
    """(heads per chunk, chunks and single heads per KV group) for the grouped path, or (1, group)
    where it does not apply. Chunks of 4 where the row's groups keep every thread busy, else of 2; the
    heads left over run one by one. Only the split of work depends on it."""
    group = n_heads // n_kv_heads
    if group < 2 or head_dim % PV_LANES != 0:
        return 1, group
    cw = 4 if group >= 4 and T * n_kv_heads * (group // 4) >= nth else 2
    return cw, group // cw + group % cw
