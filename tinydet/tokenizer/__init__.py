"""Tokenizers built from GGUF metadata or a Hugging Face directory, plus streaming detokenization.

Two vocabulary kinds are supported, each following llama.cpp (src/llama-vocab.cpp):

* ``tokenizer.ggml.model = llama``: SentencePiece BPE (`spm`).
* ``tokenizer.ggml.model = gpt2``: byte-level BPE over the file's merges, with the pre-tokenizer
  regexes llama.cpp uses for ``tokenizer.ggml.pre`` (`bpe`).

The modules, each importing only those after it: `hf` (a Hugging Face directory's tokenizer.json and
tokenizer_config.json), `core` (the `Tokenizer` class: encoding, decoding), `gguf` (building a
`Tokenizer` from GGUF metadata), `spm`, `bpe`, `stream` (`StreamDecoder`).
"""

from __future__ import annotations

from .bpe import PRE_TOKENIZERS  # noqa: F401
from .core import Tokenizer
from .gguf import (  # noqa: F401
    NULL_TOKEN_ID, TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_UNUSED, TOKEN_USER_DEFINED)
from .spm import SPIECE_UNDERLINE  # noqa: F401
from .stream import StreamDecoder

__all__ = ["Tokenizer", "StreamDecoder", "NULL_TOKEN_ID"]
