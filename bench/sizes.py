"""tinydet against llama.cpp on one GGUF file of the sizes people run (1B, 8B): load time, peak RSS,
prefill at 128 and 512 prompt tokens, decode, and decode after 2,048 and 4,096 prompt tokens, engines
alternating in one run.

    python bench/sizes.py --model $BENCH/llama-1b-random.Q4_0.gguf \\
        --llama-python $LLAMA_VENV/bin/python [--engines tinydet:native,llama.cpp] [--dtype native]
        [--prompts 128,512] [--depths 2048,4096] [--new-tokens 64] [--repeats 3] [--threads 2]
        [--wait-idle 20] [--retry-contended 3] [--spin 0.5] [--json]

compare.py's machinery does the work (its workers, engine specs, idle waits, contention accounting and
retries: see its docstring); this script only chooses what to run and how to report it. Every engine
loads first, one at a time ("load s": the worker's time to a usable model, imports included; "RSS
load": its peak RSS by then). A warm-up run per engine (the shortest prompt, 4 new tokens: tinydet's
kernels compile or load from numba's cache here) is reported as "1st prompt s", not counted. Then
--repeats rounds; a round runs every prompt length L of --prompts and --depths, shortest first, and
for each L every engine once, in an order that rotates each time: a run is a prefill of the first L ids
of the prompt from an empty KV cache (timed: prefill tok/s at L) and --new-tokens greedy decode steps
after it (timed: decode tok/s at depth L). Reported: medians over the rounds of prefill tok/s at each
length, decode tok/s after the shortest prompt ("decode") and after each --depths length,
peak RSS over the whole run, and the ratios tinydet / llama.cpp of the medians. The prompt is
compare.py's English text, repeated to the longest L, through the first engine's tokenizer.

Default engines: tinydet at --dtype (default native) and llama.cpp, on --model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare as cmp

WARMUP_NEW = 4


def _lengths(text: str, flag: str, ap) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ap.error(f"{flag}: expected comma-separated positive integers, got {text!r}")
    if any(n < 1 for n in out):
        ap.error(f"{flag}: expected positive integers, got {text!r}")
    return out


def measure(engines: list[cmp.EngineProc], loads: dict, a, log) -> dict:
    lengths = sorted(set(a.prompts) | set(a.depths))
    ids = cmp.prompt_ids(engines[0], lengths[-1])
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    first = {}
    log(f"warm-up run per engine ({lengths[0]} tokens, {WARMUP_NEW} new; excluded)")
    for e in engines:
        first[e.label] = cmp.run_once(e, ids[:lengths[0]], WARMUP_NEW, a, log)["prefill_s"]
    runs = {e.label: {n: [] for n in lengths} for e in engines}
    turn = 0
    for r in range(a.repeats):
        for n in lengths:
            order = engines[turn % len(engines):] + engines[:turn % len(engines)]
            turn += 1
            for e in order:
                m = cmp.run_once(e, ids[:n], a.new_tokens, a, log)
                m["round"], m["prompt_tokens"] = r, n
                runs[e.label][n].append(m)
            log(f"round {r + 1}/{a.repeats}, {n} tokens: " + ", ".join(
                f"{e.label} {n / runs[e.label][n][-1]['prefill_s']:.1f}/"
                f"{a.new_tokens / runs[e.label][n][-1]['decode_s']:.1f}" for e in engines) + "  (prefill/decode tok/s)")
    rows = []
    for e in engines:
        by_len = {}
        for n, ms in runs[e.label].items():
            pre = [n / m["prefill_s"] for m in ms]
            dec = [a.new_tokens / m["decode_s"] for m in ms]
            by_len[str(n)] = {"prefill_tok_s": cmp.median(pre), "decode_tok_s": cmp.median(dec),
                              "prefill_tok_s_runs": pre, "decode_tok_s_runs": dec,
                              "others_cpu_runs": [m["others_cpu"] for m in ms],
                              "maxrss_mib_runs": [m["maxrss_kb"] / 1024 for m in ms],  # the process's peak so far
                              "discarded_runs": [d for m in ms for d in m["discarded"]],
                              "tokens": ms[0]["tokens"], "repeats_identical": all(m["tokens"] == ms[0]["tokens"]
                                                                                  for m in ms)}
        every = [m for ms in runs[e.label].values() for m in ms]
        others = [m["others_cpu"] for m in every if m["others_cpu"] is not None]
        rows.append({"label": e.label, "engine": e.spec["engine"], "dtype": e.spec["dtype"], "model": e.spec["model"],
                     "python": e.spec["python"], "info": e.call(cmd="info")["info"], "load_s": loads[e.label],
                     "load_rss_mib": e.spec["load"].get("maxrss_kb", 0) / 1024, "first_prompt_s": first[e.label],
                     "peak_rss_mib": max(m["maxrss_kb"] for m in every) / 1024,
                     "others_cpu": cmp.median(others) if others else None,
                     "redone": sum(len(m["discarded"]) for m in every), "by_prompt_tokens": by_len})
    commit, dirty = a.git_state
    return {"machine": {"cpu": cmp.cpu_name(), "simd": cmp.cpu_flags(), "cpus": os.cpu_count(),
                        "loadavg_start": load_start,
                        "loadavg_end": os.getloadavg() if hasattr(os, "getloadavg") else None},
            "settings": {"threads": a.threads, "prompts": a.prompts, "depths": a.depths, "new_tokens": a.new_tokens,
                         "repeats": a.repeats, "wait_idle_s": a.wait_idle, "spin_s": a.spin,
                         "retry_contended": a.retry_contended, "quiet_below": cmp.QUIET, "prompt_ids_head": ids[:8]},
            "tinydet_commit": commit, "tinydet_uncommitted": dirty, "engines": rows}


def columns(r: dict) -> list[tuple[str, str, str]]:
    """(heading, length, "prefill"/"decode") of the speed columns."""
    s = r["settings"]
    out = [(f"prefill {n}", str(n), "prefill") for n in sorted(set(s["prompts"]) | set(s["depths"]))]
    out.append(("decode", str(min(s["prompts"])) if s["prompts"] else str(min(s["depths"])), "decode"))
    out += [(f"decode@{n}", str(n), "decode") for n in s["depths"]]
    return out


def render(r: dict) -> str:
    m, s = r["machine"], r["settings"]
    def la(v):
        return f"{v[0]:.2f}" if v else "?"

    dirty = f" ({', '.join(r['tinydet_uncommitted'])})" if r["tinydet_uncommitted"] else ""
    load = f"load average {la(m['loadavg_start'])} -> {la(m['loadavg_end'])}"
    runs = f"medians of {s['repeats']} alternating rounds after a warm-up run"
    out = [f"machine: {m['cpu']}, {m['cpus']} CPUs, {m['simd']}; {load}",
           (f"settings: threads {s['threads']}, {s['new_tokens']} new tokens (greedy), {runs}; "
            f"tinydet commit {r['tinydet_commit']}{dirty}"),
           f"model: {r['engines'][0]['model']}", ""]
    cols = columns(r)
    w = max(len(e["label"]) for e in r["engines"])
    head = f"{'engine':<{w}}  {'load s':>6} {'1st prompt s':>12} {'RSS load':>8} {'RSS peak':>8}  "
    head += "  ".join(f"{c[0]:>12}" for c in cols) + f"  {'others':>6} {'redone':>6}"
    out.append(head)
    for e in r["engines"]:
        line = (f"{e['label']:<{w}}  {e['load_s']:>6.1f} {e['first_prompt_s']:>12.1f} {e['load_rss_mib']:>8.0f} "
                f"{e['peak_rss_mib']:>8.0f}  ")
        line += "  ".join(f"{e['by_prompt_tokens'][n][f'{k}_tok_s']:>12.1f}" for _, n, k in cols)
        oth = "?" if e["others_cpu"] is None else f"{e['others_cpu']:.0%}"
        out.append(line + f"  {oth:>6} {e['redone']:>6}")
    out.append("(tok/s; RSS in MiB; others: median share of the machine's CPU other processes took during this "
               "engine's runs; redone: runs discarded for contention)")
    peers = [e for e in r["engines"] if e["engine"] != "tinydet"]
    for t in [e for e in r["engines"] if e["engine"] == "tinydet"]:
        for p in peers:
            tp, pp = t["by_prompt_tokens"], p["by_prompt_tokens"]
            ratios = ", ".join(f"{head} {tp[n][f'{k}_tok_s'] / pp[n][f'{k}_tok_s']:.2f}x" for head, n, k in cols)
            out.append(f"{t['label']} / {p['label']}: {ratios}; load {t['load_s'] / p['load_s']:.1f}x the time")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--model", required=True, help="GGUF file (the default for every engine)")
    ap.add_argument("--engines", help="comma-separated NAME[:DTYPE][=MODEL][@SRC], as compare.py "
                                      "(default: tinydet at --dtype, llama.cpp)")
    ap.add_argument("--dtype", default="native", help="tinydet's dtype (default native)")
    ap.add_argument("--prompts", default="128,512", help="prompt lengths whose prefill is reported (default 128,512)")
    ap.add_argument("--depths", default="2048,4096", help="prompt lengths after which decode is reported "
                                                          "(default 2048,4096; empty: none)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-python", help="Python with llama-cpp-python (default: this one)")
    ap.add_argument("--tinydet-python", help="Python with tinydet (default: this one)")
    ap.add_argument("--llama-no-extra-bufts", action="store_true", help=cmp.LLAMA_NO_EXTRA_HELP)
    ap.add_argument("--wait-idle", type=float, default=20.0, metavar="S", help="as compare.py (0: don't wait)")
    ap.add_argument("--retry-contended", type=int, default=3, metavar="N", help="as compare.py (0: keep every run)")
    ap.add_argument("--spin", type=float, default=0.5, metavar="S", help="as compare.py")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    a = ap.parse_args()
    a.prompts, a.depths = _lengths(a.prompts, "--prompts", ap), _lengths(a.depths, "--depths", ap)
    if not a.prompts and not a.depths:
        ap.error("nothing to measure: --prompts and --depths are both empty")
    for name in ("threads", "new_tokens", "repeats"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected a positive integer")
    if not Path(a.model).expanduser().is_file():
        ap.error(f"--model: no file {a.model}")
    a.transformers_python = None
    specs = cmp.parse_engines(a.engines or "tinydet,llama.cpp", a)
    log = (lambda *x: print(*x, file=sys.stderr, flush=True)) if a.json else (lambda *x: print(*x, flush=True))
    n_ctx = max(a.prompts + a.depths) + a.new_tokens + 16
    engines, loads, skipped = cmp.start_engines(specs, a, n_ctx, log)
    try:
        result = measure(engines, loads, a, log)
    finally:
        for e in engines:
            e.close()
    result["skipped"] = skipped
    print(json.dumps(result, indent=1) if a.json else render(result))
    if skipped:
        sys.exit(1)


if __name__ == "__main__":
    main()
