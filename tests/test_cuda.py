"""The GPU backend (tinydet/backends/cupy), checked on a machine without a GPU.

1. Its kernels' arithmetic: kernels.cu built by the host's C++ compiler into the serial emulator
   (`--device cuda-host`; TINYDET_TEST_DEVICE=cuda runs this section on a real GPU instead, as
   tools/gpu_check.sh does) must give the CPU backend's bits: the matrix product and the embedding for
   every storage type (special and non-finite scales included), the int8 mode's integer products of
   every integer type, and whole models: every architecture's tiny checkpoint, fp32/fp16/native/int8,
   whole and chunked prefill, decode, batches, traces, the golden hashes of stories260K, and `verify`.
   A native product's CPU bits are those of the float32 matrix (test_native.py proves it for every
   type, non-finite scales included), so the product of the dequantized matrix on float32 panels is
   the reference here: one CPU compile for every type instead of one per type (about 40 s each).
2. NVRTC's code for it (the cuda-bindings and nvidia-cuda-nvrtc-cu12 wheels compile to PTX with no GPU):
   every kernel is there, with no fused multiply-add, no approximate or flush-to-zero instruction and
   every float add, subtract, multiply and divide rounded to nearest (`.rn`); the lint is shown to fail
   on code that breaks each rule.
3. The errors a user meets without CuPy or a GPU.
What only a GPU can check (NVRTC's code running there, speed) is tools/gpu_check.sh.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import types

import numpy as np
import pytest
from click.testing import CliRunner

import tinydet
from contract import bits
from test_native import NATIVE, random_blocks
from test_native_model import PLANS, requantized
from tinydet.backends import open_device
from test_intdot import tricky_rows
from test_intmixed import q4_k_m  # noqa: F401 (a fixture)
from tinydet.packing import intpanels, layout
from tinydet.backends.cpu.loaders import embed as cpu_embed
from tinydet.backends.cpu.matmul import matmul as cpu_matmul
from tinydet.backends.cpu.ops import rmsnorm as cpu_rmsnorm
from tinydet.backends.cpu.storage.kinds import as_storage
from tinydet.numerics.simd import to_f16_bits
from tinydet.backends.cupy import HostDevice, embed, product
from tinydet.backends.cupy import device as D
from tinydet.backends.cupy import products as cupy_products
from tinydet.cli import main
from tinydet.errors import TinydetError
from tinydet.formats.dequant import dequantize
from tinydet.formats.ggml import GGML_TYPE_IDS
from tinydet.tools.golden import check_golden, model_loader, read_golden
from tinydet.tools.trace import diff_traces, run_trace, write_trace

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play"
DEVICE = os.environ.get("TINYDET_TEST_DEVICE", "cuda-host")  # the device section 1 runs on


@pytest.fixture(scope="module")
def dev():
    return open_device(DEVICE)


def same(got, want, what=""):
    """Bit for bit; NaN payloads aside (the CPU does not promise them either)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, what
    gn, wn = np.isnan(got), np.isnan(want)
    assert np.array_equal(gn, wn), f"{what}: NaN positions differ"
    diff = (bits(got) != bits(want)) & ~gn
    assert not diff.any(), f"{what}: {int(diff.sum())} of {diff.size} differ, max {np.nanmax(np.abs(got - want))}"


# ---------------------------------------------------------------------------------------------------
# 1. The kernels against the CPU backend.

def reference_product(x, w, n):
    """The CPU's bits of x W^T (n outputs) for float panels, or for a native storage's dequantized
    matrix (n, k) float32: its products' bits are the float32 matrix's (module docstring)."""
    if w.ndim == 2:
        w = layout.pack_panels(w)
    out = np.full((x.shape[0], n), np.nan, np.float32)
    cpu_matmul(x, w, n, out)
    return out


def dequantized(name, raw, n, k):
    return dequantize(raw, GGML_TYPE_IDS[name], (n, k))


@pytest.fixture(params=["gemv", "gemm"])
def mm_path(request, monkeypatch):
    """Each product both ways (cupy.GEMV_ROWS): gemv, every (output, k-block) chain of a block's outputs
    at once, then the Kahan steps (what a few rows take; here any number of rows, in groups of
    VROWS), or gemm's tiles (what many rows take; here any number)."""
    monkeypatch.setattr(cupy_products, "GEMV_ROWS", 10**6 if request.param == "gemv" else 0)
    return request.param


@pytest.mark.parametrize("rows", [1, 3, 9])
@pytest.mark.parametrize("name", NATIVE + ["f32", "f16"])
def test_product_every_storage_type(dev, name, rows, mm_path):
    rng = np.random.default_rng(rows)
    n, k = (100, 512) if name in ("Q4_K", "Q5_K", "Q6_K") else (100, 160)  # a partial last panel; K % 64 != 0
    x = (rng.standard_normal((rows, k)) * np.exp2(rng.integers(-8, 8, (rows, 1)))).astype(np.float32)
    if name in ("f32", "f16"):
        w = rng.standard_normal((n, k)).astype(np.float32)
        w = layout.pack_panels(w if name == "f32" else to_f16_bits(w))
    else:
        # one seed for every row count: the same blocks (non-finite scales included) at 1, 3 and 9 rows
        raw = random_blocks(name, n, k, seed=3, nonfinite=True)
        w = layout.pack_quantized(raw.reshape(-1), GGML_TYPE_IDS[name], k)
    want = reference_product(x, w if name in ("f32", "f16") else dequantized(name, raw, n, k), n)
    same(product(dev, x, w, n), want, name)


