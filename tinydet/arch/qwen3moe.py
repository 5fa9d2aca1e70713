"""Qwen3-MoE (Qwen3MoeForCausalLM, Qwen3-30B-A3B and Qwen3-235B-A22B): Qwen3's attention (QK-norm, a
head dimension of its own, NEOX RoPE: nothing permuted) and, in every layer, a mixture of experts in
place of the dense FFN: a router, then the softmax over every expert's logit taken at the
num_experts_per_tok best, divided by their sum where norm_topk_prob (Qwen's released models set it;
llama.cpp always divides), each chosen expert a SwiGLU FFN of width moe_intermediate_size.

config.json, with Qwen3MoeConfig's defaults: decoder_sparse_step must be 1 and mlp_only_layers empty
(every layer sparse, as in every released Qwen3-MoE); norm_topk_prob default false. GGUF:
qwen3moe.expert_count, .expert_used_count and .expert_feed_forward_length (feed_forward_length is
the dense width, unused)."""

from __future__ import annotations

from . import LLAMA_ATTENTION, ArchSpec, moe_tensors
from .moe import gguf_moe, hf_moe, hf_moe_out
from .qwen2 import _hf_config as _qwen2_hf_config
from .qwen3 import _QK_NORMS
from .qwen3 import _hf_out as _qwen3_out


def _gguf_config(k, fields: dict) -> dict:
    return gguf_moe(k, fields, norm_topk=True, ffn_key="expert_feed_forward_length", required=True)


def _hf_config(f, fields: dict) -> dict:
    if f.int("decoder_sparse_step", 1) != 1:
        f.bad("decoder_sparse_step", "only every layer sparse (1) is supported")
    if f.c.get("mlp_only_layers"):
        f.bad("mlp_only_layers", "dense layers among the sparse ones are not supported")
    return hf_moe(f, _qwen2_hf_config(f, fields), "num_experts", "moe_intermediate_size", "norm_topk_prob")


def _hf_out(cfg) -> dict:
    return {**_qwen3_out(cfg), **hf_moe_out(cfg, "num_experts", "moe_intermediate_size", "norm_topk_prob"),
            "intermediate_size": cfg.ffn_dim, "decoder_sparse_step": 1, "mlp_only_layers": []}


SPEC = ArchSpec(
    name="qwen3moe",
    gguf_arch="qwen3moe",
    hf_architectures=("Qwen3MoeForCausalLM",),
    hf_model_type="qwen3_moe",
    tensors=LLAMA_ATTENTION + _QK_NORMS + moe_tensors("mlp.gate", "mlp.experts"),
    flags={"qk_norm": True},
    own_head_dim=True,
    rope_scalings=("none", "yarn"),  # YaRN from config.json (Qwen3's long-context setting)
    gguf_config=_gguf_config,
    hf_config=_hf_config,
    hf_config_out=_hf_out,
)
