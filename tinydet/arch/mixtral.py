"""Mixtral (MixtralForCausalLM, model_type "mixtral"): Llama's attention and, in every layer, a
mixture of experts in place of the dense FFN: the softmax over every expert's router logit taken at
the num_experts_per_tok best and divided by their sum, each expert a SwiGLU FFN of width
intermediate_size (HF names w1 gate, w2 down, w3 up, under block_sparse_moe).

Hugging Face directories only (`gguf_arch=None`): llama.cpp's converter writes Mixtral as a `llama`
file with expert_count set, which the llama spec reads (Q/K rows permuted as for Llama). config.json
as MixtralConfig reads it: sliding_window null (the released models) or a window over every layer,
as Mistral's."""

from __future__ import annotations

from . import LLAMA_ATTENTION, ArchSpec, moe_tensors
from .mistral import _hf_config as _window
from .moe import hf_moe, hf_moe_out

TENSORS = moe_tensors("block_sparse_moe.gate", "block_sparse_moe.experts", ("w1", "w2", "w3"))


def _hf_config(f, fields: dict) -> dict:
    if "sliding_window" not in f.c:  # MixtralConfig's default is none (Mistral's: 4096)
        f.c = {**f.c, "sliding_window": None}
    return hf_moe(f, _window(f, fields), "num_local_experts", "intermediate_size", True)


def _hf_out(cfg) -> dict:
    windows = sorted(set(cfg.layer_windows) - {0})
    return {"hidden_act": "silu", **hf_moe_out(cfg, "num_local_experts", "intermediate_size", None),
            "sliding_window": windows[0] if windows else None, "router_jitter_noise": 0.0}


SPEC = ArchSpec(
    name="mixtral",
    gguf_arch=None,  # written as `llama` by llama.cpp's converter (module docstring)
    hf_architectures=("MixtralForCausalLM",),
    hf_model_type="mixtral",
    tensors=LLAMA_ATTENTION + TENSORS,
    own_head_dim=True,
    hf_config=_hf_config,
    hf_config_out=_hf_out,
)
