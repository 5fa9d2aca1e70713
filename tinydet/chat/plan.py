"""A chat request made ready for the engine: the prompt (the model's template with the tools and the
template's own options), the grammar a call is held to, and the parser that reads the answer back.

Everything here is a pure function of the request and the tokenizer, so the server and the library
give the same prompt, grammar and answer for the same request.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from . import check_messages, render_chat
from .parse import ChatParser
from .syntax import ToolSyntax, generic_system
from .syntaxes import SYNTAXES, detect
from .tools import ToolError, check_history, check_tool_choice, check_tools

THINK = ("<think>", "</think>")
RESERVED = ("template", "messages", "tools", "add_generation_prompt", "bos_token", "eos_token")  # render_chat's own


@dataclass
class ChatPlan:
    prompt: str  # the rendered prompt text
    tools: list[dict] = field(default_factory=list)
    choice: str = "none"  # "auto" | "none" | "required" | a function's name
    parallel: bool = True
    syntax: ToolSyntax | None = None  # None: calls are not read (no tools, or tool_choice "none")
    think: tuple[str, str] | None = None
    in_think: bool = False  # the prompt ends inside the think tags
    markers: dict = field(default_factory=dict)  # control token id -> the text it stands for
    grammar: str | None = None  # Lark for llguidance: the calls' constraint, or None
    reader: ToolSyntax | None = None  # a syntax that reads the whole answer itself (harmony), tools or not

    @property
    def parses(self) -> bool:
        """Whether the answer needs the parser (else its text is the content, as a plain chat's)."""
        return self.syntax is not None or self.think is not None or self.reader is not None

    def parser(self, key: str = ""):
        """The answer's parser: a ChatParser, or the reader syntax's own (feed, finish, message alike)."""
        names = [t["function"]["name"] for t in self.tools] if self.choice in ("auto", "required") else [self.choice]
        if self.reader is not None:
            return self.reader.make_parser(names if self.syntax else (), self.markers, key, self.parallel)
        return ChatParser(self.syntax, names, self.think, self.in_think, self.markers, key, self.parallel)


def _control_id(tok, text: str) -> int | None:
    """The id of the control token written `text` (one token that decodes to nothing), else None."""
    try:
        ids = tok.encode(text, add_special=False)
    except Exception:  # noqa: BLE001 - a text the tokenizer cannot take is not a token of it
        return None
    if len(ids) == 1 and tok.decode(ids) == "":
        return ids[0]
    return None


def _system_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The tools as the JSON text of the system message's `tools` field (a system message is added
    where there is none), the place Phi-4-mini's template takes them from."""
    out = [dict(m) for m in messages]
    if not out or out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": ""})
    out[0]["tools"] = json.dumps([t["function"] for t in tools], ensure_ascii=False)
    return out


def _generic_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """A conversation with tools for a template that knows none: the tools described in the system
    message, calls written into the assistant's text, results as user turns (templates that know only
    user and assistant accept them)."""
    out = [dict(m) for m in messages]
    text = generic_system(tools)
    if out and out[0]["role"] in ("system", "developer"):
        out[0]["content"] = (out[0].get("content") or "") + "\n\n" + text
    else:
        out.insert(0, {"role": "system", "content": text})
    for m in out:
        if m.get("tool_calls"):
            calls = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                             "arguments": c["function"]["arguments"]},
                                                            ensure_ascii=False) + "\n</tool_call>"
                              for c in m.pop("tool_calls"))
            m["content"] = ((m.get("content") or "") + "\n" + calls).lstrip("\n")
        elif m["role"] == "tool":
            m.pop("tool_call_id", None)
            m.update(role="user", content=f"<tool_response>\n{m['content']}\n</tool_response>")
    return out


def think_prefix(in_think: bool) -> str:
    """Lark rules for `prefix`: the model's think block before a required call (the rest of it when the
    prompt opened it; optional when not), then the blank line the templates write after it."""
    body = r'/(.|\n)*<\/think>/' if in_think else r'/<think>(.|\n)*<\/think>/'
    return f'prefix: (think_block "\\n\\n"){"" if in_think else "?"}\nthink_block[lazy]: {body}'


def plan_chat(tokenizer, messages: Sequence[Mapping], tools=None, tool_choice=None, parallel_tool_calls: bool = True,
              template_kwargs: Mapping | None = None, syntax: str | None = None) -> ChatPlan:
    """The plan of a chat request (tools and tool_choice as OpenAI's API takes them; `template_kwargs`
    the template's own options, such as enable_thinking or reasoning_effort; `syntax` a call syntax's
    name to use instead of the one the template shows). Bad tools or history raise ToolError."""
    template = tokenizer.chat_template
    for key in template_kwargs or {}:
        if key in RESERVED:
            raise ToolError(f"chat_template_kwargs.{key}", "set by the request itself, not an option")
    tools = check_tools(tools) if tools is not None else []
    choice = check_tool_choice(tool_choice, tools)
    messages = check_history(check_messages(messages))
    syn = SYNTAXES[syntax]() if syntax else detect(template)
    if syn.name == "generic" and (tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)):
        messages = _generic_messages(messages, tools)
        render_tools = None
    else:
        render_tools = tools or None
        if tools and re.search(r"message\[['\"]tools['\"]\]|message\.tools", template or ""):
            messages = _system_tools(messages, tools)  # Phi-4-mini's template reads them from the system message
    name = lambda i: tokenizer.id_to_token(i) if i is not None else ""  # noqa: E731
    prompt = render_chat(template, messages, bos_token=name(tokenizer.bos_id),
                         eos_token=name(tokenizer.eos_ids[0] if tokenizer.eos_ids else None), tools=render_tools,
                         **dict(template_kwargs or {}))
    plan = ChatPlan(prompt, tools, choice, bool(parallel_tool_calls))
    own = getattr(syn, "reasoning", None)  # a syntax that reads reasoning itself (harmony's channels)
    if own is None and template and THINK[0] in template:
        plan.think = THINK
        plan.in_think = prompt.rstrip().endswith(THINK[0])
    if own is not None:
        plan.reader = syn
    if choice == "none" and own is None:
        return plan
    for text in (*syn.markers, *(plan.think or ())):
        tid = _control_id(tokenizer, text)
        if tid is not None:
            plan.markers[tid] = text
    if choice == "none":
        return plan
    plan.syntax = syn
    control = {t: i for i, t in plan.markers.items()}
    lit = lambda text: f"<[{control[text]}]>" if text in control else json.dumps(text, ensure_ascii=False)  # noqa: E731
    prefix = ""
    if choice != "auto" and plan.think is not None and not plan.prompt.rstrip().endswith(THINK[1]):
        prefix = think_prefix(plan.in_think)  # a required call may come after the model's reasoning
    plan.grammar = syn.grammar(tools, choice, plan.parallel, lit, prefix)
    return plan
