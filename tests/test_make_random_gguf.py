"""bench/make_random_gguf.py and bench/quantize.py: the K-quant quantizers against the `gguf` package's
dequantization (independent of both the quantizer and tinydet), the storage types against llama.cpp's
llama-quantize rules (written out here by hand), and the tiny shape's files read by tinydet with the
same values, bit for bit, as the `gguf` package reads them."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from benchmods import bench_module
from gguf import GGMLQuantizationType, GGUFReader

mk = bench_module("make_random_gguf")
quantize = bench_module("quantize").quantize



def _dequant(blocks: np.ndarray, type_name: str) -> np.ndarray:
    return gguf.quants.dequantize(blocks, GGMLQuantizationType[type_name])


def _inputs() -> np.ndarray:
    """Rows of 512 (two super-blocks each) that reach the rule's corners: Gaussian at several scales,
    all-zero, all-negative, all-positive, one outlier, a constant, sub-blocks of very different ranges."""
    rng = np.random.default_rng(7)
    rows = [rng.standard_normal(512).astype(np.float32) * np.float32(s) for s in (0.02, 1.0, 300.0)]
    rows += [np.zeros(512, np.float32), -np.abs(rows[0]), np.abs(rows[1]), np.full(512, 0.5, np.float32)]
    spike = rows[0].copy()
    spike[100] = 5.0
    mixed = rows[1].copy()
    mixed[:32] *= 1e-3  # a quiet sub-block beside loud ones
    return np.stack(rows + [spike, mixed])


def _f16(x):
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def test_q4_k_within_its_bound():
    x = _inputs()
    y = _dequant(quantize(x, "Q4_K"), "Q4_K")
    assert y.shape == x.shape
    s = x.reshape(-1, 8, 32).astype(np.float64)
    lo = np.minimum(s.min(axis=2), 0)
    scale = (s.max(axis=2) - lo) / 15  # the step a sub-block needs
    d = scale.max(axis=1, keepdims=True) / 63 * (1 + 2**-10)  # fp16 rounding of d, dmin
    dmin = -lo.min(axis=1, keepdims=True) / 63 * (1 + 2**-10)
    # the step is the scale rounded up to a multiple of d; the min is off by at most dmin / 2
    bound = 0.5 * (scale + d) + 0.5 * dmin + 1e-6 * np.abs(s).max(axis=2)
    err = np.abs(y.reshape(s.shape) - s)
    assert np.all(err <= bound[..., None]), float((err - bound[..., None]).max())
    assert np.array_equal(y[3], x[3])  # zeros stay zeros
    g = x[:3]
    assert np.sqrt(((y[:3] - g) ** 2).mean(axis=1) / (g ** 2).mean(axis=1)).max() < 0.1  # 4 bits on Gaussians


def test_q6_k_within_its_bound():
    x = _inputs()
    y = _dequant(quantize(x, "Q6_K"), "Q6_K")
    s = x.reshape(-1, 16, 16).astype(np.float64)
    scale = np.abs(s).max(axis=2) / 31
    d = scale.max(axis=1, keepdims=True) / 127 * (1 + 2**-10)
    bound = 0.5 * (scale + d) + 1e-6 * np.abs(s).max(axis=2)
    err = np.abs(y.reshape(s.shape) - s)
    assert np.all(err <= bound[..., None]), float((err - bound[..., None]).max())
    assert np.array_equal(y[3], x[3])
    g = x[:3]
    assert np.sqrt(((y[:3] - g) ** 2).mean(axis=1) / (g ** 2).mean(axis=1)).max() < 0.025


def test_k_quants_need_whole_super_blocks():
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(np.zeros((2, 96), np.float32), "Q4_K")


def _types(shape: str, ftype: str, pure: bool = False) -> dict[str, str]:
    return {name: t for name, _, t in mk.tensors(mk.SHAPES[shape], 49152, ftype, pure)}


# Layers whose attn_v and ffn_down llama.cpp's Q4_K_M stores as Q6_K (use_more_bits), by hand:
# the first and last eighth of the layers, and every third layer from n/8 + 2.
MORE_BITS = {16: {0, 1, 4, 7, 10, 13, 14, 15}, 32: {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31}}


@pytest.mark.parametrize("shape", ["llama-1b", "llama-8b"])
def test_types_follow_llama_quantize(shape):
    s = mk.SHAPES[shape]
    km = _types(shape, "Q4_K_M")
    assert "output.weight" not in km if s.tied else km["output.weight"] == "Q6_K"
    assert km["token_embd.weight"] == ("Q6_K" if s.tied else "Q4_K")  # tied: quantized as the output
    for i in range(s.layers):
        more = "Q6_K" if i in MORE_BITS[s.layers] else "Q4_K"
        assert km[f"blk.{i}.attn_v.weight"] == more and km[f"blk.{i}.ffn_down.weight"] == more, i
        for part in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert km[f"blk.{i}.{part}.weight"] == "Q4_K"
        assert km[f"blk.{i}.attn_norm.weight"] == km[f"blk.{i}.ffn_norm.weight"] == "F32"
    q4 = _types(shape, "Q4_0")
    big = "token_embd.weight" if s.tied else "output.weight"
    assert q4[big] == "Q6_K" and q4["token_embd.weight"] == ("Q6_K" if s.tied else "Q4_0")
    assert {t for n, t in q4.items() if n.startswith("blk.") and "norm" not in n} == {"Q4_0"}
    for ftype, base in (("Q8_0", "Q8_0"), ("F16", "F16")):
        assert {t for n, t in _types(shape, ftype).items() if "norm" not in n and "rope" not in n} == {base}
    for ftype, base in (("Q4_0", "Q4_0"), ("Q4_K_M", "Q4_K")):
        assert {t for n, t in _types(shape, ftype, pure=True).items() if "norm" not in n and "rope" not in n} == {base}


def test_real_shapes():
    b1, b8 = mk.SHAPES["llama-1b"], mk.SHAPES["llama-8b"]
    n1 = sum(int(np.prod(rc)) for _, rc, _ in mk.tensors(b1, 49152, "F16", False))
    n8 = sum(int(np.prod(rc)) for _, rc, _ in mk.tensors(b8, 49152, "F16", False))
    # Llama-3.2-1B has 1,235,814,400 parameters with 128,256 tokens (tied), Llama-3.1-8B 8,030,261,248
    # (untied): less the tokens SmolLM2's vocabulary lacks, plus rope_freqs (head_dim / 2 values)
    assert n1 == 1_235_814_400 - (128256 - 49152) * 2048 + 32
    assert n8 == 8_030_261_248 - 2 * (128256 - 49152) * 4096 + 64
    assert mk.rope_factors(b1)[0] == 1.0 and mk.rope_factors(b1)[-1] == 32.0
    assert mk.rope_factors(b8)[-1] == 8.0 and len(mk.rope_factors(b8)) == 64


def test_moe_shape_is_qwen3_30b_a3b():
    """Qwen3-30B-A3B has 30,532,122,624 parameters with its 151,936 tokens (untied): less the tokens
    SmolLM2's vocabulary lacks, in the embedding and the output. The routers stay F32, the experts take
    the file's type."""
    s = mk.SHAPES["qwen3moe-30b-a3b"]
    n = sum(int(np.prod(rc)) for _, rc, _ in mk.tensors(s, 49152, "F16", False))
    assert n == 30_532_122_624 - 2 * (151936 - 49152) * 2048
    q4 = _types("qwen3moe-30b-a3b", "Q4_0")
    assert q4["blk.0.ffn_gate_inp.weight"] == "F32" and q4["blk.47.ffn_down_exps.weight"] == "Q4_0"


