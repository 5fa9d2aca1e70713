"""OpenAI's wire format as `tinydet serve` speaks it: the request bodies it takes, read (at most
MAX_BODY bytes) and checked by pydantic (strict: "5" is not 5); OpenAI's error shape; JSON answers.

Fields OpenAI defines and tinydet does not implement are refused by name rather than ignored (a
penalty or a logit bias silently dropped would be a silently different answer); unknown fields are
refused as OpenAI refuses them. tinydet's own fields: `top_k`, `min_p` (as vLLM takes them),
`system_fingerprint` (the fingerprint the client expects; another answers 409) and
`return_token_ids` (each choice also lists its token ids).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.requests import ClientDisconnect, Request as HTTPRequest
from starlette.responses import Response

from ..logprobs import MAX_TOP

MAX_BODY = 16 << 20  # bytes; a prompt the context can hold is far smaller
MAX_N = 16  # choices per prompt
MAX_STOP = 4  # OpenAI's limit
SEED_LIMIT = 1 << 64


class APIError(Exception):
    """An answer other than 200: HTTP status, OpenAI's error type, the field at fault, a code."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _json(obj, status: int = 200, headers: dict | None = None) -> Response:
    return Response(_dumps(obj), status, headers=headers, media_type="application/json")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


Prob = Annotated[float, Field(ge=0.0, le=1.0)]


