"""The call syntaxes of Llama 3.x (bare JSON), Mistral (`[TOOL_CALLS]`, two generations) and Phi-4-mini
(`functools[...]`), as llama.cpp's chat.cpp and vLLM's tool parsers read them.

- llama3_json: the whole answer is `{"name": "f", "parameters": {...}}`, optionally after
  `<|python_tag|>`. Llama 3.1-3.3's templates refuse more than one call in a turn ("This model only
  supports single tool-calls at once"), so one call, and the grammar allows one.
- mistral (Nemo, v3 tokenizers): `[TOOL_CALLS][{"name": "f", "arguments": {...}, "id": "abc123XYZ"}, ...]`:
  one JSON list holds the parallel calls; the id is optional.
- mistral_args (Mistral-Small-3.2, v11+ tokenizers): `[TOOL_CALLS]f[ARGS]{...}` per call (the template
  also writes `[CALL_ID]id` before `[ARGS]`: read when present, never required).
- phi4_mini: `functools[{"name": "f", "arguments": {...}}, ...]`.
"""

from __future__ import annotations

import json
import re

from .syntax import ToolSyntax, _args_json, _parse_json, call_schema, json_lark, name_args
from .tools import tool_schema

ID_SCHEMA = {"type": "string", "pattern": "^[A-Za-z0-9]{9}$"}  # Mistral's call ids


def _list_calls(body: str, names, extra=()) -> list[tuple[str, str]] | None:
    """The calls of a JSON list of call objects (all well formed and known), else None."""
    obj = _parse_json(body)
    if not isinstance(obj, list) or not obj:
        return None
    calls = [name_args(c, names, extra=extra) for c in obj]
    return calls if all(calls) else None


class Llama3Json(ToolSyntax):
    name = "llama3_json"
    opener, closer = "{", None
    anchored, leads = True, ("<|python_tag|>",)
    markers = ("<|python_tag|>",)

    def parse_body(self, body, names):
        call = name_args(_parse_json("{" + body), names, keys=("parameters", "arguments"))
        return [call] if call else None

    def call_rest(self, tools, names, lit):  # unused: the call is one JSON value, its "{" included
        raise NotImplementedError

    def grammar(self, tools, choice, parallel, lit, prefix=""):
        names = [t["function"]["name"] for t in tools] if choice in ("auto", "required") else [choice]
        body = f"call: {json_lark(call_schema(tools, names, 'parameters'))}"
        head = "%llguidance {}\n"
        if choice != "auto":
            return f"{head}start: {'prefix ' if prefix else ''}call\n{body}\n{prefix}\n"
        # llguidance's docs' Llama example: free text that does not start with "{", or a call
        return f"{head}start: TEXT | call\nTEXT: /[^{{](.|\\n)*/\n{body}\n"


class _CallList(ToolSyntax):
    """Calls as one JSON list of {"name", "arguments"} objects after the opener."""

    extra: dict = {}  # other properties a call object may have (Mistral's id)
    _max_items: int | None = None

    def parse_body(self, body, names):
        return _list_calls(body, names, extra=tuple(self.extra))

    def call_rest(self, tools, names, lit):
        schema = {"type": "array", "items": call_schema(tools, names, extra=self.extra), "minItems": 1}
        if self._max_items:
            schema["maxItems"] = self._max_items
        return f"call_rest: {json_lark(schema)}"

    def grammar(self, tools, choice, parallel, lit, prefix=""):
        # parallel calls are items of the one list, not repeated openers
        self._max_items = None if parallel else 1
        return super().grammar(tools, choice, False, lit, prefix)


class Mistral(_CallList):
    name = "mistral"
    opener, closer = "[TOOL_CALLS]", None
    markers = ("[TOOL_CALLS]",)
    id_style = "mistral"
    extra = {"id": ID_SCHEMA}


class MistralArgs(ToolSyntax):
    name = "mistral_args"
    opener, closer = "[TOOL_CALLS]", None
    markers = ("[TOOL_CALLS]", "[CALL_ID]", "[ARGS]")
    id_style = "mistral"
    _call = re.compile(r"\s*([A-Za-z0-9_.\-]{1,64})(?:\[CALL_ID\][A-Za-z0-9]{9})?\[ARGS\]")

    def parse_body(self, body, names):
        calls = []
        for part in body.split(self.opener):
            m = self._call.match(part)
            if not m or m.group(1) not in names:
                return None
            args = _parse_json(part[m.end():])
            if not isinstance(args, dict):
                return None
            calls.append((m.group(1), _args_json(args)))
        return calls

    def separator(self):
        return ""  # each call starts with its own [TOOL_CALLS]

    def call_rest(self, tools, names, lit):
        # the template writes [CALL_ID]id before [ARGS]: a model trained on it may write one
        rules = [f"call_rest: {' | '.join(f'fn_{i}' for i in range(len(names)))}",
                 f"call_id: {lit('[CALL_ID]')} CALL_ID\nCALL_ID: /[A-Za-z0-9]{{9}}/"]
        for i, n in enumerate(names):
            rules.append(f"fn_{i}: {json.dumps(n)} call_id? {lit('[ARGS]')} args_{i}\nargs_{i}: "
                         f"{json_lark(tool_schema(tools, n))}")
        return "\n".join(rules)


class Phi4Mini(_CallList):
    name = "phi4_mini"
    opener, closer = "functools", None
