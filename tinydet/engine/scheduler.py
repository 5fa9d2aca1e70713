"""The step-wise engine: `submit(request) -> Handle`, `step()`, `cancel(handle)`.

One `step()` is one forward pass over every live sequence: each running sequence's last token, plus
the prompts of joining requests, whole or in chunks under a per-step token budget (`step_tokens`).
A request gets a KV-cache slot when it is admitted and gives it back when it finishes, so requests
join and leave at any step. Its tokens are sampled from its own logits rows at its own positions, and
the backend's rows do not depend on what else shares a pass or how a prompt was chunked, so every
request's result is bit-identical to the same request generated alone.

A step decides, executes, then applies (as vLLM's scheduler, model runner and `update_from_output`):
it ends cancelled requests, admits waiting ones and plans the pass (`plan.plan_step`, a `StepPlan`);
grows the cache and runs the backend's pass; then advances each sequence by its rows.

Threads: `submit` and `cancel` may be called from any thread; `step` (or `serve`, a loop of steps for
a background thread) from one thread at a time. Each handle's events arrive in order on a queue its
owner can block on.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from typing import Callable, Iterator

from ..backends import Backend
from ..backends.compiletime import compile_seconds
from ..errors import TinydetError
from ..logprobs import token_logprobs
from .plan import StepPlan, plan_step
from .prefix import SCORED_TOP, PrefixCache, block_keys
from .sequence import Event, Generation, Request, SequenceState, check_request
from .speculate import make_drafter


class Handle:
    """A submitted request: its events as they are produced, then its result."""

    def __init__(self, engine: "Engine", request: Request, request_id: int,
                 listener: Callable[["Handle", Event | None], None] | None = None):
        self.engine, self.request, self.id = engine, request, request_id
        # SimpleQueue: its put is C code with no Python between taking and releasing its lock, so an
        # interrupt (Ctrl-C, SIGTERM's exception) cannot leave the lock held and `_fail` waiting on it.
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._done = threading.Event()
        self.result: Generation | None = None  # set when it finishes
        self.keys: list[bytes] | None = None  # its prompt's full blocks' chain keys (`Engine._keys`)
        self.error: BaseException | None = None  # set when the engine failed while it ran
        self.listener = listener

    def _put(self, ev: Event | None) -> None:
        """Deliver an event (None: the request failed, `error` says why) to the queue and listener."""
        self._events.put(ev)
        if self.listener is not None:
            try:
                self.listener(self, ev)
            except Exception:  # a listener that cannot take events (its client left) ends its request
                self.listener = None
                self.engine.cancel(self)

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """Yield this request's events in order until its last one (blocking; `timeout` seconds at
        most per event, then TimeoutError). Raises the engine's error if it failed meanwhile."""
        while True:
            try:
                ev = self._events.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"request {self.id}: no event within {timeout} s") from None
            if ev is None:  # the engine failed
                raise self.error
            yield ev
            if ev.finish_reason is not None:
                return

    def wait(self, timeout: float | None = None) -> Generation:
        """Block until finished; the result."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id}: not finished within {timeout} s")
        if self.error is not None:
            raise self.error
        return self.result

    def cancel(self) -> None:
        self.engine.cancel(self)


class _Running:
    __slots__ = ("handle", "state", "slot", "fed", "cached", "t_submit", "t_admit", "t_first", "c_admit", "c_first",
                 "k", "scores")

    def __init__(self, handle: Handle, state: SequenceState, slot: int, t_submit: float, cached: int, k=None):
        self.handle, self.state, self.slot = handle, state, slot
        self.fed = self.cached = cached  # fed: prompt tokens in the cache; cached: from the prefix cache
        self.t_submit, self.t_admit, self.t_first = t_submit, time.perf_counter(), None
        self.c_admit, self.c_first = compile_seconds(), None  # the compile clock at admission, at the first token
        self.k = k  # the drafter's DraftLength, or None
        self.scores: list | None = None  # with prompt_logprobs: (logprob, alternatives) of prompt tokens 1, 2, ...


class Engine:
    """Continuous batching over one backend: up to `max_batch` sequences in flight, KV-cache slots
    reused as sequences finish, prompts prefilled under a budget of `step_tokens` tokens per step
    (None: a joining prompt goes in whole). The cache grows as sequences get longer (up to the
    model's context length); `capacity` presizes it. `prefix_cache_bytes` > 0 keeps the keys and values of
    prompts (and of what was generated after them) for later requests that start the same way
    (`prefix.PrefixCache`); the counters in `stats` say how much prefill it saved. `speculative` ("ngram"
    or a drafter, `speculate.py`) has decoding sequences check proposed tokens in their passes, with
    the same results."""

    def __init__(self, backend: Backend, tokenizer, max_batch: int = 8, step_tokens: int | None = None,
                 capacity: int = 0, prefix_cache_bytes: int = 0, speculative=None):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise TinydetError(f"max_batch: expected at least 1, found {max_batch!r}")
        if step_tokens is not None and (isinstance(step_tokens, bool) or not isinstance(step_tokens, int)
                                        or step_tokens < 1):
            raise TinydetError(f"step_tokens: expected a positive integer or None, found {step_tokens!r}")
        self.backend, self.tokenizer = backend, tokenizer
        self.max_batch, self.step_tokens = max_batch, step_tokens
        self.cache = backend.new_cache(max(1, min(capacity, backend.config.context_length)), max_batch)
        self._lock = threading.Condition()
        self._waiting: deque[tuple[Handle, float]] = deque()
        self._cancelled: set[int] = set()
        self._running: dict[int, _Running] = {}  # slot -> sequence, in admission order
        self._free = list(range(max_batch))[::-1]
        self._ids = itertools.count(1)
        self._step_lock = threading.Lock()
        self.prefix = PrefixCache(prefix_cache_bytes)
        self.drafter = make_drafter(speculative)
        self.stats = dict(steps=0, prompt_tokens_computed=0, draft_tokens=0, draft_accepted=0)

    # -- any thread -------------------------------------------------------------------------------

    def submit(self, request: Request, listener: Callable[[Handle, Event | None], None] | None = None) -> Handle:
        """Queue a request (checked now: a bad one raises TinydetError and is not queued).
        `listener(handle, event)` is called on the engine thread with each event as it is produced
        (None when the request failed: `handle.error` says why); it must be quick. If it raises, the
        request is cancelled."""
        check_request(request, self.backend.config.context_length)
        with self._lock:
            h = Handle(self, request, next(self._ids), listener)
            self._waiting.append((h, time.perf_counter()))
            self._lock.notify_all()
        return h

    def cancel(self, handle: Handle) -> None:
        """Stop a request at the next step; its last event has finish_reason "cancelled"."""
        with self._lock:
            if not handle.finished:
                self._cancelled.add(handle.id)
                self._lock.notify_all()

    @property
    def idle(self) -> bool:
        """Nothing waiting and nothing running."""
        with self._lock:
            return not self._waiting and not self._running

    @property
    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        with self._lock:
            return len(self._running), len(self._waiting)

    def wake(self) -> None:
        """Interrupt `serve`'s wait for work (its stop event was set)."""
        with self._lock:
            self._lock.notify_all()

    # -- the engine thread ------------------------------------------------------------------------

    def step(self) -> list[Event]:
        """One forward pass over every live sequence; returns the events it produced (each also
        delivered to its handle). A step with nothing to do returns []."""
        with self._step_lock:
            try:
                return self._step()
            except BaseException as e:
                self._fail(e)
                raise

    def run(self) -> None:
        """Step until idle."""
        while not self.idle:
            self.step()

    def serve(self, stop: threading.Event, poll: float = 0.05) -> None:
        """Step while there is work, wait for work otherwise, until `stop` is set (for a thread)."""
        while not stop.is_set():
            with self._lock:
                if not self._waiting and not self._running:
                    self._lock.wait(poll)
                    continue
            self.step()

    def _state(self, r: Request) -> SequenceState:
        return SequenceState(self.tokenizer, r.prompt_ids, r.params, r.max_tokens, r.stop, r.constraint)

    def _finish(self, seq: _Running, events: list[Event], ev: Event) -> None:
        now, c_now = time.perf_counter(), compile_seconds()
        t_first, c_first = (seq.t_first, seq.c_first) if seq.t_first is not None else (now, c_now)
        # numba compiling (or loading kernels from its cache) on a first call is counted apart
        prefill_c, decode_c = c_first - seq.c_admit, c_now - c_first
        g = seq.state.result(max(t_first - seq.t_admit - prefill_c, 0.0), max(now - t_first - decode_c, 0.0),
                             seq.t_admit - seq.t_submit, prefill_c + decode_c)
        g.cached_tokens = seq.cached
        seq.handle.result = ev.result = g
        self._release(seq)
        self._emit(seq.handle, events, ev)
        seq.handle._done.set()

    def _release(self, seq: _Running, keep: bool = True) -> None:
        """The slot goes back; what it holds is offered to the prefix cache first (`keep`)."""
        if keep:
            self.prefix.store(self.cache, seq.slot, seq.state.prompt_ids + seq.state.ids,
                              int(self.cache.lengths[seq.slot]))
        del self._running[seq.slot]
        self._free.append(seq.slot)

    def _emit(self, handle: Handle, events: list[Event], ev: Event) -> None:
        events.append(ev)
        handle._put(ev)

    def _step(self) -> list[Event]:
        """Decide (cancel, admit, plan the pass), execute the plan, apply its rows."""
        events: list[Event] = []
        with self._lock:
            self._cancel(events)
            self._admit(events)
        if not self._running:
            return events
        plan = plan_step(list(self._running.values()), self.cache.lengths, self.step_tokens,
                         self.backend.config.context_length, self.drafter)
        logits = self._execute(plan)
        self._apply(plan, logits, events)
        return events

    def _cancel(self, events: list[Event]) -> None:
        """End the requests cancelled since the last step, waiting or running (with the lock held)."""
        cancelled, self._cancelled = self._cancelled, set()
        kept = deque()
        for h, t in self._waiting:
            if h.id in cancelled:  # never admitted: no tokens, no text
                state = self._state(h.request)
                state.cancel()
                h.result = state.result()
                self._emit(h, events, Event(h.id, "", None, None, "cancelled", h.result))
                h._done.set()
            else:
                kept.append((h, t))
        self._waiting = kept
        for seq in [s for s in self._running.values() if s.handle.id in cancelled]:
            self._finish(seq, events, Event(seq.handle.id, seq.state.cancel(), None, None, "cancelled"))

    def _admit(self, events: list[Event]) -> None:
        """Give free slots to waiting requests (`_next_admitted`), each starting from what the prefix
        cache holds of its prompt (with the lock held)."""
        while self._free:
            i = self._next_admitted()
            if i is None:
                break
            h, t_submit = self._waiting[i]
            del self._waiting[i]
            r = h.request
            slot = self._free.pop()
            self.cache.reset(slot)
            # At least the prompt's last token is computed: its logits row picks the first token.
            scored = r.prompt_logprobs is not None
            cached, scores = (0, []) if r.prompt_logits else self.prefix.load(
                self.cache, slot, r.prompt_ids, len(r.prompt_ids) - 1, scored)
            if scored and cached:  # the last cached position runs again: its row scores the next token
                cached -= 1
            self.cache.lengths[slot] = cached
            seq = self._running[slot] = _Running(h, self._state(r), slot, t_submit, cached,
                                                 self.drafter.length() if self.drafter else None)
            if scored:
                seq.scores = scores[1:]
                if seq.scores:
                    self._emit(h, events, Event(h.id, "", None, prompt_scores=self._scored(r, 1, seq.scores)))

    def _execute(self, plan: StepPlan) -> list:
        """Run the plan's pass; each item's logits rows (None for a chunk that wants none)."""
        self.stats["prompt_tokens_computed"] += plan.prompt_tokens
        # The cache grows (doubling, up to the context) as sequences reach its end, not when they are
        # admitted: a request's max_tokens is a limit, not a reservation in every slot.
        if plan.need > self.cache.capacity:
            self.cache.grow(max(plan.need, min(2 * self.cache.capacity, self.backend.config.context_length)))
        logits = self.backend.forward_batch(list(plan.items), self.cache)
        self.stats["steps"] += 1
        return logits

    def _apply(self, plan: StepPlan, logits: list, events: list[Event]) -> None:
        """Advance each sequence of the plan by its rows, in the plan's order. A sequence's own failure
        (say, NaN logits) ends its request alone: the others go on."""
        for s, n, draft, rows in zip(plan.seqs, plan.fed, plan.drafts, logits):
            s.fed += n
            try:
                self._advance(s, rows, draft, events)
            except Exception as e:
                with self._lock:
                    self._release(s, keep=False)
                    s.handle.error = e
                    s.handle._put(None)
                    s.handle._done.set()

    def _next_admitted(self) -> int | None:
        """The index in the queue of the first request to admit: the first whose prompt does not
        continue, past what the prefix cache holds, a prompt being prefilled now. Those wait for it to
        be cached (the choices of a multiple-choice question, sent together, compute their shared
        context once); their results do not depend on it, only their cost."""
        if not self._waiting:
            return None
        if not self.prefix.max_bytes:
            return 0
        prefilling = [(self._keys(s.handle), s.scores is not None) for s in self._running.values()
                      if s.fed < len(s.state.prompt_ids)]
        for i, (h, _) in enumerate(self._waiting):
            r = h.request
            if r.prompt_logits:
                return i
            scored = r.prompt_logprobs is not None
            keys = self._keys(h)[:(len(r.prompt_ids) - 1) // self.cache.block]  # as many as `load` may take
            n = self.prefix.held(keys, scored)
            if n == len(keys) or not any(len(k) > n and k[n] == keys[n] and (has or not scored)
                                         for k, has in prefilling):
                return i
        return None

    def _keys(self, h: Handle) -> list[bytes]:
        """The chain keys of the full blocks of h's prompt, computed once (a waiting request is looked
        at every step)."""
        if h.keys is None:
            ids = h.request.prompt_ids
            h.keys = block_keys(ids, self.cache.block, len(ids) // self.cache.block)
        return h.keys

    def _advance(self, s: _Running, rows, draft: tuple[int, ...], events: list[Event]) -> None:
        """Take one sequence's logits rows from a pass (over its last token and the proposals `draft`,
        if any): sample its next tokens, or just note a chunk."""
        if rows is None:  # a prompt chunk that does not end the prompt
            return
        if draft:
            self._accept(s, rows, draft, events)
            return
        done = not s.state.ids and s.fed == len(s.state.prompt_ids)  # the pass that ended the prompt
        r = s.handle.request
        if (r.prompt_logits or s.scores is not None) and not s.state.ids:
            # Each row predicts the next prompt token, except the prompt's last, which picks the first new one.
            predicting = rows[:-1] if done else rows
            if predicting.shape[0]:
                ev = Event(s.handle.id, "", None, prompt_rows=predicting if r.prompt_logits else None)
                if s.scores is not None:
                    first = len(s.scores) + 1
                    new = [token_logprobs(row, r.prompt_ids[first + i], SCORED_TOP) for i, row in enumerate(predicting)]
                    s.scores += new
                    ev.prompt_scores = self._scored(r, first, new)
                with self._lock:
                    self._emit(s.handle, events, ev)
            if not done:
                return
        tok, row = s.state.choose(rows[-1])
        if s.t_first is None:
            s.t_first, s.c_first = time.perf_counter(), compile_seconds()
        if done:
            self.prefix.store(self.cache, s.slot, s.state.prompt_ids, len(s.state.prompt_ids),
                              None if s.scores is None else [None] + s.scores)
        self._take(s, tok, row, events)

    @staticmethod
    def _scored(r: Request, first: int, scores: list) -> list:
        """(token, logprob, the request's number of alternatives) of prompt tokens first, first + 1, ..."""
        k = r.prompt_logprobs
        return [(r.prompt_ids[first + i], lp, alts[:k]) for i, (lp, alts) in enumerate(scores)]

    def _take(self, s: _Running, tok: int, row, events: list[Event]) -> bool:
        """Push the sequence's token chosen from `row` and deliver its event; True if it finished."""
        piece, reason = s.state.push(tok, row)
        ev = Event(s.handle.id, piece, tok, row if s.handle.request.logits else None, reason)
        with self._lock:
            if reason is not None:
                self._finish(s, events, ev)
                return True
            self._emit(s.handle, events, ev)
        return False

    def _accept(self, s: _Running, rows, draft: tuple[int, ...], events: list[Event]) -> None:
        """A pass over the last token and the proposals: at each row the sequence's own token, taken
        while it equals the proposal there, then the one that differs; the cache keeps the positions
        of the tokens taken before the last (the last goes in with the next pass, as in plain decoding)."""
        start = int(self.cache.lengths[s.slot]) - len(draft) - 1  # the last token's position
        toks, chosen_from = [], []
        for i, row in enumerate(rows):
            tok, row = s.state.choose(row, i)
            toks.append(tok)
            chosen_from.append(row)
            if i == len(draft) or tok != draft[i]:
                break
        s.k.update(len(draft), len(toks) - 1)
        s.state.drafted += len(draft)
        self.stats["draft_tokens"] += len(draft)
        for i, tok in enumerate(toks):
            self.cache.lengths[s.slot] = start + i + 1
            if i:  # a proposal taken into the output (one that a stop leaves unused does not count)
                s.state.accepted += 1
                self.stats["draft_accepted"] += 1
            if self._take(s, tok, chosen_from[i], events):
                return

    def _fail(self, e: BaseException) -> None:
        """The pass raised: every live request ends with the error (their handles re-raise it)."""
        with self._lock:
            handles = [s.handle for s in self._running.values()] + [h for h, _ in self._waiting]
            self._running.clear()
            self._waiting.clear()
            self._free = list(range(self.max_batch))[::-1]
            for h in handles:
                h.error = e
                h._put(None)
                h._done.set()
