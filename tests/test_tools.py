"""Tool calling and reasoning in the library (`Model.chat(tools=...)`, tinydet/chat/): a required or
named call parses and validates against its function's schema (checked by `jsonschema`, not by the
library that constrained it); the same request gives the same bytes, call ids included, alone, batched
among plain and structured requests, prefilled in chunks, with the prefix cache, speculating and at
any thread count; a thinking template's reasoning comes apart from the content; bad tools are
errors naming the field."""

from __future__ import annotations

import contextlib
import json

import pytest

pytest.importorskip("llguidance", reason="tool calls are held to their schema by llguidance: pip install 'tinydet[structured]'")
import jsonschema  # noqa: E402

from tinydet.api import chat_key  # noqa: E402
from tinydet.chat.tools import ToolError  # noqa: E402
from tinydet.engine.speculate import NgramDrafter  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 60},
                                                    "top": {"type": "integer", "minimum": 1, "maximum": 10},
                                                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                             "maxItems": 3}},
                   "required": ["query"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD, SEARCH]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
# A DeepSeek-R1-style ChatML template: the reply opens inside <think>.
THINK_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


@pytest.fixture(scope="module")
def smollm(smollm_models):
    return smollm_models("native")


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def schema_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def check_calls(g, names) -> None:
    assert g.message.tool_calls, g.text
    for c in g.message.tool_calls:
        assert c.name in names
        jsonschema.validate(json.loads(c.arguments), schema_of(c.name))
        assert c.id.startswith("call_") and len(c.id) == 29


def answer(g) -> tuple:
    return g.token_ids, g.output_hash, g.logits_hash, g.finish_reason, g.message.openai()


@pytest.mark.parametrize("choice", ["required", "add", "search"])
def test_required_and_named_calls_validate(smollm, choice):
    for kw in ({}, dict(temperature=0.7, seed=5)):
        g = smollm.chat(ASK, max_tokens=80, tools=TOOLS, tool_choice=choice if choice == "required" else named(choice),
                        parallel_tool_calls=False, **kw)
        check_calls(g, [t["function"]["name"] for t in TOOLS] if choice == "required" else [choice])
        assert g.finish_reason == "tool_calls" and g.message.content is None
        assert len(g.message.tool_calls) == 1


def test_named_call_as_openai_object_and_repeat_gives_same_ids(smollm):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    a = smollm.chat(ASK, max_tokens=60, tools=TOOLS, tool_choice=choice)
    b = smollm.chat(ASK, max_tokens=60, tools=TOOLS, tool_choice=choice)
    check_calls(a, ["get_weather"])
    assert answer(a) == answer(b)


def test_auto_reads_calls_or_text_and_none_renders_tools_without_reading(smollm):
    auto = smollm.chat(ASK, max_tokens=48, tools=TOOLS)
    if auto.message.tool_calls:
        check_calls(auto, [t["function"]["name"] for t in TOOLS])
    else:
        assert auto.message.content == auto.text.strip()
    none = smollm.chat(ASK, max_tokens=24, tools=TOOLS, tool_choice="none")
    assert none.message.tool_calls == [] and none.message.content == none.text
    # the tools are in the prompt (the generic form's system text) either way
    assert "get_weather" in smollm.chat_plan(ASK, tools=TOOLS, tool_choice="none").prompt


@contextlib.contextmanager
def template(model, text):
    saved, model.tokenizer.chat_template = model.tokenizer.chat_template, text
    try:
        yield
    finally:
        model.tokenizer.chat_template = saved


