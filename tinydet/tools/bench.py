"""Speed of a model on this machine: `bench(model)` measures prefill and decode throughput, the
first-token latency, load time and peak memory, and `format_report` prints the result.

    import tinydet
    from tinydet.tools.bench import bench, format_report
    print(format_report(bench("smollm2-135m-instruct", dtype="fp32", threads=2)))

The prompt is `prompt_tokens` fixed token ids (the same for every run and model of the same
vocabulary). One warm-up run (the same work, compiling or loading the numba kernels) comes first and is
left out of the medians. Each repeat starts from an empty KV cache: one forward over the prompt (prefill; its
greedy pick is the first new token), then `new_tokens` single-token forwards, each choosing the next
token greedily (decode). Numbers are medians over `repeats`. Timing does not change the results: the
same computation runs as in `generate`.
"""

from __future__ import annotations

import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import TinydetError


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TinydetError(f"{name}: expected a positive integer, found {value!r}")
    return value


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss) if sys.platform == "darwin" else int(rss) * 1024


def current_rss_bytes() -> int | None:
    """Resident set size now (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def bench_prompt(vocab_size: int, n: int, bos_id: int | None = None) -> list[int]:
    """`n` fixed token ids spread over the vocabulary (after BOS when the model has one)."""
    ids = [(i * 7919 + 13) % vocab_size for i in range(n)]
    if bos_id is not None:
        ids[0] = bos_id
    return ids


def timed_greedy(backend, prompt: list[int], new_tokens: int, threads: int | None = None
                 ) -> tuple[float, float, float, list[int]]:
    """One timed run from an empty KV cache: a forward over `prompt` and the greedy pick of the first
    new token (prefill, t0..t1), then `new_tokens` single-token forwards, each with a greedy pick
    (decode, t1..t2), on `backend` (at `threads`, when given). Returns (t0, t1, t2, the new_tokens + 1
    ids picked). `bench/compare.py` times tinydet with this too."""
    if threads is not None:
        backend.threads = threads
    cache = backend.new_cache(len(prompt) + new_tokens)
    out = []
    t0 = time.perf_counter()
    tok = int(np.argmax(backend.forward(prompt, cache)[0]))  # ties go to the lower id, as in sampling
    t1 = time.perf_counter()
    for _ in range(new_tokens):
        out.append(tok)
        tok = int(np.argmax(backend.forward([tok], cache)[0]))
    t2 = time.perf_counter()
    out.append(tok)
    return t0, t1, t2, out


def bench(model, prompt_tokens: int = 128, new_tokens: int = 64, repeats: int = 3, *, dtype: str = "fp32",
          threads: int | None = None, load_seconds: float | None = None,
          rss_before_load: int | None = None) -> dict[str, Any]:
    """Measure `model` (a loaded `tinydet.Model`, or anything `tinydet.load` takes: then it is loaded
    here with `dtype` and `threads`, and the load is timed). A caller that loaded the model itself may
    pass `load_seconds` to have it reported. Returns a JSON-serializable dict:

    prefill_tok_s, decode_tok_s       medians over `repeats` (tokens per second)
    first_token_s                     median time from the prompt to the first new token (prefill + pick)
    prefill_tok_s_runs, decode_tok_s_runs, first_token_s_runs   every repeat
    output_hash                       SHA-256 of the new_tokens + 1 greedy ids (the prefill's pick, then
                                      one per decode step), as int32 little-endian, like generate's
    repeats_identical                 whether every repeat chose the same ids (it should: a False is a bug)
    load_s                            seconds to load the model (None when not known)
    warmup_s                          the first, excluded run (with kernel compile or cache load)
    peak_rss_bytes, peak_rss_mib      the process's peak resident memory so far
    weight_bytes, kv_cache_bytes      the weights as held in memory, and a KV cache of
                                      prompt_tokens + new_tokens positions
    rss_over_weights_and_kv           peak_rss_bytes / (weight_bytes + kv_cache_bytes)
    rss_before_load_bytes             the process's resident memory before the model was loaded (the
                                      interpreter, NumPy, numba and LLVM: about 100 MiB), when known
                                      (`rss_before_load`, or measured here when this call loads)
    model_rss_over_weights_and_kv     (peak_rss_bytes - rss_before_load_bytes) / (weights + KV cache):
                                      what loading and running the model added, over what it holds
    model, dtype, backend (its name), threads, prompt_tokens, new_tokens, repeats, and the machine and versions
    """
    from .. import __version__
    from ..api import Model, load
    from ..hashing import hash_ids

    prompt_tokens = _positive_int("prompt_tokens", prompt_tokens)
    new_tokens = _positive_int("new_tokens", new_tokens)
    repeats = _positive_int("repeats", repeats)
    if not isinstance(model, Model):
        rss_before_load = current_rss_bytes()
        t0 = time.perf_counter()
        model = load(model, dtype=dtype, threads=threads)
        load_seconds = time.perf_counter() - t0
    elif threads is not None and threads != model.threads:
        raise TinydetError(f"threads: the model was loaded for {model.threads} threads, found {threads!r}")
    tr = model.backend
    cfg = model.config
    total = prompt_tokens + new_tokens
    if total > cfg.context_length:
        raise TinydetError(f"prompt_tokens + new_tokens: {total} exceeds the model's context length "
                           f"{cfg.context_length}")
    prompt = bench_prompt(cfg.vocab_size, prompt_tokens, model.tokenizer.bos_id)
    th = model.threads

    t0, _, t2, _ = timed_greedy(tr, prompt, new_tokens, th)  # warm-up: compiles or loads every kernel
    warmup_s = t2 - t0

    prefill, decode, first, outputs = [], [], [], []
    for _ in range(repeats):
        t0, t1, t2, ids = timed_greedy(tr, prompt, new_tokens, th)
        outputs.append(ids)
        first.append(t1 - t0)
        prefill.append(prompt_tokens / (t1 - t0))
        decode.append(new_tokens / (t2 - t1))

    rss = peak_rss_bytes()
    probe = tr.new_cache(total)
    kv_bytes = probe.nbytes
    del probe
    weight_bytes = tr.weight_bytes()
    import numba

    return {
        "model": str(model.path),
        "dtype": model.dtype,
        "backend": model.backend.name,
        "threads": th,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "prefill_tok_s": statistics.median(prefill),
        "decode_tok_s": statistics.median(decode),
        "first_token_s": statistics.median(first),
        "prefill_tok_s_runs": prefill,
        "decode_tok_s_runs": decode,
        "first_token_s_runs": first,
        "output_hash": hash_ids(outputs[0]),
        "repeats_identical": all(o == outputs[0] for o in outputs),
        "load_s": load_seconds,
        "warmup_s": warmup_s,
        "peak_rss_bytes": rss,
        "peak_rss_mib": rss / 2**20,
        "weight_bytes": weight_bytes,
        "kv_cache_bytes": kv_bytes,
        "rss_over_weights_and_kv": rss / (weight_bytes + kv_bytes),
        "rss_before_load_bytes": rss_before_load,
        "model_rss_over_weights_and_kv": (None if rss_before_load is None
                                          else (rss - rss_before_load) / (weight_bytes + kv_bytes)),
        "machine": {"cpu": cpu_name(), "cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "versions": {"tinydet": __version__, "numpy": np.__version__, "numba": numba.__version__},
    }


def format_report(r: dict[str, Any]) -> str:
    """A few human-readable lines for a `bench` result."""
    load = "not measured (model passed in loaded)" if r.get("load_s") is None else f"{r['load_s']:.2f} s"
    runs = lambda key, fmt: ", ".join(format(v, fmt) for v in r.get(key, []))  # noqa: E731
    m = r.get("machine", {})
    lines = [
        f"model    {Path(r['model']).name}  dtype {r['dtype']}  threads {r['threads']}  backend {r.get('backend', '?')}",
        f"machine  {m.get('cpu', '?')} ({m.get('cpus', '?')} CPUs), Python {m.get('python', '?')}, "
        f"tinydet {r.get('versions', {}).get('tinydet', '?')}",
        f"load     {load}; warm-up run {r['warmup_s']:.2f} s (excluded)",
        f"prefill  {r['prefill_tok_s']:8.1f} tok/s  ({r['prompt_tokens']} tokens; median of {r['repeats']}: "
        f"{runs('prefill_tok_s_runs', '.1f')})",
        f"decode   {r['decode_tok_s']:8.1f} tok/s  ({r['new_tokens']} tokens, greedy; median of {r['repeats']}: "
        f"{runs('decode_tok_s_runs', '.1f')})",
        f"first token  {r['first_token_s'] * 1000:.1f} ms  (prefill of {r['prompt_tokens']} tokens + pick)",
        f"memory   peak RSS {r['peak_rss_mib']:.0f} MiB = {r['rss_over_weights_and_kv']:.2f} x (weights "
        f"{r['weight_bytes'] / 2**20:.0f} MiB + KV cache {r['kv_cache_bytes'] / 2**20:.1f} MiB)"
        + ("" if r.get("rss_before_load_bytes") is None else
           f"; {r['rss_before_load_bytes'] / 2**20:.0f} MiB before loading, so the model added "
           f"{r['model_rss_over_weights_and_kv']:.2f} x"),
        f"output   {r['output_hash'][:16]}  "
        f"({'identical in every repeat' if r['repeats_identical'] else 'DIFFERS between repeats'})",
    ]
    return "\n".join(lines)
