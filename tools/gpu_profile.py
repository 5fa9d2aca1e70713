"""Where a generation's GPU time goes, kernel by kernel (tools/gpu_check.sh's profile phase):

    python tools/gpu_profile.py MODEL.gguf [--dtype native|int8] [--tokens 16] [--device cuda]

PyTorch's profiler records the CUDA activity of the whole process (CUPTI), CuPy's kernels included, so
this needs torch beside CuPy. CUDA graphs are turned off, so that every decode step's kernels are
launched one by one and each is seen under its own name. Prints the kernels by their share of the GPU
time: calls and time per call.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--dtype", default="native", choices=["fp32", "fp16", "native", "int8"])
    ap.add_argument("--tokens", type=int, default=16, help="tokens generated after the prompt")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    os.environ["TINYDET_CUDA_GRAPHS"] = "0"
    try:
        from torch.profiler import ProfilerActivity, profile, supported_activities
    except ImportError:
        print("gpu_profile: needs torch (its profiler sees CuPy's kernels too)", file=sys.stderr)
        return 2
    if ProfilerActivity.CUDA not in supported_activities():
        print("gpu_profile: this torch cannot record CUDA activity (a CPU build, or no GPU)", file=sys.stderr)
        return 2
    import tinydet

    model = tinydet.load(args.model, dtype=args.dtype, device=args.device)
    model.generate(prompt="Once upon a time", max_tokens=4)  # first-use costs out of the profile
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.generate(prompt="Once upon a time", max_tokens=args.tokens)
    wall = time.perf_counter() - t0
    rows = [(e.key, e.count, e.self_device_time_total) for e in prof.key_averages() if e.self_device_time_total > 0]
    total = sum(us for _, _, us in rows)
    print(f"{args.model} {args.dtype}: {args.tokens} tokens in {wall * 1e3:.1f} ms, {total / 1e3:.1f} ms of GPU time "
          f"(CUDA graphs off)")
    print(f"{'kernel':40} {'share':>7} {'calls':>7} {'us/call':>9}")
    for key, count, us in sorted(rows, key=lambda r: -r[2]):
        print(f"{key[:40]:40} {100 * us / total:6.1f}% {count:7d} {us / count:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
