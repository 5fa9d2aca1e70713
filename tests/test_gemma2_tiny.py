"""Gemma 2 on a tiny checkpoint made here (tests/gemma2gen.py): the same random weights as a Hugging Face
directory written by transformers' Gemma2ForCausalLM and as a GGUF with llama.cpp's gemma2 keys and
names (norms stored as 1 + w). Four layers, the even ones sliding over 8 positions, prompts longer than
that; attention and final logit soft-capping at Gemma 2's 50 and 30, and at caps small enough to bind.
Against transformers fp32 (eager attention): logits within 1e-4, the same 32 greedy tokens; the HF
directory and the GGUF give the same bits; threads, chunks across the window's edge, batches and native
storage keep them; conversion back to a Gemma2ForCausalLM directory; config.json's defaults; bad files
refused with the file and field named; the GPU backend refuses attention soft-capping."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import gemma2gen as G
import gemmatok
import tinydet
from archrunner import (DROP, backend_logits, check_converted, check_greedy, check_logits, check_matches_reference,
                        edited, fixtures, float32_eps, refused)
from contract import bits, check_native_gives_fp32_bits, check_threads_chunking_and_batch
from reference import hf_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

TEXTS = ["The quick brown fox jumps over the lazy dog, and the dog does not mind: it is a lazy dog.",
         "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n",
         "In 1969, three astronauts flew to the Moon and back; café 😀 naïve: tabs\tand  double  spaces.",
         "Once upon a time there was a little robot who wanted to learn how to paint.\n\nEvery morning it"]

# files: (hf_dir, {None, "q8_0": gguf}); models: {"hf", "gguf"}; ref: transformers' Gemma2ForCausalLM, eager
arch, files, models, ref = fixtures(lambda arch, tied: G.spec(), quants=("q8_0",))


def test_logits_match_transformers_and_gguf_equals_hf_dir(models, ref, record_property):
    from_dir, from_gguf = models["hf"], models["gguf"]
    assert float32_eps(from_dir.config) == from_gguf.config
    cfg = from_gguf.config
    assert (cfg.arch, cfg.head_dim, cfg.layer_windows, cfg.layer_ropes) == ("gemma2", G.HEAD_DIM, (8, 0, 8, 0), ())
    assert (cfg.attn_softcap, cfg.logit_softcap, cfg.embed_scale, cfg.qk_norm) == (50.0, 30.0, 8.0, False)
    assert cfg.attn_scale == float(np.float32(G.QUERY_PRE_ATTN_SCALAR ** -0.5))
    assert all(len(from_gguf.tokenize(text)) > 2 * G.SLIDING_WINDOW for text in TEXTS)
    raw = gemmatok.hf_tokenizer()
    check_logits(from_dir, from_gguf, ref, TEXTS, "gemma2", record_property, encode=lambda t: raw.encode(t).ids)


def test_soft_caps_that_bind_from_both_formats(files, models, tmp_path, record_property):
    """Caps small enough to bind (attention 1.0, final 2.0): GGUF and HF directory give the same bits,
    within 1e-4 of transformers reading that directory, and far from those of the caps at 50 / 30 and
    of the same model without the attention cap."""
    from tinydet.formats import open_checkpoint

    hf, ggufs = files
    caps = {"attn_logit_softcapping": 1.0, "final_logit_softcapping": 2.0}
    d = edited(hf, tmp_path / "hf", **caps)
    g = G.write_gguf(tmp_path / "caps.gguf", overrides={f"gemma2.{k}": v for k, v in caps.items()})
    a, b = tinydet.load(d), tinydet.load(g)
    assert (b.config.attn_softcap, b.config.logit_softcap) == (1.0, 2.0)
    assert float32_eps(a.config) == b.config
    m = G.hf_model(**caps)
    plain = models["gguf"]
    ck = open_checkpoint(g)
    worst = 0.0
    for text in (TEXTS[0], TEXTS[3]):
        ids = b.tokenize(text)
        ours = b.logits(ids)
        assert np.array_equal(bits(ours), bits(a.logits(ids)))
        worst = max(worst, float(np.abs(ours - hf_logits(m, ids)).max()))
        assert float(np.abs(ours - plain.logits(ids)).max()) > 1e-2
        uncapped = backend_logits(dataclasses.replace(ck.config, attn_softcap=None), ck.tensors, ids)
        assert float(np.abs(ours - uncapped).max()) > 1e-2
    record_property("gemma2_binding_caps_max_abs_diff_vs_transformers", worst)
    print(f"tiny gemma2, caps 1 / 2: max |tinydet - transformers| = {worst:.2e}")
    assert worst <= 1e-4


def test_window_matters(files):
    from tinydet.formats import open_checkpoint

    ck = open_checkpoint(files[0])
    ids = ck.tokenizer.encode(TEXTS[0])
    base = backend_logits(ck.config, ck.tensors, ids)
    full = backend_logits(dataclasses.replace(ck.config, layer_windows=()), ck.tensors, ids)
    assert np.abs(base - full).max() > 1e-2
    assert np.array_equal(bits(base[:G.SLIDING_WINDOW]), bits(full[:G.SLIDING_WINDOW]))  # same until the edge


def test_greedy_32_tokens_match_transformers(models, ref):
    check_greedy(models, ref, (("gguf", TEXTS[0]), ("gguf", TEXTS[1]), ("hf", TEXTS[2])))


def test_threads_chunking_and_batch(files, tmp_path):
    """With caps that bind (so the capped scores are what is compared); chunks of 8 and 9 tokens cross the
    8-position window's edge at every offset."""
    g = G.write_gguf(tmp_path / "caps.gguf", overrides={"gemma2.attn_logit_softcapping": 1.0})
    model = tinydet.load(g, dtype="fp32")
    check_threads_chunking_and_batch(model, model.tokenize(TEXTS[2]), TEXTS, extra=((1, 8), (2, 9)))


