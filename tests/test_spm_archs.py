"""Mistral and Phi-3 on tiny checkpoints made here (tests/spmgen.py): the same random weights as a Hugging
Face directory written by transformers (MistralForCausalLM / Phi3ForCausalLM) and as a GGUF laid out as
llama.cpp's converter writes it (Mistral as a `llama` file, Q/K rows permuted; Phi-3 as `phi3`, with
its fused attn_qkv and gate/up ffn_up), both with a Llama-2-style SentencePiece tokenizer. Against
transformers fp32 (eager attention): logits within 1e-4, the same 32 greedy tokens, the same token ids
and chat prompts; GGUF and HF directory give the same bits; the whole contract (threads, chunking,
batch, native storage on row slices of quantized blocks, trace, verify, golden hashes pinned to
transformers) and conversion back to a LlamaForCausalLM / Phi3ForCausalLM directory. Then what is
particular to each: the fused tensors and the permuted rows matter, the sliding windows (Phi-3's from
both formats, Mistral's from config.json) matter and match transformers, Mistral's head_dim of its own,
Phi-3's special tokens swallowing the whitespace after them, and the settings tinydet refuses (LongRoPE,
oversized windows, partial RoPE), each with one line naming the file and the field."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import spmgen as S
import tinydet
from archrunner import (DROP, backend_logits, check_converted, check_golden_pinned, check_greedy, check_logits,
                        check_matches_reference, edited, fixtures, float32_eps, refused)
from contract import (bits, check_native_gives_fp32_bits, check_threads_chunking_and_batch, check_trace_diff,
                      check_verify_matrix)
from reference import hf_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog, and the dog does not mind at all.",
         "In 1969, three astronauts flew 384400 km; prices were 19.99 and 12 percent off on 2024-03-15.",
         "[INST] What is the capital of France? [/INST] The capital of France is Paris.",
         "<|user|>\nCan you write a short story about a robot?<|end|>\n<|assistant|>\nOnce upon a time",
         "café 😀 naïve: tabs\tand  double  spaces.\n\nI'm sure </s> and <s> are odd here"]
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "You are a helpful assistant."},
          {"role": "user", "content": "Hi there"}, {"role": "assistant", "content": " Hello! How can I help? "},
          {"role": "user", "content": "Write a short story\nabout a robot."}]]


# files: {tied: (hf_dir, {quant: gguf})}; models: {"hf", "gguf"} (untied); ref: {tied: transformers' model}
arch, files, models, ref = fixtures(lambda arch, tied: S.spec(arch, tied), ["mistral", "phi3"], tied=True)


# --- the contract --------------------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers_and_gguf_equals_hf_dir(files, ref, arch, tied, record_property):
    hf_dir, ggufs = files[tied]
    from_dir, from_gguf = tinydet.load(hf_dir), tinydet.load(ggufs[None])
    # A Mistral GGUF is a `llama` one (llama.cpp's converter writes it so), the same model by another name
    name = "llama" if arch == "mistral" else arch
    assert (from_dir.config.arch, from_gguf.config.arch) == (arch, name)
    assert dataclasses.replace(float32_eps(from_dir.config), arch=name) == from_gguf.config
    assert from_gguf.config.layer_windows == ((S.PHI3_SLIDING_WINDOW,) * S.LAYERS if arch == "phi3" else ())
    # Mistral's embedding is its tokenizer; Phi-3's is padded past it (512 rows for 507 tokens here)
    assert from_gguf.config.vocab_size == S.vocab_size(arch)
    assert from_dir.tokenizer.vocab_size == (S.BASE_VOCAB + len(S.PHI3_ADDED) if arch == "phi3" else S.BASE_VOCAB)
    raw = S.hf_tokenizer(arch)
    check_logits(from_dir, from_gguf, ref[tied], TEXTS, arch, record_property, encode=lambda t: raw.encode(t).ids)


def test_tokenizer_matches_transformers(files, models, arch):
    """transformers' own tokenizer of the directory (AutoTokenizer): the same ids from tinydet's HF and
    GGUF readers on every test string (BOS added for Mistral only, Phi-3's special tokens eating the
    whitespace after them), and the same text back."""
    ref = transformers.AutoTokenizer.from_pretrained(files[False][0])
    extra = [" leading space", "trailing space ", "<|end|>  \t\n x", "[INST]Hi[/INST]", "\n\n\n", "", "x</s>  y"]
    for text in TEXTS + extra:
        want = ref(text)["input_ids"]
        assert (want[:1] == [S.BOS_ID]) == (arch == "mistral"), text
        for name, m in models.items():
            assert m.tokenize(text) == want, (name, text)
            assert m.tokenizer.decode(want) == ref.decode(want, skip_special_tokens=True), (name, text)


def test_chat_template_renders_as_apply_chat_template(files, models, arch):
    """Mistral-Instruct v0.3's and Phi-3-mini-4k-instruct's templates: tinydet's chat prompt is the ids
    of what transformers' apply_chat_template renders, from both formats."""
    ref = transformers.AutoTokenizer.from_pretrained(files[False][0])
    template = S.MISTRAL_CHAT_TEMPLATE if arch == "mistral" else S.PHI3_CHAT_TEMPLATE
    for m in models.values():
        assert m.tokenizer.chat_template == template
    for messages in CHATS:
        text = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        opener = "<s>[INST] " if arch == "mistral" else "<|user|>\n" if len(messages) == 1 else "<|system|>\n"
        assert text.startswith(opener), text
        want = ref(text, add_special_tokens=False)["input_ids"]
        for name, m in models.items():
            assert m.chat_prompt(messages) == want, (name, messages)


