"""Hugging Face directories (tinydet/formats/hf_dir.py, safetensors.py): every bad input is a one-line ModelFormatError naming the
file and the field; BF16 is widened exactly; a sharded checkpoint loads bit for bit like one file.

The broken directories are copies of stories260K converted by tinydet.tools.convert (1 MB, fast)."""

from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest

import tinydet
from tinydet.tools.convert import convert_gguf_to_hf
from tinydet.errors import ModelFormatError
from tinydet.formats.hf_dir import open_hf_dir
from tinydet.formats.safetensors import SafetensorsFile, bf16_to_f32

PROMPT_IDS = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396,
              385, 273, 374, 268, 261, 352, 359, 266, 370, 331, 290, 414, 306, 366, 263]


@pytest.fixture(scope="module")
def stories_dir(tmp_path_factory, stories_path):
    return convert_gguf_to_hf(stories_path, tmp_path_factory.mktemp("hf") / "stories260K")


@pytest.fixture(scope="module")
def stories_loaded(stories_dir):
    return open_hf_dir(stories_dir)


@pytest.fixture
def model_dir(tmp_path, stories_dir):
    """A fresh, writable copy of the converted stories260K directory."""
    d = tmp_path / "model"
    shutil.copytree(stories_dir, d)
    return d


# -- helpers -------------------------------------------------------------------------------------------

