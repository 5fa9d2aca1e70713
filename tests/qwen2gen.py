"""Tiny Qwen2 and Qwen3 checkpoints made here, deterministically, for tests.

No Qwen2 or Qwen3 checkpoint can be fetched on the project's machines, so this module makes them (`arch`
"qwen2", the default, or "qwen3"): the same random weights written as

* a Hugging Face directory (`write_hf_dir`): model.safetensors written by transformers'
  `Qwen2ForCausalLM.save_pretrained` (fp32), plus config.json, generation_config.json, tokenizer.json,
  tokenizer_config.json, vocab.json and merges.txt laid out as Qwen's published Qwen2/Qwen2.5 repos have
  them (config.json in the hub's transformers-4.x form, with top-level rope_theta and torch_dtype);
* a GGUF file (`write_gguf`) with llama.cpp's `qwen2` metadata keys and tensor names, laid out as
  llama.cpp's convert_hf_to_gguf.py writes them (alignment 32, 1-D tensors F32, Q/K *not* permuted:
  Qwen2 is a NEOX-RoPE architecture), optionally with its 2-D matrices quantized by gguf-py
  (`quant="q8_0"`, `"q4_0"`, ...).

Qwen3 differs as Qwen3's published repos and llama.cpp's converter do: no q/k/v biases, an RMSNorm
weight per head of q and of k (`self_attn.q_norm` / `k_norm`, GGUF `attn_q_norm` / `attn_k_norm`), a
head_dim of its own (here 32, so q_dim = 128 is not the hidden size 64: config.json `head_dim`, GGUF
`qwen3.attention.key_length` / `value_length`), `attention_bias: false`; the tokenizer, the chat
template (Qwen2's ChatML) and every other setting are shared.

The tokenizer is a real byte-level BPE with Qwen2's pre-tokenizer, trained here by a small deterministic
BPE trainer on `TRAINING_TEXT`, with Qwen2's special tokens added after the base vocabulary (as Qwen does)
and the model's embedding padded past the tokenizer (as Qwen does).

Everything is written deterministically: the same call writes byte-identical files on any machine
(weights come from `np.random.RandomState`, whose stream NumPy keeps stable; JSON files are written
here, not by a library whose output format may change). `write_gguf` needs numpy, tokenizers and gguf
only; `write_hf_dir` also needs torch and transformers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

GENERATOR_VERSION = 1  # bump when any written byte changes (for callers that cache the files)

# ---------------------------------------------------------------------------------------------------
# The model

HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS  # 16
QWEN3_HEAD_DIM = 32  # Qwen3's own head_dim: q_dim = 128 != HIDDEN
FFN = 160  # not a multiple of 64, on purpose (still a multiple of 32, the GGML block size)
VOCAB = 512  # the embedding's rows; the tokenizer has fewer tokens (Qwen pads its embedding too)
CONTEXT = 512
ROPE_THETA = 1_000_000.0
RMS_EPS = 1e-6
N_MERGES = 230  # base vocabulary: 256 byte tokens + 230 merges = 486 tokens

# Scales of the random weights (std of the normal draws).
EMBED_STD = 0.1
MATRIX_STD = 0.08
LM_HEAD_STD = 0.2
BIAS_STD = 0.3  # q/k/v biases: large enough that a runtime that drops them gets clearly different logits
NORM_STD = 0.1  # norm weights are 1 + NORM_STD * N(0, 1)

# ---------------------------------------------------------------------------------------------------
# The tokenizer

# Qwen2's pre-tokenizer, as in its tokenizer.json (and transformers' Qwen2Tokenizer PRETOKENIZE_REGEX).
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Added after the base vocabulary, in this order (Qwen2.5's first three, and its two non-special ones).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PLAIN_ADDED_TOKENS = ("<tool_call>", "</tool_call>")  # added tokens with special=false, as in Qwen2.5

# Qwen2-Instruct's chat template (ChatML with a default system prompt).
CHAT_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                 "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
                 "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. It's a sentence that uses every letter, and we've all
seen it a hundred times; still, it's useful when you're testing a tokenizer that'll meet real text.

In 1969, Apollo 11 landed on the Moon. The crew (three men) flew 384,400 km each way, and they didn't
take long to say it: "That's one small step for a man, one giant leap for mankind." They'd trained
for years. On July 20th at 20:17 UTC the lander touched down; 6.5 hours later the first boot followed.

Numbers matter too: 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 100, 256, 1024, 12345, 3.14159 and -7.5e-3.
Prices were $19.99, $5 and 12% off; the meeting is at 9:30 am on 2024-03-15 in room #4B.

I'm sure you'll agree: we're here, they're there, and she's gone. Isn't that odd? Don't worry!
    Indented lines, tabs\tand  double  spaces also show up,
and so do empty lines.

def hello(name):
    return "Hello, " + name + "!"  # a little code, with symbols: ==, !=, <=, >=, ->, {}, [], ()

The end... or is it? Well -- maybe. THE END, in capitals; The End, in title case; the end.
"""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, in its order (which is also Qwen2's id order), from
    transformers rather than from the code under test."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode as table

    return table()


def _pre_tokenizer():
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])


