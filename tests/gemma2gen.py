"""A tiny Gemma 2 checkpoint made here, deterministically, for tests.

Gemma 2 is Gemma 3's layout without QK-norm and with attention logit soft-capping; this module takes
the tiny Gemma tokenizer (gemmatok) and writes its own model on tinygen's scaffold: the same random
weights as

* a Hugging Face directory (`write_hf_dir`): model.safetensors by transformers'
  `Gemma2ForCausalLM.save_pretrained` (fp32, tied: no lm_head), config.json in the form of Google's
  published gemma-2 configs (model_type "gemma2", attn_logit_softcapping 50, final_logit_softcapping
  30, query_pre_attn_scalar, sliding_window, hidden_act and hidden_activation, rope_theta, no
  layer_types: transformers' rule slides the even layers);
* a GGUF file (`write_gguf`) as llama.cpp's convert_hf_to_gguf.py (Gemma2Model) writes it: its
  hyperparameters in its order (no rope.freq_base), every norm weight stored as (1 + w) in float32,
  Q/K not permuted, token_embd only, 1-D tensors F32, optionally 2-D matrices quantized by gguf-py.

The model: 4 layers (0 and 2 slide over the last SLIDING_WINDOW = 8 positions, 1 and 3 attend to
everything), 4 query heads over 2 KV heads of 32 dims (q_dim 128, not the hidden size 64),
query_pre_attn_scalar = head_dim (llama.cpp's rule for every Gemma 2 but the 27B), FFN 160.
`config_json(**changes)` gives the variants the tests need.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import gemmatok as T
from tinygen import GEMMA_GGUF_NAMES, Body, Tiny, with_changes

GENERATOR_VERSION = 1

HIDDEN = 64
LAYERS = 4
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32
FFN = 160
CONTEXT = 512
SLIDING_WINDOW = 8
ROPE_THETA = 10_000.0
QUERY_PRE_ATTN_SCALAR = HEAD_DIM
ATTN_SOFTCAP = 50.0
FINAL_SOFTCAP = 30.0
RMS_EPS = 1e-6

EMBED_STD = 0.15
NORM_STD = 0.1  # w = NORM_STD * N(0, 1); the model scales by (1 + w)

SLIDING = tuple(i % 2 == 0 for i in range(LAYERS))


def config_json(**changes) -> dict:
    """config.json as google/gemma-2-2b's (transformers 4.x keys), `changes` applied (None removes a key)."""
    c = {
        "architectures": ["Gemma2ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": ATTN_SOFTCAP,
        "bos_token_id": T.BOS_ID,
        "cache_implementation": "hybrid",
        "eos_token_id": [T.EOS_ID, T.token_id("<end_of_turn>")],
        "final_logit_softcapping": FINAL_SOFTCAP,
        "head_dim": HEAD_DIM,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": FFN,
        "max_position_embeddings": CONTEXT,
        "model_type": "gemma2",
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "pad_token_id": T.PAD_ID,
        "query_pre_attn_scalar": QUERY_PRE_ATTN_SCALAR,
        "rms_norm_eps": RMS_EPS,
        "rope_theta": ROPE_THETA,
        "sliding_window": SLIDING_WINDOW,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": T.vocab_size(),
    }
    return with_changes(c, changes)


def spec() -> Tiny:
    a = "gemma2"
    body = Body(HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, T.vocab_size(), tied=True, embed_std=EMBED_STD,
                norm_std=NORM_STD, norm_one=False, lm_head_std=None, sandwich=True)
    # Gemma2Model.set_gguf_parameters, in its order
    hparams = {f"{a}.context_length": CONTEXT, f"{a}.embedding_length": HIDDEN, f"{a}.block_count": LAYERS,
               f"{a}.feed_forward_length": FFN, f"{a}.attention.head_count": HEADS,
               f"{a}.attention.head_count_kv": KV_HEADS, f"{a}.attention.layer_norm_rms_epsilon": RMS_EPS,
               f"{a}.attention.key_length": HEAD_DIM, f"{a}.attention.value_length": HEAD_DIM,
               "general.file_type": None, f"{a}.attn_logit_softcapping": ATTN_SOFTCAP,
               f"{a}.final_logit_softcapping": FINAL_SOFTCAP, f"{a}.attention.sliding_window": SLIDING_WINDOW}
    return Tiny("gemma2", "Gemma2", body, config_json(), T.generation_config_json(), T.write_tokenizer_files, a,
                hparams, T.add_vocab, GEMMA_GGUF_NAMES, norm_offset=True)


def state_dict(seed: int = 0) -> dict[str, np.ndarray]:
    """The weights under Gemma2ForCausalLM's names (tied: no lm_head), float32, drawn in a fixed order."""
    return spec().state_dict(seed)


def hf_model(seed: int = 0, attn: str = "eager", weights: dict | None = None, **changes):
    """transformers' Gemma2ForCausalLM (float32, eval) of config_json(**changes) holding the weights."""
    return spec().hf_model(seed, weights, config_json(**changes), attn)


def write_hf_dir(hf_dir: Path, seed: int = 0, changes: dict | None = None) -> Path:
    return spec().write_hf_dir(hf_dir, seed, config_json(**(changes or {})))


def write_gguf(path: Path, quant: str | None = None, seed: int = 0, overrides: dict | None = None,
               drop: tuple[str, ...] = ()) -> Path:
    """The same model as a llama.cpp-style gemma2 GGUF (module docstring; tinygen.Tiny.write_gguf:
    `overrides` and `drop` make files that are wrong on purpose)."""
    return spec().write_gguf(path, quant, seed, overrides=overrides, drop=drop)


def dequantized_state_dict(quant: str | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    return spec().dequantized(quant, seed)
