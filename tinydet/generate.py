"""Generation, layered: `generate_step` yields (token, logits row); `stream_generate` yields
`Response` pieces of text; `generate` returns a finished `Generation`."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from .errors import ContextLengthError, TinydetError
from .model import Transformer
from .sampling import SamplingParams, sample


def hash_ids(ids: Sequence[int]) -> str:
    """SHA-256 of token ids as int32 little-endian."""
    return hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest()


def hash_logits(rows: Sequence[np.ndarray]) -> str:
    """SHA-256 of float32 little-endian logits rows, in order."""
    h = hashlib.sha256()
    for r in rows:
        h.update(np.ascontiguousarray(r, dtype="<f4").tobytes())
    return h.hexdigest()


def check_context(n_prompt: int, max_tokens: int, context_length: int) -> None:
    if n_prompt > context_length:
        raise ContextLengthError(
            f"prompt: {n_prompt} tokens do not fit in the model's context of {context_length} tokens")
    if n_prompt + max_tokens > context_length:
        raise ContextLengthError(
            f"max_tokens: {n_prompt} prompt tokens + {max_tokens} new tokens exceed the model's context of "
            f"{context_length} tokens (at most {context_length - n_prompt} new tokens fit)")


def generate_step(model: Transformer, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int,
                  threads: int | None = None) -> Iterator[tuple[int, np.ndarray]]:
    """Yield (token id, the float32 logits row that chose it) for up to `max_tokens` tokens.
    The caller decides when to stop; nothing is computed past the last token taken."""
    if max_tokens < 1:
        raise TinydetError(f"max_tokens: expected at least 1, found {max_tokens}")
    n = len(prompt_ids)
    if n == 0:
        raise TinydetError("prompt: no tokens to start from")
    check_context(n, max_tokens, model.cfg.context_length)
    cache = model.new_cache(n + max_tokens)
    logits = model.forward(prompt_ids, cache, threads=threads)[0]
    for step in range(max_tokens):
        tok = sample(logits, params, n + step)
        yield tok, logits
        if step + 1 < max_tokens:
            logits = model.forward([tok], cache, threads=threads)[0]


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


def stream_generate(model: Transformer, tokenizer, prompt_ids: Sequence[int], params: SamplingParams,
                    max_tokens: int, stop: Sequence[str] = (), threads: int | None = None) -> Iterator[Response]:
    """Yield `Response`s as tokens are produced; text never splits a UTF-8 character, and text that
    could be the start of a stop string is held back until it is known not to be one. The last
    response carries `finish_reason`. A token that ends generation (EOS) is yielded with empty text."""
    stops = [s for s in (stop or ()) if s]
    eos = set(tokenizer.eos_ids)
    decoder = tokenizer.stream(prompt_ids)  # text continues the prompt (SentencePiece spaces)
    text, emitted = "", 0
    steps = generate_step(model, prompt_ids, params, max_tokens, threads)
    taken = 0
    for tok, row in steps:
        taken += 1
        if tok in eos:
            text += decoder.flush()
            yield Response(text[emitted:], tok, row, "stop")
            return
        text += decoder.push(tok)
        if taken == max_tokens:
            text += decoder.flush()
        for s in stops:
            i = text.find(s, max(0, emitted - len(s)))
            if i >= 0:
                text = text[:i]
                yield Response(text[emitted:] if i > emitted else "", tok, row, "stop")
                return
        if taken == max_tokens:
            yield Response(text[emitted:], tok, row, "length")
            return
        upto = len(text) - _stop_holdback(text, stops)
        piece = text[emitted:upto] if upto > emitted else ""
        emitted = max(emitted, upto)
        yield Response(piece, tok, row)


def generate(model: Transformer, tokenizer, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int,
             stop: Sequence[str] = (), threads: int | None = None) -> Generation:
    ids: list[int] = []
    rows: list[np.ndarray] = []
    parts: list[str] = []
    finish = "length"
    t0 = time.perf_counter()
    t_first = None
    for r in stream_generate(model, tokenizer, prompt_ids, params, max_tokens, stop, threads):
        if t_first is None:
            t_first = time.perf_counter()
        ids.append(r.token)
        rows.append(r.logits)
        parts.append(r.text)
        if r.finish_reason:
            finish = r.finish_reason
    t1 = time.perf_counter()
    return Generation(
        text="".join(parts), token_ids=ids, prompt_token_ids=list(prompt_ids), finish_reason=finish,
        output_hash=hash_ids(ids), logits_hash=hash_logits(rows),
        prefill_seconds=(t_first or t1) - t0, decode_seconds=t1 - (t_first or t1),
    )
