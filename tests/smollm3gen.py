"""A tiny SmolLM3 checkpoint made here, deterministically, for tests.

SmolLM3-3B is Llama 3.2's tokenizer on a Llama body with NoPE layers, so this module takes the tiny
Llama 3 tokenizer of `qwen2gen` (arch "llama3": tokenizer.json, tokenizer_config.json and the GGUF
vocabulary as llama.cpp's converter makes them) and writes its own model: the same random weights as

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

import qwen2gen as Q
from tinygen import QUANTS, add_tensor, stored_values, tied_hf_model
from tinygen import write_json as _write_json

GENERATOR_VERSION = 1  # bump when any written byte changes

HIDDEN = 64
LAYERS = 8
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS  # 16
FFN = 160
VOCAB = Q.VOCAB  # 512: the Llama 3 tokenizer's 501 tokens and 11 special ones, exactly
CONTEXT = 512
ROPE_THETA = 5_000_000.0  # SmolLM3-3B's
RMS_EPS = 1e-6
NO_ROPE_INTERVAL = 4
NO_ROPE_LAYERS = [int((i + 1) % NO_ROPE_INTERVAL != 0) for i in range(LAYERS)]  # 1: RoPE

EMBED_STD = 0.15
MATRIX_STD = 0.1
NORM_STD = 0.1  # norm weights 1 + NORM_STD * N(0, 1)

TOKENIZER = "llama3"  # qwen2gen's arch for the tokenizer files


def config_json(**changes) -> dict:
    """config.json as SmolLM3-3B's (transformers 4.x keys), with `changes` applied (None removes a key)."""
    bos, eos = Q.token_id("<|begin_of_text|>", TOKENIZER), Q.token_id("<|eot_id|>", TOKENIZER)
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
    for k, v in changes.items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    return c


def state_dict(seed: int = 0) -> dict[str, np.ndarray]:
    """The weights under SmolLM3ForCausalLM's names (tied: no lm_head), float32, drawn in this order."""
    rs = np.random.RandomState(seed)

    def normal(shape, std):
        return (rs.standard_normal(shape) * std).astype(np.float32)

    def norm():
        return (1.0 + rs.standard_normal(HIDDEN) * NORM_STD).astype(np.float32)

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    sd = {"model.embed_tokens.weight": normal((VOCAB, HIDDEN), EMBED_STD)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm()
        for x, rows in (("q", q), ("k", kv), ("v", kv)):
            sd[p + f"self_attn.{x}_proj.weight"] = normal((rows, HIDDEN), MATRIX_STD)
        sd[p + "self_attn.o_proj.weight"] = normal((HIDDEN, q), MATRIX_STD)
        sd[p + "post_attention_layernorm.weight"] = norm()
        sd[p + "mlp.gate_proj.weight"] = normal((FFN, HIDDEN), MATRIX_STD)
        sd[p + "mlp.up_proj.weight"] = normal((FFN, HIDDEN), MATRIX_STD)
        sd[p + "mlp.down_proj.weight"] = normal((HIDDEN, FFN), MATRIX_STD)
    sd["model.norm.weight"] = norm()
    return sd


def hf_model(seed: int = 0, attn: str = "eager", weights: dict | None = None, **changes):
    """transformers' SmolLM3ForCausalLM (float32, eval) of config_json(**changes) holding the weights."""
    import transformers

    skip = ("architectures", "model_type", "torch_dtype")
    cfg = transformers.SmolLM3Config(**{k: v for k, v in config_json(**changes).items() if k not in skip})
    cfg._attn_implementation = attn
    return tied_hf_model(transformers.SmolLM3ForCausalLM(cfg), weights or state_dict(seed))


def write_hf_dir(hf_dir: Path, seed: int = 0, changes: dict | None = None) -> Path:
    """model.safetensors (save_pretrained), config.json (with `changes`), generation_config.json and
    the tokenizer files. Returns hf_dir."""
    hf_dir = Path(hf_dir)
    hf_dir.mkdir(parents=True, exist_ok=True)
    hf_model(seed).save_pretrained(hf_dir, safe_serialization=True)
    _write_json(hf_dir / "config.json", config_json(**(changes or {})))
    c = config_json()
    _write_json(hf_dir / "generation_config.json",
                {"bos_token_id": c["bos_token_id"], "eos_token_id": c["eos_token_id"]})
    Q.write_tokenizer_files(hf_dir, TOKENIZER)
    return hf_dir


def write_gguf(path: Path, quant: str | None = None, seed: int = 0, overrides: dict | None = None) -> Path:
    """The same model as llama.cpp's converter writes a SmolLM3 GGUF (module docstring). `overrides`:
    metadata keys added after the hyperparameters (int -> uint32, float -> float32), for broken files."""
    import gguf
    from gguf import GGUFWriter, LlamaFileType

    from gemma3gen import add_overrides

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sd = state_dict(seed)
    tokens, toktypes, merges = Q.gguf_vocab(TOKENIZER)
    w = GGUFWriter(path, "smollm3")
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name("Tiny SmolLM3" + (f" S{seed}" if seed else ""))
    n_params = sum(v.size for v in sd.values())
    w.add_size_label(gguf.size_label(n_params, n_params, 0, 0))
    # TextModel.set_gguf_parameters, then LlamaModel's
    w.add_block_count(LAYERS)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(ROPE_THETA)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_file_type(LlamaFileType[QUANTS[quant][1]])
    w.add_vocab_size(VOCAB)
    w.add_rope_dimension_count(HEAD_DIM)
    add_overrides(w, dict(overrides or {}))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types(toktypes)
    w.add_token_merges(merges)
    w.add_bos_token_id(Q.token_id("<|begin_of_text|>", TOKENIZER))
    w.add_eos_token_id(Q.token_id("<|eot_id|>", TOKENIZER))
    w.add_add_bos_token(True)
    w.add_chat_template(Q.LLAMA3_CHAT_TEMPLATE)
    for hf_name in sorted(sd):  # the converter walks the safetensors file, sorted by name
        arr = sd[hf_name]
        if hf_name.endswith(("q_proj.weight", "k_proj.weight")):  # LlamaModel.modify_tensors
            arr = Q.llama_permute(arr, HEADS if "q_proj" in hf_name else KV_HEADS)
        add_tensor(w, Q.gguf_name(hf_name), arr, quant)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def dequantized_state_dict(quant: str | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    return {k: stored_values(v, quant) for k, v in state_dict(seed).items()}


def make_tiny_smollm3(out_dir: Path, quant: str | None = None, seed: int = 0) -> tuple[Path, Path]:
    """Both forms under out_dir -> (out_dir/tiny-smollm3/, out_dir/tiny-smollm3-<F32|Q8_0|...>.gguf)."""
    out_dir = Path(out_dir)
    stem = "tiny-smollm3" + (f"-s{seed}" if seed else "")
    return write_hf_dir(out_dir / stem, seed=seed), write_gguf(out_dir / f"{stem}-{QUANTS[quant][0]}.gguf", quant, seed)
