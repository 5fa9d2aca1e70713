"""Where tinydet's memory goes on one model: resident memory after each stage of a load and a run,
each stage in a fresh process, and the peak over loading plus a run.

    python bench/memory.py MODEL.gguf [--dtype native] [--threads 2] [--prompt-tokens 128]
        [--new-tokens 64] [--trace] [--src DIR] [--json]

Stages, each a new worker process (this file run with `--worker STAGE`) that imports tinydet and
goes as far as its stage:

  import   `import tinydet` (the interpreter, NumPy, numba and llvmlite, tokenizers)
  runtime  then one small call of a jitted function loaded from numba's cache (`simd.from_f16_bits`,
           which loading calls too): LLVM initialized, the fixed cost of any model before its own
  open     `formats.open_checkpoint(MODEL)`: the metadata and the tokenizer; tensors are views of
           the mapped file, no weight is read
  load     `tinydet.load(MODEL, dtype)`: the weights packed, the checkpoint dropped
  kernels  then one forward of one token (an 8-position cache): the numba kernels loaded from
           numba's cache (or compiled) and the first scratch buffers
  run      then the prompt (compare.py's English text through the model's tokenizer, cut to
           --prompt-tokens ids), prefilled into a cache of prompt + new tokens, --new-tokens greedy
           single-token forwards, and the text of the new tokens detokenized

Each stage reports VmRSS from /proc/self/status (with its anonymous and file-backed parts: file
pages are the mapped model and the shared libraries' code) and VmHWM, the peak so far (the same as
ru_maxrss). The peak of the run worker is the figure of the whole job: load plus run. A worker
that had to compile kernels (numba's cache was cold: the first run after an edit of numerics/,
packing/ or backends/cpu/) peaks higher; it is run again, and the warm figures are reported.

--trace adds one more worker that runs `open` under tracemalloc (which costs memory of its own, so
its RSS is not reported): the Python objects (NumPy's arrays included) alive after opening and at
the peak of opening, by the file that allocated them. What RSS holds beyond them is native: the
libraries' code and heaps (tokenizers' Rust objects, LLVM).

--src DIR runs tinydet from another source checkout (first on PYTHONPATH), e.g. an older commit
unpacked with `git archive`, to hold a change to the memory of the build before it. The hash of the
generated ids is printed, so two builds can be seen to compute the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MiB = 1 << 20
STAGES = ("import", "runtime", "open", "load", "kernels", "run")


# ------------------------------------------------------------------------------------------- worker

def status() -> dict:
    """VmRSS, RssAnon, RssFile and VmHWM of this process, in bytes."""
    out = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def prompt_ids(tokenizer, n: int) -> list[int]:
    """compare.py's prompt: its English text through the model's tokenizer, repeated or cut to n ids."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from compare import PROMPT_TEXT

    ids = tokenizer.encode(PROMPT_TEXT * 4)
    body = ids[1:] if len(ids) > 1 else ids
    while len(ids) < n:
        ids = ids + body
    return ids[:n]


def worker(stage: str, a) -> dict:
    import gc
    import time

    out: dict = {"stage": stage}
    marks = out["marks"] = {}
    import tinydet
    import tinydet.api  # noqa: F401 - `import tinydet` defers the library (and NumPy, numba) to first use

    out["tinydet"] = str(Path(tinydet.__file__).resolve().parent)
    marks["import"] = status()
    if stage == "import":
        return out
    from tinydet.backends.cpu import on_first_compile

    compiled = []
    on_first_compile(lambda: compiled.append(True))
    if stage == "runtime":
        import numpy as np
        from tinydet.numerics.simd import from_f16_bits

        from_f16_bits(np.zeros((1, 1, 32), np.uint16))  # the signature loading uses: cached after one run
        marks["runtime"] = status()
        out["compiled"] = bool(compiled)
        return out
    if stage in ("open", "trace"):
        from tinydet.formats import open_checkpoint
        from tinydet.registry import resolve_model

        if stage == "trace":
            import tracemalloc

            tracemalloc.start()
        t0 = time.perf_counter()
        ck = open_checkpoint(resolve_model(a.model))  # held while measured: a checkpoint as tinydet.load holds it
        out["open_s"] = time.perf_counter() - t0
        out["tensors"] = len(ck.tensors)
        gc.collect()
        if stage == "open":
            marks["open"] = status()
            return out
        held, peak = tracemalloc.get_traced_memory()
        top = tracemalloc.take_snapshot().statistics("filename")
        out["traced"] = {"held": held, "peak": peak,
                         "top": [(str(s.traceback[0].filename), s.size, s.count) for s in top[:10]]}
        del ck
        return out

    t0 = time.perf_counter()
    model = tinydet.load(a.model, dtype=a.dtype, threads=a.threads)
    out["load_s"] = time.perf_counter() - t0
    gc.collect()
    marks["load"] = status()
    be = model.backend
    out["weight_bytes"] = be.weight_bytes()
    if stage != "load":
        be.forward([model.tokenizer.bos_id or 0], be.new_cache(8))
        gc.collect()
        marks["kernels"] = status()
    if stage == "run":
        ids = prompt_ids(model.tokenizer, a.prompt_tokens)
        cache = be.new_cache(a.prompt_tokens + a.new_tokens)
        tok = int(be.forward(ids, cache)[0].argmax())
        new = [tok]
        for _ in range(a.new_tokens - 1):
            tok = int(be.forward([tok], cache)[0].argmax())
            new.append(tok)
        out["text"] = model.detokenize(new)
        from tinydet.hashing import hash_ids

        out["ids_hash"] = hash_ids(new)
        out["kv_bytes"] = cache.nbytes
        marks["run"] = status()
    out["compiled"] = bool(compiled)
    return out


