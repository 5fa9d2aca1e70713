"""Native quantized storage (packing/layout.py's quantized panels, read by backends/cpu/loaders.py): products
straight from Q8_0/Q4_0/Q4_1/Q5_0/Q4_K/Q5_K/Q6_K blocks must be bit-identical to the matrix product
over the exactly dequantized matrix, at every thread count, token count and row permutation, on random
blocks, on the real SmolLM2 file and on every kind of matrix of the real Gemma 3 270M Q4_K_M file; so
must matrix kinds of mixed types (layout.MixedPanels)."""

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
from tinydet.backends.cpu import loaders
from tinydet.packing import layout
from tinydet.numerics import simd
from tinydet.backends.cpu.matmul import MM_GLU, MM_PLAIN, matmul, mm, scratch
from tinydet.backends.cpu.ops import SILU, glu_rows
from tinydet.backends.cpu.storage.kinds import as_storage, tag
from tinydet.formats.dequant import dequantize

OLD = ["Q8_0", "Q4_0", "Q4_1"]
NEW = ["Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
MX = ["MXFP4"]  # E8M0 exponent scales (uint8), E2M1 codes: no fp16 scale, never a NaN weight
NATIVE = OLD + NEW + MX
K_QUANTS = ["Q4_K", "Q5_K", "Q6_K"]
SHAPES = [(200, 576), (576, 1536), (100, 96)]  # (100, 96): partial panel, K not a multiple of 64
K_SHAPES = [(200, 512), (576, 1536), (100, 256), (33, 768)]  # K-quants: K a multiple of 256
TOKENS = [1, 2, 3, 4, 5, 10, 17]  # every tile shape and tail (6, 4, 2, 1; clamped rows)
NEW_TOKENS = list(range(1, 21)) + [64, 100]
THREADS = [1, 2, 3]

# Byte offsets of each type's fp16 scales (d, and m / dmin) in a block, of the bytes holding its quants
# (high bits included) and of its sub-block scales (ggml-common.h).
SCALE_OFFSETS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2],
                 "Q6_K": [208]}
QUANT_BYTES = {"Q5_0": (2, 22), "Q5_1": (4, 24), "Q4_K": (16, 144), "Q5_K": (16, 176), "Q6_K": (0, 192)}
SUBSCALE_BYTES = {"Q4_K": (4, 16), "Q5_K": (4, 16), "Q6_K": (192, 208)}


