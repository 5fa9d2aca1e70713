"""Byte-level BPE (``tokenizer.ggml.model = gpt2``), following llama.cpp (src/llama-vocab.cpp).

Byte-level BPE over the file's merges, with the pre-tokenizer regexes llama.cpp uses for
``tokenizer.ggml.pre`` (`PRE_TOKENIZERS`). HF's BPE (merge by rank, leftmost on ties) is llama.cpp's
algorithm, so ``Tokenizer.encode`` is ``hf.encode`` over the pipeline `hf_byte_level` builds.
"""

from __future__ import annotations

import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers

# ---------------------------------------------------------------------------------------------------
# Pre-tokenizer regexes, as in llama.cpp's llm_tokenizer_bpe (each is applied in turn; a piece that
# one regex does not match is kept whole, which is Split(behavior="isolated") in HF terms).

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
_FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")
_DIGITS_GPT2 = (r"\p{N}", _GPT2)


class _Pre:
    def __init__(self, exprs: tuple[str, ...], ignore_merges: bool = False, add_bos: bool = False):
        self.exprs, self.ignore_merges, self.add_bos = exprs, ignore_merges, add_bos


def _pre_table() -> dict[str, _Pre]:
    t: dict[str, _Pre] = {"default": _Pre(_DEFAULT)}
    for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"):
        t[name] = _Pre((_LLAMA3,), ignore_merges=True, add_bos=True)
    for name in ("dbrx", "smaug-bpe"):
        t[name] = _Pre((_LLAMA3,))
    for name in ("gpt-2", "phi-2", "mpt", "olmo", "jais", "gigachat", "mellum", "a.x-4.0", "exaone4",
                 "trillion", "granite-docling"):
        t[name] = _Pre((_GPT2,))
    for name in ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"):
        t[name] = _Pre(_DIGITS_GPT2)
    for name in ("qwen2", "deepseek-r1-qwen", "kormo", "stablelm2", "megrez", "hunyuan"):
        t[name] = _Pre((_QWEN2,))
    t["falcon"] = _Pre(_FALCON)
    return t


PRE_TOKENIZERS = _pre_table()


# ---------------------------------------------------------------------------------------------------
# Byte-level text: every byte spelled as one printable character


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def hf_byte_level(vocab: dict[str, int], merges: list[tuple[str, str]], pre: _Pre) -> tokenizers.Tokenizer:
    """A `tokenizers.Tokenizer` for a byte-level vocabulary: BPE over `merges`, after `pre`'s regexes
    and the byte-level mapping."""
    model = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges)
    hf = tokenizers.Tokenizer(model)
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in pre.exprs]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    return hf
