"""tinydet.tools.bench: the numbers are there, positive and consistent (no timing thresholds: machines vary),
and timing does not change what is computed."""

from __future__ import annotations

import json
import math

import pytest

import tinydet
from tinydet.tools.bench import bench, bench_prompt, format_report

NUMBERS = ("prefill_tok_s", "decode_tok_s", "first_token_s", "warmup_s", "peak_rss_bytes", "peak_rss_mib")


def _sane(r: dict, prompt_tokens: int, new_tokens: int, repeats: int) -> None:
    for key in NUMBERS:
        assert isinstance(r[key], (int, float)) and math.isfinite(r[key]) and r[key] > 0, (key, r[key])
    for key in ("prefill_tok_s_runs", "decode_tok_s_runs", "first_token_s_runs"):
        assert len(r[key]) == repeats and all(v > 0 and math.isfinite(v) for v in r[key]), key
    assert min(r["prefill_tok_s_runs"]) <= r["prefill_tok_s"] <= max(r["prefill_tok_s_runs"])
    assert min(r["decode_tok_s_runs"]) <= r["decode_tok_s"] <= max(r["decode_tok_s_runs"])
    # first-token latency is the prefill's time (with the pick), run by run
    for tok_s, latency in zip(r["prefill_tok_s_runs"], r["first_token_s_runs"]):
        assert tok_s == pytest.approx(prompt_tokens / latency, rel=1e-9)
    assert r["peak_rss_bytes"] > 10 * 2**20  # a Python process with numba loaded
    assert (r["prompt_tokens"], r["new_tokens"], r["repeats"]) == (prompt_tokens, new_tokens, repeats)
    assert r["repeats_identical"] is True
    assert len(r["output_hash"]) == 64
    assert r["weight_bytes"] > 0 and r["kv_cache_bytes"] > 0
    assert r["rss_over_weights_and_kv"] == pytest.approx(r["peak_rss_bytes"] / (r["weight_bytes"] + r["kv_cache_bytes"]))
    json.dumps(r)  # serializable as it is


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_bench_loaded_model(stories_models, dtype):
    model = stories_models[dtype]
    r = bench(model, prompt_tokens=16, new_tokens=8, repeats=2)
    _sane(r, 16, 8, 2)
    assert r["dtype"] == dtype and r["threads"] == model.threads
    assert r["load_s"] is None
    text = format_report(r)
    for word in ("prefill", "decode", "first token", "peak RSS", "not measured", dtype):
        assert word in text


def test_bench_same_tokens_as_generate(stories_models):
    """The greedy ids bench decodes are generate's for the same prompt ids (until any EOS)."""
    model = stories_models["fp32"]
    r = bench(model, prompt_tokens=12, new_tokens=10, repeats=1)
    prompt = bench_prompt(model.config.vocab_size, 12, model.tokenizer.bos_id)
    g = model.generate(prompt, max_tokens=11)
    if g.finish_reason == "length":
        assert r["output_hash"] == g.output_hash


def test_bench_loads_a_path(stories_path):
    r = bench(stories_path, prompt_tokens=8, new_tokens=4, repeats=1, dtype="fp16", threads=1)
    _sane(r, 8, 4, 1)
    assert r["load_s"] > 0 and r["dtype"] == "fp16" and r["threads"] == 1
    assert "load     " in format_report(r) and "not measured" not in format_report(r)


def test_bench_threads_do_not_change_output(stories_path):
    a = bench(stories_path, prompt_tokens=10, new_tokens=6, repeats=1, threads=1)
    b = bench(stories_path, prompt_tokens=10, new_tokens=6, repeats=1, threads=2)
    assert a["output_hash"] == b["output_hash"]


def test_bench_load_seconds_passed_through(stories_models):
    r = bench(stories_models["fp32"], prompt_tokens=4, new_tokens=2, repeats=1, load_seconds=1.25)
    assert r["load_s"] == 1.25 and "1.25 s" in format_report(r)


@pytest.mark.parametrize("kwargs", [dict(prompt_tokens=0), dict(new_tokens=-1), dict(repeats=0),
                                    dict(prompt_tokens=1.5), dict(prompt_tokens=100_000)])
def test_bench_rejects_bad_arguments(stories_models, kwargs):
    with pytest.raises(tinydet.TinydetError):
        bench(stories_models["fp32"], **kwargs)


def test_bench_cli(stories_path):
    from click.testing import CliRunner

    from tinydet.cli import main

    args = ["bench", "--model", str(stories_path), "--prompt-tokens", "8", "--max-tokens", "4", "--repeats", "2",
            "--threads", "1"]
    r = CliRunner().invoke(main, args + ["--dtype", "native", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    _sane(out, 8, 4, 2)
    assert out["dtype"] == "native" and out["load_s"] > 0
    want = bench(stories_path, prompt_tokens=8, new_tokens=4, repeats=1, threads=1)
    assert out["output_hash"] == want["output_hash"]  # native decodes fp32's tokens
    text = CliRunner().invoke(main, args)
    assert text.exit_code == 0 and "decode" in text.output and "x (weights" in text.output
    bad = CliRunner().invoke(main, ["bench", "--model", str(stories_path), "--prompt-tokens", "100000"])
    assert bad.exit_code == 1 and "context length" in bad.output