def train_bpe(text: str = TRAINING_TEXT, n_merges: int = N_MERGES) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A plain, deterministic byte-level BPE trainer -> (base vocab by id, merges by rank).

    Ids 0-255 are the byte tokens in bytes_to_unicode order (as in Qwen2: "!" is 0, "Ġ" is 220), then one
    token per merge in merge order. Each step merges the most frequent adjacent pair (ties: the smallest
    pair as strings), skipping pairs whose concatenation is already a token."""
    import unicodedata

    words: dict[tuple[str, ...], int] = {}
    for piece, _ in _pre_tokenizer().pre_tokenize_str(unicodedata.normalize("NFC", text)):
        key = tuple(piece)
        words[key] = words.get(key, 0) + 1
    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        counts: dict[tuple[str, str], int] = {}
        for w, f in words.items():
            for pair in zip(w, w[1:]):
                counts[pair] = counts.get(pair, 0) + f
        cands = [(-c, p) for p, c in counts.items() if p[0] + p[1] not in vocab]
        if not cands:
            raise ValueError(f"the training text allows only {len(merges)} merges")
        _, (a, b) = min(cands)
        merges.append((a, b))
        vocab[a + b] = len(vocab)
        new_words: dict[tuple[str, ...], int] = {}
        for w, f in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            key = tuple(out)
            new_words[key] = new_words.get(key, 0) + f
        words = new_words
    return vocab, merges


_BPE_CACHE: dict = {}


def _bpe():
    if "v" not in _BPE_CACHE:
        _BPE_CACHE["v"] = train_bpe()
    vocab, merges = _BPE_CACHE["v"]
    return dict(vocab), list(merges)


def added_tokens() -> list[tuple[int, str, bool]]:
    """(id, content, special) of the added tokens, which follow the base vocabulary."""
    base, _ = _bpe()
    names = [(t, True) for t in SPECIAL_TOKENS] + [(t, False) for t in PLAIN_ADDED_TOKENS]
    return [(len(base) + i, t, special) for i, (t, special) in enumerate(names)]


def token_id(text: str) -> int:
    for i, t, _ in added_tokens():
        if t == text:
            return i
    return _bpe()[0][text]


def tokenizer_json() -> dict:
    """tokenizer.json, field for field as Qwen2/Qwen2.5's."""
    vocab, merges = _bpe()
    bl = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": s} for i, t, s in added_tokens()],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_REGEX}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", **bl}]},
        "post_processor": {"type": "ByteLevel", **bl},
        "decoder": {"type": "ByteLevel", **bl},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [f"{a} {b}" for a, b in merges]},
    }


def tokenizer_config_json() -> dict:
    """tokenizer_config.json as Qwen2.5-Instruct's (eos <|im_end|>, pad <|endoftext|>, no BOS)."""
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": s} for i, t, s in added_tokens()},
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": CONTEXT,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def hf_tokenizer():
    """The tokenizer as a `tokenizers.Tokenizer` (what tokenizer.json holds)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(json.dumps(tokenizer_json()))


# ---------------------------------------------------------------------------------------------------
# Config and weights

ARCHS = {"qwen2": "Qwen2", "qwen3": "Qwen3"}


def head_dim(arch: str = "qwen2") -> int:
    return QWEN3_HEAD_DIM if arch == "qwen3" else HEAD_DIM


def config_json(tied: bool = False, arch: str = "qwen2") -> dict:
    """config.json in the form of Qwen's published Qwen2.5 (Qwen3) configs (transformers 4.x keys)."""
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


