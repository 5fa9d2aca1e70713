"""Tools and reasoning over HTTP: /v1/chat/completions with tools (SmolLM2, whose template shows no
call format, so the generic Hermes-style form applies) and the stateless /v1/responses, called with the
`openai` client. A call's arguments validate against its function's schema; a stream joined equals
the whole answer; the same request gives the same ids, alone or among other clients; every bad field
is a 400 naming it. Reasoning is split by a template with think tags (a stories model given one)."""

from __future__ import annotations

import copy
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

jsonschema = pytest.importorskip("jsonschema")
from test_serve import NAME, client, serving  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
RTOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's shape


@pytest.fixture(scope="module")
def smollm(smollm_models):
    return smollm_models("fp32")


@pytest.fixture(scope="module")
def server(smollm):
    with serving(smollm, max_batch=8) as (url, _):
        yield url


def _joined(chunks):
    """A chat stream's choice 0 joined: (content, reasoning, calls, finish_reason)."""
    content, reasoning, calls, reason = "", None, {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        d, reason = ch.choices[0].delta, ch.choices[0].finish_reason or reason
        content += d.content or ""
        if getattr(d, "reasoning_content", None) is not None:
            reasoning = (reasoning or "") + d.reasoning_content
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = tc.id or c["id"]
            c["name"] += tc.function.name or "" if tc.function else ""
            c["arguments"] += tc.function.arguments or "" if tc.function else ""
    return content, reasoning, [calls[k] for k in sorted(calls)], reason


def _whole(msg):
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in msg.tool_calls or []]
    return msg.content or "", getattr(msg, "reasoning_content", None), calls


# -- chat completions ---------------------------------------------------------------------------------

@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_call_validates_and_equals_model_chat(server, smollm, choice):
    c = client(server)
    kw = dict(tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, max_tokens=48, temperature=0)
    r = c.chat.completions.create(model=NAME, messages=ASK, **kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)
    # the library's answer to the same request: the same message, the same call ids
    g = smollm.chat(ASK, max_tokens=48, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
    want = [{"id": t.id, "name": t.name, "arguments": t.arguments} for t in g.message.tool_calls]
    assert _whole(ch.message) == (g.message.content or "", g.message.reasoning_content, want)
    assert ch.finish_reason == g.finish_reason
    # streamed: the pieces joined equal the whole answer, ids included; the same request gives the same ids
    content, reasoning, calls, reason = _joined(c.chat.completions.create(model=NAME, messages=ASK, stream=True, **kw))
    assert (content, reasoning, calls, reason) == (*_whole(ch.message), "tool_calls")
    again = c.chat.completions.create(model=NAME, messages=ASK, **kw)
    assert again.choices[0].message.tool_calls == ch.message.tool_calls


def test_auto_parallel_stream_equals_whole_and_history_round_trip(server, smollm):
    c = client(server)
    kw = dict(tools=TOOLS, max_tokens=40, temperature=0)
    for choice in ("auto", "required"):
        whole = c.chat.completions.create(model=NAME, messages=ASK, tool_choice=choice, **kw).choices[0]
        joined = _joined(c.chat.completions.create(model=NAME, messages=ASK, tool_choice=choice, stream=True, **kw))
        assert joined[:3] == _whole(whole.message) and joined[3] == whole.finish_reason
    # a conversation with an assistant's calls (content null) and the tool's answer
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "C"}'}}
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"}]
    r = c.chat.completions.create(model=NAME, messages=history, max_tokens=12, temperature=0,
                                  extra_body={"return_token_ids": True}, **{"tools": TOOLS})
    assert r.choices[0].prompt_token_ids == smollm.chat_prompt(history, tools=TOOLS)


def test_plain_chat_has_no_tool_fields(server):
    r = httpx.post(f"{server}/v1/chat/completions", json=dict(model=NAME, messages=ASK, max_tokens=6, temperature=0))
    msg = r.json()["choices"][0]["message"]
    assert set(msg) == {"role", "content"} and r.json()["choices"][0]["finish_reason"] == "length"


