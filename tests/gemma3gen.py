"""Tiny Gemma 3 (text) checkpoints made here, deterministically, for tests.

The real Gemma 3 is too big for most tests (and its vocabulary alone is 262,144 tokens), so this module
makes a small one: the same random weights written as

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

The tokenizer is SentencePiece-style, as Gemma's: spaces as "▁", no space prefix, byte fallback
(<0x00>..<0xFF>), BOS added, ids pad 0, eos 1, bos 2, unk 3, control tokens <mask>, <start_of_turn>,
<end_of_turn> and user-defined "[multimodal]", "\\n", "\\n\\n" (as Gemma 3's vocabulary has them), then
pieces learned by a small deterministic BPE trainer on TRAINING_TEXT (digits never merged, as Gemma's
split_digits), scored as SentencePiece scores BPE pieces. tokenizer.json is what transformers'
GemmaConverter makes of such a SentencePiece model (a BPE with byte_fallback, merges from the scores by
transformers' generate_merges rule); the GGUF vocabulary is what llama.cpp's _set_vocab_sentencepiece
makes of it (`tokenizer.ggml.model = llama`, scores, token types, added tokens from
tokenizer_config.json scored -1000). No tokenizer.model is written (it would need sentencepiece's
protobuf; tinydet and transformers read tokenizer.json).

Everything is written deterministically: the same call writes byte-identical files on any machine
(weights come from `np.random.RandomState`; JSON files are written here, not by a library). `write_gguf`
needs numpy and gguf only; `write_hf_dir` also needs torch and transformers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from tinygen import QUANTS, add_tensor, stored_values, tied_hf_model
from tinygen import gguf_name as _gguf_name
from tinygen import write_json as _write_json

GENERATOR_VERSION = 1  # bump when any written byte changes (for callers that cache the files)

# ---------------------------------------------------------------------------------------------------
# The model

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
N_MERGES = 177  # 10 added tokens + 256 bytes + 177 merged pieces + 69 characters = 512 tokens

EMBED_STD = 0.15  # the embedding is scaled by sqrt(HIDDEN) = 8 before the first layer
MATRIX_STD = 0.08
NORM_STD = 0.1  # norm weights w = NORM_STD * N(0, 1); the model scales by (1 + w)

LAYER_TYPES = tuple("full_attention" if (i + 1) % PATTERN == 0 else "sliding_attention" for i in range(LAYERS))

# ---------------------------------------------------------------------------------------------------
# The tokenizer

SPIECE = "\u2581"  # "▁"

# SentencePiece / llama.cpp token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The tokens before the byte pieces, in id order: (text, special). special=True tokens are control
# tokens (tokenizer_config's added_tokens_decoder says special: true); the others are user-defined.
ADDED_TOKENS = (("<pad>", True), ("<eos>", True), ("<bos>", True), ("<unk>", True), ("<mask>", True),
                ("[multimodal]", False), ("<start_of_turn>", True), ("<end_of_turn>", True),
                ("\n", False), ("\n\n", False))
PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
FIRST_BYTE = len(ADDED_TOKENS)  # <0x00> .. <0xFF>
FIRST_PIECE = FIRST_BYTE + 256

# Gemma 3's chat template (its instruction-tuned repos'), text and image items as there.
CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n")

TRAINING_TEXT = """\
<start_of_turn>user
What is the capital of France, and why is it famous?<end_of_turn>
<start_of_turn>model
The capital of France is Paris. It is famous for the Eiffel Tower, the Louvre, its cafes and its long
history; millions of people visit the city every year, and many of them come back again.<end_of_turn>

The quick brown fox jumps over the lazy dog, and the dog does not mind: it is a lazy dog, after all.
Then the fox runs into the forest, where the trees are tall and the light is green and quiet.

In 1969, three astronauts flew to the Moon and back: 384400 km each way, in about 8 days in total.
Prices were 19.99, 5 and 12 percent off; the meeting is at 9:30 on 2024-03-15 in room 4B.

Once upon a time there was a little robot who wanted to learn how to paint. Every morning it looked at
the sky, mixed the colours it saw, and tried again; and every evening it showed its painting to the
other robots, who said that it was getting better, little by little.

def greet(name):
\treturn "Hello, " + name + "!"  # tabs, quotes, and symbols: ==, !=, <=, >=, ->, {}, [], ()