# ------------------------------------------------------------------------------------------- driver

def spawn(stage: str, a) -> dict:
    env = dict(os.environ)
    if a.src:
        env["PYTHONPATH"] = os.pathsep.join([a.src] + [p for p in [env.get("PYTHONPATH")] if p])
    args = [sys.executable, os.path.abspath(__file__), a.model, "--worker", stage, "--dtype", a.dtype,
            "--prompt-tokens", str(a.prompt_tokens), "--new-tokens", str(a.new_tokens)]
    if a.threads is not None:
        args += ["--threads", str(a.threads)]
    r = subprocess.run(args, env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"worker {stage} failed ({r.returncode}):\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def measure(a) -> dict:
    res: dict = {"model": a.model, "file_bytes": os.path.getsize(a.model), "dtype": a.dtype,
                 "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens, "workers": {}}
    for stage in ("import", "runtime", "open", "load", "run"):
        w = spawn(stage, a)
        if w.get("compiled"):  # a cold numba cache: the worker compiled; now the cache is warm
            w = spawn(stage, a)
            w["rerun_after_compile"] = True
        res["workers"][stage] = w
    if a.trace:
        res["workers"]["trace"] = spawn("trace", a)
    return res


def render(res: dict) -> str:
    W = res["workers"]
    run = W["run"]
    rows = [("import", W["import"]["marks"]["import"]), ("runtime", W["runtime"]["marks"]["runtime"]),
            ("open", W["open"]["marks"]["open"]),
            ("load", W["load"]["marks"]["load"]), ("kernels", run["marks"]["kernels"]), ("run", run["marks"]["run"])]
    what = {"import": "import tinydet", "runtime": "runtime (+ LLVM: one cached kernel)",
            "open": "open (metadata, tokenizer)", "load": "load (weights packed)",
            "kernels": "kernels (1-token forward)",
            "run": f"run ({res['prompt_tokens']} prompt + {res['new_tokens']} new tokens)"}
    f, kv = res["file_bytes"], run["kv_bytes"]
    lines = [f"model {Path(res['model']).name} ({f / MiB:.1f} MiB), dtype {res['dtype']}; "
             f"tinydet from {run['tinydet']}",
             f"{'stage':40s} {'RSS':>7s} {'anon':>7s} {'file':>7s} {'peak':>7s}"
             "  (MiB; peak = VmHWM of that worker so far)"]
    for stage, m in rows:
        cells = " ".join(f"{m[k] / MiB:7.1f}" for k in ("VmRSS", "RssAnon", "RssFile", "VmHWM"))
        lines.append(f"{what[stage]:40s} {cells}")
    peak = run["marks"]["run"]["VmHWM"]
    lines.append(f"open {W['open']['open_s']:.2f} s, load {W['load']['load_s']:.2f} s; weights "
                 f"{run['weight_bytes'] / MiB:.1f} MiB, KV cache {kv / MiB:.2f} MiB"
                 + ("; kernels were compiled first (cold cache), figures from a rerun"
                    if run.get("rerun_after_compile") else ""))
    base = W["runtime"]["marks"]["runtime"]["VmRSS"]
    lines.append(f"peak {peak / MiB:.1f} MiB = {(peak - kv) / f:.2f} x file + KV (target 1.5 x file + KV = "
                 f"{(1.5 * f + kv) / MiB:.1f} MiB); over the runtime's {base / MiB:.1f} MiB, the model adds "
                 f"{(peak - base) / MiB:.1f} MiB = {(peak - base - kv) / f:.2f} x file + KV")
    lines.append(f"generated ids {run['ids_hash'][:16]}: {run['text'][:60]!r}")
    if "trace" in W:
        t = W["trace"]["traced"]
        lines.append(f"Python objects after open (tracemalloc): {t['held'] / MiB:.1f} MiB held, "
                     f"{t['peak'] / MiB:.1f} MiB at the peak of opening; by file:")
        root = str(Path(run["tinydet"]).parent)
        for name, size, count in t["top"]:
            if size >= MiB // 10:
                where = os.path.relpath(name, root) if name.startswith(root) else name
                lines.append(f"  {size / MiB:7.1f} MiB {count:8d} blocks  {where}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--dtype", default="native", choices=["fp32", "fp16", "native", "int8"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--trace", action="store_true", help="also attribute the Python objects after opening")
    ap.add_argument("--src", help="run tinydet from this source checkout")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", choices=STAGES + ("trace",), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a)))
        return
    a.model = os.path.abspath(os.path.expanduser(a.model))
    res = measure(a)
    print(json.dumps(res, indent=1) if a.json else render(res))


if __name__ == "__main__":
    main()
