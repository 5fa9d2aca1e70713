"""GGUF -> Hugging Face directory (tinydet/convert.py).

The converted directory must run in tinydet with the GGUF's exact bits (fp32 and fp16), load in HF
transformers as a plain LlamaForCausalLM with the same greedy tokens and the same token ids, keep the
chat template, and never be left half-written."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest

import tinydet
from tinydet.tools.convert import OUTPUT_FILES, convert_gguf_to_hf
from tinydet.errors import TinydetError
from tinydet.numerics import simd as cpu

from reference import hf_greedy

MIN_PROMPT_TOKENS = 30
STORIES_PROMPT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park "
                  "with her friends. One day, she saw a big red ball.")
SMOLLM_PROMPTS = [
    "Once upon a time, in a small village nestled between rolling hills and a quiet river, there lived "
    "an old clockmaker who spent his days repairing the watches of his neighbours.",
    "Here is a short Python function that returns the n-th Fibonacci number using iteration rather than "
    "recursion, together with a brief explanation of how it works:\n\n",
]
SMOLLM_GREEDY_NEW = 32
STORIES_GREEDY_NEW = 64
TOKENIZER_STRINGS = [
    "", " ", "  ", "\n", "Hello world", " leading space", "trailing space ", "double  space", "tabs\tand\nnewlines\n\n",
    "Lily's mom said, \"Don't worry!\"", "numbers 1234567 and 3.14159", "café naïve über", "中文字符", "emoji 😀🎉",
    "<s>special</s> in text", "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", "a<|endoftext|>b",
    "aaaaaaaaaaaaaaaa", "the the the the", "ThE qUiCk BrOwN fOx", "x" * 200, "\x00\x01 control \x7f",
]


def uint32(a):
    return np.ascontiguousarray(a).view(np.uint32)


@pytest.fixture(scope="module")
def out_root(tmp_path_factory):
    return tmp_path_factory.mktemp("converted")


@pytest.fixture(scope="module")
def converted(out_root, stories_path, smollm_path):
    """Lazily converted directories: converted(model, dtype) -> Path, with model "stories" or "smollm"."""
    done = {}
    src = {"stories": stories_path, "smollm": smollm_path}

    def get(model, dtype="fp32"):
        if (model, dtype) not in done:
            done[model, dtype] = convert_gguf_to_hf(src[model], out_root / f"{model}-{dtype}", dtype=dtype)
        return done[model, dtype]

    return get


@pytest.fixture(scope="module")
def dir_models(converted):
    """tinydet models loaded from the converted directories, once each: dir_models(model, dir dtype, dtype)."""
    cache = {}

    def get(model, dir_dtype="fp32", dtype="fp32"):
        key = (model, dir_dtype, dtype)
        if key not in cache:
            cache[key] = tinydet.load(converted(model, dir_dtype), dtype=dtype)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def gguf_models(stories_models, smollm_models):
    def get(model, dtype="fp32"):
        return stories_models[dtype] if model == "stories" else smollm_models(dtype)
    return get


@pytest.fixture(scope="module")
def hf_models(converted):
    """transformers' AutoModelForCausalLM / AutoTokenizer on the converted fp32 directories (once each)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    cache = {}

    def get(model):
        if model not in cache:
            d = str(converted(model))
            m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
            m.eval()
            cache[model] = (m, AutoTokenizer.from_pretrained(d))
        return cache[model]

    return get


def prompt_ids(model, gguf_models):
    text = STORIES_PROMPT if model == "stories" else SMOLLM_PROMPTS[0]
    ids = gguf_models(model).tokenize(text)
    assert len(ids) >= MIN_PROMPT_TOKENS
    return ids


