"""The table of tool-call syntaxes, and which one a chat template's model writes.

Adding a family is its class (syntax.py, families.py, harmony.py) and one row here.
"""

from __future__ import annotations

from .families import Llama3Json, Mistral, MistralArgs, Phi4Mini
from .harmony import Harmony
from .syntax import Generic, Hermes, ToolSyntax

SYNTAXES: dict[str, type[ToolSyntax]] = {c.name: c for c in (Hermes, Generic, Llama3Json, Mistral, MistralArgs,
                                                             Phi4Mini, Harmony)}


def detect(template: str | None) -> ToolSyntax:
    """The syntax a chat template's model writes calls in (its own markers in the template's text); the
    generic form for a template that does not render tools."""
    t = template or ""
    checks = (("harmony", "<|channel|>" in t and "<|call|>" in t),
              ("mistral_args", "[TOOL_CALLS]" in t and "[ARGS]" in t),
              ("mistral", "[TOOL_CALLS]" in t),
              ("hermes", "<tool_call>" in t and "tools" in t),
              ("llama3_json", '"parameters"' in t and "<|eot_id|>" in t and "tools" in t),
              ("phi4_mini", "functools" in t or ("<|tool|>" in t and "<|/tool|>" in t)))
    return SYNTAXES[next((name for name, hit in checks if hit), "generic")]()

