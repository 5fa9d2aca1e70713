"""Tests of the tiny-Qwen2 generator itself (tests/qwen2gen.py), independent of tinydet: the files are
deterministic, the HF directory and the GGUF hold the same model (transformers reads both to the same
logits), and the GGUF has llama.cpp's qwen2 keys, tensor names, shapes and types."""

from __future__ import annotations

import numpy as np
import pytest

import qwen2gen as Q

gguf = pytest.importorskip("gguf")

TEXTS = [
    "Hello world", "The quick brown fox jumps over the lazy dog.", "12345 and 3.14159, 2024-03-15",
    "I'm sure you'll agree: we're here, they're THERE, she'd've", "line one\nline two\n\n\tindented  double  spaces   ",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "a<|endoftext|>b", '<tool_call>{"x": 1}</tool_call>',
    "<|im_start|", "café — naïve 😀 “quotes”", "   leading and trailing   ", "IT'S ALL CAPS'S", "",
]
PROMPT = [Q.token_id("<|im_start|>"), 5, 77, 300, 12, 480, 485, 220, 198, 9, 100, 250]

BASE_KEYS = {
    "general.architecture", "general.type", "general.name", "general.size_label", "general.file_type",
    "general.quantization_version",
    "qwen2.block_count", "qwen2.context_length", "qwen2.embedding_length", "qwen2.feed_forward_length",
    "qwen2.attention.head_count", "qwen2.attention.head_count_kv", "qwen2.rope.freq_base",
    "qwen2.attention.layer_norm_rms_epsilon",
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.bos_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token",
    "tokenizer.chat_template",
}


@pytest.fixture(scope="session")
def made(tmp_path_factory):
    """{tied: (hf_dir or None, {quant: gguf_path})}; the HF dirs only where transformers is installed."""
    out = tmp_path_factory.mktemp("qwen2gen")
    res = {}
    for tied in (False, True):
        stem = "tiny-qwen2" + ("-tied" if tied else "")
        ggufs = {qq: Q.write_gguf(out / f"{stem}-{Q.QUANTS[qq][0]}.gguf", quant=qq, tied=tied)
                 for qq in (None, "q8_0", "q4_0")}
        try:
            import torch  # noqa: F401
            import transformers  # noqa: F401
            hf_dir = Q.write_hf_dir(out / stem, tied=tied)
        except ImportError:
            hf_dir = None
        res[tied] = (hf_dir, ggufs)
    return res


def _hf_dir(made, tied):
    hf_dir = made[tied][0]
    if hf_dir is None:
        pytest.skip("torch/transformers are not installed")
    return hf_dir