def test_greedy_32_tokens_match_transformers(models, ref):
    check_greedy(models, ref[False], (("gguf", TEXTS[1]), ("gguf", TEXTS[3]), ("hf", TEXTS[4])))


def test_layout_fixups_matter(files, arch):
    """What the readers undo is load-bearing. Mistral's GGUF stores Q and K rows in llama.cpp's
    interleaved order, moved back at load: running the rows as stored moves the logits. Phi-3's fused
    tensors are split as transformers splits them, each part a zero-copy row slice of the file's bytes
    equal to those rows of qkv_proj / gate_up_proj: swapping the gate and up halves, or k and v, moves
    the logits."""
    from tinydet.formats import Tensor, open_checkpoint
    from tinydet.formats.gguf import GGUFFile
    from tinydet.formats.gguf_model import gguf_config, gguf_tensors

    path = files[False][1][None]
    ck = open_checkpoint(path)
    ids = ck.tokenizer.encode(TEXTS[1])

    base = backend_logits(ck.config, ck.tensors, ids)
    sd = S.state_dict(arch)
    q, kv = S.HEADS * S.HEAD_DIM, S.KV_HEADS * S.HEAD_DIM
    moved = []
    if arch == "mistral":
        for i in range(S.LAYERS):
            for x in ("q", "k"):
                t = ck.tensors[f"layers.{i}.w{x}"]
                assert t.row_order is not None
                assert np.array_equal(bits(t.float32()), bits(sd[f"model.layers.{i}.self_attn.{x}_proj.weight"]))
        stored = {k: (Tensor(v.data, v.ggml_type, v.shape) if v.row_order is not None else v)
                  for k, v in ck.tensors.items()}
        moved.append(stored)
    else:
        g = GGUFFile(path)
        views = gguf_tensors(g, *gguf_config(g))  # read through the same map as g's own bytes
        for i in range(S.LAYERS):
            qkv, gu = sd[f"model.layers.{i}.self_attn.qkv_proj.weight"], sd[f"model.layers.{i}.mlp.gate_up_proj.weight"]
            for part, rows, name in (("wq", qkv[:q], "attn_qkv"), ("wk", qkv[q:q + kv], "attn_qkv"),
                                     ("wv", qkv[q + kv:], "attn_qkv"), ("w1", gu[:S.FFN], "ffn_up"),
                                     ("w3", gu[S.FFN:], "ffn_up")):
                t = ck.tensors[f"layers.{i}.{part}"]
                assert np.shares_memory(views[f"layers.{i}.{part}"].data, g.tensor_bytes(f"blk.{i}.{name}.weight"))
                assert np.array_equal(bits(t.float32()), bits(rows)), (i, part)
        for a, b in (("w1", "w3"), ("wk", "wv")):
            swapped = dict(ck.tensors)
            for i in range(S.LAYERS):
                swapped[f"layers.{i}.{a}"], swapped[f"layers.{i}.{b}"] = ck.tensors[f"layers.{i}.{b}"], ck.tensors[
                    f"layers.{i}.{a}"]
            moved.append(swapped)
    for tensors in moved:
        assert np.abs(base - backend_logits(ck.config, tensors, ids)).max() > 0.05


