"""Building a `Tokenizer` from a GGUF file's tokenizer metadata (``tokenizer.ggml.*``), as llama.cpp's
llama_vocab::impl::load (src/llama-vocab.cpp) reads it.

Two vocabulary kinds are supported: ``tokenizer.ggml.model = llama`` (SentencePiece BPE, see `spm`)
and ``tokenizer.ggml.model = gpt2`` (byte-level BPE over the file's merges, see `bpe`). Control,
unknown and user-defined tokens (types 3, 2, 4) become the `tokenizers.Tokenizer`'s added tokens, and
each token's decoded bytes are computed once here (`_gguf_pieces`).

Memory: a vocabulary is held once. One token -> id dict serves the duplicate check, the lookups
here and a byte-level vocabulary's `tokenizers` model; a SentencePiece vocabulary keeps it as UTF-8
bytes (`spm._SPM`), so the metadata's strings go with the metadata. Scores are one float64 array,
the decoded pieces one buffer (`_Pieces`). A SentencePiece vocabulary's `tokenizers.Tokenizer`
(``Tokenizer.hf``) is built on first use only: encoding and decoding do not need it, and for Gemma 3's
262,144 tokens its merges and maps take about 120 MiB and 2.5 s.
"""

from __future__ import annotations

import functools
import re
import warnings
from array import array
from typing import Any, Iterable, Iterator, TypeVar

import numpy as np
from tokenizers import AddedToken

from ..errors import ModelFormatError
from .bpe import _CHAR_TO_BYTE, PRE_TOKENIZERS, hf_byte_level
from .spm import _BYTE_TOKEN_RE, _SPM, SPIECE_UNDERLINE, hf_spm

# The `Tokenizer` class filled in (core.py's, which calls in here: this module does not import it back).
T = TypeVar("T")

# A special-token id of 0xFFFFFFFF (uint32 -1) means "none" in GGUF files.
NULL_TOKEN_ID = 0xFFFFFFFF

# llama.cpp token types (tokenizer.ggml.token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
_KNOWN_TYPES = (0, 1, 2, 3, 4, 5, 6)  # 0 = undefined


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
            # stacklevel: token_id, from_metadata, Tokenizer.from_gguf_metadata, then its caller.
            warnings.warn(f"{self.path}: {key}: token id {v} is outside the vocabulary (0..{n_vocab - 1}); ignored",
                          stacklevel=4)
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
# The vocabulary


# The token texts llama.cpp's llama_vocab::impl::load adds to its end-of-generation set whatever the
# metadata says (src/llama-vocab.cpp at the llama.cpp of llama-cpp-python 0.3.36).
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
             "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
             "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
             "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[")

# ... and its fill-in-the-middle pad, repo and file-separator tokens (the metadata's, else found by text).
FIM_EOG_TEXTS = {"pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
                 "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
                 "sep": ("<|file_sep|>",)}


def from_metadata(cls: type[T], metadata: dict, path) -> T:
    """`Tokenizer.from_gguf_metadata`: check `metadata`, then fill in a `cls()`."""
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
    # One float64 per token, not a Python float object (2 MiB, not 8, for 262,144 tokens); reading it
    # gives the Python float that float(x) gave.
    scores = array("d", (np.zeros(n) if scores_arr is None else np.asarray(scores_arr, np.float64)).tobytes())
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
    # Generation also ends on the tokens llama.cpp takes as end-of-generation by their text, so a chat
    # stops where llama.cpp's does (Llama 3's <|eot_id|>, Gemma's <end_of_turn>, Phi-3's <|end|>).
    eog = {seen[t] for t in EOG_TEXTS if t in seen}
    for fim_kind, texts in FIM_EOG_TEXTS.items():  # and on the first fill-in-the-middle pad/repo/separator
        fim = m.token_id(f"tokenizer.ggml.fim_{fim_kind}_token_id", n, None)
        found = [seen[t] for t in texts if t in seen]
        if fim is not None or found:
            eog.add(fim if fim is not None else min(found))
    eog = sorted(eog)
    tok.eos_ids = tuple(dict.fromkeys([*(i for i in (tok.eos_id, eot, eom) if i is not None), *eog]))

    if spm:
        pre = None
        add_bos_default = True
        tok.add_space_prefix = m.flag("tokenizer.ggml.add_space_prefix", True)
    else:
        pre = m.string("tokenizer.ggml.pre")
        if pre is None:
            # stacklevel: from_metadata, Tokenizer.from_gguf_metadata, then its caller.
            warnings.warn(f"{path}: tokenizer.ggml.pre is missing; using llama.cpp's 'default' "
                          "pre-tokenizer", stacklevel=3)
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

    vocab = seen  # every token -> its id, in id order: built once (262,144 entries: 14 MiB with the ids)
    rstrip = _rstrip_ids(metadata.get("general.name"), vocab, specials + user_defined)
    tok._rstrip = rstrip
    if spm:
        tok._spm = _SPM(vocab, scores, tok.unk_id)
        # Built on first use of tok.hf (the module docstring), from _spm: not from the metadata, whose
        # strings can then go.
        tok._hf_build = functools.partial(_spm_hf, path, tok._spm, tok.unk_id, tok.add_space_prefix,
                                          specials, user_defined, rstrip)
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
        tok.hf = _with_added_tokens(path, hf_byte_level(vocab, merges, PRE_TOKENIZERS[pre]), tokens, specials,
                                    user_defined, rstrip)
        tok._set_post_processor()
    tok._pieces = _Pieces(_gguf_pieces(tokens, types, spm))
    tok._skip = frozenset(i for i, t in enumerate(types) if t in (TOKEN_CONTROL, TOKEN_UNKNOWN)) | frozenset(
        i for i in (tok.bos_id, *tok.eos_ids) if i is not None)
    return tok


