"""The one forward pass of the CPU backend: embedding, every layer, the final norm and the logits, in one
numba call with no Python in between (about five parallel regions per layer).

Each matrix kind, stacked over layers, is float panels or quantized panels (`loaders.py`); which
loader runs is chosen when numba compiles, by the argument types, and every one gives the bits of the
float32 matrix. Without a hook the residual adds are fused into the projections that feed them (each
output added by the thread that computed it) and the gated activation into the gate/up projection
where its width allows (ffn_dim % 64 == 0). Fused or not, every output takes the same operations.

The op hook (`hook`, 0 for none) is how the pass is traced and how tests inject faults: after each op
the pass calls the hook with that op's output rows, which it may read (a trace) or change in place (a
fault: the next op reads what the hook left). With a hook every fusion is undone, so that each op's
output exists on its own: the same kernels, the same arithmetic, one more pass over a few arrays. The
call goes through numba's object mode and is compiled in but skipped when there is no hook.
"""

from __future__ import annotations

import warnings

import numpy as np
from numba import njit, objmode
from numba.core.errors import NumbaWarning

from ..base import OPS
from .loaders import embed_rows, layer
from .matmul import MM_GLU, MM_PLAIN, MM_RESIDUAL, mm, scratch
from .moe import moe_ffn
from .ops import add_bias, add_rows, attention, glu_rows, rmsnorm, rope_store, scale_rows, softcap, widen_rows
from ...numerics.simd import LANES

(EMBEDDING, ATTN_NORM, Q, K, V, ROPE_Q, ROPE_K, ATTENTION, ATTN_OUTPUT, POST_ATTN_NORM, ATTN_RESIDUAL, FFN_NORM, GATE,
 UP, ACTIVATION, DOWN, POST_FFN_NORM, FFN_RESIDUAL, FINAL_NORM, LOGITS, ROUTER) = range(len(OPS))

HOOKS: dict[int, object] = {}  # hook id -> callable(layer or None, op name, pos, slots, rows)

# numba warns that object mode cannot run in parallel under nogil; the hook is meant to hold the GIL.
warnings.filterwarnings("ignore", category=NumbaWarning, module=__name__)


def _call_hook(hook_id, layer_index, op, pos, slot, a, c0, c1):
    HOOKS[hook_id](None if layer_index < 0 else int(layer_index), OPS[op], pos, slot, a[:, c0:c1])


@njit(cache=True)
def _see(hook, li, op, pos, slot, a, c0, c1):
    if hook != 0:
        with objmode():
            _call_hook(hook, li, op, pos, slot, a, c0, c1)


@njit(cache=True, inline="always")
def _project(x, w, b, li, n_out, out, res, post, eps, nth, wbuf, hook, op, post_op, res_op, pos, slot):
    """out = x W[li]^T (+ b[li] where the model has that bias), then res += out, with a post-norm of
    out first where the model has one."""
    if hook == 0 and post.shape[1] == 0 and b.shape[1] == 0:
        mm(x, layer(w, li), n_out, out, nth, MM_RESIDUAL, res, res, 0, wbuf)
    else:
        mm(x, layer(w, li), n_out, out, nth, MM_PLAIN, out, out, 0, wbuf)
        if b.shape[1]:
            add_bias(out, b[li])
        _add_output(out, res, post, li, eps, n_out, hook, op, post_op, pos, slot)
    _see(hook, li, res_op, pos, slot, res, 0, n_out)


@njit(cache=True, inline="always")
def _add_output(out, res, post, li, eps, n_out, hook, op, post_op, pos, slot):
    """res += out, a block's output shown as `op`, with its post-norm first where the model has one."""
    _see(hook, li, op, pos, slot, out, 0, n_out)
    if post.shape[1]:
        rmsnorm(out, post[li], eps, out)
        _see(hook, li, post_op, pos, slot, out, 0, n_out)
    add_rows(res, out)


