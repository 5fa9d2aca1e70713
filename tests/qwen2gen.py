"""Tiny Qwen2, Qwen3 and Llama 3 checkpoints made here, deterministically, for tests.

No Qwen2, Qwen3 or Llama 3 checkpoint can be fetched on the project's machines, so this module makes
them (`arch` "qwen2", the default, "qwen3" or "llama3"): the same random weights written as

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

Llama 3 differs as Meta's Llama 3.2 repos and llama.cpp's converter (conversion/llama.py, LlamaModel)
do: a LlamaForCausalLM without biases; config.json with rope_theta 500000 and a "llama3" rope_scaling
(`LLAMA3_ROPE`), eos_token_id [<|end_of_text|>, <|eom_id|>, <|eot_id|>]; its own tokenizer: Llama 3's
pre-tokenizer regex, ignore_merges, 11 special tokens in Llama 3.1's order after the base vocabulary and
no padding past them, a TemplateProcessing post-processor adding <|begin_of_text|>, Llama 3.2-Instruct's
chat template; only tokenizer.json and tokenizer_config.json. Its GGUF is `general.architecture = llama`
with Q/K rows permuted for llama.cpp's interleaved RoPE (LlamaModel.permute), vocab_size and
rope.dimension_count keys, tokenizer.ggml.pre "llama-bpe", add_bos_token true, and the RoPE scaling only
as `rope_freqs.weight` (the converter's per-frequency divisors, `llama3_rope_freqs`), written first.

The Qwen tokenizer is a real byte-level BPE with Qwen2's pre-tokenizer, trained here by a small deterministic
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

from tinygen import QUANTS, add_tensor, stored_values
from tinygen import gguf_name as _gguf_name
from tinygen import write_json as _write_json

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

# Llama 3's pre-tokenizer (its tokenizer.json; llama.cpp's "llama-bpe"): digits in runs of up to 3.
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Llama 3.1/3.2's first special tokens, in their order (128000..128010 there), all special.
LLAMA3_SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                         "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                         "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>")
LLAMA3_N_MERGES = 512 - 256 - len(LLAMA3_SPECIAL_TOKENS)  # Llama 3's embedding is exactly its tokenizer
# Llama 3.2-Instruct's chat template (its tokenizer_config.json; llama.cpp's models/templates copy).
LLAMA3_CHAT_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}"""
# Llama 3.2's RoPE scaling, with original_max_position_embeddings scaled down with the model so that at
# head_dim 16 one frequency is blended and six divided by the factor (8192 would scale only the slowest).
LLAMA3_ROPE = {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 64,
               "rope_type": "llama3"}
LLAMA3_ROPE_THETA = 500_000.0

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


def _regex(arch: str) -> str:
    return LLAMA3_REGEX if arch == "llama3" else QWEN2_REGEX


def _pre_tokenizer(arch: str = "qwen2"):
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_regex(arch)), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])


