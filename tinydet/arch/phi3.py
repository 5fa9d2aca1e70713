"""Phi-3 (Phi3ForCausalLM, model_type "phi3"; GGUF `phi3`): Llama's block with fused projections and
a sliding window over every layer.

Fused tensors: HF stores q, k and v as one matrix, `self_attn.qkv_proj.weight` [q_dim + 2 kv_dim, dim]
(q's rows, then k's, then v's: Phi3Attention slices its output so), and gate and up as one,
`mlp.gate_up_proj.weight` [2 ffn, dim] (gate's rows first: Phi3MLP's `gate, up = chunk(2)`); llama.cpp's
converter writes them as they are, `blk.N.attn_qkv.weight` and `blk.N.ffn_up.weight` [2 ffn, dim]
(its LLM_FFN_SWIGLU on a fused tensor takes the first half as the gate). Each canonical tensor
(wq, wk, wv, w1, w3) is its rows of the stored one (`TensorSpec.fused`). RoPE is NEOX-style, HF's
half-split pairs, so llama.cpp's converter permutes no rows.

The sliding window is the model's definition as transformers runs it (Phi-3-mini-4k: sliding_window
2047; each position attends to the last w positions, itself included), read from config.json's
sliding_window (null or absent: none) and from GGUF's `phi3.attention.sliding_window` (0 or absent:
none; the converter writes 0 for Phi-4, whose config has none). llama.cpp differs here: it reads the
key and then disables Phi's sliding window (src/models/phi3.cpp, "Phi SWA is currently disabled"), so
past the window llama.cpp's logits are not transformers' and not tinydet's. A window larger than the
context is refused.

Refused, from both formats, with the reason: LongRoPE (Phi-3-*-128k, Phi-3.5: config.json's
rope_scaling type "longrope" or "su" with long_factor / short_factor; GGUF's rope_factors_long /
rope_factors_short tensors) switches every position's frequencies once a sequence passes
original_max_position_embeddings, so a prefix's logits would depend on what follows it, which
tinydet's KV-cache and chunking contract rules out; partial RoPE (Phi-4-mini's partial_rotary_factor
0.75, GGUF rope.dimension_count < head_dim) is refused by the readers' common checks.
"""

from __future__ import annotations

import dataclasses

from . import LLAMA_TENSORS, ArchSpec
from ..config import LENGTH_DEPENDENT_ROPE
from ..errors import ModelFormatError, TinydetError

_L = "model.layers.{}."
_QKV = ("q_dim", "kv_dim", "kv_dim")
_GATE_UP = ("ffn_dim", "ffn_dim")
# canonical -> (GGUF name, HF name, the parts' row counts, this part's index)
_FUSED = {
    "layers.{}.wq": ("blk.{}.attn_qkv.weight", _L + "self_attn.qkv_proj.weight", _QKV, 0),
    "layers.{}.wk": ("blk.{}.attn_qkv.weight", _L + "self_attn.qkv_proj.weight", _QKV, 1),
    "layers.{}.wv": ("blk.{}.attn_qkv.weight", _L + "self_attn.qkv_proj.weight", _QKV, 2),
    "layers.{}.w1": ("blk.{}.ffn_up.weight", _L + "mlp.gate_up_proj.weight", _GATE_UP, 0),  # gate
    "layers.{}.w3": ("blk.{}.ffn_up.weight", _L + "mlp.gate_up_proj.weight", _GATE_UP, 1),  # up
}
TENSORS = tuple(
    dataclasses.replace(t, gguf=_FUSED[t.canonical][0], hf=_FUSED[t.canonical][1], fused=_FUSED[t.canonical][2],
                        part=_FUSED[t.canonical][3], rope_rows=None) if t.canonical in _FUSED else t
    for t in LLAMA_TENSORS)

ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # LongRoPE's, in a GGUF


def _windows(window: int, n: int) -> tuple[int, ...]:
    return (window,) * n if window else ()


def _gguf_config(k, fields: dict) -> dict:
    for name in ROPE_FACTORS:
        if name in k.g.tensors:
            raise ModelFormatError(k.path, name, f"LongRoPE is not supported: {LENGTH_DEPENDENT_ROPE['longrope']}")
    ctx = fields["context_length"]
    window = k.int("attention.sliding_window", 0)  # typed read: an array's repr would span lines
    if not 0 <= window <= ctx:
        k.bad("attention.sliding_window", f"expected a window in 0..context_length ({ctx}), found {window!r}")
    return {**fields, "layer_windows": _windows(window, fields["n_layers"])}


def _hf_config(f, fields: dict) -> dict:
    """sliding_window as Phi3Config reads it (default none). LongRoPE's rope_scaling is refused by the
    reader, with the reason (`config.rope_refusal`)."""
    if f.c.get("sliding_window") is None:
        return fields
    window, ctx = f.int("sliding_window"), fields["context_length"]
    if window > ctx:
        f.bad("sliding_window", f"window {window} is larger than max_position_embeddings ({ctx})")
    return {**fields, "layer_windows": _windows(window, fields["n_layers"])}


def _hf_out(cfg) -> dict:
    """config.json's Phi-3 keys for a config read from a GGUF (convert), as Phi-3-mini-4k's has them."""
    windows = set(cfg.layer_windows)
    if len(windows) > 1:
        raise TinydetError(f"phi3: config.json's one sliding_window cannot say these layer windows {cfg.layer_windows}")
    window = next(iter(windows), 0)
    return {"hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "embd_pdrop": 0.0,
            "resid_pdrop": 0.0, "sliding_window": window or None,
            "original_max_position_embeddings": cfg.context_length}  # used by LongRoPE only, which is refused


SPEC = ArchSpec(
    name="phi3",
    gguf_arch="phi3",
    hf_architectures=("Phi3ForCausalLM",),
    hf_model_type="phi3",
    tensors=TENSORS,
    gguf_config=_gguf_config,
    hf_config=_hf_config,
    hf_config_out=_hf_out,
)
