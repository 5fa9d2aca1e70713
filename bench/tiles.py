"""Tile shapes of the many-row matrix product (backends/cpu/tiles.py) against each other, for the
compile target numba was given: each shape as its own kernel over SmolLM2-135M's matrix shapes, the
shapes timed in turn within one process (medians; ratios to the first shape), after checking that
every shape gives the same bits.

    python bench/tiles.py [--shapes r4w64,r6w16,...] [--rows 8,128] [--mode direct|buffered|few]

A shape rRwW runs R rows a pass over W outputs (W lanes of one vector), the rest of a range by
smaller passes (rRwWv8: those of 8 vectors of sums, 4 x 16, 2 x 32, 1 x 64 lanes). "direct": float32 panels read from memory (fp32 storage); "buffered": fp16 panels
widened, group by group, into a float32 buffer (fp16 storage; quantized panels are dequantized into
the same buffer); "few": a few rows (a batch of decoding sequences) on fp16 panels read from
memory, each thread an equal run of 32-output units (`loaders.few_rows`). The weights rotate over
about 40 MB of copies, so they come from memory as in a model. For an AVX2-only build on an AVX-512
machine:

    NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=$(python -c \
        "from tinydet.tools.verify import AVX2_FEATURES; print(AVX2_FEATURES)") python bench/tiles.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import tinydet  # noqa: F401,I001  (first: sizes numba's thread pool)
import numba  # noqa: E402
from numba import njit, prange  # noqa: E402
from tinydet.backends.cpu import tiles  # noqa: E402
from tinydet.packing import layout  # noqa: E402
from tinydet.backends.cpu.matmul import chunk_range, split_chunks  # noqa: E402
from tinydet.numerics.simd import target_isa, to_f16_bits, v_load, v_store  # noqa: E402

SHAPES = {"r4w64": ((4, 64),), "r6w64": ((6, 64), (4, 64), (2, 64), (1, 64)),
          "r8w64": ((8, 64), (4, 64), (2, 64), (1, 64)), "r1w64": ((1, 64),),
          "r2w32": ((2, 32), (1, 32)), "r3w32": ((3, 32), (2, 32), (1, 32)),
          "r6w32": ((6, 32), (4, 32), (2, 32), (1, 32)), "r8w32": ((8, 32), (4, 32), (2, 32), (1, 32)),
          "r4w16": ((4, 16), (2, 16), (1, 16)), "r6w16": ((6, 16), (4, 16), (2, 16), (1, 16)),
          "r8w16": ((8, 16), (4, 16), (2, 16), (1, 16)),
          # the rest of a range in tiles of 8 ymm of sums (tiles.SHAPES' AVX2 choice)
          "r6w16v8": ((6, 16), (4, 16), (2, 32), (1, 64))}
MATRICES = (("w13", 3072, 576), ("w2", 576, 1536), ("qkv", 960, 576))

_SRC = """
def run(x, w, n_out, out, nth):
    T, K = x.shape
    G = w.shape[0]
    if FEW:  # the decode split: each thread an equal run of 32-output units, read from memory
        U = 2 * G
        for th in prange(nth):
            for u in range(th * U // nth, (th + 1) * U // nth):
                span(x, 0, T, w, (u // 2) * K * 64 + (u % 2) * 32, u * 32, n_out, out)
        return
    C = split_chunks(T, G, nth, ROWS, CHUNK, 3 if BUFFERED else 1)
    for job in prange(G * C):
        g = job // C
        ta, tb = chunk_range(T, C, job % C, ROWS)
        if BUFFERED:
            wbuf = np.empty(K * 64, np.float32)
            for k in range(K):
                v_store(wbuf, k * 64, v_load(w, (g * K + k) * 64))
            span(x, ta, tb, wbuf, 0, g * 64, n_out, out)
        else:
            span(x, ta, tb, w, g * K * 64, g * 64, n_out, out)
"""


def kernel(name: str, mode: str):
    """The matrix product of matmul.mm's many-row path (or, "few", of a few rows on fp16 panels) with
    one fixed tile shape."""
    shapes = SHAPES[name]
    buffered = mode == "buffered"
    env = dict(np=np, prange=prange, split_chunks=split_chunks, chunk_range=chunk_range, v_load=v_load,
               v_store=v_store, span=tiles.span(shapes, 32 if mode == "few" else 64), ROWS=shapes[0][0],
               CHUNK=16 if buffered else 8, BUFFERED=buffered, FEW=mode == "few")
    exec(_SRC, env)  # noqa: S102 (the template above)
    return njit(parallel=True)(env["run"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="r4w64,r6w64,r2w32,r4w16,r6w16")
    ap.add_argument("--rows", default="8,32,128", help="row counts T (tokens of a prompt, or sequences)")
    ap.add_argument("--mode", default="direct", choices=["direct", "buffered", "few"])
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    numba.set_num_threads(a.threads)
    names = a.shapes.split(",")
    kernels = {n: kernel(n, a.mode) for n in names}
    rng = np.random.default_rng(0)
    print(f"target {target_isa()}, {a.mode}, {a.threads} threads; median us per call (ratio to {names[0]})")
    for label, n, k in MATRICES:
        w = layout.pack_panels((rng.standard_normal((n, k)) * 0.01).astype(np.float32))
        if a.mode != "direct":
            w = to_f16_bits(w)
        copies = [w] + [w.copy() for _ in range(int(40e6 // w.nbytes))]
        for T in (int(t) for t in a.rows.split(",")):
            x = rng.standard_normal((T, k)).astype(np.float32)
            out = np.empty((T, n), np.float32)
            ref = None
            for name in names:
                kernels[name](x, copies[0], n, out, a.threads)
                if ref is None:
                    ref = out.copy()
                if not np.array_equal(ref.view(np.uint32), out.view(np.uint32)):
                    raise SystemExit(f"{name} gives other bits than {names[0]}")
            ts = {name: [] for name in names}
            for r in range(max(30, 3000 // T)):
                for i, name in enumerate(names):
                    c = copies[(r * len(names) + i) % len(copies)]
                    t0 = time.perf_counter()
                    kernels[name](x, c, n, out, a.threads)
                    ts[name].append(time.perf_counter() - t0)
            base = statistics.median(ts[names[0]])
            cells = "  ".join(f"{name} {statistics.median(ts[name]) * 1e6:6.0f} ({statistics.median(ts[name]) / base:.2f})"
                              for name in names)
            print(f"{label:4} {n}x{k:<5} T={T:<4} {cells}", flush=True)


if __name__ == "__main__":
    main()