def test_threads_chunking_and_batch(files, arch):
    """Chunks of 7, 8 and 9 tokens too: for Phi-3, cache rows crossing its 7-position window's edge at
    every offset."""
    model = tinydet.load(files[False][1][None], dtype="fp32")
    ids = model.tokenize(TEXTS[4])
    assert len(ids) > 2 * S.PHI3_SLIDING_WINDOW
    check_threads_chunking_and_batch(model, ids, TEXTS, extra=((1, 7), (2, 8), (1, 9)))


@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
def test_native_storage_gives_fp32_bits(files, quant):
    """Native storage keeps the blocks as stored: for Phi-3, row slices of the fused matrices' blocks."""
    check_native_gives_fp32_bits(files[True][1][quant], quant, TEXTS[:4], kinds=("wqkv", "w13", "output"))


def test_q8_0_matches_transformers_with_its_weights(files, arch):
    """The Q8_0 file runs the transformers model that holds its dequantized weights (within 1e-4)."""
    check_matches_reference(files[False][1]["q8_0"], S.hf_model(arch, weights=S.dequantized_state_dict(arch, "q8_0")),
                            TEXTS[3:5])


def test_trace_diff(files, tmp_path):
    model = tinydet.load(files[False][1][None])
    check_trace_diff(model, model.tokenize(TEXTS[1]), tmp_path)


def test_convert_back_to_hf_directory(files, tmp_path, ref, arch):
    """GGUF -> HF directory: a Mistral GGUF (a `llama` file) becomes a LlamaForCausalLM directory, a
    Phi-3 one a Phi3ForCausalLM directory with its fused qkv_proj / gate_up_proj written back whole.
    The directory holds the generator's weights exactly; transformers loads it as that class with
    transformers' own logits of the original; tinydet gives the GGUF's bits and token ids from it."""
    from safetensors.numpy import load_file

    from tinydet.tools.convert import convert_gguf_to_hf

    name, model_type = ("LlamaForCausalLM", "llama") if arch == "mistral" else ("Phi3ForCausalLM", "phi3")
    for tied in (False, True):
        src = files[tied][1][None]
        out = convert_gguf_to_hf(src, tmp_path / f"conv-{tied}")
        cfg = json.loads((out / "config.json").read_text())
        assert (cfg["architectures"], cfg["model_type"], cfg["tie_word_embeddings"]) == ([name], model_type, tied)
        assert cfg.get("sliding_window") == (S.PHI3_SLIDING_WINDOW if arch == "phi3" else None)
        st = load_file(out / "model.safetensors")
        sd = S.state_dict(arch, tied)
        assert set(st) == set(sd)
        for k, v in sd.items():
            assert np.array_equal(bits(st[k]), bits(v)), k
        check_converted(src, out, ref[tied], name, TEXTS[3:])
    q = convert_gguf_to_hf(files[False][1]["q8_0"], tmp_path / "conv-q8")  # matrices dequantized exactly
    ids = tinydet.load(q).tokenize(TEXTS[4])
    assert np.array_equal(bits(tinydet.load(q).logits(ids)), bits(tinydet.load(files[False][1]["q8_0"]).logits(ids)))


def test_verify_matrix_passes(files):
    check_verify_matrix(files[False][1]["q8_0"])


def test_golden_hashes(files, arch):
    """tests/golden/mistral-tiny.json and phi3-tiny.json (the Q8_0 files), pinned to the
    MistralForCausalLM / Phi3ForCausalLM holding the file's dequantized weights
    (archrunner.check_golden_pinned)."""
    ref = S.hf_model(arch, weights=S.dequantized_state_dict(arch, "q8_0"))
    check_golden_pinned(files[False][1]["q8_0"], f"{arch}-tiny", ref)


# --- what is particular to each ------------------------------------------------------------------------

