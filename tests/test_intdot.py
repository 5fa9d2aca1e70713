"""The integer mode (dtype "int8": backends/cpu/actq.py, intdot.py; packing/intpanels.py) against the
independent NumPy reference of its rules (intref.py), bit for bit: activation quantization (ties, zero
blocks, extremes, non-finite values), every type's product (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K, MXFP4) at every
token count and thread count, the worst case magnitudes, and the generic and AVX2 builds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest

import intref
from test_native import assert_same_bits, random_blocks
from tinydet.backends.cpu import actq
from tinydet.packing import intpanels, layout
from tinydet.backends.cpu.matmul import matmul
from tinydet.formats.dequant import dequantize
from tinydet.formats.ggml import GGML_TYPE_IDS
from tinydet.tools.verify import AVX2_FEATURES

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "MXFP4"]
K_TYPES = ["Q4_K", "Q5_K", "Q6_K"]
f32 = np.float32


def unslot(xq: np.ndarray) -> np.ndarray:
    """actq's stored order (groups of 8 as 0, 2, 4, 6, 1, 3, 5, 7) back to element order."""
    T, K = xq.shape
    g = xq.reshape(T, K // 8, 2, 4)  # [evens, odds]
    return g.transpose(0, 1, 3, 2).reshape(T, K)


def tricky_rows(rng, T, K):
    """Rows whose blocks hit the rule's edges: ties (x * id = k + 0.5 exactly), zero blocks, amax at
    float32's extremes and below 2^-64, one huge value among tiny ones, ordinary normals."""
    x = rng.standard_normal((T, K)).astype(f32)
    for t in range(T):
        for b in range(K // 32):
            blk = x[t, 32 * b:32 * b + 32]
            kind = (t * 7 + b) % 8
            if kind == 0:  # amax 127: id = 1, halves are ties
                blk[:] = rng.integers(-126, 126, 32) + f32(0.5)
                blk[rng.integers(0, 32)] = f32(-127.0)
            elif kind == 1:  # amax 254: id = 0.5, odd integers are ties
                blk[:] = 2 * rng.integers(-63, 63, 32) + 1
                blk[0] = f32(254.0)
            elif kind == 2:
                blk[:] = 0
                blk[5] = -0.0
            elif kind == 3:
                blk *= f32(3e37)
            elif kind == 4:
                blk *= f32(1e-21)  # amax below 2^-64: zeros
            elif kind == 5:
                blk *= f32(1e-30)
                blk[3] = f32(2e-19)
    return x


def test_activation_quantization_equals_reference():
    rng = np.random.default_rng(1)
    x = tricky_rows(rng, 9, 256)
    xq, xd, xs = actq.quantize(x, 32)
    q, d = intref.quantize(x)
    assert np.array_equal(unslot(xq).astype(np.int64), q)
    assert np.array_equal(xd.view(np.uint32), d.view(np.uint32))
    assert np.array_equal(xs, q.reshape(9, -1, 16).sum(axis=2))
    assert (np.abs(q) == 127).any() and (d == 0).any() and (q.reshape(9, -1, 32) == 0).all(axis=2).any()
    # the ties really occur and go to even
    v = x[0, :32] * (f32(127) / np.abs(x[0, :32]).max())
    assert (v - np.floor(v) == 0.5).any()


def test_nonfinite_activations_make_their_blocks_nan():
    x = np.ones((3, 64), f32)
    x[0, 3], x[1, 40], x[2, 0] = np.nan, np.inf, -np.inf
    xq, xd, _ = actq.quantize(x, 32)
    assert np.isnan(xd[0, 0]) and xd[0, 1] == f32(1 / 127) and np.isnan(xd[1, 1]) and np.isnan(xd[2, 0])
    assert (xq[0, :32] == 0).all() and (xq[1, 32:] == 0).all()
    raw = random_blocks("Q4_0", 40, 64, 3)
    qp = intpanels.from_qpanels(layout.pack_quantized(raw, GGML_TYPE_IDS["Q4_0"], 64))
    out = np.empty((3, 40), f32)
    matmul(x, qp, 40, out)
    assert np.isnan(out).all()


@pytest.mark.parametrize("name", TYPES)
def test_reference_reads_the_files_quants(name):
    """The reference's integer quants and scales are the gguf dequantization's values."""
    n, k = 50, 128
    raw = random_blocks(name, n, k, 5)
    q, d, m = intref.block_quants(raw, name, n, k)
    qd = (q - intref.OFFSET[name]).astype(f32).reshape(n, -1, 32)
    w = qd * d[:, :, None] if m is None else d[:, :, None] * qd + m[:, :, None]
    want = dequantize(raw, GGML_TYPE_IDS[name], (n, k))
    ok = np.isfinite(want)
    assert np.array_equal(w.reshape(n, k)[ok], want[ok])


@pytest.mark.parametrize("name", K_TYPES)
def test_k_reference_reads_the_files_quants(name):
    """The reference's K-quant integers (quants, sub-block scales and mins) give the gguf package's
    dequantization: dl = d * sc, ml = dmin * mn, w = dl * q - ml (Q6_K: dl * (q - 32))."""
    gguf = pytest.importorskip("gguf")
    n, k = 40, 512
    raw = random_blocks(name, n, k, 5)
    q, sc, mn, d, dmin = intref.k_block_quants(raw, name, n, k)
    if name == "Q6_K":
        dl = d[:, :, None] * sc.reshape(n, -1, 16).astype(f32)
        w = dl[:, :, :, None] * (q - 32).reshape(n, -1, 16, 16).astype(f32)
    else:
        dl = d[:, :, None] * sc.reshape(n, -1, 8).astype(f32)
        ml = dmin[:, :, None] * mn.reshape(n, -1, 8).astype(f32)
        w = dl[:, :, :, None] * q.reshape(n, -1, 8, 32).astype(f32) - ml[:, :, :, None]
    want = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, name)).reshape(n, k)
    ok = np.isfinite(want)
    assert np.array_equal(w.reshape(n, k)[ok], want[ok].astype(f32))