# -- the files -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("model, tied", [("stories", False), ("smollm", True)])
def test_files(converted, model, tied):
    from safetensors import safe_open

    d = converted(model)
    assert sorted(os.listdir(d)) == ["config.json", "generation_config.json", "model.safetensors",
                                     "tokenizer.json", "tokenizer_config.json"]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["tie_word_embeddings"] is tied and cfg["rope_scaling"] is None
    with safe_open(str(d / "model.safetensors"), framework="numpy") as f:
        assert ("lm_head.weight" in f.keys()) is not tied
        assert f.metadata()["format"] == "pt"  # transformers refuses safetensors files without it
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    tc = json.loads((d / "tokenizer_config.json").read_text())
    assert tc["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert ("chat_template" in tc) is (model == "smollm")


def test_fp16_files_round_once(converted, gguf_models):
    """fp16 stores matrices as binary16 (NumPy's RNE, the same bits as tinydet's own fp16 rounding) and
    keeps the norms float32, which is what tinydet's fp16 mode stores."""
    from safetensors import safe_open

    from tinydet.formats.gguf_model import open_gguf

    d = converted("stories", "fp16")
    w = open_gguf(gguf_models("stories").path).tensors
    with safe_open(str(d / "model.safetensors"), framework="numpy") as f:
        emb = f.get_tensor("model.embed_tokens.weight")
        q = f.get_tensor("model.layers.2.self_attn.q_proj.weight")
        norm = f.get_tensor("model.layers.2.input_layernorm.weight")
    assert emb.dtype == q.dtype == np.float16 and norm.dtype == np.float32
    for ours, f32 in ((emb, w["tok_embeddings"]), (q, w["layers.2.wq"])):
        assert np.array_equal(ours.view(np.uint16), cpu.to_f16_bits(np.ascontiguousarray(f32)))
        # Idempotent: rounding the widened value again gives the same bits.
        assert np.array_equal(cpu.to_f16_bits(ours.astype(np.float32)), ours.view(np.uint16))
    assert np.array_equal(uint32(norm), uint32(w["layers.2.attention_norm"]))
    # Ties and halfway cases of RNE, checked directly.
    x = np.array([1 + 2**-11, 1 + 3 * 2**-11, 65504.0, 65520.0, 2**-25, 3 * 2**-25, -0.0], np.float32)
    with np.errstate(over="ignore"):  # 65520 rounds up to inf, in both
        assert np.array_equal(x.astype(np.float16).view(np.uint16), cpu.to_f16_bits(x))


# -- tinydet: bit-identical to the GGUF ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("model", ["stories", "smollm"])
def test_logits_bit_identical(dir_models, gguf_models, model, dtype):
    ids = prompt_ids(model, gguf_models)
    ref = gguf_models(model, dtype).logits(ids)
    m = dir_models(model, "fp32", dtype)
    assert m.config == gguf_models(model).config
    assert np.array_equal(uint32(m.logits(ids)), uint32(ref))


@pytest.mark.parametrize("model", ["stories", "smollm"])
def test_fp16_dir_bit_identical(dir_models, gguf_models, model):
    ids = prompt_ids(model, gguf_models)
    m = dir_models(model, "fp16", "fp16")
    assert np.array_equal(uint32(m.logits(ids)), uint32(gguf_models(model, "fp16").logits(ids)))


@pytest.mark.parametrize("model", ["stories", "smollm"])
def test_generation_and_text_identical(dir_models, gguf_models, model):
    prompt = "" if model == "stories" else SMOLLM_PROMPTS[1]
    a = dir_models(model).generate(prompt, max_tokens=32)
    b = gguf_models(model).generate(prompt, max_tokens=32)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 32
    assert a.text == b.text


def test_tokenizer_identical(dir_models, gguf_models):
    for model in ("stories", "smollm"):
        ours, ref = dir_models(model).tokenizer, gguf_models(model).tokenizer
        assert (ours.bos_id, ours.eos_ids, ours.add_bos, ours.add_eos) == (ref.bos_id, ref.eos_ids, ref.add_bos, ref.add_eos)
        assert ours.chat_template == ref.chat_template
        for s in TOKENIZER_STRINGS:
            assert ours.encode(s) == ref.encode(s), (model, s)
            assert ours.decode(ref.encode(s)) == ref.decode(ref.encode(s)), (model, s)


# -- HF transformers -----------------------------------------------------------------------------------

def test_hf_greedy_stories(hf_models, gguf_models):
    m, tok = hf_models("stories")
    ours = gguf_models("stories").generate("", max_tokens=STORIES_GREEDY_NEW)
    assert len(ours.token_ids) == STORIES_GREEDY_NEW
    assert hf_greedy(m, [tok.bos_token_id], STORIES_GREEDY_NEW) == ours.token_ids
    assert tok.decode(ours.token_ids, skip_special_tokens=True) == ours.text


@pytest.mark.parametrize("k", range(len(SMOLLM_PROMPTS)))
def test_hf_greedy_smollm(hf_models, gguf_models, k):
    m, tok = hf_models("smollm")
    ours = gguf_models("smollm")
    ids = ours.tokenize(SMOLLM_PROMPTS[k])
    assert list(tok(SMOLLM_PROMPTS[k])["input_ids"]) == ids
    g = ours.generate(ids, max_tokens=SMOLLM_GREEDY_NEW)
    assert len(g.token_ids) == SMOLLM_GREEDY_NEW
    assert hf_greedy(m, ids, SMOLLM_GREEDY_NEW) == g.token_ids


@pytest.mark.parametrize("model", ["stories", "smollm"])
def test_hf_tokenizer_encodes_like_tinydet(hf_models, gguf_models, model):
    _, tok = hf_models(model)
    ours = gguf_models(model).tokenizer
    assert tok.bos_token_id == ours.bos_id and tok.eos_token_id == ours.eos_ids[0]
    for s in TOKENIZER_STRINGS:
        assert list(tok(s)["input_ids"]) == ours.encode(s), s


def test_spm_and_bpe_agree_on_stories(converted, gguf_models, stories_greedy_text):
    """stories260K's GGUF vocabulary is SentencePiece: tinydet encodes with llama.cpp's SPM algorithm,
    while tokenizer.json holds a BPE whose merges come from the scores. They agree on everything here
    (random text, vocabulary pieces, runs of one character, the model's own output)."""
    import tokenizers

    hf = tokenizers.Tokenizer.from_file(str(converted("stories") / "tokenizer.json"))
    spm = gguf_models("stories").tokenizer
    pieces = [hf.id_to_token(i).replace("\u2581", " ") for i in range(3, hf.get_vocab_size())]
    pieces = [p for p in pieces if not p.startswith("<0x")]
    chars = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,!?'\"-\n\t0123456789éü中😀"
    rng = random.Random(0)
    texts = stories_greedy_text.splitlines() + [c * n for c in "ae .\n" for n in range(1, 25)]
    for _ in range(3000):
        k = rng.randrange(3)
        if k == 0:
            texts.append("".join(rng.choice(pieces) for _ in range(rng.randrange(1, 12))))
        elif k == 1:
            texts.append("".join(rng.choice(chars) for _ in range(rng.randrange(1, 40))))
        else:
            texts.append("".join(rng.choice(pieces + list(chars)) for _ in range(rng.randrange(1, 20))))
    bad = [t for t in texts if spm.encode(t) != hf.encode(t).ids]
    assert not bad, f"{len(bad)} of {len(texts)} differ, e.g. {bad[:3]!r}"


def test_chat_template_survives(hf_models, gguf_models):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    _, tok = hf_models("smollm")
    ref = gguf_models("smollm").tokenizer
    template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(ref.chat_template)
    bos, eos = ref.hf.id_to_token(ref.bos_id), ref.hf.id_to_token(ref.eos_id)
    conversations = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
         {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}],
    ]
    for msgs in conversations:
        for gen in (True, False):
            ours = template.render(messages=msgs, add_generation_prompt=gen, bos_token=bos, eos_token=eos)
            assert ours.endswith("<|im_start|>assistant\n") is gen
            assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen) == ours


