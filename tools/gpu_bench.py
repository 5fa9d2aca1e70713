"""Batched generation on the GPU (tools/gpu_check.sh's size phase): `generate_batch` of N greedy
requests, aggregate generated tokens per second (the median of --repeats rounds), with the check that
each request's tokens and logits hash are those of the same request run alone.

    python tools/gpu_bench.py MODEL.gguf [--requests 32] [--new-tokens 64] [--dtype native|int8]
        [--device cuda] [--repeats 3]

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="native", choices=["fp32", "fp16", "native", "int8"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    import tinydet

    model = tinydet.load(a.model, dtype=a.dtype, device=a.device)
    words = "Once upon a time there was a little girl who loved the sea and the sky".split()
    reqs = [dict(prompt=" ".join(words[:1 + i % len(words)]) + f" ({i})", max_tokens=a.new_tokens, temperature=0.0)
            for i in range(a.requests)]
    model.generate_batch(reqs[:2], max_batch=2)  # first-use costs (graphs, workspaces) out of the timing
    rates, got = [], None
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        got = model.generate_batch(reqs, max_batch=a.requests)
        dt = time.perf_counter() - t0
        rates.append(sum(len(g.token_ids) for g in got) / dt)
    alone = [model.generate(**reqs[i]) for i in (0, a.requests - 1)]
    same = all((g.token_ids, g.logits_hash) == (s.token_ids, s.logits_hash)
               for g, s in zip((got[0], got[-1]), alone))
    print(json.dumps({"model": a.model, "device": model.backend.name, "dtype": a.dtype, "requests": a.requests,
                      "new_tokens": a.new_tokens, "aggregate_tok_s": round(statistics.median(rates), 1),
                      "rounds_tok_s": [round(r, 1) for r in rates], "batch_equals_alone": same}))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
