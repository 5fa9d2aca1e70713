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

Where mm would take its units path for every chosen expert (decode: one row, each expert reading it;
or a few rows on quantized or fp16 panels, `loaders.few_rows`), the experts' products do not run as
an mm each (two parallel regions per expert, 17 a layer for 8 experts) but all in one region for
[w1; w3] with the gated activation and one for w2 (3 a layer with the router's): the units of every
chosen expert in a row, each thread an equal run of them weighed by rows (`_experts_job`), each run
computed by the function mm's decode jobs call (`matmul.units_span`) on the same rows, in the integer
mode quantized as mm quantizes them. mm's bits depend on neither the split nor the thread count, so a row's bits are the
same on either path. Many rows (prefill) keep an mm per expert, and that code apart from the units
path's (`_units_path`): compiled into one function with it, a 128-row prompt's mixture took 1.06-1.12x
the time (Qwen3-30B-A3B shapes, Q4_0, native and int8).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from .loaders import act_alloc, few_rows, layer, quantizes, units
from ...numerics.mathfn import exp32
from .matmul import MM_GLU, MM_PLAIN, _quantize_rows, mm, units_span
from .ops import add_bias, glu_rows, glu_span
from ...numerics.simd import LANES, f32

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
    # mm's units path for every expert, whatever its share of the T rows (few_rows holds for every
    # count up to T): all of them in one parallel region per matrix
    if T == 1 or (few_rows(layer(w13, li * E), T) and few_rows(layer(w2, li * E), T)):
        _units_path(h, li, w13, b13, w2, b2, E, n_used, ffn_dim, act, sel, wt, out, nth)
        return
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


@njit(cache=True)
def _units_path(h, li, w13, b13, w2, b2, E, n_used, ffn_dim, act, sel, wt, out, nth):
    """moe_ffn's experts where each takes mm's units path (one row: decode; or `few_rows`): the chosen
    experts in a row, each with its rows (gathered), [w1; w3] and the GLU in one parallel region, w2 in
    another; then the weighted sum as moe_ffn's."""
    T, dim = h.shape
    P = T * n_used
    # the chosen experts (ws: their index in the stacks), ascending, and each one's run [r0, r1) of
    # the (row, rank) pairs grouped by expert, rows in order within each; at: each pair's place
    r0 = np.zeros(E + 1, np.int64)
    for t in range(T):
        for r in range(n_used):
            r0[sel[t, r] + 1] += 1
    n_chosen = 0
    for e in range(E):
        if r0[e + 1] > 0:
            n_chosen += 1
        r0[e + 1] += r0[e]
    ws = np.empty(n_chosen, np.int64)
    c0 = np.empty(n_chosen, np.int64)
    c1 = np.empty(n_chosen, np.int64)
    j = 0
    for e in range(E):
        if r0[e + 1] > r0[e]:
            ws[j] = li * E + e
            c0[j] = r0[e]
            c1[j] = r0[e + 1]
            j += 1
    fill = r0[:E].copy()
    at = np.empty(P, np.int64)
    for t in range(T):
        for r in range(n_used):
            at[t * n_used + r] = fill[sel[t, r]]
            fill[sel[t, r]] += 1
    # each pair's input row: h itself for one row (every expert reads row 0), else gathered
    x = h
    i0, i1 = np.zeros(n_chosen, np.int64), np.ones(n_chosen, np.int64)
    if T > 1:
        x = np.empty((P, dim), np.float32)
        for t in range(T):
            for r in range(n_used):
                for d in range(dim):
                    x[at[t * n_used + r], d] = h[t, d]
        i0, i1 = c0, c1
    gu = np.empty((P, 2 * ffn_dim), np.float32)
    a = np.empty((P, ffn_dim), np.float32)
    y = np.empty((P, dim), np.float32)
    # modes and kinds as values, not constants (each constant would compile _experts_units once more)
    plain, none = np.int64(MM_PLAIN), np.int64(0)
    if ffn_dim % LANES == 0 and b13.shape[1] == 0:
        _experts_units(x, i0, i1, w13, ws, 2 * ffn_dim, gu, c0, nth, np.int64(MM_GLU), a, act)
    else:
        _experts_units(x, i0, i1, w13, ws, 2 * ffn_dim, gu, c0, nth, plain, gu, none)
        _expert_biases(gu, b13, ws, c0, c1)
        glu_span(gu, np.int64(0), P, ffn_dim, a, np.int64(0), ffn_dim, act)  # a few rows: on this thread
    _experts_units(a, c0, c1, w2, ws, dim, y, c0, nth, plain, y, none)
    _expert_biases(y, b2, ws, c0, c1)
    for t in range(T):
        for d in range(dim):
            acc = wt[t, 0] * y[at[t * n_used], d]
            for r in range(1, n_used):
                acc = acc + wt[t, r] * y[at[t * n_used + r], d]
            out[t, d] = acc


@njit(cache=True)
def _expert_biases(out, b, ws, c0, c1):
    """Rows c0[j] .. c1[j] of out += expert ws[j]'s bias (b: (L E, width), or width 0: none)."""
    if b.shape[1]:
        for j in range(ws.shape[0]):
            add_bias(out[c0[j]:c1[j]], b[ws[j]])


@njit(parallel=True, cache=True)
def _experts_units(x, i0, i1, w, ws, n_out, out, o0, nth, mode, act, kind):
    """For each chosen expert j: rows o0[j] .. of out (and of act, the GLU's) = mm's units path, with
    the epilogue of `mode`, on rows i0[j] .. i1[j] of x and the stack w's matrix ws[j]."""
    w0 = layer(w, ws[0])
    xa = act_alloc(x, w0)
    if quantizes(w0):  # every row once, on this thread (the function mm's threads run: compiled once)
        _quantize_rows(x, w0, xa, np.int64(0), np.int64(1))
    for th in prange(nth):
        _experts_job(xa, i0, i1, w, ws, n_out, out, o0, np.int64(th), nth, mode, act, kind)


@njit(cache=True)
def _experts_job(xa, i0, i1, w, ws, n_out, out, o0, th, nth, mode, act, kind):
    # The experts' units in a row, each weighing its rows (expert j's out rows o0[j] .. are the pairs'
    # running count, so its units start at o0[j] U), each thread an equal run of that weight: a unit
    # goes to the thread whose run holds its start. Only the split, which no output's bits depend on
    # (as mm's over one matrix); a GLU's unit covers its gate and up parts.
    parts = 2 if mode == MM_GLU else 1
    U = units(layer(w, ws[0])) // parts  # the experts of a stack have one shape
    last = ws.shape[0] - 1
    N = (o0[last] + i1[last] - i0[last]) * U
    lo, hi = th * N // nth, (th + 1) * N // nth
    for j in range(ws.shape[0]):
        n = i1[j] - i0[j]
        c = o0[j] * U
        u0 = min(U, max(0, (lo - c + n - 1) // n))  # the first unit starting at or after lo
        u1 = min(U, max(0, (hi - c + n - 1) // n))
        if u0 < u1:
            o = out[o0[j]:o0[j] + n]
            units_span(act_part(xa, i0[j], i1[j]), n, layer(w, ws[j]), n_out, o, u0, u1, parts, mode, o,
                       act[o0[j]:o0[j] + n], kind)


def act_part(xa, a, b):
    raise NotImplementedError("act_part is for jitted code")


@overload(act_part, inline="always")
def _act_part(xa, a, b):
    """Rows a .. b of `act_alloc`'s activations: of x, or of each array of its tuple (views)."""
    if isinstance(xa, types.Array):
        return lambda xa, a, b: xa[a:b]
    src = "def f(xa, a, b):\n    return (" + "".join(f"xa[{i}][a:b], " for i in range(len(xa))) + ")"
    scope = {}
    exec(src, scope)  # noqa: S102 (one slice per array of the tuple)
    return scope["f"]