@pytest.mark.parametrize("rows", [1, 9])
@pytest.mark.parametrize("name", ["Q4_0", "Q6_K", "f16"])
def test_product_fused_steps(dev, name, rows, mm_path):
    """The steps fused into a product keep the CPU's operations: RMSNorm of x (its 1 / rms computed in
    the product's own blocks by gemv), the bias added, and the product added to a residual."""
    rng = np.random.default_rng(rows)
    n, k = 100, 512 if name == "Q6_K" else 320  # gemv's RMSNorm stages rows 256 at a time: 2 and 1.25 rounds
    x = (rng.standard_normal((rows, k)) * 3).astype(np.float32)
    nw = rng.standard_normal(k).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    resid = rng.standard_normal((rows, n)).astype(np.float32)
    if name == "f16":
        w = ref = layout.pack_panels(to_f16_bits(rng.standard_normal((n, k)).astype(np.float32)))
    else:
        raw = random_blocks(name, n, k, seed=rows)
        w, ref = layout.pack_quantized(raw.reshape(-1), GGML_TYPE_IDS[name], k), dequantized(name, raw, n, k)
    h = np.empty_like(x)
    cpu_rmsnorm(x, nw, np.float32(1e-5), h)
    prod = reference_product(h, ref, n)
    same(product(dev, x, w, n, norm=(nw, 1e-5)), prod, "RMSNorm fused")
    same(product(dev, x, w, n, norm=(nw, 1e-5), bias=bias), prod + bias, "with the bias")
    plain = reference_product(x, ref, n)
    same(product(dev, x, w, n, out=resid), resid + plain, "added to a residual")
    assert not np.array_equal(bits(prod), bits(plain))


def test_product_quieted_scales_and_mixed_storage(dev, mm_path):
    """A signaling NaN scale (stored quieted, `layout`), and a kind of mixed types (MixedPanels)."""
    rng = np.random.default_rng(5)
    raw = random_blocks("Q4_1", 64, 128, seed=3).reshape(64, -1)
    raw[0, 0:2] = np.array([0x7C01], "<u2").view(np.uint8)  # a signaling NaN scale
    qp = layout.pack_quantized(raw.reshape(-1), layout.Q4_1, 128)
    assert qp.d[0, 0, 0] == 0x7E01
    x = rng.standard_normal((4, 128)).astype(np.float32)
    same(product(dev, x, qp, 64), reference_product(x, dequantized("Q4_1", raw, 64, 128), 64), "quieted scale")

    parts = [("Q8_0", 64), ("Q4_0", 128), ("f32", 64)]

    def matrix(key, n, seed):
        if key == "f32":
            return np.random.default_rng(seed).standard_normal((n, 128)).astype(np.float32)
        return dequantized(key, random_blocks(key, n, 128, seed), n, 128)

    def make(key, n, seed):
        if key == "f32":
            return lambda: layout.pack_panels(matrix(key, n, seed))
        tid = GGML_TYPE_IDS[key]
        return lambda: layout.pack_parts([(random_blocks(key, n, 128, seed), None, tid)], tid, 128)

    mixed = layout.pack_mixed([[(GGML_TYPE_IDS.get(k, k), n, make(k, n, i + 10 * li)) for i, (k, n) in enumerate(parts)]
                               for li in range(2)], 128)
    assert isinstance(mixed, layout.MixedPanels)
    for li in range(2):  # each run's float32 product on its own, side by side
        want = []
        for i, (key, n) in enumerate(parts):
            want.append(reference_product(x, matrix(key, n, i + 10 * li), n))
        same(product(dev, x, mixed, 256, layer=li), np.concatenate(want, axis=1), f"mixed layer {li}")


INT_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "MXFP4", "Q4_K", "Q5_K", "Q6_K"]


def int_panels(name, n, k, seed, nonfinite=False):
    return intpanels.from_qpanels(layout.pack_quantized(random_blocks(name, n, k, seed=seed, nonfinite=nonfinite)
                                                        .reshape(-1), GGML_TYPE_IDS[name], k))


def int_rows(rows, k, seed, tricky=True):
    """actq's edge cases (test_intdot.tricky_rows; else normals of a random scale per row), and with 9
    rows or more a NaN block and an infinite one (their rows' outputs NaN), beside ordinary rows of
    other magnitudes."""
    rng = np.random.default_rng(seed)
    if tricky:
        x = tricky_rows(rng, rows, k)
    else:
        x = (rng.standard_normal((rows, k)) * np.exp2(rng.integers(-8, 8, (rows, 1)))).astype(np.float32)
    if rows >= 9:
        x[1, 40] = np.nan
        x[2, k - 3] = -np.inf
    if rows >= 4:
        x[3] = rng.standard_normal(k).astype(np.float32) * np.float32(1e-3)
    return x


@pytest.mark.parametrize("rows", [1, 3, 9])
@pytest.mark.parametrize("name", INT_TYPES)
def test_int8_product_every_type(dev, name, rows):
    """dtype "int8": the integer products (kernels.cu act_quant, imm_*) give the CPU's bits, non-finite
    scales and activation blocks included; 32-blocks over more than a chunk of blocks (ICHUNK) ending in
    half a 64-block, super-blocks over more than a chunk; two groups of rows (IROWS); threads and blocks
    run in reverse the same."""
    kq = name in ("Q4_K", "Q5_K", "Q6_K")
    for n, k, nonfinite in (((100, 512, True), (70, 8448, False)) if kq else ((100, 160, True), (100, 1120, False))):
        w = int_panels(name, n, k, rows, nonfinite=nonfinite)
        x = int_rows(rows, k, rows, tricky=nonfinite)
        want = np.full((rows, n), np.nan, np.float32)
        cpu_matmul(x, w, n, want)
        assert np.isfinite(want).sum() > want.size // 5
        same(product(dev, x, w, n), want, f"{name} K={k}")
        if rows == 9 and DEVICE == "cuda-host":
            same(product(HostDevice(reverse=True), x, w, n), want, f"{name} K={k} in reverse")


