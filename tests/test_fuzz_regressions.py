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
    from tinydet.formats.jsonfile import read_json

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
