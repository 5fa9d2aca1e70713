"""SmolLM2-135M-Instruct against HF transformers (same GGUF) and our float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

from reference import ReferenceModel, hf_greedy, hf_logits, load_hf_model
from test_reference import SMOLLM_PROMPTS

PROMPTS = SMOLLM_PROMPTS + [
    "In 1492, Columbus sailed the ocean blue; in 1969, Apollo 11 landed on the Moon. What happened between "
    "those dates is the story of",
    "Dear hiring manager, I am writing to apply for the position of data analyst at your company. Over the "
    "past five years I have worked with large data sets in retail and healthcare, and I have",
]


@pytest.fixture(scope="module")
def hf(smollm_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    return load_hf_model(smollm_path)


@pytest.fixture(scope="module")
def prompt_ids(smollm_models):
    model = smollm_models("fp32")
    ids = [model.tokenize(p) for p in PROMPTS]
    assert all(len(i) >= 32 for i in ids)
    return ids


def test_logits_match_transformers_and_beat_its_error(smollm_path, smollm_models, hf, prompt_ids, record_property):
    model = smollm_models("fp32")
    ref = ReferenceModel(smollm_path)
    worst_hf_diff = 0.0
    for ids in prompt_ids:
        ours = model.logits(ids)
        theirs = hf_logits(hf, ids)
        exact = ref.logits(ids)
        diff = float(np.abs(ours - theirs).max())
        ours_err = float(np.abs(ours - exact).max())
        hf_err = float(np.abs(theirs - exact).max())
        print(f"{len(ids)} tokens: |tinydet-HF| {diff:.2e}, |tinydet-f64| {ours_err:.2e}, |HF-f64| {hf_err:.2e}")
        assert diff <= 5e-3
        assert ours_err <= hf_err
        worst_hf_diff = max(worst_hf_diff, diff)
    record_property("max_abs_diff_vs_transformers", worst_hf_diff)


def test_greedy_64_matches_transformers(smollm_models, hf, prompt_ids):
    model = smollm_models("fp32")
    for ids in prompt_ids:
        g = model.generate(ids, max_tokens=64)
        expected = hf_greedy(hf, ids, 64)
        # Our generation stops at EOS; HF's loop does not, so compare what we produced.
        assert g.token_ids == expected[:len(g.token_ids)]
        assert len(g.token_ids) == 64 or g.finish_reason == "stop"
