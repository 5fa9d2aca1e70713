"""Gemma 3 (text) on a tiny checkpoint made here (tests/gemma3gen.py): the same random weights as a
Hugging Face directory written by transformers' Gemma3ForCausalLM and as a GGUF with llama.cpp's gemma3
keys and names (norms stored as 1 + w). Six layers, five of them sliding over 8 positions, prompts
longer than that. Against transformers fp32 (eager attention): logits within 1e-4, the same 32 greedy
tokens; the HF directory (w, read as float32(1 + w)) and the GGUF give the same bits; threads, chunks
across the window's edge, batches and native storage keep them; conversion back to a Gemma3ForCausalLM
directory; config.json's forms and settings; bad files refused with the file and field named."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import gemma3gen as G
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

# files: (hf_dir, {quant: gguf}); models: {"hf", "gguf"}; ref: transformers' Gemma3ForCausalLM, eager
arch, files, models, ref = fixtures(lambda arch, tied: G.spec())


def test_prompts_are_longer_than_the_window(models):
    assert G.LAYER_TYPES == ("sliding_attention",) * 5 + ("full_attention",)
    for text in TEXTS:
        assert len(models["gguf"].tokenize(text)) > 2 * G.SLIDING_WINDOW, text


def test_logits_match_transformers_and_gguf_equals_hf_dir(models, ref, record_property):
    from_dir, from_gguf = models["hf"], models["gguf"]
    assert float32_eps(from_dir.config) == from_gguf.config
    cfg = from_gguf.config
    assert (cfg.arch, cfg.head_dim, cfg.layer_windows) == ("gemma3", G.HEAD_DIM, (G.SLIDING_WINDOW,) * 5 + (0,))
    assert [r.base for r in cfg.layer_ropes] == [G.ROPE_LOCAL_BASE] * 5 + [G.ROPE_THETA]
    assert cfg.attn_scale == float(np.float32(G.QUERY_PRE_ATTN_SCALAR ** -0.5)) and cfg.embed_scale == 8.0
    assert all(from_gguf.tokenize(text)[0] == G.BOS_ID for text in TEXTS)
    raw = G.hf_tokenizer()
    check_logits(from_dir, from_gguf, ref, TEXTS, "gemma3", record_property, encode=lambda t: raw.encode(t).ids)


def test_hf_norms_are_read_as_float32_one_plus_w(files):
    """The HF directory stores w; its checkpoint holds float32(1 + w) for every Gemma norm, bit for bit
    the GGUF's (which stores 1 + w), and no other tensor moves."""
    from tinydet.formats import open_checkpoint

    hf, ggufs = files
    a, b = open_checkpoint(hf), open_checkpoint(ggufs[None])
    sd = G.state_dict()
    spec = a.arch
    n_norms = 0
    for canon, t, idx in spec.tensors_for(a.config):
        if canon == "output":
            continue
        w = sd[t.hf.format(*idx)]
        got = a.tensors[canon].float32()
        assert np.array_equal(bits(got), bits(b.tensors[canon].float32())), canon
        if G.is_norm(t.hf):
            n_norms += 1
            assert t.hf_offset == 1.0 and np.array_equal(bits(got), bits(np.float32(1.0) + w)), canon
        else:
            assert t.hf_offset == 0.0 and np.array_equal(bits(got), bits(w)), canon
    assert n_norms == 1 + 6 * G.LAYERS
    assert a.tensors["output"] is a.tensors["tok_embeddings"] and b.tensors["output"] is b.tensors["tok_embeddings"]


def test_window_and_norm_offset_matter(files):
    """The prompts reach past the window (full attention would change the logits), and a reader that
    took HF's w as the scale (no 1 + w) would be far off."""
    from tinydet.formats import Tensor, open_checkpoint

    ck = open_checkpoint(files[0])
    ids = ck.tokenizer.encode(TEXTS[0])
    base = backend_logits(ck.config, ck.tensors, ids)
    full = backend_logits(dataclasses.replace(ck.config, layer_windows=(0,) * G.LAYERS), ck.tensors, ids)
    assert np.abs(base - full).max() > 1e-2
    assert np.array_equal(bits(base[:G.SLIDING_WINDOW]), bits(full[:G.SLIDING_WINDOW]))  # same until the edge
    raw = {k: (Tensor.of(np.asarray(v) - np.float32(1.0)) if k.endswith("norm") else v) for k, v in ck.tensors.items()}
    raw["output"] = raw["tok_embeddings"]
    assert np.abs(base - backend_logits(ck.config, raw, ids)).max() > 0.5


def test_greedy_32_tokens_match_transformers(models, ref):
    check_greedy(models, ref, (("gguf", TEXTS[0]), ("gguf", TEXTS[1]), ("gguf", TEXTS[3]), ("hf", TEXTS[2])))


def test_threads_chunking_and_batch(files):
    """Chunks of 8 and 9 tokens too: cache rows crossing the 8-position window's edge at every offset."""
    model = tinydet.load(files[1][None], dtype="fp32")
    check_threads_chunking_and_batch(model, model.tokenize(TEXTS[2]), TEXTS, extra=((1, 8), (2, 9)))


