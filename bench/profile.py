"""Where a decode step's time goes: per op of the forward pass, for one model, dtype and thread count.

    python bench/profile.py MODEL [--dtype native] [--threads 2] [--prompt-tokens 128] [--new-tokens 64]

Decodes `--new-tokens` tokens after a `--prompt-tokens` prefill, twice: plainly (the step time users
get) and with an op hook (`Backend.hooks`, the seam traces use) that reads the clock after every op,
so the time between two hook calls is the op between them (the q/k/v projection is one matrix product,
reported as "q"; "logits" includes the final norm's neighbour, the output matrix). A hooked pass
undoes the kernels' fusions and calls into Python after every op, so its total is longer than the
plain step; the table gives each op's share of the hooked time and that share of the plain step
(milliseconds per token), which is how the time splits when the overhead spreads evenly. Medians of
the steps; run on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import tinydet  # noqa: I001  (first: sizes numba's thread pool)

GROUPS = {"q": "qkv projection", "attn_output": "attention output (wo)", "gate": "gate/up projection",
          "down": "down projection", "logits": "output matrix (logits)", "attention": "attention",
          "rope_q": "RoPE + KV write", "activation": "gated activation"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--dtype", default="native", choices=["fp32", "fp16", "native"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()

    model = tinydet.load(args.model, dtype=args.dtype, threads=args.threads)
    be = model.backend
    ids = [(i * 7919) % (be.config.vocab_size - 10) + 5 for i in range(args.prompt_tokens)]

    def run(hooked: bool) -> tuple[list[float], dict[str, list[float]]]:
        cache = be.new_cache(args.prompt_tokens + args.new_tokens + 1)
        logits = be.forward(ids, cache)[0]
        steps, per_op = [], defaultdict(list)
        marks: list[tuple[str, float]] = []

        def hook(layer, op, pos, slots, rows):
            marks.append((op, time.perf_counter()))

        if hooked:
            be.hooks.append(hook)
        try:
            for _ in range(args.new_tokens):
                tok = int(logits.argmax())
                marks.clear()
                t0 = time.perf_counter()
                marks.append(("start", t0))
                logits = be.forward([tok], cache)[0]
                steps.append(time.perf_counter() - t0)
                if hooked:
                    step = defaultdict(float)
                    for (_, a), (op, b) in zip(marks, marks[1:]):
                        step[op] += b - a
                    for op, s in step.items():
                        per_op[op].append(s)
        finally:
            if hooked:
                be.hooks.remove(hook)
        return steps, per_op

    run(False)  # warm-up (compiles)
    plain, _ = run(False)
    hooked, per_op = run(True)
    step, hstep = statistics.median(plain), statistics.median(hooked)
    print(f"{args.model} {args.dtype}, {args.threads} threads, positions {args.prompt_tokens}.."
          f"{args.prompt_tokens + args.new_tokens}: plain step {step * 1e3:.2f} ms ({1 / step:.1f} tok/s), "
          f"hooked {hstep * 1e3:.2f} ms")
    rows = defaultdict(float)
    for op, v in per_op.items():
        rows[GROUPS.get(op, "norms, residual adds, embedding, other")] += statistics.median(v)
    total = sum(rows.values())
    print(f"{'op':40s} {'share':>6s} {'ms/token':>9s}")
    for name, v in sorted(rows.items(), key=lambda kv: -kv[1]):
        print(f"{name:40s} {v / total:6.1%} {v / total * step * 1e3:9.2f}")


if __name__ == "__main__":
    main()