Questions and answers, lists and tables: first, second, third; one, two, three. Is that all? Not yet!
The end of the story is the beginning of another one, as the old saying goes. That is the end.
"""


def _words(text: str) -> dict[str, int]:
    """Training words, SentencePiece-style: newlines are user-defined tokens and never inside a piece,
    spaces become "▁", and a word is one "▁" (or none) and what follows up to the next "▁"."""
    words: dict[str, int] = {}
    for seg in re.split(r"\n+", text):
        for w in re.findall(f"{SPIECE}?[^{SPIECE}]+|{SPIECE}", seg.replace(" ", SPIECE)):
            words[w] = words.get(w, 0) + 1
    return words


def train_pieces(text: str = TRAINING_TEXT, n_merges: int = N_MERGES) -> tuple[list[str], list[str]]:
    """A plain, deterministic BPE trainer over SentencePiece words -> (merged pieces in merge order,
    characters by frequency). Each step merges the most frequent adjacent pair (ties: the smallest pair
    as strings) whose concatenation is not yet a piece; pairs with a digit are never merged (Gemma's
    split_digits); the special tokens are cut out of the text first."""
    for t, _ in ADDED_TOKENS:
        if t not in ("\n", "\n\n"):
            text = text.replace(t, "\n")
    words = {tuple(w): f for w, f in _words(text).items()}
    chars: dict[str, int] = {}
    for w, f in words.items():
        for c in w:
            chars[c] = chars.get(c, 0) + f
    pieces = set(chars)
    merged: list[str] = []
    while len(merged) < n_merges:
        counts: dict[tuple[str, str], int] = {}
        for w, f in words.items():
            for pair in zip(w, w[1:]):
                counts[pair] = counts.get(pair, 0) + f
        cands = [(-c, p) for p, c in counts.items()
                 if p[0] + p[1] not in pieces and not any(ch.isdigit() for ch in p[0] + p[1])]
        if not cands:
            raise ValueError(f"the training text allows only {len(merged)} merges")
        _, (a, b) = min(cands)
        merged.append(a + b)
        pieces.add(a + b)
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
    by_freq = sorted(chars, key=lambda c: (-chars[c], c))
    return merged, by_freq


_CACHE: dict = {}


def sentencepiece_vocab() -> list[tuple[str, float, int]]:
    """The SentencePiece model's pieces by id: (piece, score, type), as its model proto would hold them:
    the added tokens (score 0; <unk> UNKNOWN, the control ones CONTROL, the others USER_DEFINED), the 256
    byte pieces (BYTE, score 0), then the BPE pieces, merged ones in merge order and then the characters,
    scored 0, -1, -2, ... (SentencePiece's BPE trainer's scores)."""
    if "v" not in _CACHE:
        merged, chars = train_pieces()
        out = [(t, 0.0, UNKNOWN if t == "<unk>" else CONTROL if special else USER_DEFINED)
               for t, special in ADDED_TOKENS]
        out += [(f"<0x{b:02X}>", 0.0, BYTE) for b in range(256)]
        out += [(p, -float(i), NORMAL) for i, p in enumerate(merged + chars)]
        _CACHE["v"] = out
    return list(_CACHE["v"])


def vocab_size() -> int:
    return len(sentencepiece_vocab())


def token_id(text: str) -> int:
    return next(i for i, (p, _, _) in enumerate(sentencepiece_vocab()) if p == text)


def generate_merges(vocab: dict[str, int], vocab_scores: dict[str, float]) -> list[tuple[str, str]]:
    """transformers' generate_merges (tokenization_utils_base; SentencePieceExtractor, GemmaConverter):
    every split of a piece into two pieces, pieces by descending score (stable), a piece's splits by
    (left id, right id), then longer left and right parts first among equal scores."""
    merges = []
    for merge, piece_score in vocab_scores.items():
        local = []
        for index in range(1, len(merge)):
            left, right = merge[:index], merge[index:]
            if left in vocab and right in vocab:
                local.append((left, right, piece_score))
        merges.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    merges = sorted(merges, key=lambda v: (v[2], len(v[0]), len(v[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _added_token(i: int, t: str, special: bool) -> dict:
    return {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
            "special": special}


def tokenizer_json() -> dict:
    """tokenizer.json as transformers' GemmaConverter writes Gemma's: BPE with byte fallback over the
    SentencePiece vocabulary, " " -> "▁", <bos> prepended, the added tokens not normalized."""
    sp = sentencepiece_vocab()
    vocab = {p: i for i, (p, _, _) in enumerate(sp)}
    merges = generate_merges(vocab, {p: s for p, s, _ in sp})
    bos = {"SpecialToken": {"id": "<bos>", "type_id": 0}}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [_added_token(i, t, s) for i, (t, s) in enumerate(ADDED_TOKENS)],
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": SPIECE},
        "pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious",
                          "invert": False},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "<bos>", "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<bos>": {"id": "<bos>", "ids": [BOS_ID], "tokens": ["<bos>"]}},
        },
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": SPIECE}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": [[a, b] for a, b in merges]},
    }


def tokenizer_config_json() -> dict:
    """tokenizer_config.json as Gemma 3's (BOS added, no EOS, the chat template)."""
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": s} for i, (t, s) in enumerate(ADDED_TOKENS)},
        "bos_token": "<bos>",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<eos>",
        "model_max_length": CONTEXT,
        "pad_token": "<pad>",
        "spaces_between_special_tokens": False,
        "tokenizer_class": "GemmaTokenizer",
        "unk_token": "<unk>",
        "use_default_system_prompt": False,
    }