def generation_config_json() -> dict:
    eot = token_id("<|endoftext|>")
    return {"bos_token_id": eot, "eos_token_id": [token_id("<|im_end|>"), eot], "pad_token_id": eot}


def state_dict(tied: bool = False, seed: int = 0, arch: str = "qwen2") -> dict[str, np.ndarray]:
    """The weights under transformers' Qwen2ForCausalLM (Qwen3ForCausalLM) names, float32, drawn in this
    fixed order."""
    rs = np.random.RandomState(seed)

    def normal(shape, std):
        return (rs.standard_normal(shape) * std).astype(np.float32)

    def norm(n=HIDDEN):
        return (1.0 + rs.standard_normal(n) * NORM_STD).astype(np.float32)

    hd = head_dim(arch)
    q, kv = HEADS * hd, KV_HEADS * hd
    sd = {"model.embed_tokens.weight": normal((VOCAB, HIDDEN), EMBED_STD)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm()
        for x, rows in (("q", q), ("k", kv), ("v", kv)):
            sd[p + f"self_attn.{x}_proj.weight"] = normal((rows, HIDDEN), MATRIX_STD)
            if arch == "qwen2":
                sd[p + f"self_attn.{x}_proj.bias"] = normal((rows,), BIAS_STD)
        if arch == "qwen3":
            sd[p + "self_attn.q_norm.weight"] = norm(hd)
            sd[p + "self_attn.k_norm.weight"] = norm(hd)
        sd[p + "self_attn.o_proj.weight"] = normal((HIDDEN, q), MATRIX_STD)
        sd[p + "post_attention_layernorm.weight"] = norm()
        sd[p + "mlp.gate_proj.weight"] = normal((FFN, HIDDEN), MATRIX_STD)
        sd[p + "mlp.up_proj.weight"] = normal((FFN, HIDDEN), MATRIX_STD)
        sd[p + "mlp.down_proj.weight"] = normal((HIDDEN, FFN), MATRIX_STD)
    sd["model.norm.weight"] = norm()
    lm_head = normal((VOCAB, HIDDEN), LM_HEAD_STD)  # drawn either way, so the other weights do not move
    if not tied:
        sd["lm_head.weight"] = lm_head
    return sd


# ---------------------------------------------------------------------------------------------------
# Writers

def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8", newline="\n")


def write_tokenizer_files(hf_dir: Path) -> None:
    """tokenizer.json, tokenizer_config.json, vocab.json, merges.txt."""
    hf_dir = Path(hf_dir)
    tj = tokenizer_json()
    _write_json(hf_dir / "tokenizer.json", tj)
    _write_json(hf_dir / "tokenizer_config.json", tokenizer_config_json())
    (hf_dir / "vocab.json").write_text(json.dumps(tj["model"]["vocab"], ensure_ascii=False), encoding="utf-8",
                                       newline="\n")
    (hf_dir / "merges.txt").write_text("#version: 0.2\n" + "".join(m + "\n" for m in tj["model"]["merges"]),
                                       encoding="utf-8", newline="\n")


def hf_model(tied: bool = False, seed: int = 0, arch: str = "qwen2"):
    """The transformers Qwen2ForCausalLM / Qwen3ForCausalLM (float32, eval mode) holding
    `state_dict(tied, seed, arch)`."""
    import torch
    import transformers

    name = ARCHS[arch]
    cfg = {k: v for k, v in config_json(tied, arch).items() if k not in ("architectures", "model_type", "torch_dtype")}
    model = getattr(transformers, f"{name}ForCausalLM")(getattr(transformers, f"{name}Config")(**cfg))
    model = model.to(torch.float32)
    sd = {k: torch.from_numpy(v.copy()) for k, v in state_dict(tied, seed, arch).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if tied else set()):
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    if tied and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("lm_head is not tied to embed_tokens")
    return model.eval()


def write_hf_dir(hf_dir: Path, tied: bool = False, seed: int = 0, arch: str = "qwen2") -> Path:
    """A Hugging Face directory: model.safetensors (by save_pretrained), config.json,
    generation_config.json and the tokenizer files. Returns hf_dir."""
    hf_dir = Path(hf_dir)
    hf_dir.mkdir(parents=True, exist_ok=True)
    hf_model(tied, seed, arch).save_pretrained(hf_dir, safe_serialization=True)
    # save_pretrained's JSON carries its transformers version and that version's key names: write the
    # hub's form instead, so the bytes depend on nothing installed.
    _write_json(hf_dir / "config.json", config_json(tied, arch))
    _write_json(hf_dir / "generation_config.json", generation_config_json())
    write_tokenizer_files(hf_dir)
    return hf_dir


# Names as in gguf-py's TENSOR_NAMES for MODEL_ARCH.QWEN2 and QWEN3 (and llama.cpp's converter's tensor map).
_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}

