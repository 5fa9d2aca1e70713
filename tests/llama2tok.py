"""Llama 2's kind of tokenizer, for the tiny Mistral and Phi-3 checkpoints (spmgen).

The tokenizer is Llama 2's kind, which Mistral 7B (v0.1, v0.2) and Phi-3 use: a SentencePiece BPE with
<unk> = 0, <s> = 1, </s> = 2, byte fallback pieces <0x00>..<0xFF> at 3..258, then pieces learned on
TRAINING_TEXT by gemmatok's deterministic trainer (digits never merged: Llama's split_digits),
scored 0, -1, -2, ...; a "▁" space prefix (add_dummy_prefix), BOS added (Mistral). tokenizer.json is
what transformers' LlamaConverter makes of such a model (legacy form: normalizer Prepend("▁") +
Replace(" ", "▁"), no pre-tokenizer, decoder Replace / ByteFallback / Fuse / Strip, merges by
transformers' generate_merges, a TemplateProcessing post-processor that adds <s> for Mistral and
nothing for Phi-3, whose tokenizer_config says add_bos_token false, as LlamaTokenizerFast then writes
it). Phi-3 adds its eleven tokens after the base vocabulary in its order (<|endoftext|>,
<|assistant|>, <|placeholder1|>..<|placeholder4|>, <|system|>, <|end|>, <|placeholder5|>,
<|placeholder6|>, <|user|>: ids 32000..32010 in the real one), all special and all but <|endoftext|>
with rstrip (so the "\\n" after "<|user|>" is swallowed), </s> not special and rstrip, as
Phi-3-mini-4k-instruct's tokenizer.json and tokenizer_config.json have them; its embedding is padded
past the tokenizer (PHI3_VOCAB = 512 rows for 507 tokens, as 32064 for 32011). The GGUF vocabularies
are what the converters make of these files: for Mistral, llama.cpp's _create_vocab_sentencepiece
(tokenizer_config's added tokens rescored -1000 and typed CONTROL, <unk> included); for Phi-3,
Phi3MiniModel.set_vocab (every id up to vocab_size, "[PAD{i}]" UNUSED at -10000 where the tokenizer
has none, added_tokens.json, tokenizer_config.json's and tokenizer.json's added tokens rescored -1000,
CONTROL when special else USER_DEFINED: </s> is USER_DEFINED); `tokenizer.ggml.model = llama`, no
add_space_prefix key (llama.cpp's default: true), SpecialVocab's ids and flags. No tokenizer.model is
written (it would need sentencepiece's protobuf; tinydet and transformers read tokenizer.json).

Chat templates: Mistral-7B-Instruct-v0.3's tokenizer_config.json (the "v3" template with tools; llama.cpp's
tests/test-chat-template.cpp holds the same text for Mistral-Large-Instruct-2407), rendered over this
v0.2-style vocabulary, where [INST] and [/INST] are plain text (v0.3 made them control tokens 3 and 4
of a 32768-token vocabulary). Phi-3: the template of Phi-3-mini-4k-instruct's June 2024 update, which
added the system turn (the text of llama.cpp's models/templates/microsoft-Phi-3.5-mini-instruct.jinja,
which Phi-3.5-mini shares); generation_config.json's eos ids [<|endoftext|>, <|assistant|>, <|end|>]
as Phi-3-mini-4k-instruct's ([32000, 32001, 32007]).
"""

from __future__ import annotations

import json
from pathlib import Path

import gemmatok as _G  # the SentencePiece-style piece trainer, generate_merges, token types
from tinygen import write_json

CONTEXT = 512  # Phi-3's tokenizer_config model_max_length

SPIECE = _G.SPIECE
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = (_G.NORMAL, _G.UNKNOWN, _G.CONTROL, _G.USER_DEFINED,
                                                         _G.UNUSED, _G.BYTE)
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
FIRST_BYTE = 3  # <0x00> .. <0xFF>
FIRST_PIECE = FIRST_BYTE + 256
N_MERGES = 168  # 3 + 256 bytes + 168 merged pieces + 69 characters = BASE_VOCAB
BASE_VOCAB = 496  # the SentencePiece model's pieces (Llama 2's 32000); Mistral's vocab_size
PHI3_ADDED = ("<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>",
              "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>")
PHI3_VOCAB = 512  # Phi-3's embedding rows, past its BASE_VOCAB + 11 tokens (32064 for 32011)

