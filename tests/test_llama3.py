"""Llama 3.x beyond the contract tests of tests/test_qwen.py: its RoPE scaling's per-frequency divisors
against llama.cpp's converter and transformers, GGUF rope_freqs.weight that no llama3 setting gives
(run as stored, refused by convert), the files tinydet refuses, the llama-bpe tokenizer against HF's
tokenizers on varied text, the chat template against transformers' apply_chat_template, and the
tokens generation stops on from either format."""

from __future__ import annotations

import numpy as np
import pytest

import qwen2gen as Q
import tinydet
from contract import bits
from tinydet.config import RoPE
from tinydet.rope import from_factors, inv_freq, llama3_factors

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

ARCH = "llama3"
# (rope_theta, head_dim, rope_scaling) of Meta's published configs, and the tiny model's.
CONFIGS = {
    "llama-3.1-8b/70b/405b, 3.3-70b": (500000.0, 128, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 8192}),
    "llama-3.2-1b": (500000.0, 64, {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192}),
    "llama-3.2-3b": (500000.0, 128, {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192}),
    "tiny": (Q.LLAMA3_ROPE_THETA, Q.HEAD_DIM, Q.LLAMA3_ROPE),
}


def _rope(base, p) -> RoPE:
    return RoPE(base, "llama3", p["factor"], p["low_freq_factor"], p["high_freq_factor"],
                p["original_max_position_embeddings"])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama3")
    return Q.make_tiny_qwen2(out, None, arch=ARCH)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_divisors_are_llama_cpp_converters(name):
    """tinydet's divisors from a config.json are the ones llama.cpp's converter stores in the GGUF
    (its own torch code, tests/qwen2gen.py), bit for bit, and reading those back gives the config's
    parameters: an HF directory and its GGUF run the same frequencies."""
    base, hd, p = CONFIGS[name]
    stored = Q.llama3_rope_freqs(base, hd, p)
    rope = _rope(base, p)
    assert np.array_equal(bits(llama3_factors(rope, hd)), bits(stored))
    assert from_factors(base, hd, stored) == rope
    assert 1.0 in stored and p["factor"] in stored  # each config has unscaled and fully scaled frequencies


