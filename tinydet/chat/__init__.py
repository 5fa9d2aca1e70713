"""Chat templates: the model's Jinja template rendered in jinja2's sandbox, as HF transformers does.

The sandbox matters: a template comes from a model file, and a model file must not be able to read
files or call into Python. On top of jinja2's ImmutableSandboxedEnvironment (HF's own), a template
that reaches for Python internals (`__class__`, `__globals__`, `mro`, ...) is refused outright rather
than given an empty value, and a render is bounded: at most MAX_SECONDS of time and MAX_CHARS of text
written (output, block captures and macro bodies all count) or held in one string or list built by an
operator, method or filter. The time is checked at every loop step, call, filter and piece written,
in the rendering thread itself (the server renders on worker threads, where signals cannot reach);
operations that would allocate past the bound (`'x' * 10**10`, `center(10**10)`, `replace`, `join`,
`%` widths, huge powers) are refused before they run. Real templates (Llama 3's, Qwen's, Gemma's,
SmolLM2's) write a few kilobytes in a millisecond, far inside both bounds."""

from __future__ import annotations

import functools
import re
import threading
import time
from datetime import datetime
from functools import lru_cache
from typing import Mapping, Sequence

from ..errors import TinydetError

ROLES = ("system", "developer", "user", "assistant", "tool")  # developer: OpenAI's newer name for system


class ChatTemplateError(TinydetError):
    """A chat template is missing, does not parse, or fails while rendering."""


def _raise(message: str):
    raise ChatTemplateError(f"chat template: {_one_line(message)}")


MAX_CHARS = 8 << 20  # characters a render may write in all, or hold in one built string or list
# A list item costs a pointer and usually an object of its own: it counts as ITEM_COST characters, so a
# built list holds at most MAX_CHARS / ITEM_COST (131,072) items. A filter that walks a string character
# by character in Python (sort, batch, title, ...) runs only on strings of at most that many characters:
# it cannot be stopped midway, and 8M characters took seconds.
ITEM_COST = 64
# What a render may build in all (strings and lists, each counted when made): without it a loop can keep
# appending strings each under MAX_CHARS, gigabytes before the time bound.
MAX_MADE = 4 * MAX_CHARS
_PER_ITEM_FILTERS = frozenset({"list", "sort", "unique", "batch", "slice", "select", "reject", "selectattr",
                               "rejectattr", "map", "groupby", "max", "min", "title", "wordwrap", "wordcount",
                               "urlize", "join"})
_WHITESPACE = " \t\n\r\x0b\x0c"
MAX_SECONDS = 5.0
_MAX_INT_BITS = 1 << 16  # bits of an integer a power or product may make (big ints are computed in C)
_state = threading.local()  # this thread's render: .deadline (monotonic seconds), .written and .made (characters)
# printf-style widths and precisions (`%*s`, `%99999999d`) and str.format's (`{:99999999}`)
_PERCENT_SPEC = re.compile(r"%[#0 +\-]*(\*|\d+)?(?:\.(\*|\d+))?")
_FORMAT_SPEC = re.compile(r"\{[^{}]*:([^{}]*)\}")
_NESTED_SPEC = re.compile(r"\{[^{}]*:[^{}]*\{")


class _Runaway(ChatTemplateError):
    """A render went past its time or size bound."""


