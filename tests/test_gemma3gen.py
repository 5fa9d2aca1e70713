"""Tests of the tiny-Gemma 3 generator itself (tests/gemma3gen.py), independent of tinydet's readers:
the files are deterministic, the GGUF has llama.cpp's gemma3 keys, tensor names, shapes and types (norms
as 1 + w), its vocabulary is what llama.cpp's converter makes of the SentencePiece vocabulary, and
transformers reads the HF directory and the GGUF (its own gemma3 GGUF loader) to the same model and the
same tokens."""

from __future__ import annotations

import hashlib
import importlib.util
import json

import numpy as np
import pytest

import gemma3gen as G

gguf = pytest.importorskip("gguf")

TEXTS = ["Hello world", "The capital of France is Paris.", "café — naïve 😀 “quotes”", "a  b   c\n\n\nd\n",
         "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", "<bos>x<eos>[multimodal]<mask>",
         "\tdef greet(name):\n\treturn name  # 12345", "   leading and trailing   ", "", G.TRAINING_TEXT]

KEYS = {
    "general.architecture", "general.type", "general.name", "general.size_label", "general.file_type",
    "general.quantization_version",
    "gemma3.block_count", "gemma3.context_length", "gemma3.embedding_length", "gemma3.feed_forward_length",
    "gemma3.attention.head_count", "gemma3.attention.head_count_kv", "gemma3.rope.freq_base",
    "gemma3.rope.freq_base_swa", "gemma3.attention.layer_norm_rms_epsilon", "gemma3.attention.key_length",
    "gemma3.attention.value_length", "gemma3.attention.sliding_window",
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_sep_token", "tokenizer.ggml.add_eos_token", "tokenizer.chat_template",
    "tokenizer.ggml.add_space_prefix",
}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(hf_dir or None, {quant: gguf}); the HF dir only where transformers is installed."""
    out = tmp_path_factory.mktemp("gemma3gen")
    ggufs = {q: G.write_gguf(out / f"tiny-gemma3-{G.QUANTS[q][0]}.gguf", quant=q) for q in (None, "q8_0")}
    have = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
    return (G.write_hf_dir(out / "tiny-gemma3") if have else None), ggufs


def _hf_dir(made):
    if made[0] is None:
        pytest.skip("torch/transformers are not installed")
    return made[0]


def _fields(path):
    r = gguf.GGUFReader(path)
    return r, {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def _digests(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


# --- determinism and weights --------------------------------------------------------------------------

def test_writes_are_byte_identical(tmp_path, made):
    for d in ("a", "b"):
        G.write_gguf(tmp_path / d / "m.gguf")
        G.write_gguf(tmp_path / d / "q.gguf", quant="q8_0")
        if made[0] is not None:
            G.write_hf_dir(tmp_path / d / "hf")
    da, db = _digests(tmp_path / "a"), _digests(tmp_path / "b")
    assert da and da == db
    assert da["m.gguf"] == hashlib.sha256(made[1][None].read_bytes()).hexdigest()  # and the session's file


def test_weights_are_fixed_and_norms_random():
    sd = G.state_dict()
    assert all(np.array_equal(v, G.state_dict()[k]) for k, v in sd.items())
    assert not np.array_equal(G.state_dict(seed=1)["model.embed_tokens.weight"], sd["model.embed_tokens.weight"])
    assert "lm_head.weight" not in sd and all(v.dtype == np.float32 for v in sd.values())
    norms = [k for k in sd if G.is_norm(k)]
    assert len(norms) == 1 + 6 * G.LAYERS
    for k in norms:  # w, the offset from 1: random, not zero, and 1 + w well inside [0.5, 2]
        w = sd[k]
        assert np.count_nonzero(w) == w.size and 0.05 < float(w.std()) < 0.2, k
        assert 0.5 <= float((1 + w).min()) and float((1 + w).max()) <= 2.0, k
    assert sd["model.embed_tokens.weight"].shape == (G.vocab_size(), G.HIDDEN) == (512, 64)
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (G.HEADS * G.HEAD_DIM, G.HIDDEN)
    assert sd["model.layers.0.self_attn.q_norm.weight"].shape == (G.HEAD_DIM,)


# --- the GGUF -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("quant", [None, "q8_0"])
def test_gguf_keys_tensors_shapes_types(made, quant):
    r, f = _fields(made[1][quant])
    assert set(f) == KEYS
    assert r.alignment == 32
    assert f["general.architecture"] == "gemma3" and f["general.type"] == "model"
    assert f["general.file_type"] == int(gguf.LlamaFileType[G.QUANTS[quant][1]])
    got = {k: f[f"gemma3.{k}"] for k in ("block_count", "context_length", "embedding_length", "feed_forward_length",
                                         "attention.head_count", "attention.head_count_kv", "attention.key_length",
                                         "attention.value_length", "attention.sliding_window")}
    assert got == {"block_count": 6, "context_length": 512, "embedding_length": 64, "feed_forward_length": 160,
                   "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 32,
                   "attention.value_length": 32, "attention.sliding_window": 8}
    assert (f["gemma3.rope.freq_base"], f["gemma3.rope.freq_base_swa"]) == (1e6, 1e4)
    assert f["gemma3.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert (f["tokenizer.ggml.model"], f["tokenizer.ggml.pre"]) == ("llama", "default")
    assert (f["tokenizer.ggml.bos_token_id"], f["tokenizer.ggml.eos_token_id"], f["tokenizer.ggml.unknown_token_id"],
            f["tokenizer.ggml.padding_token_id"]) == (2, 1, 3, 0)
    assert (f["tokenizer.ggml.add_bos_token"], f["tokenizer.ggml.add_sep_token"], f["tokenizer.ggml.add_eos_token"],
            f["tokenizer.ggml.add_space_prefix"]) == (True, False, False, False)
    assert f["tokenizer.chat_template"] == G.CHAT_TEMPLATE

    sd = G.state_dict()
    tensors = {t.name: t for t in r.tensors}
    assert [t.name for t in r.tensors] == [G.gguf_name(k) for k in sorted(sd)]  # the converter's order
    assert "output.weight" not in tensors and len(tensors) == len(sd) == 2 + 13 * G.LAYERS
    qtype = gguf.GGMLQuantizationType[G.QUANTS[quant][0]]
    for k, v in sd.items():
        t = tensors[G.gguf_name(k)]
        assert tuple(int(x) for x in reversed(t.shape)) == v.shape, k  # GGUF lists ne[0] (the row length) first
        assert t.tensor_type == (gguf.GGMLQuantizationType.F32 if v.ndim == 1 else qtype), k
        if G.is_norm(k):  # 1 + w, computed in float32
            want = (np.float32(1.0) + v).view(np.uint32)
            assert np.array_equal(np.asarray(t.data).reshape(v.shape).view(np.uint32), want), k
        elif quant is None:
            assert np.array_equal(np.asarray(t.data).reshape(v.shape), v), k
    names = {G.gguf_name(k) for k in sd}
    for i in range(G.LAYERS):
        assert {f"blk.{i}.{n}.weight" for n in ("attn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm",
                                                 "ffn_norm", "post_ffw_norm")} <= names


def test_gguf_vocab_is_llama_cpps_sentencepiece_vocab(made):
    _, f = _fields(made[1][None])
    tokens, scores, types = f["tokenizer.ggml.tokens"], f["tokenizer.ggml.scores"], f["tokenizer.ggml.token_type"]
    n = G.vocab_size()
    assert len(tokens) == len(scores) == len(types) == n == 512 and len(set(tokens)) == n
    T = gguf.TokenType
    # tokenizer_config's added tokens: scored -1000, CONTROL when special, else USER_DEFINED (as Gemma 3's file)
    assert tokens[:10] == [t for t, _ in G.ADDED_TOKENS]
    assert tokens[:8] == ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "[multimodal]", "<start_of_turn>",
                          "<end_of_turn>"]
    assert list(scores[:10]) == [-1000.0] * 10
    assert [types[i] for i in range(10)] == [T.CONTROL] * 5 + [T.USER_DEFINED] + [T.CONTROL] * 2 + [T.USER_DEFINED] * 2
    assert tokens[10:266] == [f"<0x{b:02X}>" for b in range(256)]
    assert all(types[i] == T.BYTE and scores[i] == 0.0 for i in range(10, 266))
    assert all(types[i] == T.NORMAL for i in range(266, n))
    assert [float(s) for s in scores[266:]] == [-float(i) for i in range(n - 266)]  # SentencePiece's BPE scores
    assert G.SPIECE in tokens and "\t" in tokens and not any(t[:1].isdigit() and len(t) > 1 for t in tokens[266:])


def test_tokenizer_json_merges_are_transformers(made):
    """tokenizer.json's merges are what transformers' generate_merges makes of the vocabulary and its
    SentencePiece scores (GemmaConverter's way), every split of a piece included."""
    pytest.importorskip("transformers")
    from transformers.tokenization_utils_base import generate_merges

    sp = G.sentencepiece_vocab()
    vocab = {p: i for i, (p, _, _) in enumerate(sp)}
    want = generate_merges(vocab, {p: s for p, s, _ in sp})
    tj = G.tokenizer_json()
    assert [tuple(m) for m in tj["model"]["merges"]] == list(want)
    assert len(want) > G.N_MERGES  # pieces with more than one split
    assert tj["model"]["vocab"] == vocab and tj["model"]["byte_fallback"] is True


# --- the HF directory -----------------------------------------------------------------------------------

def test_hf_dir_files(made, tmp_path):
    from safetensors.numpy import save_file

    d = _hf_dir(made)
    save_file(G.state_dict(), tmp_path / "np.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "np.safetensors").read_bytes() == (d / "model.safetensors").read_bytes()
    assert {p.name for p in d.iterdir()} == {"config.json", "generation_config.json", "model.safetensors",
                                             "tokenizer.json", "tokenizer_config.json"}
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["architectures"] == ["Gemma3ForCausalLM"]
    assert cfg["layer_types"] == list(G.LAYER_TYPES) and cfg["sliding_window"] == G.SLIDING_WINDOW
    assert "tie_word_embeddings" not in cfg  # as the hub's: Gemma3TextConfig ties by default


# --- transformers reads both forms to the same model ------------------------------------------------------

def test_transformers_gguf_matches_hf_dir(made):
    """transformers' own gemma3 GGUF loader (it subtracts 1 from every norm) gives the HF directory's
    logits. (That loader does not read query_pre_attn_scalar, which llama.cpp derives from
    key_length; its default is 256, so the tiny model's is passed.)"""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM, Gemma3ForCausalLM

    hf_dir, ggufs = _hf_dir(made), made[1]
    ids = G.hf_tokenizer().encode(G.TRAINING_TEXT[:300]).ids
    assert len(ids) > 4 * G.SLIDING_WINDOW
    hf = Gemma3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    ref = _logits(hf, ids)
    assert np.array_equal(ref, _logits(G.hf_model(), ids))
    assert hf.config.tie_word_embeddings is True and hf.config.layer_types == list(G.LAYER_TYPES)
    g = AutoModelForCausalLM.from_pretrained(ggufs[None].parent, gguf_file=ggufs[None].name, dtype=torch.float32,
                                             attn_implementation="eager",
                                             query_pre_attn_scalar=G.QUERY_PRE_ATTN_SCALAR).eval()
    assert type(g).__name__ == "Gemma3ForCausalLM" and g.config.tie_word_embeddings is True
    assert (g.config.head_dim, g.config.sliding_window, g.config.vocab_size) == (G.HEAD_DIM, G.SLIDING_WINDOW, 512)
    assert float(np.abs(_logits(g, ids) - ref).max()) <= 1e-6

    # The norms' scales matter: all of them 1 (w = 0) moves the logits a lot.
    nn = G.hf_model()
    with torch.no_grad():
        for n, p in nn.named_parameters():
            if n.endswith("norm.weight"):
                p.zero_()
    assert float(np.abs(_logits(nn, ids) - ref).max()) > 0.5


def test_transformers_quantized_gguf_matches_dequantized_weights(made):
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM

    _hf_dir(made)
    p = made[1]["q8_0"]
    ids = G.hf_tokenizer().encode(G.TRAINING_TEXT[:200]).ids
    g = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32,
                                             attn_implementation="eager",
                                             query_pre_attn_scalar=G.QUERY_PRE_ATTN_SCALAR).eval()
    lg = _logits(g, ids)
    assert float(np.abs(lg - _logits(G.hf_model(weights=G.dequantized_state_dict("q8_0")), ids)).max()) <= 1e-5
    assert float(np.abs(lg - _logits(G.hf_model(), ids)).max()) > 1e-3  # it is really quantized


def test_tokenizers_agree(made):
    """tokenizer.json (tokenizers), transformers from the directory and from the GGUF, and tinydet's
    SentencePiece tokenizer of the GGUF vocabulary: the same ids and text."""
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from tinydet.chat import render_chat
    from tinydet.formats import open_checkpoint

    hf_dir, ggufs = _hf_dir(made), made[1]
    raw = G.hf_tokenizer()
    at = AutoTokenizer.from_pretrained(hf_dir)
    gt = AutoTokenizer.from_pretrained(ggufs[None].parent, gguf_file=ggufs[None].name)
    ours = open_checkpoint(ggufs[None]).tokenizer
    assert (at.bos_token, at.eos_token, at.pad_token, at.unk_token) == ("<bos>", "<eos>", "<pad>", "<unk>")
    for t in TEXTS:
        ids = raw.encode(t).ids
        assert ids[:1] == [G.BOS_ID], t
        assert at.encode(t) == gt.encode(t) == ours.encode(t) == ids, t
        assert at.decode(ids, skip_special_tokens=True) == raw.decode(ids) == ours.decode(ids), t
    fallback = raw.encode("é😀").tokens
    assert fallback == ["<bos>", "<0xC3>", "<0xA9>", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "What is the capital of France?"}]
    chat = at.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat == ("<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
                    "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n")
    assert render_chat(ours.chat_template, messages, bos_token="<bos>") == chat
