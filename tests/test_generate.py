"""End to end: the published stories260K greedy text, through the API and the CLI; streaming, stop
strings and hashes."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

import tinydet
from tinydet.hashing import hash_ids, hash_logits

# llama2.c's `run` with steps=256 feeds BOS at position 0 and prints the token chosen after each of the
# 256 forward passes, so the published text holds 256 new tokens, then its closing "\n".
STORIES_NEW_TOKENS = 256


def test_stories_greedy_text_api(stories_models, stories_greedy_text):
    g = stories_models["fp32"].generate("", max_tokens=STORIES_NEW_TOKENS)
    assert g.prompt_token_ids == [1]
    assert len(g.token_ids) == STORIES_NEW_TOKENS and g.finish_reason == "length"
    assert g.text + "\n" == stories_greedy_text
    assert g.output_hash == hash_ids(g.token_ids)


def test_stories_greedy_text_cli(stories_path, stories_greedy_text):
    r = subprocess.run([sys.executable, "-m", "tinydet", "generate", "", "--model", str(stories_path),
                        "--max-tokens", str(STORIES_NEW_TOKENS), "--dtype", "fp32", "--temperature", "0"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout == stories_greedy_text


def test_cli_json(stories_path, stories_models):
    r = subprocess.run([sys.executable, "-m", "tinydet", "generate", "Once upon", "--model", str(stories_path),
                        "--max-tokens", "20", "--temperature", "0.8", "--top-p", "0.9", "--seed", "7", "--top-k", "0",
                        "--min-p", "0", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    g = stories_models["fp32"].generate("Once upon", max_tokens=20, temperature=0.8, top_p=0.9, seed=7)
    assert out["token_ids"] == g.token_ids and out["text"] == g.text
    assert out["output_hash"] == g.output_hash and out["logits_hash"] == g.logits_hash
    assert out["settings"]["seed"] == 7 and out["settings"]["top_p"] == 0.9
    import hashlib
    assert out["model_sha256"] == hashlib.sha256(stories_path.read_bytes()).hexdigest()
    assert out["tokens_per_second"] > 0


def test_logits_hash_covers_the_rows_that_chose_the_tokens(stories_models):
    model = stories_models["fp32"]
    g = model.generate("Once upon a time", max_tokens=6)
    ids = g.prompt_token_ids + g.token_ids
    rows = model.logits(ids)[len(g.prompt_token_ids) - 1:-1]
    assert [int(np.argmax(r)) for r in rows] == g.token_ids
    assert hash_logits(rows) == g.logits_hash


def test_stream_equals_generate(stories_models):
    model = stories_models["fp16"]
    kw = dict(max_tokens=60, temperature=0.9, top_k=40, seed=3)
    assert "".join(model.stream("Lily", **kw)) == model.generate("Lily", **kw).text


def test_seeded_sampling_repeats_and_depends_on_seed(stories_models):
    model = stories_models["fp32"]
    a = model.generate("Once", max_tokens=40, temperature=1.0, seed=1)
    assert a.token_ids == model.generate("Once", max_tokens=40, temperature=1.0, seed=1).token_ids
    assert a.token_ids != model.generate("Once", max_tokens=40, temperature=1.0, seed=2).token_ids


def test_stop_strings(stories_models):
    model = stories_models["fp32"]
    full = model.generate("", max_tokens=60).text
    assert "Lily" in full
    g = model.generate("", max_tokens=60, stop=["Lily"])
    assert g.finish_reason == "stop" and g.text == full[:full.index("Lily")]
    assert "".join(model.stream("", max_tokens=60, stop=["Lily"])) == g.text


def test_eos_stops(stories_models):
    import copy

    model = copy.copy(stories_models["fp32"])
    full = model.generate("", max_tokens=40)
    period = model.tokenize(".", add_special=False)[-1]
    assert period in full.token_ids
    model.tokenizer = copy.copy(model.tokenizer)
    model.tokenizer.eos_ids = (period,)  # pretend "." ends generation
    g = model.generate("", max_tokens=40)
    k = full.token_ids.index(period)
    assert g.finish_reason == "stop" and g.token_ids == full.token_ids[:k + 1]
    assert g.text == full.text[:len(g.text)] and not g.text.endswith(".")


def test_threads_do_not_change_generation(stories_path):
    outs = {tinydet.load(stories_path, threads=t).generate("Once", max_tokens=30, temperature=0.7, seed=9).logits_hash
            for t in (1, 2, 3)}
    assert len(outs) == 1


def test_structured_log(tmp_path, stories_path):
    import hashlib as hl

    log = tmp_path / "requests.jsonl"
    r = subprocess.run([sys.executable, "-m", "tinydet", "generate", "Once", "--model", str(stories_path),
                        "--max-tokens", "8", "--log", str(log), "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    model = tinydet.load(stories_path, log=log)
    g = model.generate("Once", max_tokens=8, temperature=0.5, seed=3)
    batch = model.generate_batch([dict(prompt="Once", max_tokens=8), dict(prompt="Ben", max_tokens=4)])
    "".join(model.stream("Lily", max_tokens=5))
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(lines) == 5
    first = lines[0]
    assert first["output_hash"] == out["output_hash"] and first["logits_hash"] == out["logits_hash"]
    assert first["model_sha256"] == hl.sha256(stories_path.read_bytes()).hexdigest()
    assert first["prompt_hash"] == hash_ids(out["prompt_token_ids"]) and first["backend"] == "cpu-numba"
    for key in ("time", "request_id", "tinydet_version", "settings", "dtype", "threads", "timings"):
        assert key in first
    assert lines[1]["output_hash"] == g.output_hash and lines[1]["settings"]["seed"] == 3
    assert [x["output_hash"] for x in lines[2:4]] == [b.output_hash for b in batch]
    assert lines[4]["n_tokens"] == 5 and len({x["request_id"] for x in lines}) == 5
