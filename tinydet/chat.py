"""Chat templates: the model's Jinja template rendered in jinja2's sandbox, as HF transformers does.

The sandbox matters: a template comes from a model file, and a model file must not be able to read
files or call into Python."""

from __future__ import annotations

from datetime import datetime
from functools import lru_cache
from typing import Mapping, Sequence

from .errors import TinydetError

ROLES = ("system", "user", "assistant", "tool")


class ChatTemplateError(TinydetError):
    """A chat template is missing, does not parse, or fails while rendering."""


def _raise(message: str):
    raise ChatTemplateError(f"chat template: {message}")


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    # Templates that print today's date get a fixed one: a clock would break determinism.
    env.globals["strftime_now"] = lambda fmt: datetime(2024, 1, 1).strftime(fmt)
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise ChatTemplateError(f"chat template does not parse: {e}") from None


def check_messages(messages: Sequence[Mapping[str, str]]) -> list[dict]:
    out = []
    if not messages:
        raise TinydetError("messages: expected at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise TinydetError(f"messages[{i}]: expected a mapping with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise TinydetError(f"messages[{i}].role: expected one of {', '.join(ROLES)}, found {m['role']!r}")
        if not isinstance(m["content"], str):
            raise TinydetError(f"messages[{i}].content: expected a string")
        out.append(dict(m))
    return out


def render_chat(template: str | None, messages: Sequence[Mapping[str, str]], bos_token: str = "",
                eos_token: str = "", add_generation_prompt: bool = True) -> str:
    """The prompt text for `messages`, ending with the assistant's turn opener when asked."""
    if not template:
        raise ChatTemplateError("chat: the model has no chat template (tokenizer.chat_template)")
    from jinja2 import TemplateError

    try:
        return _compile(template).render(messages=check_messages(messages), bos_token=bos_token,
                                         eos_token=eos_token, add_generation_prompt=add_generation_prompt)
    except TemplateError as e:
        raise ChatTemplateError(f"chat template failed to render: {e}") from None
