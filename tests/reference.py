"""Independent references for testing tinydet's Llama forward pass.

* ``ReferenceModel``: a float64 NumPy Llama forward pass. It deliberately shares no code with tinydet:
  the GGUF is read with the ``gguf`` package (``gguf.GGUFReader``) and dequantized with
  ``gguf.quants.dequantize``; everything is converted to float64 once.
* ``load_hf_model`` / ``hf_logits`` / ``hf_greedy``: HF transformers (fp32, CPU) loading the same GGUF.
* ``decode_llama2c``: turns SentencePiece ids into the exact text llama2.c's ``run`` prints.

Layout notes
------------
llama.cpp's ``convert_hf_to_gguf`` permutes the rows of HF's ``q_proj``/``k_proj`` within every head so
that RoPE rotates *adjacent* pairs ``(x[2i], x[2i+1])`` (llama.cpp's "NORM" rope type) instead of HF's
``rotate_half`` halves ``(x[i], x[i + d/2])``. This reference applies RoPE on adjacent pairs directly to
the GGUF layout, so it never needs to undo the permutation (HF transformers does undo it when loading a
GGUF, which makes the two an independent cross-check).

NumPy arrays from the GGUF are in "numpy order": a matrix with GGUF dims ``[n_in, n_out]`` is an array of
shape ``(n_out, n_in)``, and ``y = x @ W.T``.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path

import numpy as np

DEFAULT_ROPE_BASE = 10000.0
DEFAULT_RMS_EPS = 1e-5  # only when the GGUF lacks llama.attention.layer_norm_rms_epsilon
HF_NUM_THREADS = 2  # fixed torch thread count for the HF reference (reproducible fp32 reductions)


def _field_value(field):
    """A GGUFReader field as a Python value (scalar, str, or list)."""
    return field.contents()


class ReferenceModel:
    """Float64 NumPy Llama (llama.cpp GGUF layout) forward pass."""

    def __init__(self, gguf_path):
        import gguf
        from gguf.quants import dequantize

        self.path = Path(gguf_path)
        reader = gguf.GGUFReader(str(self.path))
        meta = {name: _field_value(f) for name, f in reader.fields.items()
                if not name.startswith("GGUF.")}
        self.metadata = meta
        arch = meta.get("general.architecture")
        if arch != "llama":
            raise ValueError(f"{self.path}: reference supports architecture 'llama', not {arch!r}")

        def key(name, default=None):
            v = meta.get(f"llama.{name}", default)
            if v is None:
                raise KeyError(f"{self.path}: missing metadata llama.{name}")
            return v

        self.dim = int(key("embedding_length"))
        self.n_layers = int(key("block_count"))
        self.n_heads = int(key("attention.head_count"))
        self.n_kv_heads = int(key("attention.head_count_kv", self.n_heads))
        self.ffn_dim = int(key("feed_forward_length"))
        self.head_dim = self.dim // self.n_heads
        self.n_rot = int(key("rope.dimension_count", self.head_dim))
        self.rope_base = float(key("rope.freq_base", DEFAULT_ROPE_BASE))
        self.eps = float(key("attention.layer_norm_rms_epsilon", DEFAULT_RMS_EPS))
        if self.n_heads % self.n_kv_heads:
            raise ValueError("n_heads must be a multiple of n_kv_heads")
        if self.n_rot % 2 or self.n_rot > self.head_dim:
            raise ValueError(f"bad rope dimension count {self.n_rot}")
        self.group = self.n_heads // self.n_kv_heads

        w = {}
        for t in reader.tensors:
            shape = tuple(int(n) for n in reversed(t.shape))  # numpy order
            arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64)
            w[t.name] = np.ascontiguousarray(arr.reshape(shape))
        self.tok_embd = w["token_embd.weight"]
        self.vocab_size = self.tok_embd.shape[0]
        self.output_norm = w["output_norm.weight"]
        # Tied embeddings: no output.weight -> reuse token_embd.weight.
        self.output = w.get("output.weight", self.tok_embd)
        self.layers = []
        for i in range(self.n_layers):
            p = f"blk.{i}."
            self.layers.append({n: w[p + n + ".weight"] for n in (
                "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")})
        L0 = self.layers[0]
        assert L0["attn_q"].shape == (self.n_heads * self.head_dim, self.dim)
        assert L0["attn_k"].shape == (self.n_kv_heads * self.head_dim, self.dim)
        assert L0["ffn_gate"].shape == (self.ffn_dim, self.dim)
        assert self.output.shape == (self.vocab_size, self.dim)

        # Tokenizer vocabulary (for decoding in tests).
        self.tokens = list(meta.get("tokenizer.ggml.tokens", []))
        self.bos_id = meta.get("tokenizer.ggml.bos_token_id")
        self.eos_id = meta.get("tokenizer.ggml.eos_token_id")

    # -- building blocks ------------------------------------------------------------------------------

    def _rmsnorm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def _rope(self, x, positions):
        """Rotate adjacent pairs (x[2i], x[2i+1]) of the first n_rot dims; x: (n, heads, head_dim)."""
        half = self.n_rot // 2
        theta = self.rope_base ** (-2.0 * np.arange(half, dtype=np.float64) / self.n_rot)
        ang = np.asarray(positions, dtype=np.float64)[:, None] * theta[None, :]  # (n, half)
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        out = x.copy()
        x0, x1 = x[..., 0:self.n_rot:2], x[..., 1:self.n_rot:2]
        out[..., 0:self.n_rot:2] = x0 * cos - x1 * sin
        out[..., 1:self.n_rot:2] = x0 * sin + x1 * cos
        return out

    def new_cache(self):
        return {"pos": 0,
                "k": [np.zeros((0, self.n_kv_heads, self.head_dim)) for _ in range(self.n_layers)],
                "v": [np.zeros((0, self.n_kv_heads, self.head_dim)) for _ in range(self.n_layers)]}

    def forward(self, token_ids, cache):
        """Run tokens at positions cache['pos'] .. +len-1, extending the cache; -> (len, vocab) logits."""
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.ndim != 1 or len(ids) == 0:
            raise ValueError("token_ids must be a non-empty 1-D sequence")
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ValueError("token id out of range")
        n, start = len(ids), cache["pos"]
        positions = start + np.arange(n)
        H, KV, G, D = self.n_heads, self.n_kv_heads, self.group, self.head_dim
        scale = 1.0 / np.sqrt(D)
        total = start + n
        # Causal mask: query i (absolute position start+i) sees keys t <= start+i.
        mask = np.arange(total)[None, :] > positions[:, None]  # (n, total)

        x = self.tok_embd[ids]  # (n, dim)
        for li, L in enumerate(self.layers):
            h = self._rmsnorm(x, L["attn_norm"])
            q = (h @ L["attn_q"].T).reshape(n, H, D)
            k = (h @ L["attn_k"].T).reshape(n, KV, D)
            v = (h @ L["attn_v"].T).reshape(n, KV, D)
            q, k = self._rope(q, positions), self._rope(k, positions)
            K = cache["k"][li] = np.concatenate([cache["k"][li], k], axis=0)  # (total, KV, D)
            V = cache["v"][li] = np.concatenate([cache["v"][li], v], axis=0)
            # Query head h uses kv head h // G: split heads as (KV, G).
            qg = q.reshape(n, KV, G, D)
            scores = np.einsum("nkgd,tkd->kgnt", qg, K) * scale  # (KV, G, n, total)
            scores = np.where(mask[None, None], -np.inf, scores)
            scores = scores - scores.max(axis=-1, keepdims=True)
            p = np.exp(scores)
            p /= p.sum(axis=-1, keepdims=True)
            att = np.einsum("kgnt,tkd->nkgd", p, V).reshape(n, H * D)
            x = x + att @ L["attn_output"].T
            h = self._rmsnorm(x, L["ffn_norm"])
            gate = h @ L["ffn_gate"].T
            up = h @ L["ffn_up"].T
            x = x + (gate / (1.0 + np.exp(-gate)) * up) @ L["ffn_down"].T
        cache["pos"] = total
        x = self._rmsnorm(x, self.output_norm)
        return x @ self.output.T

    # -- public API -----------------------------------------------------------------------------------

    def logits(self, token_ids) -> np.ndarray:
        """(len, vocab) float64 logits of a full causal pass from an empty cache."""
        return self.forward(token_ids, self.new_cache())

    def greedy(self, token_ids, n_new) -> list[int]:
        """n_new greedy (argmax, lowest id on ties) ids after the prompt; no EOS stop."""
        if n_new <= 0:
            return []
        cache = self.new_cache()
        nxt = int(np.argmax(self.forward(token_ids, cache)[-1]))
        out = [nxt]
        while len(out) < n_new:
            nxt = int(np.argmax(self.forward([nxt], cache)[-1]))
            out.append(nxt)
        return out

    # -- llama2.c-style decoding ----------------------------------------------------------------------

    def piece_bytes(self, prev_id, token_id) -> bytes:
        """The bytes llama2.c's ``decode(prev, token)`` yields for one token (SentencePiece vocab).

        '▁' -> ' '; after BOS a leading space is stripped; '<0xNN>' byte tokens -> that byte.
        """
        piece = self.tokens[token_id].replace("\u2581", " ")
        if prev_id == self.bos_id and piece.startswith(" "):
            piece = piece[1:]
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.encode("utf-8")

    def decode_llama2c(self, token_ids, first_prev=None) -> str:
        """Text llama2.c's ``run`` prints for generated ids (``first_prev``: the token before them,
        BOS by default), excluding its final ``printf("\\n")``. llama2.c's ``safe_printf`` drops
        single-byte pieces that are neither printable nor whitespace."""
        prev = self.bos_id if first_prev is None else first_prev
        out = bytearray()
        for t in token_ids:
            b = self.piece_bytes(prev, t)
            if len(b) == 1 and not (0x20 <= b[0] < 0x7F or b[0] in b" \t\n\v\f\r"):
                b = b""
            out += b
            prev = t
        return out.decode("utf-8", errors="replace")


# -- HF transformers ----------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _load_hf_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(HF_NUM_THREADS)
    hf_logging.disable_progress_bar()
    p = Path(path)
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    model.eval()
    return model


def load_hf_model(gguf_path):
    """HF transformers model from a GGUF (dequantized to fp32), cached per resolved path, eval mode.

    transformers loads a GGUF only when ``accelerate`` is installed; it dequantizes with the same
    ``gguf`` package and un-permutes Q/K back to HF's rotate_half layout."""
    return _load_hf_model(str(Path(gguf_path).resolve()))


