"""The HTTP side of `tinydet serve`: OpenAI's API on Starlette. Its routes check a request (key, model,
fingerprint, context), make its choices engine jobs and answer through `streaming.py` in the shapes of
`responses.py`; it never computes. The middleware writes errors in OpenAI's shape and counts and logs
each request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import secrets
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response
from starlette.routing import Route

from ..errors import ContextLengthError, TinydetError
from . import chat_tools, responses_api
from .chat_tools import compile_constraint
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, _json,
                       parse, read_body)
from .responses import Answers
from .service import Service
from .streaming import Runner, _Job

OUTCOMES = {200: "success", 400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "bad_request",
            409: "fingerprint_mismatch", 413: "bad_request", 429: "overloaded", 500: "error", 503: "unavailable"}


class _App:
    def __init__(self, service: Service):
        self.service = service
        self.runner = Runner(service)  # answers requests, ends them at a shutdown
        self.answers = Answers(service)

    # -- shared checks ----------------------------------------------------------------------------

    def _auth(self, req: HTTPRequest) -> None:
        key = self.service.api_key
        if key is None:
            return
        given = req.headers.get("authorization", "")
        token = given[7:] if given[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode(), key.encode()):
            raise APIError(401, "missing API key (Authorization: Bearer ...)" if not token else "incorrect API key",
                           code="invalid_api_key")

    async def _body(self, req: HTTPRequest, cls):
        self._auth(req)
        self.service.check_ready()
        body = parse(cls, await read_body(req))
        req.state.log.update(model=body.model, stream=body.stream, n=body.n)
        self._model(body.model)
        fp = self.service.fingerprint
        if body.system_fingerprint is not None and body.system_fingerprint != fp:
            raise APIError(409, f"system_fingerprint: the request expects {body.system_fingerprint} but this "
                                f"server computes {fp}", param="system_fingerprint", code="fingerprint_mismatch")
        return body

    def _model(self, name: str) -> None:
        if name != self.service.name:
            raise APIError(404, f"model: {name!r} is not served here (this server serves "
                                f"{self.service.name!r}; see /v1/models)", param="model", code="model_not_found")

    @staticmethod
    def _pinned(req: HTTPRequest) -> dict:
        """What a cluster's ingress fixed for this request (`cluster/`: id, created, seed), so that any
        replica answers it with the same bytes; empty for a request from a client."""
        return req.scope.get("state", {}).get("pinned") or {}

    def _ids(self, req: HTTPRequest, prefix: str) -> tuple[str, int]:
        """The answer's id and creation time."""
        pin = self._pinned(req)
        return f"{prefix}-{pin.get('id') or uuid.uuid4().hex}", pin.get("created") or int(time.time())

    def _seed(self, req: HTTPRequest, body) -> int:
        """The request's seed, or one picked now when it samples without one (returned, to reproduce it)."""
        if body.seed is not None:
            return body.seed
        if body.temperature is not None and body.temperature <= 0:
            return 0
        pinned = self._pinned(req).get("seed")
        return secrets.randbits(63) if pinned is None else pinned

    def _constraint(self, body) -> tuple[str, dict]:
        """(the field that asks, the request's constraint as `Model.request` takes it), compiled now
        (then cached): a bad schema or grammar is a 400 naming its field before any other work."""
        asker, constraint = body.constraint()
        if constraint:
            compile_constraint(self.service.model, asker, **constraint)
        return asker, constraint

    def _jobs(self, req: HTTPRequest, body, prompts: list[tuple[str, list[int]]], max_tokens: int | None,
              top: int | None, echo: bool, param: str, constraint: dict) -> tuple[list[_Job], int]:
        model, ctx = self.service.model, self.service.model.config.context_length
        seed = self._seed(req, body)
        temperature = 1.0 if body.temperature is None else body.temperature
        jobs = []
        for p, (text, ids) in enumerate(prompts):
            if len(ids) >= ctx:
                raise APIError(400, f"{param}: {len(ids)} tokens leave no room in the model's context of {ctx} "
                                    "tokens", param=param, code="context_length_exceeded")
            n_new = ctx - len(ids) if max_tokens is None else max_tokens
            if len(ids) + n_new > ctx:
                raise APIError(400, f"max_tokens: {len(ids)} prompt tokens + {n_new} new tokens exceed the "
                                    f"model's context of {ctx} tokens (at most {ctx - len(ids)} new tokens fit)",
                               param="max_completion_tokens" if getattr(body, "max_completion_tokens", None)
                               else "max_tokens", code="context_length_exceeded")
            for i in range(body.n):
                try:
                    r = model.request(ids, max(n_new, 1), temperature, body.top_k or 0,
                                      1.0 if body.top_p is None else body.top_p, body.min_p or 0.0,
                                      (seed + i) % (1 << 64), body.stops, logits=top is not None,
                                      prompt_logprobs=top if echo and top is not None else None, **constraint)
                except ContextLengthError as e:
                    raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
                except TinydetError as e:
                    raise APIError(400, str(e)) from None
                jobs.append(_Job(p * body.n + i, r, text, top, echo, drop_token=n_new == 0))
        return jobs, seed

    # -- /v1/completions --------------------------------------------------------------------------

    async def completions(self, req: HTTPRequest) -> Response:
        body: CompletionRequest = await self._body(req, CompletionRequest)
        model = self.service.model
        constraint = self._constraint(body)[1]
        prompts = []
        for i, p in enumerate(body.prompts):
            where = "prompt" if len(body.prompts) == 1 else f"prompt[{i}]"
            if not isinstance(p, str) and max(p) >= model.config.vocab_size:
                raise APIError(400, f"{where}: token ids must lie in [0, {model.config.vocab_size}), found "
                                    f"{max(p)}", param="prompt")
            try:
                ids = model.prompt_ids(p)
                text = p if isinstance(p, str) else model.detokenize(ids)
            except TinydetError as e:
                raise APIError(400, f"{where}: {e}", param="prompt") from None
            prompts.append((text, ids))
        max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default here
        jobs, seed = self._jobs(req, body, prompts, max_tokens, body.logprobs, body.echo, "prompt", constraint)
        rid, created = self._ids(req, "cmpl")

        chunks, final = self.answers.completion(body, rid, created)
        return await self.runner.run(req, body, jobs, seed, chunks, final)

    # -- /v1/chat/completions ---------------------------------------------------------------------

    async def chat_completions(self, req: HTTPRequest) -> Response:
        body: ChatCompletionRequest = await self._body(req, ChatCompletionRequest)
        jobs, seed = self.chat_jobs(req, body)
        rid, created = self._ids(req, "chatcmpl")

        chunks, final = self.answers.chat(body, rid, created)
        return await self.runner.run(req, body, jobs, seed, chunks, final)

    def chat_jobs(self, req: HTTPRequest, body: ChatCompletionRequest) -> tuple[list[_Job], int]:
        """A chat request's checked choices as engine jobs, each with its parser where the answer is
        read back (tools, a thinking template); (the jobs, the seed)."""
        prep = chat_tools.prepare(self.service.model, body, self._constraint(body))
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        top = (body.top_logprobs or 0) if body.logprobs else None
        jobs, seed = self._jobs(req, body, [("", prep.ids)], max_tokens, top, False, "messages", prep.constraint)
        chat_tools.attach(jobs, prep, seed)
        return jobs, seed

    async def responses(self, req: HTTPRequest) -> Response:
        """OpenAI's Responses API, stateless, answered by the chat path (`responses_api.py`)."""
        return await responses_api.answer(self, req)

    # -- the rest ---------------------------------------------------------------------------------

    async def models(self, req: HTTPRequest) -> Response:
        self._auth(req)
        return _json({"object": "list", "data": [self.answers.card()]})

    async def model(self, req: HTTPRequest) -> Response:
        self._auth(req)
        name = req.path_params["name"]
        if name != self.service.name:
            raise APIError(404, f"model: {name!r} is not served here", param="model", code="model_not_found")
        return _json(self.answers.card())

    # -- the tokenizer (vLLM's routes: lm-evaluation-harness tokenizes with the server's own) -------

    async def _tokenizer_body(self, req: HTTPRequest, cls):
        self._auth(req)
        self.service.check_ready()
        body = parse(cls, await read_body(req))
        if body.model is not None:
            self._model(body.model)
        return body

    async def tokenize(self, req: HTTPRequest) -> Response:
        body = await self._tokenizer_body(req, TokenizeRequest)
        model = self.service.model
        try:
            ids = model.tokenize(body.prompt, add_special=body.add_special_tokens)
        except TinydetError as e:
            raise APIError(400, f"prompt: {e}", param="prompt") from None
        return _json({"count": len(ids), "max_model_len": model.config.context_length, "tokens": ids})

    async def detokenize(self, req: HTTPRequest) -> Response:
        body = await self._tokenizer_body(req, DetokenizeRequest)
        try:  # the tokenizer's own message, which names no argument: the field is "tokens" here
            text = self.service.model.tokenizer.decode(body.tokens)
        except TinydetError as e:
            raise APIError(400, f"tokens: {e}", param="tokens") from None
        return _json({"prompt": text})

    async def tokenizer_info(self, req: HTTPRequest) -> Response:
        self._auth(req)
        self.service.check_ready()
        model = self.service.model
        tok = model.tokenizer
        name = lambda i: None if i is None else tok.id_to_token(i)  # noqa: E731
        return _json({"tokenizer_class": "tinydet", "bos_token": name(tok.bos_id),
                      "eos_token": name(tok.eos_ids[0] if tok.eos_ids else None), "pad_token": None,
                      "add_bos_token": tok.add_bos, "chat_template": tok.chat_template,
                      "model_max_length": model.config.context_length, "vocab_size": model.config.vocab_size})

    async def health(self, req: HTTPRequest) -> Response:
        s = self.service
        if s.state == "ready":
            return _json({"status": "ok", "system_fingerprint": s.fingerprint})
        body = {"status": s.state} if s.state == "loading" else {"status": "failed", "error": s.problem}
        return _json(body, 503)

    async def metrics(self, req: HTTPRequest) -> Response:
        return Response(self.service.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")


class _Middleware:
    """Errors in OpenAI's shape, and one log line and one metrics count per request (a stream's once
    it ends)."""

    def __init__(self, app, service: Service):
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        record = {"request_id": uuid.uuid4().hex, "method": scope["method"], "path": scope["path"],
                  "client": (scope.get("client") or ("", 0))[0]}
        status = {"code": 500}
        state = scope.setdefault("state", {})
        state["t_arrival"] = t0
        state["log"] = record
        logged = []

        def done():
            if logged:
                return
            logged.append(1)
            code = status["code"]
            record.update(status=code, duration_ms=round(1000 * (time.perf_counter() - t0), 3))
            outcome = record.get("outcome") or ("disconnected" if record.get("disconnected") else
                                                OUTCOMES.get(code, "error" if code >= 500 else "bad_request"))
            self.service.metrics.requests.labels(scope["path"], outcome).inc()
            self.service.log.write(record)

        state["log_done"] = done

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except APIError as e:
            record["error"] = e.message
            status["code"] = e.status
            await _json(e.body(), e.status, e.headers)(scope, receive, send)
        except Exception as e:  # noqa: BLE001 - one request fails, the server goes on
            record["error"] = f"{type(e).__name__}: {e}"
            status["code"] = 500
            body = APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").body()
            await _json(body, 500)(scope, receive, send)
        finally:
            if not state.get("log_deferred"):
                done()


def create_app(service: Service) -> Starlette:
    """The ASGI app. Its lifespan starts the service (loading in the background) and stops it."""
    a = _App(service)

    async def not_found(req, exc):
        e = APIError(exc.status_code, f"{req.method} {req.url.path}: "
                                      f"{'no such endpoint' if exc.status_code == 404 else 'method not allowed'}",
                     code="not_found" if exc.status_code == 404 else "method_not_allowed")
        req.state.log["error"] = e.message
        return _json(e.body(), e.status)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, service.stop)

    app = Starlette(routes=[
        Route("/v1/models", a.models, methods=["GET"]),
        Route("/v1/models/{name:path}", a.model, methods=["GET"]),
        Route("/v1/completions", a.completions, methods=["POST"]),
        Route("/v1/chat/completions", a.chat_completions, methods=["POST"]),
        Route("/v1/responses", a.responses, methods=["POST"]),
        Route("/tokenize", a.tokenize, methods=["POST"]),
        Route("/detokenize", a.detokenize, methods=["POST"]),
        Route("/tokenizer_info", a.tokenizer_info, methods=["GET"]),
        Route("/health", a.health, methods=["GET"]),
        Route("/metrics", a.metrics, methods=["GET"]),
    ], exception_handlers={404: not_found, 405: not_found}, lifespan=lifespan)
    app.add_middleware(_Middleware, service=service)
    app.state.end_running = a.runner.end_running
    return app
