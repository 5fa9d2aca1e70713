"""trace + diff: identical runs trace identically; a deliberately broken kernel is named by diff."""

from __future__ import annotations

import json

import numba
import numpy as np
import pytest
from click.testing import CliRunner

import tinydet
from tinydet.cli import main
from tinydet.tools.trace import OPS, diff_traces, run_trace, write_trace

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to"


def trace_to(tmp_path, name, model, chunk=None, settings=None):
    ids = model.prompt_ids(PROMPT)
    tracer = run_trace(model, ids, chunk)
    path = tmp_path / f"{name}.jsonl"
    write_trace(path, model, ids, tracer, settings or {"chunk": chunk})
    return path


def test_trace_covers_every_op_layer_and_position(tmp_path, stories_models):
    model = stories_models["fp32"]
    p = trace_to(tmp_path, "a", model)
    lines = p.read_text().splitlines()
    header = json.loads(lines[0])
    assert header["machine"]["numba"] == numba.__version__ and header["dtype"] == "fp32"
    recs = [json.loads(x) for x in lines[1:]]
    n = len(model.prompt_ids(PROMPT))
    per_layer = [op for op in OPS if op not in ("embedding", "final_norm", "logits")]
    assert len(recs) == n * (3 + model.config.n_layers * len(per_layer))
    assert {r["op"] for r in recs} == set(OPS)
    logits = model.logits(model.prompt_ids(PROMPT))
    last = [r for r in recs if r["op"] == "logits" and r["pos"] == n - 1][0]
    import hashlib
    assert last["sha256"] == hashlib.sha256(logits[-1].astype("<f4").tobytes()).hexdigest()


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_traces_agree_across_threads_and_chunking(tmp_path, stories_models, dtype):
    model = stories_models[dtype]
    saved = model.threads
    try:
        model.threads = 1
        a = trace_to(tmp_path, "a", model)
        model.threads = 3
        b = trace_to(tmp_path, "b", model, chunk=5)
        model.threads = 2
        c = trace_to(tmp_path, "c", model, chunk=1)
    finally:
        model.threads = saved
    for other in (b, c):
        d = diff_traces(a, other)
        assert d["identical"] and d["first"] is None, d
        assert "threads" in d["header_differences"]
    code = CliRunner().invoke(main, ["diff", str(a), str(b)])
    assert code.exit_code == 0 and "identical" in code.output


def test_injected_thread_dependent_sum_is_named(tmp_path, stories_path):
    model = tinydet.load(stories_path, dtype="fp32")
    wp = model.backend.weights.w2[2]  # the down projection of layer 2, as panels
    seen = {}

    def racy_down(layer, op, pos, slots, rows):
        """Through the backend's fault-injection hooks: layer 2's down projection recomputed the racy
        way. Each "thread" sums its own slice of k; partials are added in thread order, so the result
        depends on the thread count (the bug class this tool exists to find)."""
        if layer != 2:
            return
        if op == "activation":  # the down projection's input
            seen["x"] = rows.copy()
        elif op == "down":
            x, k = seen["x"], wp.shape[1]
            w = wp.transpose(0, 2, 1).reshape(-1, k)[:rows.shape[1]].astype(np.float32)
            acc = np.zeros(rows.shape, np.float32)
            for part in np.array_split(np.arange(k), numba.get_num_threads()):
                acc += x[:, part] @ w[:, part].T
            rows[:] = acc

    model.backend.hooks.append(racy_down)
    model.threads = 1
    a = trace_to(tmp_path, "t1", model)
    model.threads = 2
    b = trace_to(tmp_path, "t2", model)
    d = diff_traces(a, b)
    assert not d["identical"]
    first = d["first"]
    assert (first["op"], first["layer"]) == ("down", 2), first
    assert first["max_abs_diff"] > 0 and first["n_different"] > 0
    r = CliRunner().invoke(main, ["diff", str(a), str(b)])
    assert r.exit_code == 1
    assert "op down, layer 2, position" in r.output and "max |a-b|" in r.output


def test_fp16_vs_fp32_part_at_the_embedding(tmp_path, stories_models):
    a = trace_to(tmp_path, "f32", stories_models["fp32"])
    b = trace_to(tmp_path, "f16", stories_models["fp16"])
    d = diff_traces(a, b)
    assert d["first"]["op"] == "embedding" and d["header_differences"]["dtype"] == ("fp32", "fp16")


def test_cli_trace_and_bad_files(tmp_path, stories_path):
    out = tmp_path / "cli.jsonl"
    r = CliRunner().invoke(main, ["trace", "--model", str(stories_path), "--prompt", "Once", "--out", str(out),
                                  "--no-values"])
    assert r.exit_code == 0, r.output
    rec = json.loads(out.read_text().splitlines()[1])
    assert "values" not in rec and len(rec["sha256"]) == 64
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    r = CliRunner().invoke(main, ["diff", str(out), str(bad)])
    assert r.exit_code == 1 and "not JSON" in r.output