def train_bpe(text: str = TRAINING_TEXT, n_merges: int = N_MERGES,
              arch: str = "qwen2") -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A plain, deterministic byte-level BPE trainer -> (base vocab by id, merges by rank).

    Ids 0-255 are the byte tokens in bytes_to_unicode order (as in Qwen2: "!" is 0, "Ġ" is 220), then one
    token per merge in merge order. Each step merges the most frequent adjacent pair (ties: the smallest
    pair as strings), skipping pairs whose concatenation is already a token."""
    import unicodedata

    words: dict[tuple[str, ...], int] = {}
    for piece, _ in _pre_tokenizer(arch).pre_tokenize_str(unicodedata.normalize("NFC", text)):
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


def _bpe(arch: str = "qwen2"):
    key = "llama3" if arch == "llama3" else "qwen"  # Qwen2 and Qwen3 share their tokenizer
    if key not in _BPE_CACHE:
        _BPE_CACHE[key] = train_bpe(arch=arch) if key == "qwen" else train_bpe(n_merges=LLAMA3_N_MERGES, arch=arch)
    vocab, merges = _BPE_CACHE[key]
    return dict(vocab), list(merges)


def added_tokens(arch: str = "qwen2") -> list[tuple[int, str, bool]]:
    """(id, content, special) of the added tokens, which follow the base vocabulary."""
    base, _ = _bpe(arch)
    if arch == "llama3":
        names = [(t, True) for t in LLAMA3_SPECIAL_TOKENS]
    else:
        names = [(t, True) for t in SPECIAL_TOKENS] + [(t, False) for t in PLAIN_ADDED_TOKENS]
    return [(len(base) + i, t, special) for i, (t, special) in enumerate(names)]


def token_id(text: str, arch: str = "qwen2") -> int:
    for i, t, _ in added_tokens(arch):
        if t == text:
            return i
    return _bpe(arch)[0][text]


def tokenizer_json(arch: str = "qwen2") -> dict:
    """tokenizer.json, field for field as Qwen2/Qwen2.5's (Llama 3.2's for "llama3": no normalizer,
    ignore_merges, a TemplateProcessing post-processor that puts <|begin_of_text|> first)."""
    if arch == "llama3":
        return _llama3_tokenizer_json()
    vocab, merges = _bpe(arch)
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


def _llama3_tokenizer_json() -> dict:
    vocab, merges = _bpe("llama3")
    bos = "<|begin_of_text|>"
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": s} for i, t, s in added_tokens("llama3")],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_REGEX}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": {"type": "Sequence", "processors": [
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
            {"type": "TemplateProcessing",
             "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                      {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {bos: {"id": bos, "ids": [token_id(bos, "llama3")], "tokens": [bos]}}}]},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": vocab, "merges": [f"{a} {b}" for a, b in merges]},
    }


def tokenizer_config_json(arch: str = "qwen2") -> dict:
    """tokenizer_config.json as Qwen2.5-Instruct's (eos <|im_end|>, pad <|endoftext|>, no BOS), or
    Llama 3.2-Instruct's (bos <|begin_of_text|>, eos <|eot_id|>, no pad)."""
    decoder = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                        "special": s} for i, t, s in added_tokens(arch)}
    if arch == "llama3":
        return {
            "added_tokens_decoder": decoder,
            "bos_token": "<|begin_of_text|>",
            "chat_template": LLAMA3_CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": True,
            "eos_token": "<|eot_id|>",
            "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": 131072,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
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


def hf_tokenizer(arch: str = "qwen2"):
    """The tokenizer as a `tokenizers.Tokenizer` (what tokenizer.json holds)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(json.dumps(tokenizer_json(arch)))


# ---------------------------------------------------------------------------------------------------
# Config and weights

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


def state_dict(tied: bool = False, seed: int = 0, arch: str = "qwen2") -> dict[str, np.ndarray]:
    """The weights under transformers' Qwen2ForCausalLM (Qwen3ForCausalLM, LlamaForCausalLM) names,
    float32, drawn in this fixed order."""
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


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rows from HF's rotate-half order to adjacent pairs,
    as the converter stores a llama Q (n_head = heads) or K (n_head = KV heads)."""
    return np.ascontiguousarray(w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2)
                                .reshape(w.shape))


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


# ---------------------------------------------------------------------------------------------------
# Writers

def write_tokenizer_files(hf_dir: Path, arch: str = "qwen2") -> None:
    """tokenizer.json, tokenizer_config.json, and for Qwen vocab.json and merges.txt (Llama 3's repos
    have only the first two, besides its tiktoken original/)."""
    hf_dir = Path(hf_dir)
    tj = tokenizer_json(arch)
    _write_json(hf_dir / "tokenizer.json", tj)
    _write_json(hf_dir / "tokenizer_config.json", tokenizer_config_json(arch))
    if arch == "llama3":
        return
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
    _write_json(hf_dir / "generation_config.json", generation_config_json(arch))
    write_tokenizer_files(hf_dir, arch)
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

def gguf_name(hf_name: str) -> str:
    return _gguf_name(hf_name, _GGUF_NAMES)


def gguf_tensor_order(tied: bool = False, arch: str = "qwen2") -> list[str]:
    """HF names in the order llama.cpp's converter writes them: it walks the safetensors file, whose
    tensors are sorted by name (so blk.1 before blk.10; fine for the few layers here)."""
    return sorted(state_dict(tied, arch=arch))