@pytest.mark.parametrize("tn", [8, 16, 32])
@pytest.mark.parametrize("name", ["Q4_0", "Q4_K"])
def test_int8_outputs_per_block(dev, monkeypatch, name, tn):
    """imm's outputs per block (tn: 32, or 16 and 8 where a matrix has few outputs) change no bit, a
    block's outputs ending inside a panel included (100 outputs)."""
    from tinydet.backends.cupy import intproducts

    monkeypatch.setattr(intproducts, "out_per_block", lambda n: tn)
    n, k = (100, 512)
    for rows in (1, 9):
        w = int_panels(name, n, k, rows)
        x = int_rows(rows, k, rows)
        want = np.full((rows, n), np.nan, np.float32)
        cpu_matmul(x, w, n, want)
        same(product(dev, x, w, n), want, f"{name} tn={tn} rows={rows}")


def test_int8_outputs_per_block_policy():
    from tinydet.backends.cupy.intproducts import out_per_block

    # halved while under 264 blocks: a 1B model's wo / w2 (2048 outputs), k / v (512) and a 4096-output
    # matrix (256 blocks at 16) take 8; 8448 (264 blocks at 32), w13 (16384) and the vocabulary keep 32
    assert [out_per_block(n) for n in (100, 512, 2048, 4096, 8448, 16384, 128256)] == [8, 8, 8, 8, 32, 32, 32]
    assert out_per_block(4224) == 16  # 132 blocks at 32, 264 at 16


@pytest.mark.parametrize("rows", [1, 9])
@pytest.mark.parametrize("name", ["Q4_1", "Q6_K"])
def test_int8_product_fused_steps(dev, name, rows):
    """RMSNorm normalized as the quantization loads x (the CPU quantizes RMSNorm's output), the bias and
    a residual add in the integer products' epilogues."""
    rng = np.random.default_rng(rows)
    n, k = 100, 512
    x = (rng.standard_normal((rows, k)) * 3).astype(np.float32)
    nw = rng.standard_normal(k).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    resid = rng.standard_normal((rows, n)).astype(np.float32)
    w = int_panels(name, n, k, rows)
    h = np.empty_like(x)
    cpu_rmsnorm(x, nw, np.float32(1e-5), h)
    prod = np.full((rows, n), np.nan, np.float32)
    cpu_matmul(h, w, n, prod)
    same(product(dev, x, w, n, norm=(nw, 1e-5)), prod, "RMSNorm fused")
    same(product(dev, x, w, n, norm=(nw, 1e-5), bias=bias), prod + bias, "with the bias")
    plain = np.full((rows, n), np.nan, np.float32)
    cpu_matmul(x, w, n, plain)
    same(product(dev, x, w, n, out=resid), resid + plain, "added to a residual")


@pytest.mark.parametrize("mix", ["Q4_K+Q8_0+f16+f32"])
def test_int8_mixed_kinds(dev, mix, mm_path):
    """A kind of mixed types in the integer mode (MixedPanels of IntPanels and float parts): both block
    sizes' quants made once, each integer segment by its kernel, float segments by gemv / gemm."""
    from test_intmixed import MIXES, _mixed_mm, segment
    from tinydet.backends.cpu.matmul import MM_PLAIN
    from tinydet.backends.cpu.ops import SILU
    from tinydet.packing.weights import _integer

    k, plan = MIXES[mix]
    segs = [[segment(name, rows, k, seed=10 * li + s) for s, (name, rows) in enumerate(layer)]
            for li, layer in enumerate(plan)]
    mp = _integer(layout.pack_mixed([[seg for seg, _ in layer] for layer in segs], k))
    st = as_storage(mp)
    for li in range(len(plan)):
        for T in (1, 9):
            x = int_rows(T, k, li)
            want = np.full((T, mp.n), np.nan, np.float32)
            _mixed_mm(x, st, li, mp.n, want, 1, MM_PLAIN, want, SILU)
            same(product(dev, x, mp, mp.n, layer=li), want, f"{mix} layer {li} T={T}")


@pytest.mark.parametrize("name", NATIVE + ["f32", "f16", "rows_f32", "rows_f16"])
def test_embed_every_storage_type(dev, name):
    n, k = (70, 256) if name in ("Q4_K", "Q5_K", "Q6_K") else (70, 96)
    rng = np.random.default_rng(1)
    if name in NATIVE:
        w = layout.pack_quantized(random_blocks(name, n, k, seed=2, nonfinite=True).reshape(-1), GGML_TYPE_IDS[name], k)
    else:
        w = rng.standard_normal((n, k)).astype(np.float32)
        w = w if "f32" in name else to_f16_bits(w)
        w = w if name.startswith("rows") else layout.pack_panels(w)
    ids = np.array([0, 69, 31, 32, 5, 5], np.int64)
    want = np.full((ids.shape[0], k), np.nan, np.float32)
    cpu_embed(w, ids, want)
    same(embed(dev, w, ids, k), want, name)


def cpu_and_gpu(path, dtype):
    """The CPU model whose bits the GPU's must give, and the GPU's. Native storage gives fp32's bits on
    the CPU (test_native*.py), so its GPU model is held to the CPU's fp32 one: one CPU compile serves
    every quantized type's GPU kernels, not one per type and per mix of types."""
    cpu = tinydet.load(path, dtype="fp32" if dtype == "native" else dtype, threads=2)
    return cpu, tinydet.load(path, dtype=dtype, device=DEVICE)