def test_sliding_window(files, arch, tmp_path):
    """Phi-3: the window (7 positions here) from config.json and from phi3.attention.sliding_window, as
    transformers applies it (the logits test above); full attention would differ, past the window's
    edge only. Mistral: the tiny model has sliding_window null, as v0.2 / v0.3; a directory with a window
    shorter than the prompt runs as transformers' MistralForCausalLM (eager) runs it, and differs from
    the full-attention one past the edge."""
    from tinydet.formats import open_checkpoint

    w = S.PHI3_SLIDING_WINDOW if arch == "phi3" else 8
    if arch == "phi3":
        ck = open_checkpoint(files[False][1][None])
        assert ck.config.layer_windows == (w,) * S.LAYERS == open_checkpoint(files[False][0]).config.layer_windows
        full_cfg = dataclasses.replace(ck.config, layer_windows=())
    else:
        d = edited(files[False][0], tmp_path / "window", sliding_window=w)
        ck = open_checkpoint(d)
        assert ck.config.layer_windows == (w,) * S.LAYERS
        ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                                attn_implementation="eager").eval()
        ids = ck.tokenizer.encode(TEXTS[4])
        assert float(np.abs(tinydet.load(d).logits(ids) - hf_logits(ref, ids)).max()) <= 1e-4
        full_cfg = open_checkpoint(files[False][0]).config
        assert full_cfg.layer_windows == ()
    ids = ck.tokenizer.encode(TEXTS[4])
    assert len(ids) > 3 * w

    windowed, full = backend_logits(ck.config, ck.tensors, ids), backend_logits(full_cfg, ck.tensors, ids)
    assert np.array_equal(bits(windowed[:w]), bits(full[:w]))  # the same until the window's edge
    assert np.abs(windowed - full).max() > 1e-2


def test_mistral_head_dim_of_its_own(tmp_path):
    """A Mistral-Nemo-like config.json (head_dim 32, so q_dim 128 is not hidden_size 64) runs as
    transformers runs it, and so does the `llama` GGUF llama.cpp's converter writes of it
    (attention.key_length 32), bit for bit."""
    hf, g = S.make_tiny(tmp_path, "mistral", head_dim=32)
    model = tinydet.load(hf)
    assert (model.config.head_dim, model.config.q_dim, model.config.kv_dim) == (32, 128, 64)
    ref = S.hf_model("mistral", head_dim=32)
    for text in TEXTS[3:5]:
        ids = model.tokenize(text)
        assert float(np.abs(model.logits(ids) - hf_logits(ref, ids)).max()) <= 1e-4
    from_gguf = tinydet.load(g)
    assert (from_gguf.config.arch, from_gguf.config.head_dim) == ("llama", 32)
    ids = model.tokenize(TEXTS[4])
    assert np.array_equal(bits(from_gguf.logits(ids)), bits(model.logits(ids)))


def test_phi3_special_tokens_swallow_the_whitespace_after_them(tmp_path):
    """Phi-3's tokenizer.json gives its chat tokens rstrip ("<|user|>\\n" is one token); llama.cpp gives
    a GGUF the same by its general.name ("phi-3" / "phi3" in it), and so does tinydet: "Tiny Phi3"
    tokenizes as the directory does, a file named otherwise keeps the newline, and Mistral's tokens
    strip nothing."""
    text = "<|user|>\nHi there<|end|>\n<|assistant|>\n  Hello</s>  \t\nend"
    raw = S.hf_tokenizer("phi3").encode(text).ids
    newline = S.FIRST_BYTE + 0x0A  # <0x0A>
    assert newline not in raw
    named = tinydet.load(S.write_gguf(tmp_path / "phi3.gguf", "phi3"))
    other = tinydet.load(S.write_gguf(tmp_path / "other.gguf", "phi3", name="Tiny Model"))
    assert named.tokenize(text) == raw
    assert other.tokenize(text) != raw and newline in other.tokenize(text)
    mistral = tinydet.load(S.write_gguf(tmp_path / "mistral.gguf", "mistral"))
    assert mistral.tokenize("</s>\nx") == S.hf_tokenizer("mistral").encode("</s>\nx").ids
    assert newline in mistral.tokenize("</s>\nx")