MISTRAL_CHAT_TEMPLATE = (
    '{%- if messages[0]["role"] == "system" %}\n'
    '    {%- set system_message = messages[0]["content"] %}\n'
    '    {%- set loop_messages = messages[1:] %}\n'
    '{%- else %}\n'
    '    {%- set loop_messages = messages %}\n'
    '{%- endif %}\n'
    '{%- if not tools is defined %}\n'
    '    {%- set tools = none %}\n'
    '{%- endif %}\n'
    '{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}\n'
    '\n'
    '{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}\n'
    '{%- set ns = namespace() %}\n'
    '{%- set ns.index = 0 %}\n'
    '{%- for message in loop_messages %}\n'
    '    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is'
    ' defined and message.tool_calls is not none)) %}\n'
    '        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}\n'
    '            {{- raise_exception("After the optional system message, conversation roles must'
    ' alternate user/assistant/user/assistant/...") }}\n'
    '        {%- endif %}\n'
    '        {%- set ns.index = ns.index + 1 %}\n'
    '    {%- endif %}\n'
    '{%- endfor %}\n'
    '\n'
    '{{- bos_token }}\n'
    '{%- for message in loop_messages %}\n'
    '    {%- if message["role"] == "user" %}\n'
    '        {%- if tools is not none and (message == user_messages[-1]) %}\n'
    '            {{- "[AVAILABLE_TOOLS] [" }}\n'
    '            {%- for tool in tools %}\n'
    '                {%- set tool = tool.function %}\n'
    '                {{- \'{"type": "function", "function": {\' }}\n'
    '                {%- for key, val in tool.items() if key != "return" %}\n'
    '                    {%- if val is string %}\n'
    '                        {{- \'"\' + key + \'": "\' + val + \'"\' }}\n'
    '                    {%- else %}\n'
    '                        {{- \'"\' + key + \'": \' + val|tojson }}\n'
    '                    {%- endif %}\n'
    '                    {%- if not loop.last %}\n'
    '                        {{- ", " }}\n'
    '                    {%- endif %}\n'
    '                {%- endfor %}\n'
    '                {{- "}}" }}\n'
    '                {%- if not loop.last %}\n'
    '                    {{- ", " }}\n'
    '                {%- else %}\n'
    '                    {{- "]" }}\n'
    '                {%- endif %}\n'
    '            {%- endfor %}\n'
    '            {{- "[/AVAILABLE_TOOLS]" }}\n'
    '            {%- endif %}\n'
    '        {%- if loop.last and system_message is defined %}\n'
    '            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}\n'
    '        {%- else %}\n'
    '            {{- "[INST] " + message["content"] + "[/INST]" }}\n'
    '        {%- endif %}\n'
    '    {%- elif message.tool_calls is defined and message.tool_calls is not none %}\n'
    '        {{- "[TOOL_CALLS] [" }}\n'
    '        {%- for tool_call in message.tool_calls %}\n'
    '            {%- set out = tool_call.function|tojson %}\n'
    '            {{- out[:-1] }}\n'
    '            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}\n'
    '                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}\n'
    '            {%- endif %}\n'
    '            {{- \', "id": "\' + tool_call.id + \'"}\' }}\n'
    '            {%- if not loop.last %}\n'
    '                {{- ", " }}\n'
    '            {%- else %}\n'
    '                {{- "]" + eos_token }}\n'
    '            {%- endif %}\n'
    '        {%- endfor %}\n'
    '    {%- elif message["role"] == "assistant" %}\n'
    '        {{- " " + message["content"]|trim + eos_token}}\n'
    '    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}\n'
    '        {%- if message.content is defined and message.content.content is defined %}\n'
    '            {%- set content = message.content.content %}\n'
    '        {%- else %}\n'
    '            {%- set content = message.content %}\n'
    '        {%- endif %}\n'
    '        {{- \'[TOOL_RESULTS] {"content": \' + content|string + ", " }}\n'
    '        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}\n'
    '            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}\n'
    '        {%- endif %}\n'
    '        {{- \'"call_id": "\' + message.tool_call_id + \'"}[/TOOL_RESULTS]\' }}\n'
    '    {%- else %}\n'
    '        {{- raise_exception("Only user and assistant roles are supported, with the exception of an'
    ' initial optional system message!") }}\n'
    '    {%- endif %}\n'
    '{%- endfor %}\n'
    '')

PHI3_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")

TRAINING_TEXT = """\
[INST] What is the capital of France, and why do people visit it? [/INST] The capital of France is
Paris. People visit it for the museums, the river, the food and the long history of the city; many of
them come back again and again, in every season of the year.

User: can you write a short story about a robot who learns to paint? Assistant: Once upon a time
there was a little robot who wanted to learn how to paint. Every morning it looked at the sky, mixed
the colours it saw and tried again; every evening it showed its painting to the other robots.

You are a helpful assistant. The user asks a question and the assistant answers it, clearly and
kindly, in a few sentences: first the answer, then the reason, then an example if one helps.

The quick brown fox jumps over the lazy dog, and the dog does not mind: it is a lazy dog, after all.
In 1969, three astronauts flew to the Moon and back: 384400 km each way, in about 8 days in total.
Prices were 19.99, 5 and 12 percent off; the meeting is at 9:30 on 2024-03-15 in room 4B.

def fibonacci(n):
    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)  # symbols: ==, !=, <=, >=, {}, []

The three primary colours are red, yellow and blue. Is that all? Not yet! The end of the story is the
beginning of another one, as the old saying goes. That is the end.
"""