def check_same_logits(cpu, gpu, ids, chunks=(1, 5)):
    """Every position's logits (one pass, and prefill in chunks), then decode steps, bit for bit."""
    want = cpu.logits(ids)
    same(gpu.logits(ids), want, "one pass")
    for chunk in chunks:
        cache = gpu.backend.new_cache(len(ids) + 4)
        rows = [gpu.backend.forward(ids[i:i + chunk], cache, all_logits=True) for i in range(0, len(ids), chunk)]
        same(np.concatenate(rows), want, f"chunks of {chunk}")
    caches = [m.backend.new_cache(len(ids) + 4) for m in (cpu, gpu)]
    outs = [m.backend.forward(ids, c) for m, c in zip((cpu, gpu), caches)]
    for tok in (3, 7, 11):
        outs = [m.backend.forward([tok], c) for m, c in zip((cpu, gpu), caches)]
        same(outs[1], outs[0], "decode")


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "native"])
def test_stories_logits_generate_and_batch(stories_path, dtype, mm_path):
    cpu, gpu = cpu_and_gpu(stories_path, dtype)
    ids = cpu.tokenize(PROMPT)
    check_same_logits(cpu, gpu, ids)
    reqs = [dict(prompt=p, max_tokens=20 + 3 * i, temperature=0.8 * (i % 2), seed=i)
            for i, p in enumerate([PROMPT, "The dog", "", "Lily and Ben"])]
    solo = [cpu.generate(**r) for r in reqs]
    for max_batch, step_tokens in ((4, None), (3, 4)):
        got = gpu.generate_batch(reqs, max_batch=max_batch, step_tokens=step_tokens)
        assert [(g.token_ids, g.logits_hash) for g in got] == [(s.token_ids, s.logits_hash) for s in solo]


def test_long_context_attention(stories_path):
    """Attention over more positions than a block holds at once (kernels.cu ACHUNK, 512): 1,100
    positions, whole, in chunks of 300 and then decoded, the CPU's bits."""
    cpu, gpu = cpu_and_gpu(stories_path, "fp16")
    ids = [int(i) for i in np.random.default_rng(0).integers(3, 512, 1100)]
    check_same_logits(cpu, gpu, ids, chunks=(300,))


def test_stories_golden_hashes(stories_path):
    """tests/golden/stories260k.json (the first case pinned to llama2.c's published text) on the
    emulated GPU (or DEVICE), every fp32 case again with native storage."""
    golden = read_golden(__import__("pathlib").Path(__file__).parent / "golden" / "stories260k.json")
    assert check_golden(model_loader(stories_path, device=DEVICE), golden, tinydet.hashing.file_sha256(stories_path)) == []


@pytest.mark.parametrize("plan", ["Q4_1 + Q8_0 table + F16 output", "Q5_0", "mixed per layer", "mixed runs in qkv", "F16",
                                  "mixed per layer, MXFP4"])
def test_requantized_stories_native(tmp_path, stories_path, plan):
    path = requantized(tmp_path, stories_path, PLANS[plan])
    cpu, gpu = cpu_and_gpu(path, "native")
    assert gpu.backend.storage() == tinydet.load(path, dtype="native").backend.storage()
    check_same_logits(cpu, gpu, cpu.tokenize(PROMPT), chunks=(7,))


@pytest.mark.parametrize("plan", ["Q4_1 + Q8_0 table + F16 output", "Q5_0", "mixed per layer, MXFP4", "mixed runs in qkv",
                                  "mixed within qkv", "Q5_1"])
def test_requantized_stories_int8(tmp_path, stories_path, plan):
    """dtype "int8": integer products (and the float ones of kinds the integer mode keeps in floats),
    the Q8_0 table's rows, whole and chunked prefill and decode, with the CPU's bits."""
    path = requantized(tmp_path, stories_path, PLANS[plan])
    cpu, gpu = cpu_and_gpu(path, "int8")
    assert gpu.backend.storage() == cpu.backend.storage()
    if plan != "Q5_1":
        assert any(":int8" in v for v in cpu.backend.storage().values())
    check_same_logits(cpu, gpu, cpu.tokenize(PROMPT), chunks=(7,))


@pytest.fixture(scope="module")
def tiny_archs(tmp_path_factory):
    """{name: (gguf path, its quantized twin)}: Qwen2 (biases), Qwen3 (QK-norm), Llama 3 (scaled RoPE),
    Mistral, Phi-3 (head_dim 96), Gemma 3 (GELU, post-norms, embedding scale, sliding windows)."""
    import gemma3gen
    import qwen2gen
    import spmgen

    out = tmp_path_factory.mktemp("archs")
    made = {}
    for arch in ("qwen2", "qwen3", "llama3"):
        made[arch] = (qwen2gen.make_tiny_qwen2(out, None, arch=arch)[1],
                      qwen2gen.write_gguf(out / f"{arch}-q8.gguf", quant="q8_0", arch=arch))
    for arch in ("mistral", "phi3"):
        made[arch] = (spmgen.make_tiny(out, arch, None)[1], spmgen.write_gguf(out / f"{arch}-q4.gguf", arch, "q4_0"))
    made["gemma3"] = (gemma3gen.make_tiny_gemma3(out)[1], gemma3gen.write_gguf(out / "gemma3-q4.gguf", "q4_0"))
    return made


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama3", "mistral", "phi3", "gemma3"])
def test_tiny_architectures(tiny_archs, arch):
    f32_file, quant_file = tiny_archs[arch]
    text = "The quick brown fox jumps over the lazy dog, and the dog does not mind: it is a lazy dog."
    for path, dtype in ((f32_file, "fp32"), (f32_file, "fp16"), (quant_file, "native")):
        cpu, gpu = cpu_and_gpu(path, dtype)
        check_same_logits(cpu, gpu, cpu.tokenize(text), chunks=(3,))  # chunks across Gemma 3's window of 8


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama3", "mistral", "phi3", "gemma3"])
def test_tiny_architectures_int8(tiny_archs, arch):
    cpu, gpu = cpu_and_gpu(tiny_archs[arch][1], "int8")
    assert any(":int8" in v for v in cpu.backend.storage().values())
    text = "The quick brown fox jumps over the lazy dog, and the dog does not mind: it is a lazy dog."
    check_same_logits(cpu, gpu, cpu.tokenize(text), chunks=(3,))


