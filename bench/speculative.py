"""Speculative decoding against plain decoding on copy-heavy work: decode speed, acceptance and
whether the output is the same. tinydet with prompt lookup (`--speculative ngram`) against itself
without, and, with --llama-python, llama.cpp's prompt-lookup drafter (llama-cpp-python's
LlamaPromptLookupDecoding) against llama.cpp without it, on the same file and prompt ids.

    python bench/speculative.py --model M.gguf [--dtype native] [--drafter ngram|DTYPE|MODEL]
        [--threads 2] [--repeats 3] [--new-tokens 192] [--llama-python PY] [--batch] [--json]

Tasks (chat prompts around a passage of this repository's README.md, 500-1,500 tokens): repeat it,
rewrite it with its typos fixed, extract the sentences on a subject, answer a question by quoting it;
each greedy and at temperature 0.7 with a seed. Modes alternate within a round. Decode tok/s is
tokens after the first over the time after the first token (tinydet's `Generation`; llama.cpp: the
time of N tokens less the time of one, same prompt). `--drafter` is what `--speculative` takes (default
ngram; int8: the same file in the integer mode drafting). tinydet must give identical output and logits
hashes in both modes, or the script fails. llama.cpp runs each task once per mode, greedy. `--batch`: also `generate_batch` of 8 of these requests
(max_batch 8), tokens per second of the whole batch, both modes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TASKS = {
    "repeat": "Repeat the following text exactly, word for word:\n\n{p}",
    "rewrite": "Rewrite the following text with any typos fixed; keep everything else as it is:\n\n{p}",
    "extract": "From the text below, copy out every sentence that mentions a speed or a time.\n\n{p}",
    "answer": "Using only the text below, quote the sentences that say how tinydet keeps its results the same "
              "on every machine.\n\n{p}",
}


def passage(words: int) -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("tinydet")
    return " ".join(text[start:].split()[:words])


def prompts(model, words: int) -> dict[str, list[int]]:
    p = passage(words)
    if model.tokenizer.chat_template is None:  # a base model's file (Gemma 3 270M's GGUF has no template)
        return {name: model.tokenize(t.format(p=p) + "\n\n") for name, t in TASKS.items()}
    return {name: model.chat_prompt([{"role": "user", "content": t.format(p=p)}]) for name, t in TASKS.items()}


LLAMA_WORKER = r"""
import json, sys, time
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
a = json.loads(sys.argv[1])
plain = Llama(model_path=a["model"], n_ctx=4096, n_threads=a["threads"], n_threads_batch=a["threads"], verbose=False)
look = Llama(model_path=a["model"], n_ctx=4096, n_threads=a["threads"], n_threads_batch=a["threads"], verbose=False,
             logits_all=True, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))
out = []
for name, ids in a["prompts"].items():
    for mode, llm in (("plain", plain), ("lookup", look)):
        times, toks = [], None
        for n in (1, a["new"]):
            llm.reset()
            t0 = time.perf_counter()
            r = llm.create_completion(ids, max_tokens=n, temperature=0.0, top_k=1)
            times.append(time.perf_counter() - t0)
            toks = r["choices"][0]["text"]
        ntok = r["usage"]["completion_tokens"]
        out.append(dict(task=name, mode=mode, text=toks, tokens=ntok,
                        decode_tok_s=(ntok - 1) / max(times[1] - times[0], 1e-9)))