def _fields(path):
    r = gguf.GGUFReader(path)
    return r, {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def _logits(model, ids=PROMPT):
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


# --- determinism ---------------------------------------------------------------------------------------

def test_writes_are_byte_identical(tmp_path, made):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        Q.write_gguf(d / "m.gguf")
        Q.write_gguf(d / "q.gguf", quant="q8_0", tied=True)
        if made[False][0] is not None:
            Q.write_hf_dir(d / "hf")
    da, db = Q.file_digests([a]), Q.file_digests([b])
    assert da and len(da) == len(db)
    assert {k.split("/", 1)[1]: v for k, v in da.items()} == {k.split("/", 1)[1]: v for k, v in db.items()}
    # ...and equal to the session's files made in another folder.
    assert Q.file_digests([a / "m.gguf"])["m.gguf"] == Q.file_digests([made[False][1][None]])["tiny-qwen2-F32.gguf"]


def test_weights_are_fixed_and_biases_random():
    sd = Q.state_dict()
    assert sd.keys() == Q.state_dict().keys() and all(np.array_equal(v, Q.state_dict()[k]) for k, v in sd.items())
    assert "lm_head.weight" not in Q.state_dict(tied=True)
    assert all(np.array_equal(v, sd[k]) for k, v in Q.state_dict(tied=True).items())  # tying moves nothing
    assert not np.array_equal(Q.state_dict(seed=1)["model.embed_tokens.weight"], sd["model.embed_tokens.weight"])
    assert all(v.dtype == np.float32 for v in sd.values())
    biases = [k for k in sd if k.endswith(".bias")]
    assert sorted(biases) == sorted(f"model.layers.{i}.self_attn.{p}_proj.bias" for i in range(Q.LAYERS)
                                    for p in "qkv")
    for k in biases:
        assert np.count_nonzero(sd[k]) == sd[k].size and 0.15 < float(sd[k].std()) < 0.6, k


# --- the GGUF -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("quant", [None, "q8_0", "q4_0"])
def test_gguf_keys_tensors_shapes_types(made, tied, quant):
    r, f = _fields(made[tied][1][quant])
    assert set(f) == BASE_KEYS
    assert r.alignment == 32
    assert f["general.architecture"] == "qwen2" and f["general.type"] == "model"
    assert f["general.file_type"] == int(gguf.LlamaFileType[Q.QUANTS[quant][1]])
    assert (f["qwen2.block_count"], f["qwen2.context_length"], f["qwen2.embedding_length"],
            f["qwen2.feed_forward_length"], f["qwen2.attention.head_count"],
            f["qwen2.attention.head_count_kv"]) == (Q.LAYERS, Q.CONTEXT, Q.HIDDEN, Q.FFN, Q.HEADS, Q.KV_HEADS)
    assert f["qwen2.rope.freq_base"] == Q.ROPE_THETA
    assert f["qwen2.attention.layer_norm_rms_epsilon"] == pytest.approx(Q.RMS_EPS)
    assert (f["tokenizer.ggml.model"], f["tokenizer.ggml.pre"]) == ("gpt2", "qwen2")
    eot, im_end = Q.token_id("<|endoftext|>"), Q.token_id("<|im_end|>")
    assert (f["tokenizer.ggml.bos_token_id"], f["tokenizer.ggml.eos_token_id"],
            f["tokenizer.ggml.padding_token_id"]) == (eot, im_end, eot)
    assert f["tokenizer.ggml.add_bos_token"] is False and f["tokenizer.ggml.add_eos_token"] is False
    assert f["tokenizer.chat_template"] == Q.CHAT_TEMPLATE

    kv = Q.KV_HEADS * Q.HEAD_DIM
    want = {"token_embd.weight": (Q.VOCAB, Q.HIDDEN), "output_norm.weight": (Q.HIDDEN,)}
    if not tied:
        want["output.weight"] = (Q.VOCAB, Q.HIDDEN)
    for i in range(Q.LAYERS):
        want |= {f"blk.{i}.attn_norm.weight": (Q.HIDDEN,), f"blk.{i}.ffn_norm.weight": (Q.HIDDEN,),
                 f"blk.{i}.attn_q.weight": (Q.HIDDEN, Q.HIDDEN), f"blk.{i}.attn_q.bias": (Q.HIDDEN,),
                 f"blk.{i}.attn_k.weight": (kv, Q.HIDDEN), f"blk.{i}.attn_k.bias": (kv,),
                 f"blk.{i}.attn_v.weight": (kv, Q.HIDDEN), f"blk.{i}.attn_v.bias": (kv,),
                 f"blk.{i}.attn_output.weight": (Q.HIDDEN, Q.HIDDEN),
                 f"blk.{i}.ffn_gate.weight": (Q.FFN, Q.HIDDEN), f"blk.{i}.ffn_up.weight": (Q.FFN, Q.HIDDEN),
                 f"blk.{i}.ffn_down.weight": (Q.HIDDEN, Q.FFN)}
    got = {t.name: t for t in r.tensors}
    assert set(got) == set(want)
    assert [t.name for t in r.tensors] == [Q.gguf_name(k) for k in sorted(Q.state_dict(tied))]  # converter order
    qtype = gguf.GGMLQuantizationType[Q.QUANTS[quant][0]]
    for name, shape in want.items():
        t = got[name]
        assert tuple(int(x) for x in reversed(t.shape)) == shape, name  # GGUF lists ne[0] (the row length) first
        assert t.tensor_type == (gguf.GGMLQuantizationType.F32 if len(shape) == 1 else qtype), name


def test_gguf_vocab_is_the_tokenizers(made):
    _, f = _fields(made[False][1][None])
    raw = Q.hf_tokenizer()
    tokens, types, merges = f["tokenizer.ggml.tokens"], f["tokenizer.ggml.token_type"], f["tokenizer.ggml.merges"]
    n = raw.get_vocab_size(with_added_tokens=True)
    assert len(tokens) == len(types) == Q.VOCAB > n
    assert tokens[:n] == [raw.id_to_token(i) for i in range(n)]
    assert tokens[n:] == [f"[PAD{i}]" for i in range(n, Q.VOCAB)]
    T = gguf.TokenType
    special = {Q.token_id(t) for t in Q.SPECIAL_TOKENS}
    plain = {Q.token_id(t) for t in Q.PLAIN_ADDED_TOKENS}
    assert all(types[i] == T.CONTROL for i in special) and all(types[i] == T.USER_DEFINED for i in plain)
    assert all(types[i] == T.NORMAL for i in range(n) if i not in special | plain)
    assert all(types[i] == T.UNUSED for i in range(n, Q.VOCAB))
    assert merges == Q.tokenizer_json()["model"]["merges"] and len(merges) == Q.N_MERGES


def test_gguf_holds_the_hf_dirs_tensors_unpermuted(made):
    """F32 GGUF tensors equal model.safetensors' bit for bit: Q/K rows in HF order (Qwen2 is NEOX RoPE;
    llama.cpp permutes only for the llama architecture)."""
    from safetensors.numpy import load_file

    for tied in (False, True):
        hf = load_file(_hf_dir(made, tied) / "model.safetensors")
        assert set(hf) == set(Q.state_dict(tied))
        r = gguf.GGUFReader(made[tied][1][None])
        g = {t.name: np.asarray(t.data) for t in r.tensors}
        for k, v in hf.items():
            assert v.dtype == np.float32 and np.array_equal(v, Q.state_dict(tied)[k]), k
            assert np.array_equal(g[Q.gguf_name(k)].reshape(v.shape), v), k


def test_hf_dir_files(made, tmp_path):
    import json

    from safetensors.numpy import save_file

    d = _hf_dir(made, False)
    # save_pretrained's safetensors are plain safetensors of state_dict(): no transformers version in them.
    save_file(Q.state_dict(), tmp_path / "np.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "np.safetensors").read_bytes() == (d / "model.safetensors").read_bytes()
    assert {p.name for p in d.iterdir()} == {"config.json", "generation_config.json", "model.safetensors",
                                             "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"}
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["tie_word_embeddings"] is False and cfg["use_sliding_window"] is False
    assert json.loads((_hf_dir(made, True) / "config.json").read_text())["tie_word_embeddings"] is True


# --- transformers reads both forms to the same model -----------------------------------------------------

@pytest.mark.parametrize("tied", [False, True])
def test_transformers_gguf_matches_hf_dir(made, tied):
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

    hf_dir, ggufs = _hf_dir(made, tied), made[tied][1]
    hf = Qwen2ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ref = _logits(hf)
    assert np.array_equal(ref, _logits(Q.hf_model(tied)))
    assert hf.config.tie_word_embeddings is tied
    g = AutoModelForCausalLM.from_pretrained(ggufs[None].parent, gguf_file=ggufs[None].name,
                                             dtype=torch.float32).eval()
    assert g.config.tie_word_embeddings is tied and g.config.vocab_size == Q.VOCAB
    assert float(np.abs(_logits(g) - ref).max()) <= 1e-6

    # The q/k/v biases matter: without them the logits move a lot.
    nb = Q.hf_model(tied)
    with torch.no_grad():
        for n, p in nb.named_parameters():
            if n.endswith("_proj.bias"):
                p.zero_()
    assert float(np.abs(_logits(nb) - ref).max()) > 1.0


@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
def test_transformers_quantized_gguf_matches_dequantized_weights(made, quant):
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM

    _hf_dir(made, False)
    p = made[False][1][quant]
    g = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32).eval()
    ref = Q.hf_model()
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in Q.dequantized_state_dict(quant).items()})
    lg, lr = _logits(g), _logits(ref.eval())
    assert float(np.abs(lg - lr).max()) <= 1e-5
    assert float(np.abs(lg - _logits(Q.hf_model())).max()) > 1e-3  # it is really quantized


