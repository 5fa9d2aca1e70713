"""The determinism matrix behind `tinydet verify`: one workload run many ways, a hash per cell.

Workload: greedy generation of `n_new` tokens from the prompt. A cell's hash is SHA-256 over the
generated ids (int32 LE) and the float32 logits rows that chose them. Every cell must equal the
baseline (1 thread, whole-prompt prefill, alone, KV cache, this process); native storage's cells
must equal fp32's baseline.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass

from .. import structured
from ..engine import generate_batch
from ..engine.speculate import NgramDrafter, RandomDrafter
from ..hashing import hash_ids, hash_logits
from ..sampling import SamplingParams, sample

OTHER_PROMPTS = ["The little dog ran", "A", "Why is the sky blue? Because"]


@dataclass
class Cell:
    dtype: str
    group: str
    variant: str
    hash: str | None
    ok: bool | None = None
    note: str = ""


def _digest(ids, rows) -> str:
    return hashlib.sha256((hash_ids(ids) + hash_logits(rows)).encode()).hexdigest()


def run_cached(model, prompt_ids, n_new, chunk=None):
    """Greedy with a KV cache, the prompt prefilled in chunks of `chunk` tokens (None: at once)."""
    be = model.backend
    cache = be.new_cache(len(prompt_ids) + n_new)
    step = chunk or len(prompt_ids)
    for i in range(0, len(prompt_ids), step):
        logits = be.forward(prompt_ids[i:i + step], cache)[0]
    ids, rows = [], []
    for k in range(n_new):
        tok = sample(logits, SamplingParams(), len(prompt_ids) + k)
        ids.append(tok)
        rows.append(logits)
        if k + 1 < n_new:
            logits = be.forward([tok], cache)[0]
    return ids, rows


def run_recompute(model, prompt_ids, n_new):
    """Greedy with no cache reuse: every step runs the whole sequence from an empty cache."""
    be = model.backend
    seq = list(prompt_ids)
    ids, rows = [], []
    for k in range(n_new):
        logits = be.forward(seq, be.new_cache(len(seq)))[0]
        tok = sample(logits, SamplingParams(), len(seq))
        ids.append(tok)
        rows.append(logits)
        seq.append(tok)
    return ids, rows


def run_batch(model, prompt_ids, n_new, where: str, speculative=None):
    """Greedy generation alone or placed among other requests in one batch, `speculative` (a drafter)
    checking proposals or not: (ids, None, logits hash)."""
    others = [model.request(p, max_tokens=n_new + 3 * i, temperature=0.8, seed=i) for i, p in enumerate(OTHER_PROMPTS)]
    target = model.request(list(prompt_ids), max_tokens=n_new)
    batch = {"alone": [target], "first": [target] + others, "last": others + [target],
             "among": others[:1] + [target] + others[1:]}[where]
    g = generate_batch(model.backend, model.tokenizer, batch, len(batch), speculative=speculative)[batch.index(target)]
    # generate_batch may stop early at EOS; the cached run then must too.
    return g.token_ids, None, g.logits_hash


# A constrained request (structured outputs): its own baseline, since the constraint changes the tokens.
STRUCTURED_REGEX = "[a-z ,.]{1,400}"


def run_structured(model, prompt_ids, n_new, where: str = "alone", step_tokens=None, speculative=None) -> str:
    """A sampled request constrained by STRUCTURED_REGEX, alone or among others, prefilled whole or
    `step_tokens` a step, with a drafter or not: its digest (ids and the masked logits rows)."""
    target = model.request(list(prompt_ids), max_tokens=n_new, temperature=0.8, seed=1, regex=STRUCTURED_REGEX)
    others = [model.request(p, max_tokens=n_new + 3 * i, temperature=0.8, seed=i) for i, p in enumerate(OTHER_PROMPTS)]
    batch = [target] if where == "alone" else others[:1] + [target] + others[1:]
    g = generate_batch(model.backend, model.tokenizer, batch, len(batch), step_tokens, speculative)[batch.index(target)]
    return hashlib.sha256((g.output_hash + g.logits_hash).encode()).hexdigest()


# Tool calls (tinydet/chat/): a required call after optional reasoning and an auto one, in the generic
# syntax (any vocabulary spells it), read back by the parser; the digest covers the message and call ids.
VERIFY_TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "maxLength": 24}, "n": {"type": "integer"}},
    "required": ["q", "n"], "additionalProperties": False}}}]


def run_tools(model, prompt_ids, n_new, where: str = "alone", step_tokens=None, speculative=None) -> str:
    """A required call (reasoning allowed first) and a sampled auto request, alone or among others,
    prefilled whole or `step_tokens` a step, with a drafter or not: the digest of both answers (ids,
    logits rows, the message read back with its call ids)."""
    from ..chat.plan import THINK, ChatPlan, think_prefix
    from ..chat.syntax import Generic

    syn, lit = Generic(), lambda t: json.dumps(t)  # noqa: E731
    plans = [ChatPlan("", VERIFY_TOOLS, choice, True, syn, THINK,
                      grammar=syn.grammar(VERIFY_TOOLS, choice, True, lit, pre))
             for choice, pre in (("required", think_prefix(False)), ("auto", ""))]
    targets = [model.request(list(prompt_ids), max_tokens=n_new, temperature=0.8, seed=seed, grammar=plan.grammar)
               for plan, seed in zip(plans, (1, 2))]
    others = [model.request(p, max_tokens=n_new + 3 * i, temperature=0.8, seed=i) for i, p in enumerate(OTHER_PROMPTS)]
    batch = targets if where == "alone" else others[:1] + targets[:1] + others[1:] + targets[1:]
    out = generate_batch(model.backend, model.tokenizer, batch, len(batch), step_tokens, speculative)
    h = hashlib.sha256()
    for plan, t in zip(plans, targets):
        g = model.read_chat(plan, out[batch.index(t)], "verify")
        h.update((g.output_hash + g.logits_hash + json.dumps(g.message.openai())).encode())
    return h.hexdigest()


# An AVX2-only x86-64 (Haswell's features, none of AVX-512): numba takes the host's features unless told
# otherwise, so NUMBA_CPU_NAME alone would still compile AVX-512 code.
AVX2_FEATURES = ("+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+cx8,+f16c,+fma,+fsgsbase,+fxsr,+lzcnt,+mmx,+movbe,"
                 "+pclmul,+popcnt,+rdrnd,+sahf,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave,+xsaveopt")


def numba_targets() -> dict[str, dict[str, str]]:
    """Compile targets other than the host's that this host can run, as environments: a generic CPU
    (no vector extensions beyond the baseline), and on an AVX-512 x86-64 an AVX2-only one (its own
    tile shapes: backends/cpu/tiles.py)."""
    from llvmlite import binding as llvm

    targets = {"generic x86-64": {"NUMBA_CPU_NAME": "generic"}}
    feats = llvm.get_host_cpu_features()
    if feats.get("avx512f") and feats.get("avx2"):
        targets["AVX2 (haswell)"] = {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": AVX2_FEATURES}
    return targets


def npy_dispatch_to_disable() -> str:
    """NumPy's dispatch targets above the baseline that use AVX2 or AVX-512."""
    try:
        from numpy._core import _multiarray_umath as m
    except ImportError:  # NumPy 1.x
        from numpy.core import _multiarray_umath as m
    tags = ("AVX512", "AVX2", "X86_V3", "X86_V4", "FMA3")
    return " ".join(f for f in m.__cpu_dispatch__ if any(t in f for t in tags))


