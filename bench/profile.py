"""Where a forward pass's time goes: per op, for one model, dtype and thread count, in one of three
shapes of work:

    python bench/profile.py MODEL [--mode decode|prefill|batch] [--dtype native] [--threads 2]
        [--prompt-tokens 128] [--new-tokens 64] [--sequences 8] [--repeats 5]

  decode   `--new-tokens` single-token steps after a `--prompt-tokens` prefill (the step users wait on)
  prefill  a `--prompt-tokens` prompt processed at once, on a fresh cache, `--repeats` times
  batch    `--sequences` sequences of `--prompt-tokens` (different prompts) prefilled, then
           `--new-tokens` steps of one token for every sequence (`generate_batch`'s decode)

Each is run twice: plainly (the time users get) and with an op hook (`Backend.hooks`, the seam traces
use) that reads the clock after every op, so the time between two hook calls is the op between them
(the q/k/v projection is one matrix product, reported as "q"; "logits" includes the final norm's
neighbour, the output matrix). A hooked pass undoes the kernels' fusions and calls into Python after
every op, so its total is longer than the plain one; the table gives each op's share of the hooked time
and that share of the plain pass (milliseconds per pass, and per token of it), which is how the time
splits when the overhead spreads evenly. Medians over passes; run on a quiet machine.
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
MATMULS = ("qkv projection", "attention output (wo)", "gate/up projection", "down projection",
           "output matrix (logits)")


def prompts(vocab: int, n: int, length: int) -> list[list[int]]:
    """n different prompts of `length` ids (a fixed pattern per sequence: only the shapes matter)."""
    return [[(i * 7919 + s * 104729) % (vocab - 10) + 5 for i in range(length)] for s in range(n)]


def passes(be, mode: str, a) -> list:
    """The timed passes of `mode`, in order, as functions that run one pass each. Untimed set-up (a
    fresh cache, the prefill before decode steps) runs while the list is built."""
    vocab = be.config.vocab_size
    if mode == "prefill":
        (ids,) = prompts(vocab, 1, a.prompt_tokens)

        def one():
            be.forward(ids, be.new_cache(a.prompt_tokens))
        return [one] * a.repeats
    n = 1 if mode == "decode" else a.sequences
    cache = be.new_cache(a.prompt_tokens + a.new_tokens + 1, n_slots=n)
    logits = be.forward_batch(list(enumerate(prompts(vocab, n, a.prompt_tokens))), cache)
    state = {"toks": [int(x.argmax()) for x in logits]}

    def step():
        out = be.forward_batch([(s, [t]) for s, t in enumerate(state["toks"])], cache)
        state["toks"] = [int(x.argmax()) for x in out]
    return [step] * a.new_tokens


def run(be, mode, a, hooked: bool) -> tuple[list[float], dict[str, list[float]]]:
    times, per_op = [], defaultdict(list)
    marks: list[tuple[str, float]] = []

    def hook(layer, op, pos, slots, rows):
        marks.append((op, time.perf_counter()))

    todo = passes(be, mode, a)
    if hooked:
        be.hooks.append(hook)
    try:
        for f in todo:
            marks.clear()
            t0 = time.perf_counter()
            marks.append(("start", t0))
            f()
            times.append(time.perf_counter() - t0)
            if hooked:
                one = defaultdict(float)
                for (_, t_a), (op, t_b) in zip(marks, marks[1:]):
                    one[op] += t_b - t_a
                for op, s in one.items():
                    per_op[op].append(s)
    finally:
        if hooked:
            be.hooks.remove(hook)
    return times, per_op


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--mode", default="decode", choices=["decode", "prefill", "batch"])
    ap.add_argument("--dtype", default="native", choices=["fp32", "fp16", "native", "int8"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--sequences", type=int, default=8, help="batch mode's sequence count")
    ap.add_argument("--repeats", type=int, default=5, help="prefill mode's pass count")
    a = ap.parse_args()

    model = tinydet.load(a.model, dtype=a.dtype, threads=a.threads)
    be = model.backend
    run(be, a.mode, a, False)  # warm-up (compiles), plain and hooked: a pass's first hook call is slow
    run(be, a.mode, a, True)
    plain, _ = run(be, a.mode, a, False)
    hooked, per_op = run(be, a.mode, a, True)
    t, th = statistics.median(plain), statistics.median(hooked)
    tokens = {"decode": 1, "prefill": a.prompt_tokens, "batch": a.sequences}[a.mode]
    what = {"decode": f"decode at positions {a.prompt_tokens}..{a.prompt_tokens + a.new_tokens}",
            "prefill": f"prefill of {a.prompt_tokens} tokens",
            "batch": f"{a.sequences} sequences decoding at positions {a.prompt_tokens}.."
                     f"{a.prompt_tokens + a.new_tokens}"}[a.mode]
    print(f"{a.model} {a.dtype}, {a.threads} threads, {what}: plain pass {t * 1e3:.2f} ms "
          f"({tokens / t:.1f} tok/s), hooked {th * 1e3:.2f} ms")
    rows = defaultdict(float)
    for op, v in per_op.items():
        rows[GROUPS.get(op, "norms, residual adds, embedding, other")] += statistics.median(v)
    total = sum(rows.values())
    print(f"{'op':40s} {'share':>6s} {'ms/pass':>9s} {'ms/token':>9s}")
    for name, v in sorted(rows.items(), key=lambda kv: -kv[1]):
        print(f"{name:40s} {v / total:6.1%} {v / total * t * 1e3:9.2f} {v / total * t * 1e3 / tokens:9.3f}")
    mm = sum(v for k, v in rows.items() if k in MATMULS) / total
    print(f"{'matrix products together':40s} {mm:6.1%} {mm * t * 1e3:9.2f} {mm * t * 1e3 / tokens:9.3f}")


if __name__ == "__main__":
    main()
