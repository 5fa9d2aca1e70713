"""Tiny Mistral and Phi-3 checkpoints made here, deterministically, for tests: the Llama-2-style
SentencePiece family.

No Mistral or Phi-3 checkpoint can be fetched on the project's machines, so this module makes small ones
(`arch` "mistral" or "phi3") on tinygen's scaffold: the same random weights written as

* a Hugging Face directory (`write_hf_dir`): model.safetensors written by transformers'
  `MistralForCausalLM` / `Phi3ForCausalLM.save_pretrained` (fp32), plus config.json,
  generation_config.json, tokenizer.json and tokenizer_config.json (and Phi-3's added_tokens.json) laid
  out as the published repos have them (config.json in the hub's transformers-4.x form);
* a GGUF file (`write_gguf`) with the names and keys llama.cpp's convert_hf_to_gguf.py writes
  (alignment 32, 1-D tensors F32), optionally with its 2-D matrices quantized by gguf-py
  (`quant="q8_0"`, `"q4_0"`, ...).

Mistral (Mistral-7B-Instruct-v0.3's config.json form: rope_theta 1e6, sliding_window null, no
head_dim key) is written by llama.cpp's converter as a `llama` GGUF (conversion/llama.py registers
MistralForCausalLM in LlamaModel): Q and K rows permuted for llama.cpp's interleaved RoPE
(LlamaModel.permute), `llama.vocab_size` and `llama.rope.dimension_count`, no sliding-window key.
`head_dim=32` gives a Mistral-Nemo-like model whose head dimension is not hidden / heads (config.json
`head_dim`, GGUF `llama.attention.key_length` / `value_length`).

Phi-3 (Phi-3-mini-4k-instruct's config.json form: rope_theta 10000, sliding_window, bos 1, eos and pad
<|endoftext|>, original_max_position_embeddings; its `auto_map` is left out, transformers has the
class) has fused projections: `self_attn.qkv_proj.weight` [q_dim + 2 kv_dim, dim] (q, k, v rows) and
`mlp.gate_up_proj.weight` [2 ffn, dim] (gate rows, then up), written by llama.cpp's converter
(conversion/phi.py, Phi3MiniModel) as `blk.N.attn_qkv.weight` and `blk.N.ffn_up.weight`, not permuted
(NEOX RoPE), with its `phi3.*` keys: context_length, rope.scaling.original_context_length,
embedding_length, feed_forward_length, block_count, head_count, head_count_kv,
layer_norm_rms_epsilon, rope.dimension_count, rope.freq_base, file_type, attention.sliding_window.
Its window here is PHI3_SLIDING_WINDOW = 7 positions (Phi-3-mini-4k's is 2047 = 2**11 - 1), fewer
than the test prompts have, so that the window matters.

The tokenizer is Llama 2's kind (llama2tok). generation_config.json's eos ids for Phi-3 are
[<|endoftext|>, <|assistant|>, <|end|>], as Phi-3-mini-4k-instruct's ([32000, 32001, 32007]).

`write_gguf` needs numpy and gguf only; `write_hf_dir` also needs torch and transformers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import tinygen
from llama2tok import (BASE_VOCAB, BOS_ID, CONTROL, EOS_ID, FIRST_BYTE, MISTRAL_CHAT_TEMPLATE,  # noqa: F401
                       PHI3_ADDED, PHI3_CHAT_TEMPLATE, PHI3_VOCAB, USER_DEFINED, add_vocab, gguf_vocab, hf_tokenizer,
                       token_id, tokenizer_json, vocab_size, write_tokenizer_files)
from tinygen import GGUF_NAMES, QUANTS, Body, Tiny  # noqa: F401 (the tests' names)

GENERATOR_VERSION = 1  # bump when any written byte changes (for callers that cache the files)

ARCHS = {"mistral": "Mistral", "phi3": "Phi3"}
GGUF_ARCH = {"mistral": "llama", "phi3": "phi3"}  # general.architecture

# ---------------------------------------------------------------------------------------------------
# The model

HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2  # GQA (Mistral 7B: 32 / 8; Phi-3-mini has 32 / 32, Phi-3-medium 40 / 10)
HEAD_DIM = HIDDEN // HEADS  # 16
FFN = 160  # a multiple of 32 (the GGML block size), not of 64
CONTEXT = 512
RMS_EPS = 1e-5  # both models' rms_norm_eps
ROPE_THETA = {"mistral": 1_000_000.0, "phi3": 10_000.0}  # Mistral 7B v0.2/v0.3, Phi-3-mini
PHI3_SLIDING_WINDOW = 7


def head_dim_of(head_dim: int | None = None) -> int:
    return HEAD_DIM if head_dim is None else head_dim


def config_json(arch: str = "mistral", tied: bool = False, head_dim: int | None = None) -> dict:
    """config.json in the form of Mistral-7B-Instruct-v0.3's or Phi-3-mini-4k-instruct's (4.x keys).
    `head_dim` (Mistral only): a head dimension of its own, as Mistral-Nemo's config.json has it."""
    if arch == "mistral":
        c = {
            "architectures": ["MistralForCausalLM"],
            "attention_dropout": 0.0,
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
            "hidden_act": "silu",
            "hidden_size": HIDDEN,
            "initializer_range": 0.02,
            "intermediate_size": FFN,
            "max_position_embeddings": CONTEXT,
            "model_type": "mistral",
            "num_attention_heads": HEADS,
            "num_hidden_layers": LAYERS,
            "num_key_value_heads": KV_HEADS,
            "rms_norm_eps": RMS_EPS,
            "rope_theta": ROPE_THETA[arch],
            "sliding_window": None,
            "tie_word_embeddings": tied,
            "torch_dtype": "float32",
            "use_cache": True,
            "vocab_size": vocab_size(arch),
        }
        if head_dim is not None:
            c = dict(sorted({**c, "head_dim": head_dim}.items()))
        return c
    if head_dim is not None:
        raise ValueError("head_dim: Mistral only (Phi-3's is hidden_size / num_attention_heads)")
    eot = token_id("<|endoftext|>", arch)
    return {
        "architectures": ["Phi3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": BOS_ID,
        "embd_pdrop": 0.0,
        "eos_token_id": eot,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": FFN,
        "max_position_embeddings": CONTEXT,
        "model_type": "phi3",
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "original_max_position_embeddings": CONTEXT,
        "pad_token_id": eot,
        "resid_pdrop": 0.0,
        "rms_norm_eps": RMS_EPS,
        "rope_scaling": None,
        "rope_theta": ROPE_THETA[arch],
        "sliding_window": PHI3_SLIDING_WINDOW,
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": vocab_size(arch),
    }


def generation_config_json(arch: str = "mistral") -> dict:
    if arch == "mistral":
        return {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}
    eot = token_id("<|endoftext|>", arch)
    return {"bos_token_id": BOS_ID, "eos_token_id": [eot, token_id("<|assistant|>", arch), token_id("<|end|>", arch)],
            "pad_token_id": eot}



def spec(arch: str = "mistral", tied: bool = False, head_dim: int | None = None) -> Tiny:
    """The tinygen spec of `arch` (Mistral: `llama` GGUF, Q/K rows permuted; Phi-3: fused tensors)."""
    hd, a = head_dim_of(head_dim), GGUF_ARCH[arch]
    body = Body(HIDDEN, LAYERS, HEADS, KV_HEADS, hd, FFN, vocab_size(arch), tied=tied, fused=arch == "phi3")
    if arch == "mistral":  # TextModel.set_gguf_parameters, then LlamaModel's
        hp = {"block_count": LAYERS, "context_length": CONTEXT, "embedding_length": HIDDEN, "feed_forward_length": FFN,
              "attention.head_count": HEADS, "attention.head_count_kv": KV_HEADS, "rope.freq_base": ROPE_THETA[arch],
              "attention.layer_norm_rms_epsilon": RMS_EPS}
        if head_dim is not None:  # config.json's head_dim
            hp |= {"attention.key_length": head_dim, "attention.value_length": head_dim}
        hp |= {"file_type": None, "vocab_size": vocab_size(arch), "rope.dimension_count": hd}
    else:  # Phi3MiniModel.set_gguf_parameters
        hp = {"context_length": CONTEXT, "rope.scaling.original_context_length": CONTEXT, "embedding_length": HIDDEN,
              "feed_forward_length": FFN, "block_count": LAYERS, "attention.head_count": HEADS,
              "attention.head_count_kv": KV_HEADS, "attention.layer_norm_rms_epsilon": RMS_EPS,
              "rope.dimension_count": hd,  # int(partial_rotary_factor * dim) // heads
              "rope.freq_base": ROPE_THETA[arch], "file_type": None, "attention.sliding_window": PHI3_SLIDING_WINDOW}
    hparams = {("general." if k == "file_type" else f"{a}.") + k: v for k, v in hp.items()}
    stem = arch + ("-tied" if tied else "") + (f"-hd{head_dim}" if head_dim is not None else "")
    return Tiny(stem, ARCHS[arch] + (" Tied" if tied else ""), body, config_json(arch, tied, head_dim),
                generation_config_json(arch), lambda d: write_tokenizer_files(d, arch), a, hparams,
                lambda w: add_vocab(w, arch), permute=arch == "mistral")


def state_dict(arch: str = "mistral", tied: bool = False, seed: int = 0,
               head_dim: int | None = None) -> dict[str, np.ndarray]:
    """The weights under transformers' MistralForCausalLM / Phi3ForCausalLM names, float32, drawn in
    a fixed order (Phi-3's fused matrices drawn whole)."""
    return spec(arch, tied, head_dim).state_dict(seed)


def hf_model(arch: str = "mistral", tied: bool = False, seed: int = 0, head_dim: int | None = None,
             attn: str = "eager", weights: dict | None = None):
    """The transformers MistralForCausalLM / Phi3ForCausalLM (float32, eval mode, `attn` attention)
    holding `state_dict(arch, tied, seed, head_dim)` (or `weights`, under the same names)."""
    return spec(arch, tied, head_dim).hf_model(seed, weights, attn=attn)


def write_hf_dir(hf_dir: Path, arch: str = "mistral", tied: bool = False, seed: int = 0,
                 head_dim: int | None = None) -> Path:
    return spec(arch, tied, head_dim).write_hf_dir(hf_dir, seed)


def gguf_name(hf_name: str) -> str:
    return tinygen.gguf_name(hf_name, GGUF_NAMES)


def write_gguf(path: Path, arch: str = "mistral", quant: str | None = None, tied: bool = False, seed: int = 0,
               name: str | None = None, head_dim: int | None = None, overrides: dict | None = None,
               extra_tensors: dict | None = None) -> Path:
    """The same model as llama.cpp's converter writes it (a `llama` GGUF for Mistral, `phi3` for
    Phi-3; tinygen.Tiny.write_gguf). name: general.name, by default what the converter derives from
    make_tiny's directory name ("Tiny Phi3": llama.cpp gives Phi-3's special tokens rstrip by that
    name). `overrides` and `extra_tensors` (Phi-3 128k's rope_factors_long / short, say) make files
    that are wrong on purpose."""
    return spec(arch, tied, head_dim).write_gguf(path, quant, seed, name, overrides, extra=extra_tensors)


def dequantized_state_dict(arch: str = "mistral", quant: str | None = None, tied: bool = False, seed: int = 0,
                           head_dim: int | None = None) -> dict[str, np.ndarray]:
    """state_dict() as the GGUF of `quant` stores it. (Blocks run along rows, so Mistral's permuted
    rows and Phi-3's fused ones quantize as these do.)"""
    return spec(arch, tied, head_dim).dequantized(quant, seed)


def make_tiny(out_dir: Path, arch: str = "mistral", quant: str | None = None, tied: bool = False,
              seed: int = 0, head_dim: int | None = None) -> tuple[Path, Path]:
    """Both forms under out_dir -> (hf_dir, gguf_path): out_dir/tiny-ARCH[-tied][-hdN][-sN]/ and
    out_dir/tiny-ARCH[-tied][-hdN][-sN]-<F32|Q8_0|...>.gguf."""
    return spec(arch, tied, head_dim).make(out_dir, quant, seed)


if __name__ == "__main__":  # python tests/spmgen.py OUT_DIR mistral|phi3 [quant] [--tied]
    import sys
    import time

    t0 = time.perf_counter()
    args = [x for x in sys.argv[1:] if x != "--tied"]
    hf, gg = make_tiny(Path(args[0]), args[1], quant=args[2] if len(args) > 2 else None, tied="--tied" in sys.argv)
    print(hf, gg, f"{time.perf_counter() - t0:.2f}s")
