"""GEMV (decode, T=1) speed of the one matrix product (backends/cpu/matmul.py) on quantized panels
against fp32 (and fp16) panels, for SmolLM2-135M's matrix shapes. Prints medians; `--prefill T` also times T
tokens at once.

Each timed call reads a different copy of the matrix, in rotation over at least --footprint MB (default
96, three times this machine's 32 MB L3), so weights come from DRAM as they do in a real decode step
(the whole model does not fit in cache); `--footprint 0` times one cache-warm copy.

The last lines add up the matmul time of one token of SmolLM2-135M per storage kind (30 layers of
qkv, wo, w13, w2, plus the 49152-row output matrix), and for the real Q4_1 file (Q4_1 layers, Q8_0
tied output). On a shared 2-core machine a parallel call whose second thread is descheduled waits a
scheduler tick (4-12 ms): medians in the milliseconds for small matrices mean the run was disturbed.

    python bench/native_gemv.py [--threads 2] [--repeats 200] [--prefill 0] [--types fp32,Q4_1,...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import tinydet  # noqa: F401,I001  (first: sizes numba's thread pool)
import numba  # noqa: E402
from tinydet.packing import layout
from tinydet.backends.cpu.matmul import matmul
from tinydet.numerics.simd import to_f16_bits
from tinydet.formats.dequant import dequantize
from tinydet.formats.ggml import GGML_TYPES

# (name, rows N, row length K, uses per token in SmolLM2-135M: 30 layers, output once)
SHAPES = [("qkv", 960, 576, 30), ("wo", 576, 576, 30), ("w13", 3072, 576, 30), ("w2", 576, 1536, 30),
          ("output", 49152, 576, 1)]


def random_raw(rng, tid, n, k):
    t = GGML_TYPES[tid]
    nb = k // 32
    b = rng.integers(0, 256, (n, nb, t.type_size), dtype=np.uint8)
    b[:, :, 0:2] = (rng.standard_normal((n, nb)) * 0.01).astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    if tid == layout.Q4_1:
        b[:, :, 2:4] = (rng.standard_normal((n, nb)) * 0.05).astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    return b.reshape(n, -1)


def timeit(fns, repeats):
    for fn in fns:
        fn()
    ts = []
    for r in range(repeats):
        fn = fns[r % len(fns)]
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), min(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--prefill", type=int, default=0, help="also time T tokens at once")
    ap.add_argument("--types", default="fp32,fp16,Q4_1,Q8_0,Q4_0")
    ap.add_argument("--footprint", type=float, default=96.0, help="MB of matrix copies to rotate over")
    a = ap.parse_args()
    numba.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    kinds = a.types.split(",")
    Ts = [1] + ([a.prefill] if a.prefill else [])
    per_token = {(kd, T): 0.0 for kd in kinds for T in Ts}
    best_token = dict(per_token)
    smollm = {T: [0.0, 0.0] for T in Ts}  # the real file: Q4_1 layers, Q8_0 output
    print(f"threads {a.threads}, median of {a.repeats}; GB/s (from the median) = bytes the kernel reads / time "
          f"(fp32-eq = 4 B/weight / time)")
    print(f"{'matrix':8} {'N x K':>12} {'kind':5} {'T':>3} {'med us':>9} {'min us':>9} {'GB/s':>7} {'fp32-eq':>8}")
    for name, n, k, uses in SHAPES:
        x1 = rng.standard_normal((max(Ts), k)).astype(np.float32)
        for kd in kinds:
            if kd in ("fp32", "fp16"):
                raw = random_raw(rng, layout.Q8_0, n, k)
                wp = layout.pack_panels(dequantize(raw, layout.Q8_0, (n, k)))
                if kd == "fp16":
                    wp = to_f16_bits(wp)
                nbytes = wp.nbytes
                copies = [wp] + [wp.copy() for _ in range(int(a.footprint * 1e6 // nbytes))]
                calls = [lambda x, out, wp=c: matmul(x, wp, n, out) for c in copies]
            else:
                tid = {v: kk for kk, v in layout.NATIVE_TYPES.items()}[kd]
                qp = layout.pack_quantized(random_raw(rng, tid, n, k), tid, k)
                nbytes = qp.nbytes
                copies = [qp] + [layout.QPanels(qp.ggml_type, qp.n, qp.k, qp.qs.copy(), qp.d.copy(),
                                               None if qp.m is None else qp.m.copy())
                                 for _ in range(int(a.footprint * 1e6 // nbytes))]
                calls = [lambda x, out, qp=c: matmul(x, qp, n, out) for c in copies]
            for T in Ts:
                x = np.ascontiguousarray(x1[:T])
                out = np.empty((T, n), np.float32)
                reps = a.repeats if n * k * T < 5e7 else max(10, a.repeats // 10)
                dt, best = timeit([lambda c=c: c(x, out) for c in calls], reps)
                per_token[(kd, T)] += dt * uses
                best_token[(kd, T)] += best * uses
                if (kd == "Q4_1") != (name == "output") and kd in ("Q4_1", "Q8_0"):
                    smollm[T][0] += dt * uses
                    smollm[T][1] += best * uses
                print(f"{name:8} {f'{n}x{k}':>12} {kd:5} {T:>3} {dt * 1e6:9.1f} {best * 1e6:9.1f} "
                      f"{nbytes / dt / 1e9:7.1f} {4 * n * k / dt / 1e9:8.1f}")
    print("\nmatmul time per token for the whole model (30 layers x 4 matrices + output), from medians (mins):")
    for (kd, T), s in per_token.items():
        b = best_token[(kd, T)]
        print(f"  {kd:5} T={T:<3} {s * 1e3 / T:7.2f} ms/token ({b * 1e3 / T:6.2f})  -> at most "
              f"{T / s:6.1f} tok/s ({T / b:6.1f}) from matmuls alone")
    if "Q4_1" in kinds and "Q8_0" in kinds:
        for T, (s, b) in smollm.items():
            print(f"  SmolLM2-135M-Instruct.Q4_1.gguf (Q4_1 layers, Q8_0 output) T={T:<3} {s * 1e3 / T:7.2f} ms/token "
                  f"({b * 1e3 / T:6.2f})  -> at most {T / s:6.1f} tok/s ({T / b:6.1f}) from matmuls alone")


if __name__ == "__main__":
    main()
