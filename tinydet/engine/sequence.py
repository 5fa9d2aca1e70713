"""One request's life: what it asks for (`Request`), its text state while tokens arrive
(`SequenceState`: detokenization, EOS, stop strings), what each step yields (`Event`) and what it
ends as (`Generation`). Solo, batched and served generation share these, so they finish alike."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..errors import ContextLengthError, TinydetError
from ..hashing import hash_ids
from ..logprobs import MAX_TOP
from ..sampling import SamplingParams, check_int, sample

FINISH_REASONS = ("stop", "length", "cancelled")


@dataclass
class Request:
    """A prompt's token ids and its own settings. `logits`: each event carries the float32 logits row
    that chose its token (for logprobs; rows are large, so off by default)."""

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 256
    stop: Sequence[str] = ()
    logits: bool = False
    prompt_logits: bool = False  # also the rows that predict the prompt's own tokens
    constraint: object = None  # a `structured.Constraint` every token keeps to, or None
    # Also each prompt token's score (echo logprobs): (token, log p, this many alternatives) for tokens
    # 1, 2, ..., from the prefix cache where it kept them. None: not scored.
    prompt_logprobs: int | None = None


@dataclass
class Event:
    """What one step produced for one request: the text it completed (maybe empty), its token, the
    logits row that chose it (when the request asked), and on the last event the finish reason and
    the request's result. A request with `prompt_logits` also gets events with no token whose
    `prompt_rows` are the rows predicting its prompt tokens 1, 2, ... in order, a chunk at a time; one
    with `prompt_logprobs` gets `prompt_scores`, those tokens' (token, logprob, alternatives)."""

    request_id: int
    text: str
    token: int | None
    logits: np.ndarray | None = None
    finish_reason: str | None = None
    result: "Generation | None" = None
    prompt_rows: np.ndarray | None = None
    prompt_scores: list | None = None


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string), "length", or "cancelled"
    output_hash: str  # SHA-256 of token_ids as int32 LE
    logits_hash: str  # SHA-256 of the float32 logits rows that chose token_ids
    prefill_seconds: float = 0.0  # from admission to the first token, less compile_seconds' part there
    decode_seconds: float = 0.0  # from the first token to the last, less compile_seconds' part there
    queue_seconds: float = 0.0
    compile_seconds: float = 0.0  # numba compiling or loading kernels meanwhile (a first call: `backends.compiletime`)
    settings: dict = field(default_factory=dict)
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache
    draft_tokens: int = 0  # tokens a speculative drafter proposed (`speculate.py`)
    draft_accepted: int = 0  # of them, those the model chose too and kept
    message: object = None  # a chat answer read back (`chat.parse.ChatMessage`: reasoning, content, calls)

    @property
    def decode_passes(self) -> int:
        """Forward passes that chose tokens after the first: each takes one token of its own, plus the
        proposals it accepted."""
        return max(len(self.token_ids) - 1 - self.draft_accepted, 0)

    @property
    def acceptance_rate(self) -> float:
        return self.draft_accepted / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Tokens after the first per decoding pass (1.0 without speculation)."""
        return (len(self.token_ids) - 1) / self.decode_passes if self.decode_passes else 0.0

    @property
    def tokens_per_second(self) -> float:
        n = len(self.token_ids) - 1  # the first token comes out of the prefill
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0


def check_context(n_prompt: int, max_tokens: int, context_length: int) -> None:
    if n_prompt > context_length:
        raise ContextLengthError(
            f"prompt: {n_prompt} tokens do not fit in the model's context of {context_length} tokens")
    if n_prompt + max_tokens > context_length:
        raise ContextLengthError(
            f"max_tokens: {n_prompt} prompt tokens + {max_tokens} new tokens exceed the model's context of "
            f"{context_length} tokens (at most {context_length - n_prompt} new tokens fit)")


def check_stop(stop, name: str = "stop") -> tuple[str, ...]:
    """Stop strings as a tuple: None is none, a str is one stop string (not its characters)."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, Sequence) and not isinstance(stop, (bytes, bytearray)):
        if all(isinstance(s, str) for s in stop):
            return tuple(stop)
    raise TinydetError(f"{name}: expected a string or a list of strings, found {repr(stop)[:40]}")