class JSONSchemaFormat(_Body):
    name: Annotated[str, Field(max_length=64)] = "response"
    description: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise APIError(400, "response_format.json_schema: required when type is json_schema",
                           param="response_format.json_schema")
        if self.type != "json_schema" and self.json_schema is not None:
            raise APIError(400, f"response_format.json_schema: only with type json_schema, not {self.type}",
                           param="response_format.json_schema")
        return self


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs`: one of a JSON Schema, a regex, a grammar, a list of choices, or any
    JSON object."""
    json_: dict | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    json_object: bool | None = None


class _Sampling(_Body):
    model: str
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Prob | None = None
    seed: Annotated[int, Field(ge=0, lt=SEED_LIMIT)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict | None = None
    system_fingerprint: str | None = None
    return_token_ids: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    grammar: str | None = None  # llama.cpp's field: GBNF (or Lark)

    @model_validator(mode="after")
    def _unsupported(self):
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise APIError(400, f"{name}: not supported by tinydet (only 0)", param=name)
        if self.logit_bias:
            raise APIError(400, "logit_bias: not supported by tinydet", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only allowed when stream is true", param="stream_options")
        return self

    def constraint(self) -> tuple[str, dict]:
        """(the field that asks, {json_schema | regex | grammar: ...}) for `Model.request`; ("", {}) for none.
        Several at once are refused."""
        asks = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asks.append(("response_format", {"json_schema": {"type": "object"}}))
        elif rf is not None and rf.type == "json_schema":
            schema = rf.json_schema.schema_
            asks.append(("response_format.json_schema.schema", {"json_schema": {} if schema is None else schema}))
        so = self.structured_outputs
        if so is not None:
            given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("grammar", so.grammar),
                                         ("choice", so.choice), ("json_object", so.json_object or None))
                     if v is not None]
            if len(given) != 1:
                raise APIError(400, "structured_outputs: expected exactly one of json, regex, grammar, choice, "
                                    "json_object", param="structured_outputs")
            k, v = given[0]
            if k == "choice":  # one of the strings, as a grammar of literals (JSON's escapes are Lark's)
                v = {"grammar": "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in v)}
            else:
                v = {"json_schema": {"type": "object"} if k == "json_object" else v} if k.startswith("json") \
                    else {k: v}
            asks.append((f"structured_outputs.{k}", v))
        if self.grammar is not None:
            asks.append(("grammar", {"grammar": self.grammar}))
        if len(asks) > 1:
            raise APIError(400, f"{asks[0][0]} and {asks[1][0]}: give one constraint, not several", param=asks[1][0])
        return asks[0] if asks else ("", {})

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_Sampling):
    prompt: str | TokenIds | Annotated[list[str], Field(min_length=1)] | Annotated[list[TokenIds], Field(min_length=1)]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP)] | None = None
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _completion(self):
        if self.suffix:
            raise APIError(400, "suffix: not supported by tinydet", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of: not supported by tinydet (only equal to n)", param="best_of")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens: expected at least 1 (0 only with echo, to score the prompt)",
                           param="max_tokens")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        return [p] if isinstance(p[0], int) else list(p)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # checked by chat.tools.check_history, which names the field
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def plain(self) -> dict:
        c = self.content
        text = c if isinstance(c, str) else "".join(p.text for p in c or [])
        if c is None and self.tool_calls:  # an assistant turn of calls only
            text = None
        # OpenAI's newer name for the system role; chat templates know "system".
        out = {"role": "system" if self.role == "developer" else self.role, "content": text}
        for k in ("tool_calls", "tool_call_id", "reasoning_content"):  # only when given: a plain chat's prompt stays
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        return out


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP)] | None = None
    # tools (checked by chat.tools, which names the field at fault); OpenAI refuses an empty list
    tools: Annotated[list[dict], Field(min_length=1)] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict | None = None  # vLLM's: options the template reads (enable_thinking, ...)
    reasoning_effort: str | None = None  # reaches the template as reasoning_effort

    @model_validator(mode="after")
    def _chat(self):
        if self.max_tokens == 0:
            raise APIError(400, "max_tokens: expected at least 1", param="max_tokens")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs set to true", param="top_logprobs")
        return self


class TokenizeRequest(_Body):
    """vLLM's /tokenize, which lm-evaluation-harness's remote tokenizer calls."""
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    """vLLM's /detokenize."""
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


async def read_body(req: HTTPRequest) -> bytes:
    """The request's body, at most MAX_BODY bytes (else 413)."""
    raw = bytearray()
    try:
        async for part in req.stream():
            raw += part
            if len(raw) > MAX_BODY:
                raise APIError(413, f"request body: larger than {MAX_BODY >> 20} MiB", code="body_too_large")
    except ClientDisconnect:
        raise APIError(400, "the client went away before sending the body") from None
    return bytes(raw)


def parse(cls: type[_Sampling], raw: bytes) -> _Sampling:
    """The request body as `cls`, or APIError 400 naming the first field at fault."""
    try:
        return cls.model_validate_json(raw)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        if errors[0]["type"] == "json_invalid":
            raise APIError(400, f"request body: not valid JSON ({errors[0]['msg']})") from None
        # A union reports one error per member; the deepest one that is not a plain type mismatch
        # says best what is wrong ("prompt[2]: >= 0" rather than "prompt: not a string").
        first = errors[0]["loc"][:1]
        err = max((x for x in errors if x["loc"][:1] == first),
                  key=lambda x: (len(x["loc"]), not x["type"].endswith("_type")))
        param = _param(err["loc"])
        if err["type"] == "extra_forbidden":
            raise APIError(400, f"{param}: unknown or unsupported field", param=param) from None
        if err["type"] == "missing":
            raise APIError(400, f"{param}: required", param=param) from None
        raise APIError(400, f"{param or 'request body'}: {err['msg']}", param=param) from None


def _param(loc: tuple) -> str | None:
    """A pydantic error location as OpenAI names a field: messages[0].content."""
    out = ""
    for x in loc:
        if isinstance(x, int):
            out += f"[{x}]"
        elif not ("[" in x or x in _UNION_TAGS):
            out += ("." if out else "") + x
    return out or None


# Names pydantic puts into error locations for the members of a union.
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "function-after", "constrained-int", "constrained-float",
               "constrained-list", "TextPart", "StreamOptions", "ResponseFormat", "JSONSchemaFormat",
               "StructuredOutputs"}
