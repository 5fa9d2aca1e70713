"""gpt-oss's harmony format: the answer is a run of messages, each a header and a body.

    <|channel|>analysis<|message|>reasoning...<|end|>
    <|start|>assistant<|channel|>final<|message|>the answer...<|return|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>

The analysis channel is reasoning, the final channel (and commentary addressed to no one) content, and
a commentary message addressed `to=functions.NAME` a call; the recipient may also stand before the
channel (`<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>`, as the chat
template writes past calls). The markers are control tokens, named in the text by the parser's
`markers` map when they decode to nothing.

OpenAI's openai-harmony package would render and parse this, but it downloads its vocabulary
(o200k_base) on first use, which a machine without network cannot: this module reads the format from
the text itself, and renders nothing (the model's chat template does that).
"""

from __future__ import annotations

import json
import re

from .parse import ChatMessage, Delta, StreamParser, _holdback, _Segment
from .syntax import ToolSyntax, _args_json, _parse_json
from .tools import ToolCall, call_ids, tool_schema

START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN = (
    "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>")
ENDS = (END, CALL, RETURN, START)  # what ends a body (a new <|start|> ends one left open)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


class HarmonyParser(StreamParser):
    """ChatParser's interface (feed, finish, message) for harmony answers: `names` the functions a call
    may name (none: calls are content), `markers` {token id: text} of the control tokens."""

    def __init__(self, names=(), markers: dict[int, str] | None = None, key: str = "", parallel: bool = True):
        self.names, self.markers, self.key, self.parallel = tuple(names), markers or {}, key, parallel
        self.state = "header"
        self.buf = ""
        self.kind = "content"  # the body's: "reasoning", "content" or "call:NAME"
        self.n_messages = self.n_calls = 0
        self.segment = _Segment()
        self.message = ChatMessage()

    def _header(self, out, final):
        i = self.buf.find(MESSAGE)
        if i < 0:
            if final and not self.n_messages:  # no harmony at all: the text is the content
                self._emit(out, "content", self.buf)
                self.buf = ""
            return
        head, self.buf = self.buf[:i], self.buf[i + len(MESSAGE):]
        to, channel = _RECIPIENT.search(head), _CHANNEL.search(head)
        name = to.group(1)[len("functions."):] if to and to.group(1).startswith("functions.") else None
        if name is not None and name in self.names and (self.parallel or not self.n_calls):
            self.kind = "call:" + name
        elif channel and channel.group(1) == "analysis":
            self.kind = "reasoning"
        else:
            self.kind = "content"
        self.n_messages += 1
        self.state = "body"

    def _body(self, out, final):
        ends = [(j, t) for t in ENDS if (j := self.buf.find(t)) >= 0]
        if ends:
            j, tag = min(ends)
            text, self.buf = self.buf[:j], self.buf[j + (0 if tag == START else len(tag)):]
        elif final:
            text, self.buf = self.buf, ""
        else:
            if self.kind.startswith("call:"):
                return  # a call is given whole, at its end
            keep = max(_holdback(self.buf, t) for t in ENDS)
            self._emit(out, self.kind, self.buf[:len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            return
        if self.kind.startswith("call:"):
            self._call(out, self.kind[5:], text)
        else:
            self._emit(out, self.kind, text)
            if self.kind == "reasoning" and self.message.reasoning_content is None and \
                    not any(d.kind == "reasoning" for d in out):
                out.append(Delta("reasoning", ""))  # the model reasoned (maybe nothing): say so
        self.segment.end()
        self.state = "header"

    def _call(self, out, name, text):
        args = _parse_json(text)
        if not isinstance(args, dict):
            self._emit(out, "content", text)  # not a call's arguments: given as written
            return
        args = _args_json(args)
        cid = call_ids(f"{self.key}\0{self.n_calls}\0{name}\0{args}", 1)[0]
        out.append(Delta("call", call=ToolCall(name, args, cid)))
        self.n_calls += 1


class Harmony(ToolSyntax):
    """gpt-oss. Reads reasoning itself (`reasoning`), so plan_chat adds no think tags; `make_parser`
    gives the parser in ChatParser's place."""

    name = "harmony"
    reasoning = "channels"
    opener, closer = CHANNEL, CALL
    markers = (START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN)

    def make_parser(self, names, markers, key="", parallel=True) -> HarmonyParser:
        return HarmonyParser(names, markers, key, parallel)

    def parse_body(self, body, names):  # a whole answer's calls (for callers outside a stream)
        p = HarmonyParser(names)
        p.feed(CHANNEL + body + CALL)
        p.finish()
        return [(c.name, c.arguments) for c in p.message.tool_calls] or None

    def call_rest(self, tools, names, lit):
        rules = [f"call_rest: {' | '.join(f'fn_{i}' for i in range(len(names)))}"]
        for i, n in enumerate(names):
            schema = json.dumps(tool_schema(tools, n), ensure_ascii=False)
            rules.append(f'fn_{i}: "commentary to=functions.{n} " {lit(CONSTRAIN)} "json" {lit(MESSAGE)} '
                         f"args_{i} {lit(CALL)}\nargs_{i}: %json {schema}")
        return "\n".join(rules)

    def grammar(self, tools, choice, parallel, lit, prefix=""):
        names = [t["function"]["name"] for t in tools] if choice in ("auto", "required") else [choice]

        def upto(rule, marker):  # free text through `marker`: lazy where the marker is plain text
            lazy = "" if lit(marker).startswith("<[") else "[lazy]"
            return f"{rule}{lazy}: TEXT {lit(marker)}"

        again = f'{lit(START)} "assistant"'
        calls = f"call ({again} call)*" if parallel else "call"
        answer = calls if choice != "auto" else f"{calls} | final"
        return ("%llguidance {}\n"
                f"start: analysis? ({answer})\n"
                f'analysis: {lit(CHANNEL)} "analysis" {lit(MESSAGE)} analysis_text {again}\n'
                f"{upto('analysis_text', END)}\n"
                f'final: {lit(CHANNEL)} "final" {lit(MESSAGE)} TEXT\n'
                f"call: {lit(CHANNEL)} call_rest\n"
                "TEXT: /(.|\\n)*/\n"
                f"{self.call_rest(tools, names, lit)}\n")