def test_settings_it_cannot_run_are_refused(files, arch, tmp_path):
    """Refused with one line naming the file and the field: LongRoPE (Phi-3 128k: config.json's
    rope_scaling "longrope" / "su", transformers 5's rope_parameters, a GGUF's rope_factors tensors),
    with its reason; a sliding window larger than the context (from either format; Mistral's absent
    sliding_window is MistralConfig's 4096); partial RoPE (Phi-4-mini); RoPE scalings not supported; a
    GGUF claiming the HF-only `mistral` architecture."""
    from ggufgen import rewrite

    hf = files[False][0]
    n = S.HEAD_DIM // 2
    longrope = {"long_factor": [1.5] * n, "short_factor": [1.0] * n}
    if arch == "phi3":
        cases = [
            (dict(rope_scaling={"type": "longrope", **longrope}, max_position_embeddings=4 * S.CONTEXT),
             "rope_scaling", ("'longrope' is not supported", "LongRoPE", "what follows it")),
            (dict(rope_scaling={"type": "su", **longrope}), "rope_scaling", ("'su'", "LongRoPE")),
            (dict(rope_theta=DROP, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, **longrope}),
             "rope_parameters", ("LongRoPE", "what follows it")),
            (dict(sliding_window=S.CONTEXT + 1), "sliding_window", ("larger than max_position_embeddings",)),
            (dict(partial_rotary_factor=0.75), "partial_rotary_factor", ("partial RoPE",)),
            (dict(rope_theta=DROP, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "partial_rotary_factor": 0.75}),
             "rope_parameters.partial_rotary_factor", ("partial RoPE",)),
            (dict(head_dim=32), "head_dim", ("a head dimension of its own is not supported",)),
        ]
    else:
        cases = [
            (dict(sliding_window=S.CONTEXT + 1), "sliding_window", ("larger than max_position_embeddings",)),
            (dict(sliding_window=DROP), "sliding_window", ("4096", "MistralConfig's default")),
            (dict(sliding_window=0), "sliding_window", ("positive",)),
            (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
             "rope_scaling", ("'yarn' is not supported",)),
            (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_scaling",
             ("'dynamic' is not supported", "what follows it")),
        ]
    for i, (change, field, words) in enumerate(cases):
        refused(edited(hf, tmp_path / f"c{i}", **change), field, *words, strict=True)
    if arch == "phi3":
        factors = {"rope_factors_long.weight": np.full(n, 1.5, np.float32),
                   "rope_factors_short.weight": np.ones(n, np.float32)}
        g = S.write_gguf(tmp_path / "longrope.gguf", "phi3", overrides={
            "phi3.context_length": 4 * S.CONTEXT, "phi3.rope.scaling.attn_factor": 1.19}, extra_tensors=factors)
        refused(g, "rope_factors_long.weight", "LongRoPE is not supported", "what follows it", strict=True)
        g = S.write_gguf(tmp_path / "window.gguf", "phi3", overrides={"phi3.attention.sliding_window": S.CONTEXT + 1})
        refused(g, "phi3.attention.sliding_window", f"0..context_length ({S.CONTEXT})", strict=True)
        g = S.write_gguf(tmp_path / "partial.gguf", "phi3", overrides={"phi3.rope.dimension_count": 12})
        refused(g, "phi3.rope.dimension_count", "partial RoPE", strict=True)
        g = S.write_gguf(tmp_path / "su.gguf", "phi3", overrides={"phi3.rope.scaling.type": "longrope"})
        refused(g, "phi3.rope.scaling.type", "'longrope' is not supported", "LongRoPE", strict=True)
    else:
        g = tmp_path / "mistral-arch.gguf"
        g.write_bytes(rewrite(files[False][1][None], {"general.architecture": "mistral"}))
        refused(g, "general.architecture", "'mistral' is not supported", "llama", "phi3", strict=True)


