"""This machine's limits for the kernels' figures, measured with numba on the compile target it is given:
the peak of separate float32 multiplies and adds (tinydet's arithmetic: no FMA) and the memory
bandwidth of a copy loop, on --threads threads.

    python bench/limits.py [--threads 2] [--mb 512]

Peak: each thread runs 6 independent chains on vectors of 64 lanes (AVX-512: 24 zmm) or 16 (AVX2,
SSE: 12 ymm or xmm), two ways, and the faster counts: "chained", each chain a = a * m + b (2 flops a
lane a step); "streams", 3 chains a = a * m and 3 a = a + b (1 flop a lane a step, no chain waits on
both pipes). Which one a CPU's latencies let reach its pipes' limit differs (an AVX2 build on Zen 5:
chained 207-221, streams 168-173 GFLOP/s), and no kernel can beat that limit. Bandwidth:
out[:] = in[:] over --mb MB split into one run per thread, counted as bytes read plus bytes written.
Medians of 9 runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import tinydet  # noqa: F401,I001  (first: sizes numba's thread pool)
import numba  # noqa: E402
from numba import njit, prange  # noqa: E402
from tinydet.numerics.simd import target_isa, v16_splat, v_add, v_get, v_mul, v_splat  # noqa: E402

CHAINS = 6
STEPS = 4_000_000


def _peak_kernel(splat, streams: bool):
    """The peak loop (module docstring) on the vectors `splat` makes (64 lanes on AVX-512, 16 on AVX2)."""
    @njit(parallel=True)
    def peak(nth, steps, m, b):
        acc = np.zeros(nth, np.float32)
        for th in prange(nth):
            vm = splat(m)
            vb = splat(b)
            a0 = a1 = a2 = a3 = a4 = a5 = splat(np.float32(th))
            for _ in range(steps):
                if streams:
                    a0 = v_mul(a0, vm)
                    a1 = v_add(a1, vb)
                    a2 = v_mul(a2, vm)
                    a3 = v_add(a3, vb)
                    a4 = v_mul(a4, vm)
                    a5 = v_add(a5, vb)
                else:
                    a0 = v_add(v_mul(a0, vm), vb)
                    a1 = v_add(v_mul(a1, vm), vb)
                    a2 = v_add(v_mul(a2, vm), vb)
                    a3 = v_add(v_mul(a3, vm), vb)
                    a4 = v_add(v_mul(a4, vm), vb)
                    a5 = v_add(v_mul(a5, vm), vb)
            acc[th] = v_get(v_add(v_add(v_add(a0, a1), v_add(a2, a3)), v_add(a4, a5)), 0)  # keeps the loop
        return acc
    return peak


@njit(parallel=True, cache=True)
def _copy(src, dst, nth):
    n = src.shape[0]
    for th in prange(nth):
        a, b = th * n // nth, (th + 1) * n // nth
        dst[a:b] = src[a:b]


def median_time(f, runs=9):
    f()
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mb", type=float, default=512.0, help="size of the copied array")
    a = ap.parse_args()
    numba.set_num_threads(a.threads)
    splat, lanes = (v_splat, 64) if target_isa() == "avx512" else (v16_splat, 16)
    rates = {}
    for streams in (False, True):
        # m, b keep every value finite and normal: a * 0.999 + 1e-3 settles near 1; 1.0 and 0.0 change nothing
        m, b = (np.float32(1.0), np.float32(0.0)) if streams else (np.float32(0.999), np.float32(1e-3))
        peak = _peak_kernel(splat, streams)
        t = median_time(lambda: peak(a.threads, STEPS, m, b))
        rates["streams" if streams else "chained"] = a.threads * STEPS * CHAINS * lanes * (1 if streams else 2) / t / 1e9
    gflops = max(rates.values())
    n = int(a.mb * 1e6 // 4)
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    tc = median_time(lambda: _copy(src, dst, a.threads))
    print(f"target {target_isa()}, {a.threads} threads: separate mul + add peak {gflops:.1f} GFLOP/s "
          f"({', '.join(f'{k} {v:.1f}' for k, v in rates.items())}); "
          f"copy loop {2 * src.nbytes / tc / 1e9:.1f} GB/s (read + write, {a.mb:.0f} MB)")


if __name__ == "__main__":
    main()
