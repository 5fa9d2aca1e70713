"""OpenAI's Responses API (`POST /v1/responses`), stateless: a request is turned into the chat request
it means (input items as messages, instructions as a system message first, tools and text.format in
the chat shapes) and answered by the chat path, so the prompt, grammar, parser and call ids are the
chat's; `responses_shapes.py` writes the answer. Nothing is stored: `store` is accepted (OpenAI's
default is true) and ignored, and `previous_response_id` or `conversation` is a 400.

Errors name the Responses API's fields (`input[3].call_id`, `tools[0].parameters`), not the chat's.
"""

from __future__ import annotations

import re
from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response

from .protocol import SEED_LIMIT, APIError, ChatCompletionRequest, _Body, _dumps, parse
from .responses_shapes import renderers


class TextFormat(_Body):
    type: Literal["text", "json_schema", "json_object"]
    name: Annotated[str, Field(max_length=64)] | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class Reasoning(_Body):
    effort: str | None = None
    summary: str | None = None  # accepted; tinydet writes no summaries (summary is [])


class ResponsesRequest(_Body):
    model: str
    input: str | list[dict]
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    stream: bool = False
    store: bool = True  # nothing is kept whatever it says
    previous_response_id: str | None = None
    conversation: str | dict | None = None
    seed: Annotated[int, Field(ge=0, lt=SEED_LIMIT)] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    system_fingerprint: str | None = None  # tinydet's, as in the chat API
    n: ClassVar[int] = 1

    @model_validator(mode="after")
    def _stateless(self):
        for name in ("previous_response_id", "conversation"):
            if getattr(self, name) is not None:
                raise APIError(400, f"{name}: responses are not stored here (tinydet serve is stateless); send "
                                    "the whole conversation as input", param=name)
        return self


def _text(content, where: str) -> str:
    """A message's content: a string, or a list of text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: expected a string or a list of content parts", param=where)
    out = []
    for k, part in enumerate(content):
        at = f"{where}[{k}]"
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "reasoning_text"):
            kind = part.get("type") if isinstance(part, dict) else None
            raise APIError(400, f"{at}.type: expected input_text or output_text (tinydet reads text only), "
                                f"found {kind!r}", param=f"{at}.type")
        if not isinstance(part.get("text"), str):
            raise APIError(400, f"{at}.text: expected a string", param=f"{at}.text")
        out.append(part["text"])
    return "".join(out)


def _field(item: dict, key: str, where: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise APIError(400, f"{where}.{key}: expected a string", param=f"{where}.{key}")
    return v


def _messages(body: ResponsesRequest) -> tuple[list[dict], list[str], dict]:
    """(chat messages, the Responses field each came from, {chat call path: its input item}) for the
    request's instructions and input."""
    msgs, origin, calls = [], [], {}
    if body.instructions is not None:
        msgs.append({"role": "system", "content": body.instructions})
        origin.append("instructions")
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    reasoning = None  # a reasoning item's text, given to the assistant turn that follows it
    for i, item in enumerate(items):
        where = "input" if isinstance(body.input, str) else f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where}: expected an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role: expected user, system, developer or assistant, found "
                                    f"{role!r}", param=f"{where}.role")
            m = {"role": role, "content": _text(item.get("content"), f"{where}.content")}
            if role == "assistant" and reasoning is not None:
                m["reasoning_content"], reasoning = reasoning, None
            msgs.append(m)
            origin.append(where)
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", where), "type": "function",
                    "function": {"name": _field(item, "name", where), "arguments": _field(item, "arguments", where)}}
            last = msgs[-1] if msgs else None
            if last is None or last["role"] != "assistant":  # calls after an assistant's text join its turn
                last = {"role": "assistant", "content": None}
                if reasoning is not None:
                    last["reasoning_content"], reasoning = reasoning, None
                msgs.append(last)
                origin.append(where)
            last.setdefault("tool_calls", []).append(call)
            calls[f"messages[{len(msgs) - 1}].tool_calls[{len(last['tool_calls']) - 1}]"] = where
        elif kind == "function_call_output":
            msgs.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                         "content": _text(item.get("output"), f"{where}.output")})
            origin.append(where)
        elif kind == "reasoning":
            reasoning = _text(item.get("content") or [], f"{where}.content")
        else:
            raise APIError(400, f"{where}.type: expected message, function_call, function_call_output or "
                                f"reasoning, found {kind!r}", param=f"{where}.type")
    if not msgs:
        raise APIError(400, "input: expected at least one item", param="input")
    return msgs, origin, calls


