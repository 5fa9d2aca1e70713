"""Reproducers of the defects the fuzz campaign (fuzz/) found: each input once gave a non-Tinydet
exception (TypeError, ValueError, RecursionError, UnicodeDecodeError) and now a one-line TinydetError
naming the file and the field."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from ggufgen import ARRAY, UINT32, UINT64, build, rewrite, typed
from tinydet.errors import ModelFormatError, TinydetError
from tinydet.formats.gguf import GGUFFile
from tinydet.formats.gguf_model import gguf_config

DEEP = 5000  # nesting levels: past CPython's default recursion limit of 1000


def one_line(e: Exception) -> bool:
    return "\n" not in str(e)


# Keys that gguf_config once used without checking their type: each as an array and as a string.
CONFIG_KEYS = ["general.architecture", "llama.attention.head_count_kv", "llama.attention.key_length",
               "llama.attention.value_length", "llama.rope.dimension_count", "llama.rope.scaling.type",
               "llama.rope.freq_base", "llama.rope.scaling.factor", "llama.vocab_size",
               "llama.attention.layer_norm_rms_epsilon"]


STRING_KEYS = ("general.architecture", "llama.rope.scaling.type")


@pytest.mark.parametrize("kind", ["array", "scalar"])
@pytest.mark.parametrize("key", CONFIG_KEYS)
def test_gguf_config_key_of_wrong_type(stories_path, tmp_path, key, kind):
    # An array always is wrong; the wrong scalar is a number for a string key, a string otherwise.
    value = np.array([1, 2], np.uint32) if kind == "array" else 8 if key in STRING_KEYS else "8"
    edits = {key: value}
    if key == "llama.rope.scaling.factor":
        edits["llama.rope.scaling.type"] = "linear"  # the factor is read only under linear scaling
    p = tmp_path / "m.gguf"
    p.write_bytes(rewrite(stories_path, edits))
    with pytest.raises(ModelFormatError) as e:
        gguf_config(GGUFFile(p))
    assert e.value.field == key and str(p) in str(e.value) and one_line(e.value)


def test_gguf_nested_arrays(tmp_path):
    # An array of arrays of ... 5,000 deep: 12 bytes a level, read recursively.
    body = b"".join(struct.pack("<IQ", ARRAY, 1) for _ in range(DEEP)) + struct.pack("<IQ", UINT32, 0)
    key = b"x"
    blob = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", ARRAY) + body
    p = tmp_path / "deep.gguf"
    p.write_bytes(blob)
    with pytest.raises(ModelFormatError) as e:
        GGUFFile(p)
    assert e.value.field.startswith("x") and one_line(e.value)


def test_gguf_nested_arrays_shallow_still_read(tmp_path):
    p = tmp_path / "ok.gguf"
    p.write_bytes(build({"a": [[typed(UINT32, 1)], [typed(UINT32, 2)]]}, []))
    assert [list(x) for x in GGUFFile(p).metadata["a"]] == [[1], [2]]


def test_read_json_nested_too_deep(tmp_path):
    from tinydet.jsonfile import read_json

    p = tmp_path / "config.json"
    p.write_text('{"a": ' + "[" * DEEP + "]" * DEEP + "}")
    with pytest.raises(ModelFormatError) as e:
        read_json(p, "config.json")
    assert str(p) in str(e.value) and one_line(e.value)


def test_safetensors_header_nested_too_deep(tmp_path):
    from tinydet.formats.safetensors import SafetensorsFile

    header = ('{"__metadata__": {}, "x": ' + "[" * DEEP + "]" * DEEP + "}").encode()
    p = tmp_path / "model.safetensors"
    p.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(ModelFormatError) as e:
        SafetensorsFile(p)
    assert e.value.field == "header" and one_line(e.value)


def test_manifest_not_utf8(tmp_path):
    from tinydet.registry.manifest import ManifestError, load_manifest

    p = tmp_path / "m.toml"
    p.write_bytes(b'name = "m\xff"\n')
    with pytest.raises(ManifestError) as e:
        load_manifest(p)
    assert str(p) in str(e.value) and one_line(e.value)


@pytest.mark.parametrize("content", [b"\xff\xfe{}\n", b"[1]\n", ("[" * DEEP + "]" * DEEP + "\n").encode()],
                         ids=["not-utf8", "not-an-object", "nested"])
def test_read_trace_bad_file(tmp_path, content):
    from tinydet.tools.trace import read_trace

    p = tmp_path / "t.jsonl"
    p.write_bytes(content)
    with pytest.raises(TinydetError) as e:
        read_trace(p)
    assert str(p) in str(e.value) and one_line(e.value)
    json.dumps(str(e.value))


@pytest.mark.parametrize("n_layers", [2**63 - 1, 2**40])
def test_gguf_block_count_larger_than_the_file(tmp_path, n_layers):
    # Found on a tiny Gemma 3 file: its loader made a per-layer list of block_count entries
    # (MemoryError) before anything compared block_count with the tensors the file has.
    import gemma3gen

    src = tmp_path / "g.gguf"
    gemma3gen.write_gguf(src)
    p = tmp_path / "m.gguf"
    p.write_bytes(rewrite(src, {"gemma3.block_count": typed(UINT64, n_layers)}))
    with pytest.raises(ModelFormatError) as e:
        gguf_config(GGUFFile(p))
    assert e.value.field == "gemma3.block_count" and one_line(e.value)


@pytest.fixture(scope="module")
def llama3_hf_dir(tmp_path_factory):
    import qwen2gen

    d = tmp_path_factory.mktemp("hf-llama3")
    qwen2gen.write_tokenizer_files(d, arch="llama3")
    return d


def test_hf_tokenizer_post_processor_names_a_missing_token(llama3_hf_dir, tmp_path):
    # tokenizers panics in Rust (pyo3's PanicException, not an Exception) when the post-processor's
    # template names a special token absent from its own table.
    from tinydet.tokenizer.hf import read_hf_tokenizer

    for f in llama3_hf_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tj = json.loads((tmp_path / "tokenizer.json").read_text())
    procs = tj["post_processor"]["processors"]
    template = next(p for p in procs if p.get("type") == "TemplateProcessing")
    template["special_tokens"].clear()
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(ModelFormatError) as e:
        read_hf_tokenizer(tmp_path)
    assert e.value.field == "tokenizer.json" and one_line(e.value)


def test_hf_generation_config_empty_bos_list(llama3_hf_dir, tmp_path):
    from tinydet.tokenizer.hf import read_hf_tokenizer

    for f in llama3_hf_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tc = json.loads((tmp_path / "tokenizer_config.json").read_text())
    tc.pop("bos_token", None)  # so that generation_config.json's bos_token_id is read
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tc))
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": [], "eos_token_id": 2}))
    with pytest.raises(ModelFormatError) as e:
        read_hf_tokenizer(tmp_path)
    assert e.value.field == "bos_token_id" and str(tmp_path / "generation_config.json") in str(e.value)


@pytest.mark.parametrize("key", ["bos_token", "eos_token", "unk_token", "pad_token"])
def test_hf_special_token_lone_surrogate(llama3_hf_dir, tmp_path, key):
    # Found by the hf_dir target: tokenizer_config.json's "\\ud800" (valid JSON, not valid UTF-8)
    # reached tokenizers' token_to_id and escaped as a UnicodeEncodeError.
    from tinydet.tokenizer.hf import read_hf_tokenizer

    for f in llama3_hf_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tc = json.loads((tmp_path / "tokenizer_config.json").read_text())
    tc[key] = {"content": "\ud800", "lstrip": False} if key == "eos_token" else "\ud800"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tc))
    if key in ("unk_token", "pad_token"):  # optional tokens: a malformed one is ignored, not an escape
        assert read_hf_tokenizer(tmp_path).vocab_size > 0
        return
    with pytest.raises(ModelFormatError) as e:
        read_hf_tokenizer(tmp_path)
    assert e.value.field == key and "valid Unicode" in str(e.value) and one_line(e.value)


@pytest.mark.parametrize("ids", [[1.5], ["7"], [None], [True], [512], [-1], [2**63]])
def test_decode_bad_ids_are_tinydet_errors(stories_path, ids):
    # Found through Model.detokenize: int() took 1.5 as token 1 and "7" as token 7 (a silently wrong
    # answer), and None, "\x00" or an id outside the vocabulary gave a bare TypeError / ValueError.
    from tinydet.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_metadata(GGUFFile(stories_path).metadata, stories_path)
    with pytest.raises(TinydetError) as e:
        tok.decode(ids)
    assert one_line(e.value)
    with pytest.raises(TinydetError):
        tok.stream().push(ids[0])


def test_encode_lone_surrogate(stories_path):
    from tinydet.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_metadata(GGUFFile(stories_path).metadata, stories_path)
    with pytest.raises(TinydetError) as e:
        tok.encode("a\ud800b")
    assert one_line(e.value)
    assert tok.decode(tok.encode("ab", add_special=False)) == "ab"  # the check does not change good text


# ---- model-config reading: untyped float(), set() of unhashable entries, a layer count that hangs


@pytest.mark.parametrize("value", [np.array([1.0, 2.0], np.float32), "linear", "", float("nan"), 0.0],
                         ids=["array", "string", "empty-string", "nan", "zero"])
def test_gguf_gemma3_final_logit_softcapping_of_wrong_type(tmp_path, value):
    # float(cap) took the key as whatever the file stored: a string or an array gave ValueError /
    # TypeError (fuzz/crashes/gguf), NaN or 0 a softcap that makes every logit NaN or 0.
    import gemma3gen

    src = tmp_path / "g.gguf"
    gemma3gen.write_gguf(src)
    p = tmp_path / "m.gguf"
    p.write_bytes(rewrite(src, {"gemma3.final_logit_softcapping": value}))
    with pytest.raises(ModelFormatError) as e:
        gguf_config(GGUFFile(p))
    assert e.value.field == "gemma3.final_logit_softcapping" and str(p) in str(e.value) and one_line(e.value)


def test_gguf_gemma3_final_logit_softcapping_read(tmp_path):
    import gemma3gen
    from ggufgen import FLOAT32

    src = tmp_path / "g.gguf"
    gemma3gen.write_gguf(src)
    p = tmp_path / "m.gguf"
    p.write_bytes(rewrite(src, {"gemma3.final_logit_softcapping": typed(FLOAT32, 30.0)}))
    assert gguf_config(GGUFFile(p))[1].logit_softcap == 30.0


def _config_dir(tmp_path, config: dict):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _gemma3_config(**changes) -> dict:
    import gemma3gen

    return {**gemma3gen.config_json(), **changes}


def _qwen2_config(**changes) -> dict:
    import qwen2gen

    return {**qwen2gen.config_json(), "use_sliding_window": True, **changes}


@pytest.mark.parametrize("make", [_gemma3_config, _qwen2_config], ids=["gemma3", "qwen2"])
@pytest.mark.parametrize("entry", [["sliding_attention"], {"a": 1}, 1], ids=["list", "object", "number"])
def test_hf_layer_types_entry_not_a_string(tmp_path, make, entry):
    # set(layer_types) raised "unhashable type" for a list or object entry (fuzz/crashes/hf_dir).
    from tinydet.formats.hf_dir import read_hf_config

    n = make()["num_hidden_layers"]
    d = _config_dir(tmp_path, make(layer_types=[entry] + ["full_attention"] * (n - 1)))
    with pytest.raises(ModelFormatError) as e:
        read_hf_config(d, n_tensors=1000)
    assert e.value.field == "layer_types" and str(d / "config.json") in str(e.value) and one_line(e.value)


@pytest.mark.parametrize("key", ["rope_type", "type"])
@pytest.mark.parametrize("kind", [["linear"], {"linear": 1}], ids=["list", "object"])
def test_hf_rope_type_not_a_string(tmp_path, key, kind):
    # The lookup of rope_scaling.rope_type in a dict raised "unhashable type" (fuzz/crashes/hf_dir).
    from tinydet.formats.hf_dir import read_hf_config

    d = _config_dir(tmp_path, _qwen2_config(rope_scaling={key: kind, "factor": 2.0}))
    with pytest.raises(ModelFormatError) as e:
        read_hf_config(d, n_tensors=1000)
    assert e.value.field == f"rope_scaling.{key}" and one_line(e.value)


@pytest.mark.parametrize("make", [_gemma3_config, _qwen2_config], ids=["gemma3", "qwen2"])
def test_hf_num_hidden_layers_larger_than_the_weights(tmp_path, make):
    # 2**32 layers: the per-layer tables (layer_types, windows) were built for minutes before anything
    # compared the count with the tensors present (fuzz/crashes/hf_dir, a hang).
    from safetensors.numpy import save_file

    from tinydet.formats.hf_dir import open_hf_dir, read_hf_config

    d = _config_dir(tmp_path, make(num_hidden_layers=2**32, layer_types=None))
    save_file({"model.embed_tokens.weight": np.zeros((4, 4), np.float32)}, str(d / "model.safetensors"))
    for read in (open_hf_dir, read_hf_config):
        with pytest.raises(ModelFormatError) as e:
            read(d)
        assert e.value.field == "num_hidden_layers" and str(d / "config.json") in str(e.value) and one_line(e.value)


# -- the `api` target: Model's public arguments ---------------------------------------------------------

BAD_API_CALLS = [  # (call, argument named in the message, prompt, settings); each from fuzz/crashes/api
    ("generate", "prompt", 5, {}), ("generate", "prompt", None, {}), ("generate", "prompt", b"Once", {}),
    ("generate", "prompt", [1.5], {}), ("generate", "prompt", ["a"], {}), ("generate", "prompt", [True], {}),
    ("generate", "prompt", [2**63], {}), ("generate", "top_p", "Once", {"top_p": []}),
    ("generate", "temperature", "Once", {"temperature": "x"}), ("generate", "min_p", "Once", {"min_p": {"a": 1}}),
    ("generate", "top_k", "Once", {"top_k": 1e308}), ("generate", "temperature", "Once", {"temperature": 10**400}),
    ("generate", "max_tokens", "Once", {"max_tokens": "3"}), ("generate", "seed", "Once", {"seed": 2**64}),
    ("generate", "stop", "Once", {"stop": b"a"}), ("generate", "stop", "Once", {"stop": -2**63}),
    ("stream", "stop", "Once", {"stop": [None]}), ("stream", "top_p", "Once", {"top_p": None}),
    ("generate_batch", "stop", "Once", {"stop": b"a"}), ("generate_batch", "prompt", [1.5], {}),
    ("detokenize", "ids", 5, {}), ("detokenize", "ids", None, {}), ("logits", "token_ids", "\x00", {}),
    ("logits", "token_ids", [2**63], {}), ("logits", "token_ids", None, {})]


@pytest.mark.parametrize("call,name,prompt,kw", BAD_API_CALLS)
def test_api_bad_argument(stories_models, call, name, prompt, kw):
    # Each gave a TypeError/ValueError/OverflowError, an AttributeError (a bad stop failed inside the
    # engine and generate returned None), or a silently wrong answer ([1.5] ran as token 1, b"Once" as
    # ids 79 110 ..., seed 2^64 as seed 0).
    m = stories_models["fp32"]
    kw = {"max_tokens": 2, **kw}
    with pytest.raises(TinydetError) as e:
        if call == "generate":
            m.generate(prompt, **kw)
        elif call == "stream":
            list(m.stream(prompt, **kw))
        elif call == "generate_batch":
            m.generate_batch([{"prompt": prompt, **kw}])
        elif call == "detokenize":
            m.detokenize(prompt)
        else:
            m.logits(prompt)
    assert str(e.value).startswith(f"{name}:") and one_line(e.value)


NOT_LISTS = [None, 5, "Once", b"Once", {"prompt": "Once"}, iter([{"prompt": "Once"}])]


@pytest.mark.parametrize("requests", NOT_LISTS, ids=lambda v: type(v).__name__)
def test_api_generate_batch_requests_not_a_list(stories_models, requests):
    # None and 5 raised a plain TypeError (not iterable); a str, bytes or dict was read item by item
    # ("requests[0]: ... found 'O'"), and an iterator was taken although a list is documented.
    with pytest.raises(TinydetError) as e:
        stories_models["fp32"].generate_batch(requests)
    assert str(e.value).startswith("requests: expected a list of request dicts, found ") and one_line(e.value)


@pytest.mark.parametrize("item", [5, "Once", None, [{"prompt": "Once"}]], ids=lambda v: type(v).__name__)
def test_api_generate_batch_request_not_a_dict(stories_models, item):
    with pytest.raises(TinydetError) as e:
        stories_models["fp32"].generate_batch([{"prompt": "Once", "max_tokens": 2}, item])
    assert str(e.value).startswith("requests[1]: expected a dict of generate()'s settings, found ") and one_line(e.value)


@pytest.mark.parametrize("messages", NOT_LISTS, ids=lambda v: type(v).__name__)
def test_api_chat_messages_not_a_list(messages):
    # chat() and chat_prompt() check their messages here: 5 raised a plain TypeError.
    from tinydet.chat import render_chat

    with pytest.raises(TinydetError) as e:
        render_chat("{{ messages }}", messages)
    assert str(e.value).startswith("messages: expected a list of message dicts, found ") and one_line(e.value)


def test_api_failure_inside_engine_raises_its_error(stories_models):
    # NaN logits fail the request inside the engine: generate and generate_batch returned its result,
    # None (AttributeError on .settings), and stream ended quietly as if it had finished.
    m = stories_models["fp32"]

    def poison(layer, op, pos, slots, rows):
        if op == "logits":
            rows[:] = np.nan

    m.backend.hooks.append(poison)
    try:
        with pytest.raises(TinydetError, match="NaN"):
            m.generate("Once", max_tokens=2)
        with pytest.raises(TinydetError, match="NaN"):
            list(m.stream("Once", max_tokens=2))
        with pytest.raises(TinydetError, match="NaN"):
            m.generate_batch([{"prompt": "Once", "max_tokens": 2}])
    finally:
        m.backend.hooks.remove(poison)


def test_api_stop_string_is_not_split_into_characters(stories_models):
    # stop="ab" went through tuple(), so generation stopped at the first "a" or "b".
    m = stories_models["fp32"]
    text = m.generate("Once upon", max_tokens=40).text
    # A two-character stop whose first character occurs before it does: split, it would stop there.
    k = next(k for k in range(1, len(text) - 1) if text.find(text[k:k + 2]) == k and text.find(text[k]) < k)
    stop = text[k:k + 2]
    assert m.generate("Once upon", max_tokens=40, stop=stop).text == text[:k]


def test_api_numpy_arguments_accepted(stories_models):
    # The checkers take what operator.index / numbers.Real take: numpy ids and scalars are not refused.
    m = stories_models["fp32"]
    ids = m.tokenize("Once upon")
    want = m.generate(ids, max_tokens=4, temperature=0.7, top_k=5, seed=3)
    got = m.generate(np.array(ids), max_tokens=np.int64(4), temperature=np.float64(0.7), top_k=np.int64(5),
                     seed=np.uint64(3))
    assert got.token_ids == want.token_ids and got.settings == want.settings
    assert json.dumps(got.settings) == json.dumps(want.settings)  # plain ints and floats: the log's JSON


def test_forward_refuses_non_integer_ids(stories_models):
    # backends.base.plan_batch cast to int64: 1.5 ran as token 1, and 2^63 raised OverflowError.
    b = stories_models["fp32"].backend
    for ids in ([1.5], [2**63], ["7"]):
        with pytest.raises(TinydetError) as e:
            b.forward(ids, b.new_cache(1))
        assert one_line(e.value)


def _gguf_with(tmp_path, write, edits: dict):
    src = tmp_path / "src.gguf"
    write(src)
    p = tmp_path / "m.gguf"
    p.write_bytes(rewrite(src, edits))
    return src, p


def test_gguf_gemma3_per_layer_sliding_flags(tmp_path):
    # The reader gives an array of bools or integers as an ndarray, which the hook took for neither a
    # period nor a list of flags: per-layer flags were refused, and a long array's repr spans lines.
    import gemma3gen

    flags = np.array([(i + 1) % 6 != 0 for i in range(6)])  # the default period 6, layer by layer
    src, p = _gguf_with(tmp_path, gemma3gen.write_gguf, {"gemma3.attention.sliding_window_pattern": flags})
    assert gguf_config(GGUFFile(p))[1] == gguf_config(GGUFFile(src))[1]
    p.write_bytes(rewrite(src, {"gemma3.attention.sliding_window_pattern": np.arange(3000, dtype=np.uint32)}))
    with pytest.raises(ModelFormatError) as e:
        gguf_config(GGUFFile(p))
    assert e.value.field == "gemma3.attention.sliding_window_pattern" and one_line(e.value)


def test_gguf_phi3_sliding_window_array(tmp_path):
    import spmgen

    _, p = _gguf_with(tmp_path, lambda q: spmgen.write_gguf(q, arch="phi3"),
                      {"phi3.attention.sliding_window": np.arange(3000, dtype=np.uint32)})
    with pytest.raises(ModelFormatError) as e:
        gguf_config(GGUFFile(p))
    assert e.value.field == "phi3.attention.sliding_window" and one_line(e.value)


def test_api_top_k_past_int64(stories_models):
    # top_k = 2^64 passed the check (an integer >= 0) and overflowed numba's int64 in sampling; any top_k
    # past the vocabulary keeps every token, as top_k = vocabulary size does.
    m = stories_models["fp32"]
    want = m.generate("Once", max_tokens=4, temperature=0.9, top_k=m.config.vocab_size, seed=1)
    assert m.generate("Once", max_tokens=4, temperature=0.9, top_k=2**64, seed=1).token_ids == want.token_ids


@pytest.mark.parametrize("base", [-1.0, 0.0])
def test_gguf_rope_freq_base_not_positive_with_rope_freqs(tmp_path, base):
    # rope_freqs.weight was turned into Llama 3 parameters from the base before validate() checked
    # it: log(base) raised ZeroDivisionError (fuzz/crashes/gguf).
    import qwen2gen

    _, p = _gguf_with(tmp_path, lambda q: qwen2gen.write_gguf(q, arch="llama3"), {"llama.rope.freq_base": base})
    with pytest.raises(ModelFormatError) as e:
        gguf_config(GGUFFile(p))
    assert e.value.field == "llama.rope.freq_base" and one_line(e.value)


# -- chat templates (the chat_template target): each input rendered past a bound or escaped before ------

CHAT = [{"role": "user", "content": "Hi"}]


def _refused_render(template: str, monkeypatch, *parts) -> None:
    import time
    import tracemalloc

    from tinydet import chat

    monkeypatch.setattr(chat, "MAX_SECONDS", 1.0)
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(chat.ChatTemplateError) as e:
            chat.render_chat(template, CHAT)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert one_line(e.value) and all(p in str(e.value) for p in parts), str(e.value)
    assert time.monotonic() - t0 < 3 and peak < 40 * 2**20, (time.monotonic() - t0, peak)


@pytest.mark.parametrize("template,parts", [
    # a filter walking 8M characters in Python ran 14 s (sort), 7 s (title), 5 s (batch) with no clock
    # check; split() made 2.5M strings (150 MiB)
    ("{{ ('x' * 8000000)|sort|first }}", ["sort() over a string"]),
    ("{{ ('x ' * 4000000)|title|length }}", ["title() over a string"]),
    ("{{ ('x' * 8000000)|batch(3)|list|length }}", ["batch() over a string"]),
    ("{{ ('xy ' * 2500000).split()|length }}", ["split()"]),
    # a list item counted as one character: 8M items (64 MiB of pointers) passed the bound
    ("{{ ([1] * 8000000)|length }}", ["repeating a sequence"]),
    # each string under the bound, the total not: 100 x 4M characters (400 MiB) in 0.03 s
    ("{% set ns = namespace(l=[]) %}{% for i in range(100) %}{% set ns.l = ns.l + ['x' * 4000000] %}{% endfor %}",
     ["built over"]),
    # jinja's lipsum global: 8M paragraphs, no bound at all
    ("{{ lipsum(8388608) }}", ["lipsum()"]),
    # slice(n) makes n lists; tojson's indent multiplies every line
    ("{{ range(10)|slice(1000000)|list|length }}", ["slice()"]),
    ("{{ messages|tojson(indent=1000000) }}", ["tojson()"]),
    # a width from an argument: '{0:{1}}' made a 1e9-character string (1 GB) before the size check
    ("{{ '{0:{1}}'.format(1, 1000000000) }}", ["format width taken from an argument"]),
])
def test_chat_template_bounded(template, parts, monkeypatch):
    _refused_render(template, monkeypatch, *parts)


def test_chat_template_filters_of_constants_run_in_the_render():
    # jinja folded a filter of constants at compile time, outside every bound, into a literal of the
    # generated source: 32 MiB for a branch never taken; a 30,000-item list literal took 23 s to compile
    # under tracemalloc
    import tracemalloc

    from tinydet.chat import render_chat

    tracemalloc.start()
    try:
        assert render_chat("{% if 0 %}{{ 'x'|center(8388608) }}{% endif %}", CHAT) == ""
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, peak


@pytest.mark.parametrize("template,part", [
    ("{{ raise_exception('line one\\nline two') }}", "line one line two"),  # the message spanned lines
    ("{% break %}", "does not parse"),  # Python's SyntaxError on jinja's generated code escaped
    ("{% for m in messages %}{% endfor %}{% continue %}", "does not parse"),
    ("{% if 1 %}" * 150 + "{% endif %}" * 150, "does not parse"),  # IndentationError: too many levels
])
def test_chat_template_error_one_line(template, part):
    from tinydet.chat import ChatTemplateError, render_chat

    with pytest.raises(ChatTemplateError) as e:
        render_chat(template, CHAT)
    assert one_line(e.value) and part in str(e.value)


@pytest.mark.parametrize("name", ["\n", "a\tb\x00", "é\r"])
def test_safetensors_tensor_name_with_control_characters(tmp_path, name):
    """A tensor named "\\n" once gave a two-line message (found by test_fuzz's safetensors target)."""
    from tinydet.formats.safetensors import SafetensorsFile

    text = json.dumps({name: {}}).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text)
    with pytest.raises(ModelFormatError) as e:
        SafetensorsFile(path)
    assert one_line(e.value) and "exactly dtype, shape and data_offsets" in str(e.value)
