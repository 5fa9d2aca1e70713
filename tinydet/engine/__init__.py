"""The step-wise engine and what it works with: `sequence.py` (Request, SequenceState, Event,
Generation), `scheduler.py` (Engine: submit / step / cancel), `plan.py` (what a step runs: chunked
prefill under a token budget, speculative proposals), `generate.py` (solo, streamed and batched
generation as loops over it), `prefix.py` (keys and values of prompt prefixes kept for later
requests), `speculate.py` (drafters for speculative decoding that changes no bit)."""

from .generate import generate, generate_batch, stream
from .scheduler import Engine, Handle
from .sequence import Event, Generation, Request, SequenceState, check_context

__all__ = ["Engine", "Handle", "Request", "Event", "Generation", "SequenceState", "check_context", "generate",
           "generate_batch", "stream"]
