"""An assistant's output split into reasoning, content and tool calls, as it streams.

`ChatParser.feed(text, token)` takes each piece of output text as the engine produced it (with the
token, so that a control token the syntax uses, decoded to nothing, is named in the text) and returns
the deltas it completes; `finish()` the rest. The whole answer is the same parser fed the same pieces,
so a stream's deltas joined equal the answer exactly, wherever the pieces break.

- Reasoning: text between the template's think tags (`<think>`...`</think>`) at the start of the
  output, or from the start when the prompt already opened them (DeepSeek-R1's template does). It is
  streamed as it comes; a suffix that could begin the closing tag is held back.
- Content: text outside reasoning and calls, streamed as it comes; a suffix that could begin a call's
  opener is held back. Whitespace next to a tag or a call is trimmed.
- Calls: a call is given whole, once its closer arrives (or the output ends, for syntaxes whose calls
  run to the end) and its text parses as a call of a known function; text that does not parse is
  content, as written. A stream therefore never carries a call the final answer lacks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .tools import ToolCall, call_ids

if TYPE_CHECKING:  # for annotations only
    from .syntax import ToolSyntax


@dataclass
class Delta:
    kind: str  # "reasoning" | "content" | "call"
    text: str = ""
    call: ToolCall | None = None


@dataclass
class ChatMessage:
    """An assistant's answer: content (None when it is only calls), reasoning_content, tool_calls."""

    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, d: Delta) -> None:
        if d.kind == "call":
            self.tool_calls.append(d.call)
        elif d.kind == "reasoning":
            self.reasoning_content = (self.reasoning_content or "") + d.text
        else:
            self.content = (self.content or "") + d.text

    def finish_reason(self, reason: str) -> str:
        """OpenAI's finish reason for an answer the engine ended with `reason`: "tool_calls" where it
        stopped after making calls."""
        return "tool_calls" if self.tool_calls and reason == "stop" else reason

    def openai(self) -> dict:
        out = {"role": "assistant", "content": self.content if self.content or not self.tool_calls else None}
        if self.content is None and not self.tool_calls:
            out["content"] = ""
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [c.openai() for c in self.tool_calls]
        return out


