"""Chat with tools and reasoning for `tinydet serve`: a chat request made ready (`chat.plan`: the prompt
with the tools, the grammar a call is held to), every fault a 400 naming its field before any model
work; and a choice's answer read back by its parser, whole (`message`) and as OpenAI's stream deltas.

A request without tools whose template does not think gets no parser: its answer is its text, as
before, byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import TinydetError
from .protocol import APIError, ChatCompletionRequest
from .streaming import _Job


@dataclass
class ChatPrep:
    plan: object  # chat.plan.ChatPlan
    ids: list[int]  # the prompt's token ids
    constraint: dict  # for Model.request: the calls' grammar, the request's own constraint, or {}


def compile_constraint(model, param: str, **constraint) -> None:
    """Compile a constraint now (then cached), a 400 naming `param` if llguidance refuses it."""
    from ..structured import ConstraintError

    try:
        model.constraint(**constraint)
    except ConstraintError as e:
        raise APIError(400, f"{param}: {e.why}", param=param) from None
    except TinydetError as e:  # the structured extra is missing
        raise APIError(400, f"{param}: {e}", param=param) from None


def prepare(model, body: ChatCompletionRequest, constraint: tuple[str, dict]) -> ChatPrep:
    """The request's plan, prompt ids and constraint; `constraint` is (its field, the compiled
    constraint) from the request's response_format / structured_outputs / grammar."""
    from ..chat.tools import ToolError

    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        kwargs["reasoning_effort"] = body.reasoning_effort
    try:
        plan = model.chat_plan([m.plain() for m in body.messages], body.tools, body.tool_choice,
                               body.parallel_tool_calls, kwargs or None)
    except ToolError as e:
        raise APIError(400, str(e), param=e.param) from None
    except TinydetError as e:
        raise APIError(400, f"messages: {e}", param="messages") from None
    asker, own = constraint
    if plan.grammar is None:
        return ChatPrep(plan, model.tokenize(plan.prompt, add_special=False), own)
    if own:
        raise APIError(400, f"{asker}: cannot hold a reply that may call tools (set tool_choice to 'none' for a "
                            "constrained text reply)", param=asker)
    try:
        model.constraint(grammar=plan.grammar)
    except Exception:  # noqa: BLE001 - find the tool whose schema llguidance refuses, to name it
        for i, t in enumerate(plan.tools):
            compile_constraint(model, f"tools[{i}].function.parameters", json_schema=t["function"]["parameters"])
        compile_constraint(model, "tools", grammar=plan.grammar)
    return ChatPrep(plan, model.tokenize(plan.prompt, add_special=False), {"grammar": plan.grammar})


def attach(jobs: list[_Job], prep: ChatPrep, seed: int) -> None:
    """Give each choice its parser when the answer is read back (call ids from its prompt, the
    request's seed and its index, as `Model.chat`'s)."""
    from ..api import chat_key

    if prep.plan.parses:
        for j in jobs:
            j.parser = prep.plan.parser(chat_key(prep.ids, seed, j.index))


def message(job: _Job) -> dict:
    """The choice's message as OpenAI gives it."""
    if job.parser is None:
        return {"role": "assistant", "content": "".join(job.text)}
    return job.parser.message.openai()


def reason(job: _Job, reason: str) -> str:
    """The finish reason: "tool_calls" where an answer that stopped made calls."""
    return reason if job.parser is None else job.parser.message.finish_reason(reason)


def deltas(job: _Job) -> list[dict]:
    """OpenAI's chunk deltas for what the choice's last message completed: reasoning and content
    pieces; a call as its head (id, name, empty arguments) and then its arguments."""
    out = []
    calls = [d for d in job.deltas if d.kind == "call"]
    index = len(job.parser.message.tool_calls) - len(calls)  # the first new call's place in the answer
    for d in job.deltas:
        if d.kind == "reasoning":
            out.append({"reasoning_content": d.text})
        elif d.kind == "content":
            out.append({"content": d.text})
        else:
            c = d.call
            out.append({"tool_calls": [{"index": index, "id": c.id, "type": "function",
                                        "function": {"name": c.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": index, "function": {"arguments": c.arguments}}]})
            index += 1
    return out