def test_tokenizers_agree(made):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    hf_dir, ggufs = _hf_dir(made, False), made[False][1]
    raw = Q.hf_tokenizer()
    assert raw.to_str() == Tokenizer.from_file(str(hf_dir / "tokenizer.json")).to_str()
    at = AutoTokenizer.from_pretrained(hf_dir)
    gt = AutoTokenizer.from_pretrained(ggufs[None].parent, gguf_file=ggufs[None].name)
    assert (at.bos_token, at.eos_token, at.pad_token) == (None, "<|im_end|>", "<|endoftext|>")
    for t in TEXTS:
        ids = raw.encode(t, add_special_tokens=False).ids
        assert at.encode(t, add_special_tokens=False) == ids == at.encode(t), t  # no BOS/EOS added
        assert gt.encode(t, add_special_tokens=False) == ids, t
        assert at.decode(ids) == raw.decode(ids, skip_special_tokens=False)
    ids = raw.encode("<|im_start|>user\nHi<|im_end|>", add_special_tokens=False).ids
    assert ids[0] == Q.token_id("<|im_start|>") and ids[-1] == Q.token_id("<|im_end|>")
    chat = at.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


# --- Qwen3 ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3gen")
    ggufs = {q: Q.write_gguf(out / f"tiny-qwen3-{Q.QUANTS[q][0]}.gguf", quant=q, arch="qwen3") for q in (None, "q8_0")}
    return out, ggufs


