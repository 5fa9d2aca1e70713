"""The byte-level BPE tokenizers of the tiny checkpoints (qwen2gen, smollm3gen, moegen, gptossgen):
Qwen2's (`kind` "qwen2", which Qwen3 shares) and Llama 3's ("llama3").

Each is a real byte-level BPE trained here by a small deterministic trainer on `TRAINING_TEXT`, written
as its published repos have it:

* Qwen2: Qwen2's pre-tokenizer, Qwen2's special tokens added after the base vocabulary (as Qwen does;
  the model's embedding is padded past the tokenizer, as Qwen's is), tokenizer.json,
  tokenizer_config.json, vocab.json and merges.txt, Qwen2-Instruct's ChatML template;
* Llama 3: Llama 3's pre-tokenizer regex, ignore_merges, 11 special tokens in Llama 3.1's order after
  the base vocabulary and no padding past them, a TemplateProcessing post-processor adding
  <|begin_of_text|>, Llama 3.2-Instruct's chat template; only tokenizer.json and tokenizer_config.json.

The GGUF vocabulary is what llama.cpp's converter makes of them (_set_vocab_gpt2: tokenizer.ggml.model
"gpt2", pre "qwen2" / "llama-bpe", tokens, types, merges, SpecialVocab's ids and flags).

Everything is written deterministically (module tinygen). Needs tokenizers; `bytes_to_unicode` takes
GPT-2's table from transformers, not from the code under test.
"""

from __future__ import annotations

import json
from pathlib import Path

from tinygen import write_json

VOCAB = 512  # the rows of the embedding the GGUF vocabulary is padded to ("[PAD{i}]")
CONTEXT = 512  # Qwen's tokenizer_config model_max_length
N_MERGES = 230  # Qwen's base vocabulary: 256 byte tokens + 230 merges = 486 tokens

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



def write_tokenizer_files(hf_dir: Path, arch: str = "qwen2") -> None:
    """tokenizer.json, tokenizer_config.json, and for Qwen vocab.json and merges.txt (Llama 3's repos
    have only the first two, besides its tiktoken original/)."""
    hf_dir = Path(hf_dir)
    tj = tokenizer_json(arch)
    write_json(hf_dir / "tokenizer.json", tj)
    write_json(hf_dir / "tokenizer_config.json", tokenizer_config_json(arch))
    if arch == "llama3":
        return
    (hf_dir / "vocab.json").write_text(json.dumps(tj["model"]["vocab"], ensure_ascii=False), encoding="utf-8",
                                       newline="\n")
    (hf_dir / "merges.txt").write_text("#version: 0.2\n" + "".join(m + "\n" for m in tj["model"]["merges"]),
                                       encoding="utf-8", newline="\n")


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



def vocab_size(arch: str = "qwen2") -> int:
    """The tokenizer's own size (ids 0..n-1), without the embedding's padding."""
    return len(_bpe(arch)[0]) + len(added_tokens(arch))


def converter_specials(arch: str = "qwen2") -> list[tuple[str, object]]:
    """The special-token keys llama.cpp's SpecialVocab writes, in its order, as GGUFWriter calls:
    Qwen's tokenizer_config eos/pad first, then config.json's bos_token_id, add_bos/add_eos false (the
    ByteLevel post-processor); Llama 3's bos/eos and add_bos from its TemplateProcessing."""
    if arch == "llama3":
        return [("add_bos_token_id", token_id("<|begin_of_text|>", arch)),
                ("add_eos_token_id", token_id("<|eot_id|>", arch)), ("add_add_bos_token", True),
                ("add_chat_template", LLAMA3_CHAT_TEMPLATE)]
    eot = token_id("<|endoftext|>")
    return [("add_eos_token_id", token_id("<|im_end|>")), ("add_pad_token_id", eot), ("add_bos_token_id", eot),
            ("add_add_bos_token", False), ("add_add_eos_token", False), ("add_chat_template", CHAT_TEMPLATE)]


def add_vocab(w, arch: str = "qwen2", n: int = VOCAB, specials=None) -> None:
    """The vocabulary keys of `gguf_vocab(arch)`'s first n tokens, then `specials` ((GGUFWriter method,
    value) pairs; by default `converter_specials(arch)`)."""
    tokens, toktypes, merges = gguf_vocab(arch)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe" if arch == "llama3" else "qwen2")
    w.add_token_list(tokens[:n])
    w.add_token_types(toktypes[:n])
    w.add_token_merges(merges)
    for method, value in converter_specials(arch) if specials is None else specials:
        getattr(w, method)(value)
