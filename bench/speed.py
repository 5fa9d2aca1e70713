"""Prefill and decode speed of tinydet on one model (comparisons with other engines: compare.py).
Prints medians over repeats.

    python bench/speed.py MODEL.gguf [--dtype fp32|fp16|native|int8] [--threads N] [--prompt-tokens 128] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import tinydet


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "native", "int8"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()

    t0 = time.perf_counter()
    model = tinydet.load(a.model, dtype=a.dtype, threads=a.threads)
    load_s = time.perf_counter() - t0
    tr = model.backend
    vocab = model.config.vocab_size
    prompt = [(i * 7919 + 13) % vocab for i in range(a.prompt_tokens)]
    t0 = time.perf_counter()
    tr.forward(prompt[:4], tr.new_cache(8))  # compile or load kernels
    warm_s = time.perf_counter() - t0

    prefill, decode = [], []
    for _ in range(a.repeats):
        cache = tr.new_cache(a.prompt_tokens + a.new_tokens)
        t0 = time.perf_counter()
        logits = tr.forward(prompt, cache)
        prefill.append(a.prompt_tokens / (time.perf_counter() - t0))
        tok = int(logits[0].argmax())
        t0 = time.perf_counter()
        for _ in range(a.new_tokens):
            tok = int(tr.forward([tok], cache)[0].argmax())
        decode.append(a.new_tokens / (time.perf_counter() - t0))
    print(f"model {a.model} dtype {a.dtype} threads {model.threads}")
    print(f"load {load_s:.2f} s, first forward (compile/cache load) {warm_s:.2f} s")
    print(f"prefill {a.prompt_tokens} tokens: {statistics.median(prefill):.1f} tok/s (median of {a.repeats})")
    dec = statistics.median(decode)
    weights = tr.weight_bytes()  # what one decode step reads, give or take the embedding row
    print(f"decode {a.new_tokens} tokens: {dec:.1f} tok/s (median of {a.repeats}), "
          f"{dec * weights / 1e9:.1f} GB/s of weights")


if __name__ == "__main__":
    main()