def test_tools_with_a_constraint_only_with_tool_choice_none(server):
    body = dict(model=NAME, messages=ASK, tools=TOOLS, max_tokens=8, temperature=0,
                response_format={"type": "json_object"})
    r = httpx.post(f"{server}/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    r = httpx.post(f"{server}/v1/chat/completions", json={**body, "tool_choice": "none"})
    assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"]


def _ask_json(url, path, body):
    r = httpx.post(f"{url}{path}", json=body, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    for k in ("id", "created", "created_at"):
        out.pop(k, None)
    for k in ("prompt_tokens_details", "input_tokens_details"):  # the prefix cache's hits depend on the load
        out["usage"].pop(k, None)
    return out


def test_same_bytes_alone_and_among_8_clients(server):
    """A tool request's answer (ids included) alone equals its answer among plain and structured
    requests from 8 clients at once."""
    tool = dict(model=NAME, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                max_tokens=60, temperature=0)
    others = [dict(model=NAME, messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=16,
                   temperature=0.8, seed=i) for i in range(3)]
    others += [dict(model=NAME, messages=ASK, max_tokens=24, temperature=0,
                    response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}})]
    resp = dict(model=NAME, input=ASK[0]["content"], tools=RTOOLS, tool_choice="required", max_output_tokens=60,
                parallel_tool_calls=False, temperature=0)
    jobs = [("/v1/chat/completions", tool)] * 3 + [("/v1/responses", resp)] + \
           [("/v1/chat/completions", o) for o in others]
    alone = [_ask_json(server, p, b) for p, b in jobs[:4]]
    with ThreadPoolExecutor(8) as pool:
        loaded = list(pool.map(lambda j: _ask_json(server, *j), jobs))
    assert loaded[:3] == alone[:3] and loaded[3] == alone[3]
    assert alone[0]["choices"][0]["finish_reason"] == "tool_calls" and alone[3]["output"][0]["type"] == "function_call"


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=a)b"}}}
TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


def _tool(name, params=None):
    return {"type": "function", "function": {"name": name, **({"parameters": params} if params else {})}}


@pytest.mark.parametrize("extra,param", [
    (dict(tools=[_tool("a"), _tool("b"), _tool("c", BAD_SCHEMA)]), "tools[2].function.parameters"),
    (dict(tools=[_tool("a", {"type": "array"})]), "tools[0].function.parameters.type"),
    (dict(tools=[_tool("a"), _tool("a")]), "tools[1].function.name"),
    (dict(tools=[{"type": "retrieval"}]), "tools[0].type"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice.function.name"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, messages=ASK + [{"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                                       {"role": "user", "content": "and?"},
                                       {"role": "tool", "tool_call_id": "call_9", "content": "x"}]),
     "messages[3].tool_call_id"),
    (dict(tools=TOOLS, messages=ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {**TOOL_CALL, "function": {"name": "get_weather", "arguments": "{not json"}}]}]),
     "messages[1].tool_calls[0].function.arguments"),
    (dict(tools=TOOLS, structured_outputs={"regex": "[a-z]+"}), "structured_outputs.regex"),
    (dict(parallel_tool_calls="yes"), "parallel_tool_calls"),
    (dict(chat_template_kwargs=[1]), "chat_template_kwargs"),
])
def test_bad_tool_requests(server, extra, param):
    body = {"model": NAME, "messages": ASK, "max_tokens": 4, **extra}
    r = httpx.post(f"{server}/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


# -- the Responses API ----------------------------------------------------------------------------------

def _stream_output(events):
    """The response a Responses stream ends with, after checking the events' order and shapes."""
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] in ("response.completed",
                                                                                       "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert all(type(e).__module__.startswith("openai.types.responses") for e in events), types
    end = events[-1].response
    texts, args = {}, {}
    for e in events:
        if e.type in ("response.output_text.delta", "response.reasoning_text.delta"):
            texts[e.output_index] = texts.get(e.output_index, "") + e.delta
        if e.type == "response.function_call_arguments.delta":
            args[e.output_index] = args.get(e.output_index, "") + e.delta
        if e.type == "response.output_item.done":
            assert e.item == end.output[e.output_index]
    for i, item in enumerate(end.output):
        if item.type == "function_call":
            assert args[i] == item.arguments
        elif item.content[0].text:
            assert texts[i] == item.content[0].text
    return end


def test_responses_calls_and_tool_outputs(server, smollm):
    c = client(server)
    kw = dict(model=NAME, tools=RTOOLS, tool_choice="required", parallel_tool_calls=False, max_output_tokens=48,
              temperature=0)
    r = c.responses.create(input=ASK[0]["content"], **kw)
    assert r.status == "completed" and r.id.startswith("resp_") and r.object == "response"
    (fc,) = r.output
    assert fc.type == "function_call" and fc.status == "completed" and fc.call_id.startswith("call_")
    jsonschema.validate(json.loads(fc.arguments), WEATHER if fc.name == "get_weather" else TOOLS[1]["function"]
                        ["parameters"])
    # the chat path's call id for the same request
    chat = client(server).chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                                  parallel_tool_calls=False, max_tokens=48, temperature=0)
    assert chat.choices[0].message.tool_calls[0].id == fc.call_id
    assert r.usage.input_tokens == len(smollm.chat_prompt(ASK, tools=TOOLS)) and r.usage.total_tokens == \
        r.usage.input_tokens + r.usage.output_tokens
    streamed = _stream_output(list(c.responses.create(input=ASK[0]["content"], stream=True, **kw)))
    assert streamed.output == r.output and streamed.usage == r.usage
    # the call's result given back as input items: a text answer, streamed equal to whole
    items = [{"role": "user", "content": [{"type": "input_text", "text": ASK[0]["content"]}]},
             {"type": "function_call", "call_id": fc.call_id, "name": fc.name, "arguments": fc.arguments},
             {"type": "function_call_output", "call_id": fc.call_id, "output": "21 C, sunny"}]
    kw2 = dict(model=NAME, input=items, instructions="Answer briefly.", tools=RTOOLS, max_output_tokens=16,
               temperature=0)
    r2 = c.responses.create(**kw2)
    assert r2.output and r2.status in ("completed", "incomplete")
    if r2.status == "incomplete":
        assert r2.incomplete_details.reason == "max_output_tokens"
    s2 = _stream_output(list(c.responses.create(stream=True, **kw2)))
    assert s2.output == r2.output and s2.status == r2.status
    assert c.responses.create(**kw2).output == r2.output  # the same ids again
    # text.format json_schema holds the answer
    r3 = c.responses.create(model=NAME, input="Weather in Oslo as JSON.", max_output_tokens=40, temperature=0,
                            text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}})
    if r3.status == "completed":
        jsonschema.validate(json.loads(r3.output_text), WEATHER)