@pytest.mark.parametrize("name", K_TYPES)
@pytest.mark.parametrize("shape", [(100, 256), (70, 768)])
def test_k_product_equals_reference(name, shape, restore_threads):
    n, k = shape
    raw = random_blocks(name, n, k, 8)
    x = tricky_rows(np.random.default_rng(3), 11, k)
    want = intref.k_product(x, raw, name, n, k)
    for T in (1, 2, 5, 11):
        for th in (1, 2, 3):
            assert_same_bits(int_product(x[:T], raw, name, n, k, th), want[:T], f"{name} T={T} threads={th}")


def int_product(x, raw, name, n, k, threads=None):
    ip = intpanels.from_qpanels(layout.pack_quantized(raw, GGML_TYPE_IDS[name], k))
    out = np.full((x.shape[0], n), np.nan, f32)
    matmul(x, ip, n, out, threads=threads)
    return out


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("shape", [(100, 96), (200, 576)])
def test_product_equals_reference(name, shape, restore_threads):
    n, k = shape
    rng = np.random.default_rng(2)
    raw = random_blocks(name, n, k, 7)
    x = tricky_rows(rng, 17, k)
    want = intref.product(x, raw, name, n, k)
    for T in (1, 2, 3, 4, 5, 10, 17):
        for th in (1, 2, 3):
            assert_same_bits(int_product(x[:T], raw, name, n, k, th), want[:T], f"{name} T={T} threads={th}")
    assert_same_bits(int_product(x[5:6], raw, name, n, k), want[5:6], "a row alone")


ONE = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)


