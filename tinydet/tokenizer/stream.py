"""Streaming detokenization: `StreamDecoder` does what `Tokenizer.decode` does, incrementally, and
never emits half a character."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Protocol


class _Vocabulary(Protocol):
    """What a decoder reads of its `Tokenizer` (core.py's, which makes decoders: not imported back)."""

    add_space_prefix: bool
    _pieces: Sequence[bytes] | None

    def _check_id(self, i: int) -> int: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class StreamDecoder:
    """Incremental detokenizer: `push` returns the text completed by one more token (possibly ""),
    never half a UTF-8 character; `flush` returns what is left. The concatenation of everything
    returned equals `Tokenizer.decode` of the pushed ids (after `prefix`, see `Tokenizer.stream`)."""

    def __init__(self, tokenizer: _Vocabulary, prefix: Sequence[int] = ()):
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
