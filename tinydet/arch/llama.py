"""Llama (and SmolLM, TinyLlama, ...): every feature flag off. llama.cpp's converter permutes the
rows of Q and K for its interleaved RoPE; tinydet's kernels rotate HF's half-split pairs, so GGUF rows
are moved back at load."""

from __future__ import annotations

from . import LLAMA_TENSORS, ArchSpec


def _hf_out(cfg) -> dict:
    return {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}


SPEC = ArchSpec(
    name="llama",
    gguf_arch="llama",
    hf_architectures=("LlamaForCausalLM",),
    hf_model_type="llama",
    tensors=LLAMA_TENSORS,
    gguf_rope_permuted=True,
    hf_config_out=_hf_out,
)