def k_for(name: str, k: int) -> int:
    """A row length for the type: K-quants need a multiple of 256."""
    return -(-k // 256) * 256 if name in K_QUANTS else k

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
    mins) of both signs and many magnitudes, with the special scales sprinkled in. Q5_0's blocks are
    the gguf package's quantization of random rows (its scales then sprinkled the same way); for Q5_0
    and the K-quants (which gguf cannot quantize) some blocks have all quants at their minimum or
    maximum, and some K-quant blocks all sub-block scales (and mins) at 0 or at their maximum."""
    rng = np.random.default_rng(seed)
    t = GGML_TYPES[GGML_TYPE_IDS[name]]
    nb = k // t.block_size
    if name == "MXFP4":
        return mxfp4_blocks(rng, n, k, nonfinite)
    if name == "Q5_0":
        gguf = pytest.importorskip("gguf", reason="the gguf package (test extra) quantizes Q5_0 blocks")
        w = (rng.standard_normal((n, k)) * np.exp2(rng.integers(-10, 4, (n, 1)))).astype(np.float32)
        b = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q5_0).reshape(n, nb, t.type_size).copy()
    else:
        b = rng.integers(0, 256, (n, nb, t.type_size), dtype=np.uint8)

    def scales(scale, bits_=None):
        if bits_ is None:
            s = (rng.standard_normal((n, nb)) * scale * np.exp2(rng.integers(-12, 3, (n, nb)))).astype(np.float16)
            bits_ = s.view(np.uint16)
        special = np.array(SPECIAL_SCALES + (NONFINITE_SCALES if nonfinite else []), np.uint16)
        pick = rng.random((n, nb)) < 0.05
        bits_[pick] = special[rng.integers(0, special.size, int(pick.sum()))]
        return bits_.view(np.uint8).reshape(n, nb, 2)

    offs = SCALE_OFFSETS[name]
    if name == "Q5_0":  # gguf's scales, some replaced by the special ones
        b[:, :, 0:2] = scales(0, np.ascontiguousarray(b[:, :, 0:2]).view("<u2")[:, :, 0].astype(np.uint16))
    else:
        b[:, :, offs[0]:offs[0] + 2] = scales(0.02)
    if len(offs) == 2:
        b[:, :, offs[1]:offs[1] + 2] = scales(0.1)
    if name in QUANT_BYTES:
        lo, hi = QUANT_BYTES[name]
        pick = rng.random((n, nb))
        b[pick < 0.03, lo:hi] = 0  # every quant at its minimum
        b[(pick >= 0.03) & (pick < 0.06), lo:hi] = 255  # at its maximum
    if name in SUBSCALE_BYTES:
        lo, hi = SUBSCALE_BYTES[name]
        pick = rng.random((n, nb))
        b[pick < 0.03, lo:hi] = 0
        b[(pick >= 0.03) & (pick < 0.06), lo:hi] = 255 if name != "Q6_K" else 127
        b[(pick >= 0.06) & (pick < 0.09), lo:hi] = 63 if name != "Q6_K" else 128  # Q6_K: -128
    return b.reshape(n, nb * t.type_size)


# MXFP4 exponents that must survive: the subnormal scales (0, 1), the smallest normal (2), 1 (128), and
# (nonfinite) those whose larger codes overflow to inf (253..255; 255 is 2^127, not NaN)
MX_EXPONENTS = [0, 1, 2, 3, 100, 127, 128, 129, 160]
MX_OVERFLOW = [253, 254, 255]


def mxfp4_blocks(rng, n: int, k: int, nonfinite: bool = False) -> np.ndarray:
    """(n, row bytes) MXFP4 blocks: the gguf package's quantization of random rows of many magnitudes,
    some blocks' codes replaced by random bytes (every code occurs), some all 7 (12) or all 15 (-12),
    the special exponents sprinkled in."""
    gguf = pytest.importorskip("gguf", reason="the gguf package (test extra) quantizes MXFP4 blocks")
    nb = k // 32
    w = (rng.standard_normal((n, k)) * np.exp2(rng.integers(-10, 4, (n, 1)))).astype(np.float32)
    b = gguf.quants.quantize(w, gguf.GGMLQuantizationType.MXFP4).reshape(n, nb, 17).copy()
    pick = rng.random((n, nb))
    b[pick < 0.3, 1:] = rng.integers(0, 256, (int((pick < 0.3).sum()), 16), dtype=np.uint8)
    b[(pick >= 0.3) & (pick < 0.33), 1:] = 0x77
    b[(pick >= 0.33) & (pick < 0.36), 1:] = 0xFF
    special = np.array(MX_EXPONENTS + (MX_OVERFLOW if nonfinite else []), np.uint8)
    pick = rng.random((n, nb)) < 0.08
    b[pick, 0] = special[rng.integers(0, special.size, int(pick.sum()))]
    return b.reshape(n, nb * 17)


def fp32_product(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    matmul(x, layout.pack_panels(w), w.shape[0], out)
    return out


def native_product(x: np.ndarray, qp: layout.QPanels, res: np.ndarray | None = None) -> np.ndarray:
    out = np.full((x.shape[0], qp.n), np.nan, np.float32)
    matmul(x, qp, qp.n, out, res)
    return out


def test_constants_match_the_float_kernel():
    # a quantized panel is one 32-lane vector, a pair of them one 64-lane float panel's width
    assert layout.QPANEL == simd.HALF and simd.LANES == 2 * simd.HALF == 64
    assert layout.QBLOCK == 32 and simd.KBLOCK % layout.QBLOCK == 0
    assert set(layout.NATIVE_TYPES) == {layout.Q8_0, layout.Q4_0, layout.Q4_1, layout.Q5_0, layout.Q5_1, layout.Q4_K,
                                        layout.Q5_K, layout.Q6_K, layout.MXFP4} == {GGML_TYPE_IDS[n] for n in NATIVE}
    assert layout.QK_K == 256 and {GGML_TYPE_IDS[n] for n in K_QUANTS} == set(layout.K_QUANTS)


# --- 1. random blocks: bit for bit against the fp32 path, every T and thread count ------------------------

@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", OLD)
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


@pytest.mark.parametrize("name", OLD + NEW)
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


def test_scale_widenings_agree_but_on_signaling_nans():
    """The kernels' integer widening of fp16 scales (F16C aside) equals NumPy's cast on every pattern
    but the signaling NaNs, which the packer quiets (`repack.quiet_snans`): on the quieted pattern both
    give the quiet NaN that NumPy's dequantization makes of every weight the original scale multiplies."""
    allh = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    snan = ((allh & 0x7C00) == 0x7C00) & ((allh & 0x03FF) != 0) & ((allh & 0x0200) == 0)
    want = allh.view(np.float16).astype(np.float32)
    got = simd.from_f16_bits(allh)
    assert np.array_equal(u32(got)[~snan], u32(want)[~snan])
    quiet = allh[snan] | np.uint16(0x0200)
    with np.errstate(invalid="ignore"):
        weights = want[snan] * np.float32(3.0)  # NumPy's dequantization: d * q
    assert np.array_equal(u32(simd.from_f16_bits(quiet)), u32(weights))
    assert np.array_equal(u32(quiet.view(np.float16).astype(np.float32)), u32(weights))


def test_every_quant_value_and_sign_is_exact():
    """A hand-made matrix whose rows are single blocks holding all 16 nibbles (or all 256 int8 values),
    times unit vectors: each output is one weight, exactly as dequantize gives it."""
    for name in OLD:
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
    k, hd = k_for(name, 192), 32
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
    for f in ("qs", "d", "m", "sc", "qh"):
        a, b = getattr(qp, f), getattr(whole, f)
        assert (a is None and b is None) or np.array_equal(a, b)