def test_generator_writes_the_converters_layout(tmp_path):
    """spmgen's GGUFs: the keys and tensors llama.cpp's converter writes (Mistral as `llama` with
    vocab_size and rope.dimension_count; Phi-3's phi3.* keys, fused attn_qkv / ffn_up, the vocabulary
    padded to vocab_size with UNUSED "[PAD{i}]" tokens), written byte for byte the same twice."""
    from gguf import GGUFReader

    from tinygen import file_digests

    for arch in ("mistral", "phi3"):
        a, b = (S.write_gguf(tmp_path / f"{arch}-{i}.gguf", arch, "q8_0") for i in (0, 1))
        assert file_digests([a])[a.name] == file_digests([b])[b.name]
        r = GGUFReader(a)
        keys = set(r.fields)
        names = {t.name for t in r.tensors}
        types = {t.name: t.tensor_type.name for t in r.tensors}
        if arch == "mistral":
            assert str(bytes(r.fields["general.architecture"].parts[-1]), "utf-8") == "llama"
            assert {"llama.vocab_size", "llama.rope.dimension_count", "llama.rope.freq_base"} <= keys
            assert not any("sliding_window" in k for k in keys)
            assert {"blk.0.attn_q.weight", "blk.0.ffn_gate.weight"} <= names
        else:
            want = {f"phi3.{k}" for k in ("context_length", "rope.scaling.original_context_length", "embedding_length",
                                          "feed_forward_length", "block_count", "attention.head_count",
                                          "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
                                          "rope.dimension_count", "rope.freq_base", "attention.sliding_window")}
            assert {k for k in keys if k.startswith("phi3.")} == want
            assert {"blk.0.attn_qkv.weight", "blk.0.ffn_up.weight"} <= names
            assert not {"blk.0.attn_q.weight", "blk.0.ffn_gate.weight"} & names
            tokens, _, toktypes = S.gguf_vocab("phi3")
            assert len(tokens) == S.PHI3_VOCAB and tokens[-1] == f"[PAD{S.PHI3_VOCAB - 1}]"
            assert toktypes[S.EOS_ID] == S.USER_DEFINED and toktypes[S.token_id("<|end|>", "phi3")] == S.CONTROL
        assert types["token_embd.weight"] == "Q8_0" and types["output_norm.weight"] == "F32"


def test_specs_and_row_slices():
    """The two specs as found: Mistral by config.json only (a `llama` GGUF stays llama's), Phi-3 by
    both. And what Phi-3's parts are made of: `Tensor.row_slice` views rows of the stored bytes (whole
    Q8_0 blocks), dequantizes to those rows of the whole, and its release() lets go of its own rows'
    bytes only, at their offsets in the stored tensor."""
    from gguf import GGMLQuantizationType, quants

    from tinydet import arch as archs
    from tinydet.formats import Tensor
    from tinydet.formats.ggml import GGML_TYPES

    assert archs.by_gguf("llama").name == "llama" and archs.by_gguf("mistral") is None
    assert archs.by_hf("mistral", None) is archs.by_hf(None, ["MistralForCausalLM"]) is archs.SPECS["mistral"]
    assert archs.by_gguf("phi3") is archs.by_hf("phi3", None) is archs.SPECS["phi3"]
    assert "phi3" in archs.gguf_archs() and None not in archs.gguf_archs()
    parts = {t.canonical: t for t in archs.SPECS["phi3"].tensors if t.fused}
    assert sorted(parts) == ["layers.{}.w1", "layers.{}.w3", "layers.{}.wk", "layers.{}.wq", "layers.{}.wv"]
    assert [parts[f"layers.{{}}.w{x}"].part for x in ("q", "k", "v", "1", "3")] == [0, 1, 2, 0, 1]

    w = (np.random.RandomState(1).standard_normal((10, 64)) * 0.1).astype(np.float32)
    q8 = next(k for k, v in GGML_TYPES.items() if v.name == "Q8_0")
    raw = np.ascontiguousarray(quants.quantize(w, GGMLQuantizationType.Q8_0)).reshape(-1).view(np.uint8)
    calls = []
    whole = Tensor(raw, q8, w.shape, release=lambda lo=0, hi=None: calls.append((lo, hi)))
    rb = raw.size // 10  # 68 bytes a row: two blocks of 34
    part = whole.row_slice(3, 7)
    assert part.shape == (4, 64) and part.type_name == "Q8_0" and np.shares_memory(part.data, raw)
    assert np.array_equal(bits(part.float32()), bits(whole.float32()[3:7]))
    assert np.array_equal(bits(part.rows(1, 3)), bits(whole.float32()[4:6]))
    part.release()
    part.release((1, 3))
    assert calls == [(3 * rb, 7 * rb), (4 * rb, 6 * rb)]
    assert Tensor.of(w).row_slice(0, 10).float32().tobytes() == w.tobytes()  # no release to call: none made
    for bad in ((5, 5), (-1, 2), (0, 11)):
        with pytest.raises(ValueError):
            whole.row_slice(*bad)
