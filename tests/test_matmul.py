"""The float panels' matrix product (backends/cpu/matmul.py, tiles.py): fp16 panels must give the bits
of float32 panels holding the same (widened) values, and every row the bits it gets alone, along
each of the paths a token count takes: one row (decode), a few rows read from the fp16 panel unit by
unit (`loaders.few_rows`, 8 rows a pass and tails of 4 and 1), and many rows from a panel widened
once. Odd panel counts, a partial last panel and K off the 64-long k-blocks are among the shapes;
the residual and gated (GLU) epilogues ride on the same split of work."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from tinydet.backends.cpu import loaders
from tinydet.packing import layout
from tinydet.backends.cpu.storage import floats
from tinydet.backends.cpu.matmul import MM_GLU, MM_PLAIN, chunk_range, matmul, mm, scratch, split_chunks
from tinydet.backends.cpu.ops import GELU_TANH, glu_rows

SHAPES = [(960, 576), (576, 200), (100, 70), (33, 64)]  # 15, 9 and 2 panels; partial panels; K % 64 != 0
TOKENS = list(range(1, 20)) + [64]
THREADS = [1, 2, 3]


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


def product(x: np.ndarray, panels: np.ndarray, n: int, res: np.ndarray | None = None) -> np.ndarray:
    out = np.full((x.shape[0], n), np.nan, np.float32)
    matmul(x, panels, n, out, res)
    return out


@numba.njit
def _few(w, T):
    return loaders.few_rows(w, T)


def test_few_rows_is_the_fp16_decode_batch():
    assert floats.HALF_WIDEN == 16
    assert [t for t in range(1, 40) if _few(np.zeros((1, 64, 64), np.uint16), t)] == list(range(1, 16))
    assert not any(_few(np.zeros((1, 64, 64), np.float32), t) for t in range(1, 40))


@pytest.mark.parametrize("tile, chunk_tiles, min_tiles", [(6, 16, 3), (4, 8, 1), (8, 16, 3)])
def test_split_covers_every_row_once_and_keeps_converted_groups_whole(tile, chunk_tiles, min_tiles):
    """Chunks tile [0, T) in order, none empty; a chunk beyond the fewest that hold `chunk_tiles` tiles
    each is added only to even out the threads and only while chunks keep `min_tiles` tiles; so 8
    decoding sequences over 9 groups of a buffered (dequantized) storage are 9 jobs, not 18."""
    for T in range(1, 200):
        n_tiles = -(-T // tile)
        for G in (1, 2, 9, 15, 48):
            for nth in (1, 2, 3, 4):
                C = split_chunks(T, G, nth, tile, chunk_tiles, min_tiles)
                least = -(-n_tiles // chunk_tiles)
                assert least <= C <= max(least, n_tiles // min_tiles), (T, G, nth, C)
                assert C == least or (C * G) % nth == 0
                spans = [chunk_range(T, C, c, tile) for c in range(C)]
                assert spans[0][0] == 0 and spans[-1][1] == T and all(a < b for a, b in spans)
                assert all(spans[c][1] == spans[c + 1][0] for c in range(C - 1))
    assert split_chunks(8, 9, 2, 6, 16, 3) == 1  # buffered: one conversion per group
    assert split_chunks(8, 9, 2, 4, 8, 1) == 2  # read from memory: rows split for an even share


def test_a_product_converts_into_one_scratch_not_a_buffer_per_job():
    """Every job of the many-row path converts its group into its thread's row of the caller's
    `scratch`, so what a product allocates (numba's parallel launch) does not grow with its jobs. A
    buffer of its own per job (150-400 KB in a model) was mapped and unmapped by the OS for every job
    wherever glibc's mmap threshold is fixed (MALLOC_TRIM_THRESHOLD_ set: a step of 8 decoding
    sequences, Q4_1, took 5.8x the time)."""
    from numba.core.runtime import _nrt_python, rtsys

    if not hasattr(_nrt_python, "memsys_enable_stats"):
        pytest.skip("this numba cannot count its runtime's allocations")
    _nrt_python.memsys_enable_stats()
    rng = np.random.default_rng(11)
    w = layout.pack_panels(rng.standard_normal((576, 256)).astype(np.float16).view(np.uint16))  # widened
    wbuf = scratch(2, 256)
    counts = {}
    for T in (16, 64, 200):  # 9 groups: 9 to 36 jobs
        x = rng.standard_normal((T, 256)).astype(np.float32)
        out = np.empty((T, 576), np.float32)
        for nth in (1, 2):
            mm(x, w, 576, out, nth, MM_PLAIN, out, out, 0, wbuf)  # compiled
            before = rtsys.get_allocation_stats().alloc
            mm(x, w, 576, out, nth, MM_PLAIN, out, out, 0, wbuf)
            counts[T, nth] = rtsys.get_allocation_stats().alloc - before
    assert len(set(counts.values())) == 1, counts


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_fp16_panels_equal_fp32_panels_and_each_row_alone(shape, restore_threads):
    n, k = shape
    rng = np.random.default_rng(n + k)
    w16 = (rng.standard_normal((n, k)) * 0.5).astype(np.float16)
    p16 = layout.pack_panels(w16.view(np.uint16))
    p32 = layout.pack_panels(w16.astype(np.float32))
    for T in TOKENS:
        x = rng.standard_normal((T, k)).astype(np.float32)
        for threads in THREADS:
            numba.set_num_threads(threads)
            got = product(x, p16, n)
            assert np.isfinite(got).all()
            assert np.array_equal(bits(got), bits(product(x, p32, n))), f"{shape} T={T} threads={threads}"
            alone = np.concatenate([product(x[t:t + 1].copy(), p16, n) for t in range(T)])
            assert np.array_equal(bits(got), bits(alone)), f"{shape} T={T} threads={threads}: rows differ alone"
            res = rng.standard_normal((T, n)).astype(np.float32)
            want = res + got
            assert np.array_equal(bits(product(x, p16, n, res)), bits(got))
            assert np.array_equal(bits(res), bits(want)), f"{shape} T={T}: residual"


def test_fp16_gated_epilogue_equals_glu_of_the_product():
    """MM_GLU on a few rows: each thread's units of the gate and of the up part, then their product."""
    ffn, k = 192, 128
    rng = np.random.default_rng(3)
    w16 = (rng.standard_normal((2 * ffn, k)) * 0.3).astype(np.float16)
    p16 = layout.pack_panels(w16.view(np.uint16))

    @numba.njit
    def fused(x, w, n, out, act, nth):
        mm(x, w, n, out, nth, MM_GLU, out, act, GELU_TANH, scratch(nth, x.shape[1]))

    for T in (2, 5, 8, 13, 20):
        x = rng.standard_normal((T, k)).astype(np.float32)
        plain = product(x, p16, 2 * ffn)
        want = np.empty((T, ffn), np.float32)
        glu_rows(plain, ffn, want, GELU_TANH)
        for threads in THREADS:
            act = np.full((T, ffn), np.nan, np.float32)
            fused(x, p16, 2 * ffn, np.empty((T, 2 * ffn), np.float32), act, threads)
            assert np.array_equal(bits(act), bits(want)), f"T={T} threads={threads}"


