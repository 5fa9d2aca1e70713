"""Llama (and SmolLM, TinyLlama, Llama 3.x, ...): every feature flag off. llama.cpp's converter permutes
the rows of Q and K for its interleaved RoPE; tinydet's kernels rotate HF's half-split pairs, so GGUF
rows are moved back at load. Llama 3.1's RoPE scaling comes from config.json's rope_scaling
(rope_type "llama3") or from a GGUF's rope_freqs.weight, the divisors llama.cpp's converter computes
from it (`tinydet.rope`); linear scaling from either format."""

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
    own_head_dim=True,  # config.json head_dim / GGUF attention.key_length (Mistral-Nemo's 128 for 5120 / 32)
    rope_scalings=("none", "linear", "llama3", "factors"),
    hf_config_out=_hf_out,
)
