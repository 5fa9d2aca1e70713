"""A tiny Gemma 2 checkpoint made here, deterministically, for tests.

Gemma 2 is Gemma 3's layout without QK-norm and with attention logit soft-capping; this module takes
the tiny Gemma tokenizer of `gemma3gen` (SentencePiece-style, tokenizer.json as transformers'
GemmaConverter writes it, the GGUF vocabulary as llama.cpp's _set_vocab_sentencepiece makes it) and
writes its own model: the same random weights as

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

import gemma3gen as G3
from tinygen import QUANTS, add_tensor, stored_values, tied_hf_model
from tinygen import write_json as _write_json

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
MATRIX_STD = 0.08
NORM_STD = 0.1  # w = NORM_STD * N(0, 1); the model scales by (1 + w)

SLIDING = tuple(i % 2 == 0 for i in range(LAYERS))


def config_json(**changes) -> dict:
    """config.json as google/gemma-2-2b's (transformers 4.x keys), `changes` applied (None removes a key)."""
    c = {
        "architectures": ["Gemma2ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": ATTN_SOFTCAP,
        "bos_token_id": G3.BOS_ID,
        "cache_implementation": "hybrid",
        "eos_token_id": [G3.EOS_ID, G3.token_id("<end_of_turn>")],
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
        "pad_token_id": G3.PAD_ID,
        "query_pre_attn_scalar": QUERY_PRE_ATTN_SCALAR,
        "rms_norm_eps": RMS_EPS,
        "rope_theta": ROPE_THETA,
        "sliding_window": SLIDING_WINDOW,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": G3.vocab_size(),
    }
    for k, v in changes.items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    return c


def state_dict(seed: int = 0) -> dict[str, np.ndarray]:
    """The weights under Gemma2ForCausalLM's names (tied: no lm_head), float32, drawn in this order."""
    rs = np.random.RandomState(seed)

    def normal(shape, std):
        return (rs.standard_normal(shape) * std).astype(np.float32)

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    sd = {"model.embed_tokens.weight": normal((G3.vocab_size(), HIDDEN), EMBED_STD)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = normal(HIDDEN, NORM_STD)
        sd[p + "self_attn.q_proj.weight"] = normal((q, HIDDEN), MATRIX_STD)
        sd[p + "self_attn.k_proj.weight"] = normal((kv, HIDDEN), MATRIX_STD)
        sd[p + "self_attn.v_proj.weight"] = normal((kv, HIDDEN), MATRIX_STD)
        sd[p + "self_attn.o_proj.weight"] = normal((HIDDEN, q), MATRIX_STD)
        sd[p + "post_attention_layernorm.weight"] = normal(HIDDEN, NORM_STD)
        sd[p + "pre_feedforward_layernorm.weight"] = normal(HIDDEN, NORM_STD)
        sd[p + "mlp.gate_proj.weight"] = normal((FFN, HIDDEN), MATRIX_STD)
        sd[p + "mlp.up_proj.weight"] = normal((FFN, HIDDEN), MATRIX_STD)
        sd[p + "mlp.down_proj.weight"] = normal((HIDDEN, FFN), MATRIX_STD)
        sd[p + "post_feedforward_layernorm.weight"] = normal(HIDDEN, NORM_STD)
    sd["model.norm.weight"] = normal(HIDDEN, NORM_STD)
    return sd


def hf_model(seed: int = 0, attn: str = "eager", weights: dict | None = None, **changes):
    """transformers' Gemma2ForCausalLM (float32, eval) of config_json(**changes) holding the weights."""
    import transformers

    skip = ("architectures", "model_type", "torch_dtype")
    cfg = transformers.Gemma2Config(**{k: v for k, v in config_json(**changes).items() if k not in skip})
    cfg._attn_implementation = attn
    return tied_hf_model(transformers.Gemma2ForCausalLM(cfg), weights or state_dict(seed))


def write_hf_dir(hf_dir: Path, seed: int = 0, changes: dict | None = None) -> Path:
    hf_dir = Path(hf_dir)
    hf_dir.mkdir(parents=True, exist_ok=True)
    hf_model(seed).save_pretrained(hf_dir, safe_serialization=True)
    _write_json(hf_dir / "config.json", config_json(**(changes or {})))
    _write_json(hf_dir / "generation_config.json", G3.generation_config_json())
    G3.write_tokenizer_files(hf_dir)
    return hf_dir


def write_gguf(path: Path, quant: str | None = None, seed: int = 0, overrides: dict | None = None,
               drop: tuple[str, ...] = ()) -> Path:
    """The same model as a llama.cpp-style gemma2 GGUF (module docstring). `overrides` maps a metadata
    key to the value written instead of the converter's (or added after the hyperparameters); `drop`
    names tensors left out."""
    import gguf
    from gguf import GGUFWriter, LlamaFileType

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sd = state_dict(seed)
    overrides = dict(overrides or {})
    a = "gemma2"
    w = GGUFWriter(path, a)

    def kv(key, add, value):
        add(overrides.pop(key, value))

    w.add_type(gguf.GGUFType.MODEL)
    w.add_name("Tiny Gemma2" + (f" S{seed}" if seed else ""))
    n_params = sum(v.size for v in sd.values())
    w.add_size_label(gguf.size_label(n_params, n_params, 0, 0))
    # Gemma2Model.set_gguf_parameters, in its order
    kv(f"{a}.context_length", w.add_context_length, CONTEXT)
    kv(f"{a}.embedding_length", w.add_embedding_length, HIDDEN)
    kv(f"{a}.block_count", w.add_block_count, LAYERS)
    kv(f"{a}.feed_forward_length", w.add_feed_forward_length, FFN)
    kv(f"{a}.attention.head_count", w.add_head_count, HEADS)
    kv(f"{a}.attention.head_count_kv", w.add_head_count_kv, KV_HEADS)
    kv(f"{a}.attention.layer_norm_rms_epsilon", w.add_layer_norm_rms_eps, RMS_EPS)
    kv(f"{a}.attention.key_length", w.add_key_length, HEAD_DIM)
    kv(f"{a}.attention.value_length", w.add_value_length, HEAD_DIM)
    w.add_file_type(LlamaFileType[QUANTS[quant][1]])
    kv(f"{a}.attn_logit_softcapping", w.add_attn_logit_softcapping, ATTN_SOFTCAP)
    kv(f"{a}.final_logit_softcapping", w.add_final_logit_softcapping, FINAL_SOFTCAP)
    kv(f"{a}.attention.sliding_window", w.add_sliding_window, SLIDING_WINDOW)
    G3.add_overrides(w, overrides)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    G3.add_vocab(w)
    if overrides:
        raise KeyError(f"overrides for keys write_gguf does not write: {sorted(overrides)}")
    for hf_name in sorted(sd):
        gname = G3.gguf_name(hf_name)
        if gname in drop:
            continue
        arr = G3.gguf_norm(sd[hf_name]) if G3.is_norm(hf_name) else sd[hf_name]
        add_tensor(w, gname, arr, quant)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def dequantized_state_dict(quant: str | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    return {k: stored_values(v, quant) for k, v in state_dict(seed).items()}


def make_tiny_gemma2(out_dir: Path, quant: str | None = None, seed: int = 0) -> tuple[Path, Path]:
    """Both forms under out_dir -> (out_dir/tiny-gemma2/, out_dir/tiny-gemma2-<F32|Q8_0|...>.gguf)."""
    out_dir = Path(out_dir)
    stem = "tiny-gemma2" + (f"-s{seed}" if seed else "")
    return write_hf_dir(out_dir / stem, seed=seed), write_gguf(out_dir / f"{stem}-{QUANTS[quant][0]}.gguf", quant, seed)