def _tools(tools: list[dict]) -> list:
    """Responses' function tools ({type, name, description, parameters, strict}) in the chat shape; the
    chat's checks name the rest."""
    out = []
    for t in tools:
        if isinstance(t, dict) and t.get("type") == "function":
            fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
            fn.update({k: v for k, v in t.items() if k not in ("type", "name", "description", "parameters", "strict")})
            t = {"type": "function", "function": fn}
        out.append(t)
    return out


def to_chat(body: ResponsesRequest) -> tuple[ChatCompletionRequest, callable]:
    """The chat request `body` means, and the function that renames a chat field to the request's."""
    msgs, origin, calls = _messages(body)
    chat = {"model": body.model, "messages": msgs, "stream": body.stream,
            "parallel_tool_calls": body.parallel_tool_calls}
    for ours, theirs in (("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("seed", "seed"), ("user", "user"),
                         ("system_fingerprint", "system_fingerprint")):
        if getattr(body, ours) is not None:
            chat[theirs] = getattr(body, ours)
    if body.tools is not None:
        chat["tools"] = _tools(body.tools)
    if body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        js = {"name": fmt.name or "response", "schema": fmt.schema_ if fmt.schema_ is not None else {}}
        js.update({k: getattr(fmt, k) for k in ("description", "strict") if getattr(fmt, k) is not None})
        chat["response_format"] = {"type": "json_schema", "json_schema": js}
    elif fmt is not None:
        chat["response_format"] = {"type": fmt.type}
    if body.reasoning is not None and body.reasoning.effort is not None:
        chat["reasoning_effort"] = body.reasoning.effort

    def rename(param: str | None) -> str | None:
        if not param:
            return param
        m = re.match(r"(messages\[\d+\]\.tool_calls\[\d+\])(?:\.function)?(.*)", param)
        if m and m.group(1) in calls:
            return calls[m.group(1)] + {".arguments": ".arguments", ".name": ".name", ".id": ".call_id"}.get(
                m.group(2), "")
        m = re.match(r"messages\[(\d+)\](.*)", param)
        if m:
            rest = {".tool_call_id": ".call_id", ".content": ".content"}.get(m.group(2), "")
            return origin[int(m.group(1))] + rest if int(m.group(1)) < len(origin) else "input"
        if param == "messages":
            return "input"
        param = re.sub(r"^(tools\[\d+\])\.function", r"\1", param)
        return {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                "reasoning_effort": "reasoning.effort", "tool_choice.function.name": "tool_choice.name",
                "response_format": "text.format", "response_format.json_schema": "text.format",
                "response_format.json_schema.schema": "text.format.schema"}.get(param, param)

    try:
        return parse(ChatCompletionRequest, _dumps(chat).encode()), rename
    except APIError as e:
        raise _renamed(e, rename) from None


def _renamed(e: APIError, rename) -> APIError:
    new = rename(e.param)
    if e.param and new != e.param:
        e.message = e.message.replace(e.param, new, 1)
    e.param = new
    return e


async def answer(app, req: HTTPRequest) -> Response:
    """POST /v1/responses on the server's `_App`."""
    body: ResponsesRequest = await app._body(req, ResponsesRequest)
    chat, rename = to_chat(body)
    try:
        jobs, seed = app.chat_jobs(req, chat)
    except APIError as e:
        raise _renamed(e, rename) from None
    rid, created = app._ids(req, "resp")
    rid = "resp_" + rid[len("resp-"):]
    chunks, final = renderers(app.service, body, rid, created)
    return await app.runner.run(req, chat, jobs, seed, chunks, final, frame=_frame, done="")


def _frame(event: dict) -> str:
    if "error" in event:  # an error after the 200: the Responses API's error event
        event = {**event["error"], "type": "error", "sequence_number": None}
    return f"event: {event['type']}\ndata: {_dumps(event)}\n\n"