@pytest.mark.parametrize("name", NATIVE)
def test_embed_rows_equal_dequantize(name):
    tid = GGML_TYPE_IDS[name]
    n, k = 300, k_for(name, 96)
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
    n, k = 96, k_for(name, 128)
    layers = [layout.pack_quantized(random_blocks(name, n, k, seed=30 + i), tid, k) for i in range(3)]
    st = layout.stack(layers)
    assert st.qs.shape == (3,) + layers[0].qs.shape
    for i, lq in enumerate(layers):
        one = layout.layer_of(st, i)
        assert all(np.array_equal(a, b) for a, b in zip(one.arrays(), lq.arrays())) and len(one.arrays()) == len(
            lq.arrays())
    rng = np.random.default_rng(4)
    for T in (1, 4, 8):
        x = rng.standard_normal((T, k)).astype(np.float32)
        for i, lq in enumerate(layers):
            one = layout.layer_of(st, i)
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
    def run(x, w, li, n, out, nth, mode, kind):  # ints as arguments: matmul's specialization of mm
        mm(x, loaders.layer(w, li), n, out, nth, mode, out, out, kind, scratch(nth, x.shape[1]))

    rng = np.random.default_rng(5)
    for name in NATIVE:
        tid = GGML_TYPE_IDS[name]
        n, k = 70, k_for(name, 64)
        layers = [layout.pack_quantized(random_blocks(name, n, k, seed=40 + i), tid, k) for i in range(2)]
        st = layout.stack(layers)
        w = as_storage(st)
        assert len(w) == 6 and w[0] is tag("native", name)
        for T in (1, 6):
            x = rng.standard_normal((T, k)).astype(np.float32)
            for li in range(2):
                got = np.empty((T, n), np.float32)
                run(x, w, li, n, got, 2, MM_PLAIN, 0)
                assert_same_bits(got, native_product(x, layers[li]), f"{name} T={T} layer {li}")


def test_bytes_per_weight():
    n, k = 640, 1024
    per_weight = {name: layout.pack_quantized(random_blocks(name, n, k, 0), GGML_TYPE_IDS[name], k).nbytes / (n * k)
                  for name in NATIVE}
    assert per_weight == {"Q8_0": 34 / 32, "Q4_0": 18 / 32, "Q4_1": 20 / 32, "Q5_0": 22 / 32, "Q5_1": 24 / 32,
                          "Q4_K": 144 / 256,
                          "Q5_K": 176 / 256, "Q6_K": 210 / 256, "MXFP4": 17 / 32}  # GGUF's own sizes


def test_errors():
    raw = random_blocks("Q4_1", 64, 64, 0)
    qp = layout.pack_quantized(raw, layout.Q4_1, 64)
    with pytest.raises(ValueError, match="native storage handles"):
        layout.pack_quantized(raw, GGML_TYPE_IDS["BF16"], 64)
    with pytest.raises(ValueError, match="multiple of 256"):
        layout.pack_quantized(random_blocks("Q6_K", 4, 256, 0).reshape(-1)[:4 * 105], layout.Q6_K, 128)
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