@njit(cache=True, nogil=True)
def forward(ids, pos, slot, rows, w, experts, k_cache, v_cache, cos, sin, layer_rope, windows, n_heads, n_kv_heads,
            head_dim, ffn_dim, act, moe, eps, attn_scale, embed_scale, logit_cap, attn_cap, n_out, nth, hook):
    """Logits (len(rows), n_out) of rows `rows` of tokens `ids` at positions `pos` of sequences
    `slot`, appending each token's key and value to the caches.

    w = (table, attn_norm, wqkv, bqkv, q_norm, k_norm, wo, bo, sinks, post_attn_norm, ffn_norm, w13, w2,
    post_ffn_norm, norm, output), as `packing.weights.CPUWeights` holds them; `experts` (router, router_bias,
    w13e, b13e, w2e, b2e) for a mixture of experts, else None (numba then leaves the mixture's branch
    out); caches (L, ...) of
    `KVCache`; cos, sin (R, positions, head_dim / 2) with layer l using table layer_rope[l] (-1: a NoPE
    layer, no rotation); windows (L,) the sliding window of each layer (0: none); act ops.SILU,
    GELU_TANH or SWIGLU_OAI; moe (n_experts, n_experts_used, moe.SOFTMAX or SOFTMAX_TOPK, norm_topk); embed_scale,
    logit_cap, attn_cap (attention scores' soft cap) 0 for none; nth, the thread count, only shapes the
    split of work; hook an id of HOOKS, or 0."""
    (table, attn_norm, wqkv, bqkv, q_norm, k_norm, wo, bo, sinks, post_attn_norm, ffn_norm, w13, w2, post_ffn_norm,
     norm, w_out) = w
    n_experts, n_used, gating, norm_topk = moe
    T = ids.shape[0]
    dim = attn_norm.shape[1]
    q_dim = n_heads * head_dim
    kv_dim = n_kv_heads * head_dim
    n_qkv = q_dim + 2 * kv_dim
    x = np.empty((T, dim), np.float32)  # the residual stream
    h = np.empty((T, dim), np.float32)
    qkv = np.empty((T, n_qkv), np.float32)
    q = np.empty((T, q_dim), np.float32)
    att = np.empty((T, q_dim), np.float32)
    proj = np.empty((T, dim), np.float32)
    gu = np.empty((T, 2 * ffn_dim), np.float32)
    a = np.empty((T, ffn_dim), np.float32)
    rl = np.empty((T, n_experts), np.float32)  # router logits
    wbuf = scratch(nth, max(dim, q_dim, ffn_dim))
    no_bias = np.zeros((1, 0), np.float32)  # the dense FFN's down projection has none
    embed_rows(table, ids, x)
    if embed_scale != 0:
        scale_rows(x, embed_scale)
    _see(hook, -1, EMBEDDING, pos, slot, x, 0, dim)
    for li in range(attn_norm.shape[0]):
        kc = k_cache[li]
        vc = v_cache[li]
        rmsnorm(x, attn_norm[li], eps, h)
        _see(hook, li, ATTN_NORM, pos, slot, h, 0, dim)
        mm(h, layer(wqkv, li), n_qkv, qkv, nth, MM_PLAIN, qkv, qkv, 0, wbuf)
        if bqkv.shape[1]:
            add_bias(qkv, bqkv[li])
        _see(hook, li, Q, pos, slot, qkv, 0, q_dim)
        _see(hook, li, K, pos, slot, qkv, q_dim, q_dim + kv_dim)
        _see(hook, li, V, pos, slot, qkv, q_dim + kv_dim, n_qkv)
        r = layer_rope[li]
        rope_store(qkv, q_dim, kv_dim, head_dim, cos[max(r, 0)], sin[max(r, 0)], r >= 0, pos, slot, kc, vc, q,
                   q_norm[li], k_norm[li], eps)
        _see(hook, li, ROPE_Q, pos, slot, q, 0, q_dim)
        if hook != 0:
            _see(hook, li, ROPE_K, pos, slot, widen_rows(kc, slot, pos), 0, kv_dim)  # what the cache holds
        attention(q, kc, vc, pos, slot, n_heads, n_kv_heads, head_dim, attn_scale, attn_cap, windows[li], sinks[li],
                  att, nth)
        _see(hook, li, ATTENTION, pos, slot, att, 0, q_dim)
        _project(att, wo, bo, li, dim, proj, x, post_attn_norm, eps, nth, wbuf, hook, ATTN_OUTPUT, POST_ATTN_NORM,
                 ATTN_RESIDUAL, pos, slot)
        rmsnorm(x, ffn_norm[li], eps, h)
        _see(hook, li, FFN_NORM, pos, slot, h, 0, dim)
        if experts is not None:
            moe_ffn(h, li, experts, n_experts, n_used, gating, norm_topk, ffn_dim, act, proj, rl, nth, wbuf)
            _see(hook, li, ROUTER, pos, slot, rl, 0, n_experts)
            _add_output(proj, x, post_ffn_norm, li, eps, dim, hook, DOWN, POST_FFN_NORM, pos, slot)
            _see(hook, li, FFN_RESIDUAL, pos, slot, x, 0, dim)
            continue
        if hook == 0 and ffn_dim % LANES == 0:
            mm(h, layer(w13, li), 2 * ffn_dim, gu, nth, MM_GLU, gu, a, act, wbuf)
        else:
            mm(h, layer(w13, li), 2 * ffn_dim, gu, nth, MM_PLAIN, gu, gu, 0, wbuf)
            _see(hook, li, GATE, pos, slot, gu, 0, ffn_dim)
            _see(hook, li, UP, pos, slot, gu, ffn_dim, 2 * ffn_dim)
            glu_rows(gu, ffn_dim, a, act)
            _see(hook, li, ACTIVATION, pos, slot, a, 0, ffn_dim)
        _project(a, w2, no_bias, li, dim, proj, x, post_ffn_norm, eps, nth, wbuf, hook, DOWN, POST_FFN_NORM,
                 FFN_RESIDUAL, pos, slot)
    xr = np.empty((rows.shape[0], dim), np.float32)
    pr = np.empty(rows.shape[0], np.int64)
    sr = np.empty(rows.shape[0], np.int64)
    for i in range(rows.shape[0]):
        for d in range(dim):  # by element: a row assignment compiles numba's shape-error path (2 s)
            xr[i, d] = x[rows[i], d]
        pr[i] = pos[rows[i]]
        sr[i] = slot[rows[i]]
    hn = np.empty((rows.shape[0], dim), np.float32)
    rmsnorm(xr, norm, eps, hn)
    _see(hook, -1, FINAL_NORM, pr, sr, hn, 0, dim)
    logits = np.empty((rows.shape[0], n_out), np.float32)
    if rows.shape[0]:
        mm(hn, w_out, n_out, logits, nth, MM_PLAIN, logits, logits, 0, wbuf)
    if logit_cap != 0:
        softcap(logits, n_out, logit_cap)
    _see(hook, -1, LOGITS, pr, sr, logits, 0, n_out)
    return logits
