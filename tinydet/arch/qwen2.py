"""Qwen2 and Qwen2.5: Llama plus biases on the q, k and v projections (flag qkv_bias). llama.cpp
rotates Qwen2's q and k with NEOX RoPE, HF's half-split pairs, so its converter writes the rows as HF
has them: nothing is permuted. A config.json with use_sliding_window slides the layers from
max_window_layers on, as transformers does (Qwen2.5's own configs leave it off)."""

from __future__ import annotations

from . import LLAMA_TENSORS, ArchSpec, TensorSpec

_BIASES = tuple(
    TensorSpec(f"layers.{{}}.b{x}", f"blk.{{}}.attn_{x}.bias", f"model.layers.{{}}.self_attn.{x}_proj.bias", (dim,),
               flag="qkv_bias") for x, dim in (("q", "q_dim"), ("k", "kv_dim"), ("v", "kv_dim")))


def _hf_config(f, fields: dict) -> dict:
    """Sliding windows from config.json: layer_types where given, else transformers' rule."""
    n = fields["n_layers"]
    if not f.c.get("use_sliding_window"):
        return fields
    window = f.int("sliding_window")
    types = f.layer_types(n, lambda: ["sliding_attention" if i >= f.int("max_window_layers", 28) else "full_attention"
                                      for i in range(n)])
    return {**fields, "layer_windows": tuple(window if t == "sliding_attention" else 0 for t in types)}


def _hf_out(cfg) -> dict:
    windows = [w for w in cfg.layer_windows if w]
    out = {"hidden_act": "silu", "use_sliding_window": bool(windows), "sliding_window": windows[0] if windows else None,
           "max_window_layers": cfg.n_layers, "attention_dropout": 0.0}
    if windows:
        out["layer_types"] = ["sliding_attention" if w else "full_attention" for w in cfg.layer_windows]
    return out


SPEC = ArchSpec(
    name="qwen2",
    gguf_arch="qwen2",
    hf_architectures=("Qwen2ForCausalLM",),
    hf_model_type="qwen2",
    tensors=LLAMA_TENSORS + _BIASES,
    flags={"qkv_bias": True},
    hf_config=_hf_config,
    hf_config_out=_hf_out,
)
