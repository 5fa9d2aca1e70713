"""OLMoE (OlmoeForCausalLM, OLMoE-1B-7B): Llama's attention with an RMSNorm over the whole of q and of
k (weights of q_dim and kv_dim: not per head as Qwen3's), NEOX RoPE (HF's half-split pairs: llama.cpp's
converter permutes nothing), and in every layer a mixture of experts in place of the dense FFN: the
softmax over every expert's router logit taken at the num_experts_per_tok best, not renormalised
unless norm_topk_prob (OLMoE's models leave it off, and llama.cpp's olmoe never divides), each expert
a SwiGLU FFN of width intermediate_size.

config.json as OlmoeConfig reads it; clip_qkv (a clamp of q, k and v) is refused. GGUF: olmoe.expert_count
and .expert_used_count, feed_forward_length the experts' width."""

from __future__ import annotations

from . import LLAMA_ATTENTION, ArchSpec, TensorSpec, moe_tensors
from .moe import gguf_moe, hf_moe, hf_moe_out

_QK_NORMS = tuple(
    TensorSpec(f"layers.{{}}.{x}_norm", f"blk.{{}}.attn_{x}_norm.weight",
               f"model.layers.{{}}.self_attn.{x}_norm.weight", (width,), flag="qk_norm")
    for x, width in (("q", "q_dim"), ("k", "kv_dim")))


def _gguf_config(k, fields: dict) -> dict:
    return gguf_moe(k, fields, norm_topk=False, required=True)


def _hf_config(f, fields: dict) -> dict:
    if f.c.get("clip_qkv") is not None:
        f.bad("clip_qkv", "clamping q, k and v is not supported")
    return hf_moe(f, fields, "num_experts", "intermediate_size", "norm_topk_prob")


def _hf_out(cfg) -> dict:
    return {"hidden_act": "silu", "attention_bias": False, "clip_qkv": None,
            **hf_moe_out(cfg, "num_experts", "intermediate_size", "norm_topk_prob")}


SPEC = ArchSpec(
    name="olmoe",
    gguf_arch="olmoe",
    hf_architectures=("OlmoeForCausalLM",),
    hf_model_type="olmoe",
    tensors=LLAMA_ATTENTION + _QK_NORMS + moe_tensors("mlp.gate", "mlp.experts"),
    flags={"qk_norm": True},
    gguf_config=_gguf_config,
    hf_config=_hf_config,
    hf_config_out=_hf_out,
)
