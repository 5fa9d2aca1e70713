"""The determinism contract's checks, shared by the tests of each architecture's tiny checkpoints
(test_qwen.py, test_spm_archs.py, test_gemma3_tiny.py): each asserts bit-identical results."""

from __future__ import annotations

import numpy as np

import tinydet
from reference import hf_generate
from tinydet.structured import available as structured_available
from tinydet.tools.trace import diff_traces, run_trace, write_trace
from tinydet.tools.verify import numba_targets

# `verify`'s cells per dtype: 20 in its own process, 4 of structured outputs and 4 of tool calls where
# llguidance is installed (the test extra has it), plus one per other numba target this host can run and one with NumPy's
# AVX2/AVX-512 dispatch off. Its default dtypes: fp32, fp16 and native, and int8 for a file with
# quantized matrices.
_IN_PROCESS = 20 + (8 if structured_available() else 0)
VERIFY_CELLS = 3 * (_IN_PROCESS + len(numba_targets()))
VERIFY_CELLS_QUANTIZED = 4 * (_IN_PROCESS + len(numba_targets()))

# A dtype's cells without the other targets' and NumPy's runs (`check_verify_matrix`)
VERIFY_CELLS_IN_PROCESS = _IN_PROCESS - 1


def check_verify_matrix(path) -> None:
    """`tinydet verify` on a tiny quantized file passes: every dtype's cells in its own process (fp32,
    fp16, native and int8). The runs under the other numba targets and with NumPy's dispatch off are
    SmolLM2's and stories260K's (test_verify.py; test_golden.py under each target): an architecture's
    flags change which kernels run, not how a target compiles them, and each target's compile of
    another tiny model's passes, in subprocesses, was minutes of CI per architecture."""
    import json

    from click.testing import CliRunner

    from tinydet.cli import main

    dtypes = ("fp32", "fp16", "native", "int8")
    r = CliRunner().invoke(main, ["verify", "--model", str(path), "--json", "--max-tokens", "12", "--no-subprocess"]
                           + [a for d in dtypes for a in ("--dtype", d)])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["passed"] and len(out["cells"]) == len(dtypes) * VERIFY_CELLS_IN_PROCESS
    assert {c["dtype"] for c in out["cells"]} == set(dtypes)


def check_greedy_matches(model, ref, ids, n: int = 32, label=None) -> None:
    """tinydet's n greedy tokens after `ids` are transformers' (`reference.hf_generate`), up to a stop
    token of tinydet's."""
    want = hf_generate(ref, ids, n)
    g = model.generate(ids, max_tokens=n)
    assert len(want) == n and g.token_ids == want[:len(g.token_ids)], label
    assert len(g.token_ids) == n or g.finish_reason == "stop", label


# (threads, chunk) pairs; every test adds chunks that cross its model's sliding window at each offset.
THREADS_AND_CHUNKS = ((1, 1), (2, 5), (3, 3))


def bits(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def check_threads_chunking_and_batch(model, ids, texts, extra=()) -> None:
    """The prompt's logits at every (threads, chunk) of THREADS_AND_CHUNKS + extra equal one pass's, and
    generate_batch of `texts` (greedy and sampled, with and without step_tokens) equals each alone."""
    base = bits(model.logits(ids))
    for threads, chunk in THREADS_AND_CHUNKS + tuple(extra):
        model.threads = threads
        cache = model.backend.new_cache(len(ids))
        rows = [model.backend.forward(ids[i:i + chunk], cache, all_logits=True) for i in range(0, len(ids), chunk)]
        assert np.array_equal(bits(np.concatenate(rows)), base), (threads, chunk)
    model.threads = 2
    reqs = [dict(prompt=t, max_tokens=12 + 3 * i, temperature=0.8 * (i % 2), seed=i) for i, t in enumerate(texts)]
    solo = [model.generate(**r) for r in reqs]
    for step_tokens in (None, 4):
        got = model.generate_batch(reqs, max_batch=3, step_tokens=step_tokens)
        assert [(g.token_ids, g.logits_hash) for g in got] == [(s.token_ids, s.logits_hash) for s in solo]


def check_native_gives_fp32_bits(path, quant: str, texts, kinds=("wqkv",)) -> None:
    """Native storage of a quantized file keeps `kinds` in its type and gives fp32's logits and hashes."""
    fp32, native = tinydet.load(path, dtype="fp32"), tinydet.load(path, dtype="native")
    storage = native.backend.storage()
    assert all(storage[k] == quant.upper() for k in kinds), storage
    for text in texts:
        ids = fp32.tokenize(text)
        assert np.array_equal(bits(native.logits(ids)), bits(fp32.logits(ids)))
    g, want = native.generate(texts[0], max_tokens=20), fp32.generate(texts[0], max_tokens=20)
    assert (g.output_hash, g.logits_hash) == (want.output_hash, want.logits_hash)


def check_trace_diff(model, ids, tmp_path) -> None:
    """Traces at 1 thread in one pass and at 3 threads in chunks of 4 are identical, op for op."""
    paths = []
    for threads, chunk in ((1, None), (3, 4)):
        model.threads = threads
        p = tmp_path / f"t{threads}.jsonl"
        write_trace(p, model, ids, run_trace(model, ids, chunk), {"chunk": chunk})
        paths.append(p)
    d = diff_traces(*paths)
    assert d["identical"] and d["n_compared"] > 0
