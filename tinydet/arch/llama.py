"""Llama (and SmolLM, TinyLlama, Llama 3.x, ...): every feature flag off. llama.cpp's converter permutes
the rows of Q and K for its interleaved RoPE; tinydet's kernels rotate HF's half-split pairs, so GGUF
rows are moved back at load. Llama 3.1's RoPE scaling comes from config.json's rope_scaling
(rope_type "llama3") or from a GGUF's rope_freqs.weight, the divisors llama.cpp's converter computes
from it (`tinydet.rope`); linear scaling from either format. A llama GGUF with expert_count is a
Mixtral (`arch/mixtral.py`): llama.cpp's converter writes it so, and so it is read here; converting it
to Hugging Face writes a MixtralForCausalLM directory."""

from __future__ import annotations

from . import LLAMA_TENSORS, ArchSpec
from .mixtral import TENSORS as _MIXTRAL
from .moe import gguf_moe


def _gguf_config(k, fields: dict) -> dict:
    """A `llama` GGUF with expert_count is Mixtral (as llama.cpp runs it: softmax gating, renormalised)."""
    return gguf_moe(k, fields, norm_topk=True)


def _hf_out(cfg) -> dict:
    return {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}


SPEC = ArchSpec(
    name="llama",
    gguf_arch="llama",
    hf_architectures=("LlamaForCausalLM",),
    hf_model_type="llama",
    tensors=LLAMA_TENSORS + _MIXTRAL,  # the experts' only where expert_count says (Mixtral)
    gguf_rope_permuted=True,
    own_head_dim=True,  # config.json head_dim / GGUF attention.key_length (Mistral-Nemo's 128 for 5120 / 32)
    rope_scalings=("none", "linear", "llama3", "factors"),
    gguf_config=_gguf_config,
    hf_config_out=_hf_out,
    hf_moe_spec="mixtral",
)
