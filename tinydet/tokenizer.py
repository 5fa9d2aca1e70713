"""Tokenizers built from GGUF metadata, plus streaming detokenization.

Two vocabulary kinds are supported, each following llama.cpp (src/llama-vocab.cpp):

* ``tokenizer.ggml.model = llama``: SentencePiece BPE. Spaces become U+2581 ("▁"), a "▁" is put in
  front of the text and of every text run that follows a special token (unless
  ``tokenizer.ggml.add_space_prefix`` is false), then adjacent symbols are merged, always taking the
  pair whose merged piece has the highest score (leftmost on ties), and characters that end up as no
  token fall back to ``<0xNN>`` byte tokens. ``encode`` runs exactly that algorithm (llama.cpp's
  llm_tokenizer_spm_session, in Python, cached per word). A ``tokenizers.BPE`` with merges derived from
  the scores (the way transformers converts such vocabularies) is built as well, as ``hf``; it agrees on
  everything tested, but a merge-rank order cannot express SPM's position-based tie-break between a
  token's different splits in general, so ``Tokenizer.encode`` does not rely on it.
* ``tokenizer.ggml.model = gpt2``: byte-level BPE over the file's merges, with the pre-tokenizer
  regexes llama.cpp uses for ``tokenizer.ggml.pre``. HF's BPE (merge by rank, leftmost on ties) is
  llama.cpp's algorithm, so ``encode`` is ``hf.encode``.

Control, unknown and user-defined tokens (types 3, 2, 4) are matched whole in the input text, as
llama.cpp does with ``parse_special`` and as HF does with added tokens.

Decoding concatenates per-token bytes (control and unknown tokens skipped, byte tokens as their byte,
"▁" as a space, byte-level pieces mapped back to bytes), strips the one leading space SentencePiece
added, and decodes UTF-8 with U+FFFD for invalid bytes. ``StreamDecoder`` does the same incrementally
and never emits half a character.
"""

from __future__ import annotations

import codecs
import heapq
import re
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from .errors import ModelFormatError

__all__ = ["Tokenizer", "StreamDecoder", "NULL_TOKEN_ID"]

# A special-token id of 0xFFFFFFFF (uint32 -1) means "none" in GGUF files.
NULL_TOKEN_ID = 0xFFFFFFFF

# llama.cpp token types (tokenizer.ggml.token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
_KNOWN_TYPES = (0, 1, 2, 3, 4, 5, 6)  # 0 = undefined

SPIECE_UNDERLINE = "\u2581"

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
_BYTE_TOKEN_RE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


# ---------------------------------------------------------------------------------------------------
# Metadata helpers


def _as_int(v: Any) -> int | None:
    if isinstance(v, (bool, np.bool_)):
        return None
    if isinstance(v, (int, np.integer)):
        return int(v)
    return None


def _as_bool(v: Any) -> bool | None:
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    return None


