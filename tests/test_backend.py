"""The backend seam: a backend instance owns its thread count, and two models with different thread
counts used from two Python threads at once each keep their own bits and settings; the forward
pass's items (slots, logits wanted) are checked; op hooks see every op in order."""

from __future__ import annotations

import threading

import numba
import numpy as np
import pytest

import tinydet
from tinydet.backends.base import OPS
from tinydet.errors import ContextLengthError, TinydetError

PROMPT = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338]


def test_two_models_two_threads_keep_their_own_bits_and_settings(stories_path):
    ref = tinydet.load(stories_path, dtype="fp32", threads=1).logits(PROMPT)
    models = {1: tinydet.load(stories_path, dtype="fp32", threads=1),
              3: tinydet.load(stories_path, dtype="fp32", threads=3)}
    seen = {1: set(), 3: set()}
    for n, m in models.items():
        # the thread count numba runs each pass with, as seen from inside it
        m.backend.hooks.append(lambda layer, op, pos, slots, rows, n=n: seen[n].add(numba.get_num_threads()))
    errors, barrier = [], threading.Barrier(2)

    def run(n):
        try:
            barrier.wait()
            for _ in range(25):
                out = models[n].logits(PROMPT)
                if not np.array_equal(out.view(np.uint32), ref.view(np.uint32)):
                    errors.append(f"threads={n}: logits differ")
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    ts = [threading.Thread(target=run, args=(n,)) for n in models]
    for t in ts:
        t.start()
    for t in ts:
        t.join(300)
    assert not errors, errors
    assert seen == {1: {1}, 3: {3}}
    assert (models[1].threads, models[3].threads) == (1, 3)


def test_thread_count_is_validated(stories_models):
    model = stories_models["fp32"]
    for bad in (0, -1, 2.0, True, numba.config.NUMBA_NUM_THREADS + 1):
        with pytest.raises(TinydetError, match="threads"):
            model.threads = bad


def test_batch_items_are_checked(stories_models):
    be = stories_models["fp32"].backend
    cache = be.new_cache(8, n_slots=2)
    with pytest.raises(TinydetError, match="slot 0 is repeated"):
        be.forward_batch([(0, [1]), (0, [2])], cache)
    with pytest.raises(TinydetError, match="slot 2"):
        be.forward_batch([(2, [1])], cache)
    with pytest.raises(TinydetError, match="at least one token"):
        be.forward_batch([(0, [])], cache)
    with pytest.raises(TinydetError, match="logits must be one of"):
        be.forward_batch([(0, [1], "some")], cache)
    with pytest.raises(TinydetError, match=r"\[0, 512\)"):
        be.forward_batch([(0, [512])], cache)
    with pytest.raises(ContextLengthError, match="holds 8"):
        be.forward_batch([(0, list(range(1, 10)))], cache)
    assert list(cache.lengths) == [0, 0]  # nothing was appended by a refused pass
    out = be.forward_batch([(0, [1, 403, 407], "none"), (1, [1, 403], "all")], cache)
    assert out[0] is None and out[1].shape == (2, 512) and list(cache.lengths) == [3, 2]
    ref = be.forward([1, 403, 407], be.new_cache(8), all_logits=True)
    assert np.array_equal(out[1], ref[:2])


def test_hooks_see_every_op_in_order(stories_models):
    model = stories_models["fp32"]
    calls = []
    be = model.backend
    be.forward_batch([(0, [1, 403])], be.new_cache(2), hook=lambda layer, op, pos, slots, rows:
                     calls.append((layer, op, tuple(pos), rows.shape)))
    per_layer = [op for op in OPS if op not in ("embedding", "post_attention_norm", "post_ffn_norm", "final_norm",
                                                 "logits", "router")]  # router: mixtures of experts only
    want = [(None, "embedding")] + [(li, op) for li in range(model.config.n_layers) for op in per_layer] + [
        (None, "final_norm"), (None, "logits")]
    assert [(layer, op) for layer, op, _, _ in calls] == want
    assert calls[0][2:] == ((0, 1), (2, 64)) and calls[-1][2:] == ((1,), (1, 512))