# quant name -> (GGMLQuantizationType name, LlamaFileType name)
QUANTS = {
    None: ("F32", "ALL_F32"),
    "f32": ("F32", "ALL_F32"),
    "f16": ("F16", "MOSTLY_F16"),
    "bf16": ("BF16", "MOSTLY_BF16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
    "q4_0": ("Q4_0", "MOSTLY_Q4_0"),
    "q4_1": ("Q4_1", "MOSTLY_Q4_1"),
    "q5_0": ("Q5_0", "MOSTLY_Q5_0"),
    "q5_1": ("Q5_1", "MOSTLY_Q5_1"),
}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_NAMES:
        return _GGUF_NAMES[hf_name]
    parts = hf_name.split(".")  # model.layers.N.rest
    return f"blk.{parts[2]}." + _GGUF_NAMES[".".join(parts[3:])]


def gguf_tensor_order(tied: bool = False, arch: str = "qwen2") -> list[str]:
    """HF names in the order llama.cpp's converter writes them: it walks the safetensors file, whose
    tensors are sorted by name (so blk.1 before blk.10; fine for the few layers here)."""
    return sorted(state_dict(tied, arch=arch))


def gguf_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) as llama.cpp's _set_vocab_gpt2/get_vocab_base make them: tokens by
    id up to the model's vocab_size, ids the tokenizer lacks as "[PAD{i}]" of type UNUSED, added tokens
    CONTROL when special (or when they look special, "<|...|>"), else USER_DEFINED."""
    from gguf import TokenType

    vocab, merges = _bpe()
    by_id = {i: t for t, i in vocab.items()}
    types = {i: TokenType.NORMAL for i in by_id}
    for i, t, special in added_tokens():
        by_id[i] = t
        looks_special = t.startswith("<|") and t.endswith("|>")
        types[i] = TokenType.CONTROL if special or looks_special else TokenType.USER_DEFINED
    tokens, toktypes = [], []
    for i in range(VOCAB):
        if i in by_id:
            tokens.append(by_id[i])
            toktypes.append(int(types[i]))
        else:
            tokens.append(f"[PAD{i}]")
            toktypes.append(int(TokenType.UNUSED))
    return tokens, toktypes, [f"{a} {b}" for a, b in merges]


def write_gguf(path: Path, quant: str | None = None, tied: bool = False, seed: int = 0,
               name: str | None = None, arch: str = "qwen2") -> Path:
    """The same model as a llama.cpp-style qwen2 (qwen3) GGUF. quant: None/"f32" (all F32), or one of "f16",
    "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1" for every 2-D matrix (token_embd and output
    included, as the converter's --outtype does); 1-D tensors (norms, biases) stay F32. name: general.name,
    by default what the converter derives from make_tiny_qwen2's directory name. Returns path."""
    import gguf
    from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, quants

    qname, ftname = QUANTS[quant]
    qtype = GGMLQuantizationType[qname]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sd = state_dict(tied, seed, arch)
    tokens, toktypes, merges = gguf_vocab()
    eot, im_end = token_id("<|endoftext|>"), token_id("<|im_end|>")

    w = GGUFWriter(path, arch)  # general.architecture; alignment 32 by default
    # In the converter's order: model info, hyperparameters, quantization version, vocabulary.
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name or f"Tiny {ARCHS[arch]}" + (" Tied" if tied else "") + (f" S{seed}" if seed else ""))
    n_params = sum(v.size for v in sd.values())
    w.add_size_label(gguf.size_label(n_params, n_params, 0, 0))  # as the converter computes it
    w.add_block_count(LAYERS)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(ROPE_THETA)
    w.add_layer_norm_rms_eps(RMS_EPS)
    if arch == "qwen3":  # config.json's head_dim
        w.add_key_length(QWEN3_HEAD_DIM)
        w.add_value_length(QWEN3_HEAD_DIM)
    w.add_file_type(LlamaFileType[ftname])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(toktypes)
    w.add_token_merges(merges)
    # SpecialVocab: tokenizer_config's eos/pad first, then config.json's bos_token_id.
    w.add_eos_token_id(im_end)
    w.add_pad_token_id(eot)
    w.add_bos_token_id(eot)
    w.add_add_bos_token(False)  # the ByteLevel post-processor (and tokenizer_config's add_bos_token)
    w.add_add_eos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    for hf_name in gguf_tensor_order(tied, arch):
        arr = sd[hf_name]
        gname = gguf_name(hf_name)
        if arr.ndim == 1 or gname.endswith("_norm.weight") or qtype == GGMLQuantizationType.F32:
            w.add_tensor(gname, arr)
        elif qtype == GGMLQuantizationType.F16:
            w.add_tensor(gname, arr.astype(np.float16))
        else:
            w.add_tensor(gname, quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def dequantized_state_dict(quant: str | None = None, tied: bool = False, seed: int = 0,
                           arch: str = "qwen2") -> dict[str, np.ndarray]:
    """state_dict() with each tensor round-tripped through what write_gguf stores for it (the float
    weights the quantized GGUF holds), for comparing quantized files against a float reference."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[QUANTS[quant][0]]
    out = {}
    for k, v in state_dict(tied, seed, arch).items():
        if v.ndim == 1 or qtype == GGMLQuantizationType.F32:
            out[k] = v
        elif qtype == GGMLQuantizationType.F16:
            out[k] = v.astype(np.float16).astype(np.float32)
        else:
            out[k] = quants.dequantize(quants.quantize(v, qtype), qtype).astype(np.float32)
    return out


def make_tiny_qwen2(out_dir: Path, quant: str | None = None, tied: bool = False,
                    seed: int = 0, arch: str = "qwen2") -> tuple[Path, Path]:
    """Both forms under out_dir -> (hf_dir, gguf_path):
    out_dir/tiny-ARCH[-tied]/ and out_dir/tiny-ARCH[-tied]-<F32|Q8_0|...>.gguf."""
    out_dir = Path(out_dir)
    stem = f"tiny-{arch}" + ("-tied" if tied else "") + (f"-s{seed}" if seed else "")
    hf_dir = write_hf_dir(out_dir / stem, tied=tied, seed=seed, arch=arch)
    g = write_gguf(out_dir / f"{stem}-{QUANTS[quant][0]}.gguf", quant=quant, tied=tied, seed=seed, arch=arch)
    return hf_dir, g


def file_digests(paths) -> dict[str, str]:
    """name -> SHA-256 of each file (directories: each file inside), for determinism checks."""
    import hashlib

    out = {}
    for p in map(Path, paths):
        files = sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p]
        for f in files:
            out[os.path.relpath(f, p.parent)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


if __name__ == "__main__":  # python tests/qwen2gen.py OUT_DIR [quant] [--tied] [--qwen3]
    import sys
    import time

    t0 = time.perf_counter()
    args = [a for a in sys.argv[1:] if a not in ("--tied", "--qwen3")]
    hf, gg = make_tiny_qwen2(Path(args[0]), quant=args[1] if len(args) > 1 else None, tied="--tied" in sys.argv,
                             arch="qwen3" if "--qwen3" in sys.argv else "qwen2")
    print(hf, gg, f"{time.perf_counter() - t0:.2f}s")
