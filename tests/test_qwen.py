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
from pathlib import Path

import numpy as np
import pytest

import qwen2gen as Q
import tinydet
from contract import (bits, check_greedy_matches, check_native_gives_fp32_bits, check_threads_chunking_and_batch,
                      check_trace_diff, check_verify_matrix)
from reference import hf_generate
from tinydet.hashing import file_sha256
from tinydet.tools.golden import check_golden, model_loader, read_golden

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

GOLDEN = Path(__file__).parent / "golden"  # qwen2-tiny.json, qwen3-tiny.json, llama3-tiny.json
TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog.", "12345 and 3.14159, 2024-03-15",
         "<|im_start|>user\nHi there, how are you?<|im_end|>\n<|im_start|>assistant\n",
         "I'm sure you'll agree: we're here.\n\n\tdef hello(name):\n    return name"]


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "llama3"])
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def files(tmp_path_factory, arch):
    """{tied: (hf_dir, {quant: gguf})} for the untied and the tied variant."""
    out = tmp_path_factory.mktemp(arch)
    made = {}
    for tied in (False, True):
        hf, f32 = Q.make_tiny_qwen2(out, None, tied=tied, arch=arch)
        made[tied] = (hf, {q: Q.write_gguf(out / f"{q}-{tied}.gguf", q, tied=tied, arch=arch) for q in ("q8_0", "q4_0")})
        made[tied][1][None] = f32
    return made


@pytest.fixture(scope="module")
def hf_model(arch):
    return {tied: Q.hf_model(tied=tied, arch=arch).eval() for tied in (False, True)}


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers_and_gguf_equals_hf_dir(files, hf_model, arch, tied, record_property):
    hf_dir, ggufs = files[tied]
    from_dir, from_gguf = tinydet.load(hf_dir), tinydet.load(ggufs[None])
    # GGUF stores the RMSNorm epsilon as a float32, config.json as a decimal: the kernels use float32
    assert dataclasses.replace(from_dir.config, rms_eps=float(np.float32(from_dir.config.rms_eps))) == from_gguf.config
    assert from_gguf.config.arch == Q.GGUF_ARCH[arch]
    assert (from_gguf.config.qkv_bias, from_gguf.config.qk_norm) == (arch == "qwen2", arch == "qwen3")
    assert from_gguf.config.head_dim == Q.head_dim(arch)
    assert from_gguf.config.rope.scaling == ("llama3" if arch == "llama3" else "none")
    worst = 0.0
    for text in TEXTS:
        ids = from_gguf.tokenize(text)
        assert ids == from_dir.tokenize(text) == Q.hf_tokenizer(arch).encode(text).ids
        ours = from_gguf.logits(ids)
        assert np.array_equal(bits(ours), bits(from_dir.logits(ids)))
        with torch.no_grad():
            want = hf_model[tied](torch.tensor([ids])).logits[0].numpy()
        worst = max(worst, float(np.abs(ours - want).max()))
    record_property(f"{arch}_max_abs_diff_vs_transformers", worst)
    print(f"tiny {arch} (tied={tied}): max |tinydet - transformers| = {worst:.2e} over {len(TEXTS)} prompts")
    assert worst <= 1e-4


def test_greedy_32_tokens_match_transformers(files, hf_model):
    model = tinydet.load(files[False][1][None])
    for text in TEXTS[:3]:
        check_greedy_matches(model, hf_model[False], model.tokenize(text), label=text)


def test_biases_qk_norms_and_rope_scaling_matter(files, arch):
    """A runtime that dropped Qwen2's biases, Qwen3's QK-norm weights or Llama 3's RoPE scaling would
    be caught: zeroing the biases, setting the norm weights to 1, or rotating unscaled moves the logits."""
    from tinydet.backends.cpu import CPUBackend
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
    be, zero = CPUBackend(ck.config, ck.tensors), CPUBackend(cfg, tensors)
    a = be.forward(ids, be.new_cache(len(ids)), all_logits=True)
    b = zero.forward(ids, zero.new_cache(len(ids)), all_logits=True)
    assert np.abs(a - b).max() > 0.5


def test_threads_chunking_and_batch(files):
    model = tinydet.load(files[False][1][None], dtype="fp32")
    check_threads_chunking_and_batch(model, model.tokenize(TEXTS[3]), TEXTS)