@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
def test_native_storage_gives_fp32_bits(files, quant):
    """The tied output in native storage is the embedding's blocks."""
    check_native_gives_fp32_bits(files[1][quant], quant, TEXTS[:3], kinds=("wqkv", "output"))


def test_q8_0_matches_transformers_with_its_weights(files):
    """The Q8_0 file runs the Gemma3ForCausalLM that holds its dequantized weights (within 1e-4)."""
    check_matches_reference(files[1]["q8_0"], G.hf_model(weights=G.dequantized_state_dict("q8_0")), TEXTS[:1])


def test_convert_back_to_hf_directory(files, tmp_path, ref):
    """GGUF -> HF directory: norms written as w = float32(s - 1); transformers loads it as
    Gemma3ForCausalLM with transformers' own logits of the original, and tinydet gives the GGUF's bits
    from it. Exact here because every stored norm value s of the tiny model lies in [0.5, 2**24], where
    float32(1 + float32(s - 1)) == s (test_norm_offset_round_trip_range)."""
    from safetensors.numpy import load_file

    from tinydet.formats import open_checkpoint
    from tinydet.tools.convert import convert_gguf_to_hf

    src = files[1][None]
    stored = {k: t.float32() for k, t in open_checkpoint(src).tensors.items() if k.endswith("norm")}
    assert len(stored) == 1 + 6 * G.LAYERS
    assert all(0.5 <= v.min() and v.max() <= 2.0 ** 24 for v in stored.values())
    out = convert_gguf_to_hf(src, tmp_path / "conv")
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["architectures"], cfg["model_type"], cfg["tie_word_embeddings"]) == (
        ["Gemma3ForCausalLM"], "gemma3_text", True)
    assert (cfg["head_dim"], cfg["query_pre_attn_scalar"], cfg["sliding_window"], cfg["layer_types"]) == (
        G.HEAD_DIM, G.QUERY_PRE_ATTN_SCALAR, G.SLIDING_WINDOW, list(G.LAYER_TYPES))
    assert (cfg["rope_theta"], cfg["rope_local_base_freq"], cfg["rope_scaling"]) == (
        G.ROPE_THETA, G.ROPE_LOCAL_BASE, None)
    st = load_file(out / "model.safetensors")
    assert "lm_head.weight" not in st
    spec = open_checkpoint(src).arch
    for canon, t, idx in spec.tensors_for(open_checkpoint(src).config):
        if canon in stored:
            w = st[t.hf.format(*idx)]
            assert np.array_equal(bits(w), bits(stored[canon] - np.float32(1.0))), canon
            assert np.array_equal(bits(np.float32(1.0) + w), bits(stored[canon])), canon
    check_converted(src, out, ref, "Gemma3ForCausalLM", TEXTS[3:])  # the same scales, through transformers
    ids = tinydet.load(src).tokenize(TEXTS[3])
    # The quantized file too (its matrices dequantized exactly into float32).
    q = convert_gguf_to_hf(files[1]["q8_0"], tmp_path / "conv-q8")
    assert np.array_equal(bits(tinydet.load(q).logits(ids)), bits(tinydet.load(files[1]["q8_0"]).logits(ids)))


def test_norm_offset_round_trip_range():
    """What convert relies on: for every float32 s in [0.5, 2) (all of them) and a sample up to 2**24,
    HF's w = float32(s - 1) read back through Tensor.plus(1.0) is s again; below 0.5 it need not be."""
    from tinydet.formats import Tensor

    def back(s):
        return Tensor.of(s - np.float32(1.0)).plus(1.0).float32()

    for lo in (0.5, 1.0):  # [0.5, 1) and [1, 2): 2**23 values each
        s = (np.arange(2 ** 23, dtype=np.uint32) + np.float32(lo).view(np.uint32)).view(np.float32)
        assert np.array_equal(bits(back(s)), bits(s)), lo
    rs = np.random.RandomState(0)
    s = (rs.randint(np.float32(2.0).view(np.uint32), np.float32(2.0 ** 24).view(np.uint32) + 1, 1 << 20)
         .astype(np.uint32).view(np.float32))
    assert np.array_equal(bits(back(s)), bits(s))
    low = np.array([2.0 ** -30, 0.1, 2.0 ** 24 + 2], np.float32)
    assert not np.any(bits(back(low)) == bits(low))  # s - 1 rounds: each comes back changed


# --- config.json's forms and settings -----------------------------------------------------------------