class _Meta:
    def __init__(self, metadata: dict, path):
        self.m, self.path = metadata, path

    def err(self, field: str, message: str) -> ModelFormatError:
        return ModelFormatError(self.path, field, message)

    def has(self, key: str) -> bool:
        return key in self.m

    def string(self, key: str, default=None) -> str | None:
        if key not in self.m:
            return default
        v = self.m[key]
        if not isinstance(v, str):
            raise self.err(key, f"expected a string, found {type(v).__name__}")
        return v

    def flag(self, key: str, default: bool) -> bool:
        if key not in self.m:
            return default
        v = _as_bool(self.m[key])
        if v is None:
            raise self.err(key, f"expected a bool, found {self.m[key]!r}")
        return v

    def token_id(self, key: str, n_vocab: int, default: int | None, strict: bool = True) -> int | None:
        """A special-token id: None when absent or 0xFFFFFFFF (llama.cpp's LLAMA_TOKEN_NULL). An id
        outside the vocabulary is an error when `strict`, else (ids tinydet never emits: unknown,
        padding, separator) it is dropped with a warning, as llama.cpp ignores it."""
        if key not in self.m:
            return default
        v = _as_int(self.m[key])
        if v is None:
            raise self.err(key, f"expected an integer token id, found {self.m[key]!r}")
        if v == NULL_TOKEN_ID or v == -1:
            return None
        if not 0 <= v < n_vocab:
            if strict:
                raise self.err(key, f"token id {v} is outside the vocabulary (0..{n_vocab - 1})")
            warnings.warn(f"{self.path}: {key}: token id {v} is outside the vocabulary (0..{n_vocab - 1}); ignored",
                          stacklevel=3)
            return None
        return v

    def string_list(self, key: str, required: bool) -> list[str] | None:
        if key not in self.m:
            if required:
                raise self.err(key, "required tokenizer metadata is missing")
            return None
        v = self.m[key]
        if not isinstance(v, (list, tuple)) or not all(isinstance(s, str) for s in v):
            raise self.err(key, "expected an array of strings")
        return list(v)

    def numeric_array(self, key: str, n: int, kind: str) -> np.ndarray | None:
        if key not in self.m:
            return None
        v = self.m[key]
        try:
            arr = np.asarray(v)
        except Exception:  # noqa: BLE001 - anything unconvertible is a format error
            arr = None
        if arr is None or arr.ndim != 1 or arr.dtype.kind not in ("f", "i", "u") or (kind == "i" and arr.dtype.kind == "f"):
            raise self.err(key, f"expected a 1-D {'float' if kind == 'f' else 'integer'} array")
        if len(arr) != n:
            raise self.err(key, f"has {len(arr)} entries but tokenizer.ggml.tokens has {n}")
        return arr


# ---------------------------------------------------------------------------------------------------
# SentencePiece BPE, as llama.cpp's llm_tokenizer_spm_session


class _SPM:
    _CACHE_MAX = 1 << 16

    def __init__(self, tokens: list[str], scores: list[float], unk_id: int | None):
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.scores = scores
        self.byte_ids: list[int | None] = []
        for b in range(256):
            tid = self.vocab.get(f"<0x{b:02X}>")
            if tid is None and b < 0x80:
                tid = self.vocab.get(chr(b))
            self.byte_ids.append(tid if tid is not None else unk_id)
        # Merges never cross the start of a "▁" run unless some token has a "▁" after another
        # character; when none does, text can be cut there and each word encoded (and cached) alone.
        self.split_words = not any(re.search(f"[^{SPIECE_UNDERLINE}]{SPIECE_UNDERLINE}", t) for t in tokens)
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

    def _merge(self, word: str) -> tuple[int, ...]:
        vocab, scores = self.vocab, self.scores
        sym = list(word)
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
            sym[left], sym[right] = merged, ""
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
                for b in s.encode("utf-8"):
                    bid = self.byte_ids[b]
                    if bid is None:
                        raise ValueError(f"cannot encode {s!r}: the vocabulary has no <0x{b:02X}> byte token "
                                         "and no unknown token")
                    out.append(bid)
            i = nxt[i]
        return tuple(out)


