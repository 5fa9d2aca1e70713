"""Every layer of the forward pass in one numba call (no tracing; `model.py` calls the kernels one by
one when tracing).

Each matrix kind (wqkv, wo, w13, w2), stacked over layers, is either float panels (L, P, K, 64) of
float32 or fp16 bits (`cpu`'s kernels), or a tuple `(qs, d, m)` of quantized panels (`qpack.stack`:
Q8_0, Q4_0 or Q4_1, dequantized inside `qcpu`'s kernels). Which kernel runs is chosen when numba
compiles, by the argument types. Both compute each output exactly as `cpu.matmul` does over the
float32 matrix; the other operations are the same kernels `model.py` calls one by one, in the same
order, so this pass gives the bits of the traced path, and native storage (quantized panels, float32
cache) gives fp32's. The residual adds are fused into the projections that feed them (each output
added by the thread that computed it), and SwiGLU into the gate/up projection where its width allows.
About five parallel regions per layer, with no Python in between.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from . import qcpu
from .cpu import (LANES, MM_PLAIN, MM_RESIDUAL, MM_SWIGLU, _attention_par, _mm, _swiglu_span, embed, embed_panels,
                  rmsnorm, rope_store)


def mm_layer(x, w, li, n_out, out, res, nth):
    """out = x W[li]^T, then res += out when res is an array (None: nothing more)."""
    raise NotImplementedError("mm_layer is for jitted code")


@overload(mm_layer)
def _mm_layer(x, w, li, n_out, out, res, nth):
    if isinstance(w, types.BaseTuple):
        return lambda x, w, li, n_out, out, res, nth: qcpu.q_mm_layer(x, w[0], w[1], w[2], li, n_out, out, res,
                                                                      nth)
    if isinstance(w, types.Array):
        if isinstance(res, types.NoneType):
            return lambda x, w, li, n_out, out, res, nth: _mm(x, w[li], n_out, out, nth, np.int64(MM_PLAIN), out,
                                                              out)
        return lambda x, w, li, n_out, out, res, nth: _mm(x, w[li], n_out, out, nth, np.int64(MM_RESIDUAL), res,
                                                          res)
    return None


@njit(parallel=True, cache=True)
def swiglu_rows(gu, ffn_dim, act):
    """act = silu(gate) * up, 64 lanes at a time (cpu's fused form: the same operations per output),
    a row per thread; one row runs on the calling thread."""
    T = gu.shape[0]
    if T == 1:
        _swiglu_span(gu, 0, ffn_dim, act, 0, ffn_dim)
    else:
        for t in prange(T):
            _swiglu_span(gu, t, ffn_dim, act, 0, ffn_dim)


def mm_swiglu_layer(x, w, li, ffn_dim, gu, act, nth):
    """gu = x W[li]^T ([gate | up]), act = silu(gate) * up."""
    raise NotImplementedError("mm_swiglu_layer is for jitted code")


@overload(mm_swiglu_layer)
def _mm_swiglu_layer(x, w, li, ffn_dim, gu, act, nth):
    if isinstance(w, types.Array):
        def impl(x, w, li, ffn_dim, gu, act, nth):
            if ffn_dim % LANES == 0:  # the fused form: the same operations per output
                _mm(x, w[li], 2 * ffn_dim, gu, nth, np.int64(MM_SWIGLU), gu, act)
            else:
                _mm(x, w[li], 2 * ffn_dim, gu, nth, np.int64(MM_PLAIN), gu, gu)
                swiglu_rows(gu, ffn_dim, act)
        return impl

    def impl_q(x, w, li, ffn_dim, gu, act, nth):
        qcpu.q_mm_layer(x, w[0], w[1], w[2], li, 2 * ffn_dim, gu, None, nth)
        swiglu_rows(gu, ffn_dim, act)
    return impl_q


@njit(cache=True)
def forward_layers(x, attn_norm, wqkv, wo, ffn_norm, w13, w2, k_cache, v_cache, pos, slot, cos, sin,
                   n_heads, n_kv_heads, head_dim, ffn_dim, eps, scale, nth):
    """x (T, dim): embedded tokens in, residual stream after the last layer out. Norms (L, dim), matrix
    kinds as in the module docstring, caches (L, ...) of `model.KVCache`. `nth`, the thread count,
    only shapes the split of work."""
    T, dim = x.shape
    q_dim = n_heads * head_dim
    kv_dim = n_kv_heads * head_dim
    n_qkv = q_dim + 2 * kv_dim
    h = np.empty((T, dim), np.float32)
    qkv = np.empty((T, n_qkv), np.float32)
    q = np.empty((T, q_dim), np.float32)
    att = np.empty((T, q_dim), np.float32)
    proj = np.empty((T, dim), np.float32)
    gu = np.empty((T, 2 * ffn_dim), np.float32)
    act = np.empty((T, ffn_dim), np.float32)
    for li in range(attn_norm.shape[0]):
        kc = k_cache[li]
        vc = v_cache[li]
        rmsnorm(x, attn_norm[li], eps, h)
        mm_layer(h, wqkv, li, n_qkv, qkv, None, nth)
        rope_store(qkv, q_dim, kv_dim, head_dim, cos, sin, pos, slot, kc, vc, q)
        _attention_par(q, kc, vc, pos, slot, n_heads, n_kv_heads, head_dim, scale, att)
        mm_layer(att, wo, li, dim, proj, x, nth)
        rmsnorm(x, ffn_norm[li], eps, h)
        mm_swiglu_layer(h, w13, li, ffn_dim, gu, act, nth)
        mm_layer(act, w2, li, dim, proj, x, nth)


def embed_rows(table, ids, x):
    """x[t] = row ids[t] of the embedding table: a float (vocab, dim) table, float panels (a tied
    output matrix), or a quantized panel tuple (qs, d, m)."""
    raise NotImplementedError("embed_rows is for jitted code")


@overload(embed_rows)
def _embed_rows(table, ids, x):
    if isinstance(table, types.BaseTuple):
        qs, m = table[0], table[2]
        if qs.dtype == types.int8:
            return lambda table, ids, x: qcpu._embed_q8_0(table[0], table[1], ids, x)
        if isinstance(m, types.NoneType):
            return lambda table, ids, x: qcpu._embed_q4_0(table[0], table[1], ids, x)
        return lambda table, ids, x: qcpu._embed_q4_1(table[0], table[1], table[2], ids, x)
    if isinstance(table, types.Array) and table.ndim == 3:
        return lambda table, ids, x: embed_panels(table, ids, x)
    return lambda table, ids, x: embed(table, ids, x)


def mm_out(x, w, n_out, out, nth):
    """out = x W^T for the output matrix: float panels or a quantized panel tuple."""
    raise NotImplementedError("mm_out is for jitted code")


@overload(mm_out)
def _mm_out(x, w, n_out, out, nth):
    if isinstance(w, types.BaseTuple):
        return lambda x, w, n_out, out, nth: qcpu.q_mm(x, w[0], w[1], w[2], n_out, out, None, nth)
    return lambda x, w, n_out, out, nth: _mm(x, w, n_out, out, nth, np.int64(MM_PLAIN), out, out)


@njit(cache=True)
def forward_logits(ids, table, attn_norm, wqkv, wo, ffn_norm, w13, w2, k_cache, v_cache, pos, slot, cos, sin,
                   n_heads, n_kv_heads, head_dim, ffn_dim, eps, scale, norm, w_out, n_out, rows, nth):
    """The whole pass in one call: embedding, every layer, the final norm of rows `rows` and their
    logits (len(rows), n_out). The same kernels, in the same order, as model.py's step-by-step path."""
    dim = attn_norm.shape[1]
    x = np.empty((ids.shape[0], dim), np.float32)
    embed_rows(table, ids, x)
    forward_layers(x, attn_norm, wqkv, wo, ffn_norm, w13, w2, k_cache, v_cache, pos, slot, cos, sin,
                   n_heads, n_kv_heads, head_dim, ffn_dim, eps, scale, nth)
    xr = np.empty((rows.shape[0], dim), np.float32)
    for i in range(rows.shape[0]):
        xr[i] = x[rows[i]]
    hn = np.empty((rows.shape[0], dim), np.float32)
    rmsnorm(xr, norm, eps, hn)
    logits = np.empty((rows.shape[0], n_out), np.float32)
    mm_out(hn, w_out, n_out, logits, nth)
    return logits
