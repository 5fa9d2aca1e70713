"""Every bad input gets a one-line error naming the file or the setting, and a non-zero CLI exit."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

import tinydet
from tinydet.cli import main
from tinydet.errors import ContextLengthError, ModelFormatError, TinydetError

import ggufgen as G


def cli(*args):
    r = CliRunner().invoke(main, list(map(str, args)))
    return r.exit_code, r.output


def check_cli(args, *parts):
    code, out = cli(*args)
    assert code != 0, out
    assert "Traceback" not in out
    for p in parts:
        assert p in out, out
    return out


@pytest.fixture
def bad_models(tmp_path, stories_path):
    def make(name, **kw):
        p = tmp_path / f"{name}.gguf"
        p.write_bytes(G.rewrite(stories_path, **kw))
        return p
    return make


def test_missing_path(tmp_path):
    p = tmp_path / "missing.gguf"
    with pytest.raises(ModelFormatError, match="no such file"):
        tinydet.load(p)
    check_cli(["generate", "hi", "--model", p], str(p), "no such file")
    check_cli(["info", p], str(p), "no such file")


def test_not_gguf(tmp_path):
    p = tmp_path / "notes.txt"
    p.write_text("hello, this is not a model file at all" * 10)
    check_cli(["generate", "hi", "--model", p], str(p), "magic", "not a GGUF file")


def test_truncated(tmp_path, stories_path):
    p = tmp_path / "cut.gguf"
    p.write_bytes(stories_path.read_bytes()[:5000])
    check_cli(["generate", "hi", "--model", p], str(p), "truncated")


def test_unsupported_version(tmp_path, stories_path):
    p = tmp_path / "v9.gguf"
    data = bytearray(stories_path.read_bytes())
    data[4:8] = (9).to_bytes(4, "little")
    p.write_bytes(bytes(data))
    check_cli(["generate", "hi", "--model", p], str(p), "version", "expected 2 or 3")


def test_tensor_past_end(tmp_path, stories_path):
    p = tmp_path / "short.gguf"
    p.write_bytes(stories_path.read_bytes()[:-64])
    check_cli(["generate", "hi", "--model", p], str(p), "blk.4.ffn_norm.weight.offset", "runs past the end")


def test_unknown_tensor_type(bad_models):
    def retype(tensors):
        return [(n, s, 99 if n == "output_norm.weight" else t, r) for n, s, t, r in tensors]
    p = bad_models("type", tensor_edits=retype)
    check_cli(["generate", "hi", "--model", p], str(p), "output_norm.weight.type", "unsupported tensor type 99")


def test_unknown_architecture(bad_models):
    p = bad_models("arch", metadata_edits={"general.architecture": "mamba"})
    check_cli(["generate", "hi", "--model", p], str(p), "general.architecture", "'mamba' is not supported")


def test_missing_metadata_key(bad_models):
    p = bad_models("nokey", drop_keys=("llama.block_count",))
    check_cli(["generate", "hi", "--model", p], str(p), "llama.block_count", "missing")


def test_missing_tensor_and_wrong_shape(bad_models):
    p = bad_models("notensor", tensor_edits=lambda ts: [t for t in ts if t[0] != "blk.2.attn_k.weight"])
    check_cli(["generate", "hi", "--model", p], str(p), "blk.2.attn_k.weight", "missing")
    p = bad_models("shape", metadata_edits={"llama.feed_forward_length": G.typed(G.UINT32, 100)})
    check_cli(["generate", "hi", "--model", p], str(p), "blk.0.ffn_gate.weight", "expected shape")


def test_prompt_longer_than_context(bad_models):
    p = bad_models("ctx", metadata_edits={"llama.context_length": G.typed(G.UINT32, 8)})
    prompt = "Once upon a time there was a little girl named Lily who loved to play"
    model = tinydet.load(p)
    with pytest.raises(ContextLengthError, match="prompt"):
        model.generate(prompt, max_tokens=1)
    with pytest.raises(ContextLengthError):
        model.logits(list(range(9)))
    check_cli(["generate", prompt, "--model", p, "--max-tokens", "1"], "prompt", "context of 8 tokens")


def test_max_tokens_overflow(stories_path):
    check_cli(["generate", "Once", "--model", stories_path, "--max-tokens", "5000"],
              "max_tokens", "exceed the model's context of 2048")


def test_bad_dtype_and_threads(stories_path):
    check_cli(["generate", "hi", "--model", stories_path, "--dtype", "fp8"], "--dtype", "fp8")
    check_cli(["generate", "hi", "--model", stories_path, "--threads", "0"], "--threads", "0")
    with pytest.raises(TinydetError, match="dtype"):
        tinydet.load(stories_path, dtype="bf16")
    with pytest.raises(TinydetError, match="threads"):
        tinydet.load(stories_path, threads=0)
    check_cli(["generate", "hi", "--model", stories_path, "--max-tokens", "0"], "--max-tokens")


def test_bad_token_ids(stories_models):
    with pytest.raises(TinydetError, match=r"^token_ids: token id 99999 is outside the vocabulary \(0\.\.511\)$"):
        stories_models["fp32"].logits([1, 99999])


def test_info(stories_path):
    code, out = cli("info", stories_path)
    assert code == 0, out
    assert "270cba1bd5109f42d03350f60406024560464db173c0e387d91f0426d3bd256d" in out
    assert "llama.block_count = 5" in out and "blk.0.attn_q.weight" in out and "n_kv_heads = 4" in out


def test_inconsistent_heads(bad_models):
    p = bad_models("kv", metadata_edits={"llama.attention.head_count_kv": G.typed(G.UINT32, 3)})
    check_cli(["generate", "hi", "--model", p], str(p), "llama.attention.head_count_kv", "do not divide 8")
    p = bad_models("eps", metadata_edits={"llama.attention.layer_norm_rms_epsilon": -1.0})
    check_cli(["info", p], str(p), "llama.attention.layer_norm_rms_epsilon", "expected an RMSNorm epsilon")