_CACHE: dict = {}


def sentencepiece_vocab() -> list[tuple[str, float, int]]:
    """The SentencePiece model's pieces by id, (piece, score, type), as Llama 2's model proto holds
    them: <unk> (UNKNOWN), <s>, </s> (CONTROL), the 256 byte pieces (BYTE), then the BPE pieces, merged
    ones in merge order and then the characters, scored 0, -1, -2, ... Both architectures share it."""
    if "v" not in _CACHE:
        merged, chars = _G.train_pieces(TRAINING_TEXT, N_MERGES)
        out = [("<unk>", 0.0, UNKNOWN), ("<s>", 0.0, CONTROL), ("</s>", 0.0, CONTROL)]
        out += [(f"<0x{b:02X}>", 0.0, BYTE) for b in range(256)]
        out += [(p, -float(i), NORMAL) for i, p in enumerate(merged + chars)]
        if len(out) != BASE_VOCAB:
            raise RuntimeError(f"the trainer gave {len(out)} pieces, not {BASE_VOCAB}")
        _CACHE["v"] = out
    return list(_CACHE["v"])


def added_tokens(arch: str) -> list[tuple[int, str, bool, bool]]:
    """(id, content, special, rstrip) of tokenizer.json's added tokens: <unk>, <s>, </s> and, for
    Phi-3, its own after the base vocabulary (module docstring)."""
    if arch == "mistral":
        return [(UNK_ID, "<unk>", True, False), (BOS_ID, "<s>", True, False), (EOS_ID, "</s>", True, False)]
    out = [(UNK_ID, "<unk>", True, False), (BOS_ID, "<s>", True, False), (EOS_ID, "</s>", False, True)]
    return out + [(BASE_VOCAB + i, t, True, t != "<|endoftext|>") for i, t in enumerate(PHI3_ADDED)]


def vocab_size(arch: str) -> int:
    """config.json's vocab_size: the embedding's rows."""
    return PHI3_VOCAB if arch == "phi3" else BASE_VOCAB


def token_id(text: str, arch: str = "mistral") -> int:
    for i, t, _, _ in added_tokens(arch):
        if t == text:
            return i
    return next(i for i, (p, _, _) in enumerate(sentencepiece_vocab()) if p == text)


def _added_token(i: int, t: str, special: bool, rstrip: bool) -> dict:
    return {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": rstrip, "normalized": False,
            "special": special}


def tokenizer_json(arch: str = "mistral") -> dict:
    """tokenizer.json as transformers' LlamaConverter writes Llama 2's kind (module docstring)."""
    sp = sentencepiece_vocab()
    vocab = {p: i for i, (p, _, _) in enumerate(sp)}
    merges = _G.generate_merges(vocab, {p: s for p, s, _ in sp})
    a, b = {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}
    if arch == "mistral":  # LlamaTokenizerFast's post-processor for add_bos_token true
        bos = {"SpecialToken": {"id": "<s>", "type_id": 0}}
        post = {"type": "TemplateProcessing", "single": [bos, a],
                "pair": [bos, a, {"SpecialToken": {"id": "<s>", "type_id": 1}}, b],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [BOS_ID], "tokens": ["<s>"]}}}
    else:  # ... and for add_bos_token false (Phi-3)
        post = {"type": "TemplateProcessing", "single": [a], "pair": [a, b], "special_tokens": {}}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [_added_token(*t) for t in added_tokens(arch)],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": SPIECE},
            {"type": "Replace", "pattern": {"String": " "}, "content": SPIECE}]},
        "pre_tokenizer": None,
        "post_processor": post,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": SPIECE}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": [[x, y] for x, y in merges]},
    }


