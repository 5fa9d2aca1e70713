"""A tiny SmolLM3 checkpoint made here, deterministically, for tests.

SmolLM3-3B is Llama 3.2's tokenizer on a Llama body with NoPE layers, so this module takes the tiny
Llama 3 tokenizer (bpetok's "llama3": tokenizer.json, tokenizer_config.json and the GGUF vocabulary as
llama.cpp's converter makes them) and writes its own model on tinygen's scaffold: the same random
weights as

* a Hugging Face directory (`write_hf_dir`): model.safetensors by transformers'
  `SmolLM3ForCausalLM.save_pretrained` (fp32, tied: no lm_head), config.json in the form of
  HuggingFaceTB/SmolLM3-3B's (no_rope_layers and no_rope_layer_interval 4, use_sliding_window false,
  sliding_window null, layer_types, rope_theta 5e6, rope_scaling null, tie_word_embeddings true);
* a GGUF file (`write_gguf`) as llama.cpp's convert_hf_to_gguf.py writes SmolLM3 (its SmolLM3Model is
  a LlamaModel): `general.architecture = smollm3`, Llama's hyperparameters (vocab_size,
  rope.dimension_count), Q/K rows permuted for llama.cpp's interleaved RoPE, token_embd only (tied),
  1-D tensors F32, optionally 2-D matrices quantized by gguf-py (`quant="q8_0"`, ...). No NoPE key:
  llama.cpp fixes every fourth layer as NoPE.

The model: 8 layers, so that layers 3 and 7 are NoPE (the interval repeats); 4 query heads over 2 KV
heads of 16 dims; FFN 160 (a multiple of 32, not of 64). `config_json(**changes)` and `write_hf_dir(...,
changes=...)` give the variants the tests need (explicit no_rope_layers, sliding layers, defaults).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import bpetok
from tinygen import Body, Tiny, with_changes

GENERATOR_VERSION = 1  # bump when any written byte changes

HIDDEN = 64
LAYERS = 8
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS  # 16
FFN = 160
VOCAB = bpetok.VOCAB  # 512: the Llama 3 tokenizer's 501 tokens and 11 special ones, exactly
CONTEXT = 512
ROPE_THETA = 5_000_000.0  # SmolLM3-3B's
RMS_EPS = 1e-6
NO_ROPE_INTERVAL = 4
NO_ROPE_LAYERS = [int((i + 1) % NO_ROPE_INTERVAL != 0) for i in range(LAYERS)]  # 1: RoPE

EMBED_STD = 0.15
MATRIX_STD = 0.1
NORM_STD = 0.1  # norm weights 1 + NORM_STD * N(0, 1)

TOKENIZER = "llama3"  # bpetok's kind


def config_json(**changes) -> dict:
    """config.json as SmolLM3-3B's (transformers 4.x keys), with `changes` applied (None removes a key)."""
    bos, eos = bpetok.token_id("<|begin_of_text|>", TOKENIZER), bpetok.token_id("<|eot_id|>", TOKENIZER)
    c = {
        "architectures": ["SmolLM3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": FFN,
        "layer_types": ["full_attention"] * LAYERS,
        "max_position_embeddings": CONTEXT,
        "max_window_layers": LAYERS,
        "mlp_bias": False,
        "model_type": "smollm3",
        "no_rope_layer_interval": NO_ROPE_INTERVAL,
        "no_rope_layers": list(NO_ROPE_LAYERS),
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "pad_token_id": None,
        "pretraining_tp": 1,
        "rms_norm_eps": RMS_EPS,
        "rope_scaling": None,
        "rope_theta": ROPE_THETA,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    }
    return with_changes(c, changes)


def spec() -> Tiny:
    a = "smollm3"
    body = Body(HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, tied=True, embed_std=EMBED_STD,
                matrix_std=MATRIX_STD, norm_std=NORM_STD, lm_head_std=None)
    # TextModel.set_gguf_parameters, then LlamaModel's; no NoPE key: llama.cpp fixes every fourth layer
    hparams = {f"{a}.block_count": LAYERS, f"{a}.context_length": CONTEXT, f"{a}.embedding_length": HIDDEN,
               f"{a}.feed_forward_length": FFN, f"{a}.attention.head_count": HEADS,
               f"{a}.attention.head_count_kv": KV_HEADS, f"{a}.rope.freq_base": ROPE_THETA,
               f"{a}.attention.layer_norm_rms_epsilon": RMS_EPS, "general.file_type": None,
               f"{a}.vocab_size": VOCAB, f"{a}.rope.dimension_count": HEAD_DIM}
    c = config_json()
    return Tiny("smollm3", "SmolLM3", body, c, {"bos_token_id": c["bos_token_id"], "eos_token_id": c["eos_token_id"]},
                lambda d: bpetok.write_tokenizer_files(d, TOKENIZER), a, hparams,
                lambda w: bpetok.add_vocab(w, TOKENIZER), permute=True)


def state_dict(seed: int = 0) -> dict[str, np.ndarray]:
    """The weights under SmolLM3ForCausalLM's names (tied: no lm_head), float32, drawn in a fixed order."""
    return spec().state_dict(seed)


def hf_model(seed: int = 0, attn: str = "eager", weights: dict | None = None, **changes):
    """transformers' SmolLM3ForCausalLM (float32, eval) of config_json(**changes) holding the weights."""
    return spec().hf_model(seed, weights, config_json(**changes), attn)


def write_hf_dir(hf_dir: Path, seed: int = 0, changes: dict | None = None) -> Path:
    """model.safetensors (save_pretrained), config.json (with `changes`), generation_config.json and
    the tokenizer files. Returns hf_dir."""
    return spec().write_hf_dir(hf_dir, seed, config_json(**(changes or {})))


def write_gguf(path: Path, quant: str | None = None, seed: int = 0, overrides: dict | None = None) -> Path:
    """The same model as llama.cpp's converter writes a SmolLM3 GGUF (module docstring). `overrides`:
    metadata keys added after the hyperparameters (int -> uint32, float -> float32), for broken files."""
    return spec().write_gguf(path, quant, seed, overrides=overrides)


def dequantized_state_dict(quant: str | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    return spec().dequantized(quant, seed)