def check_request(r: Request, context_length: int, where: str = "") -> None:
    """Raise TinydetError (naming `where`'s fields) unless the request can run."""
    if not r.prompt_ids:
        raise TinydetError(f"{where}prompt: no tokens to start from")
    check_int(f"{where}max_tokens", r.max_tokens, 1, what="an integer >= 1")
    check_stop(r.stop, f"{where}stop")
    if r.prompt_logprobs is not None:
        check_int(f"{where}prompt_logprobs", r.prompt_logprobs, 0, MAX_TOP + 1, f"0 to {MAX_TOP}")
    check_context(len(r.prompt_ids), r.max_tokens, context_length)


def _stop_holdback(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that could still grow into a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class SequenceState:
    """One request's text state: turns sampled tokens into text pieces, applies EOS and stop strings,
    and keeps what the result needs (the ids, a running hash of the logits rows)."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int,
                 stop: Sequence[str] = (), constraint=None):
        if max_tokens < 1:
            raise TinydetError(f"max_tokens: expected at least 1, found {max_tokens}")
        self.prompt_ids = list(prompt_ids)
        self.params, self.max_tokens = params, max_tokens
        self.stops = [s for s in check_stop(stop) if s]
        self.eos = set(tokenizer.eos_ids)
        self.decoder = tokenizer.stream(self.prompt_ids)  # text continues the prompt (SentencePiece spaces)
        self.text, self.emitted = "", 0
        self.ids: list[int] = []
        self._rows = hashlib.sha256()  # hashing.hash_logits, one row at a time
        self.finish_reason: str | None = None
        self.drafted = self.accepted = 0  # speculation's counts (Generation's draft_*)
        self.matcher = constraint.matcher() if constraint is not None else None

    def choose(self, row: np.ndarray, ahead: int = 0) -> tuple[int, np.ndarray]:
        """The token sampled from `row` for the position `ahead` past the next, and the row it was
        sampled from: under a constraint, the row masked by it (the constraint then takes the token, so
        rows ahead are chosen in order, each after the one before is taken)."""
        if self.matcher is not None:
            row = self.matcher.mask(row)
        tok = sample(row, self.params, self.position + ahead)
        if self.matcher is not None:
            self.matcher.consume(tok)
        return tok, row

    @property
    def position(self) -> int:
        """Position of the next token to sample (the RNG's counter)."""
        return len(self.prompt_ids) + len(self.ids)

    def _end(self, piece: str, reason: str) -> tuple[str, str]:
        self.finish_reason = reason
        return piece, reason

    def push(self, tok: int, row: np.ndarray) -> tuple[str, str | None]:
        """Take the token sampled from `row`: (the text it completes, the finish reason or None).
        Text never splits a UTF-8 character, and text that could be the start of a stop string is
        held back until it is known not to be one. A token that ends generation (EOS) adds no text."""
        self.ids.append(tok)
        self._rows.update(np.ascontiguousarray(row, dtype="<f4").data)
        if tok in self.eos:
            self.text += self.decoder.flush()
            return self._end(self.text[self.emitted:], "stop")
        last = len(self.ids) == self.max_tokens
        self.text += self.decoder.push(tok)
        if last:
            self.text += self.decoder.flush()
        for s in self.stops:
            i = self.text.find(s, max(0, self.emitted - len(s)))
            if i >= 0:
                self.text = self.text[:i]
                return self._end(self.text[self.emitted:] if i > self.emitted else "", "stop")
        if last:
            return self._end(self.text[self.emitted:], "length")
        upto = len(self.text) - _stop_holdback(self.text, self.stops)
        piece = self.text[self.emitted:upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return piece, None

    def cancel(self) -> str:
        """End here: the text not yet emitted (held back for stop strings) is given out."""
        self.text += self.decoder.flush()
        return self._end(self.text[self.emitted:], "cancelled")[0]

    def result(self, prefill_seconds: float = 0.0, decode_seconds: float = 0.0, queue_seconds: float = 0.0,
               compile_seconds: float = 0.0) -> Generation:
        return Generation(
            text=self.text, token_ids=list(self.ids), prompt_token_ids=list(self.prompt_ids),
            finish_reason=self.finish_reason or "length", output_hash=hash_ids(self.ids),
            logits_hash=self._rows.hexdigest(), prefill_seconds=prefill_seconds, decode_seconds=decode_seconds,
            queue_seconds=queue_seconds, compile_seconds=compile_seconds, draft_tokens=self.drafted,
            draft_accepted=self.accepted)
