"""A checkpoint's tensors packed for one dtype, in the panels both backends read (the GPU backend
copies them to the device as they are); loading does this, once.

  fp32    every matrix as float32 panels
  fp16    every matrix as binary16 panels (rounded here, once, to nearest even; KV cache fp16 too)
  native  each matrix as the file stores it: Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K/MXFP4 blocks as quantized
          panels, F16 as fp16 panels of the file's bits, other types dequantized to float32 panels; a
          kind whose layers (or runs of rows) differ in type keeps each as stored (`MixedPanels`)
          where the runs start at multiples of 64 rows; the bits of fp32
  int8    native storage, but the quantized matrices computed in integers against activations
          quantized to 8 bits (`backends/cpu/intdot.py`, `actq.py`; Q8_0's quants regrouped,
          `intpanels.py`), the quantized segments of kinds of mixed types too; F16/F32 as in native
Norm weights and biases stay float32. Matrices of one kind are stacked over layers (one array each,
for the one-call forward pass); [wq; wk; wv] and [w1; w3] are packed as one matrix each. Packing goes
a few thousand rows at a time and releases each part of the file as it is copied, so that loading
holds little more than the packed weights.
"""

from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from ..formats import Tensor
from ..formats.ggml import F16
from .layout import (LANES, MixedPanels, QPanels, aligned_empty, layer_of, pack_mixed, pack_panels,
                     pack_parts, pack_stack)
from . import repack
from .intpanels import INT_TYPES, IntPanels, from_qpanels
from .names import MATRICES, MOE_MATRICES, NATIVE_TYPES
from ..numerics.simd import to_f16_bits

_PACK_ROWS = 4096  # rows dequantized and packed at a time (bounds the float32 temporaries)


def storage(a: np.ndarray, dtype: str) -> np.ndarray:
    """float32 -> the storage type of `dtype` (fp16 rounds here, once, to nearest even)."""
    return a if dtype != "fp16" else to_f16_bits(np.ascontiguousarray(a, np.float32))


def _stack(arrays: list[np.ndarray]) -> np.ndarray:
    """Equal-shaped arrays -> one 64-byte-aligned (n, ...) array (layout only)."""
    out = aligned_empty((len(arrays),) + arrays[0].shape, arrays[0].dtype)
    for i, a in enumerate(arrays):
        out[i] = a
    return out