def test_native_q8_0_gives_fp32_bits_and_matches_transformers(files):
    check_native_gives_fp32_bits(files[1]["q8_0"], "q8_0", TEXTS[:2], kinds=("wqkv", "output"))
    check_matches_reference(files[1]["q8_0"], G.hf_model(weights=G.dequantized_state_dict("q8_0")), TEXTS[:1])


def test_convert_back_to_hf_directory(files, tmp_path, ref):
    """GGUF -> HF directory (norms as w = float32(s - 1), exact for the tiny model's values): transformers
    loads it as Gemma2ForCausalLM with the original's logits bit for bit, and tinydet gives the GGUF's bits."""
    from tinydet.tools.convert import convert_gguf_to_hf

    src = files[1][None]
    out = convert_gguf_to_hf(src, tmp_path / "conv")
    c = json.loads((out / "config.json").read_text())
    assert (c["architectures"], c["model_type"], c["tie_word_embeddings"]) == (["Gemma2ForCausalLM"], "gemma2", True)
    assert (c["attn_logit_softcapping"], c["final_logit_softcapping"], c["query_pre_attn_scalar"],
            c["sliding_window"], c["layer_types"]) == (50.0, 30.0, G.QUERY_PRE_ATTN_SCALAR, G.SLIDING_WINDOW,
                                                      ["sliding_attention", "full_attention"] * 2)
    check_converted(src, out, ref, "Gemma2ForCausalLM", TEXTS[3:])


# --- config.json's defaults and bad input ---------------------------------------------------------------

def test_config_defaults_are_gemma2configs(files, tmp_path):
    """Absent keys take Gemma2Config's values (caps 50 and 30, query_pre_attn_scalar 256, the even
    layers sliding over 4096), null caps mean none; transformers reads each the same way."""
    from tinydet.formats.hf_dir import read_hf_config

    _, base, _, _ = read_hf_config(files[0])
    absent = edited(files[0], tmp_path / "absent", attn_logit_softcapping=DROP, final_logit_softcapping=DROP,
                    query_pre_attn_scalar=DROP, sliding_window=DROP)
    _, cfg, _, _ = read_hf_config(absent)
    assert cfg == dataclasses.replace(base, attn_scale=0.0625, layer_windows=(4096, 0, 4096, 0))
    ref = transformers.AutoConfig.from_pretrained(absent)
    assert (ref.attn_logit_softcapping, ref.final_logit_softcapping, ref.query_pre_attn_scalar, ref.sliding_window,
            ref.layer_types) == (50.0, 30.0, 256, 4096, ["sliding_attention", "full_attention"] * 2)
    null = edited(files[0], tmp_path / "null", attn_logit_softcapping=None, final_logit_softcapping=None)
    _, cfg, _, _ = read_hf_config(null)
    assert (cfg.attn_softcap, cfg.logit_softcap) == (None, None)


def test_transformers_own_config_json_reads_alike(files, tmp_path, ref):
    """config.json as transformers 5 saves it (rope_parameters, its own key set) reads to the same config."""
    from tinydet.formats.hf_dir import read_hf_config

    d = edited(files[0], tmp_path / "v5")
    (d / "config.json").unlink()
    ref.config.save_pretrained(d)
    assert "rope_parameters" in json.loads((d / "config.json").read_text())
    assert read_hf_config(d)[1] == read_hf_config(files[0])[1]


@pytest.mark.parametrize("field,value,expect", [
    ("attn_logit_softcapping", 0.0, "positive"),
    ("final_logit_softcapping", -30.0, "positive"),
    ("attn_logit_softcapping", "50", "number"),
    ("sliding_window", None, "null"),
    ("hidden_activation", "gelu", "gelu"),
    ("use_bidirectional_attention", True, "bidirectional"),
    ("layer_types", ["sliding_attention"] * 3, "4 entries"),
    ("rope_scaling", {"rope_type": "linear", "factor": 2.0}, "linear"),
])
def test_bad_config_json_is_refused(files, tmp_path, field, value, expect):
    assert expect in refused(edited(files[0], tmp_path / "d", **{field: value}), field)


@pytest.mark.parametrize("key,value,expect", [
    ("gemma2.attn_logit_softcapping", 0.0, "positive"),
    ("gemma2.final_logit_softcapping", float("inf"), "positive"),
    ("gemma2.attention.sliding_window", 0, "positive"),
])
def test_bad_gguf_is_refused(tmp_path, key, value, expect):
    assert expect in refused(G.write_gguf(tmp_path / "x.gguf", overrides={key: value}), key)


def test_missing_tensor_is_refused(tmp_path):
    p = G.write_gguf(tmp_path / "x.gguf", drop=("blk.1.post_ffw_norm.weight",))
    assert "missing" in refused(p, "blk.1.post_ffw_norm.weight")


def test_gpu_backend_refuses_attention_soft_capping(models):
    from tinydet.backends.cupy import CudaBackend

    with pytest.raises(tinydet.TinydetError, match="soft-capping"):
        CudaBackend(models["gguf"].config, {}, device=object())
