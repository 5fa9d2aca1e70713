"""Generation, layered: `generate_step` yields (token, logits row); `stream_generate` yields
`Response` pieces of text; `generate` returns a finished `Generation`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from .errors import ContextLengthError, TinydetError
from .hashing import hash_ids, hash_logits
from .backends import Backend
from .sampling import SamplingParams, sample


def check_context(n_prompt: int, max_tokens: int, context_length: int) -> None:
    if n_prompt > context_length:
        raise ContextLengthError(
            f"prompt: {n_prompt} tokens do not fit in the model's context of {context_length} tokens")
    if n_prompt + max_tokens > context_length:
        raise ContextLengthError(
            f"max_tokens: {n_prompt} prompt tokens + {max_tokens} new tokens exceed the model's context of "
            f"{context_length} tokens (at most {context_length - n_prompt} new tokens fit)")


def generate_step(model: Backend, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int
                  ) -> Iterator[tuple[int, np.ndarray]]:
    """Yield (token id, the float32 logits row that chose it) for up to `max_tokens` tokens.
    The caller decides when to stop; nothing is computed past the last token taken."""
    if max_tokens < 1:
        raise TinydetError(f"max_tokens: expected at least 1, found {max_tokens}")
    n = len(prompt_ids)
    if n == 0:
        raise TinydetError("prompt: no tokens to start from")
    check_context(n, max_tokens, model.config.context_length)
    cache = model.new_cache(n + max_tokens)
    logits = model.forward(prompt_ids, cache)[0]
    for step in range(max_tokens):
        tok = sample(logits, params, n + step)
        yield tok, logits
        if step + 1 < max_tokens:
            logits = model.forward([tok], cache)[0]


@dataclass
class Response:
    """One step of a stream: the text it completed (maybe empty), its token and logits row."""
    text: str
    token: int | None
    logits: np.ndarray | None
    finish_reason: str | None = None


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    output_hash: str  # SHA-256 of token_ids as int32 LE
    logits_hash: str  # SHA-256 of the float32 logits rows that chose token_ids
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    settings: dict = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        n = len(self.token_ids) - 1  # the first token comes out of the prefill
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0


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
    and keeps what the result needs. Solo and batched generation share it, so they finish alike."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int,
                 stop: Sequence[str] = ()):
        if max_tokens < 1:
            raise TinydetError(f"max_tokens: expected at least 1, found {max_tokens}")
        self.prompt_ids = list(prompt_ids)
        self.params, self.max_tokens = params, max_tokens
        self.stops = [s for s in (stop or ()) if s]
        self.eos = set(tokenizer.eos_ids)
        self.decoder = tokenizer.stream(self.prompt_ids)  # text continues the prompt (SentencePiece spaces)
        self.text, self.emitted = "", 0
        self.ids: list[int] = []
        self.rows: list[np.ndarray] = []
        self.finish_reason: str | None = None

    @property
    def position(self) -> int:
        """Position of the next token to sample (the RNG's counter)."""
        return len(self.prompt_ids) + len(self.ids)

    def _end(self, tok, row, piece, reason) -> Response:
        self.finish_reason = reason
        return Response(piece, tok, row, reason)

    def push(self, tok: int, row: np.ndarray) -> Response:
        self.ids.append(tok)
        self.rows.append(row)
        if tok in self.eos:
            self.text += self.decoder.flush()
            return self._end(tok, row, self.text[self.emitted:], "stop")
        last = len(self.ids) == self.max_tokens
        self.text += self.decoder.push(tok)
        if last:
            self.text += self.decoder.flush()
        for s in self.stops:
            i = self.text.find(s, max(0, self.emitted - len(s)))
            if i >= 0:
                self.text = self.text[:i]
                return self._end(tok, row, self.text[self.emitted:] if i > self.emitted else "", "stop")
        if last:
            return self._end(tok, row, self.text[self.emitted:], "length")
        upto = len(self.text) - _stop_holdback(self.text, self.stops)
        piece = self.text[self.emitted:upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return Response(piece, tok, row)

    def result(self, prefill_seconds: float = 0.0, decode_seconds: float = 0.0) -> Generation:
        return Generation(
            text=self.text, token_ids=list(self.ids), prompt_token_ids=list(self.prompt_ids),
            finish_reason=self.finish_reason or "length", output_hash=hash_ids(self.ids),
            logits_hash=hash_logits(self.rows), prefill_seconds=prefill_seconds, decode_seconds=decode_seconds)


def stream_generate(model: Backend, tokenizer, prompt_ids: Sequence[int], params: SamplingParams,
                    max_tokens: int, stop: Sequence[str] = (), state: "SequenceState | None" = None) -> Iterator[Response]:
    """Yield `Response`s as tokens are produced; text never splits a UTF-8 character, and text that
    could be the start of a stop string is held back until it is known not to be one. The last
    response carries `finish_reason`. A token that ends generation (EOS) is yielded with empty text."""
    seq = state or SequenceState(tokenizer, prompt_ids, params, max_tokens, stop)
    for tok, row in generate_step(model, prompt_ids, params, max_tokens):
        r = seq.push(tok, row)
        yield r
        if r.finish_reason:
            return


def generate(model: Backend, tokenizer, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int,
             stop: Sequence[str] = ()) -> Generation:
    seq = SequenceState(tokenizer, prompt_ids, params, max_tokens, stop)
    t0 = time.perf_counter()
    t_first = None
    for _ in stream_generate(model, tokenizer, prompt_ids, params, max_tokens, stop, state=seq):
        if t_first is None:
            t_first = time.perf_counter()
    t1 = time.perf_counter()
    return seq.result((t_first or t1) - t0, t1 - (t_first or t1))


@dataclass
class Request:
    """One request of a batch: its prompt ids and its own settings."""
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 256
    stop: Sequence[str] = ()


def generate_batch(model: Backend, tokenizer, requests: Sequence[Request], max_batch: int = 8) -> list[Generation]:
    """Continuous batching: up to `max_batch` sequences share each forward pass (a joining request's
    whole prompt and the running ones' last tokens); a finished sequence leaves at once and the next
    waiting request takes its slot. Each result is bit-identical to that request generated alone."""
    if max_batch < 1:
        raise TinydetError(f"max_batch: expected at least 1, found {max_batch}")
    for i, r in enumerate(requests):
        if not r.prompt_ids:
            raise TinydetError(f"requests[{i}].prompt: no tokens to start from")
        check_context(len(r.prompt_ids), r.max_tokens, model.config.context_length)
    if not requests:
        return []
    capacity = max(len(r.prompt_ids) + r.max_tokens for r in requests)
    n_slots = min(max_batch, len(requests))
    cache = model.new_cache(capacity, n_slots)
    waiting = list(range(len(requests)))[::-1]
    free = list(range(n_slots))[::-1]
    running: dict[int, tuple[int, SequenceState]] = {}  # slot -> (request index, state)
    results: list[Generation | None] = [None] * len(requests)
    while waiting or running:
        items = []
        while waiting and free:
            idx, slot = waiting.pop(), free.pop()
            r = requests[idx]
            cache.reset(slot)
            running[slot] = (idx, SequenceState(tokenizer, r.prompt_ids, r.params, r.max_tokens, r.stop))
            items.append((slot, r.prompt_ids))
        joined = {slot for slot, _ in items}
        items += [(slot, [seq.ids[-1]]) for slot, (_, seq) in running.items() if slot not in joined]
        logits = model.forward_batch(items, cache)
        for (slot, _), row in zip(items, logits):
            idx, seq = running[slot]
            tok = sample(row[0], seq.params, seq.position)
            if seq.push(tok, row[0]).finish_reason:
                results[idx] = seq.result()
                del running[slot]
                free.append(slot)
    return results


