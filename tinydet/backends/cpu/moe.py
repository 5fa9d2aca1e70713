"""The mixture-of-experts FFN (`ModelConfig.n_experts`): routing, the chosen experts' products, and
their weighted sum, each row's arithmetic fixed whatever else is in the batch.

Per row t of the normed input h:
  router logits   l = h R^T (+ its bias: gpt-oss), the one matrix product (`matmul.mm`): the same
                  bits alone or batched;
  choice          the n_used largest logits, by strict comparison, so that of equal logits the lower
                  expert id ranks first (ties broken by id, never by arrival or thread), a NaN below
                  every number; rank r is the r-th chosen;
  weights         "softmax" gating: p_e = exp(l_e - m) / s over every expert (m the largest logit, s
                  the sum of the exponentials in expert order), taken at the chosen ones and, with
                  norm_topk, divided by their sum in rank order; "softmax_topk": the same softmax over
                  the chosen logits only, in rank order. exp is `mathfn.exp32`: the same bits on every
                  machine;
  expert outputs  y_r = FFN_e(h_t) of expert e = the rank-r choice: its [w1; w3] product with the
                  gated activation, then its w2 product, each the one matrix product (each adding
                  its bias to the finished outputs where the model has them: gpt-oss);
  sum             out_t = w_0 y_0 + w_1 y_1 + ... in rank order, one float32 rounding per product and
                  per addition (the model's own weights on the model's own order, never arrival's).
A batch groups its rows by expert, so that each expert's matrices are read once per step for every
row that chose it; the one matrix product gives each row the bits it has alone, so grouping changes
no row's arithmetic. Only the chosen experts' weights are read.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .loaders import layer
from .mathfn import exp32
from .matmul import MM_GLU, MM_PLAIN, mm
from .ops import add_bias, glu_rows
from .simd import LANES, f32

SOFTMAX, SOFTMAX_TOPK = 0, 1  # ModelConfig.moe_gating "softmax", "softmax_topk"


@njit(cache=True)
def route(logits, n_used, gating, norm, sel, wt):
    """sel[t, r], wt[t, r]: the expert of rank r of row t and its weight (module docstring)."""
    T, E = logits.shape
    for t in range(T):
        for r in range(n_used):
            best = -1
            for e in range(E):
                taken = False
                for q in range(r):
                    taken = taken or sel[t, q] == e
                # strict: an equal logit never displaces a lower id; a NaN ranks below every number
                if not taken and (best < 0 or logits[t, e] > logits[t, best]
                                  or (logits[t, best] != logits[t, best] and logits[t, e] == logits[t, e])):
                    best = e
            sel[t, r] = best
        m = logits[t, sel[t, 0]]
        if gating == SOFTMAX:
            for e in range(E):  # the largest logit (sel[t, 0]'s unless NaNs)
                if logits[t, e] > m:
                    m = logits[t, e]
            s = f32(0.0)
            for e in range(E):
                s += exp32(logits[t, e] - m)
        else:
            s = f32(0.0)
            for r in range(n_used):
                s += exp32(logits[t, sel[t, r]] - m)
        for r in range(n_used):
            wt[t, r] = exp32(logits[t, sel[t, r]] - m) / s
        if gating == SOFTMAX and norm:
            z = f32(0.0)
            for r in range(n_used):
                z += wt[t, r]
            for r in range(n_used):
                wt[t, r] = wt[t, r] / z


@njit(cache=True)
def moe_ffn(h, li, experts, n_experts, n_used, gating, norm, ffn_dim, act, out, logits, nth, wbuf):
    """out (T, dim) = the mixture's output for the rows of h (T, dim) in layer li; `logits` (T,
    n_experts) receives the router's. experts = (router, router_bias, w13, b13, w2, b2): router a
    stack over layers, its bias (L, n_experts); w13 ([w1; w3]) and w2 stacks over (layer, expert),
    layer li's expert e at li * n_experts + e, their biases (L E, 2 ffn_dim) and (L E, dim); a bias
    array of width 0 where the model has none. A bias is added to each finished output (one
    rounding), before the activation."""
    router, rb, w13, b13, w2, b2 = experts
    T, dim = h.shape
    E = n_experts
    mm(h, layer(router, li), E, logits, nth, MM_PLAIN, logits, logits, 0, wbuf)
    if rb.shape[1]:
        add_bias(logits, rb[li])
    sel = np.empty((T, n_used), np.int64)
    wt = np.empty((T, n_used), np.float32)
    route(logits, n_used, gating, norm, sel, wt)
    # (row, rank) pairs grouped by expert, rows in order within each: a counting sort
    start = np.zeros(E + 1, np.int64)
    for t in range(T):
        for r in range(n_used):
            start[sel[t, r] + 1] += 1
    for e in range(E):
        start[e + 1] += start[e]
    fill = start[:E].copy()
    pairs = np.empty(T * n_used, np.int64)  # t * n_used + r
    for t in range(T):
        for r in range(n_used):
            e = sel[t, r]
            pairs[fill[e]] = t * n_used + r
            fill[e] += 1
    ys = np.empty((T * n_used, dim), np.float32)  # y of each (row, rank)
    for e in range(E):
        n = start[e + 1] - start[e]
        if n == 0:
            continue
        xe = np.empty((n, dim), np.float32)
        for j in range(n):
            t = pairs[start[e] + j] // n_used
            for d in range(dim):
                xe[j, d] = h[t, d]
        gu = np.empty((n, 2 * ffn_dim), np.float32)
        a = np.empty((n, ffn_dim), np.float32)
        w = li * E + e
        if ffn_dim % LANES == 0 and b13.shape[1] == 0:
            mm(xe, layer(w13, w), 2 * ffn_dim, gu, nth, MM_GLU, gu, a, act, wbuf)
        else:
            mm(xe, layer(w13, w), 2 * ffn_dim, gu, nth, MM_PLAIN, gu, gu, 0, wbuf)
            if b13.shape[1]:
                add_bias(gu, b13[w])
            glu_rows(gu, ffn_dim, a, act)
        ye = np.empty((n, dim), np.float32)
        mm(a, layer(w2, w), dim, ye, nth, MM_PLAIN, ye, ye, 0, wbuf)
        if b2.shape[1]:
            add_bias(ye, b2[w])
        for j in range(n):
            p = pairs[start[e] + j]
            for d in range(dim):
                ys[p, d] = ye[j, d]
    for t in range(T):
        for d in range(dim):
            acc = wt[t, 0] * ys[t * n_used, d]
            for r in range(1, n_used):
                acc = acc + wt[t, r] * ys[t * n_used + r, d]
            out[t, d] = acc
