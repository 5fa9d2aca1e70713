"""SmolLM3 on a tiny checkpoint made here (tests/smollm3gen.py): the same random weights as a Hugging
Face directory written by transformers' SmolLM3ForCausalLM and as a GGUF with llama.cpp's smollm3 keys
(Q/K rows permuted, tied output). Eight layers, 3 and 7 NoPE. Against transformers fp32 (eager
attention): logits within 1e-4, the same 32 greedy tokens; the HF directory and the GGUF give the same
bits; NoPE layers rotate nothing (q and the cached k are the projections, bit for bit) and matter;
other NoPE patterns and sliding layers from config.json; threads, chunks, batches and native Q8_0
storage keep the bits; conversion back to a SmolLM3ForCausalLM directory; bad files refused with the
file and field named; the GPU backend refuses NoPE layers."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import bpetok
import smollm3gen as S
import tinydet
from archrunner import (DROP, backend_logits, check_converted, check_greedy, check_logits, check_matches_reference,
                        edited, fixtures, float32_eps, refused)
from contract import bits, check_native_gives_fp32_bits, check_threads_chunking_and_batch
from reference import hf_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

TEXTS = ["The quick brown fox jumps over the lazy dog. It's a sentence that uses every letter.",
         "In 1969, Apollo 11 landed on the Moon. The crew (three men) flew 384,400 km each way.",
         "I'm sure you'll agree: we're here, they're there, and she's gone. Isn't that odd? Don't worry!",
         "def hello(name):\n    return \"Hello, \" + name + \"!\"  # a little code, with symbols: ==, !="]

# files: (hf_dir, {None, "q8_0": gguf}); models: {"hf", "gguf"}; ref: transformers' SmolLM3ForCausalLM, eager
arch, files, models, ref = fixtures(lambda arch, tied: S.spec(), quants=("q8_0",))


def test_logits_match_transformers_and_gguf_equals_hf_dir(models, ref, record_property):
    from_dir, from_gguf = models["hf"], models["gguf"]
    assert float32_eps(from_dir.config) == from_gguf.config
    cfg = from_gguf.config
    assert (cfg.arch, cfg.rope.base, cfg.layer_windows) == ("smollm3", S.ROPE_THETA, ())
    assert cfg.layer_nope == (False, False, False, True) * 2
    raw = bpetok.hf_tokenizer(S.TOKENIZER)
    check_logits(from_dir, from_gguf, ref, TEXTS, "smollm3", record_property, encode=lambda t: raw.encode(t).ids)


def test_nope_layers_rotate_nothing_and_matter(files, ref):
    """At a NoPE layer the pass's q after RoPE and the cached k are the projections' bits; every other
    layer rotates. All-RoPE (layer_nope off) gives other logits, those of transformers with
    no_rope_layers all 1."""
    from tinydet.formats import open_checkpoint

    ck = open_checkpoint(files[1][None])
    ids = ck.tokenizer.encode(TEXTS[0])
    seen = {}

    def hook(layer, op, pos, slots, rows):
        if op in ("q", "k", "rope_q", "rope_k"):
            seen[layer, op] = np.array(rows)

    base = backend_logits(ck.config, ck.tensors, ids, hook)
    for layer in range(S.LAYERS):
        same = [np.array_equal(bits(seen[layer, a]), bits(seen[layer, b]))
                for a, b in (("q", "rope_q"), ("k", "rope_k"))]
        assert same == [ck.config.nope(layer)] * 2, layer
    all_rope = backend_logits(dataclasses.replace(ck.config, layer_nope=()), ck.tensors, ids)
    assert np.abs(base - all_rope).max() > 1e-2
    want = hf_logits(S.hf_model(no_rope_layers=[1] * S.LAYERS), ids)
    assert float(np.abs(all_rope - want).max()) <= 1e-4
    assert float(np.abs(base - hf_logits(ref, ids)).max()) <= 1e-4


def test_greedy_32_tokens_match_transformers(models, ref):
    check_greedy(models, ref, (("gguf", TEXTS[0]), ("gguf", TEXTS[1]), ("hf", TEXTS[2])))


def test_threads_chunking_and_batch(files):
    model = tinydet.load(files[1][None], dtype="fp32")
    check_threads_chunking_and_batch(model, model.tokenize(TEXTS[1]), TEXTS)


def test_native_q8_0_gives_fp32_bits_and_matches_transformers(files):
    check_native_gives_fp32_bits(files[1]["q8_0"], "q8_0", TEXTS[:2], kinds=("wqkv", "output"))
    check_matches_reference(files[1]["q8_0"], S.hf_model(weights=S.dequantized_state_dict("q8_0")), TEXTS[:1])


YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16}  # SmolLM3's long-context setting


@pytest.mark.parametrize("case", ["pattern", "interval", "sliding", "defaults", "yarn"])
def test_config_json_settings_match_transformers(files, models, tmp_path, case):
    """Another NoPE pattern (no_rope_layers), the interval alone, sliding layers (SmolLM3Config's rule:
    the NoPE layers slide), SmolLM3Config's defaults (rope_theta 2e6, interval 4) and a YaRN scaling
    (SmolLM3's 128k setting, its rotating layers only), each read as transformers reads it: logits
    within 1e-4 of its model of that config.json."""
    pattern = [0, 1, 1, 1, 1, 0, 1, 1]
    changes = {"pattern": {"no_rope_layers": pattern},
               "interval": {"no_rope_layers": DROP, "no_rope_layer_interval": 3, "layer_types": DROP},
               "sliding": {"use_sliding_window": True, "sliding_window": 8, "layer_types": DROP},
               "defaults": {"no_rope_layers": DROP, "no_rope_layer_interval": DROP, "rope_theta": DROP,
                            "layer_types": DROP},
               "yarn": {"rope_scaling": YARN}}[case]
    d = edited(files[0], tmp_path / "d", **changes)
    model = tinydet.load(d)
    cfg = model.config
    want_nope = {"pattern": tuple(not x for x in pattern), "interval": (False, False, True) * 2 + (False, False)}
    assert cfg.layer_nope == want_nope.get(case, (False, False, False, True) * 2)
    assert cfg.layer_windows == ((0, 0, 0, 8) * 2 if case == "sliding" else ())
    assert cfg.rope.base == (2e6 if case == "defaults" else S.ROPE_THETA)
    assert cfg.rope.scaling == ("yarn" if case == "yarn" else "none")
    ref = S.hf_model(**{k: (None if v is DROP else v) for k, v in changes.items()})
    assert ref.config.no_rope_layers == [int(not x) for x in cfg.layer_nope]
    ids = model.tokenize(TEXTS[3])
    assert len(ids) > 2 * 8
    ours = model.logits(ids)
    assert float(np.abs(ours - hf_logits(ref, ids)).max()) <= 1e-4
    assert float(np.abs(ours - models["hf"].logits(ids)).max()) > 1e-3


def test_convert_back_to_hf_directory(files, tmp_path, ref):
    """GGUF -> HF directory: no_rope_layers written out; transformers loads it as SmolLM3ForCausalLM with
    the original's logits bit for bit (the same weights: Q/K rows moved back exactly), and tinydet gives
    the GGUF's bits from it."""
    from tinydet.tools.convert import convert_gguf_to_hf

    src = files[1][None]
    out = convert_gguf_to_hf(src, tmp_path / "conv")
    c = json.loads((out / "config.json").read_text())
    assert (c["architectures"], c["model_type"], c["tie_word_embeddings"]) == (["SmolLM3ForCausalLM"], "smollm3", True)
    assert (c["no_rope_layers"], c["no_rope_layer_interval"], c["use_sliding_window"]) == (S.NO_ROPE_LAYERS, 4, False)
    check_converted(src, out, ref, "SmolLM3ForCausalLM", TEXTS[2:3])


# --- bad input ------------------------------------------------------------------------------------------

def test_transformers_own_config_json_reads_alike(files, tmp_path, ref):
    """config.json as transformers 5 saves it (rope_parameters, its own key set) reads to the same config."""
    from tinydet.formats.hf_dir import read_hf_config

    d = edited(files[0], tmp_path / "v5")
    (d / "config.json").unlink()
    ref.config.save_pretrained(d)
    assert "rope_parameters" in json.loads((d / "config.json").read_text())
    assert read_hf_config(d)[1] == read_hf_config(files[0])[1]


@pytest.mark.parametrize("field,value,expect", [
    ("no_rope_layers", [1, 1, 1, 0], "at least 8 entries"),
    ("no_rope_layers", [1, 1, 1, 2, 1, 1, 1, 0], "0 (no RoPE) or 1"),
    ("no_rope_layer_interval", 0, "positive"),
    ("use_sliding_window", "yes", "true or false"),
])
def test_bad_config_json_is_refused(files, tmp_path, field, value, expect):
    changes = {field: value}
    if field == "no_rope_layer_interval":
        changes["no_rope_layers"] = DROP
    assert expect in refused(edited(files[0], tmp_path / "d", **changes), field)


def test_sliding_layers_need_use_sliding_window_and_a_window(files, tmp_path):
    types = ["full_attention"] * 3 + ["sliding_attention"] + ["full_attention"] * 4
    d = edited(files[0], tmp_path / "a", layer_types=types)
    assert "disagree" in refused(d, "use_sliding_window")
    d = edited(files[0], tmp_path / "b", layer_types=types, use_sliding_window=True)
    assert "missing" in refused(d, "sliding_window")


def test_bad_gguf_is_refused(tmp_path):
    p = S.write_gguf(tmp_path / "swa.gguf", overrides={"smollm3.attention.sliding_window": 8})
    assert "sliding-window" in refused(p, "smollm3.attention.sliding_window")


def test_gpu_backend_refuses_nope_layers(models):
    from tinydet.backends.cupy import CudaBackend

    with pytest.raises(tinydet.TinydetError, match="NoPE"):
        CudaBackend(models["gguf"].config, {}, device=object())