def test_gpt_oss_shape_is_gpt_oss_20b():
    """gpt-oss-20b has 20,914,757,184 parameters with its 201,088 tokens (untied; the count it is
    published with, and transformers' for GptOssConfig with 24 layers and 32 experts): less the tokens
    SmolLM2's vocabulary lacks. Experts MXFP4, other matrices Q8_0, routers and vectors F32."""
    s = mk.SHAPES["gpt-oss-20b"]
    n = sum(int(np.prod(rc)) for _, rc, _ in mk.tensors(s, 49152, "MXFP4", False))
    assert n == 20_914_757_184 - 2 * (201088 - 49152) * 2880
    t = _types("gpt-oss-20b", "MXFP4")
    assert (t["blk.0.ffn_gate_exps.weight"], t["blk.23.ffn_down_exps.weight"], t["blk.0.attn_q.weight"],
            t["blk.0.ffn_gate_inp.weight"], t["blk.0.ffn_up_exps.bias"], t["output.weight"]) == (
        "MXFP4", "MXFP4", "Q8_0", "F32", "F32", "Q8_0")


def test_tiny_gpt_oss_file_reads_as_gpt_oss(tmp_path, stories_path):
    """tinydet reads the gpt-oss shape's file as llama.cpp's gpt-oss: sinks, biases, alternating
    windows, YaRN from its keys, the experts kept as MXFP4 blocks natively. (Running a gpt-oss is
    test_gptoss's: not compiled again here.)"""
    import tinydet

    path = tmp_path / "gpt-oss.gguf"
    mk.write(path, "gpt-oss-tiny", "MXFP4", 0, False, mk.tokenizer_fields(stories_path), log=lambda *a: None)
    native = tinydet.load(path, dtype="native")
    c = native.config
    assert (c.arch, c.n_experts, c.n_experts_used, c.moe_gating, c.attn_sinks, c.moe_bias) == (
        "gptoss", 8, 2, "softmax_topk", True, True)
    assert c.layer_windows == (128, 0) and (c.rope.scaling, c.rope.factor, c.rope.original_context) == (
        "yarn", 32.0, 4096)
    st = native.backend.storage()
    assert (st["w13e"], st["w2e"], st["router"], st["wqkv"]) == ("MXFP4", "MXFP4", "f32", "Q8_0")