def test_yarn_attention_factor(tmp_path):
    """A YaRN RoPE (Qwen3's long-context setting in config.json) multiplies cos and sin by its attention
    factor (0.1 ln 4 + 1 here) on the GPU as on the CPU: the same tables, the CPU's bits."""
    import qwen2gen

    made = qwen2gen.write_hf_dir(tmp_path / "qwen3", arch="qwen3")
    cfg = json.loads((made / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    (made / "config.json").write_text(json.dumps(cfg))
    cpu, gpu = cpu_and_gpu(made, "fp32")
    assert cpu.config.rope.attention_factor > 1.1
    text = "The quick brown fox jumps over the lazy dog, and the dog does not mind: it is a lazy dog."
    check_same_logits(cpu, gpu, cpu.tokenize(text), chunks=(3,))


def test_q4_k_m_int8(q4_k_m):
    """A tiny Q4_K_M (Q4_K and Q6_K kinds, mixed per layer and within wqkv; a Q6_K output) in integers."""
    cpu, gpu = cpu_and_gpu(q4_k_m, "int8")
    assert cpu.backend.storage()["w2"] == "Q4_K:int8+Q6_K:int8"
    check_same_logits(cpu, gpu, cpu.tokenize(PROMPT), chunks=(5,))


def test_gemma3_q4_k_m_native(gemma3_path):
    """A real Q4_K_M file (Q4_K, Q6_K and Q5_0/Q8_0 matrices, a 262144-row quantized table): a short prompt."""
    cpu, gpu = cpu_and_gpu(gemma3_path, "native")
    assert {"Q4_K", "Q6_K"} <= set("+".join(gpu.backend.storage().values()).split("+"))
    ids = cpu.tokenize("The capital of France is")
    same(gpu.logits(ids), cpu.logits(ids), "gemma3 native")


def for_threads_blocks(src: str) -> list[tuple[str, str]]:
    """Each FOR_THREADS { ... } of kernels.cu as (its function's name, what follows it up to the next
    statement)."""
    out = []
    src = re.sub(r"//[^\n]*", "", src)
    for m in re.finditer(r"FOR_THREADS \{", src):
        depth, i = 1, m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(src[i], 0)
            i += 1
        fn = re.findall(r"(?:KERNEL|DEV void) (\w+)\(", src[:m.start()])[-1]
        out.append((fn, src[i:i + 40]))
    return out


def test_every_step_ends_in_a_barrier():
    """Threads of a block share what they wrote only after a SYNC: one follows every FOR_THREADS but a
    kernel's last (what the emulator, which runs each step's threads to the end, cannot see)."""
    steps = for_threads_blocks(D.source())
    assert {fn for fn, _ in steps} >= {"gemm", "gemv", "attend"}
    def ok(after):  # a SYNC next, or the function's closing brace (at the line's start)
        return after.lstrip().startswith("SYNC;") or re.match(r"[ \t]*\n}", after) is not None

    assert [(fn, after) for fn, after in steps if not ok(after)] == []
    steps = for_threads_blocks("DEV void k() {\n    FOR_THREADS { a = 1; }\n    FOR_THREADS { b = a; }\n}")
    assert [ok(after) for _, after in steps] == [False, True]


def test_thread_order_does_not_matter(stories_path, tiny_archs):
    """The emulator running every launch's blocks and threads in reverse gives the same bits: no thread
    reads what another writes in the same step (gemm, gemv, attend and every one-thread kernel)."""
    from tinydet.backends.cupy import CudaBackend
    from tinydet.formats import open_checkpoint

    for path, dtype in ((stories_path, "fp16"), (tiny_archs["gemma3"][1], "native")):
        cpu = tinydet.load(path, dtype=dtype)
        ck = open_checkpoint(path)
        gpu = tinydet.Model(ck.path, CudaBackend(ck.config, ck.tensors, dtype, 1, HostDevice(reverse=True)),
                            ck.tokenizer, ck.metadata)
        check_same_logits(cpu, gpu, cpu.tokenize(PROMPT * 2), chunks=(9,))


class GraphDevice(HostDevice):
    """The emulator with CUDA graphs as CuPy gives them: between begin_capture and end_capture launches
    are recorded, not run, and the graph's launch replays them with the arguments they had then (array
    contents as they are now, like device pointers; scalars as captured)."""

    def __init__(self):
        super().__init__()
        self.stream, self.recording, self.captures, self.replays = self, None, 0, 0

    def begin_capture(self):
        self.recording = []

    def end_capture(self):
        rec, self.recording = self.recording, None
        self.captures += 1

        def replay(stream):
            self.replays += 1
            for call in rec:
                HostDevice.launch(self, *call)
        return types.SimpleNamespace(launch=replay)

    def launch(self, name, grid, block, args):
        if self.recording is None:
            return super().launch(name, grid, block, args)
        self.recording.append((name, grid, block, args))


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_decode_graphs_replay_the_cpu_bits(stories_path, dtype):
    """Decode steps captured once per batch shape and replayed with new inputs give the CPU's bits: no
    step's tokens, positions or slots are baked into the capture."""
    from tinydet.backends.cupy import CudaBackend
    from tinydet.formats import open_checkpoint

    cpu = tinydet.load(stories_path, dtype=dtype)
    dev = GraphDevice()
    ck = open_checkpoint(stories_path)
    gpu = tinydet.Model(ck.path, CudaBackend(ck.config, ck.tensors, dtype, 1, dev), ck.tokenizer, ck.metadata)
    assert gpu.backend.graphs
    check_same_logits(cpu, gpu, cpu.tokenize(PROMPT))
    reqs = [dict(prompt=p, max_tokens=20 + 5 * i, temperature=0.8 * (i % 2), seed=i)
            for i, p in enumerate([PROMPT, "The dog", "", "Lily and Ben"])]
    got = gpu.generate_batch(reqs, max_batch=3)
    assert [(g.token_ids, g.logits_hash) for g in got] == [(g.token_ids, g.logits_hash) for g in (cpu.generate(**r) for r in reqs)]
    assert dev.captures >= 4 and dev.replays > 10 * dev.captures


def test_int8_decode_graphs_replay_the_cpu_bits(tmp_path, stories_path):
    """The int8 mode's decode graphs: the quantized activations' buffers are the workspace's own."""
    from tinydet.backends.cupy import CudaBackend
    from tinydet.formats import open_checkpoint

    path = requantized(tmp_path, stories_path, PLANS["Q4_1 + Q8_0 table + F16 output"])
    cpu = tinydet.load(path, dtype="int8", threads=2)
    dev = GraphDevice()
    ck = open_checkpoint(path)
    gpu = tinydet.Model(ck.path, CudaBackend(ck.config, ck.tensors, "int8", 1, dev), ck.tokenizer, ck.metadata)
    check_same_logits(cpu, gpu, cpu.tokenize(PROMPT), chunks=(6,))
    reqs = [dict(prompt=p, max_tokens=12 + 3 * i, temperature=0.8 * (i % 2), seed=i)
            for i, p in enumerate([PROMPT, "The dog", "Lily and Ben"])]
    got = gpu.generate_batch(reqs, max_batch=2)
    assert [(g.token_ids, g.logits_hash) for g in got] == [(g.token_ids, g.logits_hash) for g in (cpu.generate(**r) for r in reqs)]
    assert dev.captures >= 2 and dev.replays > 5 * dev.captures


def check_trace_and_fault(tmp_path, cpu, gpu, chunk: int, fault_layer: int, fault_op: str, col: int) -> None:
    """The traced pass (a hook after every op, `chunk` tokens a pass) records the CPU's bits op by op,
    and a hook adding 1 to column `col` of op `fault_op` in layer `fault_layer` changes the logits on
    the device as on the CPU."""
    ids = cpu.tokenize(PROMPT)
    paths = []
    for m in (cpu, gpu):
        p = tmp_path / f"{m.backend.name}.jsonl"
        write_trace(p, m, ids, run_trace(m, ids, chunk), {"chunk": chunk})
        paths.append(p)
    d = diff_traces(*paths)
    assert d["identical"] and d["n_compared"] > 100 and d["header_differences"]["backend"] == ("cpu-numba", gpu.backend.name)

    def fault(layer, op, pos, slots, rows):
        if layer == fault_layer and op == fault_op:
            rows[:, col] += 1.0

    outs = []
    for m in (cpu, gpu):
        m.backend.hooks.append(fault)
        outs.append(m.logits(ids))
        m.backend.hooks.clear()
    same(outs[1], outs[0], "with a fault")
    assert not np.array_equal(bits(outs[0]), bits(cpu.logits(ids)))


def test_trace_equals_cpu_trace(stories_path, tmp_path):
    """The traced pass records the CPU's bits op by op; a hook's change reaches the next op on the
    device as on the CPU."""
    cpu, gpu = cpu_and_gpu(stories_path, "fp16")
    check_trace_and_fault(tmp_path, cpu, gpu, 4, 2, "attn_norm", 3)


def test_int8_trace_and_hooks(tmp_path, stories_path):
    """int8 with a hook after every op (RMSNorm unfused, its output quantized by the product): the
    CPU's bits op by op, and a hook's change reaches the integer products on the device as on the CPU."""
    path = requantized(tmp_path, stories_path, PLANS["mixed runs in qkv"])
    cpu, gpu = cpu_and_gpu(path, "int8")
    check_trace_and_fault(tmp_path, cpu, gpu, 5, 1, "ffn_norm", 7)


def test_verify_on_the_emulated_gpu(stories_path):
    r = CliRunner().invoke(main, ["verify", "--model", str(stories_path), "--device", DEVICE, "--dtype", "fp32",
                                  "--dtype", "fp16", "--max-tokens", "8", "--json"])
    assert r.exit_code == 0, r.output
    import json

    out = json.loads(r.output)
    assert out["passed"] and sum(c["group"] == "backend" and c["variant"] == "cpu-numba" for c in out["cells"]) == 2


def test_verify_on_the_emulated_gpu_takes_int8_of_a_quantized_file(tmp_path, stories_path):
    """verify's default dtypes on a GPU: a quantized file's int8 cells too, each against the CPU's run."""
    import json

    path = requantized(tmp_path, stories_path, PLANS["Q4_1 + Q8_0 table + F16 output"])
    r = CliRunner().invoke(main, ["verify", "--model", str(path), "--device", DEVICE, "--max-tokens", "4", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    cpu_cells = {c["dtype"] for c in out["cells"] if c["group"] == "backend" and c["variant"] == "cpu-numba"}
    assert out["passed"] and cpu_cells == {"fp32", "fp16", "native", "int8"}


def test_emulated_generate_cli(stories_path):
    args = ["generate", "Once upon a time", "--model", str(stories_path), "--max-tokens", "24", "--json"]
    a, b = (CliRunner().invoke(main, args + extra) for extra in ([], ["--device", DEVICE]))
    assert a.exit_code == b.exit_code == 0, a.output + b.output
    import json

    ja, jb = json.loads(a.output), json.loads(b.output)
    assert (ja["output_hash"], ja["logits_hash"]) == (jb["output_hash"], jb["logits_hash"])


# ---------------------------------------------------------------------------------------------------
# 2. NVRTC's PTX.

ARCHS = ("compute_80", "compute_90", "sm_90")  # A100, H100/H200 (PTX for the driver), H100/H200 (machine code)


_NVRTC_BUILD = D.nvrtc_build


def nvrtc_build(code: str, arch: str, options=D.NVRTC_OPTIONS):
    """D.nvrtc_build, once per source, architecture and options in this process (seconds each)."""
    return _nvrtc_build_once(code, arch, tuple(options))


@functools.lru_cache(maxsize=None)
def _nvrtc_build_once(code, arch, options):
    return _NVRTC_BUILD(code, arch, options)


def ptx(code: str, arch: str, options=D.NVRTC_OPTIONS) -> str:
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (test extra) compiles the kernels to PTX")
    return nvrtc_build(code, arch, options)[0]


def lint(text: str) -> list[str]:
    """PTX lines that break the rules: fma (fused multiply-add), .approx or .ftz anywhere, or a float
    add, sub, mul, div, sqrt or rcp without .rn (ptxas may contract such an add or mul; div.full and
    div.approx are not IEEE division)."""
    bad = []
    for line in text.splitlines():
        ins = line.strip().split()[0] if line.strip() else ""
        arith = re.match(r"(add|sub|mul|div|sqrt|rcp|rsqrt)\.", ins) and re.search(r"\.f(32|64)\b", ins)
        if ins.startswith("fma.") or ".approx" in ins or ".ftz" in ins or (arith and ".rn." not in ins):
            bad.append(line.strip())
    return bad


@pytest.mark.parametrize("arch", ARCHS)
def test_ptx_keeps_every_rounding(arch):
    text = ptx(D.source(), arch)
    entries = set(re.findall(r"\.entry (\w+)\(", text))
    assert entries == set(D.signatures()), entries ^ set(D.signatures())
    assert lint(text) == []
    assert re.search(r"\bmul\.rn\.f32\b", text) and re.search(r"\badd\.rn\.f64\b", text)
    assert re.search(r"\bdiv\.rn\.f32\b", text) and re.search(r"\bsqrt\.rn\.f32\b", text)


def test_ptx_lint_can_fail():
    """The lint finds NVRTC's default contraction, the fast-math intrinsics and flush-to-zero (on a kernel
    of the shape kernels.cu's are: the whole source takes NVRTC seconds each time)."""
    code = 'extern "C" __global__ void k(float* x) { x[0] = x[1] * x[2] + x[3]; x[4] = x[5] / x[6]; }'
    assert lint(ptx(code, "compute_90")) == []
    fused = ptx(code, "compute_90", tuple(o for o in D.NVRTC_OPTIONS if not o.startswith("--fmad")))
    assert any(b.startswith("fma.rn.f32") for b in lint(fused))
    approx = ptx(code + '\nextern "C" __global__ void e(float* x) { x[0] = expf(x[0]); }', "compute_90")
    assert any(".approx" in b for b in lint(approx))
    ftz = ptx(code, "compute_90", tuple(o for o in D.NVRTC_OPTIONS if o != "--ftz=false") + ("--ftz=true",))
    assert any(".ftz" in b for b in lint(ftz))


class FakeCupy:
    """What CudaDevice asks of CuPy, without a GPU: one device of compute capability 9.0; RawModule
    records what it was given."""

    def __init__(self):
        fake = self

        class Device:
            compute_capability = "90"

            def __init__(self, index):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *a):
                return False

        class RawModule:
            def __init__(self, **kw):
                fake.module_args = kw

            def get_function(self, name):
                return name

        self.RawModule = RawModule
        self.ndarray = np.ndarray
        self.cuda = types.SimpleNamespace(
            Device=Device, Stream=lambda non_blocking: None,
            runtime=types.SimpleNamespace(getDeviceCount=lambda: 1,
                                          getDeviceProperties=lambda i: {"name": b"Fake GPU"}))


def test_the_gpu_loads_the_linted_ptx(monkeypatch, tmp_path):
    """CudaDevice hands CuPy the machine code that NVRTC made for the GPU's own architecture from the PTX
    that the lint passes (never CuPy's own compile, which adds -ftz=true), both cached as files, with
    every kernel in it; a GPU newer than NVRTC knows gets that PTX for the driver to compile."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (test extra) compiles the kernels to PTX")
    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setenv("TINYDET_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(D, "nvrtc_build", nvrtc_build)  # the builds test_ptx_keeps_every_rounding made
    dev = D.CudaDevice(0)
    assert dev.name == "cuda:0 (Fake GPU)" and set(fake.module_args) == {"path"} and dev.arch == "sm_90"
    ptx_text, cubin = nvrtc_build(D.source(), "sm_90")
    assert open(fake.module_args["path"], "rb").read() == cubin and cubin[:4] == b"\x7fELF"
    assert dev.ptx.read_text() == ptx_text and lint(ptx_text) == [] and ".target sm_90" in ptx_text
    assert set(re.findall(r"\.entry (\w+)\(", ptx_text)) == set(dev._fns) == set(D.signatures())
    fake.cuda.Device.compute_capability = "91"  # a GPU NVRTC has no machine code for (nvrtc_arch below)
    dev = D.CudaDevice(0)
    assert dev.arch == "compute_90" and fake.module_args["path"] == str(dev.ptx)
    assert lint(dev.ptx.read_text()) == []
    assert D.nvrtc_arch(90) == "sm_90" and D.nvrtc_arch(86) == "sm_86" and D.nvrtc_arch(91) == "compute_90"
    with pytest.raises(TinydetError, match="NVRTC cannot build for compute capability 2.0"):
        D.nvrtc_arch(20)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(TinydetError, match=r"device cuda: cuda-bindings \(NVRTC's Python binding\) is not installed"):
        D.nvrtc_arch(90)


def _gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.mark.skipif(not _gpu(), reason="no NVIDIA GPU with CuPy here (tools/gpu_check.sh is the check on one)")
@pytest.mark.parametrize("graphs", ["1", "0"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "native"])
def test_real_gpu(stories_path, dtype, graphs, monkeypatch):
    """On an NVIDIA GPU: the CPU's logits, decode steps and batches, with CUDA graphs and without."""
    monkeypatch.setenv("TINYDET_CUDA_GRAPHS", graphs)
    cpu, gpu = tinydet.load(stories_path, dtype=dtype), tinydet.load(stories_path, dtype=dtype, device="cuda")
    assert gpu.backend.graphs == (graphs == "1")
    check_same_logits(cpu, gpu, cpu.tokenize(PROMPT))
    reqs = [dict(prompt=p, max_tokens=24, temperature=0.8 * i, seed=i) for i, p in enumerate([PROMPT, "The", ""])]
    assert ([(g.token_ids, g.logits_hash) for g in gpu.generate_batch(reqs, max_batch=3)]
            == [(g.token_ids, g.logits_hash) for g in (cpu.generate(**r) for r in reqs)])


# ---------------------------------------------------------------------------------------------------
# 3. Errors.

def test_no_cupy_no_gpu_bad_device(stories_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import fails as when CuPy is not installed
    with pytest.raises(TinydetError, match=r"device cuda: CuPy is not installed \(pip install 'tinydet\[cuda12\]'"):
        tinydet.load(stories_path, device="cuda")
    r = CliRunner().invoke(main, ["generate", "x", "--model", str(stories_path), "--device", "cuda:1"])
    assert r.exit_code == 1 and r.output.strip().splitlines()[-1].startswith("error: device cuda: CuPy is not installed")

    def no_driver():
        raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=no_driver)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    with pytest.raises(TinydetError, match="device cuda: no usable NVIDIA GPU .cudaErrorNoDevice"):
        tinydet.load(stories_path, device="cuda")
    fake.cuda.runtime.getDeviceCount = lambda: 1
    with pytest.raises(TinydetError, match=r"device cuda:3: this machine has 1 GPU"):
        tinydet.load(stories_path, device="cuda:3")
    for bad in ("gpu", "cuda:x", "CUDA", ""):
        with pytest.raises(TinydetError, match="device: expected one of cpu, cuda, cuda:N, cuda-host"):
            tinydet.load(stories_path, device=bad)
    r = CliRunner().invoke(main, ["generate", "x", "--model", str(stories_path), "--device", "gpu"])
    assert r.exit_code == 2 and "Invalid value for '--device'" in r.output
    r = CliRunner().invoke(main, ["serve", "--ray", "--device", "cuda"])
    assert r.exit_code == 1 and "Ray replicas run on the CPU" in r.output
    r = CliRunner().invoke(main, ["golden", "--model", str(stories_path), "--write", "x.json", "--device", "cuda-host"])
    assert r.exit_code == 1 and "--write records the CPU backend's hashes" in r.output


def test_out_of_device_memory(stories_path):
    """CuPy's OutOfMemoryError while the weights or a KV cache are copied: a MemoryLimitError saying what."""
    class OutOfMemoryError(Exception):
        pass

    class Full(HostDevice):
        limit = 0

        def to_device(self, a):
            if self.limit <= 0:
                raise OutOfMemoryError("Out of memory allocating 1,024 bytes")
            self.limit -= 1
            return super().to_device(a)

    from tinydet.backends.cupy import CudaBackend
    from tinydet.formats import open_checkpoint
    from tinydet.memory import MemoryLimitError

    ck = open_checkpoint(stories_path)
    with pytest.raises(MemoryLimitError, match=r"device host: the weights \(1 MiB at fp32\) do not fit in the GPU's free"):
        CudaBackend(ck.config, open_checkpoint(stories_path).tensors, "fp32", 1, Full())
    dev = Full()
    dev.limit = 10**6
    be = CudaBackend(ck.config, ck.tensors, "fp32", 1, dev)
    dev.xp = types.SimpleNamespace(zeros=lambda *a: (_ for _ in ()).throw(OutOfMemoryError("2 GB")))
    with pytest.raises(MemoryLimitError, match="the keys and values of 1 x 512 positions do not fit"):
        be.new_cache(512)


def test_launch_arguments_are_checked(dev):
    x = np.zeros(4, np.float32)
    with pytest.raises(TinydetError, match="kernel add_rows: expected 3 arguments, found 2"):
        dev.launch("add_rows", (1,), (4,), (x, x))
    with pytest.raises(TinydetError, match="kernel add_rows: y must be a C-contiguous device array of float32"):
        dev.launch("add_rows", (1,), (4,), (x, np.zeros(4, np.float64), 4))
    with pytest.raises(TinydetError, match="kernel add_rows: x must be a C-contiguous"):
        dev.launch("add_rows", (1,), (4,), (np.zeros(8, np.float32)[::2], x, 4))
    with pytest.raises(TinydetError, match="kernel 'nope': not in kernels.cu"):
        dev.launch("nope", (1,), (1,), ())
    y = np.arange(4, dtype=np.float32)
    dev.launch("add_rows", (1,), (4,), (x, y, 4))
    assert x.tolist() == [0, 1, 2, 3]