def tokenizer_config_json(arch: str = "mistral") -> dict:
    """tokenizer_config.json as Mistral-7B-Instruct's (BOS added, v0.3's chat template) or
    Phi-3-mini-4k-instruct's (no BOS, eos and pad <|endoftext|>, padding side left)."""
    decoder = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": r, "single_word": False,
                        "special": s} for i, t, s, r in added_tokens(arch)}
    if arch == "mistral":
        return {
            "add_bos_token": True,
            "add_eos_token": False,
            "added_tokens_decoder": decoder,
            "additional_special_tokens": [],
            "bos_token": "<s>",
            "chat_template": MISTRAL_CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": "</s>",
            "legacy": True,
            "model_max_length": 1000000000000000019884624838656,  # transformers' "no limit"
            "pad_token": None,
            "sp_model_kwargs": {},
            "spaces_between_special_tokens": False,
            "tokenizer_class": "LlamaTokenizer",
            "unk_token": "<unk>",
            "use_default_system_prompt": False,
        }
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": decoder,
        "bos_token": "<s>",
        "chat_template": PHI3_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "legacy": False,
        "model_max_length": CONTEXT,
        "pad_token": "<|endoftext|>",
        "padding_side": "left",
        "sp_model_kwargs": {},
        "tokenizer_class": "LlamaTokenizer",
        "unk_token": "<unk>",
        "use_default_system_prompt": False,
    }


def added_tokens_json() -> dict:
    """Phi-3's added_tokens.json (content -> id), keys sorted as in its repo."""
    return dict(sorted((t, i) for i, t, _, _ in added_tokens("phi3") if i >= BASE_VOCAB))


def hf_tokenizer(arch: str = "mistral"):
    """The tokenizer as a `tokenizers.Tokenizer` (what tokenizer.json holds)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(json.dumps(tokenizer_json(arch)))


def gguf_vocab(arch: str = "mistral") -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) as llama.cpp's converter makes them from the files above (module
    docstring): LlamaModel's _create_vocab_sentencepiece for Mistral, Phi3MiniModel.set_vocab for Phi-3."""
    sp = sentencepiece_vocab()
    n = vocab_size(arch)
    tokens, scores, types = [f"[PAD{i}]" for i in range(n)], [-10000.0] * n, [UNUSED] * n
    for i, (p, s, t) in enumerate(sp):
        tokens[i], scores[i], types[i] = p, s, t
    looks_special = ("<pad>", "<mask>", "<2mass>", "[@BOS@]")  # does_token_look_special's fixed list
    if arch == "mistral":
        for key, d in tokenizer_config_json(arch)["added_tokens_decoder"].items():
            i, t = int(key), d["content"]
            special = d["special"] or t in looks_special or (t.startswith("<|") and t.endswith("|>"))
            types[i] = CONTROL if special else USER_DEFINED
            tokens[i] = t if special else t.replace(SPIECE, " ")
            scores[i] = -1000.0
        return tokens, scores, types
    for t, i in added_tokens_json().items():
        tokens[i], scores[i], types[i] = t, -1000.0, USER_DEFINED
    entries = [(int(k), d) for k, d in tokenizer_config_json(arch)["added_tokens_decoder"].items()]
    entries += [(d["id"], d) for d in tokenizer_json(arch)["added_tokens"]]
    for i, d in entries:
        tokens[i], scores[i], types[i] = d["content"], -1000.0, CONTROL if d["special"] else USER_DEFINED
    return tokens, scores, types



def add_vocab(w, arch: str) -> None:
    """The vocabulary keys as the converter writes them: `tokenizer.ggml.model = llama`, then
    SpecialVocab's (tokenizer_config's bos/eos/unk/pad, config.json's ids agreeing; add_bos from the
    post-processor (Mistral's adds <s>; its pair template makes add_sep false) or else from
    tokenizer_config (Phi-3: false), add_eos from tokenizer_config; the chat template."""
    tokens, scores, toktypes = gguf_vocab(arch)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(toktypes)
    w.add_bos_token_id(BOS_ID)
    if arch == "mistral":
        w.add_eos_token_id(EOS_ID)
        w.add_unk_token_id(UNK_ID)
        w.add_add_bos_token(True)
        w.add_add_sep_token(False)
        w.add_add_eos_token(False)
        w.add_chat_template(MISTRAL_CHAT_TEMPLATE)
    else:
        eot = token_id("<|endoftext|>", arch)
        w.add_eos_token_id(eot)
        w.add_unk_token_id(UNK_ID)
        w.add_pad_token_id(eot)
        w.add_add_bos_token(False)
        w.add_add_eos_token(False)
        w.add_chat_template(PHI3_CHAT_TEMPLATE)


def write_tokenizer_files(hf_dir: Path, arch: str = "mistral") -> None:
    """tokenizer.json, tokenizer_config.json (and Phi-3's added_tokens.json)."""
    hf_dir = Path(hf_dir)
    write_json(hf_dir / "tokenizer.json", tokenizer_json(arch))
    write_json(hf_dir / "tokenizer_config.json", tokenizer_config_json(arch))
    if arch == "phi3":
        write_json(hf_dir / "added_tokens.json", added_tokens_json())