def _tick() -> None:
    deadline = getattr(_state, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise _Runaway(f"chat template stopped: rendering took over {MAX_SECONDS:g} s (a runaway loop?)")


def _too_big(what: str, n: int) -> None:
    if n > MAX_CHARS:
        raise _Runaway(f"chat template stopped: {what} would make {n} characters (a list item counts "
                       f"{ITEM_COST}), over the limit of {MAX_CHARS}")


def _made(what: str, n: int) -> None:
    """`n` characters built (or about to be): within the bound for one object and for the render."""
    _too_big(what, n)
    if hasattr(_state, "made"):
        _state.made += n
        if _state.made > MAX_MADE:
            raise _Runaway(f"chat template stopped: it built over {MAX_MADE} characters of strings and lists")


def _size(x) -> int:
    if isinstance(x, str):
        return len(x)
    return len(x) * ITEM_COST if isinstance(x, (list, tuple, dict)) else 0


def _check_format(fmt: str, braces: bool) -> None:
    """Refuse a format string whose widths or precisions would allocate past the bound."""
    specs = [g for m in _PERCENT_SPEC.finditer(fmt) for g in m.groups() if g]
    if braces and _NESTED_SPEC.search(fmt):  # '{0:{1}}': the width is an argument's, unseen here
        raise _Runaway("chat template stopped: a format width taken from an argument ('{0:{1}}') is not allowed")
    if braces:
        specs += re.findall(r"\d+", " ".join(_FORMAT_SPEC.findall(fmt)))
    for g in specs:
        if g == "*" or int(g) > MAX_CHARS:
            raise _Runaway(f"chat template stopped: format width {g!r} is over the limit of {MAX_CHARS}")


def _precheck(name: str, args: tuple, kwargs: dict) -> None:
    """Refuse a call (a str method, or the filter of that name) whose result would be past the bound:
    estimated from its arguments, as the allocation itself cannot be stopped once it starts."""
    for v in (*args[1:], *kwargs.values()):  # args[0] is the value (or the str), not a size
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_CHARS:
            _too_big(f"{name}() with argument {v}", abs(v))
    s = args[0] if args else None
    if name in _PER_ITEM_FILTERS:  # the filter's value, or str.join's separator or sequence
        for a in args:
            if isinstance(a, str):
                _too_big(f"{name}() over a string of {len(a)} characters", len(a) * ITEM_COST)
    if name in ("split", "rsplit", "splitlines") and isinstance(s, str):
        sep = args[1] if len(args) > 1 and isinstance(args[1], str) and args[1] else None
        pieces = 1 + (s.count(sep) if sep else sum(s.count(c) for c in _WHITESPACE))  # at most
        _too_big(f"{name}()", pieces * ITEM_COST)
    if name == "replace" and len(args) >= 3 and all(isinstance(a, str) for a in args[:3]):
        old, new = args[1], args[2]
        n = (len(s) + 1) if old == "" else s.count(old)
        _too_big("replace()", len(s) + n * max(0, len(new) - len(old)))
    elif name == "join":  # str.join(sep, seq) or the filter's join(seq, sep)
        seq = next((a for a in args if isinstance(a, (list, tuple))), None)
        sep = next((a for a in args if isinstance(a, str)), "")
        if seq is not None:
            _too_big("join()", sum(_size(x) for x in seq) + len(sep) * len(seq))
    elif name == "indent" and isinstance(s, str):
        width = args[1] if len(args) > 1 else kwargs.get("width", 4)
        _too_big("indent()", len(s) + (len(width) if isinstance(width, str) else int(width or 0)) * (s.count("\n") + 1))
    elif name == "format" and isinstance(s, str):
        _check_format(s, braces=False)
    elif name == "sum" and args and isinstance(args[0], (list, tuple)):
        _too_big("sum()", sum(_size(x) for x in args[0]))
    elif name == "slice" and len(args) > 1 and isinstance(args[1], int):
        _too_big("slice()", args[1] * ITEM_COST)  # it makes that many lists, empty or not
    elif name == "tojson" and isinstance(indent := args[1] if len(args) > 1 else kwargs.get("indent"), int):
        # each line's indent is the width times its depth: bounded by the lines and the brackets
        import json

        compact = json.dumps(s)
        brackets = compact.count("[") + compact.count("{")
        lines = 2 * brackets + compact.count(",") + 1
        _too_big("tojson()", len(compact) + lines * abs(indent) * brackets)


def _guard_filter(name: str, f):
    """A filter with the render's checks around it (jinja's pass_context/... markers are kept)."""
    @functools.wraps(f)
    def guarded(*args, **kwargs):
        if getattr(_state, "deadline", None) is None:
            # jinja folds a filter of constants at compile time, outside the bounds, into a literal of
            # the generated Python source (`'x'|center(8000000)`: 8 MB of source): refusing makes it
            # leave the filter to the render
            raise ChatTemplateError("chat template: filters run only while rendering")
        _tick()
        # the value is the first argument but for filters that take the context/environment first
        value_args = args[1:] if getattr(f, "jinja_pass_arg", None) is not None else args
        _precheck(name, value_args, kwargs)
        out = f(*args, **kwargs)
        _made(f"filter {name}", _size(out))
        return out
    return guarded


def _ticking(seq):
    """A loop's iterable, checking the clock at each step (the loop may write nothing and call nothing)."""
    for x in seq:
        _tick()
        yield x


def _lipsum(n=5, html=True, min=20, max=100):  # noqa: A002  (jinja's names) jinja's, its size checked first
    from jinja2.utils import generate_lorem_ipsum

    ints = [v if isinstance(v, int) else 0 for v in (n, max)]
    _made("lipsum()", ints[0] * ints[1] * 12)  # words of up to 11 characters and a space
    return generate_lorem_ipsum(n, html, min, max)


def _sandbox_classes():
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    class Generator(CodeGenerator):
        """Compiles every piece written (constant or not) through `environment.written`, and `~`
        through `environment.concat_checked`, so that their sizes count against the bound."""

        def _output_const_repr(self, group):
            return f"environment.written({super()._output_const_repr(group)})"

        def _output_child_pre(self, node, frame, finalize):
            self.write("environment.written(")
            super()._output_child_pre(node, frame, finalize)

        def _output_child_post(self, node, frame, finalize):
            super()._output_child_post(node, frame, finalize)
            self.write(")")

        def visit_Concat(self, node, frame):
            self.write("environment.concat_checked((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class Sandbox(ImmutableSandboxedEnvironment):
        code_generator_class = Generator
        intercepted_binops = frozenset({"+", "*", "**", "%"})

        def is_safe_attribute(self, obj, attr, value):
            return not attr.startswith("_") and super().is_safe_attribute(obj, attr, value)

        def unsafe_undefined(self, obj, attribute):
            # jinja2 returns an Undefined that prints as "": a template probing internals is refused instead
            raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object")

        def call_binop(self, context, operator, left, right):
            _tick()
            ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (left, right))
            if operator == "**" and ints and right > 0 and abs(left) > 1:
                if right * abs(left).bit_length() > _MAX_INT_BITS:
                    raise _Runaway(f"chat template stopped: {left} ** {right} is too large a number")
            elif operator == "*" and ints:
                if left.bit_length() + right.bit_length() > _MAX_INT_BITS:
                    raise _Runaway("chat template stopped: a product is too large a number")
            elif operator == "*":
                seq, n = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(n, int) and not isinstance(n, bool):
                    _made("repeating a sequence", _size(seq) * max(n, 0))
            elif operator == "+":
                _made("concatenation", _size(left) + _size(right))
            elif operator == "%" and isinstance(left, str):
                _check_format(left, braces=False)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own signature)
            _tick()
            owner = getattr(__obj, "__self__", None)
            name = getattr(__obj, "__name__", "")
            if isinstance(owner, str):
                _precheck(name, (owner, *args), kwargs)
            wrapped = getattr(__obj, "__wrapped__", None)  # the sandbox's str.format wrapper
            if name in ("format", "format_map") and isinstance(getattr(wrapped, "__self__", None), str):
                _check_format(wrapped.__self__, braces=True)
            out = super().call(__context, __obj, *args, **kwargs)
            _made(f"{name or 'a call'}()", _size(out))
            return out

        def written(self, piece):
            _tick()
            if hasattr(_state, "written"):
                _state.written += len(piece)
                if _state.written > MAX_CHARS:
                    raise _Runaway(f"chat template stopped: it wrote over {MAX_CHARS} characters")
            return piece

        def concat_checked(self, parts):
            parts = [str(p) for p in parts]
            _made("concatenation (~)", sum(len(p) for p in parts))
            return "".join(parts)

    return Sandbox


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2 import TemplateError, nodes

    env = _sandbox_classes()(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    env.globals["lipsum"] = _lipsum
    # Templates that print today's date get a fixed one: a clock would break determinism.
    env.globals["strftime_now"] = lambda fmt: datetime(2024, 1, 1).strftime(fmt)
    env.filters["tojson"] = _tojson
    env.filters = {name: _guard_filter(name, f) for name, f in env.filters.items()}
    env.filters["tinydet_ticking"] = _ticking
    try:
        ast = env.parse(template)
        for loop in ast.find_all(nodes.For):  # every loop's iterable checks the clock at each step
            loop.iter = nodes.Filter(loop.iter, "tinydet_ticking", [], [], None, None, lineno=loop.lineno)
        ast.set_environment(env)
        return env.from_string(ast)
    except (TemplateError, SyntaxError) as e:  # SyntaxError: Python's, on the code jinja made ({% break %} outside a loop)
        raise ChatTemplateError(f"chat template does not parse: {_one_line(e)}") from None
    except RecursionError:
        raise ChatTemplateError("chat template does not parse: it nests too deeply") from None


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' names for it, in its order


def check_messages(messages: Sequence[Mapping]) -> list[dict]:
    """The messages as plain dicts, each checked: a known role, text content (None where an assistant's
    turn is only tool calls). Other keys (tool_calls, tool_call_id, name, reasoning_content) pass through
    to the template; an assistant's reasoning is given under each name templates read, as transformers does."""
    out = []
    # A str, bytes or dict iterates (as characters, ints, keys) but is not a list of messages.
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes, bytearray)):
        raise TinydetError(f"messages: expected a list of message dicts, found {repr(messages)[:40]}")
    if not messages:
        raise TinydetError("messages: expected at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or ("content" not in m and not m.get("tool_calls")):
            raise TinydetError(f"messages[{i}]: expected a mapping with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise TinydetError(f"messages[{i}].role: expected one of {', '.join(ROLES)}, found {m['role']!r}")
        content = m.get("content")
        if not (isinstance(content, str) or (content is None and m.get("tool_calls"))):
            raise TinydetError(f"messages[{i}].content: expected a string")
        m = dict(m)
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' tojson (jinja2's own escapes <, >, & and ' and sorts keys): tool schemas render as
    the model was trained on them."""
    import json

    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def render_chat(template: str | None, messages: Sequence[Mapping], bos_token: str = "",
                eos_token: str = "", add_generation_prompt: bool = True, tools: Sequence[Mapping] | None = None,
                **kwargs) -> str:
    """The prompt text for `messages`, ending with the assistant's turn opener when asked. `tools` (OpenAI's
    function tools) and `kwargs` (chat_template_kwargs: enable_thinking, reasoning_effort, ...) reach the
    template as transformers' apply_chat_template passes them."""
    if not template:
        raise ChatTemplateError("chat: the model has no chat template (tokenizer.chat_template)")
    from jinja2.sandbox import SecurityError

    compiled = _compile(template)
    msgs = check_messages(messages)
    _state.deadline, _state.written, _state.made = time.monotonic() + MAX_SECONDS, 0, 0
    try:
        context = {**kwargs, "messages": msgs, "bos_token": bos_token, "eos_token": eos_token,
                   "add_generation_prompt": add_generation_prompt}
        if tools is not None:
            context["tools"] = [dict(t) for t in tools]
        return "".join(compiled.generate(**context))
    except ChatTemplateError:
        raise
    except SecurityError as e:
        raise ChatTemplateError(f"chat template refused: it reaches for Python internals ({_one_line(e)})") from None
    except RecursionError:
        raise ChatTemplateError("chat template failed to render: it recurses too deeply") from None
    except Exception as e:  # whatever jinja2 or an operation raises inside (TypeError, OverflowError, ...)
        raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {_one_line(e)}") from None
    finally:
        del _state.deadline, _state.written, _state.made


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