def gguf_vocab(arch: str = "qwen2") -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) as llama.cpp's _set_vocab_gpt2/get_vocab_base make them: tokens by
    id up to the model's vocab_size, ids the tokenizer lacks as "[PAD{i}]" of type UNUSED, added tokens
    CONTROL when special (or when they look special, "<|...|>"), else USER_DEFINED."""
    from gguf import TokenType

    vocab, merges = _bpe(arch)
    by_id = {i: t for t, i in vocab.items()}
    types = {i: TokenType.NORMAL for i in by_id}
    for i, t, special in added_tokens(arch):
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
    "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4" for every 2-D matrix (token_embd and output
    included, as the converter's --outtype does); 1-D tensors (norms, biases) stay F32. name: general.name,
    by default what the converter derives from make_tiny_qwen2's directory name. Returns path."""
    import gguf
    from gguf import GGUFWriter, LlamaFileType

    ftname = QUANTS[quant][1]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sd = state_dict(tied, seed, arch)
    tokens, toktypes, merges = gguf_vocab(arch)
    llama = arch == "llama3"

    w = GGUFWriter(path, GGUF_ARCH[arch])  # general.architecture; alignment 32 by default
    # In the converter's order: model info, hyperparameters, quantization version, vocabulary.
    w.add_type(gguf.GGUFType.MODEL)
    title = "Llama 3" if llama else ARCHS[arch]
    w.add_name(name or f"Tiny {title}" + (" Tied" if tied else "") + (f" S{seed}" if seed else ""))
    n_params = sum(v.size for v in sd.values())
    w.add_size_label(gguf.size_label(n_params, n_params, 0, 0))  # as the converter computes it
    w.add_block_count(LAYERS)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(LLAMA3_ROPE_THETA if llama else ROPE_THETA)
    w.add_layer_norm_rms_eps(RMS_EPS)
    if arch == "qwen3":  # config.json's head_dim
        w.add_key_length(QWEN3_HEAD_DIM)
        w.add_value_length(QWEN3_HEAD_DIM)
    w.add_file_type(LlamaFileType[ftname])
    if llama:  # LlamaModel.set_gguf_parameters
        w.add_vocab_size(VOCAB)
        w.add_rope_dimension_count(HEAD_DIM)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe" if llama else "qwen2")
    w.add_token_list(tokens)
    w.add_token_types(toktypes)
    w.add_token_merges(merges)
    if llama:  # SpecialVocab: tokenizer_config's bos/eos; add_bos from the TemplateProcessing post-processor
        w.add_bos_token_id(token_id("<|begin_of_text|>", arch))
        w.add_eos_token_id(token_id("<|eot_id|>", arch))
        w.add_add_bos_token(True)
        w.add_chat_template(LLAMA3_CHAT_TEMPLATE)
    else:
        eot, im_end = token_id("<|endoftext|>"), token_id("<|im_end|>")
        # SpecialVocab: tokenizer_config's eos/pad first, then config.json's bos_token_id.
        w.add_eos_token_id(im_end)
        w.add_pad_token_id(eot)
        w.add_bos_token_id(eot)
        w.add_add_bos_token(False)  # the ByteLevel post-processor (and tokenizer_config's add_bos_token)
        w.add_add_eos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)

    if llama:  # generate_extra_tensors comes first
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs())
    for hf_name in gguf_tensor_order(tied, arch):
        arr = sd[hf_name]
        gname = gguf_name(hf_name)
        if llama and hf_name.endswith(("q_proj.weight", "k_proj.weight")):  # LlamaModel.modify_tensors
            arr = llama_permute(arr, HEADS if "q_proj" in hf_name else KV_HEADS)
        add_tensor(w, gname, arr, quant)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def dequantized_state_dict(quant: str | None = None, tied: bool = False, seed: int = 0,
                           arch: str = "qwen2") -> dict[str, np.ndarray]:
    """state_dict() with each tensor round-tripped through what write_gguf stores for it (the float
    weights the quantized GGUF holds), for comparing quantized files against a float reference."""
    return {k: stored_values(v, quant) for k, v in state_dict(tied, seed, arch).items()}


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


if __name__ == "__main__":  # python tests/qwen2gen.py OUT_DIR [quant] [--tied] [--qwen3 | --llama3]
    import sys
    import time

    t0 = time.perf_counter()
    args = [a for a in sys.argv[1:] if a not in ("--tied", "--qwen3", "--llama3")]
    arch = "qwen3" if "--qwen3" in sys.argv else "llama3" if "--llama3" in sys.argv else "qwen2"
    hf, gg = make_tiny_qwen2(Path(args[0]), quant=args[1] if len(args) > 1 else None, tied="--tied" in sys.argv,
                             arch=arch)
    print(hf, gg, f"{time.perf_counter() - t0:.2f}s")