def test_contract_alone_batched_chunked_cached_speculating_threads(smollm, restore_threads):
    """A required and an auto request with tools, and a thinking request (a template that opens <think>,
    a named call after the reasoning): the same bytes and message alone, among plain and structured
    requests (prefilled 7 tokens a step), through an engine with the prefix cache (cold and warm),
    speculating, and at 3 threads."""
    cases, alone = [], []
    for choice, kw, tmpl in (("required", {}, None), ("auto", dict(temperature=0.7, seed=11), None),
                             (named("add"), dict(temperature=0.7, seed=3), THINK_TEMPLATE)):
        with template(smollm, tmpl or smollm.tokenizer.chat_template):
            plan = smollm.chat_plan(ASK, tools=TOOLS, tool_choice=choice)
            alone.append(smollm.chat(ASK, max_tokens=90, tools=TOOLS, tool_choice=choice, **kw))
        ids = smollm.tokenize(plan.prompt, add_special=False)
        cases.append((plan, dict(prompt=ids, max_tokens=90, grammar=plan.grammar, **kw)))
    assert alone[0].message.tool_calls and alone[2].message.reasoning_content is not None

    def read(plan, r, g):
        return answer(smollm.read_chat(plan, g, chat_key(r["prompt"], r.get("seed", 0))))

    want = [answer(g) for g in alone]
    plain = [dict(prompt="Once upon a time", max_tokens=20), dict(prompt="The sky is", max_tokens=12, temperature=0.8, seed=2),
             dict(prompt="Name:", max_tokens=16, json_schema={"type": "object", "properties": {"n": {"type": "string"}}})]
    mixed = plain[:1] + [cases[0][1]] + plain[1:] + [cases[1][1], cases[2][1]]
    out = smollm.generate_batch(mixed, max_batch=6, step_tokens=7)
    assert [read(p, r, out[mixed.index(r)]) for p, r in cases] == want
    engine = smollm.engine(4, step_tokens=16, prefix_cache_bytes=64 << 20)
    for warm in (False, True):  # cold, then the prompts' blocks from the cache
        handles = [engine.submit(smollm.request(**r)) for _, r in cases]
        engine.run()
        got = [h.result for h in handles]
        assert all(g.cached_tokens > 0 for g in got) == warm
        assert [read(p, r, g) for (p, r), g in zip(cases, got)] == want
    smollm.threads = 3
    smollm.speculative = NgramDrafter()
    try:
        assert [read(p, r, smollm.generate(**r)) for p, r in cases] == want
    finally:
        smollm.speculative = None


def test_thinking_template_splits_reasoning_from_content(smollm):
    with template(smollm, THINK_TEMPLATE):
        plan = smollm.chat_plan(ASK)
        assert plan.in_think and plan.think == ("<think>", "</think>")
        g = smollm.chat(ASK, max_tokens=40)
        # the prompt opened <think>: everything before a </think> is reasoning
        if "</think>" in g.text:
            head, tail = g.text.split("</think>", 1)
            assert g.message.reasoning_content == head.strip() and g.message.content == (tail.strip() or None)
        else:
            assert g.message.reasoning_content == g.text.strip() and g.message.content is None
        # a required call may follow the reasoning: the grammar lets the think block close first
        g = smollm.chat(ASK, max_tokens=200, tools=TOOLS, tool_choice=named("add"))
        assert g.text.count("</think>") == 1 or not g.message.tool_calls
        if g.finish_reason == "tool_calls":
            check_calls(g, ["add"])
            assert g.message.reasoning_content is not None


def test_multi_turn_agent_loop_twice_gives_identical_transcripts(smollm):
    def run():
        messages = [{"role": "user", "content": "Add 2 and 3, then tell me the sum."}]
        transcript = []
        for turn in range(3):
            g = smollm.chat(messages, max_tokens=60, tools=[ADD], tool_choice="required" if turn == 0 else "auto",
                            temperature=0.7, seed=turn)
            msg = g.message.openai()
            transcript.append(msg)
            messages.append(msg)
            if not g.message.tool_calls:
                break
            for c in g.message.tool_calls:
                args = json.loads(c.arguments)
                messages.append({"role": "tool", "tool_call_id": c.id, "content": str(args["a"] + args["b"])})
        return transcript

    first = run()
    assert first[0]["tool_calls"] and first == run()


