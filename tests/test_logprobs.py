"""Log-probabilities (tinydet's own log-softmax) and the fingerprint that names a result's bits."""

from __future__ import annotations

import numpy as np
import pytest

import tinydet
from tinydet.errors import TinydetError
from tinydet.logprobs import token_logprobs


def test_log_softmax_against_float64():
    rng = np.random.default_rng(0)
    for scale in (0.1, 3.0, 30.0):
        row = (rng.standard_normal(49152) * scale).astype(np.float32)
        x = row.astype(np.float64)
        ref = x - x.max() - np.log(np.exp(x - x.max()).sum())
        for tok in (0, 17, int(row.argmax())):
            lp, top = token_logprobs(row, tok, 5)
            assert abs(lp - ref[tok]) < 1e-12
        order = np.argsort(-row, kind="stable")[:5]
        assert [i for i, _ in top] == list(order)
        assert [v for _, v in top] == pytest.approx(ref[order], abs=1e-12)


def test_top_alternatives_break_ties_to_the_lower_id():
    row = np.array([1.0, 3.0, 2.0, 3.0, 3.0, -1.0], np.float32)
    _, top = token_logprobs(row, 0, 4)
    assert [i for i, _ in top] == [1, 3, 4, 2]
    assert token_logprobs(row, 5, 0)[1] == []
    assert [i for i, _ in token_logprobs(row, 5, 20)[1]] == [1, 3, 4, 2, 0, 5]  # k beyond the vocabulary


def test_invalid_rows_and_k_are_refused():
    with pytest.raises(TinydetError, match="NaN"):
        token_logprobs(np.array([0.0, np.nan], np.float32), 0)
    with pytest.raises(TinydetError, match="top_logprobs"):
        token_logprobs(np.zeros(4, np.float32), 0, 21)


def test_fingerprint_names_what_fixes_the_bits(stories_path):
    """Version, fp32 or fp16 arithmetic, model and sources; not threads, and fp32 and native (which
    compute the same bits) share one."""
    fp32 = tinydet.load(stories_path, threads=1)
    native = tinydet.load(stories_path, dtype="native", threads=2)
    fp16 = tinydet.load(stories_path, dtype="fp16")
    assert fp32.fingerprint == native.fingerprint != fp16.fingerprint
    assert fp32.fingerprint.startswith(f"tinydet-{tinydet.__version__}-fp32-{fp32.sha256[:12]}-")
    assert fp32.generate("Tom", max_tokens=20).logits_hash == native.generate("Tom", max_tokens=20).logits_hash