def _spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a scored vocabulary: every split of a token into two tokens, best score
    first (as transformers' GGUF/SentencePiece converters do)."""
    vocab = {t: i for i, t in enumerate(tokens)}
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


# ---------------------------------------------------------------------------------------------------


class Tokenizer:
    """Text <-> token ids for one model. Build with `from_gguf_metadata` or `from_hf`."""

    hf: tokenizers.Tokenizer
    vocab_size: int
    bos_id: int | None
    eos_ids: tuple[int, ...]
    add_bos: bool
    add_eos: bool

    def __init__(self):
        # Filled in by the constructors below.
        self.hf = None  # type: ignore[assignment]
        self.vocab_size = 0
        self.model = "hf"  # "llama" (SentencePiece BPE), "gpt2" (byte-level BPE) or "hf"
        self.pre: str | None = None
        self.bos_id = None
        self.eos_id: int | None = None
        self.eos_ids = ()
        self.unk_id: int | None = None
        self.pad_id: int | None = None
        self.sep_id: int | None = None
        self.add_bos = False
        self.add_eos = False
        self.add_space_prefix = False
        self.chat_template: str | None = None
        self._spm: _SPM | None = None
        self._special_re: re.Pattern | None = None
        self._special_ids: dict[str, int] = {}
        self._pieces: list[bytes] | None = None  # per-token decoded bytes (GGUF vocabularies)
        self._skip: frozenset[int] = frozenset()

    # -- construction ------------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, metadata: dict, path) -> Tokenizer:
        """Build from a GGUF file's metadata (`GGUFFile(path).metadata`); `path` is for messages only."""
        m = _Meta(metadata, path)
        kind = m.string("tokenizer.ggml.model")
        if kind is None:
            raise m.err("tokenizer.ggml.model", "required tokenizer metadata is missing")
        if kind not in ("llama", "gpt2"):
            raise m.err("tokenizer.ggml.model",
                        f"tokenizer model {kind!r} is not supported (supported: 'llama', 'gpt2')")
        tokens = m.string_list("tokenizer.ggml.tokens", required=True)
        n = len(tokens)
        if n == 0:
            raise m.err("tokenizer.ggml.tokens", "the vocabulary is empty")
        # llama.cpp renames empty tokens; a token string must map to one id.
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        seen: dict[str, int] = {}
        for i, t in enumerate(tokens):
            if t in seen:
                raise m.err("tokenizer.ggml.tokens", f"token {t!r} appears twice (ids {seen[t]} and {i})")
            seen[t] = i

        types_arr = m.numeric_array("tokenizer.ggml.token_type", n, "i")
        if types_arr is None:
            # llama.cpp takes every token as normal then; still decode "<0xNN>" as its byte, as HF does.
            types = [TOKEN_BYTE if kind == "llama" and _BYTE_TOKEN_RE.fullmatch(t) else TOKEN_NORMAL
                     for t in tokens]
        else:
            types = [int(x) for x in types_arr]
            bad = [i for i, x in enumerate(types) if x not in _KNOWN_TYPES]
            if bad:
                raise m.err("tokenizer.ggml.token_type",
                            f"token {bad[0]} has unknown type {types[bad[0]]} (expected 0-6)")
        scores_arr = m.numeric_array("tokenizer.ggml.scores", n, "f")
        if kind == "llama" and scores_arr is None:
            raise m.err("tokenizer.ggml.scores", "required for a 'llama' (SentencePiece) vocabulary, missing")
        scores = [float(x) for x in scores_arr] if scores_arr is not None else [0.0] * n
        if any(s != s for s in scores):
            raise m.err("tokenizer.ggml.scores", "contains NaN")

        tok = cls()
        tok.model = kind
        tok.vocab_size = n
        tok.chat_template = m.string("tokenizer.chat_template")
        spm = kind == "llama"
        # Defaults as in llama.cpp's llama_vocab::impl::load.
        tok.bos_id = m.token_id("tokenizer.ggml.bos_token_id", n, 1 if spm and n > 1 else None)
        tok.eos_id = m.token_id("tokenizer.ggml.eos_token_id", n, 2 if spm and n > 2 else None)
        tok.unk_id = m.token_id("tokenizer.ggml.unknown_token_id", n, 0 if spm else None, strict=False)
        tok.pad_id = m.token_id("tokenizer.ggml.padding_token_id", n, None, strict=False)
        tok.sep_id = m.token_id("tokenizer.ggml.seperator_token_id", n, None, strict=False)
        eot = m.token_id("tokenizer.ggml.eot_token_id", n, None)
        eom = m.token_id("tokenizer.ggml.eom_token_id", n, None)
        tok.eos_ids = tuple(dict.fromkeys(i for i in (tok.eos_id, eot, eom) if i is not None))

        if spm:
            pre = None
            add_bos_default = True
            tok.add_space_prefix = m.flag("tokenizer.ggml.add_space_prefix", True)
        else:
            pre = m.string("tokenizer.ggml.pre")
            if pre is None:
                warnings.warn(f"{path}: tokenizer.ggml.pre is missing; using llama.cpp's 'default' "
                              "pre-tokenizer", stacklevel=2)
                pre = "default"
            if pre not in PRE_TOKENIZERS:
                raise m.err("tokenizer.ggml.pre",
                            f"pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(PRE_TOKENIZERS))})")
            add_bos_default = PRE_TOKENIZERS[pre].add_bos
            tok.add_space_prefix = False
        tok.pre = pre
        tok.add_bos = m.flag("tokenizer.ggml.add_bos_token", add_bos_default)
        tok.add_eos = m.flag("tokenizer.ggml.add_eos_token", False)
        if tok.add_bos and tok.bos_id is None:
            raise m.err("tokenizer.ggml.add_bos_token", "is true but the vocabulary has no BOS token")
        if tok.add_eos and tok.eos_id is None:
            raise m.err("tokenizer.ggml.add_eos_token", "is true but the vocabulary has no EOS token")

        specials = [i for i, t in enumerate(types) if t in (TOKEN_CONTROL, TOKEN_UNKNOWN)]
        user_defined = [i for i, t in enumerate(types) if t == TOKEN_USER_DEFINED]
        tok._special_ids = {tokens[i]: i for i in specials + user_defined}
        if tok._special_ids:
            alts = sorted(tok._special_ids, key=lambda s: (-len(s), s))
            tok._special_re = re.compile("|".join(map(re.escape, alts)))

        vocab = {t: i for i, t in enumerate(tokens)}
        if spm:
            # llama.cpp merges into any token whose text two adjacent symbols spell.
            merges = _spm_merges(tokens, scores)
            unk_text = tokens[tok.unk_id] if tok.unk_id is not None else None
            model = models.BPE(vocab=vocab, merges=merges, unk_token=unk_text, fuse_unk=True, byte_fallback=True)
            hf = tokenizers.Tokenizer(model)
            replace = normalizers.Replace(" ", SPIECE_UNDERLINE)
            hf.normalizer = (normalizers.Sequence([normalizers.Prepend(SPIECE_UNDERLINE), replace])
                             if tok.add_space_prefix else replace)
            hf.pre_tokenizer = None
            steps = [decoders.Replace(SPIECE_UNDERLINE, " "), decoders.ByteFallback(), decoders.Fuse()]
            if tok.add_space_prefix:
                steps.append(decoders.Strip(" ", 1, 0))
            hf.decoder = decoders.Sequence(steps)
            tok._spm = _SPM(tokens, scores, tok.unk_id)
        else:
            raw_merges = m.string_list("tokenizer.ggml.merges", required=True)
            merges = []
            for i, s in enumerate(raw_merges):
                k = s.find(" ", 1)  # llama.cpp splits at the first space after the first character
                left, right = (s[:k], s[k + 1:]) if k > 0 else ("", "")
                if not left or not right or left not in vocab or right not in vocab or left + right not in vocab:
                    raise m.err("tokenizer.ggml.merges",
                                f"merge {i} ({s!r}) is not 'LEFT RIGHT' over tokens whose concatenation is a token")
                merges.append((left, right))
            p = PRE_TOKENIZERS[pre]
            model = models.BPE(vocab=vocab, merges=merges, ignore_merges=p.ignore_merges)
            hf = tokenizers.Tokenizer(model)
            hf.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in p.exprs]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
            hf.decoder = decoders.ByteLevel()
        if specials:
            hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in specials])
        if user_defined:
            hf.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user_defined])
        if hf.get_vocab_size(with_added_tokens=True) != n:
            raise m.err("tokenizer.ggml.tokens", "the special tokens do not map onto the vocabulary")
        tok.hf = hf
        tok._set_post_processor()
        tok._pieces = _gguf_pieces(tokens, types, spm)
        tok._skip = frozenset(i for i, t in enumerate(types) if t in (TOKEN_CONTROL, TOKEN_UNKNOWN)) | frozenset(
            i for i in (tok.bos_id, *tok.eos_ids) if i is not None)
        return tok

    @classmethod
    def from_hf(cls, tokenizer: tokenizers.Tokenizer, *, bos_id: int | None, eos_ids: Iterable[int],
                add_bos: bool, add_eos: bool) -> Tokenizer:
        """Wrap an existing `tokenizers.Tokenizer` (e.g. a model directory's tokenizer.json). Its own
        post-processor is ignored: BOS/EOS are added per `add_bos`/`add_eos`."""
        tok = cls()
        tok.hf = tokenizer
        tok.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        tok.bos_id = None if bos_id is None else int(bos_id)
        tok.eos_ids = tuple(dict.fromkeys(int(i) for i in eos_ids))
        tok.eos_id = tok.eos_ids[0] if tok.eos_ids else None
        tok.add_bos, tok.add_eos = bool(add_bos), bool(add_eos)
        if tok.add_bos and tok.bos_id is None:
            raise ValueError("add_bos is true but bos_id is None")
        if tok.add_eos and tok.eos_id is None:
            raise ValueError("add_eos is true but there is no EOS id")
        tok._skip = frozenset(i for i in (tok.bos_id, *tok.eos_ids) if i is not None)
        return tok

    def _set_post_processor(self) -> None:
        """Make `hf.encode(text)` add BOS/EOS the way `encode` does."""
        single, special = "$A", []
        if self.add_bos:
            bos = self.hf.id_to_token(self.bos_id)
            single = f"{bos} {single}"
            special.append((bos, self.bos_id))
        if self.add_eos:
            eos = self.hf.id_to_token(self.eos_id)
            single = f"{single} {eos}"
            if self.eos_id != self.bos_id or not self.add_bos:
                special.append((eos, self.eos_id))
        try:
            self.hf.post_processor = processors.TemplateProcessing(single=single, special_tokens=special)
        except Exception:  # noqa: BLE001 - a token text the template syntax cannot hold: leave hf as is
            self.hf.post_processor = None

    # -- encoding ----------------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids for `text`; BOS/EOS added per `add_bos`/`add_eos` when `add_special`. Special
        tokens written in the text (e.g. "<|im_start|>") become their ids."""
        if not isinstance(text, str):
            raise TypeError(f"text must be str, not {type(text).__name__}")
        if self._spm is not None:
            ids = self._encode_spm(text)
        else:
            ids = list(self.hf.encode(text, add_special_tokens=False).ids)
        if add_special:
            if self.add_bos:
                ids.insert(0, self.bos_id)
            if self.add_eos:
                ids.append(self.eos_id)
        return ids

    def _encode_spm(self, text: str) -> list[int]:
        out: list[int] = []
        prev_special = True  # llama.cpp puts the space prefix after every special token
        for piece, special_id in self._split_special(text):
            if special_id is not None:
                out.append(special_id)
                prev_special = True
                continue
            if self.add_space_prefix and prev_special:
                piece = " " + piece
            out.extend(self._spm.encode(piece.replace(" ", SPIECE_UNDERLINE)))
            prev_special = False
        return out

    def _split_special(self, text: str):
        if self._special_re is None:
            if text:
                yield text, None
            return
        pos = 0
        for mt in self._special_re.finditer(text):
            if mt.start() > pos:
                yield text[pos:mt.start()], None
            yield "", self._special_ids[mt.group()]
            pos = mt.end()
        if pos < len(text):
            yield text[pos:], None

    # -- decoding ----------------------------------------------------------------------------------

    def _check_id(self, i) -> int:
        j = int(i)
        if not 0 <= j < self.vocab_size:
            raise ValueError(f"token id {j} is outside the vocabulary (0..{self.vocab_size - 1})")
        return j

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, skipping BOS/EOS/control tokens; invalid UTF-8 becomes U+FFFD."""
        ids = [self._check_id(i) for i in ids]
        if self._pieces is None:
            return self.hf.decode([i for i in ids if i not in self._skip], skip_special_tokens=True)
        data = b"".join([self._pieces[i] for i in ids])
        if self.add_space_prefix and data[:1] == b" ":
            data = data[1:]
        return data.decode("utf-8", errors="replace")

    def stream(self, prefix: Sequence[int] = ()) -> StreamDecoder:
        """An incremental decoder. Text it emits continues `decode(prefix)`: with the default (empty)
        prefix the first piece loses SentencePiece's leading space, as `decode` does; pass the
        prompt's ids to decode a continuation of that prompt."""
        return StreamDecoder(self, prefix)


