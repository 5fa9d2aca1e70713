"""Qwen2 (q/k/v biases), Qwen3 (QK-norm, a head_dim of its own) and Llama 3 (its RoPE scaling, the
llama-bpe tokenizer) on tiny checkpoints made here (tests/qwen2gen.py): the same random weights as a
Hugging Face directory written by transformers and as a GGUF with llama.cpp's qwen2 / qwen3 / llama
names and keys (for Llama 3: Q/K rows permuted and rope_freqs.weight, as its converter writes them).
Against transformers fp32: logits within 1e-4, the same 32 greedy tokens; GGUF and HF directory give
the same bits; the whole contract (threads, chunking, batch, native storage, trace, verify, golden
hashes) and conversion back to a Qwen2ForCausalLM / Qwen3ForCausalLM / LlamaForCausalLM directory."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import qwen2gen as Q
import tinydet
from archrunner import (backend_logits, check_converted, check_golden_pinned, check_greedy, check_logits, edited,
                        fixtures, float32_eps)
from contract import (bits, check_native_gives_fp32_bits, check_threads_chunking_and_batch, check_trace_diff,
                      check_verify_matrix)
from reference import hf_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog.", "12345 and 3.14159, 2024-03-15",
         "<|im_start|>user\nHi there, how are you?<|im_end|>\n<|im_start|>assistant\n",
         "I'm sure you'll agree: we're here.\n\n\tdef hello(name):\n    return name"]


# files: {tied: (hf_dir, {quant: gguf})}; models: {"hf", "gguf"} (untied); ref: {tied: transformers' model}
arch, files, models, ref = fixtures(lambda arch, tied: Q.spec(tied, arch), ["qwen2", "qwen3", "llama3"], tied=True)


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers_and_gguf_equals_hf_dir(files, ref, arch, tied, record_property):
    hf_dir, ggufs = files[tied]
    from_dir, from_gguf = tinydet.load(hf_dir), tinydet.load(ggufs[None])
    assert float32_eps(from_dir.config) == from_gguf.config
    assert from_gguf.config.arch == Q.GGUF_ARCH[arch]
    assert (from_gguf.config.qkv_bias, from_gguf.config.qk_norm) == (arch == "qwen2", arch == "qwen3")
    assert from_gguf.config.head_dim == Q.head_dim(arch)
    assert from_gguf.config.rope.scaling == ("llama3" if arch == "llama3" else "none")
    raw = Q.hf_tokenizer(arch)
    check_logits(from_dir, from_gguf, ref[tied], TEXTS, arch, record_property, encode=lambda t: raw.encode(t).ids)


def test_greedy_32_tokens_match_transformers(models, ref):
    check_greedy(models, ref[False], [("gguf", text) for text in TEXTS[:3]])


def test_biases_qk_norms_and_rope_scaling_matter(files, arch):
    """A runtime that dropped Qwen2's biases, Qwen3's QK-norm weights or Llama 3's RoPE scaling would
    be caught: zeroing the biases, setting the norm weights to 1, or rotating unscaled moves the logits."""
    from tinydet.config import RoPE
    from tinydet.formats import Tensor, open_checkpoint

    ck = open_checkpoint(files[False][1][None])
    cfg = ck.config
    if arch == "llama3":
        tensors = ck.tensors
        cfg = dataclasses.replace(cfg, rope=RoPE(cfg.rope.base))
    elif arch == "qwen2":
        tensors = {k: (Tensor.of(np.zeros(v.shape, np.float32)) if ".b" in k else v) for k, v in ck.tensors.items()}
    else:
        tensors = {k: (Tensor.of(np.ones(v.shape, np.float32)) if k.endswith(("q_norm", "k_norm")) else v)
                   for k, v in ck.tensors.items()}
        assert sum(k.endswith(("q_norm", "k_norm")) for k in tensors) == 2 * Q.LAYERS
    ids = ck.tokenizer.encode(TEXTS[1])
    assert np.abs(backend_logits(ck.config, ck.tensors, ids) - backend_logits(cfg, tensors, ids)).max() > 0.5


def test_threads_chunking_and_batch(files):
    model = tinydet.load(files[False][1][None], dtype="fp32")
    check_threads_chunking_and_batch(model, model.tokenize(TEXTS[3]), TEXTS)


@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
def test_native_storage_gives_fp32_bits(files, quant):
    check_native_gives_fp32_bits(files[True][1][quant], quant, TEXTS[:3])


def test_trace_diff(files, tmp_path):
    model = tinydet.load(files[False][1][None])
    check_trace_diff(model, model.tokenize(TEXTS[1]), tmp_path)


def test_convert_back_to_hf_directory(files, tmp_path, ref, arch):
    """GGUF -> HF directory: transformers loads it as Qwen2ForCausalLM / Qwen3ForCausalLM with
    transformers' own logits of the original, and tinydet gives the GGUF's bits from it."""
    from tinydet.tools.convert import convert_gguf_to_hf

    for tied in (False, True):
        out = convert_gguf_to_hf(files[tied][1][None], tmp_path / f"conv-{tied}")
        cfg = json.loads((out / "config.json").read_text())
        name = f"{Q.ARCHS[arch]}ForCausalLM"
        assert cfg["architectures"] == [name] and cfg["model_type"] == Q.config_json(arch=arch)["model_type"]
        if arch == "llama3":  # read back from rope_freqs.weight's divisors
            assert cfg["rope_scaling"] == {k: v for k, v in Q.LLAMA3_ROPE.items()}
        assert cfg["tie_word_embeddings"] is tied and cfg["head_dim"] == Q.head_dim(arch)
        check_converted(files[tied][1][None], out, ref[tied], name, TEXTS[4:], attn=None)


def test_verify_matrix_passes(files):
    check_verify_matrix(files[False][1]["q8_0"])


def test_golden_hashes(files, arch):
    """tests/golden/{qwen2,qwen3,llama3}-tiny.json (the Q8_0 files), pinned to the Qwen2ForCausalLM /
    Qwen3ForCausalLM / LlamaForCausalLM holding the file's dequantized weights
    (archrunner.check_golden_pinned)."""
    ref = Q.spec(arch=arch).hf_model(weights=Q.dequantized_state_dict("q8_0", arch=arch))
    check_golden_pinned(files[False][1]["q8_0"], f"{arch}-tiny", ref)


def test_sliding_window_config(files, tmp_path, arch):
    """config.json's use_sliding_window slides the layers from max_window_layers on, as transformers
    reads it (Qwen2.5's own configs leave it off). LlamaForCausalLM has no sliding window: transformers
    ignores those keys in a Llama config.json, and so does tinydet."""
    d = edited(files[False][0], tmp_path / "sliding", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    cfg = json.loads((d / "config.json").read_text())
    model = tinydet.load(d)
    assert model.config.layer_windows == (() if arch == "llama3" else (0, 4))
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    ids = model.tokenize(TEXTS[4])
    assert len(ids) > 8
    want = hf_logits(ref, ids)
    got = model.logits(ids)
    assert np.abs(got - want).max() <= 1e-4
    unwindowed = tinydet.load(files[False][0]).logits(ids)
    if arch == "llama3":
        assert np.array_equal(bits(got), bits(unwindowed))
        return
    assert np.abs(got - unwindowed).max() > 1e-3  # the window matters here
    cfg["layer_types"] = ["full_attention"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(tinydet.ModelFormatError, match="layer_types"):
        tinydet.load(d)


def test_qwen3_yarn_matches_transformers(tmp_path):
    """Qwen3's long-context setting, a YaRN RoPE scaling in config.json (transformers 4.x's rope_scaling
    and 5.x's rope_parameters), runs as transformers runs it: logits within 1e-4 on a prompt past the
    ramp's wavelengths, where the scaling moves them."""
    made = Q.write_hf_dir(tmp_path / "qwen3", arch="qwen3")
    plain = tinydet.load(made)
    ids = plain.tokenize("The quick brown fox jumps over the lazy dog, and the dog does not mind: it is lazy.")
    for key, extra in (("rope_scaling", {}), ("rope_parameters", {"rope_theta": Q.ROPE_THETA, "beta_fast": 16})):
        cfg = json.loads((made / "config.json").read_text())
        cfg[key] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, **extra}
        (made / "config.json").write_text(json.dumps(cfg))
        got = tinydet.load(made).logits(ids)
        want = hf_logits(transformers.AutoModelForCausalLM.from_pretrained(made, dtype=torch.float32).eval(), ids)
        assert np.abs(got - want).max() <= 1e-4, key
        assert np.abs(got - plain.logits(ids)).max() > 1e-2  # the scaling matters here


def test_qwen3_settings_it_cannot_run_are_refused(tmp_path):
    """A Qwen3 config.json with q/k/v/o biases or a YaRN scaling with DeepSeek's mscale keys is refused
    with the field named, not run without it."""
    made = Q.write_hf_dir(tmp_path / "qwen3", arch="qwen3")
    cases = {"attention_bias": {"attention_bias": True},
             "rope_scaling": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 0.707,
                                               "original_max_position_embeddings": 128}}}
    for field, change in cases.items():
        d = edited(made, tmp_path / field, **change)
        with pytest.raises(tinydet.ModelFormatError, match=field) as e:
            tinydet.load(d)
        assert "config.json" in str(e.value), str(e.value)