def _subprocess_cell(model_name, dtype, prompt_ids, n_new, env_extra: dict) -> tuple[str | None, str]:
    env = dict(os.environ, **env_extra)
    cmd = [sys.executable, "-m", "tinydet", "verify", "--model", str(model_name), "--dtype", dtype,
           "--max-tokens", str(n_new), "--worker", json.dumps(list(prompt_ids))]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode != 0:
        return None, (r.stderr.strip().splitlines() or ["failed"])[-1]
    return json.loads(r.stdout)["hash"], ""


def worker_hash(model, prompt_ids, n_new) -> str:
    ids, rows = run_cached(model, list(prompt_ids), n_new)
    return _digest(ids, rows)


def run_matrix(load, model_name, prompt_ids, n_new: int, dtypes=("fp32", "fp16", "native"), subprocesses: bool = True,
               progress=None, reference=None) -> list[Cell]:
    """All cells for each dtype. `load(dtype, threads)` returns a Model; `reference(dtype)`, where given,
    another backend's Model (the CPU's, when `load` gives a GPU's) whose run is one more cell."""
    cells: list[Cell] = []
    for dtype in dtypes:
        model = load(dtype, 1)
        ids = list(prompt_ids)

        def add(group, variant, fn, note=""):
            if progress:
                progress(f"{dtype} {group} {variant}")
            out = fn()
            h = out[2] if len(out) == 3 else _digest(*out)
            cells.append(Cell(dtype, group, variant, h, note=note))

        model.threads = 1
        add("baseline", "1 thread, whole prompt, alone, KV cache", lambda: run_cached(model, ids, n_new))
        base_ids, base_rows = run_cached(model, ids, n_new)
        add("repeat", "second run", lambda: run_cached(model, ids, n_new))
        for t in (1, 2, 3, 4):
            model.threads = t
            add("threads", str(t), lambda: run_cached(model, ids, n_new))
        model.threads = 1
        for chunk, name in ((None, "whole"), (1, "token by token"), (7, "chunks of 7"), (64, "chunks of 64")):
            add("prefill", name, lambda: run_cached(model, ids, n_new, chunk))
        add("kv cache", "full recompute", lambda: run_recompute(model, ids, n_new))
        # generate_batch stops at EOS; a batch cell matches when its tokens and logits rows equal the
        # baseline's (up to where it stopped), and then carries the baseline's hash.
        for where in ("alone", "first", "last", "among"):
            if progress:
                progress(f"{dtype} batch {where}")
            tok, _, lh = run_batch(model, ids, n_new, where)
            n = len(tok)
            same = tok == base_ids[:n] and lh == hash_logits(base_rows[:n])
            cells.append(Cell(dtype, "batch", where, _digest(base_ids, base_rows) if same else lh))
        # speculative decoding: prompt lookup, and proposals that are nearly all wrong
        for name, mk in (("ngram", NgramDrafter), ("random proposals", lambda: RandomDrafter(model.config.vocab_size))):
            for where in ("alone", "among"):
                if progress:
                    progress(f"{dtype} speculative {name} {where}")
                tok, _, lh = run_batch(model, ids, n_new, where, mk())
                n = len(tok)
                same = tok == base_ids[:n] and lh == hash_logits(base_rows[:n])
                cells.append(Cell(dtype, "speculative", f"{name}, {where}", _digest(base_ids, base_rows) if same else lh))
        if structured.available():  # compared with their own baseline (below)
            model.threads = 1
            add("structured", "baseline: alone, 1 thread", lambda: (None, None, run_structured(model, ids, n_new)))
            add("structured", "among others", lambda: (None, None, run_structured(model, ids, n_new, "among")))
            model.threads = 3
            add("structured", "3 threads, chunks of 7", lambda: (None, None, run_structured(model, ids, n_new, "alone", 7)))
            model.threads = 1
            add("structured", "ngram, among others",
                lambda: (None, None, run_structured(model, ids, n_new, "among", None, NgramDrafter())))
            add("tools", "baseline: alone, 1 thread", lambda: (None, None, run_tools(model, ids, n_new)))
            add("tools", "among others", lambda: (None, None, run_tools(model, ids, n_new, "among")))
            model.threads = 3
            add("tools", "3 threads, chunks of 7", lambda: (None, None, run_tools(model, ids, n_new, "alone", 7)))
            model.threads = 1
            add("tools", "ngram, among others",
                lambda: (None, None, run_tools(model, ids, n_new, "among", None, NgramDrafter())))
        if reference is not None:
            ref = reference(dtype)
            add("backend", ref.backend.name, lambda: run_cached(ref, ids, n_new))
        if subprocesses:
            variants = [("numba target", v, env) for v, env in numba_targets().items()]
            variants.append(("numpy dispatch", "no AVX2/AVX-512", {"NPY_DISABLE_CPU_FEATURES": npy_dispatch_to_disable()}))
            for group, variant, env in variants:
                if progress:
                    progress(f"{dtype} {group} {variant}")
                h, err = _subprocess_cell(model_name, dtype, ids, n_new, env)
                cells.append(Cell(dtype, group, variant, h, note=err))
    # Each cell against its dtype's baseline: the plain workload's, or for structured and tools cells
    # the constrained requests' own. Native storage computes fp32's bits, so it is held to fp32's.
    kind = lambda c: c.group if c.group in ("structured", "tools") else ""  # noqa: E731
    is_base = lambda c: c.group == "baseline" or (kind(c) and c.variant.startswith("baseline"))  # noqa: E731
    baselines = {(c.dtype, kind(c)): c.hash for c in cells if is_base(c)}
    for k in ("", "structured", "tools"):
        if ("fp32", k) in baselines and ("native", k) in baselines:
            baselines[("native", k)] = baselines[("fp32", k)]
    for c in cells:
        c.ok = c.hash is not None and c.hash == baselines[(c.dtype, kind(c))]
    return cells


def format_table(cells: list[Cell]) -> str:
    lines = [f"{'dtype':<6} {'cell':<16} {'variant':<40} {'hash':<18} result"]
    for c in cells:
        h = (c.hash or "-")[:16]
        res = "ok" if c.ok else ("FAILED: " + c.note if c.note else "DIFFERS")
        lines.append(f"{c.dtype:<6} {c.group:<16} {c.variant:<40} {h:<18} {res}")
    return "\n".join(lines)
