"""Tool-call syntaxes: how a family of models writes a call, read back from its text, and the grammar
that holds a call to its function's schema while it is written.

A syntax says where a call starts (`opener`) and ends (`closer`; None: at the end of the output), how
the text between parses into calls (`parse_body`), and writes a Lark grammar for llguidance
(`grammar`): with tool_choice "required" or a named function the output is calls and nothing else;
with "auto" text is free until the model writes the opener, and from there the call is held to the
schema (llguidance's lazy lexemes, as its docs describe for tool calling).

`syntaxes.detect(template)` picks the syntax from the chat template's own text. A template that does not
render tools at all gets the generic form: tools described in a system message (`generic_system`),
calls written Hermes-style.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from .tools import tool_schema

Lit = Callable[[str], str]  # a marker's Lark form: a quoted string, or <[id]> for a control token


# A call's JSON as the templates write it (`tojson`: ", " and ": ", no line breaks), so that the model
# writes calls the way it was trained to, in the fewest tokens.
JSON_FORMAT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def json_lark(schema: dict) -> str:
    """Lark for a JSON value of `schema` written as JSON_FORMAT says."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_FORMAT}, ensure_ascii=False)


def _quoted(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _args_json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


class ToolSyntax:
    """One family's call syntax. Subclasses set the markers and write parse_body and the call grammar."""

    name = "base"
    opener = ""
    closer: str | None = None  # None: a call runs to the end of the output
    id_style = "openai"  # how call ids look (tools.call_ids)
    markers: tuple[str, ...] = ()  # texts that may be control tokens (decoded to nothing): named in the text
    anchored = False  # a call only at the start of the output (Llama 3's bare JSON): later text is content
    leads: tuple[str, ...] = ()  # texts an anchored call may start with, dropped (Llama's <|python_tag|>)

    def parse_body(self, body: str, names: Sequence[str]) -> list[tuple[str, str]] | None:
        """The calls (name, arguments as JSON object text) in the text between opener and closer, or
        None when it is not a well-formed call of a known function (it is then returned as text)."""
        raise NotImplementedError

    def call_rest(self, tools: list[dict], names: Sequence[str], lit: Lit) -> str:
        """Lark rules defining `call_rest`: what follows the opener in one whole call of one of `names`,
        through the closer."""
        raise NotImplementedError

    def separator(self) -> str:
        """Lark text between two calls of a parallel answer."""
        return '"\\n"'

    def grammar(self, tools: list[dict], choice: str, parallel: bool, lit: Lit, prefix: str = "") -> str:
        """The answer's Lark grammar for tool_choice `choice` ("auto", "required" or a function's name).
        `prefix` is Lark rules defining `prefix` (what comes before: reasoning), or "" for none."""
        names = [t["function"]["name"] for t in tools] if choice in ("auto", "required") else [choice]
        rest = self.call_rest(tools, names, lit)
        opener = lit(self.opener)
        head = "%llguidance {}\n"
        if choice != "auto":
            pre = "prefix " if prefix else ""
            sep = self.separator()
            many = f" ({sep + ' ' if sep else ''}call)*" if parallel else ""
            return f"{head}start: {pre}call{many}\ncall: {opener} call_rest\n{rest}\n{prefix}\n"
        if opener.startswith("<["):  # a control token: free text cannot hold it, so no laziness is needed
            more = "*" if parallel else "?"
            return f"{head}start: TEXT ({opener} call_rest TEXT){more}\nTEXT: /(.|\\n)*/\n{rest}\n"
        # llguidance's lazy tool-calling pattern: any text up to the opener, then the call's rules
        start = "start: call* TEXT" if parallel else "start: TEXT | call"
        return (f"{head}{start}\nTEXT: /(.|\\n)*/\ncall_hd[lazy]: TEXT {opener}\ncall: call_hd call_rest\n"
                f"{rest}\n")


class Hermes(ToolSyntax):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`: Qwen2.5, Qwen3, SmolLM3, Hermes,
    and the generic form."""

    name = "hermes"
    opener, closer = "<tool_call>", "</tool_call>"
    markers = ("<tool_call>", "</tool_call>")

    def parse_body(self, body, names):
        call = name_args(_parse_json(body), names)
        return [call] if call else None

    def call_rest(self, tools, names, lit):
        schema = call_schema(tools, names)
        return (f"call_rest: \"\\n\" body \"\\n\" {lit(self.closer)}\n"
                f"body: {json_lark(schema)}")


class Generic(Hermes):
    """For templates that do not render tools: the tools described in a system message, calls written
    Hermes-style (the tags are plain text in any vocabulary)."""

    name = "generic"


def generic_system(tools: list[dict]) -> str:
    """The system text that offers `tools` to a model whose template does not."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You may call functions to help answer. The functions, as JSON Schemas:\n<tools>\n" + listing +
            "\n</tools>\nTo call one, answer with a JSON object of its name and arguments inside tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')




def _parse_json(text: str):
    """The JSON value `text` holds (whitespace around it allowed), or None."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def name_args(obj, names: Sequence[str], keys=("arguments", "parameters"), extra=()) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a call written as {"name": ..., "arguments" or "parameters": {...}}
    naming one of `names` (other keys only those in `extra`), else None. Arguments written as a JSON
    string (some models do) are read as the object it holds."""
    if not isinstance(obj, dict) or obj.get("name") not in names or set(obj) - {"name", *keys, *extra}:
        return None
    args = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):
        args = _parse_json(args)
    return (obj["name"], _args_json(args)) if isinstance(args, dict) else None


def call_schema(tools: list[dict], names: Sequence[str], key: str = "arguments", extra: dict | None = None) -> dict:
    """The JSON Schema of one call object {"name": n, key: n's arguments} of any of `names`."""
    alts = [{"type": "object", "properties": {"name": {"const": n}, key: tool_schema(tools, n), **(extra or {})},
             "required": ["name", key], "additionalProperties": False} for n in names]
    return alts[0] if len(alts) == 1 else {"anyOf": alts}
