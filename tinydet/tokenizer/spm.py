"""SentencePiece BPE (``tokenizer.ggml.model = llama``), following llama.cpp (src/llama-vocab.cpp).

Spaces become U+2581 ("▁"), a "▁" is put in front of the text and of every text run that follows a
special token (unless ``tokenizer.ggml.add_space_prefix`` is false), then adjacent symbols are merged,
always taking the pair whose merged piece has the highest score (leftmost on ties), and characters that
end up as no token fall back to ``<0xNN>`` byte tokens. ``Tokenizer.encode`` runs exactly that algorithm
(`_SPM`: llama.cpp's llm_tokenizer_spm_session, in Python, cached per word). A ``tokenizers.BPE`` with
merges derived from the scores (the way transformers converts such vocabularies, `hf_spm`) is built on
first use of ``Tokenizer.hf``; it agrees on everything tested, but a merge-rank order cannot express SPM's
position-based tie-break between a token's different splits in general, so ``Tokenizer.encode`` does
not rely on it.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Sequence

import tokenizers
from tokenizers import decoders, models, normalizers

SPIECE_UNDERLINE = "\u2581"

_BYTE_TOKEN_RE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


# ---------------------------------------------------------------------------------------------------
# SentencePiece BPE, as llama.cpp's llm_tokenizer_spm_session


class _SPM:
    """The vocabulary is held as UTF-8 bytes: a token's bytes object takes about half the memory of its
    str (a "▁" makes a str two bytes a character; Gemma 3's 262,144 tokens: 12 MiB, not 21), and
    merging bytes gives the same tokens as merging text: concatenation and lookups agree, and the
    stale-bigram check compares lengths that only grow when a symbol changes, in bytes as in
    characters."""

    _CACHE_MAX = 1 << 16

    def __init__(self, vocab: dict[str, int], scores: Sequence[float], unk_id: int | None):
        """`vocab` maps every token to its id, in id order (its id objects are shared, not copied);
        `scores` is indexed by id."""
        self.vocab = {t.encode("utf-8"): i for t, i in vocab.items()}
        self.tokens = list(self.vocab)  # by id
        self.scores = scores
        self.byte_ids: list[int | None] = []
        for b in range(256):
            tid = self.vocab.get(b"<0x%02X>" % b)
            if tid is None and b < 0x80:
                tid = self.vocab.get(bytes([b]))
            self.byte_ids.append(tid if tid is not None else unk_id)
        # Merges never cross the start of a "▁" run unless some token has a "▁" after another
        # character; when none does, text can be cut there and each word encoded (and cached) alone.
        self.split_words = not any(re.search(f"[^{SPIECE_UNDERLINE}]{SPIECE_UNDERLINE}", t) for t in vocab)
        self._word_re = re.compile(f"(?<=[^{SPIECE_UNDERLINE}])(?={SPIECE_UNDERLINE})")
        self._cache: dict[str, tuple[int, ...]] = {}

    def encode(self, text: str) -> list[int]:
        """`text` already escaped (spaces as "▁", prefix added)."""
        if not text:
            return []
        if not self.split_words:
            return list(self._merge(text))
        out: list[int] = []
        cache = self._cache
        for word in self._word_re.split(text):
            ids = cache.get(word)
            if ids is None:
                ids = self._merge(word)
                if len(cache) >= self._CACHE_MAX:
                    cache.clear()
                cache[word] = ids
            out.extend(ids)
        return out

    def token(self, i: int) -> str:
        return self.tokens[i].decode("utf-8")

    def _merge(self, word: str) -> tuple[int, ...]:
        vocab, scores = self.vocab, self.scores
        sym = [c.encode("utf-8") for c in word]  # symbols as bytes (the class docstring)
        n = len(sym)
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        heap = []
        for i in range(n - 1):
            tid = vocab.get(sym[i] + sym[i + 1])
            if tid is not None:
                heap.append((-scores[tid], i, i + 1, len(sym[i]) + len(sym[i + 1])))
        heapq.heapify(heap)
        push, pop = heapq.heappush, heapq.heappop
        while heap:
            _, left, right, size = pop(heap)
            sl, sr = sym[left], sym[right]
            # Skip bigrams whose symbols have changed since they were queued (llama.cpp's check).
            if not sl or not sr or len(sl) + len(sr) != size:
                continue
            merged = sl + sr
            sym[left], sym[right] = merged, b""
            nx = nxt[right]
            nxt[left] = nx
            if nx >= 0:
                prv[nx] = left
            p = prv[left]
            if p >= 0:
                tid = vocab.get(sym[p] + merged)
                if tid is not None:
                    push(heap, (-scores[tid], p, left, len(sym[p]) + len(merged)))
            if nx >= 0:
                tid = vocab.get(merged + sym[nx])
                if tid is not None:
                    push(heap, (-scores[tid], left, nx, len(merged) + len(sym[nx])))
        out: list[int] = []
        i = 0
        while i != -1:
            s = sym[i]
            tid = vocab.get(s)
            if tid is not None:
                out.append(tid)
            else:  # only single characters can be missing: byte fallback
                for b in s:
                    bid = self.byte_ids[b]
                    if bid is None:
                        raise ValueError(f"cannot encode {s.decode('utf-8')!r}: the vocabulary has no "
                                         f"<0x{b:02X}> byte token and no unknown token")
                    out.append(bid)
            i = nxt[i]
        return tuple(out)


# ---------------------------------------------------------------------------------------------------
# The same vocabulary as a tokenizers.BPE


def _spm_merges(tokens: list[str], scores: Sequence[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges implied by a scored vocabulary (`vocab` maps `tokens` to their ids): every split of
    a token into two tokens, best score first (as transformers' GGUF/SentencePiece converters do)."""
    found = []
    for i, t in enumerate(tokens):
        if len(t) < 2:
            continue
        for k in range(1, len(t)):
            left, right = t[:k], t[k:]
            if left in vocab and right in vocab:
                found.append((-scores[i], i, -k, left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def hf_spm(tokens: list[str], scores: Sequence[float], vocab: dict[str, int], unk_id: int | None,
           add_space_prefix: bool) -> tokenizers.Tokenizer:
    """A `tokenizers.Tokenizer` for a SentencePiece vocabulary (`vocab` maps `tokens` to their ids):
    BPE over `_spm_merges`, spaces as "▁" (with the prefix when `add_space_prefix`), byte fallback."""
    # llama.cpp merges into any token whose text two adjacent symbols spell.
    merges = _spm_merges(tokens, scores, vocab)
    unk_text = tokens[unk_id] if unk_id is not None else None
    model = models.BPE(vocab=vocab, merges=merges, unk_token=unk_text, fuse_unk=True, byte_fallback=True)
    hf = tokenizers.Tokenizer(model)
    replace = normalizers.Replace(" ", SPIECE_UNDERLINE)
    hf.normalizer = (normalizers.Sequence([normalizers.Prepend(SPIECE_UNDERLINE), replace])
                     if add_space_prefix else replace)
    hf.pre_tokenizer = None
    steps = [decoders.Replace(SPIECE_UNDERLINE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    hf.decoder = decoders.Sequence(steps)
    return hf