def _span_kernel(f, width):
    @numba.njit
    def run(x, w, n_out, out):
        K = x.shape[1]
        for u in range(w.shape[0] * 64 // width):  # each unit of `width` outputs of every panel
            p, off = divmod(u * width, 64)
            f(x, 0, x.shape[0], w, p * K * 64 + off, u * width, n_out, out)
    return run


def test_every_vector_units_tile_gives_the_same_bits():
    """Each tile shape of every vector unit (tiles.SHAPES: AVX2's 16-lane tiles too, run here on the
    host's registers) gives the bits of the product the host computes, for row counts that fill whole
    tiles and leave every tail, a partial last panel and K off the 64-long k-blocks."""
    from tinydet.backends.cpu import tiles

    seen = {(shapes, tiles.LANES if kind != "few" else tiles.LANES // 2)
            for units in tiles.SHAPES.values() for kind, opts in units.items() for _, shapes in opts}
    assert any(W == 16 for shapes, _ in seen for _, W in shapes)
    n, k = 100, 300  # 5 k-blocks (the compensation acts from the third), the last partial
    rng = np.random.default_rng(7)
    p32 = layout.pack_panels(rng.standard_normal((n, k)).astype(np.float32))
    for shapes, width in sorted(seen):
        run = _span_kernel(tiles.span(shapes, width), width)
        for T in list(range(1, 14)) + [64]:
            x = rng.standard_normal((T, k)).astype(np.float32)
            got = np.full((T, n), np.nan, np.float32)
            run(x, p32, n, got)
            assert np.array_equal(bits(got), bits(product(x, p32, n))), f"tiles {shapes} of {width}, T={T}"
