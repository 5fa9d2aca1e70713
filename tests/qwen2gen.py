"""Tiny Qwen2, Qwen3 and Llama 3 checkpoints made here, deterministically, for tests.

No Qwen2, Qwen3 or Llama 3 checkpoint can be fetched on the project's machines, so this module makes
them (`arch` "qwen2", the default, "qwen3" or "llama3") on tinygen's scaffold: the same random weights
written as

* a Hugging Face directory (`write_hf_dir`): model.safetensors written by transformers'
  `Qwen2ForCausalLM.save_pretrained` (fp32), plus config.json, generation_config.json and the
  tokenizer files (bpetok) laid out as Qwen's published Qwen2/Qwen2.5 repos have them (config.json in
  the hub's transformers-4.x form, with top-level rope_theta and torch_dtype);
* a GGUF file (`write_gguf`) with llama.cpp's `qwen2` metadata keys and tensor names, laid out as
  llama.cpp's convert_hf_to_gguf.py writes them (alignment 32, 1-D tensors F32, Q/K *not* permuted:
  Qwen2 is a NEOX-RoPE architecture), optionally with its 2-D matrices quantized by gguf-py
  (`quant="q8_0"`, `"q4_0"`, ...).

Qwen3 differs as Qwen3's published repos and llama.cpp's converter do: no q/k/v biases, an RMSNorm
weight per head of q and of k (`self_attn.q_norm` / `k_norm`, GGUF `attn_q_norm` / `attn_k_norm`), a
head_dim of its own (here 32, so q_dim = 128 is not the hidden size 64: config.json `head_dim`, GGUF
`qwen3.attention.key_length` / `value_length`), `attention_bias: false`; the tokenizer, the chat
template (Qwen2's ChatML) and every other setting are shared.

Llama 3 differs as Meta's Llama 3.2 repos and llama.cpp's converter (conversion/llama.py, LlamaModel)
do: a LlamaForCausalLM without biases; config.json with rope_theta 500000 and a "llama3" rope_scaling
(`LLAMA3_ROPE`), eos_token_id [<|end_of_text|>, <|eom_id|>, <|eot_id|>]; its own tokenizer (bpetok).
Its GGUF is `general.architecture = llama` with Q/K rows permuted for llama.cpp's interleaved RoPE
(LlamaModel.permute), vocab_size and rope.dimension_count keys, tokenizer.ggml.pre "llama-bpe",
add_bos_token true, and the RoPE scaling only as `rope_freqs.weight` (the converter's per-frequency
divisors, `llama3_rope_freqs`), written first.

`write_gguf` needs numpy, tokenizers and gguf only; `write_hf_dir` also needs torch and transformers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import tinygen
from bpetok import (CHAT_TEMPLATE, LLAMA3_CHAT_TEMPLATE, N_MERGES, PLAIN_ADDED_TOKENS,  # noqa: F401 (the tests' names)
                    SPECIAL_TOKENS, VOCAB, add_vocab, added_tokens, gguf_vocab, hf_tokenizer, token_id, tokenizer_json,
                    write_tokenizer_files)
from tinygen import GGUF_NAMES, QUANTS, Body, Tiny, file_digests, llama_permute  # noqa: F401 (the tests' names)

GENERATOR_VERSION = 1  # bump when any written byte changes (for callers that cache the files)

HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS  # 16
QWEN3_HEAD_DIM = 32  # Qwen3's own head_dim: q_dim = 128 != HIDDEN
FFN = 160  # not a multiple of 64, on purpose (still a multiple of 32, the GGML block size)
CONTEXT = 512
ROPE_THETA = 1_000_000.0
RMS_EPS = 1e-6
BIAS_STD = 0.3  # q/k/v biases: large enough that a runtime that drops them gets clearly different logits

# Llama 3.2's RoPE scaling, with original_max_position_embeddings scaled down with the model so that at
# head_dim 16 one frequency is blended and six divided by the factor (8192 would scale only the slowest).
LLAMA3_ROPE = {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 64,
               "rope_type": "llama3"}
LLAMA3_ROPE_THETA = 500_000.0


ARCHS = {"qwen2": "Qwen2", "qwen3": "Qwen3", "llama3": "Llama"}  # arch -> transformers' class prefix
GGUF_ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "llama3": "llama"}


def head_dim(arch: str = "qwen2") -> int:
    return QWEN3_HEAD_DIM if arch == "qwen3" else HEAD_DIM


def config_json(tied: bool = False, arch: str = "qwen2") -> dict:
    """config.json in the form of Qwen's published Qwen2.5 (Qwen3) configs, or Meta's Llama 3.2 one
    (transformers 4.x keys)."""
    if arch == "llama3":
        return {
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": token_id("<|begin_of_text|>", arch),
            "eos_token_id": [token_id(t, arch) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")],
            "head_dim": HEAD_DIM,
            "hidden_act": "silu",
            "hidden_size": HIDDEN,
            "initializer_range": 0.02,
            "intermediate_size": FFN,
            "max_position_embeddings": CONTEXT,
            "mlp_bias": False,
            "model_type": "llama",
            "num_attention_heads": HEADS,
            "num_hidden_layers": LAYERS,
            "num_key_value_heads": KV_HEADS,
            "pretraining_tp": 1,
            "rms_norm_eps": RMS_EPS,
            "rope_scaling": dict(LLAMA3_ROPE),
            "rope_theta": LLAMA3_ROPE_THETA,
            "tie_word_embeddings": tied,
            "torch_dtype": "float32",
            "use_cache": True,
            "vocab_size": VOCAB,
        }
    c = {
        "architectures": [f"{ARCHS[arch]}ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": token_id("<|endoftext|>"),
        "eos_token_id": token_id("<|im_end|>"),
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": FFN,
        "max_position_embeddings": CONTEXT,
        "max_window_layers": LAYERS,
        "model_type": arch,
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": RMS_EPS,
        "rope_theta": ROPE_THETA,
        "sliding_window": CONTEXT,
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    }
    if arch == "qwen3":
        c.update(attention_bias=False, head_dim=QWEN3_HEAD_DIM)
        c = dict(sorted(c.items()))
    return c


def generation_config_json(arch: str = "qwen2") -> dict:
    if arch == "llama3":
        c = config_json(arch=arch)
        return {"bos_token_id": c["bos_token_id"], "do_sample": True, "eos_token_id": c["eos_token_id"],
                "temperature": 0.6, "top_p": 0.9}
    eot = token_id("<|endoftext|>")
    return {"bos_token_id": eot, "eos_token_id": [token_id("<|im_end|>"), eot], "pad_token_id": eot}


def spec(tied: bool = False, arch: str = "qwen2") -> Tiny:
    """The tinygen spec of `arch` (tied: no lm_head, the output is the embedding)."""
    llama = arch == "llama3"
    body = Body(HIDDEN, LAYERS, HEADS, KV_HEADS, head_dim(arch), FFN, VOCAB, tied=tied,
                bias_std=BIAS_STD if arch == "qwen2" else None, qk_norm="head" if arch == "qwen3" else None)
    a = GGUF_ARCH[arch]
    hparams = {f"{a}.block_count": LAYERS, f"{a}.context_length": CONTEXT, f"{a}.embedding_length": HIDDEN,
               f"{a}.feed_forward_length": FFN, f"{a}.attention.head_count": HEADS,
               f"{a}.attention.head_count_kv": KV_HEADS,
               f"{a}.rope.freq_base": LLAMA3_ROPE_THETA if llama else ROPE_THETA,
               f"{a}.attention.layer_norm_rms_epsilon": RMS_EPS}
    if arch == "qwen3":  # config.json's head_dim
        hparams |= {f"{a}.attention.key_length": QWEN3_HEAD_DIM, f"{a}.attention.value_length": QWEN3_HEAD_DIM}
    hparams["general.file_type"] = None
    if llama:  # LlamaModel.set_gguf_parameters
        hparams |= {f"{a}.vocab_size": VOCAB, f"{a}.rope.dimension_count": HEAD_DIM}
    title = ("Llama 3" if llama else ARCHS[arch]) + (" Tied" if tied else "")
    return Tiny(arch + ("-tied" if tied else ""), title, body, config_json(tied, arch), generation_config_json(arch),
                lambda d: write_tokenizer_files(d, arch), a, hparams, lambda w: add_vocab(w, arch), permute=llama,
                attn=None, extra=(lambda: {"rope_freqs.weight": llama3_rope_freqs()}) if llama else None)


def state_dict(tied: bool = False, seed: int = 0, arch: str = "qwen2") -> dict[str, np.ndarray]:
    """The weights under transformers' Qwen2ForCausalLM (Qwen3ForCausalLM, LlamaForCausalLM) names,
    float32, drawn in a fixed order (tinygen.draw_weights; lm_head drawn even when tied)."""
    return spec(tied, arch).state_dict(seed)


def llama3_rope_freqs(base: float = LLAMA3_ROPE_THETA, dim: int = HEAD_DIM, p: dict = LLAMA3_ROPE) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter computes it (conversion/llama.py,
    LlamaModel.generate_extra_tensors, with torch in float32), from config.json's rope_theta, head_dim
    and rope_scaling (by default the tiny model's)."""
    import math

    import torch

    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, lo, hi, old = p["factor"], p["low_freq_factor"], p["high_freq_factor"], p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / lo, old / hi
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()




