"""Tool-call syntaxes against the real chat templates (llama.cpp's collection, fetched at test time):
rendering with tools equals transformers', each family's parser reads back the calls its template
writes, `detect` names the family, each grammar takes a valid call and refuses a bad one, and a
stream split anywhere gives the same message."""

from __future__ import annotations

import datetime as _dt
import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinydet.chat import ChatTemplateError, render_chat
from tinydet.chat.harmony import Harmony, HarmonyParser
from tinydet.chat.parse import ChatParser
from tinydet.chat.plan import THINK, plan_chat
from tinydet.chat.syntaxes import SYNTAXES, detect

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "description": "The city."},
                                          "unit": {"type": "string", "enum": ["c", "f"]}},
                                          "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "Adds two integers.",
                                      "parameters": {"type": "object", "properties": {
                                          "a": {"type": "integer"}, "b": {"type": "integer"}},
                                          "required": ["a", "b"], "additionalProperties": False}}},
]
NAMES = ("get_weather", "add")
CALLS = [{"id": "abcDEF123", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
         {"id": "xyz789QRS", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]
BOS, EOS = "<s>", "</s>"

# template file -> (the syntax detect names, the template's options, where the model's turn ends)
TEMPLATES = {
    "Qwen-Qwen3-0.6B": ("hermes", {"enable_thinking": False}, "<|im_end|>"),
    "Qwen-Qwen2.5-7B-Instruct": ("hermes", {}, "<|im_end|>"),
    # llama.cpp's copy of SmolLM3's template renders no tools (HF's writes <tool_call> xml_tools): generic
    "HuggingFaceTB-SmolLM3-3B": ("generic", {"enable_thinking": False}, None),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": ("hermes", {}, "<|im_end|>"),
    "meta-llama-Llama-3.1-8B-Instruct": ("llama3_json", {"date_string": "01 Jan 2024"}, "<|eot_id|>"),
    "meta-llama-Llama-3.2-3B-Instruct": ("llama3_json", {"date_string": "01 Jan 2024"}, "<|eot_id|>"),
    "meta-llama-Llama-3.3-70B-Instruct": ("llama3_json", {"date_string": "01 Jan 2024"}, "<|eot_id|>"),
    "mistralai-Mistral-Nemo-Instruct-2407": ("mistral", {}, EOS),
    "Mistral-Small-3.2-24B-Instruct-2506": ("mistral_args", {}, EOS),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("generic", {}, None),
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": ("generic", {}, None),
    "openai-gpt-oss-120b": ("harmony", {"reasoning_effort": "low"}, None),
}


def conversation(n_calls: int = 1) -> list[dict]:
    calls = CALLS[:n_calls]
    return [{"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "What is the weather in Paris, and 2 + 3?"},
            {"role": "assistant", "content": "", "tool_calls": calls},
            *({"role": "tool", "tool_call_id": c["id"], "content": '{"result": 20}'} for c in calls),
            {"role": "assistant", "content": "It is 20 C in Paris."},
            {"role": "user", "content": "And in Rome?"}]


@pytest.fixture(scope="module")
def template(llama_templates):
    def get(name: str) -> str:
        return (llama_templates / f"{name}.jinja").read_text(encoding="utf-8")
    return get


class _FixedDate(_dt.datetime):
    @classmethod
    def now(cls, tz=None):  # tinydet's strftime_now gives 2024-01-01: transformers' now the same
        return cls(2024, 1, 1)


@pytest.fixture
def hf_render(monkeypatch):
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    monkeypatch.setattr(utils, "datetime", _FixedDate)

    def render(template, messages, add_generation_prompt=True, **kw):
        out = utils.render_jinja_template(conversations=[messages], tools=TOOLS, chat_template=template,
                                          add_generation_prompt=add_generation_prompt, bos_token=BOS,
                                          eos_token=EOS, **kw)
        return out[0][0]
    return render


def ours(template, messages, add_generation_prompt=True, **kw):
    return render_chat(template, messages, BOS, EOS, add_generation_prompt, tools=TOOLS, **kw)


@pytest.mark.parametrize("name", TEMPLATES)
def test_render_with_tools_matches_transformers(template, hf_render, name):
    t, (_, kw, _) = template(name), TEMPLATES[name]
    n = 1 if name.startswith(("meta-llama", "openai")) else 2  # these write one call a turn (Llama refuses two)
    for msgs in (conversation(n), conversation(n)[:2]):
        assert ours(t, msgs, **kw) == hf_render(t, msgs, **kw)
    if name == "openai-gpt-oss-120b":  # the reasoning effort and a past turn's thinking reach the template
        msgs = conversation(1)
        msgs[2] = {**msgs[2], "thinking": "I should look it up."}
        for effort in ("low", "high"):
            assert ours(t, msgs, reasoning_effort=effort) == hf_render(t, msgs, reasoning_effort=effort)
            assert f"Reasoning: {effort}" in ours(t, msgs, reasoning_effort=effort)


@pytest.mark.parametrize("name", TEMPLATES)
def test_detect(template, name):
    assert detect(template(name)).name == TEMPLATES[name][0]


def test_detect_without_tools_and_phi4_mini():
    assert detect(None).name == detect("{{ messages }}").name == "generic"
    # Phi-4-mini's template (not in llama.cpp's collection) writes the tools inside <|tool|> tags
    phi4 = "{{ '<|system|>' + m['content'] + '<|tool|>' + m['tools'] + '<|/tool|>' + '<|end|>' }}"
    assert detect(phi4).name == "phi4_mini"


def parser_for(syn, prompt: str, template: str, names=NAMES, parallel=True, markers=None):
    if hasattr(syn, "make_parser"):
        return syn.make_parser(names, markers or {}, "k", parallel)
    think = THINK if THINK[0] in template and THINK[1] in template else None
    in_think = bool(think) and prompt.rstrip().endswith(THINK[0])
    return ChatParser(syn, names, think, in_think, markers or {}, "k", parallel)


def got_calls(message):
    return [(c.name, json.loads(c.arguments)) for c in message.tool_calls]


def want_calls(calls):
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("name", [n for n, v in TEMPLATES.items() if v[0] != "generic"])
def test_parser_reads_the_templates_own_calls(template, name, n):
    """The template's rendering of an assistant turn of calls, after its generation prompt, read back."""
    t, (syn_name, kw, end) = template(name), TEMPLATES[name]
    head = conversation(n)[1:2]  # no system message: Nemo's writes it into the last user turn only
    last = {"role": "assistant", "content": "", "tool_calls": CALLS[:n]}
    if n == 2 and syn_name == "llama3_json":
        with pytest.raises(ChatTemplateError, match="single tool-calls"):  # the family makes one call a turn
            ours(t, [*head, last], add_generation_prompt=False, **kw)
        return
    prompt = ours(t, head, **kw)
    full = ours(t, [*head, last], add_generation_prompt=False, **kw)
    assert full.startswith(prompt)
    text = full[len(prompt):]
    if end is not None:  # the end-of-turn token stops the output: it is not the answer's text
        text = text[:text.index(end)]
    syn = SYNTAXES[syn_name]()
    p = parser_for(syn, prompt, t)
    p.feed(text)
    p.finish()
    # gpt-oss's template writes only a turn's first call (a harmony message holds one call), and puts
    # the recipient before the channel (`assistant to=functions.f<|channel|>commentary json`) where the
    # model writes `<|channel|>commentary to=functions.f <|constrain|>json` (the grammars' form): the
    # parser reads both. Mistral Small 3.2's writes `[CALL_ID]id` before `[ARGS]`: read when present.
    want = CALLS[:1] if syn_name == "harmony" else CALLS[:n]
    assert got_calls(p.message) == want_calls(want)
    assert not (p.message.content or "").strip()
    for c in p.message.tool_calls:
        assert (re.fullmatch(r"[A-Za-z0-9]{9}", c.id) if syn.id_style == "mistral" else c.id.startswith("call_"))


def test_harmony_reasoning_final_and_calls():
    p = HarmonyParser(NAMES)
    p.feed("<|channel|>analysis<|message|>Think first.<|end|><|start|>assistant<|channel|>commentary "
           'to=functions.add <|constrain|>json<|message|>{"a": 1, "b": 2}<|call|>')
    p.finish()
    assert p.message.reasoning_content == "Think first." and got_calls(p.message) == [("add", {"a": 1, "b": 2})]
    p = HarmonyParser(NAMES)
    p.feed("<|channel|>analysis<|message|><|end|><|start|>assistant<|channel|>final<|message|>Hi there.<|return|>")
    p.finish()
    assert (p.message.reasoning_content, p.message.content, p.message.tool_calls) == ("", "Hi there.", [])
    p = HarmonyParser(())  # no tools offered: a call's text is content
    p.feed('<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1}<|call|>')
    p.finish()
    assert p.message.tool_calls == [] and p.message.content == '{"a": 1}'


def test_llama_call_only_at_the_start():
    syn = SYNTAXES["llama3_json"]()
    p = ChatParser(syn, NAMES)
    p.feed('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}')
    p.finish()
    assert got_calls(p.message) == [("add", {"a": 1, "b": 2})] and p.message.content is None
    p = ChatParser(syn, NAMES)
    p.feed('Use {"name": "add", "parameters": {"a": 1, "b": 2}}')
    p.finish()
    assert p.message.tool_calls == [] and p.message.content.startswith("Use {")


# -- grammars -------------------------------------------------------------------------------------

def call_text(syn: str, calls, lit=lambda s: s) -> str:
    """The text a model of family `syn` writes for `calls` [(name, args)]."""
    j = lambda x: json.dumps(x)  # noqa: E731
    if syn in ("hermes", "generic"):
        return "\n".join(f'<tool_call>\n{j({"name": n, "arguments": a})}\n</tool_call>' for n, a in calls)
    if syn == "llama3_json":
        return j({"name": calls[0][0], "parameters": calls[0][1]})
    if syn in ("mistral", "phi4_mini"):
        opener = "[TOOL_CALLS]" if syn == "mistral" else "functools"
        return lit(opener) + j([{"name": n, "arguments": a} for n, a in calls])
    if syn == "mistral_args":
        return "".join(f"{lit('[TOOL_CALLS]')}{n}{lit('[ARGS]')}{j(a)}" for n, a in calls)
    one = [f"{lit('<|channel|>')}commentary to=functions.{n} {lit('<|constrain|>')}json{lit('<|message|>')}"
           f"{j(a)}{lit('<|call|>')}" for n, a in calls]
    return (lit("<|start|>") + "assistant").join(one)


GOOD = [("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 2, "b": 3})]
FAMILIES = ["hermes", "generic", "llama3_json", "mistral", "mistral_args", "phi4_mini", "harmony"]


@pytest.fixture(scope="module")
def smollm_tok(smollm_path):
    from tinydet.formats.gguf import GGUFFile
    from tinydet.tokenizer import Tokenizer

    g = GGUFFile(smollm_path)
    return Tokenizer.from_gguf_metadata(g.metadata, g.path)


def accepts(tok, grammar: str, text: str, ids=None) -> bool:
    from tinydet.structured import constraint

    m = constraint(tok, tok.vocab_size, grammar=grammar).matcher()._m
    ids = tok.encode(text, add_special=False) if ids is None else ids
    return all(m.consume_token(t) for t in ids) and not m.is_error() and m.is_accepting()


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("choice", ["required", "get_weather", "auto"])
@pytest.mark.parametrize("syn_name", FAMILIES)
def test_grammar_with_a_real_tokenizer(smollm_tok, syn_name, choice, parallel):
    """SmolLM2's vocabulary has none of the markers as control tokens: they are plain text here."""
    pytest.importorskip("llguidance")
    g = SYNTAXES[syn_name]().grammar(TOOLS, choice, parallel, json.dumps)
    ok = accepts
    assert ok(smollm_tok, g, call_text(syn_name, GOOD[:1]))
    assert not ok(smollm_tok, g, call_text(syn_name, [("get_time", {"city": "Paris"})]))  # no such function
    assert not ok(smollm_tok, g, call_text(syn_name, [("get_weather", {"city": 3})]))  # against the schema
    assert not ok(smollm_tok, g, call_text(syn_name, [("get_weather", {"city": "P", "x": 1})]))
    if syn_name != "llama3_json":  # Llama 3 makes one call a turn
        assert ok(smollm_tok, g, call_text(syn_name, GOOD)) == (parallel and choice != "get_weather")
    if choice == "get_weather":
        assert not ok(smollm_tok, g, call_text(syn_name, GOOD[1:]))
    free = "<|channel|>final<|message|>Hello there." if syn_name == "harmony" else "Hello there."
    assert ok(smollm_tok, g, free) == (choice == "auto")


class ByteTokenizer:
    """A vocabulary of the 256 bytes and the given control tokens (decoded to nothing), for markers that
    are control tokens in the real models' vocabularies (Mistral's, gpt-oss's)."""

    def __init__(self, specials, chat_template=None):
        self.specials = {s: 256 + i for i, s in enumerate(specials)}
        self.eos_ids, self.bos_id = [256 + len(specials)], None
        self.vocab_size = 257 + len(specials)
        self._pieces = [bytes([i]) for i in range(256)] + [b""] * (len(specials) + 1)
        self._skip, self._spm, self.chat_template = set(range(256, self.vocab_size)), None, chat_template
        self._split = re.compile("(" + "|".join(map(re.escape, specials)) + ")")

    def id_to_token(self, i):
        return next((s for s, j in self.specials.items() if j == i), "</s>" if i in self.eos_ids else None)

    def encode(self, text, add_special=False):
        return [t for part in self._split.split(text) if part
                for t in ([self.specials[part]] if part in self.specials else part.encode())]

    def decode(self, ids):
        return b"".join(self._pieces[i] for i in ids).decode(errors="replace")


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("choice", ["required", "auto"])
@pytest.mark.parametrize("syn_name", ["mistral", "mistral_args", "harmony"])
def test_grammar_with_control_token_markers(syn_name, choice, parallel):
    pytest.importorskip("llguidance")
    syn = SYNTAXES[syn_name]()
    tok = ByteTokenizer(syn.markers)
    lit = lambda s: f"<[{tok.specials[s]}]>" if s in tok.specials else json.dumps(s)  # noqa: E731
    g = syn.grammar(TOOLS, choice, parallel, lit)
    assert accepts(tok, g, call_text(syn_name, GOOD[:1]))
    assert accepts(tok, g, call_text(syn_name, GOOD)) == parallel
    if syn_name == "mistral_args":  # with the id Small 3.2's template writes before [ARGS]
        assert accepts(tok, g, call_text(syn_name, GOOD[:1]).replace("[ARGS]", "[CALL_ID]abcDEF123[ARGS]"))
    assert not accepts(tok, g, call_text(syn_name, [("get_weather", {"city": 3})]))
    if choice == "auto":  # (free text may hold the marker's text: it is not the control token)
        return
    # the marker written as plain text is not the control token
    plain = call_text(syn_name, GOOD[:1]).replace(syn.markers[0], "")
    assert not accepts(tok, g, plain, ids=[*syn.markers[0].encode(), *tok.encode(plain)])


def test_plan_chat_harmony_with_control_tokens(template):
    """plan_chat on gpt-oss's template: the harmony reader (tools or not), its control tokens resolved,
    a grammar that compiles, and the parser reading markers given as tokens that decode to nothing."""
    pytest.importorskip("llguidance")
    from tinydet.structured import constraint

    tok = ByteTokenizer(Harmony.markers, template("openai-gpt-oss-120b"))
    msgs = conversation(1)[:2]
    plan = plan_chat(tok, msgs, TOOLS, "required")
    assert plan.reader is not None and plan.think is None and set(plan.markers.values()) == set(Harmony.markers)
    constraint(tok, tok.vocab_size, grammar=plan.grammar)
    p = plan.parser("k")
    for piece in re.split("(<\\|[a-z]+\\|>)", call_text("harmony", GOOD[:1])):
        p.feed("", tok.specials[piece]) if piece in tok.specials else p.feed(piece)
    p.finish()
    assert got_calls(p.message) == GOOD[:1]
    plain = plan_chat(tok, msgs)  # no tools: still the harmony reader, for the reasoning
    p = plain.parser()
    p.feed("<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final<|message|>Hi.")
    p.finish()
    assert (p.message.reasoning_content, p.message.content) == ("Hm.", "Hi.")


# -- streams ----------------------------------------------------------------------------------------

ANSWERS = {
    "hermes": "<think>\nLet me see.\n</think>\n\nChecking.\n" + call_text("hermes", GOOD),
    "generic": "Sure.\n" + call_text("generic", GOOD[:1]) + "\nDone <tool_call>\n{bad}\n</tool_call>",
    "llama3_json": "<think>Hm.</think>\n\n<|python_tag|>" + call_text("llama3_json", GOOD),
    "mistral": "Let me call. " + call_text("mistral", GOOD),
    "mistral_args": call_text("mistral_args", GOOD),
    "phi4_mini": "<think>ok</think>" + call_text("phi4_mini", GOOD),
    "harmony": "<|channel|>analysis<|message|>Reason <here>.<|end|><|start|>assistant" + call_text("harmony", GOOD),
}


def fed(syn_name, pieces):
    syn = SYNTAXES[syn_name]()
    p = parser_for(syn, "", "<think></think>")
    deltas = [d for piece in pieces for d in p.feed(piece)] + p.finish()
    return p.message, deltas


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(syn_name=st.sampled_from(sorted(ANSWERS)), cuts=st.lists(st.integers(0, 400), max_size=12))
def test_split_anywhere_gives_the_same_message(syn_name, cuts):
    text = ANSWERS[syn_name]
    whole, _ = fed(syn_name, [text])
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    message, deltas = fed(syn_name, [text[a:b] for a, b in zip(bounds, bounds[1:])])
    assert message == whole
    assert "".join(d.text for d in deltas if d.kind == "content") == (whole.content or "")
    assert "".join(d.text for d in deltas if d.kind == "reasoning") == (whole.reasoning_content or "")


def test_stream_answers_read_as_meant():
    assert got_calls(fed("hermes", [ANSWERS["hermes"]])[0]) == GOOD
    m = fed("llama3_json", [ANSWERS["llama3_json"]])[0]
    assert m.reasoning_content == "Hm." and got_calls(m) == GOOD[:1]
    m = fed("mistral", [ANSWERS["mistral"]])[0]
    assert m.content == "Let me call." and got_calls(m) == GOOD
    m = fed("harmony", [ANSWERS["harmony"]])[0]
    assert m.reasoning_content == "Reason <here>." and got_calls(m) == GOOD
    assert got_calls(fed("phi4_mini", [ANSWERS["phi4_mini"]])[0]) == GOOD
    assert got_calls(fed("mistral_args", [ANSWERS["mistral_args"]])[0]) == GOOD


# Phi-4-mini-instruct's template (no copy of it ships with llama.cpp's templates; this is its published
# form, shortened to what tools touch): the tools come from the system message's `tools` field.
PHI4_MINI_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and message['tools'] "
    "is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools'] + "
    "'<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}")


def test_phi4_mini_takes_the_tools_in_the_system_message():
    from tinydet.chat.plan import plan_chat

    class Tok:
        chat_template, bos_id, eos_ids = PHI4_MINI_TEMPLATE, None, ()

        def id_to_token(self, i):
            return ""

        def encode(self, text, add_special=False):
            return list(text.encode())

        def decode(self, ids):
            return bytes(ids).decode()

    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
    plan = plan_chat(Tok(), [{"role": "user", "content": "hi"}], tools, "auto")
    assert plan.syntax.name == "phi4_mini"
    assert plan.prompt == ('<|system|><|tool|>[{"name": "add", "parameters": {"type": "object", "properties": {}}}]'
                           '<|/tool|><|end|><|user|>hi<|end|><|assistant|>')
