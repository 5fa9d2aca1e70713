"""Mistral (MistralForCausalLM, config.json model_type "mistral"): Llama's tensors and layout plus a
sliding window over every layer and a head dimension of its own, read as transformers' MistralConfig
reads config.json.

Hugging Face directories only (`gguf_arch=None`): llama.cpp's converter registers MistralForCausalLM
in its LlamaModel, so a Mistral GGUF is a `llama` file (Q/K rows permuted as for Llama) and tinydet
reads it with the llama spec; converting it back gives a LlamaForCausalLM directory. The converter
writes no sliding-window key, so such a file attends to every position, as llama.cpp runs it: for
Mistral 7B v0.1 (sliding_window 4096) the GGUF and the directory differ past 4096 positions; v0.2 and
v0.3 (sliding_window null) and Mistral-Nemo are the same model either way.

config.json, with MistralConfig's defaults where a key is absent:
  sliding_window   null: every position; w: each position attends to the last w positions, itself
                   included (transformers' sliding_window_overlay: kv > q - w), which is
                   ModelConfig.layer_windows' meaning; absent: 4096, MistralConfig's default. Refused
                   when larger than max_position_embeddings (and not positive).
  head_dim         null or absent: hidden_size / num_attention_heads; else its own (Mistral-Nemo: 128
                   for a hidden size of 5120 over 32 heads).
  rope_scaling     none accepted (Mistral 7B and Nemo have none); anything else is refused by name.
  layer_types      ignored, as MistralModel ignores it (it slides every layer).
"""

from __future__ import annotations

from . import LLAMA_TENSORS, ArchSpec

DEFAULT_WINDOW = 4096  # MistralConfig's sliding_window when config.json has no such key


def _hf_config(f, fields: dict) -> dict:
    """The sliding window (module docstring)."""
    if "sliding_window" not in f.c:
        window, said = DEFAULT_WINDOW, " (MistralConfig's default: config.json has no sliding_window)"
    elif f.c["sliding_window"] is None:
        return fields
    else:
        window, said = f.int("sliding_window"), ""
    ctx = fields["context_length"]
    if window > ctx:
        f.bad("sliding_window", f"window {window}{said} is larger than max_position_embeddings ({ctx})")
    return {**fields, "layer_windows": (window,) * fields["n_layers"]}


SPEC = ArchSpec(
    name="mistral",
    gguf_arch=None,  # written as `llama` by llama.cpp's converter (module docstring)
    hf_architectures=("MistralForCausalLM",),
    hf_model_type="mistral",
    tensors=LLAMA_TENSORS,
    own_head_dim=True,
    hf_config=_hf_config,
)