@pytest.mark.slow
def test_generic_x86_64_target_gives_the_same_bits(tmp_path):
    """Compiled for a generic x86-64 (the vectors split into SSE registers; no F16C, FMA or AVX-512:
    integer fp16 widening, unfused multiply-adds, nibbles masked in place rather than looked up), the
    same bits: Q4_1, Q5_K (the 5th bits, the 6-bit sub-block scales and mins), Q6_K (the 2 high
    bits, int8 scales, no mins) and MXFP4 (its codes' values computed from their bits, not looked up). Q5_0 runs Q5_K's 5-bit blocks with Q6_K's scale-only weights; each
    type is a compile of the whole product (about a minute of CI), so it is left to the host build."""
    cases = [("Q4_1", 100, 160), ("Q5_K", 70, 512), ("Q6_K", 40, 256), ("MXFP4", 100, 160)]
    script = tmp_path / "gen.py"
    script.write_text(
        "import sys, numpy as np, tinydet\n"
        "from tinydet.packing import layout\n"
        "from tinydet.backends.cpu.matmul import matmul\n"
        "from tinydet.formats.ggml import GGML_TYPE_IDS\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from test_native import random_blocks\n"
        f"for name, n, k in {cases!r}:\n"
        "    raw = random_blocks(name, n, k, 9)\n"
        "    qp = layout.pack_quantized(raw, GGML_TYPE_IDS[name], k)\n"
        "    x = np.random.default_rng(0).standard_normal((7, k)).astype(np.float32)\n"
        "    out = np.empty((8, n), np.float32)\n"
        "    matmul(x[:1], qp, n, out[:1])\n"
        "    matmul(x, qp, n, out[1:])\n"
        "    np.save(sys.argv[2] + name + '.npy', out)\n")
    # numba's cache keys kernels by target: this one's sit beside the host's (and golden's generic run's)
    env = dict(os.environ, NUMBA_CPU_NAME="generic", NUMBA_CACHE_DIR=numba.config.CACHE_DIR)
    env.pop("NUMBA_CPU_FEATURES", None)
    dest = tmp_path / "out-"
    r = subprocess.run([sys.executable, str(script), str(Path(__file__).parent), str(dest)], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    for name, n, k in cases:
        got = np.load(f"{dest}{name}.npy")
        raw = random_blocks(name, n, k, 9)
        x = np.random.default_rng(0).standard_normal((7, k)).astype(np.float32)
        want = fp32_product(x, dequantize(raw, GGML_TYPE_IDS[name], (n, k)))
        assert_same_bits(got[:1], want[:1], name)
        assert_same_bits(got[1:], want, name)


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


def test_signaling_nan_scales_are_stored_quieted():
    """F16C quiets signaling NaNs and the integer widening does not: the packer stores such a scale
    quieted (still fp16 bits), and the product and the embedding rows still equal fp32's."""
    n, k = 40, 64
    raw = random_blocks("Q8_0", n, k, seed=7)
    blocks = raw.reshape(n, k // 32, 34)
    blocks[3, 1, 0:2] = np.array([0x7C01], "<u2").view(np.uint8)  # a signaling NaN scale
    qp = layout.pack_quantized(raw, layout.Q8_0, k)
    assert qp.d.dtype == np.uint16 and qp.d[0, 1, 3] == 0x7E01
    w = dequantize(raw, layout.Q8_0, (n, k))
    x = np.random.default_rng(4).standard_normal((3, k)).astype(np.float32)
    for T in (1, 3):
        assert_same_bits(native_product(x[:T], qp), fp32_product(x[:T], w))
    rows = np.empty((n, k), np.float32)
    loaders.embed(qp, np.arange(n), rows)
    assert np.array_equal(u32(rows), u32(w))  # NaN payloads too


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


# --- 4. Q5_0 and the K-quants: more token counts, a float64 reference, every quant value -------------------

def float64_bound(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x W^T in float64 and a bound on a float32 block-Kahan sum's error: each 64-term block partial
    is a plain float32 sum (at most ~64 roundings of its magnitude), the Kahan steps add a few more."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    return x64 @ w64.T, 80 * 2.0 ** -24 * (np.abs(x64) @ np.abs(w64).T) + 1e-37


@pytest.mark.parametrize("name", NEW)
def test_new_types_equal_fp32_matmul(name, restore_threads):
    """Every T from 1 to 20, 64 and 100 (every tile shape, chunked prefill jobs), odd output counts,
    threads 1/2/3: fp32's bits, and within rounding of the float64 product."""
    tid = GGML_TYPE_IDS[name]
    rng = np.random.default_rng(8)
    for n, k in (K_SHAPES if name in K_QUANTS else SHAPES[:2] + [(100, 96), (33, 288)]):
        raw = random_blocks(name, n, k, seed=n + k)
        w = dequantize(raw, tid, (n, k))
        assert np.isfinite(w).all()
        qp = layout.pack_quantized(raw, tid, k)
        assert all(a.dtype != np.float32 for a in (qp.d, qp.m) if a is not None)  # finite: fp16 bits kept
        x = rng.standard_normal((max(NEW_TOKENS), k)).astype(np.float32)
        want_all = fp32_product(x, w)
        ref, bound = float64_bound(x, w)
        assert (np.abs(want_all - ref) <= bound).all()
        for T in NEW_TOKENS:
            want = fp32_product(x[:T], w)
            assert_same_bits(want, want_all[:T], f"{name} fp32 T={T}")  # prefill rows = each row alone
            for threads in THREADS:
                numba.set_num_threads(threads)
                assert_same_bits(native_product(x[:T], qp), want, f"{name} {n}x{k} T={T} threads={threads}")


def hand_blocks(name: str, n: int) -> np.ndarray:
    """n rows of one block (Q5_0) or super-block whose quants run through every value (row r, element e:
    quant (7r + e) mod 2**bits), with negative d, positive dmin, and sub-block scales and mins through
    0..63 (Q6_K: int8 scales through -128..127)."""
    tid = GGML_TYPE_IDS[name]
    t = GGML_TYPES[tid]
    r = np.arange(n)[:, None]
    e = np.arange(t.block_size)[None, :]
    bits_ = {"Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6}[name]
    q = ((7 * r + e) % (1 << bits_)).astype(np.uint8)  # (n, elements): the quant of each element
    b = np.zeros((n, t.type_size), np.uint8)

    def h(x):
        return np.full(n, x, np.uint16).view(np.uint8).reshape(n, 2)

    lo, hi = q & 15, q >> 4
    if name == "Q5_0":
        b[:, 0:2] = h(0xB1A3)  # d < 0
        b[:, 2:6] = np.packbits(hi, axis=1, bitorder="little")
        b[:, 6:22] = lo[:, :16] | (lo[:, 16:] << 4)
    elif name == "Q5_1":
        b[:, 0:2], b[:, 2:4] = h(0xB1A3), h(0x3555)  # d < 0, m > 0
        b[:, 4:8] = np.packbits(hi, axis=1, bitorder="little")
        b[:, 8:24] = lo[:, :16] | (lo[:, 16:] << 4)
    elif name in ("Q4_K", "Q5_K"):
        b[:, 0:2], b[:, 2:4] = h(0xB1A3), h(0x3555)
        b[:, 4:16] = (r * 13 + np.arange(12)[None, :] * 37) % 256  # every 6-bit scale and min over the rows
        qs = 16 if name == "Q4_K" else 48
        sub = lo.reshape(n, 4, 2, 32)  # sub-block 2c low nibbles, 2c + 1 high, of bytes 32c..
        b[:, qs:qs + 128] = (sub[:, :, 0] | (sub[:, :, 1] << 4)).reshape(n, 128)
        if name == "Q5_K":  # bit i of byte l: the 5th bit of element l of sub-block i
            b[:, 16:48] = np.packbits(hi.reshape(n, 8, 32).transpose(0, 2, 1), axis=2, bitorder="little")[:, :, 0]
    else:  # Q6_K, formats.dequant's interleaving
        ql = np.zeros((n, 2, 2, 32), np.uint8)
        qh = np.zeros((n, 2, 32), np.uint8)
        qq = q.reshape(n, 2, 4, 32)  # [half][run of 32][l]
        ql[:, :, 0] = (qq[:, :, 0] & 15) | ((qq[:, :, 2] & 15) << 4)
        ql[:, :, 1] = (qq[:, :, 1] & 15) | ((qq[:, :, 3] & 15) << 4)
        for run in range(4):
            qh |= (qq[:, :, run] >> 4) << (2 * run)
        b[:, 0:128] = ql.reshape(n, 128)
        b[:, 128:192] = qh.reshape(n, 64)
        b[:, 192:208] = ((r * 29 + np.arange(16)[None, :] * 17) % 256).astype(np.uint8)
        b[:, 208:210] = h(0xB1A3)
    return b


@pytest.mark.parametrize("name", NEW)
def test_new_types_every_quant_value_is_exact(name):
    """Rows of one (super-)block holding every quant value (and every 6-bit scale and min, every int8
    scale), times unit vectors: each output is one weight, exactly as dequantize gives it; embedding
    rows are the weights."""
    tid = GGML_TYPE_IDS[name]
    n = 96
    b = hand_blocks(name, n)
    k = GGML_TYPES[tid].block_size
    w = dequantize(b, tid, (n, k))
    assert len(np.unique(w)) >= 32
    qp = layout.pack_quantized(b, tid, k)
    x = np.eye(k, dtype=np.float32)
    assert_same_bits(native_product(x, qp), np.ascontiguousarray(w.T) + np.float32(0.0), name)
    assert_same_bits(native_product(x, qp), fp32_product(x, w), name)
    assert_same_bits(native_product(x[:1], qp), fp32_product(x[:1], w), name)
    rows = np.empty((n, k), np.float32)
    loaders.embed(qp, np.arange(n), rows)
    assert_same_bits(rows, w, name)


def test_q5_1_weights_are_gguf_dequantization():
    """Q5_1 (native's newest type, its own row of `qblocks.READERS`): the native kernels' weights (the
    embedding rows) are the gguf package's dequantization bit for bit, and its product fp32's."""
    gguf = pytest.importorskip("gguf", reason="the gguf package (test extra) is the reference")
    n, k = 70, 256
    raw = random_blocks("Q5_1", n, k, seed=12)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_1).astype(np.float32).reshape(n, k)
    qp = layout.pack_quantized(raw, layout.Q5_1, k)
    assert as_storage(qp)[0] is tag("native", "Q5_1")
    rows = np.empty((n, k), np.float32)
    loaders.embed(qp, np.arange(n), rows)
    assert_same_bits(rows, want, "Q5_1 rows")
    x = np.random.default_rng(2).standard_normal((5, k)).astype(np.float32)
    for T in (1, 5):
        assert_same_bits(native_product(x[:T], qp), fp32_product(x[:T], want), f"Q5_1 T={T}")


def test_k_quant_fused_multiply_add_is_exact():
    """Q4_K/Q5_K's kernel may fuse (dl * q) - ml into one FMA: for every finite fp16 d, every 6-bit
    scale sc and every 5-bit q, dl = d * sc and dl * q are exact in float32 (equal the float64 ones)."""
    d = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    d = d[np.isfinite(d)]
    q = np.arange(32, dtype=np.float32)
    for sc in range(64):
        dl = d * np.float32(sc)
        assert np.array_equal(dl.astype(np.float64), d.astype(np.float64) * sc)
        assert np.array_equal((dl[:, None] * q[None, :]).astype(np.float64), dl.astype(np.float64)[:, None] * q)


# --- 5. matrix kinds of mixed types (layout.MixedPanels) ---------------------------------------------------

def mixed_segment(name: str, rows: int, k: int, seed: int):
    """((key, rows, make) for layout.pack_mixed, the segment's float32 matrix): a quant type's random
    blocks, or random float32 ("f32") or fp16 ("f16") rows."""
    if name in ("f32", "f16"):
        w = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32)
        if name == "f16":
            h = w.astype(np.float16)
            return ("f16", rows, lambda: layout.pack_panels(h.view(np.uint16))), h.astype(np.float32)
        return ("f32", rows, lambda: layout.pack_panels(w)), w
    tid = GGML_TYPE_IDS[name]
    raw = random_blocks(name, rows, k, seed)
    return (tid, rows, lambda: layout.pack_quantized(raw, tid, k)), dequantize(raw, tid, (rows, k))


@numba.njit
def _mixed_mm(x, w, li, n, out, nth, mode, act, kind):
    mm(x, loaders.layer(w, li), n, out, nth, mode, out, act, kind, scratch(nth, x.shape[1]))


MIXED = {
    # a Q4_K_M file's [wq; wk; wv]: runs of rows of two types, which may also change between layers
    "runs": (512, [[("Q5_0", 128), ("Q8_0", 70)], [("Q8_0", 64), ("Q5_0", 134)], [("Q5_0", 198)]]),
    # its ffn_down: one type per layer, plus float parts (F32 / F16 rows, or a type without a kernel)
    "layers": (768, [[("Q4_K", 256)], [("Q6_K", 256)], [("f32", 64), ("Q6_K", 64), ("f16", 128)],
                     [("Q4_K", 128), ("Q6_K", 128)]]),
    # MXFP4 (uint8 exponents) beside fp16-scaled types, in runs and alone
    "mxfp4": (256, [[("MXFP4", 128), ("Q8_0", 70)], [("Q4_0", 64), ("MXFP4", 134)], [("MXFP4", 198)]]),
}


@pytest.mark.parametrize("case", list(MIXED))
def test_mixed_kinds_equal_fp32(case, restore_threads):
    """Each layer of a MixedPanels stack gives the bits of its float32 matrix, decode and prefill, at
    threads 1/2/3, through loaders.layer as the forward pass reads it; and the gated-activation
    epilogue (gate and up from different parts) gives fp32's activations."""
    k, plan = MIXED[case]
    segs = [[mixed_segment(name, rows, k, seed=100 * li + s) for s, (name, rows) in enumerate(layer_plan)]
            for li, layer_plan in enumerate(plan)]
    mp = layout.pack_mixed([[seg for seg, _ in layer_segs] for layer_segs in segs], k)
    n = mp.n
    assert mp.nbytes < 4 * n * k * len(plan) / 2  # mostly quantized
    st = as_storage(mp)
    rng = np.random.default_rng(9)
    for li, layer_segs in enumerate(segs):
        w = np.concatenate([m for _, m in layer_segs])
        for T in (1, 2, 5, 7, 20):
            x = rng.standard_normal((T, k)).astype(np.float32)
            want = fp32_product(x, w)
            for threads in THREADS:
                got = np.full((T, n), np.nan, np.float32)
                _mixed_mm(x, st, li, n, got, threads, MM_PLAIN, got, SILU)
                assert_same_bits(got, want, f"{case} layer {li} T={T} threads={threads}")
            # [gate | up] = [rows 0..n/2 | rows n/2..n] (n/2 a multiple of 64): the fused activation
            ffn = n // 2
            if ffn % 64 == 0:
                act = np.full((T, ffn), np.nan, np.float32)
                gu = np.empty((T, n), np.float32)
                _mixed_mm(x, st, li, n, gu, 2, MM_GLU, act, SILU)
                want_act = np.empty((T, ffn), np.float32)
                glu_rows(want, ffn, want_act, SILU)
                assert_same_bits(act, want_act, f"{case} layer {li} T={T} GLU")


def test_mixed_errors():
    seg_a, _ = mixed_segment("Q8_0", 70, 64, 0)
    seg_b, _ = mixed_segment("Q4_0", 64, 64, 1)
    with pytest.raises(ValueError, match="multiple of 64"):
        layout.pack_mixed([[seg_a, seg_b]], 64)  # the second run would start at row 70
    with pytest.raises(ValueError, match="row count"):
        layout.pack_mixed([[seg_b], [seg_a]], 64)
    seg_c, _ = mixed_segment("Q8_0", 64, 64, 2)
    seg_d, _ = mixed_segment("Q4_0", 70, 64, 3)
    mp = layout.pack_mixed([[seg_b, seg_a], [seg_c, seg_d]], 64)
    assert mp.type_name == "Q4_0+Q8_0" and mp.n == 134
    bad = layout.MixedPanels(mp.n, mp.k, mp.parts, mp.table.copy())
    bad.table[0, 1, 1] = 10 ** 6  # a panel past the part's end
    with pytest.raises(ValueError, match="do not fit"):
        bad.check()


# --- 6. the real Gemma 3 270M Q4_K_M file: every kind of matrix it has --------------------------------------

def test_gemma3_every_matrix_kind_bit_identical(gemma3_path, restore_threads):
    """For each (type, shape) of the file's matrices (Q8_0, Q5_0, Q4_K, Q6_K), two layers' tensors (the
    first and the last), and a slice of the Q8_0 token table: native products at T = 1 and 5 equal
    fp32's bits, embedding rows equal dequantize; the kinds that mix types ([wq; wk] Q5_0 with wv
    Q8_0, ffn_down Q4_K in some layers and Q6_K in others) as MixedPanels equal fp32 too."""
    g = GGUFFile(gemma3_path)
    info = g.tensors
    numba.set_num_threads(2)
    rng = np.random.default_rng(0)
    spread = np.array([[1.0], [0.1], [3.0], [30.0], [1.0]])
    by_kind: dict = {}
    for name, t in info.items():
        if len(t.shape) == 2 and name != "token_embd.weight":
            by_kind.setdefault((t.type_name, t.shape), []).append(name)
    assert {kind[0] for kind in by_kind} == {"Q8_0", "Q5_0", "Q4_K", "Q6_K"}

    def check(raw, tid, shape, what):
        n, k = shape
        qp = layout.pack_quantized(raw, tid, k)
        w = dequantize(raw, tid, shape)
        x = (rng.standard_normal((5, k)) * spread).astype(np.float32)
        want = fp32_product(x, w)
        assert np.isfinite(want).all()
        assert_same_bits(native_product(x, qp), want, f"{what} T=5")
        assert_same_bits(native_product(x[:1], qp), want[:1], f"{what} T=1")
        ids = np.array([0, n - 1, n // 2, 33])
        rows = np.empty((ids.size, k), np.float32)
        loaders.embed(qp, ids, rows)
        assert_same_bits(rows, w[ids], f"{what} rows")

    for (tname, shape), names in sorted(by_kind.items()):
        for name in sorted({names[0], names[-1]}):
            check(g.tensor_bytes(name), info[name].ggml_type, shape, f"{name} {tname} {shape}")
    emb = info["token_embd.weight"]
    rb = emb.shape[1] // 32 * 34
    raw = g.tensor_bytes("token_embd.weight").reshape(emb.shape[0], rb)
    for r0 in (0, 100_000, emb.shape[0] - 1000):  # slices of the 262144 x 640 table
        check(np.ascontiguousarray(raw[r0:r0 + 1000]), emb.ggml_type, (1000, emb.shape[1]), f"token_embd[{r0}:]")

    # the mixed kinds, two layers each, as weights.py packs them
    n_layers = g.require("gemma3.block_count")
    down = [f"blk.{i}.ffn_down.weight" for i in range(n_layers)]
    down_types = {info[d].type_name for d in down}
    assert down_types == {"Q4_K", "Q6_K"}
    pick = [next(d for d in down if info[d].type_name == t) for t in sorted(down_types)]
    qkv = [[f"blk.{i}.attn_{p}.weight" for p in "qkv"] for i in (0, n_layers - 1)]
    assert [info[q].type_name for q in qkv[0]] == ["Q5_0", "Q5_0", "Q8_0"]
    for kind in ([[d] for d in pick], qkv):
        k = info[kind[0][0]].shape[1]
        layers = []
        for names in kind:
            segs = []
            for name in names:
                t = info[name]
                raw = g.tensor_bytes(name)
                if segs and segs[-1][0] == t.ggml_type:  # consecutive parts of one type: one run
                    prev = segs.pop()
                    raw = np.concatenate([prev[3], raw.reshape(-1)])
                rows = raw.size // (k // GGML_TYPES[t.ggml_type].block_size * GGML_TYPES[t.ggml_type].type_size)
                segs.append((t.ggml_type, rows, None, raw.reshape(-1)))
            layers.append(segs)
        mp = layout.pack_mixed([[(tid, rows, lambda raw=raw, tid=tid: layout.pack_quantized(raw, tid, k))
                                 for tid, rows, _, raw in segs] for segs in layers], k)
        st = as_storage(mp)
        for li, segs in enumerate(layers):
            w = np.concatenate([dequantize(raw, tid, (rows, k)) for tid, rows, _, raw in segs])
            x = (rng.standard_normal((5, k)) * spread).astype(np.float32)
            want = fp32_product(x, w)
            for T in (1, 5):
                got = np.empty((T, mp.n), np.float32)
                _mixed_mm(x[:T], st, li, mp.n, got, 2, MM_PLAIN, got, SILU)
                assert_same_bits(got, want[:T], f"{mp.type_name} layer {li} T={T}")


@pytest.mark.parametrize("name", ["Q8_0", "Q5_0", "Q6_K", "MXFP4"])
def test_pack_parts_releases_each_chunk_after_copying_it(name, monkeypatch):
    """`pack_parts(..., release=)` (a token table letting its file pages go while it packs) calls
    release(r0, r1) once per chunk, in order, covering every row, and only after those rows are in
    the panels: overwriting each chunk's raw bytes as it is released (as if its pages were gone for
    good) leaves the packed matrix equal to the one packed without release."""
    monkeypatch.setattr(layout, "_CHUNK_ROWS", 64)
    tid = GGML_TYPE_IDS[name]
    n, k = 200, k_for(name, 96)
    raw = random_blocks(name, n, k, seed=31)
    want = layout.pack_quantized(raw, tid, k)
    work = raw.copy()
    calls = []

    def release(r0, r1):
        calls.append((r0, r1))
        work[r0:r1] = 0xFF  # NaN scales and other quants: any later read of these rows would show

    got = layout.pack_parts([(work, None, tid)], tid, k, release=release)
    assert calls == [(0, 64), (64, 128), (128, 192), (192, 200)]
    for f in ("qs", "d", "m", "sc", "qh"):
        a, b = getattr(got, f), getattr(want, f)
        assert (a is None and b is None) or (a.dtype == b.dtype and np.array_equal(a, b)), f


def test_scale_quieting_reads_every_panel():
    """Scales are quieted in place: a signaling NaN in the last panel of a 4-panel matrix is quieted,
    and every other scale kept as its fp16 bits."""
    n, k = 100, 64  # 4 panels
    raw = random_blocks("Q8_0", n, k, seed=8)
    raw.reshape(n, k // 32, 34)[n - 1, 1, 0:2] = np.array([0x7C01], "<u2").view(np.uint8)  # in the last panel
    qp = layout.pack_quantized(raw, layout.Q8_0, k)
    bits = np.ascontiguousarray(raw.reshape(n, k // 32, 34)[:, :, 0:2]).view("<u2")[:, :, 0]
    want = np.zeros((4 * 32, k // 32), np.uint16)
    want[:n] = bits
    want[n - 1, 1] = 0x7E01
    assert qp.d.dtype == np.uint16 and np.array_equal(qp.d.transpose(0, 2, 1).reshape(-1, k // 32), want)


# --- 6. MXFP4: E8M0 exponents, E2M1 codes ------------------------------------------------------------------

MX_SHAPES = [(200, 576), (100, 96), (33, 288), (70, 1536)]  # partial panels, K = 3, 9, 18, 48 blocks


def test_mxfp4_equals_fp32_matmul(restore_threads):
    """Every T from 1 to 20, 64 and 100 (decode, the few-rows path, prefill's dequantized pairs and
    every tile shape), odd output counts, K of several blocks, threads 1/2/3: fp32's bits, and within
    rounding of the float64 product."""
    tid = GGML_TYPE_IDS["MXFP4"]
    rng = np.random.default_rng(9)
    for n, k in MX_SHAPES:
        raw = random_blocks("MXFP4", n, k, seed=n + k)
        w = dequantize(raw, tid, (n, k))
        assert np.isfinite(w).all()
        qp = layout.pack_quantized(raw, tid, k)
        assert qp.d.dtype == np.uint8 and qp.d.shape == (-(-n // 32), k // 32, 32) and qp.m is None
        x = rng.standard_normal((max(NEW_TOKENS), k)).astype(np.float32)
        want_all = fp32_product(x, w)
        ref, bound = float64_bound(x, w)
        assert (np.abs(want_all - ref) <= bound).all()
        for T in NEW_TOKENS:
            want = fp32_product(x[:T], w)
            for threads in THREADS:
                numba.set_num_threads(threads)
                assert_same_bits(native_product(x[:T], qp), want, f"MXFP4 {n}x{k} T={T} threads={threads}")


def test_mxfp4_every_code_and_exponent_is_exact():
    """Rows of one block holding all 16 codes, at every exponent 0..255, times unit vectors: each output
    is one weight exactly as dequantize gives it (the subnormal scales of e = 0 and 1, code 8's +0, the
    overflows to +-inf of the large exponents); embedding rows are the weights."""
    tid = GGML_TYPE_IDS["MXFP4"]
    n, k = 256, 32
    b = np.zeros((n, 17), np.uint8)
    b[:, 0] = np.arange(n)
    codes = (np.arange(n)[:, None] * 5 + np.arange(32)[None, :]) % 16
    b[:, 1:] = codes[:, :16] | (codes[:, 16:] << 4)
    w = dequantize(b, tid, (n, k))
    assert np.isinf(w).any() and (w.view(np.uint32) == 0x00200000).any()
    qp = layout.pack_quantized(b, tid, k)
    finite = np.isfinite(w).all(axis=1)  # an inf weight times a 0 of a unit vector is NaN: those rows apart
    x = np.eye(k, dtype=np.float32)
    got = native_product(x, qp)
    assert_same_bits(got[:, finite], np.ascontiguousarray(w[finite].T) + np.float32(0.0), "MXFP4")
    assert_same_bits(got, fp32_product(x, w), "MXFP4")
    assert_same_bits(native_product(x[:1], qp), fp32_product(x[:1], w), "MXFP4")
    assert_same_bits(native_product(np.ones((3, k), np.float32), qp), fp32_product(np.ones((3, k), np.float32), w))
    rows = np.empty((n, k), np.float32)
    loaders.embed(qp, np.arange(n), rows)
    assert_same_bits(rows, w, "MXFP4 rows")


def test_mxfp4_overflowing_exponents(restore_threads):
    """Exponents whose larger codes overflow to inf (253..255) among ordinary blocks: inf and NaN outputs
    where the fp32 path has them, the same bits elsewhere, decode and prefill."""
    tid = GGML_TYPE_IDS["MXFP4"]
    n, k = 130, 256
    raw = random_blocks("MXFP4", n, k, seed=3, nonfinite=True)
    w = dequantize(raw, tid, (n, k))
    assert np.isinf(w).any() and not np.isnan(w).any()
    qp = layout.pack_quantized(raw, tid, k)
    x = np.random.default_rng(1).standard_normal((40, k)).astype(np.float32)
    want = fp32_product(x, w)
    assert np.isnan(want).any() and np.isfinite(want).any()
    for threads in (1, 2):
        numba.set_num_threads(threads)
        for T in (1, 2, 9, 40):
            assert_same_bits(native_product(x[:T], qp), want[:T], f"MXFP4 T={T} threads={threads}")

