"""A request's choices on the engine, and its answer: one JSON body once every choice has finished,
or SSE (`data: {...}` events, then `data: [DONE]`) as tokens arrive.

Each choice is one engine request. Its events reach the event loop through a listener the engine
thread calls; the listener also turns logits rows into log-probabilities there, so rows never cross.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from starlette.requests import ClientDisconnect, Request as HTTPRequest
from starlette.responses import Response, StreamingResponse

from ..engine import Request
from ..hashing import hash_ids
from ..logprobs import token_logprobs
from .protocol import APIError, _dumps, _json
from .service import Service


@dataclass
class _Job:
    """One choice: the engine request and what its answer needs."""

    index: int
    request: Request
    prompt_text: str
    top: int | None  # log-probabilities wanted: None = none, else that many alternatives
    echo: bool = False
    drop_token: bool = False  # max_tokens 0 with echo: the one token run is not part of the answer
    # filled from events:
    text: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[tuple] = field(default_factory=list)  # (token, logprob, alternatives) per token
    prompt_logprobs: list[tuple] = field(default_factory=list)
    result: object = None
    offset: int = 0  # characters streamed so far (completions' text_offset)
    # a chat answer read back (tools or a thinking template): its parser, fed in order on the loop
    parser: object = None  # chat.parse.ChatParser or None (the text is the content)
    deltas: list = field(default_factory=list)  # what the last message completed, for its chunk
    history: list = field(default_factory=list)  # every delta in order (the Responses API's items)
    reasoning_tokens: int = 0

    def feed(self, text: str, tok: int | None, final: bool) -> None:
        if self.parser is None:
            return
        p = self.parser
        self.deltas = []
        if tok is not None or text:
            if p.state in ("start", "think") and p.think is not None:
                self.reasoning_tokens += tok is not None  # a token read while reasoning
            self.deltas = p.feed(text, tok)
        if final:
            self.deltas += p.finish()
        self.history += self.deltas


class _Listener:
    """Runs on the engine thread: turns one choice's events into small messages on the loop's queue."""

    def __init__(self, runner: Runner, job: _Job, queue: asyncio.Queue, loop, t_arrival: float):
        self.runner, self.job, self.queue, self.loop = runner, job, queue, loop
        self.t_arrival, self.t_prev = t_arrival, None

    def __call__(self, handle, ev) -> None:
        try:
            msg = self._message(handle, ev)
        except Exception as e:  # noqa: BLE001 - the request fails with it (500), the engine goes on
            handle.cancel()
            msg = ("error", self.job.index, e)
        self.loop.call_soon_threadsafe(self.queue.put_nowait, msg)

    def _message(self, handle, ev) -> tuple:
        job, m = self.job, self.runner.service.metrics
        if ev is None:
            msg = ("error", job.index, handle.error)
        elif ev.prompt_scores is not None:
            msg = ("prompt", job.index, ev.prompt_scores)
        else:
            now = time.perf_counter()
            if ev.token is not None:
                m.generation_tokens.inc()
                if self.t_prev is None:
                    m.ttft.observe(now - self.t_arrival)
                else:
                    m.itl.observe(now - self.t_prev)
                self.t_prev = now
            lp = None
            if ev.token is not None and job.top is not None and not job.drop_token:
                lp = (ev.token, *token_logprobs(ev.logits, ev.token, job.top))
            if ev.result is not None:
                m.e2e.observe(now - self.t_arrival)
                m.queue_time.observe(ev.result.queue_seconds)
                if ev.finish_reason != "cancelled":
                    m.finished.labels(ev.finish_reason).inc()
            msg = ("token", job.index, (ev.text, ev.token, lp, ev.finish_reason, ev.result))
        return msg


class Runner:
    """Submits requests' jobs to the service and answers them; ends them all at a shutdown."""

    def __init__(self, service: Service):
        self.service = service
        self._running: set[asyncio.Queue] = set()  # the message queues of requests being answered

    def end_running(self, message: str) -> None:
        """End every request being answered with `message` as a 503 (in a stream: an error event, then
        [DONE]); the engine stops their work. On the event loop, when a shutdown's grace runs out."""
        for queue in self._running:
            queue.put_nowait(("shutdown", -1, message))

    async def run(self, req: HTTPRequest, body, jobs: list[_Job], seed: int, render_chunk, render_final,
                  frame=None, done: str = "data: [DONE]\n\n"):
        """Submit the jobs and answer: a JSON body, or SSE chunks as tokens arrive (each chunk written
        by `frame`, OpenAI's `data:` line unless given; `done` ends the stream)."""
        frame = frame or (lambda chunk: f"data: {_dumps(chunk)}\n\n")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        t_arrival = req.state.t_arrival
        listeners = [_Listener(self, j, queue, loop, t_arrival) for j in jobs]
        handles = self.service.submit([j.request for j in jobs], listeners)
        self._running.add(queue)
        req.state.log["prompt_tokens"] = [len(j.request.prompt_ids) for j in jobs[::body.n]]
        live = {j.index for j in jobs}
        by_index = {j.index: j for j in jobs}

        def cancel_all():
            for h in handles:
                if not h.finished:
                    h.cancel()

        async def next_message(poll: bool):
            while True:
                try:
                    return await asyncio.wait_for(queue.get(), 0.5 if poll else None)
                except asyncio.TimeoutError:
                    if await req.is_disconnected():
                        raise ClientDisconnect() from None

        def take(msg) -> tuple[_Job, tuple | None]:
            """Record a message on its job: (the job, the token message's data, or None for prompt rows)."""
            kind, index, data = msg
            if kind == "shutdown":
                raise APIError(503, data, type="server_error", code="server_shutdown")
            job = by_index[index]
            if kind == "error":
                raise APIError(500, f"the engine failed on this request: {type(data).__name__}: {data}",
                               type="server_error", code="engine_error")
            if kind == "prompt":
                job.prompt_logprobs.extend(data)
                return job, None
            text, tok, lp, reason, result = data
            if tok is not None and not job.drop_token:
                job.tokens.append(tok)
                job.text.append(text)
                if lp is not None:
                    job.logprobs.append(lp)
            if not job.drop_token:
                job.feed(text, tok, reason is not None)
            if reason is not None:
                job.result = result
                live.discard(index)
            return job, data

        # Streaming waits for the first message only before answering, so a request that fails at
        # once gets its error status rather than a 200 stream.
        streaming = False
        try:
            first = take(await next_message(poll=True))
            while live and not body.stream:
                take(await next_message(poll=True))
            streaming = body.stream
        except ClientDisconnect:
            cancel_all()
            req.state.log["disconnected"] = True
            return Response(status_code=499)
        except BaseException:
            cancel_all()
            raise
        finally:
            if not streaming:  # a stream's queue stays until the stream ends (events())
                self._running.discard(queue)
        if not body.stream:
            self._log_choices(req, jobs)
            return _json(render_final(jobs, seed))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events():
            started, failed = set(), False
            try:
                job, data = first
                while True:
                    if data is not None:  # a token message (prompt rows have no chunk of their own)
                        for chunk in render_chunk(job, data, started, seed, include_usage):
                            yield frame(chunk)
                    if not live:
                        break
                    try:
                        job, data = take(await next_message(poll=False))
                    except APIError as e:  # after the 200: the error goes into the stream
                        yield frame(e.body())
                        req.state.log.update(error=e.message, outcome="error")
                        failed = True
                        live.clear()
                        break
                if not failed:
                    if include_usage:
                        yield frame(render_final(jobs, seed, usage_only=True))
                    self._log_choices(req, jobs)
                if done:
                    yield done
            finally:  # the client left (or the stream ended): nothing of this request runs on
                if live:
                    req.state.log["disconnected"] = True
                cancel_all()
                self._running.discard(queue)
                req.state.log_done()

        req.state.log_deferred = True
        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def _log_choices(self, req: HTTPRequest, jobs: list[_Job]) -> None:
        req.state.log["choices"] = [
            {"finish_reason": j.result.finish_reason, "completion_tokens": len(j.tokens),
             "output_hash": j.result.output_hash, "logits_hash": j.result.logits_hash,
             "prompt_hash": hash_ids(j.request.prompt_ids), "cached_tokens": j.result.cached_tokens,
             "seed": j.request.params.seed, "queue_ms": round(1e3 * j.result.queue_seconds, 3),
             "prefill_ms": round(1e3 * j.result.prefill_seconds, 3),
             "decode_ms": round(1e3 * j.result.decode_seconds, 3),
             "compile_ms": round(1e3 * j.result.compile_seconds, 3),
             **({"draft_tokens": j.result.draft_tokens, "draft_accepted": j.result.draft_accepted,
                 "decode_passes": j.result.decode_passes} if j.result.draft_tokens else {})} for j in jobs]