def hf_model(tied: bool = False, seed: int = 0, arch: str = "qwen2"):
    """The transformers Qwen2ForCausalLM / Qwen3ForCausalLM / LlamaForCausalLM (float32, eval mode,
    transformers' default attention) holding `state_dict(tied, seed, arch)`."""
    return spec(tied, arch).hf_model(seed)


def write_hf_dir(hf_dir: Path, tied: bool = False, seed: int = 0, arch: str = "qwen2") -> Path:
    return spec(tied, arch).write_hf_dir(hf_dir, seed)


def gguf_name(hf_name: str) -> str:
    return tinygen.gguf_name(hf_name, GGUF_NAMES)


def write_gguf(path: Path, quant: str | None = None, tied: bool = False, seed: int = 0,
               name: str | None = None, arch: str = "qwen2") -> Path:
    """The same model as a llama.cpp-style qwen2 (qwen3, llama) GGUF (tinygen.Tiny.write_gguf); Llama 3's
    rope_freqs.weight first. name: general.name, by default what the converter derives from
    make_tiny_qwen2's directory name. Returns path."""
    return spec(tied, arch).write_gguf(path, quant, seed, name)


def dequantized_state_dict(quant: str | None = None, tied: bool = False, seed: int = 0,
                           arch: str = "qwen2") -> dict[str, np.ndarray]:
    """state_dict() as the GGUF of `quant` stores it, for comparing quantized files against a float
    reference."""
    return spec(tied, arch).dequantized(quant, seed)


def make_tiny_qwen2(out_dir: Path, quant: str | None = None, tied: bool = False,
                    seed: int = 0, arch: str = "qwen2") -> tuple[Path, Path]:
    """Both forms under out_dir -> (hf_dir, gguf_path):
    out_dir/tiny-ARCH[-tied]/ and out_dir/tiny-ARCH[-tied]-<F32|Q8_0|...>.gguf."""
    return spec(tied, arch).make(out_dir, quant, seed)


if __name__ == "__main__":  # python tests/qwen2gen.py OUT_DIR [quant] [--tied] [--qwen3 | --llama3]
    import sys
    import time

    t0 = time.perf_counter()
    args = [a for a in sys.argv[1:] if a not in ("--tied", "--qwen3", "--llama3")]
    arch = "qwen3" if "--qwen3" in sys.argv else "llama3" if "--llama3" in sys.argv else "qwen2"
    hf, gg = make_tiny_qwen2(Path(args[0]), quant=args[1] if len(args) > 1 else None, tied="--tied" in sys.argv,
                             arch=arch)
    print(hf, gg, f"{time.perf_counter() - t0:.2f}s")