@pytest.mark.parametrize("extra,param", [
    (dict(previous_response_id="resp_123"), "previous_response_id"),
    (dict(conversation="conv_1"), "conversation"),
    (dict(tools=[{"type": "function", "name": "a", "parameters": BAD_SCHEMA}]), "tools[0].parameters"),
    (dict(tools=[{"type": "function", "name": "a b"}]), "tools[0].name"),
    (dict(tools=RTOOLS, tool_choice={"type": "function", "name": "nope"}), "tool_choice.name"),
    (dict(input=[{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c1", "name": "get_weather",
                                                    "arguments": "{oops"}]), "input[1].arguments"),
    (dict(input=[{"role": "user", "content": "x"}, {"type": "function_call_output", "call_id": "c9", "output": "1"}]),
     "input[1].call_id"),
    (dict(input=[{"type": "web_search_call"}]), "input[0].type"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
     "input[0].content[0].type"),
    (dict(max_output_tokens=0), "max_output_tokens"),
    (dict(tools=RTOOLS, text={"format": {"type": "json_object"}}), "text.format"),
    (dict(bogus=1), "bogus"),
])
def test_bad_responses_requests(server, extra, param):
    body = {"model": NAME, "input": "x", "max_output_tokens": 4, **extra}
    r = httpx.post(f"{server}/v1/responses", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err


# -- reasoning ---------------------------------------------------------------------------------------

THINKING = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if reasoning_effort is defined %}effort: {{ reasoning_effort }}\n{% endif %}"
            "{% if add_generation_prompt %}<|assistant|><think>{% endif %}{# a reply closes it: </think> #}")


@pytest.fixture(scope="module")
def thinker(stories_models):
    """The stories model with a template that opens the model's reasoning (a copy: the shared one
    keeps having no template)."""
    m = copy.copy(stories_models["fp32"])
    m.tokenizer = copy.copy(m.tokenizer)
    m.tokenizer.chat_template = THINKING
    with serving(m, max_batch=4) as (url, _):
        yield url, m


def test_reasoning_split_whole_and_streamed(thinker):
    url, m = thinker
    c = client(url)
    # the grammar makes the reply close its reasoning, then answer
    kw = dict(model=NAME, messages=[{"role": "user", "content": "Once upon a time"}], max_tokens=40, temperature=0,
              reasoning_effort="high", extra_body={"grammar": 'start: /[a-z ]{2,20}/ "</think>" /[a-z ]{2,20}/',
                                                   "return_token_ids": True})
    r = c.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert msg.reasoning_content and msg.content and "</think>" not in msg.content + msg.reasoning_content
    assert r.choices[0].prompt_token_ids == m.chat_prompt(kw["messages"],
                                                          chat_template_kwargs={"reasoning_effort": "high"})
    content, reasoning, calls, reason = _joined(c.chat.completions.create(stream=True, **kw))
    assert (content, reasoning, calls, reason) == (msg.content, msg.reasoning_content, [], r.choices[0].finish_reason)
    # the Responses API: a reasoning item, its tokens counted
    kr = dict(model=NAME, input="Once upon a time", max_output_tokens=12, temperature=0, reasoning={"effort": "low"})
    rr = c.responses.create(**kr)
    assert rr.output[0].type == "reasoning" and rr.output[0].content[0].text
    assert rr.usage.output_tokens_details.reasoning_tokens > 0 and rr.status == "incomplete"
    assert _stream_output(list(c.responses.create(stream=True, **kr))).output == rr.output
