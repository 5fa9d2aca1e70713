"""Structured outputs: a JSON Schema, a regular expression or a grammar constrains every token.

llguidance (the `structured` extra; what llama.cpp and vLLM use) compiles the constraint and, at each
step, gives the set of tokens that keep the output inside it. The mask is applied to the float32 logits
row in one fixed way (every token outside the set to -inf) and the sampler runs as for any request
(greedy ties to the lower id, the draw keyed by seed and position), so a constrained request is as
deterministic as any other: the mask depends only on the tokens chosen so far. Decoding takes one
token a step (no fast-forwarded tokens), so batching, chunked prefill, the prefix cache and
speculation see an ordinary sequence.

The llguidance tokenizer is built from tinydet's own vocabulary: each token's bytes (GGUF files),
control tokens marked as llguidance expects (a 0xFF byte before the name), or the `tokenizers`
vocabulary of a Hugging Face directory.
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .errors import TinydetError
from .tokenizer.spm import SPIECE_UNDERLINE

KINDS = ("json_schema", "regex", "grammar")
# Between JSON tokens: nothing, a space, or a newline and up to 20 spaces or tabs of indentation (as
# llama.cpp's schema grammars allow). Any whitespace would let a model write blank lines until
# max_tokens. A schema's own "x-guidance" options take precedence.
JSON_DEFAULTS = {"whitespace_pattern": r"(\x20|\x0A[\x20\x09]{0,20})"}
_CACHE_SIZE = 64  # compiled constraints kept, by (tokenizer, kind, source): a server sees the same schemas


class ConstraintError(TinydetError):
    """A constraint that cannot be used: "KIND: WHY"; `why` alone for a caller that names the field
    itself (the server names the request's)."""

    def __init__(self, kind: str, why: str):
        super().__init__(f"{kind}: {why}")
        self.why = why


def available() -> bool:
    """Whether llguidance (the structured extra) is installed."""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401
    except ImportError:
        raise TinydetError("structured outputs (json_schema, regex, grammar) need the structured extra: "
                           "pip install 'tinydet[structured]'") from None
    return llguidance


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads from a tokenizer: each token's bytes, the special ids,
    BOS/EOS, and a call that tokenizes text (used only for text a grammar forces)."""

    def __init__(self, tok, n_vocab: int):
        self.eos_token_id = tok.eos_ids[0] if tok.eos_ids else None
        self.bos_token_id = tok.bos_id
        tokens = []
        for i in range(n_vocab):
            b = tok._pieces[i] if i < tok.vocab_size else b""
            if i < tok.vocab_size and (not b or i in tok._skip):  # control and unknown tokens: no text
                b = b"\xff" + (tok.id_to_token(i) or f"<[{i}]>").encode("utf-8")
            tokens.append(b)
        self.tokens = tokens
        self.special_token_ids = [i for i, b in enumerate(tokens) if b[:1] == b"\xff"]
        self._tok = tok

    def __call__(self, text):
        if not isinstance(text, str):
            raise TypeError("text")  # llguidance then passes str
        if self._tok._spm is not None:  # without the space prefix `encode` puts at the start
            return self._tok._spm.encode(text.replace(" ", SPIECE_UNDERLINE))
        return self._tok.encode(text, add_special=False)


class _Compiled:
    """Per tinydet tokenizer: llguidance's tokenizer and the constraints compiled for it (the latest
    _CACHE_SIZE, by kind and text)."""

    def __init__(self, llt, n_vocab: int, n_bits: int):
        self.llt, self.n_vocab, self.n_bits = llt, n_vocab, n_bits  # n_bits: llguidance's vocabulary
        self.constraints: OrderedDict = OrderedDict()


_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _compiled(tok, n_vocab: int) -> _Compiled:
    """llguidance's tokenizer for tinydet tokenizer `tok` over `n_vocab` logits (built once per tokenizer:
    about 0.1 s for 49,152 tokens)."""
    llg = _llguidance()
    with _LOCK:
        got = _TOKENIZERS.get(tok)
        if got is not None and got.n_vocab == n_vocab:
            return got
        n = max(n_vocab, tok.vocab_size)
        eos = list(tok.eos_ids)
        if tok._pieces is not None:
            llt = llg.LLTokenizer(llg.TokenizerWrapper(_Vocabulary(tok, n)), n_vocab=n, eos_token=eos)
        else:
            llt = llg.LLTokenizer(tok.hf.to_str(), n_vocab=n, eos_token=eos)
        got = _TOKENIZERS[tok] = _Compiled(llt, n_vocab, n)
        return got


def _one_line(message: str) -> str:
    """llguidance's error (several lines, with a caret under the place) as one line."""
    parts = [p.strip() for p in str(message).splitlines()]
    text = " ".join(p for p in parts if p and set(p) != {"^"})
    return text if len(text) <= 400 else text[:397] + "..."


INT_LIMIT = 1 << 62  # llguidance 1.9 crashes the process on an integer near -2^63 (in enum and const)


def _check_integers(value, where: str) -> None:
    """Refuse integers a schema holds beyond +-INT_LIMIT, naming where."""
    if isinstance(value, int) and not isinstance(value, bool) and not -INT_LIMIT < value < INT_LIMIT:
        raise ConstraintError("json_schema", f"{value} at {where or 'the top'}: integers beyond +-2^62 are not supported")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        _check_integers(v, f"{where}[{k}]" if isinstance(k, int) else f"{where}.{k}" if where else k)