@pytest.mark.parametrize("name", list(CONFIGS))
def test_frequencies_match_transformers(name):
    """Against transformers' own llama3 RoPE initialisation (float32): the same frequencies to float32
    precision (tinydet's are float64 with float32 divisors)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    base, hd, p = CONFIGS[name]
    cfg = transformers.LlamaConfig(hidden_size=hd * 4, num_attention_heads=4, head_dim=hd,
                                   rope_parameters={"rope_type": "llama3", "rope_theta": base, **p})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    got = inv_freq(_rope(base, p), hd)
    rel = np.abs(got - want.double().numpy()) / got
    assert rel.max() <= 4e-7, rel.max()


def _rewrite(src, dst, **kw):
    from ggufgen import rewrite

    dst.write_bytes(rewrite(src, **kw))
    return dst


def _replace_tensor(name, value):
    def edit(tensors):
        return [(n, value.shape, 0, value.astype(np.float32).tobytes()) if n == name else (n, s, t, b)
                for n, s, t, b in tensors]
    return edit


def test_divisors_no_llama3_setting_gives_run_as_stored(files, tmp_path):
    """A rope_freqs.weight one ulp off llama3's (as a converter with another float32 pow could write):
    the file runs its own divisors exactly (scaling "factors"), within float32 noise of the exact file;
    converting it to a directory, whose config.json could not say them, is refused and leaves nothing."""
    from tinydet.tools.convert import convert_gguf_to_hf

    hf_dir, gguf = files
    f = Q.llama3_rope_freqs()
    band = [i for i, x in enumerate(f) if 1.0 < x < Q.LLAMA3_ROPE["factor"]]
    assert band
    odd = f.copy()
    odd[band[0]] = np.nextafter(odd[band[0]], np.float32(np.inf))
    path = _rewrite(gguf, tmp_path / "odd.gguf", tensor_edits=_replace_tensor("rope_freqs.weight", odd))
    model, exact = tinydet.load(path), tinydet.load(gguf)
    assert model.config.rope.scaling == "factors" and model.config.rope.freq_factors == tuple(float(x) for x in odd)
    want = inv_freq(RoPE(Q.LLAMA3_ROPE_THETA), Q.HEAD_DIM) / odd.astype(np.float64)
    assert np.array_equal(inv_freq(model.config.rope, Q.HEAD_DIM), want)
    ids = exact.tokenize("The quick brown fox jumps over the lazy dog.")
    assert np.abs(model.logits(ids) - exact.logits(ids)).max() <= 1e-4
    with pytest.raises(tinydet.TinydetError, match="rope_freqs.weight") as e:
        convert_gguf_to_hf(path, tmp_path / "out")
    assert "config.json cannot say" in str(e.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


@pytest.mark.parametrize("case, field, words", [
    ("qwen2 with rope_freqs", "rope_freqs.weight", "not supported for qwen2"),
    ("wrong shape", "rope_freqs.weight", "expected F32 of shape (8,)"),
    ("with linear scaling", "rope_freqs.weight", "together with RoPE scaling 'linear'"),
    ("yarn", "llama.rope.scaling.type", "'yarn' is not supported"),
    ("non-positive divisor", "rope_freqs.weight", "positive, finite"),
])
def test_bad_rope_settings_are_refused(files, tmp_path, case, field, words):
    """Each a one-line ModelFormatError naming the file and the key or tensor."""
    gguf = files[1]
    f = Q.llama3_rope_freqs()
    if case == "qwen2 with rope_freqs":
        src = Q.write_gguf(tmp_path / "q.gguf", arch="qwen2")
        path = _rewrite(src, tmp_path / "bad.gguf",
                        tensor_edits=lambda ts: [("rope_freqs.weight", f.shape, 0, f.tobytes())] + ts)
    elif case == "wrong shape":
        path = _rewrite(gguf, tmp_path / "bad.gguf", tensor_edits=_replace_tensor("rope_freqs.weight", f[:6]))
    elif case == "with linear scaling":
        path = _rewrite(gguf, tmp_path / "bad.gguf", metadata_edits={"llama.rope.scaling.type": "linear",
                                                                    "llama.rope.scaling.factor": 2.0})
    elif case == "yarn":
        path = _rewrite(gguf, tmp_path / "bad.gguf", metadata_edits={"llama.rope.scaling.type": "yarn"})
    else:
        g = f.copy()
        g[3] = 0.0
        path = _rewrite(gguf, tmp_path / "bad.gguf", tensor_edits=_replace_tensor("rope_freqs.weight", g))
    with pytest.raises(tinydet.ModelFormatError) as e:
        tinydet.load(path)
    msg = str(e.value)
    assert str(path) in msg and field in msg and words in msg and "\n" not in msg, msg


STRINGS = ["Hello world", "1234567 and 12 345 6789012", "I'M sure you'LL agree, don't you?", "naïve café, déjà vu",
           "日本語のテキスト and 中文", "emoji 🎉🚀 here", "tabs\tand\n\nnewlines\r\n  indented", "  leading spaces",
           "def f(x):\n    return x ** 2  # square", "$19.99 (12% off) #4B @home", "<|eot_id|> inside text",
           "THE END, The End, the end...", "a" * 40, "", " ", "\n", "x=1;y=2;z=x+y", "e-mail: a.b@c.de",
           "3.14159, -7.5e-3, 0x1F", "'s 't 're 've 'm 'll 'd", "Ünïcödé ÀÉÎÕÜ", "..!!??;;::"]


def test_tokenizer_matches_hf_tokenizers(files):
    """GGUF (llama.cpp's llama-bpe) and HF directory tokenize like HF's tokenizers on tokenizer.json,
    BOS included, and decode back to the text."""
    hf_dir, gguf = files
    ref = Q.hf_tokenizer(ARCH)
    a, b = tinydet.load(gguf), tinydet.load(hf_dir)
    bos = Q.token_id("<|begin_of_text|>", ARCH)
    for text in STRINGS:
        want = ref.encode(text).ids
        assert want[0] == bos
        assert a.tokenize(text) == b.tokenize(text) == want, text
        if "<|" not in text:  # special tokens are not text (decoding leaves them out)
            assert a.detokenize(want) == text, text


MESSAGES = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi! How can I help?"},
     {"role": "user", "content": "Tell me a joke.\n\nA short one."}],
]


def test_chat_template_renders_as_transformers(files):
    """Llama 3.2's template (its date line from strftime_now, which tinydet pins to 01 Jan 2024) as
    transformers' apply_chat_template renders it with that date, and tokenized the same."""
    hf_dir, gguf = files
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    for model in (tinydet.load(gguf), tinydet.load(hf_dir)):
        for msgs in MESSAGES:
            want = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, date_string="01 Jan 2024")
            assert "Today Date: 01 Jan 2024" in want
            from tinydet.chat import render_chat

            assert render_chat(model.tokenizer.chat_template, msgs, bos_token="<|begin_of_text|>") == want
            ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, date_string="01 Jan 2024")
            if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            assert model.chat_prompt(msgs) == list(ids)


def test_generation_stops_on_llama3s_end_tokens(files):
    """Both formats end generation on <|end_of_text|>, <|eom_id|> and <|eot_id|>: the HF directory
    from generation_config.json, the GGUF from its eos (<|eot_id|>) and the tokens llama.cpp ends on by
    their text."""
    hf_dir, gguf = files
    want = {Q.token_id(t, ARCH) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")}
    assert set(tinydet.load(gguf).tokenizer.eos_ids) == set(tinydet.load(hf_dir).tokenizer.eos_ids) == want