def _gguf_pieces(tokens: list[str], types: list[int], spm: bool) -> list[bytes]:
    """Bytes each token contributes to decoded text, as llama.cpp's token_to_piece(special=false):
    control, unknown, unused and undefined tokens give nothing; user-defined tokens their text."""
    out = []
    for t, ty in zip(tokens, types):
        if ty == TOKEN_USER_DEFINED:
            out.append(t.encode("utf-8"))
        elif ty == TOKEN_NORMAL:
            if spm:
                out.append(t.replace(SPIECE_UNDERLINE, " ").encode("utf-8"))
            else:
                try:
                    out.append(bytes(_CHAR_TO_BYTE[c] for c in t))
                except KeyError:  # not byte-level text: take it as written
                    out.append(t.encode("utf-8"))
        elif ty == TOKEN_BYTE and spm:
            mt = _BYTE_TOKEN_RE.fullmatch(t)
            out.append(bytes([int(mt.group(1), 16)]) if mt else b"")
        else:
            out.append(b"")
    return out


class StreamDecoder:
    """Incremental detokenizer: `push` returns the text completed by one more token (possibly ""),
    never half a UTF-8 character; `flush` returns what is left. The concatenation of everything
    returned equals `Tokenizer.decode` of the pushed ids (after `prefix`, see `Tokenizer.stream`)."""

    def __init__(self, tokenizer: Tokenizer, prefix: Sequence[int] = ()):
        self._tok = tokenizer
        prefix = [tokenizer._check_id(i) for i in prefix]
        if tokenizer._pieces is not None:
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
            self._at_start = tokenizer.add_space_prefix
            for i in prefix:
                self._push_bytes(i)
        else:
            # Generic tokenizers: decode a short window of recent ids and emit what grew.
            self._ids: list[int] = prefix
            self._read_offset = len(prefix)
            self._prefix_offset = max(0, len(prefix) - 8)

    def _push_bytes(self, token_id: int) -> str:
        b = self._tok._pieces[token_id]
        if not b:
            return ""
        if self._at_start:
            self._at_start = False
            if b[:1] == b" ":
                b = b[1:]
        return self._utf8.decode(b)

    def push(self, token_id: int) -> str:
        token_id = self._tok._check_id(token_id)
        if self._tok._pieces is not None:
            return self._push_bytes(token_id)
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        if self._tok._pieces is not None:
            return self._utf8.decode(b"", final=True)
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        dec = self._tok.decode
        prefix_text = dec(self._ids[self._prefix_offset:self._read_offset])
        new_text = dec(self._ids[self._prefix_offset:])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            if not new_text.startswith(prefix_text):  # a decoder that rewrote the past: emit the tail
                prefix_text = new_text[:len(prefix_text)]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return new_text[len(prefix_text):]
        return ""