def test_tiny_moe_file_reads_as_a_mixture(tmp_path, stories_path):
    """tinydet reads the MoE shape's file as llama.cpp's qwen3moe: the experts' settings from its keys,
    every expert's matrices kept as the file's Q4_0 blocks natively, the routers F32. (Native storage
    giving fp32's bits on a mixture is test_moe's, on Q8_0 and MXFP4 experts: not compiled again here.)"""
    import tinydet

    path = tmp_path / "moe.gguf"
    mk.write(path, "qwen3moe-tiny", "Q4_0", 0, True, mk.tokenizer_fields(stories_path), log=lambda *a: None)
    native = tinydet.load(path, dtype="native")
    s = mk.SHAPES["qwen3moe-tiny"]
    c = native.config
    assert (c.arch, c.n_experts, c.n_experts_used, c.ffn_dim, c.moe_norm_topk) == ("qwen3moe", 8, 2, s.ffn, True)
    st = native.backend.storage()
    assert (st["w13e"], st["w2e"], st["router"]) == ("Q4_0", "Q4_0", "f32")


def test_tokenizer_is_smollm2s(smollm_path):
    tok = {name: value for name, value, *_ in mk.tokenizer_fields(smollm_path)}
    assert len(tok["tokenizer.ggml.tokens"]) == len(tok["tokenizer.ggml.token_type"]) == 49152
    assert tok["tokenizer.ggml.model"] == "gpt2" and len(tok["tokenizer.ggml.merges"]) > 40000
    assert "tokenizer.chat_template" in tok and all(k.startswith("tokenizer.") for k in tok)


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory, stories_path):
    """The tiny shape in every type, with stories260K's 512-token tokenizer (SmolLM2's 49,152 tokens
    take seconds to parse per file: kept out of these tests)."""
    out = tmp_path_factory.mktemp("random_gguf")
    tok = mk.tokenizer_fields(stories_path)
    files = {}
    for t in mk.FILE_TYPES:
        files[t] = out / f"tiny.{t}.gguf"
        mk.write(files[t], "tiny", t, 0, False, tok, log=lambda *a: None)
    return files, tok


@pytest.mark.parametrize("ftype", list(mk.FILE_TYPES))
def test_tiny_file_reads_the_same_in_tinydet(tiny_files, ftype):
    """tinydet reads every tensor with the values the gguf package reads (bit for bit), the config is the
    shape's, the types are the plan's, and the weights have the intended statistics."""
    from tinydet.formats.checkpoint import Tensor
    from tinydet.formats.gguf import GGUFFile
    from tinydet.formats.gguf_model import open_gguf

    files, _ = tiny_files
    path = files[ftype]
    assert not path.with_name(path.name + ".part").exists()
    s = mk.SHAPES["tiny"]
    ck = open_gguf(path)
    c = ck.config
    assert (c.arch, c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.vocab_size) == \
        ("llama", s.dim, s.layers, s.heads, s.kv_heads, s.head_dim, s.ffn, 512)
    assert ck.tokenizer.vocab_size == 512 and c.rope.base == s.rope_theta
    assert (c.rope.scaling, c.rope.factor) == ("llama3", s.rope_factor)  # rope_freqs as Llama 3's own
    plan = {n: (rc, t) for n, rc, t in mk.tensors(s, 512, ftype, False)}
    r = GGUFReader(path)
    g = GGUFFile(path)
    assert [t.name for t in r.tensors] == list(plan)
    for t in r.tensors:
        rc, typ = plan[t.name]
        assert t.tensor_type.name == typ, t.name
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(rc)
        info = g.tensors[t.name]
        mine = Tensor(g.tensor_bytes(t.name), info.ggml_type, info.shape).float32()
        assert mine.dtype == np.float32 and np.array_equal(mine.view(np.uint32), ref.astype(np.float32).view(np.uint32))
        if "norm" in t.name:
            assert np.all(ref == 1.0)
        elif t.name != "rope_freqs.weight":
            assert abs(ref.mean()) < 2e-3 and 0.018 < ref.std() < 0.022, (t.name, ref.mean(), ref.std())


def test_same_weights_in_every_type(tiny_files):
    """A tensor's values depend on the seed and its name, not on the type: the Q8_0 file's are the F16
    file's within Q8_0's error."""
    files, _ = tiny_files
    a = {t.name: t for t in GGUFReader(files["F16"]).tensors}
    b = {t.name: t for t in GGUFReader(files["Q8_0"]).tensors}
    for name in ("token_embd.weight", "blk.1.ffn_down.weight"):
        x = gguf.quants.dequantize(a[name].data, a[name].tensor_type)
        y = gguf.quants.dequantize(b[name].data, b[name].tensor_type)
        assert np.abs(x - y).max() < 0.02 * 4.5 / 127  # half a Q8_0 step of a 4.5-sigma block, and more


def test_bytes_are_deterministic(tiny_files, tmp_path):
    files, tok = tiny_files
    again, other = tmp_path / "again.gguf", tmp_path / "other.gguf"
    mk.write(again, "tiny", "Q4_0", 0, False, tok, log=lambda *a: None)
    mk.write(other, "tiny", "Q4_0", 1, False, tok, log=lambda *a: None)
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()
    assert digest(again) == digest(files["Q4_0"]) != digest(other)
