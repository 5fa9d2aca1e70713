"""OpenAI's function tools, checked before any model work: the `tools` list, `tool_choice`, and a
conversation's assistant `tool_calls` and `tool` messages. Each fault is a ToolError naming the field
as OpenAI's API names it (`tools[2].function.parameters`), so the server answers a 400 with that `param`.

A call's id is a function of the request and the call's place in the answer (no clock, no random
state): the same request gives the same ids, whatever else the server is doing.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import TinydetError

MAX_TOOLS = 128  # OpenAI's limit on the tools list
MAX_TOOLS_CHARS = 1 << 20  # the tools' JSON, in characters: it is rendered into every prompt
NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's rule for a function's name
CHOICES = ("auto", "none", "required")


class ToolError(TinydetError):
    """A tools field that cannot be used; `param` names it (`tools[0].function.name`)."""

    def __init__(self, param: str, why: str):
        super().__init__(f"{param}: {why}")
        self.param, self.why = param, why


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the function's name, its arguments as JSON text (an object, as the
    model wrote it), and its id."""

    name: str
    arguments: str
    id: str = ""

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def check_tools(tools) -> list[dict]:
    """The tools as plain dicts ({"type": "function", "function": {name, description?, parameters?,
    strict?}}), each checked; parameters default to an empty object schema."""
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes, bytearray)):
        raise ToolError("tools", f"expected a list of tools, found {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise ToolError("tools", f"{len(tools)} tools, more than the {MAX_TOOLS} allowed")
    out, names = [], {}
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, Mapping):
            raise ToolError(where, "expected an object")
        if t.get("type") != "function":
            raise ToolError(f"{where}.type", f"expected 'function', found {t.get('type')!r}")
        extra = set(t) - {"type", "function"}
        if extra:
            raise ToolError(f"{where}.{sorted(extra)[0]}", "unknown field")
        f = t.get("function")
        if not isinstance(f, Mapping):
            raise ToolError(f"{where}.function", "expected an object with a name")
        extra = set(f) - {"name", "description", "parameters", "strict"}
        if extra:
            raise ToolError(f"{where}.function.{sorted(extra)[0]}", "unknown field")
        name = f.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ToolError(f"{where}.function.name", "expected 1-64 letters, digits, '_', '.' or '-', found "
                                                      f"{repr(name)[:70]}")
        if name in names:
            raise ToolError(f"{where}.function.name", f"{name!r} is also tools[{names[name]}]'s name")
        names[name] = i
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise ToolError(f"{where}.function.description", "expected a string")
        if f.get("strict") is not None and not isinstance(f["strict"], bool):
            raise ToolError(f"{where}.function.strict", "expected true or false")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, Mapping):
            raise ToolError(f"{where}.function.parameters", "expected a JSON Schema object")
        if params.get("type", "object") != "object":
            raise ToolError(f"{where}.function.parameters.type", f"expected 'object' (a function takes named "
                                                                 f"arguments), found {params.get('type')!r}")
        fn = {"name": name}
        if f.get("description") is not None:
            fn["description"] = f["description"]
        fn["parameters"] = dict(params)
        out.append({"type": "function", "function": fn})
    try:
        size = len(json.dumps(out, allow_nan=False))
    except (TypeError, ValueError, RecursionError) as e:
        raise ToolError("tools", f"not JSON ({type(e).__name__})") from None
    if size > MAX_TOOLS_CHARS:
        raise ToolError("tools", f"{size} characters of JSON, more than the {MAX_TOOLS_CHARS} allowed")
    return out


def check_tool_choice(choice, tools: list[dict]) -> str:
    """`tool_choice` as "auto", "none", "required", or the name of the one function to call. OpenAI's
    default is "auto" with tools and "none" without."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise ToolError("tool_choice", f"expected one of {', '.join(CHOICES)} or a function, found {choice!r}")
        if choice == "required" and not tools:
            raise ToolError("tool_choice", "'required' needs tools")
        return choice
    if isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(choice.get("function"), Mapping):
        name = choice["function"].get("name")
    elif isinstance(choice, Mapping) and choice.get("type") == "function" and "name" in choice:  # the Responses API's
        name = choice["name"]
    else:
        raise ToolError("tool_choice", 'expected "auto", "none", "required" or {"type": "function", '
                                       '"function": {"name": ...}}')
    known = [t["function"]["name"] for t in tools]
    if name not in known:
        raise ToolError("tool_choice.function.name", f"{repr(name)[:70]} is not one of the tools "
                                                     f"({', '.join(known) or 'none given'})")
    return name


def tool_schema(tools: list[dict], name: str) -> dict:
    return next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)


def check_history(messages: Sequence[Mapping]) -> list[dict]:
    """The conversation with each assistant's tool calls checked and their arguments as objects (chat
    templates write `arguments | tojson`; OpenAI sends a JSON string), and each `tool` message answering
    a call made before it."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes, bytearray)) or not messages:
        raise ToolError("messages", "expected a non-empty list of message objects")
    out, open_ids = [], set()
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ToolError(f"messages[{i}]", "expected an object with 'role' and 'content'")
        m = dict(m)
        calls = m.get("tool_calls")
        if calls is not None:
            if m.get("role") != "assistant":
                raise ToolError(f"messages[{i}].tool_calls", "only an assistant message makes tool calls")
            if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
                raise ToolError(f"messages[{i}].tool_calls", "expected a list")
            fixed = []
            for j, c in enumerate(calls):
                where = f"messages[{i}].tool_calls[{j}]"
                if not isinstance(c, Mapping) or not isinstance(c.get("function"), Mapping):
                    raise ToolError(where, "expected {id, type: 'function', function: {name, arguments}}")
                f = c["function"]
                if not isinstance(f.get("name"), str):
                    raise ToolError(f"{where}.function.name", "expected a string")
                args = f.get("arguments", "{}")
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except (ValueError, RecursionError):
                        raise ToolError(f"{where}.function.arguments", "not valid JSON") from None
                if not isinstance(args, Mapping):
                    raise ToolError(f"{where}.function.arguments", "expected a JSON object")
                cid = c.get("id")
                if cid is not None and not isinstance(cid, str):
                    raise ToolError(f"{where}.id", "expected a string")
                if cid:
                    open_ids.add(cid)
                fixed.append({**c, "type": "function", "function": {**f, "arguments": dict(args)}})
            m["tool_calls"] = fixed
        if m.get("role") == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str) or not cid:
                raise ToolError(f"messages[{i}].tool_call_id", "required for a tool message")
            if cid not in open_ids:
                raise ToolError(f"messages[{i}].tool_call_id", f"{cid[:70]!r} answers no earlier assistant tool call")
        out.append(m)
    return out


def call_ids(digest_of: str, n: int, style: str = "openai") -> list[str]:
    """`n` call ids derived from `digest_of` (the request's and the answer's hash) and each call's place:
    `call_` + 24 hex digits, or 9 letters and digits where the template demands it ("mistral")."""
    out = []
    for k in range(n):
        h = hashlib.sha256(f"{digest_of}\0{k}".encode()).digest()
        if style == "mistral":
            alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
            v = int.from_bytes(h[:12], "big")
            out.append("".join(alphabet[(v >> (6 * s)) % 62] for s in range(9)))
        else:
            out.append("call_" + h.hex()[:24])
    return out
