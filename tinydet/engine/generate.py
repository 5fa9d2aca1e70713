"""Solo, streamed and batched generation: each a loop over the step-wise engine."""

from __future__ import annotations

from typing import Iterator, Sequence

from ..backends import Backend
from ..errors import TinydetError
from .scheduler import Engine
from .sequence import Event, Generation, Request, check_request


def _solo(backend: Backend, tokenizer, request: Request, speculative=None) -> tuple[Engine, object]:
    check_request(request, backend.config.context_length)
    engine = Engine(backend, tokenizer, max_batch=1, capacity=len(request.prompt_ids) + request.max_tokens,
                    speculative=speculative)
    return engine, engine.submit(request)


def stream(backend: Backend, tokenizer, request: Request, speculative=None) -> Iterator[Event]:
    """Yield the request's events as each step produces them; the last carries the finish reason and
    the result. `speculative`: a drafter (`speculate.py`) or None; the same events either way."""
    engine, handle = _solo(backend, tokenizer, request, speculative)
    while not handle.finished:
        yield from engine.step()
    if handle.error is not None:  # the request failed inside the engine (say, NaN logits): no last event
        raise handle.error


def generate(backend: Backend, tokenizer, request: Request, speculative=None) -> Generation:
    engine, handle = _solo(backend, tokenizer, request, speculative)
    engine.run()
    return handle.wait()  # the engine's error if the request failed (its result is None then)


def generate_batch(backend: Backend, tokenizer, requests: Sequence[Request], max_batch: int = 8,
                   step_tokens: int | None = None, speculative=None) -> list[Generation]:
    """Continuous batching: up to `max_batch` sequences share each forward pass (joining prompts,
    whole or under a budget of `step_tokens` tokens a step, and the running ones' last tokens); a
    finished sequence leaves at once and the next waiting request takes its slot. Each result is
    bit-identical to that request generated alone."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise TinydetError(f"max_batch: expected at least 1, found {max_batch!r}")
    for i, r in enumerate(requests):
        check_request(r, backend.config.context_length, f"requests[{i}].")
    if not requests:
        return []
    engine = Engine(backend, tokenizer, max_batch=min(max_batch, len(requests)), step_tokens=step_tokens,
                    capacity=max(len(r.prompt_ids) + r.max_tokens for r in requests), speculative=speculative)
    handles = [engine.submit(r) for r in requests]
    engine.run()
    return [h.wait() for h in handles]  # the first failed request's error, as generate() would raise
