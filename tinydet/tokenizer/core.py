"""The `Tokenizer` class: text <-> token ids for one model.

Control, unknown and user-defined tokens (types 3, 2, 4) are matched whole in the input text, as
llama.cpp does with ``parse_special`` and as HF does with added tokens.

Decoding concatenates per-token bytes (control and unknown tokens skipped, byte tokens as their byte,
"▁" as a space, byte-level pieces mapped back to bytes; see `gguf._gguf_pieces`), strips the one
leading space SentencePiece added, and decodes UTF-8 with U+FFFD for invalid bytes.
"""

from __future__ import annotations

import operator
import re
import threading
from collections.abc import Callable, Iterable, Sequence

import tokenizers
from tokenizers import processors

from ..errors import TinydetError
from . import gguf
from .spm import _SPM, SPIECE_UNDERLINE
from .stream import StreamDecoder

_C_SPACE = " \t\n\v\f\r"  # what C's isspace() accepts (llama.cpp strips these, HF any Unicode space)


class TokenInputError(TinydetError, ValueError):
    """Text or token ids a tokenizer cannot take. A ValueError too, as these were before they were
    TinydetErrors: callers that catch ValueError keep working."""


class TokenTypeError(TinydetError, TypeError):
    """Text that is not a str, or a token id that is not an integer (also a TypeError, as before)."""


class Tokenizer:
    """Text <-> token ids for one model. Build with `from_gguf_metadata` or `from_hf`."""

    vocab_size: int
    bos_id: int | None
    eos_ids: tuple[int, ...]
    add_bos: bool
    add_eos: bool

    def __init__(self):
        # Filled in by the constructors below.
        self._hf: tokenizers.Tokenizer | None = None
        self._hf_build: Callable[[], tokenizers.Tokenizer] | None = None  # makes `hf` on first use
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
        self._rstrip: frozenset[int] = frozenset()  # special tokens that swallow the whitespace after them
        self._pieces: gguf._Pieces | None = None  # per-token decoded bytes (GGUF vocabularies)
        self._skip: frozenset[int] = frozenset()

    _HF_LOCK = threading.Lock()  # one build of a lazy `hf`, whichever thread asks first

    @property
    def hf(self) -> tokenizers.Tokenizer:
        """The vocabulary as a `tokenizers.Tokenizer` (with BOS/EOS added as `encode` adds them). A
        SentencePiece GGUF vocabulary builds it on first use, not at load: `encode` and `decode` do
        not use it, and it is the largest part of such a tokenizer (Gemma 3: ~120 MiB, 3 s)."""
        if self._hf_build is not None:
            with self._HF_LOCK:
                if self._hf_build is not None:  # another thread may have built it meanwhile
                    self._hf = self._hf_build()
                    self._set_post_processor()
                    self._hf_build = None  # only now: other threads wait for the whole of it
        return self._hf

    @hf.setter
    def hf(self, value: tokenizers.Tokenizer) -> None:
        self._hf, self._hf_build = value, None

    def id_to_token(self, i: int) -> str | None:
        """The vocabulary's text of token i (as `hf.id_to_token`; None outside the vocabulary),
        without building a lazy `hf`."""
        if self._spm is not None:
            return self._spm.token(i) if 0 <= i < len(self._spm.tokens) else None
        return self.hf.id_to_token(i)

    # -- construction ------------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, metadata: dict, path) -> Tokenizer:
        """Build from a GGUF file's metadata (`GGUFFile(path).metadata`); `path` is for messages only."""
        return gguf.from_metadata(cls, metadata, path)

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
        """Make `hf.encode(text)` add BOS/EOS the way `encode` does (on `_hf`: a lazy `hf` calls this
        while it is being built)."""
        single, special = "$A", []
        if self.add_bos:
            bos = self._hf.id_to_token(self.bos_id)
            single = f"{bos} {single}"
            special.append((bos, self.bos_id))
        if self.add_eos:
            eos = self._hf.id_to_token(self.eos_id)
            single = f"{single} {eos}"
            if self.eos_id != self.bos_id or not self.add_bos:
                special.append((eos, self.eos_id))
        try:
            self._hf.post_processor = processors.TemplateProcessing(single=single, special_tokens=special)
        except Exception:  # noqa: BLE001 - a token text the template syntax cannot hold: leave hf as is
            self._hf.post_processor = None

    # -- encoding ----------------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids for `text`; BOS/EOS added per `add_bos`/`add_eos` when `add_special`. Special
        tokens written in the text (e.g. "<|im_start|>") become their ids."""
        if not isinstance(text, str):
            raise TokenTypeError(f"text must be str, not {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate ("\ud800"): no UTF-8, no tokens
            raise TokenInputError(f"text is not valid Unicode: {e.reason} at position {e.start}") from None
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
        while (mt := self._special_re.search(text, pos)) is not None:
            if mt.start() > pos:
                yield text[pos:mt.start()], None
            tid = self._special_ids[mt.group()]
            yield "", tid
            pos = mt.end()
            if tid in self._rstrip:  # llama.cpp's RSTRIP: C isspace() on the bytes that follow
                while pos < len(text) and text[pos] in _C_SPACE:
                    pos += 1
        if pos < len(text):
            yield text[pos:], None

    # -- decoding ----------------------------------------------------------------------------------

    def _check_id(self, i) -> int:
        # operator.index, not int(): int() would take 1.5 as token 1 and "7" as token 7.
        if isinstance(i, bool):
            raise TokenTypeError(f"token ids must be integers, found {i!r}")
        try:
            j = operator.index(i)
        except TypeError:
            raise TokenTypeError(f"token ids must be integers, found {str(repr(i))[:40]}") from None
        if not 0 <= j < self.vocab_size:
            raise TokenInputError(f"token id {j} is outside the vocabulary (0..{self.vocab_size - 1})")
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

    def token_bytes(self, i: int) -> bytes:
        """One token's own bytes as text would contain them (a SentencePiece token keeps its leading
        space); a control token with no text gives its name, so a log-probability can say which it was."""
        i = self._check_id(i)
        if self._pieces is not None:
            b = self._pieces[i]
        else:
            b = self.hf.decode([i], skip_special_tokens=False).encode("utf-8")
        return b or (self.id_to_token(i) or "").encode("utf-8")

    def stream(self, prefix: Sequence[int] = ()) -> StreamDecoder:
        """An incremental decoder. Text it emits continues `decode(prefix)`: with the default (empty)
        prefix the first piece loses SentencePiece's leading space, as `decode` does; pass the
        prompt's ids to decode a continuation of that prompt."""
        return StreamDecoder(self, prefix)