print(json.dumps(out))
"""


def run_tinydet(model, ids, new, settings, spec):
    model.speculative = spec
    g = model.generate(ids, max_tokens=new, **settings)
    model.speculative = None
    return g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="native")
    ap.add_argument("--drafter", default="ngram", help="ngram, a dtype (this file drafting in it) or a draft model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--words", type=int, default=450, help="words of README.md in the passage")
    ap.add_argument("--llama-python", default=None)
    ap.add_argument("--batch", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--llama-only", action="store_true", help="skip tinydet's runs (its prompts are still made)")
    a = ap.parse_args()

    import tinydet

    model = tinydet.load(a.model, dtype=a.dtype, threads=a.threads, speculative=a.drafter)
    drafter = model.speculative  # resolved once (a draft model loaded once), then set and unset per run
    model.speculative = None
    ps = prompts(model, a.words)
    settings = {"greedy": {}, "t0.7": dict(temperature=0.7, seed=11)}
    rows = []
    for name, ids in ({} if a.llama_only else ps).items():
        for sname, s in settings.items():
            runs = {"plain": [], "spec": []}
            gens = {}
            for r in range(a.repeats):
                for spec in ((None, drafter) if r % 2 == 0 else (drafter, None)):
                    g = run_tinydet(model, ids, a.new_tokens, s, spec)
                    key = "spec" if spec else "plain"
                    runs[key].append(g.tokens_per_second)
                    if key in gens and (g.output_hash, g.logits_hash) != (gens[key].output_hash, gens[key].logits_hash):
                        sys.exit(f"{name} {sname} {key}: a repeat gave other bytes")
                    gens[key] = g
            p, n = gens["plain"], gens["spec"]
            if (p.output_hash, p.logits_hash) != (n.output_hash, n.logits_hash):
                sys.exit(f"{name} {sname}: speculative output differs from plain")
            med = {k: statistics.median(v) for k, v in runs.items()}
            rows.append(dict(task=name, sampling=sname, prompt_tokens=len(ids), tokens=len(p.token_ids),
                             plain_tok_s=med["plain"], spec_tok_s=med["spec"], speedup=med["spec"] / med["plain"],
                             acceptance=n.acceptance_rate, tokens_per_pass=n.tokens_per_pass, same_bytes=True,
                             output_hash=p.output_hash))
            print(f"{name:8} {sname:6} prompt {len(ids):5} new {len(p.token_ids):4}: plain {med['plain']:6.1f}, "
                  f"{drafter.name} {med['spec']:6.1f} tok/s ({med['spec'] / med['plain']:.2f}x), accepted "
                  f"{n.acceptance_rate:.0%}, {n.tokens_per_pass:.2f} tokens/pass, same bytes", file=sys.stderr)
    result = {"model": a.model, "dtype": a.dtype, "drafter": drafter.name, "threads": a.threads, "repeats": a.repeats,
              "tinydet": rows}
    if a.batch and not a.llama_only:
        reqs = [dict(prompt=ids, max_tokens=a.new_tokens // 2, **s) for ids in ps.values() for s in settings.values()]
        tps = {"plain": [], "spec": []}
        outs = {}
        for r in range(a.repeats):
            for spec in ((None, drafter) if r % 2 == 0 else (drafter, None)):
                model.speculative = spec
                t0 = time.perf_counter()
                gs = model.generate_batch(reqs, max_batch=8)
                dt = time.perf_counter() - t0
                model.speculative = None
                tps["spec" if spec else "plain"].append(sum(len(g.token_ids) for g in gs) / dt)
                outs["spec" if spec else "plain"] = [(g.output_hash, g.logits_hash) for g in gs]
        if outs["plain"] != outs["spec"]:
            sys.exit("generate_batch: speculative output differs from plain")
        med = {k: statistics.median(v) for k, v in tps.items()}
        result["batch"] = dict(requests=len(reqs), plain_tok_s=med["plain"], spec_tok_s=med["spec"],
                               ratio=med["spec"] / med["plain"])
        print(f"generate_batch of {len(reqs)}: plain {med['plain']:.1f}, {drafter.name} {med['spec']:.1f} tok/s "
              f"({med['spec'] / med['plain']:.2f}x), same bytes", file=sys.stderr)
    if a.llama_python:
        arg = json.dumps(dict(model=a.model, threads=a.threads, new=a.new_tokens, prompts=ps))
        r = subprocess.run([a.llama_python, "-c", LLAMA_WORKER, arg], capture_output=True, text=True)
        if r.returncode:
            sys.exit(r.stderr[-2000:])
        ll = json.loads(r.stdout)
        by = {(x["task"], x["mode"]): x for x in ll}
        result["llama.cpp"] = []
        for name in ps:
            pl, lk = by[(name, "plain")], by[(name, "lookup")]
            row = dict(task=name, plain_tok_s=pl["decode_tok_s"], lookup_tok_s=lk["decode_tok_s"],
                       speedup=lk["decode_tok_s"] / pl["decode_tok_s"], same_text=pl["text"] == lk["text"])
            result["llama.cpp"].append(row)
            print(f"llama.cpp {name:8} greedy: plain {pl['decode_tok_s']:6.1f}, lookup {lk['decode_tok_s']:6.1f} tok/s "
                  f"({row['speedup']:.2f}x), same text: {row['same_text']}", file=sys.stderr)
    if a.json:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