def hf_tokenizer():
    """The tokenizer as a `tokenizers.Tokenizer` (what tokenizer.json holds)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(json.dumps(tokenizer_json()))


def gguf_vocab() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) as llama.cpp's _create_vocab_sentencepiece makes them: the
    SentencePiece pieces, scores and types (UNKNOWN, CONTROL, BYTE, NORMAL), then every entry of
    tokenizer_config.json's added_tokens_decoder rescored -1000 and typed CONTROL when special (or
    when it looks special) else USER_DEFINED."""
    sp = sentencepiece_vocab()
    tokens, scores, types = [p for p, _, _ in sp], [s for _, s, _ in sp], [t for _, _, t in sp]
    looks_special = ("<pad>", "<mask>", "<2mass>", "[@BOS@]")  # does_token_look_special's fixed list
    for key, d in tokenizer_config_json()["added_tokens_decoder"].items():
        i = int(key)
        types[i] = CONTROL if d["special"] or d["content"] in looks_special else USER_DEFINED
        scores[i] = -1000.0
        tokens[i] = d["content"]
    return tokens, scores, types


# ---------------------------------------------------------------------------------------------------
# Config and weights

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


def generation_config_json() -> dict:
    return {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, token_id("<end_of_turn>")], "pad_token_id": PAD_ID}


def is_norm(hf_name: str) -> bool:
    """A Gemma norm weight (HF stores w, the model scales by 1 + w)."""
    return hf_name.endswith("norm.weight")


