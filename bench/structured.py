"""Structured outputs' cost: decode tok/s of a request held to a JSON Schema against the same request
unconstrained, and the time of the mask (llguidance's token set, applied to the row) and of taking the
token, per step, beside the forward pass.

    python bench/structured.py [--model M] [--dtype fp32] [--threads 2] [--repeats 3] [--max-tokens 256] [--json]

Requests: tests/schemas.py's schemas with their chat prompts, greedy; each constrained output that ends
(not cut by --max-tokens, which the table marks) must parse and validate against its schema. Decode tok/s is `Generation`'s
(tokens after the first over the time after the first token). The two modes alternate within a round;
medians over rounds. The mask and take times are measured inside the constrained runs by timing
`structured.Matcher.mask` and `consume`; the forward pass per step is the rest of the decode time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import tinydet  # noqa: E402
from tinydet import structured  # noqa: E402
from schemas import PROMPTS, SCHEMAS  # noqa: E402

TIMES = {"mask": [], "consume": []}


def _timed(name, fn):
    def wrapper(self, *a):
        t0 = time.perf_counter()
        out = fn(self, *a)
        TIMES[name].append(time.perf_counter() - t0)
        return out
    return wrapper


def check(text: str, schema: dict) -> None:
    """The output parses and, where `jsonschema` is installed (the test extra), validates."""
    value = json.loads(text)
    try:
        import jsonschema
    except ImportError:
        return
    jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    model = tinydet.load(a.model, dtype=a.dtype, threads=a.threads)
    structured.Matcher.mask = _timed("mask", structured.Matcher.mask)
    structured.Matcher.consume = _timed("consume", structured.Matcher.consume)
    model.generate("Hi", max_tokens=4, json_schema={"type": "object"})  # compile kernels and the tokenizer
    rows = []
    for name, schema in SCHEMAS.items():
        prompt = model.chat_prompt([{"role": "user", "content": PROMPTS[name]}])
        model.constraint(json_schema=schema)  # compiled once, as a server's cache holds it
        plain, held, mask_us, take_us, fwd_ms, n_tok, finished = [], [], [], [], [], [], []
        for _ in range(a.repeats):
            g = model.generate(prompt, max_tokens=a.max_tokens)
            plain.append(g.tokens_per_second)
            for v in TIMES.values():
                v.clear()
            g = model.generate(prompt, max_tokens=a.max_tokens, json_schema=schema)
            held.append(g.tokens_per_second)
            finished.append(g.finish_reason == "stop")
            if g.finish_reason == "stop":
                check(g.text, schema)
            n = len(g.token_ids)
            steps = TIMES["mask"][1:]  # the first step's mask belongs to the prefill
            mask_us.append(1e6 * statistics.median(steps))
            take_us.append(1e6 * statistics.median(TIMES["consume"][1:]))
            fwd_ms.append(1e3 * (g.decode_seconds - sum(steps) - sum(TIMES["consume"][1:])) / max(n - 1, 1))
            n_tok.append(n)
        row = dict(schema=name, tokens=int(statistics.median(n_tok)), complete=all(finished), plain_tok_s=statistics.median(plain),
                   schema_tok_s=statistics.median(held), mask_us=statistics.median(mask_us),
                   consume_us=statistics.median(take_us), forward_ms=statistics.median(fwd_ms))
        row["ratio"] = row["schema_tok_s"] / row["plain_tok_s"]
        rows.append(row)
        if not a.json:
            print(f"{name:10s} {row['tokens']:4d} tok{'' if row['complete'] else ' (cut)'}  plain {row['plain_tok_s']:6.1f}  schema {row['schema_tok_s']:6.1f} "
                  f"tok/s ({row['ratio']:.2f}x)  mask {row['mask_us']:6.1f} us  take {row['consume_us']:5.1f} us  "
                  f"forward {row['forward_ms']:.2f} ms per step", flush=True)
    if a.json:
        print(json.dumps(dict(model=a.model, dtype=a.dtype, threads=a.threads, rows=rows), indent=1))
    else:
        print(f"median ratio {statistics.median(r['ratio'] for r in rows):.2f}x")


if __name__ == "__main__":
    main()
