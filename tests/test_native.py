"""Native quantized storage (backends/cpu: layout.py's quantized panels, read by loaders.py): products
straight from Q8_0/Q4_0/Q4_1 blocks must be bit-identical to the matrix product over the exactly
dequantized matrix, at every thread count, token count and row permutation, on random blocks and on
the real SmolLM2 file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest

from tinydet.formats.ggml import GGML_TYPE_IDS, GGML_TYPES
from tinydet.formats.gguf import GGUFFile
from tinydet.formats.gguf_model import rope_row_order
from tinydet.backends.cpu import layout, loaders, simd
from tinydet.backends.cpu.matmul import MM_PLAIN, matmul, mm
from tinydet.formats.dequant import dequantize

NATIVE = ["Q8_0", "Q4_0", "Q4_1"]
SHAPES = [(200, 576), (576, 1536), (100, 96)]  # (100, 96): partial panel, K not a multiple of 64
TOKENS = [1, 2, 3, 4, 5, 10, 17]  # every tile shape and tail (6, 4, 2, 1; clamped rows)
THREADS = [1, 2, 3]

# fp16 scales that must survive: +-0, subnormals, tiny and large normals, negative.
SPECIAL_SCALES = [0x0000, 0x8000, 0x0001, 0x03FF, 0x8001, 0x0400, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF, 0xB1A3]
# inf and NaN scales (quiet, signalling, with sign and payload)
NONFINITE_SCALES = [0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFE5A]


def u32(a: np.ndarray) -> np.ndarray:
    assert a.dtype == np.float32
    return np.ascontiguousarray(a).view(np.uint32)


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    """Equal bit patterns; where either is NaN, both must be NaN (which NaN payload an operation
    propagates is the CPU's rule and LLVM may commute operands, so payloads are not compared)."""
    assert got.shape == want.shape, what
    gn, wn = np.isnan(got), np.isnan(want)
    assert np.array_equal(gn, wn), f"{what}: NaN positions differ"
    ok = (u32(got) == u32(want)) | gn
    if not ok.all():
        i = np.flatnonzero(~ok.ravel())
        raise AssertionError(f"{what}: {i.size} of {ok.size} outputs differ, first at flat index {i[0]}: "
                             f"got 0x{u32(got).ravel()[i[0]]:08x}, want 0x{u32(want).ravel()[i[0]]:08x}")


def random_blocks(name: str, n: int, k: int, seed: int, nonfinite: bool = False) -> np.ndarray:
    """(n, row bytes) uint8: random quants (every value occurs), realistic random fp16 scales (and
    mins) of both signs and many magnitudes, with the special scales sprinkled in."""
    rng = np.random.default_rng(seed)
    t = GGML_TYPES[GGML_TYPE_IDS[name]]
    nb = k // 32
    b = rng.integers(0, 256, (n, nb, t.type_size), dtype=np.uint8)

    def scales(scale):
        s = (rng.standard_normal((n, nb)) * scale * np.exp2(rng.integers(-12, 3, (n, nb)))).astype(np.float16)
        bits_ = s.view(np.uint16)
        special = np.array(SPECIAL_SCALES + (NONFINITE_SCALES if nonfinite else []), np.uint16)
        pick = rng.random((n, nb)) < 0.05
        bits_[pick] = special[rng.integers(0, special.size, int(pick.sum()))]
        return bits_.view(np.uint8).reshape(n, nb, 2)

    b[:, :, 0:2] = scales(0.02)
    if name == "Q4_1":
        b[:, :, 2:4] = scales(0.1)
    return b.reshape(n, nb * t.type_size)


def fp32_product(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    matmul(x, layout.pack_panels(w), w.shape[0], out)
    return out


def native_product(x: np.ndarray, qp: layout.QPanels, res: np.ndarray | None = None) -> np.ndarray:
    out = np.full((x.shape[0], qp.n), np.nan, np.float32)
    matmul(x, qp, qp.n, out, res)
    return out


@pytest.fixture
def restore_threads():
    n = numba.get_num_threads()
    yield
    numba.set_num_threads(n)


def test_constants_match_the_float_kernel():
    # a quantized panel is one 32-lane vector, a pair of them one 64-lane float panel's width
    assert layout.QPANEL == simd.HALF and simd.LANES == 2 * simd.HALF == 64
    assert layout.QBLOCK == 32 and simd.KBLOCK % layout.QBLOCK == 0
    assert set(layout.NATIVE_TYPES) == {layout.Q8_0, layout.Q4_0, layout.Q4_1} == {GGML_TYPE_IDS[n] for n in NATIVE}


# --- 1. random blocks: bit for bit against the fp32 path, every T and thread count ------------------------

@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", NATIVE)
def test_qmatmul_equals_fp32_matmul(name, shape, restore_threads):
    n, k = shape
    tid = GGML_TYPE_IDS[name]
    raw = random_blocks(name, n, k, seed=n + k)
    w = dequantize(raw, tid, (n, k))
    qp = layout.pack_quantized(raw, tid, k)
    assert qp.d.dtype == np.uint16  # finite scales: kept as fp16 bits
    rng = np.random.default_rng(7)
    for T in TOKENS:
        x = rng.standard_normal((T, k)).astype(np.float32)
        want = fp32_product(x, w)
        assert np.isfinite(want).all()
        for threads in THREADS:
            numba.set_num_threads(threads)
            assert_same_bits(native_product(x, qp), want, f"{name} {n}x{k} T={T} threads={threads}")


@pytest.mark.parametrize("name", NATIVE)
def test_nonfinite_scales(name, restore_threads):
    """inf and NaN scales (and so inf/NaN weights): the same outputs, NaN where fp32 gives NaN."""
    n, k = 130, 256
    tid = GGML_TYPE_IDS[name]
    raw = random_blocks(name, n, k, seed=3, nonfinite=True)
    w = dequantize(raw, tid, (n, k))
    assert np.isnan(w).any() and np.isinf(w).any()
    qp = layout.pack_quantized(raw, tid, k)
    x = np.random.default_rng(1).standard_normal((9, k)).astype(np.float32)
    want = fp32_product(x, w)
    for threads in (1, 2):
        numba.set_num_threads(threads)
        for T in (1, 2, 9):
            assert_same_bits(native_product(x[:T], qp), want[:T], f"{name} T={T} threads={threads}")


def test_float32_scales_fallback():
    """Scales the kernel's integer widening might not reproduce bit for bit (NaN payloads) are stored
    widened by NumPy; the kernels take float32 scales as well as fp16 bits and give the same result."""
    n, k = 70, 128
    raw = random_blocks("Q4_1", n, k, seed=5)
    qp = layout.pack_quantized(raw, layout.Q4_1, k)
    as_f32 = layout.QPanels(qp.ggml_type, n, k, qp.qs, qp.d.view(np.float16).astype(np.float32),
                           qp.m.view(np.float16).astype(np.float32))
    x = np.random.default_rng(2).standard_normal((5, k)).astype(np.float32)
    for T in (1, 5):
        assert_same_bits(native_product(x[:T], as_f32), native_product(x[:T], qp))
    # the kernels' integer widening (the packer's check) agrees with NumPy on every non-NaN fp16 pattern
    allh = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    want = allh.view(np.float16).astype(np.float32)
    got = simd.from_f16_bits(allh).view(np.uint32)
    finite = ~np.isnan(want)
    assert np.array_equal(got[finite], want.view(np.uint32)[finite])
    assert np.isnan(got.view(np.float32)[~finite]).all()


def test_every_quant_value_and_sign_is_exact():
    """A hand-made matrix whose rows are single blocks holding all 16 nibbles (or all 256 int8 values),
    times unit vectors: each output is one weight, exactly as dequantize gives it."""
    for name in NATIVE:
        tid = GGML_TYPE_IDS[name]
        t = GGML_TYPES[tid]
        n, k = 64, 32
        b = np.zeros((n, t.type_size), np.uint8)
        b[:, 0:2] = np.full(n, 0xB1A3, np.uint16).view(np.uint8).reshape(n, 2)  # d < 0
        if name == "Q4_1":
            b[:, 2:4] = np.full(n, 0x3555, np.uint16).view(np.uint8).reshape(n, 2)
        q = (np.arange(n)[:, None] * 7 + np.arange(32)[None, :]) % 256
        if name == "Q8_0":
            b[:, 2:34] = q
        else:
            off = 2 if name == "Q4_0" else 4
            b[:, off:off + 16] = (q[:, :16] % 16) | ((q[:, 16:] % 16) << 4)
        w = dequantize(b, tid, (n, k))
        qp = layout.pack_quantized(b, tid, k)
        x = np.eye(k, dtype=np.float32)
        # each output is 0 + w * 1 = w (a -0.0 weight gives +0.0)
        assert_same_bits(native_product(x, qp), np.ascontiguousarray(w.T) + np.float32(0.0), name)
        assert_same_bits(native_product(x, qp), fp32_product(x, w), name)


# --- 2. layout: permutation, concatenation, stacking, embedding --------------------------------------------

def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF's rotate-half rows -> llama.cpp's adjacent pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """GGUF's Q/K rows back to HF's order (the inverse of llama_cpp_permute), moving rows only."""
    n, k = w.shape
    return np.ascontiguousarray(w.reshape(n_heads, n // n_heads // 2, 2, k).swapaxes(1, 2).reshape(n, k))


def test_rope_row_order_is_unpermute_rope_rows():
    for n, heads in ((576, 9), (192, 3), (64, 1), (256, 4)):
        w = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
        assert np.array_equal(w[rope_row_order(n, heads)], unpermute_rope_rows(w, heads))
        assert np.array_equal(llama_cpp_permute(w, heads)[rope_row_order(n, heads)], w)


@pytest.mark.parametrize("name", NATIVE)
def test_pack_parts_equals_packing_the_permuted_concatenation(name, restore_threads):
    """[wq; wk; wv] with Q/K rows un-permuted, packed from raw block rows, is the matrix the fp32 path
    builds from the dequantized tensors: row by row (embed) and product by product (qmatmul)."""
    tid = GGML_TYPE_IDS[name]
    k, hd = 192, 32
    q_rows, kv_rows = 6 * hd, 2 * hd
    raw_q = random_blocks(name, q_rows, k, seed=11)
    raw_k = random_blocks(name, kv_rows, k, seed=12)
    raw_v = random_blocks(name, kv_rows, k, seed=13)
    qp = layout.pack_parts([(raw_q, rope_row_order(q_rows, 6), tid),
                           (raw_k, rope_row_order(kv_rows, 2), tid), (raw_v, None, tid)], tid, k)
    w = np.concatenate([unpermute_rope_rows(dequantize(raw_q, tid, (q_rows, k)), 6),
                        unpermute_rope_rows(dequantize(raw_k, tid, (kv_rows, k)), 2),
                        dequantize(raw_v, tid, (kv_rows, k))])
    assert qp.n == w.shape[0]
    rows = np.empty_like(w)
    loaders.embed(qp, np.arange(qp.n), rows)
    assert_same_bits(rows, w, "rows")
    x = np.random.default_rng(3).standard_normal((7, k)).astype(np.float32)
    for threads in (1, 3):
        numba.set_num_threads(threads)
        for T in (1, 7):
            assert_same_bits(native_product(x[:T], qp), fp32_product(x[:T], w), f"T={T} threads={threads}")
    # the same as packing once from the permuted raw rows, and a flat byte buffer is accepted
    order = np.concatenate([rope_row_order(q_rows, 6), q_rows + rope_row_order(kv_rows, 2),
                            q_rows + kv_rows + np.arange(kv_rows)])
    whole = layout.pack_quantized(np.concatenate([raw_q, raw_k, raw_v]).reshape(-1), tid, k, order)
    for a, b in ((qp.qs, whole.qs), (qp.d, whole.d), (qp.m, whole.m)):
        assert (a is None and b is None) or np.array_equal(a, b)


@pytest.mark.parametrize("name", NATIVE)
def test_embed_rows_equal_dequantize(name):
    tid = GGML_TYPE_IDS[name]
    n, k = 300, 96
    raw = random_blocks(name, n, k, seed=21, nonfinite=True)
    w = dequantize(raw, tid, (n, k))
    qp = layout.pack_quantized(raw, tid, k)
    ids = np.array([0, 299, 31, 32, 33, 150, 150, 7])
    out = np.empty((ids.size, k), np.float32)
    loaders.embed(qp, ids, out)
    assert_same_bits(out, w[ids])


@pytest.mark.parametrize("name", NATIVE)
def test_stack_and_residual(name, restore_threads):
    """layout.stack keeps each layer's matrix; the residual variant adds exactly out into res."""
    tid = GGML_TYPE_IDS[name]
    n, k = 96, 128
    layers = [layout.pack_quantized(random_blocks(name, n, k, seed=30 + i), tid, k) for i in range(3)]
    st = layout.stack(layers)
    assert st.qs.shape == (3,) + layers[0].qs.shape
    rng = np.random.default_rng(4)
    for T in (1, 4, 8):
        x = rng.standard_normal((T, k)).astype(np.float32)
        for i, lq in enumerate(layers):
            one = layout.QPanels(st.ggml_type, n, k, st.qs[i], st.d[i], None if st.m is None else st.m[i])
            out = native_product(x, one)
            assert_same_bits(out, native_product(x, lq))
            res = rng.standard_normal((T, n)).astype(np.float32)
            want = res + out  # one elementwise float32 add, as ops.add_rows(res, out)
            got = native_product(x, lq, res)
            assert_same_bits(got, out)
            assert_same_bits(res, want)


def test_jitted_entry_points():
    """mm on loaders.layer (as the one-call forward pass uses them) picks the loader by the arrays'
    types and gives matmul's bits."""
    @numba.njit
    def run(x, qs, d, m, li, n, out):
        mm(x, loaders.layer((qs, d, m), li), n, out, 2, MM_PLAIN, out, out, 0)

    rng = np.random.default_rng(5)
    for name in NATIVE:
        tid = GGML_TYPE_IDS[name]
        n, k = 70, 64
        layers = [layout.pack_quantized(random_blocks(name, n, k, seed=40 + i), tid, k) for i in range(2)]
        st = layout.stack(layers)
        for T in (1, 6):
            x = rng.standard_normal((T, k)).astype(np.float32)
            for li in range(2):
                got = np.empty((T, n), np.float32)
                run(x, st.qs, st.d, st.m, li, n, got)
                assert_same_bits(got, native_product(x, layers[li]), f"{name} T={T} layer {li}")


def test_bytes_per_weight():
    n, k = 640, 1024
    per_weight = {name: layout.pack_quantized(random_blocks(name, n, k, 0), GGML_TYPE_IDS[name], k).nbytes / (n * k)
                  for name in NATIVE}
    assert per_weight == {"Q8_0": 34 / 32, "Q4_0": 18 / 32, "Q4_1": 20 / 32}  # GGUF's own sizes


def test_errors():
    raw = random_blocks("Q4_1", 64, 64, 0)
    qp = layout.pack_quantized(raw, layout.Q4_1, 64)
    with pytest.raises(ValueError, match="native storage handles"):
        layout.pack_quantized(raw, GGML_TYPE_IDS["Q6_K"], 64)
    with pytest.raises(ValueError, match="permutation"):
        layout.pack_quantized(raw, layout.Q4_1, 64, np.zeros(64, np.int64))
    with pytest.raises(ValueError, match="whole number of rows"):
        layout.pack_quantized(raw.reshape(-1)[:-1], layout.Q4_1, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        layout.pack_quantized(raw, layout.Q4_1, 48)
    with pytest.raises(ValueError, match="differ"):
        layout.stack([qp, layout.pack_quantized(raw, layout.Q4_1, 32)])
    with pytest.raises(ValueError, match="share one type"):
        layout.pack_parts([(raw, None, layout.Q4_1), (raw, None, layout.Q8_0)], layout.Q4_1, 64)
    assert layout.pack_parts([(raw, None, layout.Q4_1), (raw, None)], layout.Q4_1, 64).n == 128
    x = np.zeros((2, 64), np.float32)
    with pytest.raises(ValueError, match="do not fit"):
        matmul(x, qp, 64, np.empty((3, 64), np.float32))
    with pytest.raises(ValueError, match="do not fit"):
        matmul(np.zeros((2, 32), np.float32), qp, 64, np.empty((2, 64), np.float32))
    with pytest.raises(ValueError, match="do not fit"):
        matmul(x, qp, 65, np.empty((2, 65), np.float32))
    with pytest.raises(TypeError, match="C-contiguous float32"):
        matmul(x.astype(np.float64), qp, 64, np.empty((2, 64), np.float32))
    with pytest.raises(TypeError, match="C-contiguous float32"):
        matmul(x, qp, 64, np.empty((64, 2), np.float32).T)
    with pytest.raises(ValueError, match="layout"):
        matmul(x, layout.QPanels(qp.ggml_type, qp.n, qp.k, qp.qs[:, :1], qp.d, qp.m), 64,
                     np.empty((2, 64), np.float32))
    with pytest.raises(ValueError, match="row ids"):
        loaders.embed(qp, np.array([64]), np.empty((1, 64), np.float32))


def test_generic_x86_64_target_gives_the_same_bits(tmp_path):
    """Compiled for a generic x86-64 (the vectors split into SSE registers), the same bits."""
    script = tmp_path / "gen.py"
    script.write_text(
        "import sys, numpy as np, tinydet\n"
        "from tinydet.backends.cpu import layout\n"
        "from tinydet.backends.cpu.matmul import matmul\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from test_native import random_blocks\n"
        "raw = random_blocks('Q4_1', 100, 160, 9)\n"
        "qp = layout.pack_quantized(raw, layout.Q4_1, 160)\n"
        "x = np.random.default_rng(0).standard_normal((7, 160)).astype(np.float32)\n"
        "out = np.empty((8, 100), np.float32)\n"
        "matmul(x[:1], qp, 100, out[:1])\n"
        "matmul(x, qp, 100, out[1:])\n"
        "np.save(sys.argv[2], out)\n")
    env = dict(os.environ, NUMBA_CPU_NAME="generic", NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("NUMBA_CPU_FEATURES", None)
    dest = tmp_path / "out.npy"
    r = subprocess.run([sys.executable, str(script), str(Path(__file__).parent), str(dest)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    got = np.load(dest)
    raw = random_blocks("Q4_1", 100, 160, 9)
    x = np.random.default_rng(0).standard_normal((7, 160)).astype(np.float32)
    want = fp32_product(x, dequantize(raw, layout.Q4_1, (100, 160)))
    assert_same_bits(got[:1], want[:1])
    assert_same_bits(got[1:], want)


# --- 3. the real SmolLM2 file: every matrix of every layer, and the Q8_0 token table ----------------------

def test_smollm_every_matrix_bit_identical(smollm_path, restore_threads):
    g = GGUFFile(smollm_path)
    raw = g.tensor_bytes
    info = g.tensors
    n_heads = g.require("llama.attention.head_count")
    n_kv = g.require("llama.attention.head_count_kv")
    dim = info["token_embd.weight"].shape[1]
    n_layers = g.require("llama.block_count")
    types_seen = set()

    def deq(name):
        return dequantize(raw(name), info[name].ggml_type, info[name].shape)

    rng = np.random.default_rng(0)
    numba.set_num_threads(2)
    for i in range(n_layers):
        blk = f"blk.{i}."
        q_rows, kv_rows = info[blk + "attn_q.weight"].shape[0], info[blk + "attn_k.weight"].shape[0]
        tid = info[blk + "attn_q.weight"].ggml_type
        mats = {
            "wqkv": (layout.pack_parts([(raw(blk + "attn_q.weight"), rope_row_order(q_rows, n_heads)),
                                       (raw(blk + "attn_k.weight"), rope_row_order(kv_rows, n_kv)),
                                       (raw(blk + "attn_v.weight"), None)], tid, dim),
                     lambda: np.concatenate([unpermute_rope_rows(deq(blk + "attn_q.weight"), n_heads),
                                             unpermute_rope_rows(deq(blk + "attn_k.weight"), n_kv),
                                             deq(blk + "attn_v.weight")])),
            "wo": (layout.pack_quantized(raw(blk + "attn_output.weight"), info[blk + "attn_output.weight"].ggml_type,
                                        info[blk + "attn_output.weight"].shape[1]),
                   lambda: deq(blk + "attn_output.weight")),
            "w13": (layout.pack_parts([(raw(blk + "ffn_gate.weight"), None), (raw(blk + "ffn_up.weight"), None)],
                                     info[blk + "ffn_gate.weight"].ggml_type, dim),
                    lambda: np.concatenate([deq(blk + "ffn_gate.weight"), deq(blk + "ffn_up.weight")])),
            "w2": (layout.pack_quantized(raw(blk + "ffn_down.weight"), info[blk + "ffn_down.weight"].ggml_type,
                                        info[blk + "ffn_down.weight"].shape[1]),
                   lambda: deq(blk + "ffn_down.weight")),
        }
        for name, (qp, w) in mats.items():
            w = w()
            types_seen.add(GGML_TYPES[qp.ggml_type].name)
            # activations of a realistic spread, some rows scaled up (as after a residual)
            spread = np.array([[1.0], [0.1], [3.0], [30.0], [1.0]])
            x = (rng.standard_normal((5, w.shape[1])) * spread).astype(np.float32)
            want = fp32_product(x, w)
            assert_same_bits(native_product(x, qp), want, f"layer {i} {name} T=5")
            assert_same_bits(native_product(x[:1], qp), want[:1], f"layer {i} {name} T=1")
    assert types_seen == {"Q4_1"}
    # the Q8_0 token table: as the (tied) output matrix and as the embedding
    tid = info["token_embd.weight"].ggml_type
    assert GGML_TYPES[tid].name == "Q8_0" and "output.weight" not in info
    table = deq("token_embd.weight")
    qp = layout.pack_quantized(raw("token_embd.weight"), tid, dim)
    x = rng.standard_normal((3, dim)).astype(np.float32)
    want = fp32_product(x, table)
    assert_same_bits(native_product(x, qp), want, "output T=3")
    assert_same_bits(native_product(x[2:], qp), want[2:], "output T=1")
    ids = np.array([0, 1, 2, 100, 49151, 12345])
    rows = np.empty((ids.size, dim), np.float32)
    loaders.embed(qp, ids, rows)
    assert_same_bits(rows, table[ids], "embedding")


def test_signaling_nan_scales_are_stored_widened():
    """F16C quiets signaling NaNs and the integer widening does not: a matrix with one stores
    NumPy's float32 scales, and the product still equals fp32's."""
    n, k = 40, 64
    raw = random_blocks("Q8_0", n, k, seed=7)
    blocks = raw.reshape(n, k // 32, 34)
    blocks[3, 1, 0:2] = np.array([0x7C01], "<u2").view(np.uint8)  # a signaling NaN scale
    qp = layout.pack_quantized(raw, layout.Q8_0, k)
    assert qp.d.dtype == np.float32
    w = dequantize(raw, layout.Q8_0, (n, k))
    x = np.random.default_rng(4).standard_normal((3, k)).astype(np.float32)
    for T in (1, 3):
        assert_same_bits(native_product(x[:T], qp), fp32_product(x[:T], w))
    clean = layout.pack_quantized(random_blocks("Q8_0", n, k, seed=7), layout.Q8_0, k)
    assert clean.d.dtype == np.uint16


def test_q4_1_scale_times_quant_is_exact():
    """Q4_1's kernel may fuse (d * q) + m into one FMA because d * q never rounds: for every fp16 scale
    d and every 4-bit q, the float32 product equals the exact (float64) one. Rounding d * q + m once is
    then the same as rounding the sum of the rounded product."""
    d = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    d = d[np.isfinite(d)]
    q = np.arange(16, dtype=np.float32)
    f32 = d[:, None] * q[None, :]
    f64 = d.astype(np.float64)[:, None] * q.astype(np.float64)[None, :]
    assert np.array_equal(f32.astype(np.float64), f64)