# -- writing safely ------------------------------------------------------------------------------------

def _leftovers(parent, name):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


def test_refuses_to_overwrite(tmp_path, stories_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("an older conversion's")
    with pytest.raises(TinydetError, match="not empty"):
        convert_gguf_to_hf(stories_path, out)
    assert (out / "config.json").read_text() == "an older conversion's"
    assert convert_gguf_to_hf(stories_path, out, overwrite=True) == out
    assert sorted(os.listdir(out)) == sorted(OUTPUT_FILES) and (out / "model.safetensors").is_file()
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert _leftovers(tmp_path, "out") == []
    (tmp_path / "empty").mkdir()
    convert_gguf_to_hf(stories_path, tmp_path / "empty")  # an empty directory is fine
    (tmp_path / "file").write_text("x")
    with pytest.raises(TinydetError, match="not a directory"):
        convert_gguf_to_hf(stories_path, tmp_path / "file", overwrite=True)
    with pytest.raises(TinydetError, match="dtype"):
        convert_gguf_to_hf(stories_path, tmp_path / "bf16", dtype="bf16")


@pytest.mark.parametrize("fail_at", ["safetensors", "tokenizer_config.json", "config.json", "rename"])
@pytest.mark.parametrize("existing", [False, True])
def test_failure_leaves_nothing(tmp_path, stories_path, monkeypatch, fail_at, existing):
    import tinydet.tools.convert as conv

    out = tmp_path / "out"
    if existing:
        out.mkdir()
        (out / "config.json").write_text("mine")

    class Boom(RuntimeError):
        pass

    real_json, real_st, real_move = conv._write_json, conv._write_safetensors, conv._move_into_place

    def write_json(path, data):
        real_json(path, data)
        if path.name == fail_at:
            raise Boom(path.name)

    def write_st(path, tensors, metadata):
        if fail_at == "safetensors":
            path.write_bytes(b"half a file")
            raise Boom("disk full")
        real_st(path, tensors, metadata)

    def move(tmp, dst, overwrite):
        if fail_at == "rename":
            raise Boom("rename")
        real_move(tmp, dst, overwrite)

    monkeypatch.setattr(conv, "_write_json", write_json)
    monkeypatch.setattr(conv, "_write_safetensors", write_st)
    monkeypatch.setattr(conv, "_move_into_place", move)
    with pytest.raises(Boom):
        conv.convert_gguf_to_hf(stories_path, out, overwrite=existing)
    if existing:
        assert sorted(os.listdir(out)) == ["config.json"] and (out / "config.json").read_text() == "mine"
    else:
        assert not out.exists()
    assert _leftovers(tmp_path, "out") == []


@pytest.mark.parametrize("extra", ["keep.txt", ".git", "model.gguf", "sub/config.json"])
def test_overwrite_replaces_only_a_conversion(tmp_path, stories_path, extra):
    """--overwrite never deletes what a conversion did not write: a checkout, the user's files, a GGUF."""
    out = tmp_path / "out"
    (out / extra).parent.mkdir(parents=True, exist_ok=True)
    (out / extra).write_text("mine")
    (out / "config.json").write_text("an older conversion's")
    with pytest.raises(TinydetError, match=r"which a conversion does not write") as e:
        convert_gguf_to_hf(stories_path, out, overwrite=True)
    assert str(out) in str(e.value) and "\n" not in str(e.value)
    assert (out / extra).read_text() == "mine" and (out / "config.json").read_text() == "an older conversion's"
    assert _leftovers(tmp_path, "out") == []


def test_never_the_working_directory_or_the_source(tmp_path, stories_path, monkeypatch):
    """An empty output path, ".", the working directory or a parent of it, or a directory holding the
    source are refused, with or without overwrite (an empty path once replaced a whole checkout)."""
    work = tmp_path / "work" / "here"
    work.mkdir(parents=True)
    (work / "config.json").write_text("mine")
    monkeypatch.chdir(work)
    for target in ["", ".", str(work), "..", str(tmp_path), "../here"]:
        for overwrite in (False, True):
            with pytest.raises(TinydetError, match="empty path|current directory") as e:
                convert_gguf_to_hf(stories_path, target, overwrite=overwrite)
            assert "\n" not in str(e.value)
    assert (work / "config.json").read_text() == "mine" and sorted(os.listdir(work)) == ["config.json"]
    src_dir = tmp_path / "models"
    src_dir.mkdir()
    src = src_dir / "model.safetensors"  # a GGUF under a name a conversion writes
    src.write_bytes(Path(stories_path).read_bytes())
    with pytest.raises(TinydetError, match="holds the source"):
        convert_gguf_to_hf(src, src_dir, overwrite=True)
    assert src.read_bytes() == Path(stories_path).read_bytes()


def test_cli_convert_into_an_empty_path_is_refused(tmp_path, stories_path, monkeypatch):
    from click.testing import CliRunner

    from tinydet.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "keep.txt").write_text("mine")
    r = CliRunner().invoke(main, ["convert", str(stories_path), "", "--overwrite"])
    assert r.exit_code != 0 and "empty path" in r.output and "Traceback" not in r.output
    assert sorted(os.listdir(tmp_path)) == ["keep.txt"]