@functools.lru_cache(maxsize=None)
def _load_hf_tokenizer(path: str):
    from transformers import AutoTokenizer

    p = Path(path)
    return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)


def load_hf_tokenizer(gguf_path):
    """HF tokenizer built from the GGUF's embedded vocabulary, cached per resolved path."""
    return _load_hf_tokenizer(str(Path(gguf_path).resolve()))


def hf_logits(model, token_ids) -> np.ndarray:
    """(len, vocab) float32 logits of one causal pass."""
    import torch

    torch.set_num_threads(HF_NUM_THREADS)
    ids = torch.tensor([list(map(int, token_ids))], dtype=torch.long)
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=False)
    return out.logits[0].float().numpy().copy()


def hf_generate(model, token_ids, n_new) -> list[int]:
    """n_new ids of transformers' own greedy continuation (`generate`: no sampling, no EOS stop)."""
    import torch

    ids = list(map(int, token_ids))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n_new, do_sample=False, eos_token_id=None)
    return out[0, len(ids):].tolist()


def _cache_kwarg(model) -> str:
    """Name of the KV-cache argument of ``model.forward`` (``cache`` in transformers 5.x, where
    ``past_key_values`` is deprecated; ``past_key_values`` in 4.x)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def hf_greedy(model, token_ids, n_new) -> list[int]:
    """n_new greedy ids after the prompt: a manual argmax loop (first index on ties) over HF's KV cache,
    so there is no EOS stop and no generation-config processing."""
    import torch

    torch.set_num_threads(HF_NUM_THREADS)
    if n_new <= 0:
        return []
    kw = _cache_kwarg(model)
    ids = torch.tensor([list(map(int, token_ids))], dtype=torch.long)
    out = []
    with torch.inference_mode():
        res = model(input_ids=ids, use_cache=True)
        while True:
            nxt = int(torch.argmax(res.logits[0, -1]))
            out.append(nxt)
            if len(out) == n_new:
                return out
            cache = getattr(res, "cache", None)
            if cache is None:
                cache = res.past_key_values
            res = model(input_ids=torch.tensor([[nxt]], dtype=torch.long), use_cache=True, **{kw: cache})
