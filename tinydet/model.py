"""The Llama forward pass over a preallocated KV cache. `forward` returns logits; it knows nothing of
sampling or tokens beyond their ids."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np

from . import qpack
from .config import ModelConfig as Config
from .errors import ContextLengthError, TinydetError
from .formats import Tensor
from .formats.ggml import F16, F32
from .kernels import cpu, forward, qcpu
from .kernels.mathfn import exp64, log64

# fp32: float32 weights; fp16: weights and KV cache as binary16; native: each matrix as the file
# stores it (Q8_0/Q4_0/Q4_1 blocks, F16 or F32; other types dequantized), float32 everywhere else,
# computing the bits of fp32.
DTYPES = ("fp32", "fp16", "native")
# The one-call pass (forward.forward_logits) uses these kernels inside; a replaced one (tests inject faults)
# routes the pass through the kernels one by one, where the replacement is seen.
_MATMULS = (cpu.matmul, qcpu.qmatmul)


def storage(a: np.ndarray, dtype: str) -> np.ndarray:
    """float32 -> the storage type of `dtype` (fp16 rounds here, once, to nearest even)."""
    return a if dtype == "fp32" else cpu.to_f16_bits(np.ascontiguousarray(a, np.float32))


def _f32(a) -> np.ndarray:
    return a.float32() if isinstance(a, Tensor) else np.ascontiguousarray(a, np.float32)


def _stack(arrays: list[np.ndarray]) -> np.ndarray:
    """Equal-shaped arrays -> one 64-byte-aligned (n, ...) array (layout only)."""
    out = cpu.aligned_empty((len(arrays),) + arrays[0].shape, arrays[0].dtype)
    for i, a in enumerate(arrays):
        out[i] = a
    return out


@dataclass
class Layer:
    """Matrices are float panels (P, K, 64), or `qpack.QPanels` in native mode."""
    attn_norm: np.ndarray  # (dim,) f32
    wqkv: np.ndarray | qpack.QPanels  # [wq; wk; wv]: (ceil((q_dim + 2 kv_dim)/64), dim, 64)
    wo: np.ndarray | qpack.QPanels  # (ceil(dim/64), q_dim, 64)
    ffn_norm: np.ndarray  # (dim,) f32
    w13: np.ndarray | qpack.QPanels  # [w1; w3]: (ceil(2 ffn/64), dim, 64)
    w2: np.ndarray | qpack.QPanels  # (ceil(dim/64), ffn, 64)


_PACK_ROWS = 4096  # rows dequantized and packed at a time (bounds the float32 temporaries)


def _row_chunks(p, n0: int, n1: int) -> np.ndarray:
    """Rows n0..n1 of a matrix as float32 (a Tensor's rows dequantized, in its row order)."""
    if not isinstance(p, Tensor):
        return np.ascontiguousarray(p[n0:n1], np.float32)
    return p.rows(n0, n1)


def _pack_float(parts: list, dtype: str, out: np.ndarray | None = None) -> np.ndarray:
    """The row concatenation of `parts` (Tensor or float32 (n, k) arrays) as panels (P, k, 64) of
    `dtype`'s storage, written into `out` (or a new aligned array), a few thousand rows at a time so
    that loading holds little more than the packed weights. The values are pack_panels' exactly."""
    n, k = sum(p.shape[0] for p in parts), parts[0].shape[1]
    P = -(-n // cpu.PANEL)
    if out is None:
        out = cpu.aligned_empty((P, k, cpu.PANEL), np.uint16 if dtype == "fp16" else np.float32)
    out[-1] = 0  # the last panel's padding rows
    g = 0  # global row of the next chunk
    for p in parts:
        for n0 in range(0, p.shape[0], _PACK_ROWS):
            n1 = min(p.shape[0], n0 + _PACK_ROWS)
            w = storage(_row_chunks(p, n0, n1), dtype)
            if isinstance(p, Tensor) and p.row_order is None:
                p.release((n0, n1))
            m = n1 - n0
            if g % cpu.PANEL == 0 and (m % cpu.PANEL == 0 or g + m == n):
                full = -(-m // cpu.PANEL) * cpu.PANEL
                if full != m:
                    w = np.concatenate([w, np.zeros((full - m, k), w.dtype)])
                out[g // cpu.PANEL:(g + full) // cpu.PANEL] = w.reshape(-1, cpu.PANEL, k).transpose(0, 2, 1)
            else:  # rows that straddle panels (e.g. a part whose row count is not a multiple of 64)
                r = np.arange(g, g + m)
                out[(r // cpu.PANEL)[:, None], np.arange(k)[None, :], (r % cpu.PANEL)[:, None]] = w
            g += m
        if isinstance(p, Tensor):
            p.release()
    return out


def _pack_stack(per_layer: list[list], dtype: str) -> np.ndarray:
    """One matrix kind as float panels stacked over layers (L, P, K, 64), each layer packed in place
    (`_pack_float`) from its parts."""
    n, k = sum(w.shape[0] for w in per_layer[0]), per_layer[0][0].shape[1]
    stack = cpu.aligned_empty((len(per_layer), -(-n // cpu.PANEL), k, cpu.PANEL),
                              np.uint16 if dtype == "fp16" else np.float32)
    for i, parts in enumerate(per_layer):
        _pack_float(parts, dtype, stack[i])
    return stack


def _native_kind(per_layer: list[list]) -> tuple:
    """One matrix kind in native storage, from its parts per layer (Tensor or float32 arrays, to
    be concatenated by rows). Returns (the stack for `forward.forward_layers`, one matrix per layer):
    quantized panels when every part has one Q8_0/Q4_0/Q4_1 type, fp16 panels when all are F16,
    else float32 panels of the dequantized values."""
    kinds = {p.ggml_type if isinstance(p, Tensor) else F32 for parts in per_layer for p in parts}
    kind = kinds.pop() if len(kinds) == 1 else None
    if kind == F32:
        kind = None  # dequantize: F32 -> a float32 copy
    if kind in qpack.NATIVE_TYPES:
        k = per_layer[0][0].shape[1]
        st = qpack.stack([qpack.pack_parts([(p.data, p.row_order, p.ggml_type) for p in parts], kind, k)
                          for parts in per_layer])
        mats = [qpack.QPanels(kind, st.n, st.k, st.qs[i], st.d[i], None if st.m is None else st.m[i])
                for i in range(len(per_layer))]
        _done(per_layer)
        return (st.qs, st.d, st.m), mats
    if kind == F16:  # the file's fp16 bits, moved as they are
        def bits(p):
            b = p.data.view("<u2").reshape(p.shape)
            return b if p.row_order is None else b[p.row_order]
        st = _stack([cpu.pack_panels(np.concatenate([bits(p) for p in parts]).view(np.uint16))
                     for parts in per_layer])
        _done(per_layer)
    else:
        st = _pack_stack(per_layer, "fp32")
    return st, list(st)


def _done(per_layer) -> None:
    for parts in per_layer:
        for p in parts:
            if isinstance(p, Tensor):
                p.release()


class KVCache:
    """Keys (after RoPE) and values for `n_slots` sequences. Values by position, (layer, slot,
    capacity, kv_dim); keys with 64 positions side by side, (layer, slot, kv_head, ceil(capacity/64),
    head_dim, 64), for attention's vectorized dot products (`cpu.widen_rows` reads rows back).
    `lengths[slot]` counts the positions filled."""

    def __init__(self, cfg: Config, capacity: int, dtype: str, n_slots: int = 1):
        st = np.uint16 if dtype == "fp16" else np.float32
        tiles = -(-capacity // cpu.ATILE)
        self.k = np.zeros((cfg.n_layers, n_slots, cfg.n_kv_heads, tiles, cfg.head_dim, cpu.ATILE), st)
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
    `weights` holds float32 arrays under the canonical names of `weights.py` (for native storage,
    matrices may be `Tensor`s)."""

    def __init__(self, cfg: Config, weights: dict, dtype: str = "fp32"):
        if dtype not in DTYPES:
            raise TinydetError(f"dtype: expected one of {', '.join(DTYPES)}, found {dtype!r}")
        self.cfg, self.dtype = cfg, dtype
        self.cache_dtype = "fp16" if dtype == "fp16" else "fp32"
        self.norm = _f32(weights["norm"])  # (dim,)
        kinds = (("wqkv", ("wq", "wk", "wv")), ("wo", ("wo",)), ("w13", ("w1", "w3")), ("w2", ("w2",)))
        if dtype == "native":
            self._init_native(cfg, weights, kinds)
        else:
            self._init_float(cfg, weights, kinds, dtype)
        self.layers = [Layer(attn_norm=self._stacks["attn_norm"][i], ffn_norm=self._stacks["ffn_norm"][i],
                             **{name: mats[i] for name, mats in self._mats.items()}) for i in range(cfg.n_layers)]
        # the embedding table and output matrix as forward.forward_logits takes them
        as_arg = lambda w: (w.qs, w.d, w.m) if isinstance(w, qpack.QPanels) else w  # noqa: E731
        self._w_out = as_arg(self.output)
        self._table = as_arg(self.output if self.tok_embeddings is None else self.tok_embeddings)
        # theta_i = base**(-2i/hd), in float64 with tinydet's own exp/log: the same bits on every CPU.
        ln_base = log64(cfg.rope_base)
        self.inv_freq = np.array([exp64(-(2.0 * i / cfg.head_dim) * ln_base) for i in range(cfg.head_dim // 2)])
        self._cos = np.zeros((0, cfg.head_dim // 2), np.float32)
        self._sin = self._cos
        self.scale = np.float32(1.0 / math.sqrt(cfg.head_dim))
        self.eps = np.float32(cfg.rms_eps)

    def _norms(self, cfg: Config, weights: dict) -> None:
        self._stacks = {name: _stack([_f32(weights[f"layers.{i}.{name.replace('attn', 'attention')}"])
                                      for i in range(cfg.n_layers)]) for name in ("attn_norm", "ffn_norm")}

    def _init_float(self, cfg: Config, weights: dict, kinds, dtype: str) -> None:
        emb = weights["tok_embeddings"]
        self.output = _pack_float([weights["output"]], dtype)  # (ceil(vocab/64), dim, 64), aligned
        if weights["output"] is emb:
            self.tok_embeddings = None  # tied: rows are read from the output panels (same values)
        else:
            self.tok_embeddings = storage(_f32(emb), dtype)  # (vocab, dim)
            if isinstance(emb, Tensor):
                emb.release()
        self._norms(cfg, weights)
        # Each matrix kind is stacked over layers (one array each, for `forward.forward_layers`); the
        # layers hold views into the stacks.
        self._mats = {}
        for name, parts in kinds:
            self._stacks[name] = _pack_stack([[weights[f"layers.{i}.{n}"] for n in parts]
                                              for i in range(cfg.n_layers)], dtype)
            self._mats[name] = list(self._stacks[name])

    def _init_native(self, cfg: Config, weights: dict, kinds) -> None:
        self._norms(cfg, weights)
        self._mats = {}
        for name, parts in kinds:
            self._stacks[name], self._mats[name] = _native_kind(
                [[weights[f"layers.{i}.{n}"] for n in parts] for i in range(cfg.n_layers)])
        emb = weights["tok_embeddings"]
        if isinstance(emb, Tensor) and emb.ggml_type in qpack.NATIVE_TYPES:
            self.tok_embeddings = qpack.pack_parts([(emb.data, None, emb.ggml_type)], emb.ggml_type, cfg.dim)
        elif weights["output"] is emb:
            self.tok_embeddings = None  # tied: rows are read from the output panels (same values)
        elif isinstance(emb, Tensor) and emb.ggml_type == F16:
            self.tok_embeddings = np.array(emb.data.view("<u2").reshape(emb.shape), np.uint16)  # widened exactly
        else:
            self.tok_embeddings = _f32(emb)
        if weights["output"] is emb and self.tok_embeddings is not None:
            self.output = self.tok_embeddings  # one copy serves both
        else:
            self.output = _native_kind([[weights["output"]]])[1][0]
        for w in weights.values():
            if isinstance(w, Tensor):
                w.release()

    def matrices(self) -> dict[str, str]:
        """How each matrix kind is stored: "f32", "f16" or a GGML quant type name."""
        def kind(m):
            if isinstance(m, qpack.QPanels):
                return m.type_name
            return "f16" if m.dtype == np.uint16 else "f32"
        out = {name: kind(getattr(self.layers[0], name)) for name in ("wqkv", "wo", "w13", "w2")}
        out["output"] = kind(self.output)
        out["tok_embeddings"] = kind(self.output if self.tok_embeddings is None else self.tok_embeddings)
        return out

    def weight_bytes(self) -> int:
        """Bytes of weights held in memory (each array once)."""
        seen, total = set(), 0
        for a in [self.tok_embeddings, self.output, self.norm, *self._stacks.values()]:
            if a is None:
                continue
            parts = [a] if isinstance(a, np.ndarray) else [x for x in (
                (a.qs, a.d, a.m) if isinstance(a, qpack.QPanels) else a) if x is not None]
            for x in parts:
                if id(x) not in seen:
                    seen.add(id(x))
                    total += x.nbytes
        return total

    def _matmul(self, x, w, n_out, out) -> None:
        if isinstance(w, qpack.QPanels):
            qcpu.qmatmul(x, w, n_out, out)
        else:
            cpu.matmul(x, w, n_out, out)

    def new_cache(self, capacity: int, n_slots: int = 1) -> KVCache:
        if capacity > self.cfg.context_length:
            raise ContextLengthError(
                f"{capacity} positions requested but the model's context length is {self.cfg.context_length}")
        return KVCache(self.cfg, capacity, self.cache_dtype, n_slots)

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
            ends.append((ends[-1] if ends else 0) + toks.shape[0])
        if len(items) == 1:
            ids, pos, slots = ids_l[0], pos_l[0], slot_l[0]
        else:
            ids = np.concatenate(ids_l)
            pos = np.concatenate(pos_l)
            slots = np.concatenate(slot_l)
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise TinydetError(f"token ids must lie in [0, {cfg.vocab_size}), found {int(ids.min())}..{int(ids.max())}")
        if threads is not None:
            numba.set_num_threads(threads)
        T = ids.shape[0]
        cos, sin = self._rope(int(pos.max()) + 1)
        rows = np.arange(T) if all_logits else np.array([e - 1 for e in ends], np.int64)
        rec = tracer.record if tracer is not None else None
        if rec is None and (cpu.matmul, qcpu.qmatmul) == _MATMULS:
            # The whole pass in one call: the same kernels in the same order as the steps below, so
            # the same bits.
            st = self._stacks
            logits = forward.forward_logits(
                ids, self._table, st["attn_norm"], st["wqkv"], st["wo"], st["ffn_norm"], st["w13"], st["w2"],
                cache.k, cache.v, pos, slots, cos, sin, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim,
                self.eps, self.scale, self.norm, self._w_out, cfg.vocab_size, rows, numba.get_num_threads())
        else:
            logits = self._forward_by_op(ids, cache, pos, slots, cos, sin, rows, rec)
        for (slot, _), a in zip(items, ids_l):
            cache.lengths[slot] += a.shape[0]
        starts = [0] + ends[:-1]
        if all_logits:
            return [logits[a:b] for a, b in zip(starts, ends)]
        return [logits[i:i + 1] for i in range(len(items))]

    def _forward_by_op(self, ids, cache: KVCache, pos, slots, cos, sin, rows, rec) -> np.ndarray:
        """The pass one kernel call at a time, the tracer recording between them (and a kernel
        replaced at run time, as tests inject faults, is honoured)."""
        cfg = self.cfg
        x = np.empty((ids.shape[0], cfg.dim), np.float32)  # residual stream
        if self.tok_embeddings is None:
            cpu.embed_panels(self.output, ids, x)
        elif isinstance(self.tok_embeddings, qpack.QPanels):
            qcpu.embed(self.tok_embeddings, ids, x)
        else:
            cpu.embed(self.tok_embeddings, ids, x)
        if rec:
            rec(None, "embedding", pos, slots, x)
        self._layers_by_op(x, cache, pos, slots, cos, sin, rec)
        hn = np.empty((rows.shape[0], cfg.dim), np.float32)
        cpu.rmsnorm(np.ascontiguousarray(x[rows]), self.norm, self.eps, hn)
        logits = np.empty((rows.shape[0], cfg.vocab_size), np.float32)
        self._matmul(hn, self.output, cfg.vocab_size, logits)
        if rec:
            rec(None, "final_norm", pos[rows], slots[rows], hn)
            rec(None, "logits", pos[rows], slots[rows], logits)
        return logits

    def _layers_by_op(self, x, cache: KVCache, pos, slots, cos, sin, rec) -> None:
        cfg = self.cfg
        T = x.shape[0]
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
            self._matmul(h, layer.wqkv, qkv.shape[1], qkv)
            cpu.rope_store(qkv, qd, kvd, cfg.head_dim, cos, sin, pos, slots, kc, vc, q)
            if rec:
                rec(li, "attn_norm", pos, slots, h)
                rec(li, "q", pos, slots, qkv[:, :qd])
                rec(li, "k", pos, slots, qkv[:, qd:qd + kvd])
                rec(li, "v", pos, slots, qkv[:, qd + kvd:])
                rec(li, "rope_q", pos, slots, q)
                rec(li, "rope_k", pos, slots, cpu.widen_rows(kc, slots, pos))
            cpu.attention(q, kc, vc, pos, slots, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, self.scale, att)
            self._matmul(att, layer.wo, cfg.dim, proj)
            if rec:
                rec(li, "attention", pos, slots, att)
                rec(li, "attn_output", pos, slots, proj)
            cpu.add_inplace(x, proj)
            cpu.rmsnorm(x, layer.ffn_norm, self.eps, h)
            self._matmul(h, layer.w13, 2 * fd, gu)
            cpu.swiglu(gu, fd, act)
            if rec:
                rec(li, "attn_residual", pos, slots, x)
                rec(li, "ffn_norm", pos, slots, h)
                rec(li, "gate", pos, slots, gu[:, :fd])
                rec(li, "up", pos, slots, gu[:, fd:])
                rec(li, "activation", pos, slots, act)
            self._matmul(act, layer.w2, cfg.dim, proj)
            cpu.add_inplace(x, proj)
            if rec:
                rec(li, "down", pos, slots, proj)
                rec(li, "ffn_residual", pos, slots, x)
