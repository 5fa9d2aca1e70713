"""The forward pass: accuracy against independent references and the determinism contract."""

from __future__ import annotations

import numpy as np
import pytest

from tinydet.hashing import hash_logits

from reference import ReferenceModel

PROMPT_IDS_STORIES = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396,
                      267, 337, 410, 408, 419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432]


def run_chunked(model, ids, chunk, threads):
    """Logits for every position, feeding `ids` in chunks of `chunk` tokens through one KV cache."""
    model.threads = threads
    backend = model.backend
    cache = backend.new_cache(len(ids))
    rows = [backend.forward(ids[i:i + chunk], cache, all_logits=True) for i in range(0, len(ids), chunk)]
    return np.concatenate(rows)


def smollm_ids(model):
    text = ("The history of mathematics spans thousands of years, from counting with pebbles and tally marks to "
            "the abstract structures of modern algebra, and every culture added something of its own.")
    ids = model.tokenize(text)
    assert len(ids) >= 32
    return ids


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_stories_bit_identical_across_threads_and_chunking(stories_models, dtype):
    model = stories_models[dtype]
    ids = PROMPT_IDS_STORIES
    base = run_chunked(model, ids, len(ids), threads=1)
    assert np.isfinite(base).all()
    variants = {}
    for threads in (1, 2, 3):
        for chunk in (len(ids), 1, 5):
            variants[(threads, chunk)] = run_chunked(model, ids, chunk, threads)
    for key, out in variants.items():
        assert out.view(np.uint32).tobytes() == base.view(np.uint32).tobytes(), f"differs for threads/chunk {key}"


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_smollm_bit_identical_across_threads_and_chunking(smollm_models, dtype):
    model = smollm_models(dtype)
    ids = smollm_ids(model)
    base = hash_logits(run_chunked(model, ids, len(ids), threads=1))
    for threads, chunk in [(2, len(ids)), (3, len(ids)), (1, 1), (2, 5), (3, 5), (2, 1)]:
        assert hash_logits(run_chunked(model, ids, chunk, threads)) == base, (threads, chunk)


def test_api_logits_equal_incremental(stories_models):
    model = stories_models["fp32"]
    full = model.logits(PROMPT_IDS_STORIES)
    assert full.shape == (len(PROMPT_IDS_STORIES), model.config.vocab_size) and full.dtype == np.float32
    assert np.array_equal(full, run_chunked(model, PROMPT_IDS_STORIES, 1, threads=2))


def test_fp16_close_to_fp32_but_not_equal(stories_models):
    a = stories_models["fp32"].logits(PROMPT_IDS_STORIES)
    b = stories_models["fp16"].logits(PROMPT_IDS_STORIES)
    assert not np.array_equal(a, b)  # fp16 really stores binary16
    assert np.abs(a - b).max() < 0.05 * np.abs(a).max()


def test_stories_matches_float64_reference(stories_path, stories_models):
    ref = ReferenceModel(stories_path).logits(PROMPT_IDS_STORIES)
    ours = stories_models["fp32"].logits(PROMPT_IDS_STORIES)
    err = np.abs(ours - ref).max()
    print(f"stories260K fp32 max |tinydet - float64 ref| = {err:.3e}")
    assert err < 1e-4