def state_dict(seed: int = 0) -> dict[str, np.ndarray]:
    """The weights under transformers' Gemma3ForCausalLM names (tied: no lm_head), float32, drawn in
    this fixed order."""
    rs = np.random.RandomState(seed)

    def normal(shape, std):
        return (rs.standard_normal(shape) * std).astype(np.float32)

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    sd = {"model.embed_tokens.weight": normal((vocab_size(), HIDDEN), EMBED_STD)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = normal(HIDDEN, NORM_STD)
        sd[p + "self_attn.q_proj.weight"] = normal((q, HIDDEN), MATRIX_STD)
        sd[p + "self_attn.k_proj.weight"] = normal((kv, HIDDEN), MATRIX_STD)
        sd[p + "self_attn.v_proj.weight"] = normal((kv, HIDDEN), MATRIX_STD)
        sd[p + "self_attn.q_norm.weight"] = normal(HEAD_DIM, NORM_STD)
        sd[p + "self_attn.k_norm.weight"] = normal(HEAD_DIM, NORM_STD)
        sd[p + "self_attn.o_proj.weight"] = normal((HIDDEN, q), MATRIX_STD)
        sd[p + "post_attention_layernorm.weight"] = normal(HIDDEN, NORM_STD)
        sd[p + "pre_feedforward_layernorm.weight"] = normal(HIDDEN, NORM_STD)
        sd[p + "mlp.gate_proj.weight"] = normal((FFN, HIDDEN), MATRIX_STD)
        sd[p + "mlp.up_proj.weight"] = normal((FFN, HIDDEN), MATRIX_STD)
        sd[p + "mlp.down_proj.weight"] = normal((HIDDEN, FFN), MATRIX_STD)
        sd[p + "post_feedforward_layernorm.weight"] = normal(HIDDEN, NORM_STD)
    sd["model.norm.weight"] = normal(HIDDEN, NORM_STD)
    return sd


def gguf_norm(w: np.ndarray) -> np.ndarray:
    """What llama.cpp's converter stores for a Gemma 3 norm weight w of an fp32 checkpoint:
    `data_torch + 1`, float32 (one rounding, as Gemma3RMSNorm's float32 `1.0 + weight`)."""
    return (np.float32(1.0) + np.asarray(w, np.float32)).astype(np.float32)


# ---------------------------------------------------------------------------------------------------
# Writers

def hf_config(attn: str = "eager"):
    """transformers' Gemma3TextConfig of config_json() (attention implementation `attn`)."""
    import transformers

    skip = ("architectures", "model_type", "torch_dtype", "_sliding_window_pattern")
    cfg = transformers.Gemma3TextConfig(**{k: v for k, v in config_json().items() if k not in skip})
    cfg._attn_implementation = attn
    return cfg


def hf_model(seed: int = 0, attn: str = "eager", weights: dict | None = None):
    """The transformers Gemma3ForCausalLM (float32, eval mode, `attn` attention) holding
    `state_dict(seed)` (or `weights`, under the same names)."""
    import transformers

    return tied_hf_model(transformers.Gemma3ForCausalLM(hf_config(attn)), weights or state_dict(seed))


def write_tokenizer_files(hf_dir: Path) -> None:
    hf_dir = Path(hf_dir)
    _write_json(hf_dir / "tokenizer.json", tokenizer_json())
    _write_json(hf_dir / "tokenizer_config.json", tokenizer_config_json())


def write_hf_dir(hf_dir: Path, seed: int = 0) -> Path:
    """A Hugging Face directory: model.safetensors (by save_pretrained), config.json,
    generation_config.json, tokenizer.json and tokenizer_config.json. Returns hf_dir."""
    hf_dir = Path(hf_dir)
    hf_dir.mkdir(parents=True, exist_ok=True)
    hf_model(seed).save_pretrained(hf_dir, safe_serialization=True)
    # save_pretrained's JSON carries its transformers version and that version's key names: write the
    # hub's form instead, so the bytes depend on nothing installed.
    _write_json(hf_dir / "config.json", config_json())
    _write_json(hf_dir / "generation_config.json", generation_config_json())
    write_tokenizer_files(hf_dir)
    return hf_dir


# gguf-py's tensor map for MODEL_ARCH.GEMMA3 (llama.cpp's converter's names).
_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}

def gguf_name(hf_name: str) -> str:
    return _gguf_name(hf_name, _GGUF_NAMES)


def gguf_tensor_order() -> list[str]:
    """HF names in the order llama.cpp's converter writes them: it walks the safetensors file, whose
    tensors are sorted by name (blk.1 before blk.10: fine for the 6 layers here)."""
    return sorted(state_dict())


def add_overrides(w, overrides: dict) -> None:
    """Write and remove the keys of `overrides` that are not tokenizer keys (a test's broken files):
    ints as uint32, floats as float32, strings as strings."""
    for key in [k for k in overrides if not k.startswith("tokenizer.")]:
        v = overrides.pop(key)
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            raise TypeError(f"{key}: an int, float or str override, found {v!r}")
        (w.add_uint32 if isinstance(v, int) else w.add_float32 if isinstance(v, float) else w.add_string)(key, v)


def add_vocab(w) -> None:
    """The vocabulary keys, as _set_vocab_sentencepiece, SpecialVocab and add_space_prefix(False) write
    them (Gemma 2's and Gemma 3's converters alike)."""
    tokens, scores, toktypes = gguf_vocab()
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(toktypes)
    # SpecialVocab: tokenizer_config's bos/eos/unk/pad; add_bos from tokenizer.json's post-processor,
    # add_sep from its pair template, add_eos from tokenizer_config; the chat template.
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_unk_token_id(UNK_ID)
    w.add_pad_token_id(PAD_ID)
    w.add_add_bos_token(True)
    w.add_add_sep_token(False)
    w.add_add_eos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    w.add_add_space_prefix(False)