def _holdback(text: str, tag: str) -> int:
    """Length of the longest proper suffix of `text` that is a prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class _Segment:
    """A run of reasoning or content text with the whitespace at its ends trimmed, streamed: leading
    whitespace is dropped, trailing whitespace held until more text follows it."""

    def __init__(self):
        self.started, self.pending = False, ""

    def push(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        text = self.pending + text
        kept = text.rstrip()
        self.pending = text[len(kept):]
        return kept

    def end(self) -> None:
        self.started, self.pending = False, ""


class StreamParser:
    """What ChatParser and harmony's parser share: text fed in (a control token named by `markers`),
    each state's step (`_<state>(out, final)`) run until it stops changing, the deltas added to
    `message`. Subclasses set state, buf, markers, segment and message."""

    state: str
    buf: str
    markers: dict
    segment: _Segment
    message: ChatMessage

    def feed(self, text: str, token: int | None = None) -> list[Delta]:
        if token is not None and token in self.markers:
            # a control token decodes to nothing: its name goes after whatever text the step released
            # (a server's event may carry text held back for a stop string), as it came after it
            text += self.markers[token]
        self.buf += text
        return self._run(final=False)

    def finish(self) -> list[Delta]:
        return self._run(final=True)

    def _emit(self, out: list[Delta], kind: str, text: str) -> None:
        text = self.segment.push(text)
        if text:
            out.append(Delta(kind, text))

    def _run(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        while True:
            before = (self.state, len(self.buf))
            getattr(self, f"_{self.state}")(out, final)
            if (self.state, len(self.buf)) == before:
                break
        for d in out:
            self.message.add(d)
        return out


class ChatParser(StreamParser):
    """One answer's parser. `syntax`: the tool-call syntax (None: no tools offered); `names`: the
    functions a call may name; `think`: (open tag, close tag) or None; `in_think`: the prompt ended
    inside the think tags; `markers`: {token id: text} for control tokens the text must show;
    `key`: what call ids derive from (the request's hash)."""

    def __init__(self, syntax: ToolSyntax | None = None, names=(), think: tuple[str, str] | None = None,
                 in_think: bool = False, markers: dict[int, str] | None = None, key: str = "",
                 parallel: bool = True):
        self.syntax, self.names, self.think = syntax, tuple(names), think
        self.markers, self.key, self.parallel = markers or {}, key, parallel
        self.state = "think" if think and in_think else "start" if think else "content"
        self.buf = ""  # text not yet given out (in state "call": the call's text since its opener)
        self.n_calls = 0
        self.began = False  # for an anchored syntax: the output's start is decided (a call or text)
        self.segment = _Segment()
        self.message = ChatMessage()

    # -- the states -------------------------------------------------------------------------------

    def _start(self, out, final):
        opener = self.think[0]
        s = self.buf.lstrip()
        if s.startswith(opener):
            self.buf = s[len(opener):]
            self.state = "think"
        elif final or not opener.startswith(s):
            self.state = "content"

    def _think(self, out, final):
        close = self.think[1]
        i = self.buf.find(close)
        if i >= 0:
            self._emit(out, "reasoning", self.buf[:i])
            if not self.message.reasoning_content and not any(d.kind == "reasoning" for d in out):
                out.append(Delta("reasoning", ""))  # the model reasoned (maybe nothing): say so
            self.buf = self.buf[i + len(close):]
            self.segment.end()
            self.state = "content"
            return
        keep = 0 if final else _holdback(self.buf, close)
        self._emit(out, "reasoning", self.buf[:len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep:]
        if final:
            self.segment.end()

    def _anchored(self, final) -> bool:
        """For a syntax whose call must start the output: True once decided (the state may have become
        "call"), False while the text so far could still begin a call."""
        syn, s = self.syntax, self.buf.lstrip()
        lead = next((x for x in syn.leads if s.startswith(x)), "")
        s = s[len(lead):].lstrip()
        if s.startswith(syn.opener):
            self.buf, self.state = s[len(syn.opener):], "call"
        elif not final and any(x.startswith(s) for x in (syn.opener, *([] if lead else syn.leads))):
            return False
        self.began = True
        return True

    def _content(self, out, final):
        syn = self.syntax
        if syn is not None and syn.anchored and not self.began and (not self._anchored(final) or self.state == "call"):
            return
        done = syn is None or (not self.parallel and self.n_calls) or syn.anchored
        i = -1 if done else self.buf.find(syn.opener)
        if i >= 0:
            self._emit(out, "content", self.buf[:i])
            self.segment.end()
            self.buf = self.buf[i + len(syn.opener):]
            self.state = "call"
            return
        keep = 0 if final or done else _holdback(self.buf, syn.opener)
        self._emit(out, "content", self.buf[:len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep:]

    def _call(self, out, final):
        syn = self.syntax
        i = self.buf.find(syn.closer) if syn.closer is not None else -1
        if i < 0 and not final:
            return
        if i < 0:  # the output ended inside the call
            body, rest, closed = self.buf, "", syn.closer is None
            raw = syn.opener + body
        else:
            body, rest, closed = self.buf[:i], self.buf[i + len(syn.closer):], True
            raw = syn.opener + body + syn.closer
        calls = syn.parse_body(body.strip(), self.names) if closed else None
        if calls and not self.parallel:
            calls = calls[:1]
        if calls:
            for name, args in calls:
                cid = call_ids(f"{self.key}\0{self.n_calls}\0{name}\0{args}", 1, syn.id_style)[0]
                out.append(Delta("call", call=ToolCall(name, args, cid)))
                self.n_calls += 1
        else:
            self._emit(out, "content", raw)
        self.segment.end()
        self.buf = rest
        self.state = "content"
