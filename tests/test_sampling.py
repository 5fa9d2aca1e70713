"""The sampler: a pure function of (logits, settings, seed, position)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from tinydet.errors import TinydetError
from tinydet.sampling import SamplingParams, order_desc, sample, uniform


def test_uniform_is_keyed_and_uniform():
    assert uniform(7, 3) == uniform(7, 3)
    assert uniform(7, 3) != uniform(7, 4) and uniform(7, 3) != uniform(8, 3)
    xs = np.array([uniform(123, p) for p in range(20000)])
    assert 0 <= xs.min() and xs.max() < 1
    assert abs(xs.mean() - 0.5) < 0.01
    hist = np.histogram(xs, bins=10, range=(0, 1))[0]
    assert hist.min() > 1800


def test_greedy_ties_go_to_lower_id():
    logits = np.array([0.5, 2.0, 2.0, -1.0], np.float32)
    assert sample(logits, SamplingParams(), 0) == 1


def test_top_k_1_is_greedy_and_ties_sort_stably():
    logits = np.array([0.5, 2.0, 2.0, -1.0], np.float32)
    for pos in range(50):
        assert sample(logits, SamplingParams(temperature=1.0, top_k=1, seed=pos), pos) == 1


def test_candidate_order_is_numpys_stable_argsort():
    """The radix sort behind sampling orders candidates exactly as np.argsort(-row, kind="stable"):
    ties (many, and 0.0 against -0.0) by id, infinities, vocabularies of every size."""
    rng = np.random.default_rng(0)
    rows = [np.array([], np.float32), np.array([1.5], np.float32), np.array([0.0, -0.0, 1.0, -0.0, 0.0, -1.0], np.float32),
            np.array([np.inf, -np.inf, 3.0, np.inf, -np.inf, -0.0, 1e-45, -1e-45], np.float32)]
    for n in (2, 7, 2049, 49152, 262144):
        rows.append((rng.standard_normal(n) * 5).astype(np.float32))
        rows.append(rng.integers(-3, 3, n).astype(np.float32) * np.float32(0.5))  # ties everywhere
        rows.append(np.where(rng.random(n) < 0.5, np.float32(-0.0), np.float32(0.0)))
    for row in rows:
        assert np.array_equal(order_desc(row), np.argsort(-row, kind="stable")), row[:8]


def test_distribution_follows_softmax():
    logits = np.log(np.array([0.5, 0.3, 0.2], np.float64)).astype(np.float32)
    counts = Counter(sample(logits, SamplingParams(temperature=1.0, seed=5), p) for p in range(20000))
    freq = np.array([counts[i] for i in range(3)]) / 20000
    assert np.abs(freq - [0.5, 0.3, 0.2]).max() < 0.015


def test_top_p_and_min_p_cut_the_tail():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05])).astype(np.float32)
    seen_p = {sample(logits, SamplingParams(temperature=1.0, top_p=0.75, seed=1), p) for p in range(3000)}
    assert seen_p == {0, 1}  # 0.5 < 0.75 <= 0.8
    seen_m = {sample(logits, SamplingParams(temperature=1.0, min_p=0.5, seed=1), p) for p in range(3000)}
    assert seen_m == {0, 1}  # 0.3 >= 0.5 * 0.5 > 0.15
    seen_k = {sample(logits, SamplingParams(temperature=1.0, top_k=3, seed=1), p) for p in range(3000)}
    assert seen_k == {0, 1, 2}


def test_same_seed_same_position_same_token_and_seed_matters():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(1000).astype(np.float32)
    p = SamplingParams(temperature=0.8, top_p=0.95, seed=42)
    a = [sample(logits, p, pos) for pos in range(200)]
    assert a == [sample(logits, p, pos) for pos in range(200)]
    b = [sample(logits, SamplingParams(temperature=0.8, top_p=0.95, seed=43), pos) for pos in range(200)]
    assert a != b


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(temperature=float("inf")), dict(top_k=-1),
                                    dict(top_p=0.0), dict(top_p=1.5), dict(min_p=-0.1), dict(seed=-1)])
def test_bad_settings(kwargs):
    with pytest.raises(TinydetError):
        SamplingParams(**kwargs)


def test_nan_logits_refused():
    with pytest.raises(TinydetError, match="NaN"):
        sample(np.array([0.0, np.nan], np.float32), SamplingParams(), 0)