@pytest.mark.parametrize("kw, param", [
    (dict(tools=[{"type": "retrieval"}]), "tools[0].type"),
    (dict(tools=[WEATHER, {"type": "function", "function": {"name": "bad name!"}}]), "tools[1].function.name"),
    (dict(tools=[WEATHER, WEATHER]), "tools[1].function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]),
     "tools[0].function.parameters.type"),
    (dict(tools=[WEATHER], tool_choice="add"), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "add"}}), "tool_choice.function.name"),
    (dict(tools=[WEATHER] * 200), "tools"),
    (dict(tools=None, tool_choice="required"), "tool_choice"),
])
def test_bad_tools_name_the_field(smollm, kw, param):
    with pytest.raises(ToolError) as e:
        smollm.chat_plan(ASK, **kw)
    assert e.value.param == param


@pytest.mark.parametrize("messages, param", [
    (ASK + [{"role": "tool", "tool_call_id": "call_x", "content": "1"}], "messages[1].tool_call_id"),
    (ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}],
     "messages[1].tool_calls[0].function.arguments"),
    (ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "[1, 2]"}}]}],
     "messages[1].tool_calls[0].function.arguments"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls"),
])
def test_bad_history_names_the_field(smollm, messages, param):
    with pytest.raises(ToolError) as e:
        smollm.chat_plan(messages, tools=[ADD])
    assert e.value.param == param


def test_a_schema_llguidance_refuses_is_an_error_before_generation(smollm):
    from tinydet.structured import ConstraintError

    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "(unclosed"}}}}}
    with pytest.raises(ConstraintError):
        smollm.chat(ASK, max_tokens=4, tools=[bad], tool_choice="required")


# -- the CLI ----------------------------------------------------------------------------------------

def test_cli_generate_json_reports_calls_and_chat_runs_the_loop(smollm_path, smollm, tmp_path):
    import subprocess
    import sys

    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([ADD]))
    run = lambda cmd, *a, **kw: subprocess.run([sys.executable, "-m", "tinydet", cmd, "--model", str(smollm_path),  # noqa: E731
                                                "--dtype", "native", "--temperature", "0", *a], capture_output=True,
                                               text=True,
                                               timeout=600, **kw)
    r = run("generate", "Add 2 and 3", "--chat", "--tools", str(tools), "--tool-choice", "add", "--max-tokens", "40",
            "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    want = smollm.chat([{"role": "user", "content": "Add 2 and 3"}], max_tokens=40, tools=[ADD], tool_choice=named("add"))
    assert out["message"] == want.message.openai() and out["output_hash"] == want.output_hash
    call = out["message"]["tool_calls"][0]
    # chat: the call is shown, the typed line goes back as the tool's result, the model answers
    r = run("chat", "--tools", str(tools), "--tool-choice", "add", "--max-tokens", "40",
            input="Add 2 and 3\n5\n\n")
    assert r.returncode == 0, r.stderr
    assert f"[call {call['id']}] add({call['function']['arguments']})" in r.stdout
    assert f"result of add [{call['id']}]> " in r.stdout
    tools.write_text(json.dumps([{"type": "function", "function": {"name": "a b"}}]))
    r = run("generate", "x", "--chat", "--tools", str(tools))
    assert r.returncode == 1 and "tools[0].function.name" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    tools.write_text(json.dumps({"tools": [ADD]}))
    r = run("generate", "x", "--tools", str(tools))
    assert r.returncode == 2 and "--tools only with --chat" in r.stderr


def test_template_kwargs_cannot_set_what_the_request_sets(smollm):
    with pytest.raises(ToolError) as e:
        smollm.chat_plan(ASK, chat_template_kwargs={"bos_token": "x"})
    assert e.value.param == "chat_template_kwargs.bos_token"
    # an option the template does not read changes nothing
    assert smollm.chat_plan(ASK, chat_template_kwargs={"enable_thinking": False}).prompt == smollm.chat_plan(ASK).prompt
