"""Qwen3 (dense): Qwen2 without the q/k/v biases, with QK-norm (an RMSNorm over each head of q and k,
before RoPE) and a head dimension of its own (GGUF `qwen3.attention.key_length`, config.json
`head_dim`: Qwen3's q_dim is not its hidden size). NEOX RoPE as Qwen2: llama.cpp's converter permutes
nothing. Sliding windows from config.json as Qwen2's (a config with `attention_bias` is refused by the
reader, as for every spec without biases)."""

from __future__ import annotations

from . import LLAMA_TENSORS, ArchSpec, TensorSpec
from .qwen2 import _hf_config
from .qwen2 import _hf_out as _qwen2_out

_QK_NORMS = tuple(
    TensorSpec(f"layers.{{}}.{x}_norm", f"blk.{{}}.attn_{x}_norm.weight", f"model.layers.{{}}.self_attn.{x}_norm.weight",
               ("head_dim",), flag="qk_norm") for x in ("q", "k"))


def _hf_out(cfg) -> dict:
    return {**_qwen2_out(cfg), "attention_bias": False}


SPEC = ArchSpec(
    name="qwen3",
    gguf_arch="qwen3",
    hf_architectures=("Qwen3ForCausalLM",),
    hf_model_type="qwen3",
    tensors=LLAMA_TENSORS + _QK_NORMS,
    flags={"qk_norm": True},
    own_head_dim=True,
    rope_scalings=("none", "yarn"),  # YaRN from config.json (Qwen3's long-context setting)
    hf_config=_hf_config,
    hf_config_out=_hf_out,
)
