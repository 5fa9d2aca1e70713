"""The Llama forward pass over a preallocated KV cache. `forward` returns logits; it knows nothing of
sampling or tokens beyond their ids."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np

from .config import Config
from .errors import ContextLengthError, TinydetError
from .kernels import cpu
from .kernels.mathfn import exp64, log64

DTYPES = ("fp32", "fp16")


def storage(a: np.ndarray, dtype: str) -> np.ndarray:
    """float32 -> the storage type of `dtype` (fp16 rounds here, once, to nearest even)."""
    return a if dtype == "fp32" else cpu.to_f16_bits(np.ascontiguousarray(a, np.float32))


@dataclass
class Layer:
    attn_norm: np.ndarray  # (dim,) f32
    wqkv: np.ndarray  # panels of [wq; wk; wv]: (ceil((q_dim + 2 kv_dim)/64), dim, 64)
    wo: np.ndarray  # panels (ceil(dim/64), q_dim, 64)
    ffn_norm: np.ndarray  # (dim,) f32
    w13: np.ndarray  # panels of [w1; w3]: (ceil(2 ffn/64), dim, 64)
    w2: np.ndarray  # panels (ceil(dim/64), ffn, 64)


class KVCache:
    """Keys (after RoPE) and values for `n_slots` sequences, written by position:
    (layer, slot, capacity, kv_dim) each. `lengths[slot]` counts the positions filled."""

    def __init__(self, cfg: Config, capacity: int, dtype: str, n_slots: int = 1):
        st = np.float32 if dtype == "fp32" else np.uint16
        self.k = np.zeros((cfg.n_layers, n_slots, capacity, cfg.kv_dim), st)
        self.v = np.zeros((cfg.n_layers, n_slots, capacity, cfg.kv_dim), st)
        self.capacity = capacity
        self.lengths = np.zeros(n_slots, np.int64)

    @property
    def length(self) -> int:
        """Positions filled in slot 0 (the whole cache when it holds one sequence)."""
        return int(self.lengths[0])

    def reset(self, slot: int) -> None:
        """Free a slot for a new sequence (old entries are overwritten before they are read)."""
        self.lengths[slot] = 0


class Transformer:
    """Packed weights and the forward pass. Build with `Transformer(cfg, weights, dtype)` where
    `weights` holds float32 arrays under the canonical names of `weights.py`."""

    def __init__(self, cfg: Config, weights: dict[str, np.ndarray], dtype: str = "fp32"):
        if dtype not in DTYPES:
            raise TinydetError(f"dtype: expected one of {', '.join(DTYPES)}, found {dtype!r}")
        self.cfg, self.dtype = cfg, dtype
        f32 = lambda a: np.ascontiguousarray(a, np.float32)  # noqa: E731
        packed = lambda a: storage(cpu.pack_panels(f32(a)), dtype)  # noqa: E731
        self.tok_embeddings = storage(f32(weights["tok_embeddings"]), dtype)  # (vocab, dim)
        self.norm = f32(weights["norm"])  # (dim,)
        self.output = packed(weights["output"])  # (ceil(vocab/64), dim, 64)
        self.layers = []
        for i in range(cfg.n_layers):
            w = lambda n: weights[f"layers.{i}.{n}"]  # noqa: E731
            self.layers.append(Layer(
                attn_norm=f32(w("attention_norm")),
                wqkv=packed(np.concatenate([w("wq"), w("wk"), w("wv")])),
                wo=packed(w("wo")),
                ffn_norm=f32(w("ffn_norm")),
                w13=packed(np.concatenate([w("w1"), w("w3")])),
                w2=packed(w("w2")),
            ))
        # theta_i = base**(-2i/hd), in float64 with tinydet's own exp/log: the same bits on every CPU.
        ln_base = log64(cfg.rope_base)
        self.inv_freq = np.array([exp64(-(2.0 * i / cfg.head_dim) * ln_base) for i in range(cfg.head_dim // 2)])
        self._cos = np.zeros((0, cfg.head_dim // 2), np.float32)
        self._sin = self._cos
        self.scale = np.float32(1.0 / math.sqrt(cfg.head_dim))
        self.eps = np.float32(cfg.rms_eps)

    def new_cache(self, capacity: int, n_slots: int = 1) -> KVCache:
        if capacity > self.cfg.context_length:
            raise ContextLengthError(
                f"{capacity} positions requested but the model's context length is {self.cfg.context_length}")
        return KVCache(self.cfg, capacity, self.dtype, n_slots)

    def _rope(self, n_pos: int):
        # Entries depend only on their own position, so growing the table never changes old rows.
        if self._cos.shape[0] < n_pos:
            n = max(n_pos, min(2 * self._cos.shape[0], self.cfg.context_length))
            cos = np.empty((n, self.cfg.head_dim // 2), np.float32)
            sin = np.empty_like(cos)
            cpu.rope_tables(n, self.inv_freq, cos, sin)
            self._cos, self._sin = cos, sin
        return self._cos, self._sin

    def forward(self, tokens, cache: KVCache, all_logits: bool = False, threads: int | None = None,
                slot: int = 0) -> np.ndarray:
        """Run `tokens` (ids at positions cache.lengths[slot]..) through the model, appending to the
        cache. Returns float32 logits: (len(tokens), vocab) if `all_logits`, else (1, vocab) for the last."""
        return self.forward_batch([(slot, tokens)], cache, all_logits, threads)[0]

    def forward_batch(self, items, cache: KVCache, all_logits: bool = False, threads: int | None = None,
                      tracer=None):
        """One pass over several sequences: `items` is [(slot, token ids), ...], each continuing its
        slot of `cache`. Returns one logits array per item, as `forward` would for it alone: every row
        is computed by the same per-output arithmetic whatever else shares the pass. `tracer`
        (see trace.py) records every op's output per position; None costs nothing."""
        cfg = self.cfg
        ids_l, pos_l, slot_l, ends = [], [], [], []
        seen = set()
        for slot, toks in items:
            toks = np.asarray(toks, np.int64).reshape(-1)
            if toks.shape[0] == 0:
                raise TinydetError("forward: expected at least one token")
            if slot in seen or not 0 <= slot < cache.lengths.shape[0]:
                raise TinydetError(f"forward: slot {slot} is repeated or outside 0..{cache.lengths.shape[0] - 1}")
            seen.add(slot)
            start = int(cache.lengths[slot])
            if start + toks.shape[0] > cache.capacity:
                raise ContextLengthError(
                    f"{start + toks.shape[0]} positions needed but the KV cache holds {cache.capacity}")
            ids_l.append(toks)
            pos_l.append(np.arange(start, start + toks.shape[0], dtype=np.int64))
            slot_l.append(np.full(toks.shape[0], slot, np.int64))
            ends.append(sum(a.shape[0] for a in ids_l))
        ids = np.concatenate(ids_l)
        pos = np.concatenate(pos_l)
        slots = np.concatenate(slot_l)
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise TinydetError(f"token ids must lie in [0, {cfg.vocab_size}), found {int(ids.min())}..{int(ids.max())}")
        if threads is not None:
            numba.set_num_threads(threads)
        T = ids.shape[0]
        cos, sin = self._rope(int(pos.max()) + 1)
        x = np.empty((T, cfg.dim), np.float32)  # residual stream
        cpu.embed(self.tok_embeddings, ids, x)
        rec = tracer.record if tracer is not None else None
        if rec:
            rec(None, "embedding", pos, slots, x)
        h = np.empty_like(x)
        qkv = np.empty((T, cfg.q_dim + 2 * cfg.kv_dim), np.float32)
        q = np.empty((T, cfg.q_dim), np.float32)
        att = np.empty((T, cfg.q_dim), np.float32)
        proj = np.empty_like(x)
        gu = np.empty((T, 2 * cfg.ffn_dim), np.float32)
        act = np.empty((T, cfg.ffn_dim), np.float32)
        qd, kvd, fd = cfg.q_dim, cfg.kv_dim, cfg.ffn_dim
        for li, layer in enumerate(self.layers):
            kc, vc = cache.k[li], cache.v[li]
            cpu.rmsnorm(x, layer.attn_norm, self.eps, h)
            cpu.matmul(h, layer.wqkv, qkv.shape[1], qkv)
            cpu.rope_store(qkv, qd, kvd, cfg.head_dim, cos, sin, pos, slots, kc, vc, q)
            if rec:
                rec(li, "attn_norm", pos, slots, h)
                rec(li, "q", pos, slots, qkv[:, :qd])
                rec(li, "k", pos, slots, qkv[:, qd:qd + kvd])
                rec(li, "v", pos, slots, qkv[:, qd + kvd:])
                rec(li, "rope_q", pos, slots, q)
                rec(li, "rope_k", pos, slots, cpu.widen_rows(kc, slots, pos))
            cpu.attention(q, kc, vc, pos, slots, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, self.scale, att)
            cpu.matmul(att, layer.wo, cfg.dim, proj)
            if rec:
                rec(li, "attention", pos, slots, att)
                rec(li, "attn_output", pos, slots, proj)
            cpu.add_inplace(x, proj)
            cpu.rmsnorm(x, layer.ffn_norm, self.eps, h)
            cpu.matmul(h, layer.w13, 2 * fd, gu)
            cpu.swiglu(gu, fd, act)
            if rec:
                rec(li, "attn_residual", pos, slots, x)
                rec(li, "ffn_norm", pos, slots, h)
                rec(li, "gate", pos, slots, gu[:, :fd])
                rec(li, "up", pos, slots, gu[:, fd:])
                rec(li, "activation", pos, slots, act)
            cpu.matmul(act, layer.w2, cfg.dim, proj)
            cpu.add_inplace(x, proj)
            if rec:
                rec(li, "down", pos, slots, proj)
                rec(li, "ffn_residual", pos, slots, x)
        for (slot, _), a in zip(items, ids_l):
            cache.lengths[slot] += a.shape[0]
        starts = [0] + ends[:-1]
        if all_logits:
            rows = np.arange(T)
        else:
            rows = np.array([e - 1 for e in ends])
        hn = np.empty((rows.shape[0], cfg.dim), np.float32)
        cpu.rmsnorm(np.ascontiguousarray(x[rows]), self.norm, self.eps, hn)
        logits = np.empty((rows.shape[0], cfg.vocab_size), np.float32)
        cpu.matmul(hn, self.output, cfg.vocab_size, logits)
        if rec:
            rec(None, "final_norm", pos[rows], slots[rows], hn)
            rec(None, "logits", pos[rows], slots[rows], logits)
        if all_logits:
            return [logits[a:b] for a, b in zip(starts, ends)]
        return [logits[i:i + 1] for i in range(len(items))]
