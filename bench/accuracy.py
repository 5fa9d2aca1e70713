"""How far each engine's logits are from a float64 reference on the same file and prompts: tinydet's
modes (native, int8, ...) beside llama.cpp, at several prompt lengths, and where int8's greedy text
first leaves native's.

    python bench/accuracy.py --model SmolLM2-135M-Instruct.Q4_1.gguf \\
        --llama-python $LLAMA_VENV/bin/python [--dtypes native,int8] [--lengths 40,400,1500]
        [--reference float64|native] [--greedy 64] [--threads 2] [--json]

The reference is `tests/reference.py`'s float64 forward pass from the file's weights as the `gguf`
package dequantizes them (Llama-architecture files), or with `--reference native` tinydet's native
mode (fp32 products of the same dequantized weights, within ~3e-5 of float64 on SmolLM2), for
architectures the float64 reference does not cover. The prompt is this repository's README.md then
bench/README.md, tokenized by tinydet; every engine gets the same ids, each length L a fresh pass of
the first L ids (so llama.cpp runs its batch shapes for that length), every position's logits
compared. Reported per engine and length: max |logit - reference| over all positions and the whole
vocabulary, the share of positions whose argmax matches the reference's, and max |reference|.

llama.cpp runs in `--llama-python` (llama-cpp-python with its defaults: n_batch 512, its repacked
layouts), this script as its worker writing the logits to .npy files.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TEXTS = (ROOT / "README.md", ROOT / "bench" / "README.md")
GREEDY_PROMPTS = ("The capital of France is", "Once upon a time", "def fibonacci(n):")


def llama_worker(model: str, ids_file: str, out: str, lengths: str, threads: int) -> None:
    from llama_cpp import Llama

    ids = np.load(ids_file).tolist()
    for n in (int(x) for x in lengths.split(",")):
        llm = Llama(model_path=model, n_ctx=n + 16, logits_all=True, n_threads=threads, verbose=False)
        llm.eval(ids[:n])
        np.save(f"{out}{n}.npy", np.asarray(llm.scores[:n], np.float32))
        del llm


def llama_logits(a, ids: list[int], lengths: list[int]) -> dict[int, np.ndarray]:
    with tempfile.TemporaryDirectory() as d:
        np.save(f"{d}/ids.npy", np.asarray(ids, np.int64))
        r = subprocess.run([a.llama_python, __file__, "--llama-worker", a.model, f"{d}/ids.npy", f"{d}/l",
                            ",".join(map(str, lengths)), str(a.threads)], capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"llama.cpp worker failed ({r.returncode}): {r.stderr[-2000:]}")
        return {n: np.load(f"{d}/l{n}.npy") for n in lengths}


def reference_logits(a, ids: list[int], lengths: list[int], models) -> dict[int, np.ndarray]:
    if a.reference == "native":
        return {n: models["native"].logits(ids[:n]).astype(np.float64) for n in lengths}
    sys.path.insert(0, str(ROOT / "tests"))
    from reference import ReferenceModel

    ref = ReferenceModel(a.model)
    return {n: ref.logits(ids[:n]) for n in lengths}


def compare(got: np.ndarray, ref: np.ndarray) -> dict:
    return {"max_abs_error": float(np.abs(got.astype(np.float64) - ref).max()),
            "argmax_agrees": float(np.mean(got.argmax(-1) == ref.argmax(-1))),
            "max_abs_reference": float(np.abs(ref).max())}


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--llama-worker":
        llama_worker(*sys.argv[2:6], int(sys.argv[6]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtypes", default="native,int8", help="tinydet modes to compare (default native,int8)")
    ap.add_argument("--lengths", default="40,400,1500", help="prompt lengths (default 40,400,1500)")
    ap.add_argument("--reference", choices=("float64", "native"), default="float64")
    ap.add_argument("--llama-python", help="Python with llama-cpp-python (none: llama.cpp left out)")
    ap.add_argument("--greedy", type=int, default=64, help="greedy tokens per prompt for where int8 "
                    "leaves native (0: not run)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    import tinydet

    lengths = sorted(int(x) for x in a.lengths.split(","))
    dtypes = a.dtypes.split(",")
    models = {d: tinydet.load(a.model, dtype=d, threads=a.threads) for d in dict.fromkeys(dtypes + ["native"])}
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in TEXTS)
    ids = models["native"].tokenize(text)[:lengths[-1]]
    if len(ids) < lengths[-1]:
        sys.exit(f"the prompt text has only {len(ids)} tokens")
    ref = reference_logits(a, ids, lengths, models)
    engines = {f"tinydet {d}": {n: models[d].logits(ids[:n]) for n in lengths} for d in dtypes}
    if a.llama_python:
        engines["llama.cpp"] = llama_logits(a, ids, lengths)
    report = {"model": a.model, "reference": a.reference, "threads": a.threads,
              "errors": {e: {n: compare(got[n], ref[n]) for n in lengths} for e, got in engines.items()}}
    if a.greedy and "int8" in models:
        report["greedy"] = {}
        for p in GREEDY_PROMPTS:
            g = {d: models[d].generate(p, max_tokens=a.greedy) for d in ("native", "int8")}
            report["greedy"][p] = {"first_difference": first_difference(g["native"].token_ids, g["int8"].token_ids),
                                   "native": g["native"].text, "int8": g["int8"].text}
    if a.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{Path(a.model).name}, reference {a.reference}, {a.threads} threads")
    print("| engine | prompt tokens | max |error| | argmax agrees | max |reference| |")
    print("|---|--:|--:|--:|--:|")
    for e, rows in report["errors"].items():
        for n, r in rows.items():
            print(f"| {e} | {n} | {r['max_abs_error']:.3g} | {100 * r['argmax_agrees']:.1f}% | "
                  f"{r['max_abs_reference']:.1f} |")
    for p, r in report.get("greedy", {}).items():
        print(f"\n{p!r}: int8 leaves native at token {r['first_difference']}")
        print(f"  native: {r['native']!r}\n  int8:   {r['int8']!r}")


if __name__ == "__main__":
    main()