def test_config_forms_read_alike(files, tmp_path):
    """transformers 5's form (rope_parameters by layer type, as save_pretrained writes it), a config from
    before layer_types (sliding_window_pattern) and one without tie_word_embeddings (Gemma ties by
    default) all read to the config of the hub form."""
    from tinydet.formats.hf_dir import read_hf_config

    hf = files[0]
    _, base, tie, _ = read_hf_config(hf)
    assert tie is True and "tie_word_embeddings" not in json.loads((hf / "config.json").read_text())
    v5 = edited(hf, tmp_path / "v5", rope_theta=DROP, rope_local_base_freq=DROP, rope_scaling=DROP,
                tie_word_embeddings=True, rope_parameters={
                    "full_attention": {"rope_theta": G.ROPE_THETA, "rope_type": "default"},
                    "sliding_attention": {"rope_theta": G.ROPE_LOCAL_BASE, "rope_type": "default"}})
    old = edited(hf, tmp_path / "old", layer_types=DROP, sliding_window_pattern=6)
    defaults = edited(hf, tmp_path / "defaults", rope_theta=DROP, rope_local_base_freq=DROP,
                      query_pre_attn_scalar=DROP)
    for d in (v5, old):
        _, cfg, t, _ = read_hf_config(d)
        assert (cfg, t) == (base, True), d.name
    # Gemma3TextConfig's defaults: global base 1e6 (not 10000), local 10000, query_pre_attn_scalar 256.
    _, cfg, _, _ = read_hf_config(defaults)
    assert cfg == dataclasses.replace(base, attn_scale=0.0625)
    ref = transformers.AutoConfig.from_pretrained(defaults)
    assert ref.query_pre_attn_scalar == 256 and ref.rope_parameters["full_attention"]["rope_theta"] == G.ROPE_THETA
    # The transformers 5 directory runs the same bits.
    ids = tinydet.load(hf).tokenize(TEXTS[1])
    assert np.array_equal(bits(tinydet.load(v5).logits(ids)), bits(tinydet.load(hf).logits(ids)))


@pytest.mark.parametrize("setting", ["linear_rope", "softcap"])
def test_settings_from_both_formats(files, tmp_path, setting, ref):
    """A linearly scaled global RoPE (config.json rope_scaling / GGUF rope.scaling.*) and final logit
    soft-capping (final_logit_softcapping): GGUF and HF directory give the same bits, within 1e-4 of
    transformers reading that directory, and not those of the plain model."""
    hf, ggufs = files
    if setting == "linear_rope":
        d = edited(hf, tmp_path / "hf", rope_scaling={"rope_type": "linear", "factor": 8.0})
        over = {"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0}
    else:
        d = edited(hf, tmp_path / "hf", final_logit_softcapping=2.0)
        over = {"gemma3.final_logit_softcapping": 2.0}
    g = G.write_gguf(tmp_path / "x.gguf", overrides=over)
    a, b = tinydet.load(d), tinydet.load(g)
    assert dataclasses.replace(a.config, rms_eps=float(np.float32(a.config.rms_eps))) == b.config
    if setting == "linear_rope":
        assert b.config.rope.scaling == "linear" and b.config.rope.factor == 8.0
        assert [r.scaling for r in b.config.layer_ropes] == ["none"] * 5 + ["linear"]  # global layers only
    else:
        assert b.config.logit_softcap == 2.0
    m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    for text in (TEXTS[0], TEXTS[3]):
        ids = b.tokenize(text)
        ours = b.logits(ids)
        assert np.array_equal(bits(ours), bits(a.logits(ids)))
        assert float(np.abs(ours - hf_logits(m, ids)).max()) <= 1e-4
        assert float(np.abs(ours - hf_logits(ref, ids)).max()) > 1e-3


# --- bad input ------------------------------------------------------------------------------------------

def test_bad_gguf_files_are_refused(tmp_path):
    p = G.write_gguf(tmp_path / "no-norm.gguf", drop=("blk.0.post_ffw_norm.weight",))
    assert "missing" in refused(p, "blk.0.post_ffw_norm.weight")
    p = G.write_gguf(tmp_path / "yarn.gguf", overrides={"gemma3.rope.scaling.type": "yarn",
                                                         "gemma3.rope.scaling.factor": 4.0})
    assert "yarn" in refused(p, "gemma3.rope.scaling.type")
    p = G.write_gguf(tmp_path / "window.gguf", overrides={"gemma3.attention.sliding_window": 2 * G.CONTEXT})
    assert str(2 * G.CONTEXT) in refused(p, "gemma3.attention.sliding_window")


@pytest.mark.parametrize("field,value,expect", [
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}, "yarn"),
    ("rope_parameters.full_attention",
     {"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, "yarn"),
    ("rope_parameters.sliding_attention",
     {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
      "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "sliding"),
    ("sliding_window", 2 * G.CONTEXT, str(2 * G.CONTEXT)),
    ("attn_logit_softcapping", 50.0, "soft-capping"),
    ("hidden_activation", "gelu", "gelu"),
    ("use_bidirectional_attention", True, "bidirectional"),
    ("layer_types", ["sliding_attention"] * 5, "6 entries"),
])
def test_bad_config_json_is_refused(files, tmp_path, field, value, expect):
    key = "rope_parameters" if field.startswith("rope_parameters.") else field
    drop = {"rope_theta": DROP, "rope_local_base_freq": DROP} if key == "rope_parameters" else {}
    d = edited(files[0], tmp_path / "d", **{key: value}, **drop)
    assert expect in refused(d, field)


def test_untied_config_without_lm_head_is_refused(files, tmp_path):
    d = edited(files[0], tmp_path / "d", tie_word_embeddings=False)
    assert "tie_word_embeddings" in refused(d, "lm_head.weight")
