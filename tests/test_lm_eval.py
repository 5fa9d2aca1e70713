"""lm-evaluation-harness against a live `tinydet serve`: its own `local-completions` client (the
server's /tokenize as its tokenizer) on a small local task set (`evaltask.py`: multiple choice,
generation, rolling log-likelihood). Every per-sample result is the same at any concurrency, with the
prefix cache or without, chunked prefill or not, and each score is the model's own log-probability."""

from __future__ import annotations

import json
import logging

import pytest

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install -e '.[eval]')")
pytest.importorskip("tenacity", reason="lm-evaluation-harness's API client needs tenacity (pip install -e '.[eval]')")

import evaltask  # noqa: E402
from test_serve import NAME, serving  # noqa: E402
from tinydet.logprobs import token_logprobs  # noqa: E402


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    return folder, evaltask.write(folder, n_mc=8, n_gen=4, n_rolling=3, long=False)


@pytest.fixture(scope="module")
def stories(stories_models):
    return stories_models["fp32"]


def evaluate(url: str, tasks, concurrency: int) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    folder, names = tasks
    logging.getLogger("lm-eval").setLevel(logging.WARNING)
    return simple_evaluate(model="local-completions",
                           model_args={"model": NAME, "base_url": f"{url}/v1/completions",
                                       "num_concurrent": concurrency, "max_retries": 1},
                           tasks=names, task_manager=TaskManager(include_path=str(folder), include_defaults=False),
                           log_samples=True)


def samples(out: dict) -> dict:
    """Each task's per-sample records (arguments, responses, filtered responses, metrics) as JSON text."""
    return {task: json.dumps(sorted(rows, key=lambda r: r["doc_id"]), sort_keys=True, default=str)
            for task, rows in out["samples"].items()}


def test_lm_eval_gives_the_same_samples_at_any_concurrency(stories, tasks, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    runs = []
    with serving(stories, max_batch=8, prefill_chunk=16) as (url, service):
        for concurrency in (1, 8):
            runs.append(evaluate(url, tasks, concurrency))
        hits = service.engine.prefix.hits
    with serving(stories, max_batch=2, prefix_cache_bytes=0) as (url, _):
        runs.append(evaluate(url, tasks, 4))
    first = samples(runs[0])
    assert set(first) == {"tinydet_mc", "tinydet_gen", "tinydet_rolling"}
    for out in runs[1:]:
        assert samples(out) == first
        assert out["results"] == runs[0]["results"]
    assert hits > 0  # the choices after the first took their context from the prefix cache

    # lm-eval's number for a choice is the model's: the sum of its tokens' log-probabilities after the
    # context, from one full causal pass here (lm-eval tokenizes context + choice whole, then cuts).
    for s in runs[0]["samples"]["tinydet_mc"][:2]:
        for (context, continuation), resp in zip(s["arguments"], s["resps"]):
            whole = stories.tokenize(context + continuation, add_special=False)
            n_ctx = len(stories.tokenize(context, add_special=False))
            rows = stories.logits(whole)
            ll = sum(token_logprobs(rows[i - 1], whole[i])[0] for i in range(n_ctx, len(whole)))
            assert resp[0][0] == ll