def worst_case(name, n=64, k=256):
    """(raw, x): every quant at its extreme (the first half of the rows at the largest unsigned
    quants: nibbles 15, 5-bit 31, Q6_K's 63; Q8_0's -128 and 127; the K-quants' 6-bit scales and mins
    at 63, Q6_K's int8 scales at -128 and 127) against activations at +-127 in four sign patterns:
    the sums the integer kernels keep (32-bit lanes, AVX2's 16-bit pair sums) at their largest."""
    if name in K_TYPES:
        raw = np.zeros((n, k // 256, intref.K_BLOCK_BYTES[name]), np.uint8)
        if name == "Q6_K":  # ql[128], qh[64], scales[16], d
            raw[: n // 2, :, :192] = 0xFF
            raw[:, :, 192:208] = np.where(np.arange(n) % 4 < 2, 0x80, 0x7F)[:, None, None]
            raw[:, :, 208:210] = ONE
        else:  # d, dmin, scales[12], (Q5_K: qh[32]), qs
            raw[:, :, 0:4] = np.tile(ONE, 2)
            raw[:, :, 4:16] = 0xFF
            raw[: n // 2, :, 16:] = 0xFF
    elif name == "MXFP4":  # codes 7 (12) and 15 (-12): the lookup's largest unsigned bytes, 24 and 0
        raw = np.zeros((n, k // 32, 17), np.uint8)
        raw[:, :, 0] = 128  # d = 1
        raw[: n // 2, :, 1:] = 0x77
        raw[n // 2:, :, 1:] = 0xFF
    else:
        raw = np.zeros((n, k // 32, intref.BLOCK_BYTES[name]), np.uint8)
        raw[:, :, 0:2] = ONE
        if name == "Q8_0":
            raw[: n // 2, :, 2:] = 0x80  # -128
            raw[n // 2:, :, 2:] = 0x7F
        else:
            raw[: n // 2, :, 2:] = 0xFF  # nibbles 15 (Q5_0: 31 with the high bits)
            if name == "Q4_1":
                raw[:, :, 2:4] = np.frombuffer(np.float16(-2.0).tobytes(), np.uint8)
    x = np.ones((4, k), f32)
    x[1] = -1
    x[2, ::2] = -1
    x[3] = np.where(np.arange(k) % 3 == 0, f32(1), f32(-1))
    return raw.reshape(n, -1), x


def reference(name):
    return intref.k_product if name in K_TYPES else intref.product


@pytest.mark.parametrize("name", TYPES + K_TYPES)
def test_worst_case_magnitudes(name):
    """Every quant at its extreme against activations at +-127: no overflow, no saturation."""
    n, k = 64, 256
    raw, x = worst_case(name, n, k)
    want = reference(name)(x, raw, name, n, k)
    assert_same_bits(int_product(x, raw, name, n, k), want, name)
    assert np.isfinite(want).all() and np.abs(want).max() > 0


@pytest.mark.slow
def test_generic_and_avx2_builds_give_the_same_bits(tmp_path):
    """Compiled for a generic x86-64 (plain vector integer IR) and for Haswell (AVX2's vpmaddubsw, its
    16-bit pair sums folded by vpmaddwd), the bits of the reference, as the host build's (AVX-512 VNNI
    here) are, on random blocks and at the worst case magnitudes: every type but Q4_1 and Q8_0, which
    SmolLM2's int8 golden cases run under both builds (`test_golden.py`), each type being a compile of
    its own."""
    cases = [(name, 100, 192) for name in TYPES if name not in ("Q4_1", "Q8_0")] + [(name, 70, 512) for name in K_TYPES]
    script = tmp_path / "gen.py"
    script.write_text(
        "import sys, numpy as np\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from test_intdot import int_product, tricky_rows, worst_case\n"
        "from test_native import random_blocks\n"
        f"for name, n, k in {cases!r}:\n"
        "    raw = random_blocks(name, n, k, 9)\n"
        "    x = tricky_rows(np.random.default_rng(0), 7, k)\n"
        "    np.save(sys.argv[2] + name + '.npy', np.concatenate([int_product(x[:1], raw, name, n, k), "
        "int_product(x, raw, name, n, k)]))\n"
        "    raw, x = worst_case(name)\n"
        "    np.save(sys.argv[2] + name + '-worst.npy', int_product(x, raw, name, 64, 256))\n")
    for cpu in ("generic", "haswell"):
        env = dict(os.environ, NUMBA_CPU_NAME=cpu, NUMBA_CACHE_DIR=numba.config.CACHE_DIR)
        env.pop("NUMBA_CPU_FEATURES", None)
        if cpu == "haswell":  # else numba keeps the host's features (AVX-512 here) under Haswell's name
            env["NUMBA_CPU_FEATURES"] = AVX2_FEATURES
        dest = tmp_path / f"{cpu}-"
        r = subprocess.run([sys.executable, str(script), str(Path(__file__).parent), str(dest)], env=env,
                           capture_output=True, text=True, timeout=1500)
        assert r.returncode == 0, r.stderr[-2000:]
        for name, n, k in cases:
            raw = random_blocks(name, n, k, 9)
            x = tricky_rows(np.random.default_rng(0), 7, k)
            want = reference(name)(x, raw, name, n, k)
            got = np.load(f"{dest}{name}.npy")
            assert_same_bits(got[:1], want[:1], f"{cpu} {name}")
            assert_same_bits(got[1:], want, f"{cpu} {name}")
            raw, x = worst_case(name)
            assert_same_bits(np.load(f"{dest}{name}-worst.npy"), reference(name)(x, raw, name, 64, 256),
                             f"{cpu} {name} worst case")


def test_mxfp4_every_code_and_exponent():
    """MXFP4 rows of one block holding all 16 codes at every exponent 0..255 (subnormal scales, 2^127)
    against activations of several magnitudes: the reference's bits, decode and prefill; and the
    reference's quants are ggml's kvalues (code 8 is 0, 15 is -12)."""
    n, k = 256, 64
    b = np.zeros((n, k // 32, 17), np.uint8)
    b[:, :, 0] = np.arange(n)[:, None]
    codes = (np.arange(n)[:, None, None] * 3 + np.arange(k // 32)[None, :, None] + np.arange(32)[None, None, :]) % 16
    b[:, :, 1:] = codes[:, :, :16] | (codes[:, :, 16:] << 4)
    raw = b.reshape(n, -1)
    q, d, _ = intref.block_quants(raw, "MXFP4", n, k)
    assert set(q.ravel().tolist()) == set(intref.KVALUES_MXFP4.tolist()) and d[0, 0] == f32(2.0 ** -128)
    x = tricky_rows(np.random.default_rng(4), 9, k) * f32(1e-30)
    x[:4] = tricky_rows(np.random.default_rng(5), 4, k)
    want = intref.product(x, raw, "MXFP4", n, k)
    assert np.isinf(want).any() and np.isfinite(want).any()
    for T in (1, 2, 9):
        assert_same_bits(int_product(x[:T], raw, "MXFP4", n, k), want[:T], f"MXFP4 T={T}")