def read_st(path):
    """(header dict, data bytes) of a safetensors file, without trusting anything."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_st(path, header, data, header_len=None):
    """Write a safetensors file from a header dict and data bytes; `header_len` overrides the length."""
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    path.write_bytes(struct.pack("<Q", len(hb) if header_len is None else header_len) + hb + data)


def edit_config(d, **changes):
    p = d / "config.json"
    c = json.loads(p.read_text())
    for k, v in changes.items():
        if v is ...:
            del c[k]
        else:
            c[k] = v
    p.write_text(json.dumps(c))
    return p


def expect_error(d, *parts, file=None, loader=open_hf_dir):
    """Loading `d` raises a one-line ModelFormatError naming `file` (default: d) and each of `parts`."""
    with pytest.raises(ModelFormatError) as ei:
        loader(d)
    msg = str(ei.value)
    assert "\n" not in msg, msg
    assert str(file or d) in msg, msg
    for p in parts:
        assert p in msg, msg
    return msg


def uint32(a):
    return np.ascontiguousarray(a).view(np.uint32)


# -- the good directory --------------------------------------------------------------------------------

def test_loads_like_the_gguf(stories_dir, stories_loaded, stories_models):
    cfg, weights, tok, meta = stories_loaded.config, stories_loaded.tensors, stories_loaded.tokenizer, stories_loaded.metadata
    gguf = stories_models["fp32"]
    assert cfg == gguf.config
    assert meta["format"] == "huggingface" and meta["config"]["model_type"] == "llama"
    assert all(np.asarray(w).dtype == np.float32 for w in weights.values())
    assert (tok.bos_id, tok.eos_ids, tok.add_bos, tok.add_eos) == (1, (2,), True, False)
    m = tinydet.load(stories_dir)
    assert m.tokenize("Once upon a time") == gguf.tokenize("Once upon a time")
    assert np.array_equal(uint32(m.logits(PROMPT_IDS)), uint32(gguf.logits(PROMPT_IDS)))


def test_progress(stories_dir):
    calls = []
    open_hf_dir(stories_dir, progress=lambda done, total, name: calls.append((done, total, name)))
    total = 3 + 9 * 5
    assert calls[0] == (0, total, "model.embed_tokens.weight")
    assert calls[-1] == (total, total, "")
    assert [c[0] for c in calls] == list(range(total + 1))
    assert "model.layers.4.mlp.up_proj.weight" in {c[2] for c in calls}


# -- config.json ---------------------------------------------------------------------------------------

def test_missing_config(model_dir):
    (model_dir / "config.json").unlink()
    expect_error(model_dir, "config.json", "missing", file=model_dir / "config.json")


def test_config_not_json(model_dir):
    (model_dir / "config.json").write_text("{'hidden_size': 64,")
    expect_error(model_dir, "config.json", "not valid JSON", file=model_dir / "config.json")


@pytest.mark.parametrize("field", ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                   "vocab_size", "max_position_embeddings", "rms_norm_eps"])
def test_config_missing_field(model_dir, field):
    p = edit_config(model_dir, **{field: ...})
    expect_error(model_dir, field, "missing", file=p, loader=tinydet.load)


def test_config_defaults(model_dir, stories_loaded):
    """num_key_value_heads defaults to the head count and rope_theta to 10000; transformers 5's
    rope_parameters is read too."""
    edit_config(model_dir, rope_theta=..., rope_scaling=..., head_dim=...)
    assert open_hf_dir(model_dir).config == stories_loaded.config
    edit_config(model_dir, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert open_hf_dir(model_dir).config == stories_loaded.config
    edit_config(model_dir, num_key_value_heads=...)
    expect_error(model_dir, "model.layers.0.self_attn.k_proj.weight", "(64, 64)", "(32, 64)",
                 file=model_dir / "model.safetensors")


@pytest.mark.parametrize("changes, parts", [
    (dict(num_attention_heads=7, head_dim=...), ("num_attention_heads", "7 heads do not divide hidden_size 64")),
    (dict(num_key_value_heads=3), ("num_key_value_heads", "3 KV heads do not divide 8 query heads")),
    (dict(head_dim=7), ("head_dim", "RoPE needs an even head dimension, found 7")),
    (dict(head_dim="16"), ("head_dim", "expected an integer")),
    (dict(hidden_size="64"), ("hidden_size", "expected an integer")),
    (dict(num_hidden_layers=0), ("num_hidden_layers", "positive integer")),
    (dict(rms_norm_eps=2.0), ("rms_norm_eps", "(0, 1)")),
    (dict(model_type="deepseek_v3"), ("model_type", "'deepseek_v3' is not supported")),
    (dict(model_type=..., architectures=["GPT2LMHeadModel"]), ("model_type", "only Llama")),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), ("rope_scaling.low_freq_factor", "missing")),
    (dict(rope_scaling={"rope_type": "longrope", "factor": 8.0}), ("rope_scaling", "'longrope' is not supported")),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), ("rope_parameters", "'yarn' is not supported")),
    (dict(hidden_act="gelu"), ("hidden_act", "'gelu' is not supported")),
    (dict(attention_bias=True), ("attention_bias", "not supported")),
    (dict(tie_word_embeddings="yes"), ("tie_word_embeddings", "true or false")),
])
def test_config_inconsistent(model_dir, changes, parts):
    p = edit_config(model_dir, **changes)
    expect_error(model_dir, *parts, file=p)


def test_tensor_shape_disagrees_with_config(model_dir):
    edit_config(model_dir, intermediate_size=171)
    expect_error(model_dir, "model.layers.0.mlp.gate_proj.weight", "expected shape (171, 64)", "found (172, 64)",
                 file=model_dir / "model.safetensors")


def test_vocab_smaller_than_tokenizer(model_dir):
    edit_config(model_dir, vocab_size=100)
    expect_error(model_dir, "tokenizer.json", "512 tokens", file=model_dir / "tokenizer.json")


# -- weights -------------------------------------------------------------------------------------------

def _rewrite_tensors(d, change):
    """Rewrite model.safetensors with `change(dict of float32 arrays)` applied."""
    from safetensors.numpy import load_file, save_file

    p = d / "model.safetensors"
    t = load_file(str(p))
    change(t)
    save_file(t, str(p), metadata={"format": "pt"})
    return p


def test_missing_tensor(model_dir):
    p = _rewrite_tensors(model_dir, lambda t: t.pop("model.layers.3.self_attn.v_proj.weight"))
    expect_error(model_dir, "model.layers.3.self_attn.v_proj.weight", "missing", file=p)


def test_lm_head_missing_without_tie(model_dir, stories_loaded):
    p = _rewrite_tensors(model_dir, lambda t: t.pop("lm_head.weight"))
    expect_error(model_dir, "lm_head.weight", "tie_word_embeddings is false", file=p)
    edit_config(model_dir, tie_word_embeddings=True)
    w = open_hf_dir(model_dir).tensors
    assert w["output"] is w["tok_embeddings"]
    assert np.array_equal(w["output"], stories_loaded.tensors["tok_embeddings"])


def test_unexpected_tensor(model_dir):
    p = _rewrite_tensors(model_dir, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}))
    expect_error(model_dir, "model.layers.0.self_attn.q_proj.bias", "unexpected tensor", file=p)


def test_pickle_only_refused(model_dir):
    (model_dir / "model.safetensors").unlink()
    (model_dir / "pytorch_model.bin").write_bytes(b"\x80\x04this would be unpickled")
    msg = expect_error(model_dir, "pytorch_model.bin", "pickle", "arbitrary code", loader=tinydet.load)
    assert "safetensors" in msg


def test_no_weights(model_dir):
    (model_dir / "model.safetensors").unlink()
    expect_error(model_dir, "model.safetensors", "missing")


# -- lying safetensors headers -------------------------------------------------------------------------

def _lie(d, edit, header_len=None):
    p = d / "model.safetensors"
    header, data = read_st(p)
    data = edit(header, data) or data
    write_st(p, header, data, header_len)
    return p


def test_offsets_past_eof(model_dir):
    def edit(h, data):
        b, e = h["model.norm.weight"]["data_offsets"]
        h["model.norm.weight"]["data_offsets"] = [len(data) - (e - b) + 8, len(data) + 8]
    p = _lie(model_dir, edit)
    expect_error(model_dir, "model.norm.weight.data_offsets", "runs past the end", file=p)


def test_offsets_overlap(model_dir):
    def edit(h, data):
        h["model.layers.1.input_layernorm.weight"]["data_offsets"] = h["model.layers.0.input_layernorm.weight"]["data_offsets"]
    p = _lie(model_dir, edit)
    expect_error(model_dir, "input_layernorm.weight.data_offsets", "overlaps", file=p)


def test_size_mismatch(model_dir):
    def edit(h, data):
        h["model.norm.weight"]["shape"] = [65]
    p = _lie(model_dir, edit)
    expect_error(model_dir, "model.norm.weight.data_offsets", "holds 256 bytes", "needs 260", file=p)


def test_trailing_bytes(model_dir):
    p = _lie(model_dir, lambda h, data: data + b"\0" * 16)
    expect_error(model_dir, "data_offsets", "trailing bytes", file=p)


def test_gap(model_dir):
    def edit(h, data):
        last = max((n for n in h if n != "__metadata__"), key=lambda n: h[n]["data_offsets"][0])
        b, e = h[last]["data_offsets"]
        h[last]["data_offsets"] = [b + 4, e + 4]
        return data[:b] + b"\0" * 4 + data[b:]
    p = _lie(model_dir, edit)
    expect_error(model_dir, "data_offsets", "gap of 4 bytes", file=p)


def test_unknown_dtype(model_dir):
    def edit(h, data):
        h["model.norm.weight"]["dtype"] = "F9"
    p = _lie(model_dir, edit)
    expect_error(model_dir, "model.norm.weight.dtype", "unknown dtype 'F9'", file=p)


def test_unsupported_dtype(model_dir):
    def edit(h, data):
        h["model.norm.weight"]["dtype"] = "I32"
    p = _lie(model_dir, edit)
    expect_error(model_dir, "model.norm.weight.dtype", "I32 is not supported", file=p)


@pytest.mark.parametrize("header_len", [2**64 - 1, 2**40, 1])
def test_garbage_header_length(model_dir, header_len):
    p = _lie(model_dir, lambda h, data: None, header_len=header_len)
    expect_error(model_dir, "header length", file=p)


def test_header_not_json(model_dir):
    p = model_dir / "model.safetensors"
    raw = bytearray(p.read_bytes())
    raw[8:12] = b"{{{{"
    p.write_bytes(bytes(raw))
    expect_error(model_dir, "header", "not valid JSON", file=p)


def test_truncated_file(model_dir):
    p = model_dir / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-100])
    expect_error(model_dir, "data_offsets", "runs past the end", file=p)


def test_header_checked_before_safetensors(model_dir):
    """The checks stand on their own: a lying file never reaches safetensors or NumPy."""
    p = _lie(model_dir, lambda h, data: h["model.norm.weight"].__setitem__("data_offsets", [0, 256]))
    with pytest.raises(ModelFormatError, match="overlaps"):
        SafetensorsFile(p)


# -- BF16 ----------------------------------------------------------------------------------------------

def test_bf16_known_values():
    bits = np.array([0x0000, 0x8000, 0x3F80, 0xBF80, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x0001, 0x807F, 0x7F7F],
                    np.uint16)
    out = bf16_to_f32(bits)
    assert out.dtype == np.float32
    assert np.array_equal(uint32(out), bits.astype(np.uint32) << 16)
    assert out[2] == 1.0 and out[3] == -1.0 and np.isposinf(out[4]) and np.isneginf(out[5])
    assert np.isnan(out[6]) and np.isnan(out[7])
    assert out[8] == np.float32(2.0 ** -133)  # the smallest subnormal
    assert out[10] == np.float32(3.3895313892515355e38)


def test_bf16_matches_torch_exhaustively():
    torch = pytest.importorskip("torch")
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)  # every pattern: NaNs, infs, subnormals
    ours = bf16_to_f32(bits)
    theirs = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16).to(torch.float32).numpy()
    assert np.array_equal(uint32(ours), uint32(theirs))


def test_bf16_checkpoint(model_dir, stories_loaded):
    """A BF16 safetensors file (written by hand: NumPy has no bfloat16) loads as its exact values."""
    p = model_dir / "model.safetensors"
    header, data = read_st(p)
    f32 = {name: np.frombuffer(data, "<f4", count=int(np.prod(info["shape"])), offset=info["data_offsets"][0])
           for name, info in header.items() if name != "__metadata__"}
    new_header, chunks, pos = {"__metadata__": {"format": "pt"}}, [], 0
    rng = np.random.default_rng(0)
    expected = {}
    for name, a in f32.items():
        # Round-to-nearest-even to bf16, plus a few special patterns in the first row.
        u = a.view(np.uint32).astype(np.uint64)
        b = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        b.reshape(-1)[:4] = rng.choice([0x7F80, 0xFFC1, 0x0001, 0x8000], 4)
        expected[name] = (b.astype(np.uint32) << 16).view(np.float32)
        raw = b.tobytes()
        shape = list(header[name]["shape"])
        new_header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [pos, pos + len(raw)]}
        chunks.append(raw)
        pos += len(raw)
    write_st(p, new_header, b"".join(chunks))
    w = open_hf_dir(model_dir).tensors
    names = {"tok_embeddings": "model.embed_tokens.weight", "layers.2.wk": "model.layers.2.self_attn.k_proj.weight",
             "layers.4.ffn_norm": "model.layers.4.post_attention_layernorm.weight", "output": "lm_head.weight"}
    for canon, hf in names.items():
        assert np.array_equal(uint32(w[canon]), uint32(expected[hf].reshape(w[canon].shape))), canon
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file
    ref = load_file(str(p))
    for canon, hf in names.items():
        assert np.array_equal(uint32(w[canon]), uint32(ref[hf].to(torch.float32).numpy())), canon


# -- shards --------------------------------------------------------------------------------------------

def _shard(d):
    from safetensors.numpy import load_file, save_file

    t = load_file(str(d / "model.safetensors"))
    names = sorted(t)
    halves = {"model-00001-of-00002.safetensors": names[:len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    wm = {}
    for shard, ns in halves.items():
        save_file({n: t[n] for n in ns}, str(d / shard), metadata={"format": "pt"})
        wm.update({n: shard for n in ns})
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": wm}))
    return halves


def test_sharded_loads_bit_identically(model_dir, stories_loaded, stories_models):
    _shard(model_dir)
    ck = open_hf_dir(model_dir)
    cfg, w, meta = ck.config, ck.tensors, ck.metadata
    assert cfg == stories_loaded.config and len(meta["files"]) == 2
    ref = stories_loaded.tensors
    assert w.keys() == ref.keys()
    for k in ref:
        assert np.array_equal(uint32(w[k]), uint32(ref[k])), k
    m = tinydet.load(model_dir)
    assert np.array_equal(uint32(m.logits(PROMPT_IDS)), uint32(stories_models["fp32"].logits(PROMPT_IDS)))


def test_missing_shard(model_dir):
    halves = _shard(model_dir)
    (model_dir / "model-00002-of-00002.safetensors").unlink()
    first = halves["model-00002-of-00002.safetensors"][0]
    expect_error(model_dir, f"weight_map.{first}", "'model-00002-of-00002.safetensors' is missing",
                 file=model_dir / "model.safetensors.index.json")


def test_shard_path_outside_dir(model_dir):
    _shard(model_dir)
    p = model_dir / "model.safetensors.index.json"
    idx = json.loads(p.read_text())
    name = next(iter(idx["weight_map"]))
    idx["weight_map"][name] = "../elsewhere.safetensors"
    p.write_text(json.dumps(idx))
    expect_error(model_dir, "not a plain file name", file=p)


def test_index_points_to_wrong_shard(model_dir):
    halves = _shard(model_dir)
    p = model_dir / "model.safetensors.index.json"
    idx = json.loads(p.read_text())
    name = halves["model-00001-of-00002.safetensors"][0]
    idx["weight_map"][name] = "model-00002-of-00002.safetensors"
    p.write_text(json.dumps(idx))
    expect_error(model_dir, f"weight_map.{name}", "has no tensor", file=p)


# -- tokenizer -----------------------------------------------------------------------------------------

def test_tokenizer_does_not_parse(model_dir):
    p = model_dir / "tokenizer.json"
    p.write_text('{"version": "1.0", "model": {"type": "NoSuchModel"}}')
    expect_error(model_dir, "tokenizer.json", "does not parse", file=p)
    p.write_text("not json at all")
    expect_error(model_dir, "tokenizer.json", "does not parse", file=p)


def test_tokenizer_missing(model_dir):
    (model_dir / "tokenizer.json").unlink()
    expect_error(model_dir, "tokenizer.json", "missing", file=model_dir / "tokenizer.json")


def test_tokenizer_config_variants(model_dir):
    p = model_dir / "tokenizer_config.json"
    tc = json.loads(p.read_text())
    # AddedToken dicts, a list of named templates, EOS ids as a list in generation_config.json.
    tc["bos_token"] = {"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False, "special": True}
    tc["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    p.write_text(json.dumps(tc))
    (model_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 0]}))
    tok = open_hf_dir(model_dir).tokenizer
    assert (tok.bos_id, tok.eos_ids, tok.chat_template) == (1, (2, 0), "D")
    # Without add_bos_token, what tokenizer.json's post-processor does decides (it adds <s>).
    del tc["add_bos_token"]
    tc["chat_template"] = "{{ messages }}"
    p.write_text(json.dumps(tc))
    tok = open_hf_dir(model_dir).tokenizer
    assert tok.add_bos and tok.encode("hi")[0] == 1 and tok.chat_template == "{{ messages }}"
    tc["add_bos_token"] = False
    p.write_text(json.dumps(tc))
    assert open_hf_dir(model_dir).tokenizer.encode("hi")[0] != 1


@pytest.mark.parametrize("key, value, parts", [
    ("bos_token", "<nope>", ("bos_token", "'<nope>' is not in tokenizer.json's vocabulary")),
    ("eos_token", 7, ("eos_token", "expected a token string")),
    ("add_bos_token", "yes", ("add_bos_token", "true or false")),
    ("chat_template", 5, ("chat_template", "expected a string")),
])
def test_tokenizer_config_bad(model_dir, key, value, parts):
    p = model_dir / "tokenizer_config.json"
    tc = json.loads(p.read_text())
    tc[key] = value
    p.write_text(json.dumps(tc))
    expect_error(model_dir, *parts, file=p)


def test_generation_config_bad_eos(model_dir):
    p = model_dir / "generation_config.json"
    p.write_text(json.dumps({"eos_token_id": [2, 99999]}))
    expect_error(model_dir, "eos_token_id", "99999 is outside the vocabulary", file=p)
