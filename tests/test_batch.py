"""Batched generation: every request's logits and tokens equal the same request generated alone."""

from __future__ import annotations

import pytest

STORIES_REQUESTS = [
    dict(prompt="", max_tokens=40),
    dict(prompt="Once upon a time", max_tokens=25, temperature=0.8, top_p=0.9, seed=1),
    dict(prompt="Lily and Ben went to the park. They saw a big dog.", max_tokens=12, temperature=1.0, top_k=20, seed=2),
    dict(prompt="The sun", max_tokens=33, stop=["."]),
    dict(prompt="Tom had a red ball", max_tokens=5, temperature=0.7, min_p=0.05, seed=3),
    dict(prompt="One day", max_tokens=50, temperature=0.9, seed=4),
    dict(prompt="She was sad because", max_tokens=18),
    dict(prompt="Once upon a time", max_tokens=25, temperature=0.8, top_p=0.9, seed=5),
    dict(prompt="Ben", max_tokens=9, temperature=1.2, seed=6),
    dict(prompt="The little bird", max_tokens=21),
]


def solo(model, r):
    return model.generate(**r)


def same(a, b):
    return (a.token_ids, a.logits_hash, a.text, a.finish_reason) == (b.token_ids, b.logits_hash, b.text, b.finish_reason)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("max_batch", range(1, 9))
def test_batch_equals_solo_with_joins_and_leaves(stories_models, dtype, max_batch):
    model = stories_models[dtype]
    expected = [solo(model, r) for r in STORIES_REQUESTS]
    got = model.generate_batch(STORIES_REQUESTS, max_batch=max_batch)
    assert len(got) == len(STORIES_REQUESTS)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert same(g, e), f"request {i} differs at max_batch={max_batch}"
    assert any(e.finish_reason == "stop" for e in expected)  # a sequence leaves early


@pytest.mark.parametrize("position", ["alone", "first", "last", "middle"])
def test_composition_does_not_matter(stories_models, position):
    model = stories_models["fp32"]
    target = dict(prompt="Once upon a time there was a girl", max_tokens=30, temperature=0.8, seed=11)
    others = [dict(prompt="A cat", max_tokens=7), dict(prompt="The big tree", max_tokens=45, temperature=1.0, seed=3),
              dict(prompt="", max_tokens=20)]
    batch = {"alone": [target], "first": [target] + others, "last": others + [target],
             "middle": others[:1] + [target] + others[1:]}[position]
    got = model.generate_batch(batch, max_batch=8)[batch.index(target)]
    assert same(got, solo(model, target))


def test_smollm_batch_equals_solo(smollm_models):
    model = smollm_models("fp32")
    reqs = [dict(prompt="The capital of France is", max_tokens=12),
            dict(prompt="def fibonacci(n):", max_tokens=20, temperature=0.7, top_p=0.9, seed=4),
            dict(prompt="Write a haiku about the sea.", max_tokens=8, temperature=1.0, seed=9)]
    got = model.generate_batch(reqs, max_batch=2)
    for r, g in zip(reqs, got):
        assert same(g, solo(model, r))


def test_batch_bad_requests(stories_models):
    from tinydet.errors import TinydetError

    model = stories_models["fp32"]
    with pytest.raises(TinydetError, match="unknown settings"):
        model.generate_batch([dict(prompt="a", temprature=1.0)])
    with pytest.raises(TinydetError, match="max_batch"):
        model.generate_batch([dict(prompt="a")], max_batch=0)
    assert model.generate_batch([]) == []
