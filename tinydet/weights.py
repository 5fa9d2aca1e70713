"""Canonical weight names, and the per-source fixes that bring a file's tensors to them.

Canonical names (HF layout: Q/K rows in rotate-half order, matrices [out, in]):
  tok_embeddings [vocab, dim], norm [dim], output [vocab, dim],
  layers.{i}.attention_norm [dim], layers.{i}.wq [q_dim, dim], .wk [kv_dim, dim], .wv [kv_dim, dim],
  .wo [dim, q_dim], .ffn_norm [dim], .w1 (gate) [ffn, dim], .w2 (down) [dim, ffn], .w3 (up) [ffn, dim].
Model code never sees a GGUF or HF name.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from .config import Config
from .errors import ModelFormatError
from .qpack import rope_row_order
from .quants import dequantize

GGUF_NAMES = {
    "tok_embeddings": "token_embd.weight",
    "norm": "output_norm.weight",
    "output": "output.weight",
    "layers.{}.attention_norm": "blk.{}.attn_norm.weight",
    "layers.{}.wq": "blk.{}.attn_q.weight",
    "layers.{}.wk": "blk.{}.attn_k.weight",
    "layers.{}.wv": "blk.{}.attn_v.weight",
    "layers.{}.wo": "blk.{}.attn_output.weight",
    "layers.{}.ffn_norm": "blk.{}.ffn_norm.weight",
    "layers.{}.w1": "blk.{}.ffn_gate.weight",
    "layers.{}.w2": "blk.{}.ffn_down.weight",
    "layers.{}.w3": "blk.{}.ffn_up.weight",
}


def expected_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    shapes = {
        "tok_embeddings": (cfg.vocab_size, cfg.dim),
        "norm": (cfg.dim,),
        "output": (cfg.vocab_size, cfg.dim),
    }
    for i in range(cfg.n_layers):
        shapes.update({
            f"layers.{i}.attention_norm": (cfg.dim,),
            f"layers.{i}.wq": (cfg.q_dim, cfg.dim),
            f"layers.{i}.wk": (cfg.kv_dim, cfg.dim),
            f"layers.{i}.wv": (cfg.kv_dim, cfg.dim),
            f"layers.{i}.wo": (cfg.dim, cfg.q_dim),
            f"layers.{i}.ffn_norm": (cfg.dim,),
            f"layers.{i}.w1": (cfg.ffn_dim, cfg.dim),
            f"layers.{i}.w2": (cfg.dim, cfg.ffn_dim),
            f"layers.{i}.w3": (cfg.ffn_dim, cfg.dim),
        })
    return shapes


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert permutation of Q/K rows.

    convert_hf_to_gguf reorders each head's rows from HF's rotate-half order (i, i + hd/2) to adjacent
    pairs (2i, 2i+1) so that llama.cpp can rotate neighbours; this maps them back. Rows only move:
    no value changes."""
    n, k = w.shape
    hd = n // n_heads
    return np.ascontiguousarray(w.reshape(n_heads, hd // 2, 2, k).swapaxes(1, 2).reshape(n, k))


def canonical_names(cfg: Config) -> Iterator[tuple[str, str]]:
    """(canonical, template key) pairs for every tensor of the model."""
    for key in GGUF_NAMES:
        if "{}" in key:
            for i in range(cfg.n_layers):
                yield key.format(i), key
        else:
            yield key, key


@dataclass(frozen=True)
class RawTensor:
    """A matrix as the file stores it (GGML type and bytes), kept for native storage. `row_order`,
    when set, is the row permutation `unpermute_rope_rows` would apply (out[i] = row order[i])."""

    data: np.ndarray  # uint8, the tensor's bytes (a read-only view of the file)
    ggml_type: int
    shape: tuple[int, int]
    row_order: np.ndarray | None = None
    release: Callable[..., None] | None = None  # release(lo=0, hi=None): bytes lo..hi copied out

    def dequantize(self) -> np.ndarray:
        w = dequantize(self.data, self.ggml_type, self.shape)
        return w if self.row_order is None else np.ascontiguousarray(w[self.row_order])

    def done(self, rows: tuple[int, int] | None = None) -> None:
        """The bytes (of rows n0..n1, default all) have been copied out: let the file's pages go."""
        if self.release is None:
            return
        if rows is None:
            self.release()
        else:
            row_bytes = self.data.shape[0] // self.shape[0]
            self.release(rows[0] * row_bytes, rows[1] * row_bytes)


def load_gguf_weights(gguf, cfg: Config, progress: Callable[[int, int, str], None] | None = None,
                      keep_matrices: bool = False) -> dict[str, np.ndarray | RawTensor]:
    """Dequantize every tensor of a GGUF llama model to float32 under its canonical name; with
    `keep_matrices`, the 2-D tensors stay as the file stores them (`RawTensor`, read when packed).

    The output matrix is tied to the token embedding only when `output.weight` is absent."""
    shapes = expected_shapes(cfg)
    names = list(canonical_names(cfg))
    out: dict[str, np.ndarray] = {}
    for done, (name, key) in enumerate(names):
        gname = GGUF_NAMES[key].format(name.split(".")[1]) if "{}" in key else GGUF_NAMES[key]
        if progress is not None:
            progress(done, len(names), gname)
        if gname not in gguf.tensors:
            if name == "output":
                continue  # tied below
            raise ModelFormatError(gguf.path, gname, "required tensor is missing")
        info = gguf.tensors[gname]
        if info.shape != shapes[name]:
            raise ModelFormatError(gguf.path, gname,
                                   f"expected shape {shapes[name]} from the metadata, found {info.shape}")
        if keep_matrices and len(info.shape) == 2:
            order = None
            if name.endswith(".wq"):
                order = rope_row_order(cfg.q_dim, cfg.n_heads)
            elif name.endswith(".wk"):
                order = rope_row_order(cfg.kv_dim, cfg.n_kv_heads)
            out[name] = RawTensor(gguf.tensor_bytes(gname), info.ggml_type, info.shape, order,
                                  functools.partial(gguf.release, gname))
            continue
        w = dequantize(gguf.tensor_bytes(gname), info.ggml_type, info.shape)
        if name.endswith(".wq"):
            w = unpermute_rope_rows(w, cfg.n_heads)
        elif name.endswith(".wk"):
            w = unpermute_rope_rows(w, cfg.n_kv_heads)
        out[name] = w
    if "output" not in out:
        out["output"] = out["tok_embeddings"]
    if progress is not None:
        progress(len(names), len(names), "")
    return out
