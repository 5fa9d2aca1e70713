"""Gemma's tokenizer for the tiny checkpoints (gemma3gen, gemma2gen), and the SentencePiece machinery
llama2tok's Llama 2 tokenizer shares (the piece trainer, transformers' merges rule, the token types).

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
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tinygen import write_json

CONTEXT = 512  # tokenizer_config's model_max_length
N_MERGES = 177  # 10 added tokens + 256 bytes + 177 merged pieces + 69 characters = 512 tokens

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



def generation_config_json() -> dict:
    return {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, token_id("<end_of_turn>")], "pad_token_id": PAD_ID}


def write_tokenizer_files(hf_dir: Path) -> None:
    hf_dir = Path(hf_dir)
    write_json(hf_dir / "tokenizer.json", tokenizer_json())
    write_json(hf_dir / "tokenizer_config.json", tokenizer_config_json())



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