def _with_added_tokens(path, hf, tokens: list[str], specials: list[int], user_defined: list[int],
                       rstrip: frozenset[int]):
    """`hf` with the control and unknown tokens as special added tokens and the user-defined ones as
    added tokens (matched whole in the text)."""
    if specials:
        hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False, rstrip=i in rstrip)
                               for i in specials])
    if user_defined:
        hf.add_tokens([AddedToken(tokens[i], special=False, normalized=False, rstrip=i in rstrip)
                       for i in user_defined])
    if hf.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ModelFormatError(path, "tokenizer.ggml.tokens", "the special tokens do not map onto the vocabulary")
    return hf


def _spm_hf(path, spm: _SPM, unk_id, add_space_prefix, specials, user_defined, rstrip):
    """A SentencePiece vocabulary's `tokenizers.Tokenizer` (`spm.hf_spm`, plus its added tokens)."""
    tokens = [spm.token(i) for i in range(len(spm.tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    return _with_added_tokens(path, hf_spm(tokens, spm.scores, vocab, unk_id, add_space_prefix), tokens,
                              specials, user_defined, rstrip)


def _rstrip_ids(name, vocab: dict[str, int], matched: list[int]) -> frozenset[int]:
    """The tokens that swallow the whitespace after them in the text, as llama.cpp's
    llama_vocab::impl::load sets LLAMA_TOKEN_ATTR_RSTRIP by the file's general.name: where it contains
    "phi-3" or "phi3" (any case), every token matched in the text (control, unknown, user-defined) and
    "</s>", but "<unk>", "<s>" and "<|endoftext|>" (what Phi-3's tokenizer.json says with rstrip: true;
    its chat template's "<|user|>" and the newline after it give the one token). No other model gets
    such attributes here."""
    if not isinstance(name, str) or not any(s in name.lower() for s in ("phi-3", "phi3")):
        return frozenset()
    ids = set(matched) | ({vocab["</s>"]} if "</s>" in vocab else set())
    return frozenset(ids - {vocab.get(t) for t in ("<unk>", "<s>", "<|endoftext|>")})


class _Pieces:
    """Each token's decoded bytes, all in one buffer: piece i (0 <= i < len) is data[ends[i]:ends[i + 1]].
    A list of 262,144 bytes objects (Gemma 3's vocabulary) takes 12 MiB; this takes 4."""

    __slots__ = ("_data", "_ends")

    def __init__(self, pieces: Iterable[bytes]):
        data, ends = bytearray(), array("q", [0])
        for b in pieces:
            data += b
            ends.append(len(data))
        self._data, self._ends = bytes(data), ends

    def __len__(self) -> int:
        return len(self._ends) - 1

    def __getitem__(self, i: int) -> bytes:
        return self._data[self._ends[i]:self._ends[i + 1]]


# Byte-level text to bytes with one str.translate: each of the 256 byte-level characters to the
# character of its byte (latin-1), every other character below 256 to one latin-1 cannot encode, so
# that a token with any character outside the alphabet fails to encode, as a per-character lookup did.
_BYTE_LEVEL = {**{i: "\uffff" for i in range(256)}, **{ord(c): chr(b) for c, b in _CHAR_TO_BYTE.items()}}


def _gguf_pieces(tokens: list[str], types: list[int], spm: bool) -> Iterator[bytes]:
    """Bytes each token contributes to decoded text, as llama.cpp's token_to_piece(special=false):
    control, unknown, unused and undefined tokens give nothing; user-defined tokens their text.
    Yielded one by one, into `_Pieces`: a list of them would be a transient of 262,144 objects."""
    for t, ty in zip(tokens, types):
        if ty == TOKEN_USER_DEFINED:
            yield t.encode("utf-8")
        elif ty == TOKEN_NORMAL:
            if spm:
                yield t.replace(SPIECE_UNDERLINE, " ").encode("utf-8")
            else:
                try:
                    b = t.translate(_BYTE_LEVEL).encode("latin-1")
                except UnicodeEncodeError:  # not byte-level text: take it as written
                    b = t.encode("utf-8")
                yield b
        elif ty == TOKEN_BYTE and spm:
            mt = _BYTE_TOKEN_RE.fullmatch(t)
            yield bytes([int(mt.group(1), 16)]) if mt else b""
        else:
            yield b""