@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
def test_native_storage_gives_fp32_bits(files, quant):
    check_native_gives_fp32_bits(files[True][1][quant], quant, TEXTS[:3])


def test_trace_diff(files, tmp_path):
    model = tinydet.load(files[False][1][None])
    check_trace_diff(model, model.tokenize(TEXTS[1]), tmp_path)


def test_convert_back_to_hf_directory(files, tmp_path, hf_model, arch):
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
        m = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert type(m).__name__ == name
        ids = tinydet.load(files[tied][1][None]).tokenize(TEXTS[4])
        with torch.no_grad():
            a = m(torch.tensor([ids])).logits[0].numpy()
            b = hf_model[tied](torch.tensor([ids])).logits[0].numpy()
        assert np.array_equal(a, b)  # the same weights, bit for bit, through transformers
        assert np.array_equal(bits(tinydet.load(out).logits(ids)), bits(tinydet.load(files[tied][1][None]).logits(ids)))


def test_verify_matrix_passes(files):
    check_verify_matrix(files[False][1]["q8_0"])


def test_golden_hashes(files, arch):
    """tests/golden/{qwen2,qwen3,llama3}-tiny.json (the Q8_0 files). Its greedy fp32 case is pinned to
    transformers: the same 32 tokens from the Qwen2ForCausalLM / Qwen3ForCausalLM / LlamaForCausalLM
    holding the file's dequantized weights. Then every case, and every fp32 case again with native storage, gives the
    recorded hashes."""
    path = files[False][1]["q8_0"]
    data = read_golden(GOLDEN / f"{arch}-tiny.json")
    assert data["model_sha256"] == file_sha256(path), "the generator no longer writes the recorded file"
    model = tinydet.load(path, dtype="fp32")
    case = data["cases"][0]
    assert (case["dtype"], case["temperature"], case["max_tokens"]) == ("fp32", 0.0, 32)
    ref = Q.hf_model(tied=False, arch=arch)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(torch.from_numpy(Q.dequantized_state_dict("q8_0", arch=arch)[name]))
        ids = model.tokenize(case["prompt"])
        want = hf_generate(ref, ids, 32)
    g = model.generate(case["prompt"], max_tokens=32)
    assert g.token_ids == want and g.output_hash == case["output_hash"]
    assert check_golden(model_loader(path, fp32=model), data, file_sha256(path)) == []


def test_sliding_window_config(files, tmp_path, arch):
    """config.json's use_sliding_window slides the layers from max_window_layers on, as transformers
    reads it (Qwen2.5's own configs leave it off). LlamaForCausalLM has no sliding window: transformers
    ignores those keys in a Llama config.json, and so does tinydet."""
    import shutil

    d = tmp_path / "sliding"
    shutil.copytree(files[False][0], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(use_sliding_window=True, sliding_window=4, max_window_layers=1)
    (d / "config.json").write_text(json.dumps(cfg))
    model = tinydet.load(d)
    assert model.config.layer_windows == (() if arch == "llama3" else (0, 4))
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    ids = model.tokenize(TEXTS[4])
    assert len(ids) > 8
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].numpy()
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
        want = transformers.AutoModelForCausalLM.from_pretrained(made, dtype=torch.float32).eval()
        with torch.no_grad():
            want = want(torch.tensor([ids])).logits[0].numpy()
        assert np.abs(got - want).max() <= 1e-4, key
        assert np.abs(got - plain.logits(ids)).max() > 1e-2  # the scaling matters here


def test_qwen3_settings_it_cannot_run_are_refused(tmp_path):
    """A Qwen3 config.json with q/k/v/o biases or a YaRN scaling with DeepSeek's mscale keys is refused
    with the field named, not run without it."""
    import shutil

    made = Q.write_hf_dir(tmp_path / "qwen3", arch="qwen3")
    cases = {"attention_bias": {"attention_bias": True},
             "rope_scaling": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 0.707,
                                               "original_max_position_embeddings": 128}}}
    for field, change in cases.items():
        d = tmp_path / field
        shutil.copytree(made, d)
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(tinydet.ModelFormatError, match=field) as e:
            tinydet.load(d)
        assert "config.json" in str(e.value), str(e.value)