def _pack_float(parts: list[Tensor], dtype: str, out: np.ndarray | None = None) -> np.ndarray:
    """The row concatenation of `parts` as panels (P, k, 64) of `dtype`'s storage, written into `out`
    (or a new aligned array) a few thousand rows at a time. The values are pack_panels' exactly."""
    n, k = sum(p.shape[0] for p in parts), parts[0].shape[1]
    P = -(-n // LANES)
    if out is None:
        out = aligned_empty((P, k, LANES), np.uint16 if dtype == "fp16" else np.float32)
    out[-1] = 0  # the last panel's padding rows
    g = 0  # global row of the next chunk
    for p in parts:
        for n0 in range(0, p.shape[0], _PACK_ROWS):
            n1 = min(p.shape[0], n0 + _PACK_ROWS)
            m = n1 - n0
            if dtype == "fp16" and p.ggml_type == F16 and repack.f16_rows(
                    p.data.view("<u2").reshape(p.shape), np.arange(n0, n1) if p.row_order is None else
                    np.ascontiguousarray(p.row_order[n0:n1], np.int64), g, out):
                # An F16 tensor's rows for fp16 are its own bits where none is a NaN: widening binary16
                # to float32 is exact and rounding an exact value back gives its bits (test_panelcache
                # checks every pattern). Rows with a NaN take the round trip below.
                w = None
            else:
                w = storage(p.rows(n0, n1), dtype)
            if p.row_order is None:
                p.release((n0, n1))
            if w is None:
                pass
            elif g % LANES == 0 and (m % LANES == 0 or g + m == n):
                full = -(-m // LANES) * LANES
                if full != m:
                    w = np.concatenate([w, np.zeros((full - m, k), w.dtype)])
                out[g // LANES:(g + full) // LANES] = w.reshape(-1, LANES, k).transpose(0, 2, 1)
            else:  # rows that straddle panels (e.g. a part whose row count is not a multiple of 64)
                r = np.arange(g, g + m)
                out[(r // LANES)[:, None], np.arange(k)[None, :], (r % LANES)[:, None]] = w
            g += m
        p.release()
    return out


def _pack_stack(per_layer: list[list[Tensor]], dtype: str) -> np.ndarray:
    """One matrix kind as float panels stacked over layers (L, P, K, 64), each layer packed in place."""
    n, k = sum(w.shape[0] for w in per_layer[0]), per_layer[0][0].shape[1]
    out = aligned_empty((len(per_layer), -(-n // LANES), k, LANES), np.uint16 if dtype == "fp16" else np.float32)
    for i, parts in enumerate(per_layer):
        _pack_float(parts, dtype, out[i])
    return out


def _release(per_layer) -> None:
    for parts in per_layer:
        for p in parts:
            p.release()


def _f16_panels(parts: list[Tensor]) -> np.ndarray:
    """F16 tensors' rows concatenated as fp16 panels of the file's bits, moved as they are."""
    def bits(p):
        b = p.data.view("<u2").reshape(p.shape)
        return b if p.row_order is None else b[p.row_order]
    return pack_panels(np.concatenate([bits(p) for p in parts]).view(np.uint16))


def _native_kind(per_layer: list[list[Tensor]]):
    """One matrix kind in native storage, stacked over layers: quantized panels when every part has
    one type of NATIVE_TYPES, fp16 panels of the file's bits when all are F16, `MixedPanels` when the
    types differ (between layers, or between parts whose runs start at multiples of 64 rows), else
    float32 panels of the dequantized values."""
    kinds = {p.ggml_type for parts in per_layer for p in parts}
    kind = kinds.pop() if len(kinds) == 1 else None
    if kind in NATIVE_TYPES:
        k = per_layer[0][0].shape[1]
        # one layer at a time straight into the stack, its file bytes let go once copied (and a derived
        # tensor's bytes, `formats.checkpoint.Derived`, made only when its layer's turn comes)
        return pack_stack(_Lazy(lambda li: [(p.data, p.row_order, p.ggml_type) for p in per_layer[li]],
                                len(per_layer)), kind, k, done=lambda li: _release([per_layer[li]]))
    if kind == F16:  # the file's fp16 bits, moved as they are
        st = _stack([_f16_panels(parts) for parts in per_layer])
        _release(per_layer)
        return st
    if kind is None:
        mixed = _mixed_kind(per_layer)
        if mixed is not None:
            return mixed
    return _pack_stack(per_layer, "fp32")


class _Lazy:
    """A sequence of n items made by item(i) when read."""

    def __init__(self, item, n: int):
        self.item, self.n = item, n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return (self.item(i) for i in range(self.n))


def _segment_key(ggml_type: int):
    return ggml_type if ggml_type in NATIVE_TYPES else ("f16" if ggml_type == F16 else "f32")


def _mixed_kind(per_layer: list[list[Tensor]]) -> MixedPanels | None:
    """A kind of several types as `MixedPanels`: in each layer, consecutive parts of one storage kind
    are one segment. None where a segment would start at a row that is not a multiple of 64, or
    where nothing would stay quantized (float32 panels then, as for one type)."""
    k = per_layer[0][0].shape[1]
    layers = []
    for parts in per_layer:
        segs, r0 = [], 0
        for p in parts:
            key = _segment_key(p.ggml_type)
            if segs and segs[-1][0] == key:
                segs[-1][1].append(p)
            elif r0 % LANES:
                return None
            else:
                segs.append((key, [p]))
            r0 += p.shape[0]
        layers.append(segs)
    if all(key == "f32" for segs in layers for key, _ in segs):
        return None

    def make(key, ps):
        def packed():
            if key == "f32":
                return _pack_float(ps, "fp32")  # releases each part as it goes
            st = _f16_panels(ps) if key == "f16" else pack_parts([(p.data, p.row_order, p.ggml_type) for p in ps],
                                                                 key, k)
            for p in ps:
                p.release()
            return st
        return packed

    return pack_mixed([[(key, sum(p.shape[0] for p in ps), make(key, ps)) for key, ps in segs] for segs in layers], k)


def _integer(st):
    """A kind for the integer mode: quantized panels of INT_TYPES as IntPanels, a kind of mixed types
    with each such part as IntPanels (its float parts, and its segment table, as they are), others as
    they are."""
    if isinstance(st, MixedPanels):
        parts = tuple(_integer(p) for p in st.parts)
        return st if all(p is q for p, q in zip(parts, st.parts)) else MixedPanels(st.n, st.k, parts, st.table)
    return from_qpanels(st) if isinstance(st, QPanels) and st.ggml_type in INT_TYPES else st


def _first(st):
    """Layer 0 of a stack (a matrix packed as a stack of one)."""
    if isinstance(st, QPanels):
        return layer_of(st, 0)
    return st[0]


def _vectors(cfg: ModelConfig, tensors: dict, names: tuple[str, ...]) -> np.ndarray:
    """Per-layer float32 vectors concatenated: (L, width); (L, 0) when the model has none."""
    if f"layers.0.{names[0]}" not in tensors:
        return np.zeros((cfg.n_layers, 0), np.float32)
    return _stack([np.concatenate([tensors[f"layers.{i}.{n}"].float32() for n in names]) for i in range(cfg.n_layers)])


def _expert_vectors(cfg: ModelConfig, tensors: dict, names: tuple[str, ...]) -> np.ndarray:
    """Per-(layer, expert) float32 vectors concatenated, layer l's expert e at row l * n_experts + e:
    (L E, width); (L E, 0) when the model has none."""
    E = cfg.n_experts
    if f"layers.0.experts.0.{names[0]}" not in tensors:
        return np.zeros((cfg.n_layers * E, 0), np.float32)
    return _stack([np.concatenate([tensors[f"layers.{i}.experts.{e}.{n}"].float32() for n in names])
                   for i in range(cfg.n_layers) for e in range(E)])


class CPUWeights:
    """Packed weights (shapes per layer l; "panels" of a matrix [N, K] are (ceil(N/64), K, 64) float,
    or `QPanels` in native storage, each kind stacked over layers):
      attn_norm, ffn_norm (L, dim); q_norm, k_norm (L, head_dim), or (L, q_dim) and (L, kv_dim) for
      norms over all of q and k (OLMoE); post_attn_norm, post_ffn_norm
      (L, dim); bqkv (L, q_dim + 2 kv_dim); bo (L, dim); sinks (L, n_heads): float32, the optional
      ones (L, 0) when absent; a mixture's router_bias (L, n_experts), b13e (L E, 2 ffn_dim) and b2e
      (L E, dim), (.., 0) when absent;
      wqkv [wq; wk; wv], wo, w13 [w1; w3], w2: panels; norm (dim,); output: panels; a mixture of
      experts has router, w13e and w2e (`MOE_MATRICES`) instead of w13 and w2;
      table: the embedding, a (vocab, dim) float array, or the output's storage when tied to it."""

    def __init__(self, cfg: ModelConfig, tensors: dict[str, Tensor], dtype: str, progress=None):
        """`progress(done, total, name)`, if given, is called as each matrix kind is packed."""
        L = cfg.n_layers
        per_kind = {name: [[tensors[f"layers.{i}.{n}"] for n in parts] for i in range(L)]
                    for name, parts in MATRICES if f"layers.0.{parts[0]}" in tensors}
        if cfg.n_experts:
            E = cfg.n_experts
            per_kind["router"] = [[tensors[f"layers.{i}.router"]] for i in range(L)]
            for name, parts in MOE_MATRICES[1:]:
                per_kind[name] = [[tensors[f"layers.{i}.experts.{e}.{n}"] for n in parts] for i in range(L)
                                  for e in range(E)]
        steps = list(per_kind) + ["output"]

        def step(name):
            if progress is not None:
                progress(steps.index(name) + 1, len(steps), f"packing {name}")
        self.norm = tensors["norm"].float32()
        self.attn_norm = _vectors(cfg, tensors, ("attention_norm",))
        self.ffn_norm = _vectors(cfg, tensors, ("ffn_norm",))
        self.q_norm = _vectors(cfg, tensors, ("q_norm",))
        self.k_norm = _vectors(cfg, tensors, ("k_norm",))
        self.post_attn_norm = _vectors(cfg, tensors, ("post_attention_norm",))
        self.post_ffn_norm = _vectors(cfg, tensors, ("post_ffn_norm",))
        self.bqkv = _vectors(cfg, tensors, ("bq", "bk", "bv"))
        self.bo = _vectors(cfg, tensors, ("bo",))
        self.sinks = _vectors(cfg, tensors, ("sinks",))
        if cfg.n_experts:
            self.router_bias = _vectors(cfg, tensors, ("router_bias",))
            self.b13e = _expert_vectors(cfg, tensors, ("b1", "b3"))
            self.b2e = _expert_vectors(cfg, tensors, ("b2",))
        emb, out = tensors["tok_embeddings"], tensors["output"]
        if dtype in ("native", "int8"):
            conv = _integer if dtype == "int8" else (lambda st: st)
            for name, parts in per_kind.items():
                setattr(self, name, conv(_native_kind(parts)))
                step(name)
            if emb.ggml_type in NATIVE_TYPES:
                # The largest matrix (Gemma 3's: 178 MB of a 253 MB file), packed last: its file pages
                # go as its rows are copied, or they and the copy would be the peak of loading.
                self.table = pack_parts([(emb.data, None, emb.ggml_type)], emb.ggml_type, cfg.dim,
                                        release=lambda r0, r1: emb.release((r0, r1)))
            elif out is emb:
                self.table = None  # tied: rows are read from the output panels (same values)
            elif emb.ggml_type == F16:
                self.table = np.array(emb.data.view("<u2").reshape(emb.shape), np.uint16)  # widened exactly
            else:
                self.table = emb.float32()
            if out is emb and self.table is not None:
                self.table = self.output = conv(self.table)  # one copy serves both
            else:
                self.output = conv(_first(_native_kind([[out]])))
            emb.release()
        else:
            for name, parts in per_kind.items():
                setattr(self, name, _pack_stack(parts, dtype))
                step(name)
            self.output = _pack_float([out], dtype)
            if out is emb:
                self.table = None  # tied: rows are read from the output panels (same values)
            else:
                self.table = storage(emb.float32(), dtype)  # (vocab, dim)
                emb.release()
        if self.table is None:
            self.table = self.output
        step("output")

    @classmethod
    def restore(cls, attrs: dict) -> "CPUWeights":
        """Weights from their attributes as `panelcache` kept them (arrays already packed)."""
        w = cls.__new__(cls)
        vars(w).update(attrs)
        return w

    def storage(self) -> dict[str, str]:
        """How each matrix kind is stored: "f32", "f16" or a GGML quant type name ("Q4_K+Q6_K": a kind of
        mixed types, `MixedPanels`, its parts by type id; "Q4_0:int8": computed in integers, `IntPanels`;
        "Q4_K:int8+Q6_K:int8": a kind of mixed types in the integer mode)."""
        def kind(m):
            if isinstance(m, (QPanels, MixedPanels, IntPanels)):
                return m.type_name
            return "f16" if m.dtype == np.uint16 else "f32"
        out = {name: kind(getattr(self, name)) for name, _ in MATRICES + MOE_MATRICES if hasattr(self, name)}
        out["output"] = kind(self.output)
        out["tok_embeddings"] = kind(self.table)
        return out

    def nbytes(self) -> int:
        """Bytes of weights held in memory (each array once)."""
        seen, total = set(), 0
        for a in vars(self).values():
            parts = [a] if isinstance(a, np.ndarray) else a.arrays()
            for x in parts:
                if id(x) not in seen:
                    seen.add(id(x))
                    total += x.nbytes
        return total