def test_qwen3_weights_and_config():
    sd = Q.state_dict(arch="qwen3")
    assert not any(k.endswith(".bias") for k in sd)
    hd = Q.QWEN3_HEAD_DIM
    assert Q.HEADS * hd != Q.HIDDEN  # a head_dim of its own, not hidden / heads
    for i in range(Q.LAYERS):
        p = f"model.layers.{i}.self_attn."
        assert sd[p + "q_proj.weight"].shape == (Q.HEADS * hd, Q.HIDDEN)
        assert sd[p + "o_proj.weight"].shape == (Q.HIDDEN, Q.HEADS * hd)
        assert sd[p + "q_norm.weight"].shape == sd[p + "k_norm.weight"].shape == (hd,)
    cfg = Q.config_json(arch="qwen3")
    assert (cfg["model_type"], cfg["architectures"], cfg["head_dim"], cfg["attention_bias"]) == (
        "qwen3", ["Qwen3ForCausalLM"], hd, False)
    assert {k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "head_dim", "attention_bias")} == {
        k: v for k, v in Q.config_json().items() if k not in ("model_type", "architectures")}


def test_qwen3_gguf_keys_and_tensors(qwen3):
    _, ggufs = qwen3
    r, f = _fields(ggufs[None])
    q2 = {k.replace("qwen2.", "qwen3."): v for k, v in _fields(Q.write_gguf(qwen3[0] / "q2.gguf"))[1].items()}
    assert set(f) == set(q2) | {"qwen3.attention.key_length", "qwen3.attention.value_length"}
    assert f["general.architecture"] == "qwen3"
    assert f["qwen3.attention.key_length"] == f["qwen3.attention.value_length"] == Q.QWEN3_HEAD_DIM
    names = {t.name: tuple(int(x) for x in reversed(t.shape)) for t in r.tensors}
    for i in range(Q.LAYERS):
        assert names[f"blk.{i}.attn_q_norm.weight"] == names[f"blk.{i}.attn_k_norm.weight"] == (Q.QWEN3_HEAD_DIM,)
        assert names[f"blk.{i}.attn_q.weight"] == (Q.HEADS * Q.QWEN3_HEAD_DIM, Q.HIDDEN)
        assert f"blk.{i}.attn_q.bias" not in names
    assert [t.name for t in r.tensors] == [Q.gguf_name(k) for k in sorted(Q.state_dict(arch="qwen3"))]


def test_qwen3_transformers_reads_the_gguf_as_the_hf_model(qwen3):
    """transformers' own GGUF loader (it knows `qwen3`) gives the logits of the Qwen3ForCausalLM holding
    state_dict(arch="qwen3"): tensor names, shapes and the QK-norm tensors are llama.cpp's. (That loader
    does not read attention.key_length, so head_dim is passed to it; the key itself is checked above.)"""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM

    _, ggufs = qwen3
    ref = _logits(Q.hf_model(arch="qwen3"))
    g = AutoModelForCausalLM.from_pretrained(ggufs[None].parent, gguf_file=ggufs[None].name, dtype=torch.float32,
                                             head_dim=Q.QWEN3_HEAD_DIM).eval()
    assert type(g).__name__ == "Qwen3ForCausalLM" and g.config.head_dim == Q.QWEN3_HEAD_DIM
    assert float(np.abs(_logits(g) - ref).max()) <= 1e-6
    nn = Q.hf_model(arch="qwen3")
    with torch.no_grad():
        for n, p in nn.named_parameters():
            if n.endswith(("q_norm.weight", "k_norm.weight")):
                p.fill_(1.0)
    assert float(np.abs(_logits(nn) - ref).max()) > 0.05  # the QK-norm weights matter
