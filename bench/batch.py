"""Batched generation throughput of tinydet builds side by side: `generate_batch` of N greedy requests
(N different prompts, --new-tokens each), aggregate generated tokens per second, the builds run
alternately in rounds (medians), each in its own worker process (compare.py's workers and idle waits).

    python bench/batch.py --model M.gguf --engines tinydet:fp32@$OLD,tinydet:fp32 [--requests 8]
        [--new-tokens 96] [--prompt-tokens 64] [--threads 2] [--repeats 5] [--json]

Every build must give the same output hashes (tinydet's results do not depend on the batch); the
script says so or fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--engines", required=True, help="comma-separated tinydet[:DTYPE][=MODEL][@SRC] (compare.py's)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "native", "int8"])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--wait-idle", type=float, default=20.0)
    ap.add_argument("--spin", type=float, default=0.5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    specs = compare.parse_engines(a.engines, a)
    if any(s["engine"] != "tinydet" for s in specs):
        ap.error("--engines: tinydet builds only")
    log = (lambda *x: print(*x, file=sys.stderr, flush=True))
    engines = []
    for s in specs:
        s["label"] = f"tinydet {s['dtype']} ({compare.file_tag(s['model'])})" + (
            f" @{Path(s['src']).name}" if s.get("src") else "")
        s.update(threads=a.threads, n_ctx=0, python=sys.executable)
        e = compare.EngineProc(s, sys.executable)
        log(f"loaded {e.label} in {e.recv()['load_s']:.1f} s")
        engines.append(e)
    try:
        ids = engines[0].call(cmd="tokenize", text=compare.PROMPT_TEXT * 4)["ids"]
        # N prompts: windows of the text at different offsets and lengths (each its own request)
        prompts = [ids[7 * i:7 * i + a.prompt_tokens - 3 * i] for i in range(a.requests)]
        runs = {e.label: [] for e in engines}
        hashes = {}
        for rnd in range(a.repeats + 1):
            order = engines[rnd % len(engines):] + engines[:rnd % len(engines)]
            for e in order:
                time.sleep(compare.PAUSE_S)
                compare.wait_idle(a.wait_idle, log)
                m = e.call(cmd="batch", prompts=prompts, new_tokens=a.new_tokens, spin_s=a.spin)
                hashes.setdefault(e.label, m["hashes"])
                if m["hashes"] != hashes[e.label]:
                    raise SystemExit(f"{e.label}: output hashes changed between rounds")
                if rnd:  # round 0 is the warm-up
                    runs[e.label].append(a.requests * a.new_tokens / m["seconds"])
            log(f"round {rnd}{' (warm-up)' if not rnd else ''}: " + ", ".join(
                f"{k} {v[-1]:.1f} tok/s" for k, v in runs.items() if v))
    finally:
        for e in engines:
            e.close()
    same = len({tuple(h) for h in hashes.values()}) == 1
    med = {k: statistics.median(v) for k, v in runs.items()}
    first = next(iter(med))
    result = {"requests": a.requests, "new_tokens": a.new_tokens, "prompt_lengths": [len(p) for p in prompts],
              "threads": a.threads, "repeats": a.repeats, "tok_s_runs": runs, "tok_s_median": med,
              "ratio_to_first": {k: v / med[first] for k, v in med.items()}, "same_outputs": same,
              "commit": compare.git_state()[0]}
    if a.json:
        print(json.dumps(result, indent=1))
    else:
        for k, v in med.items():
            print(f"{k:<40} {v:8.1f} tok/s aggregate  ({v / med[first]:.3f}x {first})")
        print("outputs identical across builds" if same else "OUTPUTS DIFFER between builds")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
