"""Tiny Gemma 3 (text) checkpoints made here, deterministically, for tests.

The real Gemma 3 is too big for most tests (and its vocabulary alone is 262,144 tokens), so this module
makes a small one on tinygen's scaffold, with gemmatok's tokenizer: the same random weights written as

* a Hugging Face directory (`write_hf_dir`): model.safetensors written by transformers'
  `Gemma3ForCausalLM.save_pretrained` (fp32, tied: no lm_head), plus config.json, generation_config.json,
  tokenizer.json and tokenizer_config.json laid out as Google's published Gemma 3 text repos have them
  (config.json in the hub's transformers-4.x form: model_type "gemma3_text", rope_theta for the global
  layers, rope_local_base_freq for the sliding ones, rope_scaling null, layer_types, no
  tie_word_embeddings key: Gemma3TextConfig ties by default);
* a GGUF file (`write_gguf`) with llama.cpp's `gemma3` metadata keys and tensor names, laid out as
  llama.cpp's convert_hf_to_gguf.py (conversion/gemma.py, Gemma3Model) writes them: every norm weight
  stored as (1 + w), computed in float32 as the converter does for an fp32 checkpoint, 1-D tensors F32,
  Q/K *not* permuted (Gemma rotates NEOX-style), token_embd only (tied), attention.sliding_window,
  key_length / value_length, rope.freq_base and rope.freq_base_swa; optionally with its 2-D matrices
  quantized by gguf-py (`quant="q8_0"`, `"q4_0"`, ...).

The model: 6 layers, so that llama.cpp's fixed gemma3 layer pattern (6: every sixth layer attends
globally) and transformers' layer_types agree: layers 0-4 slide over the last SLIDING_WINDOW = 8
positions (fewer than the test prompts have, so the window matters) with RoPE base 10000, layer 5
attends to everything with base 1e6. A head_dim of its own (32: q_dim 128 is not the hidden size 64),
query_pre_attn_scalar = head_dim (llama.cpp's rule for every Gemma 3 but the 27B), GQA (4 query heads,
2 KV heads), no logit soft-capping. Norm weights w are random (1 + w is what scales), never zero.

`write_gguf` needs numpy and gguf only; `write_hf_dir` also needs torch and transformers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import tinygen
from gemmatok import (ADDED_TOKENS, BOS_ID, CHAT_TEMPLATE, EOS_ID, N_MERGES, PAD_ID, SPIECE,  # noqa: F401
                      TRAINING_TEXT, add_vocab, generation_config_json, hf_tokenizer, sentencepiece_vocab, token_id,
                      tokenizer_json, vocab_size, write_tokenizer_files)
from tinygen import GEMMA_GGUF_NAMES, QUANTS, Body, Tiny  # noqa: F401 (the tests' names)

GENERATOR_VERSION = 1  # bump when any written byte changes (for callers that cache the files)

HIDDEN = 64
LAYERS = 6
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32  # Gemma's own head_dim: q_dim = 128 != HIDDEN
FFN = 160  # a multiple of 32 (the GGML block size), not of 64
CONTEXT = 512
SLIDING_WINDOW = 8
PATTERN = 6  # every PATTERN-th layer attends globally (llama.cpp: set_swa_pattern(6) for gemma3)
ROPE_THETA = 1_000_000.0  # the global layers'
ROPE_LOCAL_BASE = 10_000.0  # the sliding layers'
QUERY_PRE_ATTN_SCALAR = HEAD_DIM
RMS_EPS = 1e-6

EMBED_STD = 0.15  # the embedding is scaled by sqrt(HIDDEN) = 8 before the first layer
NORM_STD = 0.1  # norm weights w = NORM_STD * N(0, 1); the model scales by (1 + w)

LAYER_TYPES = tuple("full_attention" if (i + 1) % PATTERN == 0 else "sliding_attention" for i in range(LAYERS))


def config_json() -> dict:
    """config.json in the form of Google's published Gemma 3 text configs (transformers 4.x keys)."""
    return {
        "_sliding_window_pattern": PATTERN,
        "architectures": ["Gemma3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "final_logit_softcapping": None,
        "head_dim": HEAD_DIM,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": FFN,
        "layer_types": list(LAYER_TYPES),
        "max_position_embeddings": CONTEXT,
        "model_type": "gemma3_text",
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "pad_token_id": PAD_ID,
        "query_pre_attn_scalar": QUERY_PRE_ATTN_SCALAR,
        "rms_norm_eps": RMS_EPS,
        "rope_local_base_freq": ROPE_LOCAL_BASE,
        "rope_scaling": None,
        "rope_theta": ROPE_THETA,
        "sliding_window": SLIDING_WINDOW,
        "torch_dtype": "float32",
        "use_bidirectional_attention": False,
        "use_cache": True,
        "vocab_size": vocab_size(),
    }


def is_norm(hf_name: str) -> bool:
    """A Gemma norm weight (HF stores w, the model scales by 1 + w)."""
    return hf_name.endswith("norm.weight")


def spec() -> Tiny:
    a = "gemma3"
    body = Body(HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, vocab_size(), tied=True, embed_std=EMBED_STD,
                norm_std=NORM_STD, norm_one=False, lm_head_std=None, qk_norm="head", sandwich=True)
    # TextModel.set_gguf_parameters, then Gemma3Model's
    hparams = {f"{a}.block_count": LAYERS, f"{a}.context_length": CONTEXT, f"{a}.embedding_length": HIDDEN,
               f"{a}.feed_forward_length": FFN, f"{a}.attention.head_count": HEADS,
               f"{a}.attention.head_count_kv": KV_HEADS, f"{a}.rope.freq_base": ROPE_THETA,
               f"{a}.rope.freq_base_swa": ROPE_LOCAL_BASE, f"{a}.attention.layer_norm_rms_epsilon": RMS_EPS,
               f"{a}.attention.key_length": HEAD_DIM, f"{a}.attention.value_length": HEAD_DIM,
               "general.file_type": None, f"{a}.attention.sliding_window": SLIDING_WINDOW}
    return Tiny("gemma3", "Gemma3", body, config_json(), generation_config_json(), write_tokenizer_files, a, hparams,
                add_vocab, GEMMA_GGUF_NAMES, norm_offset=True)


def state_dict(seed: int = 0) -> dict[str, np.ndarray]:
    """The weights under transformers' Gemma3ForCausalLM names (tied: no lm_head), float32."""
    return spec().state_dict(seed)


def hf_model(seed: int = 0, attn: str = "eager", weights: dict | None = None):
    """The transformers Gemma3ForCausalLM (float32, eval mode, `attn` attention) holding
    `state_dict(seed)` (or `weights`, under the same names)."""
    return spec().hf_model(seed, weights, attn=attn)


def write_hf_dir(hf_dir: Path, seed: int = 0) -> Path:
    return spec().write_hf_dir(hf_dir, seed)


def gguf_name(hf_name: str) -> str:
    return tinygen.gguf_name(hf_name, GEMMA_GGUF_NAMES)


def write_gguf(path: Path, quant: str | None = None, seed: int = 0, name: str | None = None,
               overrides: dict | None = None, drop: tuple[str, ...] = ()) -> Path:
    """The same model as a llama.cpp-style gemma3 GGUF (tinygen.Tiny.write_gguf: `overrides` and
    `drop` make files that are wrong on purpose)."""
    return spec().write_gguf(path, quant, seed, name, overrides, drop)


def dequantized_state_dict(quant: str | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """state_dict() as the GGUF of `quant` stores it (the norms as HF's w)."""
    return spec().dequantized(quant, seed)


def make_tiny_gemma3(out_dir: Path, quant: str | None = None, seed: int = 0) -> tuple[Path, Path]:
    """Both forms under out_dir -> (out_dir/tiny-gemma3/, out_dir/tiny-gemma3-<F32|Q8_0|...>.gguf)."""
    return spec().make(out_dir, quant, seed)



if __name__ == "__main__":  # python tests/gemma3gen.py OUT_DIR [quant]
    import sys
    import time

    t0 = time.perf_counter()
    hf, gg = make_tiny_gemma3(Path(sys.argv[1]), quant=sys.argv[2] if len(sys.argv) > 2 else None)
    print(hf, gg, f"{time.perf_counter() - t0:.2f}s")