def write_gguf(path: Path, quant: str | None = None, seed: int = 0, name: str | None = None,
               overrides: dict | None = None, drop: tuple[str, ...] = ()) -> Path:
    """The same model as a llama.cpp-style gemma3 GGUF. quant: None/"f32" (all F32), or one of "f16",
    "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1" for every 2-D matrix (token_embd included, as the
    converter's --outtype does); 1-D tensors (the norms, stored as 1 + w) stay F32. name: general.name.

    For files that are wrong on purpose: `overrides` maps a metadata key ("gemma3.attention.sliding_window")
    to the value written instead of the converter's (a key it does not write is added after the
    hyperparameters: int -> uint32, float -> float32, str -> string); `drop` names tensors left out.
    Returns path."""
    import gguf
    from gguf import GGUFWriter, LlamaFileType

    ftname = QUANTS[quant][1]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sd = state_dict(seed)
    overrides = dict(overrides or {})
    a = "gemma3"

    w = GGUFWriter(path, a)  # general.architecture; alignment 32 by default

    def kv(key, add, value):
        add(overrides.pop(key, value))

    # In the converter's order: model info, hyperparameters (TextModel's, then Gemma3Model's), the
    # quantization version, the vocabulary (_set_vocab_sentencepiece, SpecialVocab, add_space_prefix).
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name or "Tiny Gemma3" + (f" S{seed}" if seed else ""))
    n_params = sum(v.size for v in sd.values())
    w.add_size_label(gguf.size_label(n_params, n_params, 0, 0))  # as the converter computes it
    kv(f"{a}.block_count", w.add_block_count, LAYERS)
    kv(f"{a}.context_length", w.add_context_length, CONTEXT)
    kv(f"{a}.embedding_length", w.add_embedding_length, HIDDEN)
    kv(f"{a}.feed_forward_length", w.add_feed_forward_length, FFN)
    kv(f"{a}.attention.head_count", w.add_head_count, HEADS)
    kv(f"{a}.attention.head_count_kv", w.add_head_count_kv, KV_HEADS)
    kv(f"{a}.rope.freq_base", w.add_rope_freq_base, ROPE_THETA)
    kv(f"{a}.rope.freq_base_swa", w.add_rope_freq_base_swa, ROPE_LOCAL_BASE)
    kv(f"{a}.attention.layer_norm_rms_epsilon", w.add_layer_norm_rms_eps, RMS_EPS)
    kv(f"{a}.attention.key_length", w.add_key_length, HEAD_DIM)
    kv(f"{a}.attention.value_length", w.add_value_length, HEAD_DIM)
    w.add_file_type(LlamaFileType[ftname])
    kv(f"{a}.attention.sliding_window", w.add_sliding_window, SLIDING_WINDOW)
    add_overrides(w, overrides)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_vocab(w)
    if overrides:
        raise KeyError(f"overrides for keys write_gguf does not write: {sorted(overrides)}")

    for hf_name in gguf_tensor_order():
        gname = gguf_name(hf_name)
        if gname in drop:
            continue
        arr = sd[hf_name]
        if is_norm(hf_name):
            arr = gguf_norm(arr)
        add_tensor(w, gname, arr, quant)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def dequantized_state_dict(quant: str | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """state_dict() with each matrix round-tripped through what write_gguf stores for it (the float
    weights the quantized GGUF holds; the norms as HF's w), for comparing quantized files against a
    float reference."""
    return {k: stored_values(v, quant) for k, v in state_dict(seed).items()}


def make_tiny_gemma3(out_dir: Path, quant: str | None = None, seed: int = 0) -> tuple[Path, Path]:
    """Both forms under out_dir -> (hf_dir, gguf_path): out_dir/tiny-gemma3/ and
    out_dir/tiny-gemma3-<F32|Q8_0|...>.gguf."""
    out_dir = Path(out_dir)
    stem = "tiny-gemma3" + (f"-s{seed}" if seed else "")
    hf_dir = write_hf_dir(out_dir / stem, seed=seed)
    g = write_gguf(out_dir / f"{stem}-{QUANTS[quant][0]}.gguf", quant=quant, seed=seed)
    return hf_dir, g


if __name__ == "__main__":  # python tests/gemma3gen.py OUT_DIR [quant]
    import sys
    import time

    t0 = time.perf_counter()
    hf, gg = make_tiny_gemma3(Path(sys.argv[1]), quant=sys.argv[2] if len(sys.argv) > 2 else None)
    print(hf, gg, f"{time.perf_counter() - t0:.2f}s")