def _source(kind: str, value) -> str:
    """The constraint's text: a schema as compact JSON (from a dict or JSON text), a regex or grammar as given."""
    if kind == "json_schema":
        if isinstance(value, (str, bytes)):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ConstraintError("json_schema", f"not JSON ({e})") from None
            except RecursionError:
                raise ConstraintError("json_schema", "not JSON (nested too deeply)") from None
        if isinstance(value, bool):
            value = {} if value else {"not": {}}
        if not isinstance(value, dict):
            raise ConstraintError("json_schema", f"expected a JSON object (a schema), found {repr(value)[:40]}")
        try:
            _check_integers(value, "")
        except RecursionError:
            raise ConstraintError("json_schema", "nested too deeply") from None
        try:
            # keys in the schema's order: llguidance writes properties in that order
            return json.dumps(value, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ConstraintError("json_schema", f"not JSON-serializable ({e})") from None
        except RecursionError:
            raise ConstraintError("json_schema", "nested too deeply") from None
    if not isinstance(value, str):
        raise ConstraintError(kind, f"expected a string, found {repr(value)[:40]}")
    return value


def check_schema_text(text) -> None:
    """A schema's text parses as a JSON object (checked before a model loads; compiled after)."""
    _source("json_schema", text)


def _grammar(llg, kind: str, source: str) -> str:
    if kind == "json_schema":
        try:
            return llg.LLMatcher.grammar_from_json_schema(source, defaults=JSON_DEFAULTS)
        except ValueError as e:
            raise ConstraintError("json_schema", _one_line(e)) from None
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(source)
    if "::=" in source:  # GBNF, llama.cpp's grammar format
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            source = gbnf_to_lark(source)
        except Exception as e:  # noqa: BLE001 - the converter raises what its parser meets
            raise ConstraintError("grammar", f"not a valid GBNF grammar ({_one_line(e)})") from None
    return llg.LLMatcher.grammar_from_lark(source)


@dataclass(frozen=True, eq=False)
class Constraint:
    """A compiled constraint, shared by the requests that use it: `matcher()` starts one's state."""

    kind: str
    source: str
    n_bits: int  # tokens in llguidance's masks (the logits' and the tokenizer's, the larger)
    eos_ids: tuple
    _template: object  # an LLMatcher at the start, copied for each request

    @property
    def sha256(self) -> str:
        return hashlib.sha256(f"{self.kind}\0{self.source}".encode("utf-8")).hexdigest()

    def describe(self) -> dict:
        """For settings and logs: the kind and the SHA-256 of its text (a schema can be large)."""
        return {"kind": self.kind, "sha256": self.sha256}

    def matcher(self) -> "Matcher":
        return Matcher(self._template.deep_copy(), self.n_bits, self.eos_ids)


def constraint(tok, n_vocab: int, json_schema=None, regex=None, grammar=None) -> Constraint | None:
    """The constraint of at most one of `json_schema` (a dict or JSON text), `regex` or `grammar`
    (llguidance's Lark syntax, or llama.cpp's GBNF), compiled for tokenizer `tok` and `n_vocab` logits;
    None when none is given. A constraint that does not compile is a one-line TinydetError naming it."""
    given = [(k, v) for k, v in zip(KINDS, (json_schema, regex, grammar)) if v is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ConstraintError(" and ".join(k for k, _ in given), "give one constraint, not several")
    kind, value = given[0]
    source = _source(kind, value)
    llg = _llguidance()
    cache = _compiled(tok, n_vocab)
    with _LOCK:
        c = cache.constraints.get((kind, source))
        if c is not None:
            cache.constraints.move_to_end((kind, source))
            return c
    m = llg.LLMatcher(cache.llt, _grammar(llg, kind, source), log_level=0)
    if m.is_error():
        raise ConstraintError(kind, _one_line(m.get_error()))
    c = Constraint(kind, source, cache.n_bits, tuple(tok.eos_ids), m)
    with _LOCK:
        cache.constraints[(kind, source)] = c
        while len(cache.constraints) > _CACHE_SIZE:
            cache.constraints.popitem(last=False)
    return c


class Matcher:
    """One request's place in its constraint: `mask(row)` the logits row with every token outside the
    constraint at -inf, `consume(tok)` the token chosen from it."""

    def __init__(self, m, n_bits: int, eos_ids: tuple):
        import llguidance.numpy as lln

        self._fill = lln.fill_next_token_bitmask
        self._m = m
        self._eos = list(eos_ids)
        self._bits = np.empty((n_bits + 31) // 32, np.int32)

    def mask(self, row: np.ndarray) -> np.ndarray:
        self._fill(self._m, self._bits.reshape(1, -1))
        allowed = np.unpackbits(self._bits.view(np.uint8), count=row.shape[0], bitorder="little").view(bool)
        if not allowed.any():  # a state nothing can follow (llguidance's error state): end the output
            allowed[self._eos] = True
        return np.where(allowed, row, np.float32(-np.inf)).astype(np.float32, copy=False)

    def consume(self, tok: int) -> None:
        # Only a token the mask allowed reaches here; llguidance keeps an error state, never raises.
        self._m.consume_token(int(tok))

    @property
    def complete(self) -> bool:
        """Whether the output so far is a whole match (JSON that parses, a regex's full match)."""
        return self._m.is_accepting() or self._m.is_stopped()
