"""The float64 NumPy reference (tests/reference.py) is itself checked against independent ground truth:

* stories260K: llama2.c's published greedy output (stories260K.greedy.txt), reproduced byte for byte;
* SmolLM2-135M-Instruct Q4_1: HF transformers fp32 logits and greedy continuations.

Only then can tinydet's own tests lean on the reference.
"""

from __future__ import annotations

import numpy as np
import pytest

from reference import ReferenceModel, hf_greedy, hf_logits, load_hf_model, load_hf_tokenizer

# llama2.c `run` at temperature 0 from BOS with steps=256: forward passes at positions 0..255, each
# followed by printing the argmax token, so 256 generated tokens (the last one is printed but never
# fed back), then a final printf("\n").
STORIES_STEPS = 256

# Measured max |reference float64 - HF fp32| over all logits of each prompt is ~3e-5..5e-5 (logits
# reach |35|); the bound leaves room for other BLAS / thread counts.
SMOLLM_LOGITS_ATOL = 1e-3
SMOLLM_GREEDY_NEW = 16

SMOLLM_PROMPTS = [
    "Once upon a time, in a small village nestled between rolling hills and a quiet river, there lived "
    "an old clockmaker who spent his days repairing the watches of his neighbours.",
    "The mitochondria is often called the powerhouse of the cell because it produces most of the chemical "
    "energy needed to power the biochemical reactions of the cell. In this article, we explain",
    "Here is a short Python function that returns the n-th Fibonacci number using iteration rather than "
    "recursion, together with a brief explanation of how it works:\n\n",
]


@pytest.fixture(scope="module")
def stories_ref(stories_path):
    return ReferenceModel(stories_path)


@pytest.fixture(scope="module")
def smollm_ref(smollm_path):
    return ReferenceModel(smollm_path)


@pytest.fixture(scope="module")
def smollm_hf(smollm_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers loads GGUF files only with accelerate installed")
    return load_hf_model(smollm_path)


@pytest.fixture(scope="module")
def smollm_prompt_ids(smollm_path):
    pytest.importorskip("transformers")
    tok = load_hf_tokenizer(smollm_path)
    ids = [list(tok(p)["input_ids"]) for p in SMOLLM_PROMPTS]
    for p, t in zip(SMOLLM_PROMPTS, ids):
        assert len(t) >= 32, (p, len(t))
    return ids


def _first_difference(a: str, b: str) -> str:
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"first difference at char {i}: got {a[i:i + 40]!r}, expected {b[i:i + 40]!r} (lengths {len(a)}, {len(b)})"


# -- stories260K ---------------------------------------------------------------------------------------

def test_stories_config(stories_ref):
    r = stories_ref
    assert (r.n_layers, r.dim, r.n_heads, r.n_kv_heads, r.head_dim, r.ffn_dim, r.vocab_size) == (
        5, 64, 8, 4, 8, 172, 512)
    assert r.rope_base == 10000.0
    assert r.eps == pytest.approx(1e-5)
    assert r.bos_id == 1


def test_stories_greedy_matches_llama2c(stories_ref, stories_greedy_text):
    ids = stories_ref.greedy([stories_ref.bos_id], STORIES_STEPS)
    assert len(ids) == STORIES_STEPS
    # Newer llama2.c stops when BOS is sampled; there must be none, or the published text would be shorter.
    assert stories_ref.bos_id not in ids
    text = stories_ref.decode_llama2c(ids) + "\n"  # llama2.c ends with printf("\n")
    assert text == stories_greedy_text, _first_difference(text, stories_greedy_text)


def test_stories_decode_details(stories_ref, stories_greedy_text):
    """The printing rules the runtime must reproduce are all exercised by the published text."""
    ids = stories_ref.greedy([stories_ref.bos_id], STORIES_STEPS)
    pieces = [stories_ref.tokens[i] for i in ids]
    assert pieces[0] == "\u2581Once"  # its leading '▁' is stripped after BOS: the text starts "Once"
    assert stories_greedy_text.startswith("Once upon a time")
    assert "<0x0A>" in pieces  # byte tokens print as the byte
    assert stories_greedy_text.count("\n") == pieces.count("<0x0A>") + 1  # + the final printf("\n")
    # The last generated token is '.', so the file ends ".\n".
    assert pieces[-1] == "." and stories_greedy_text.endswith("you.\n")


def test_stories_kv_cache_matches_full_pass(stories_ref):
    """Incremental decoding through the reference's KV cache equals one full causal pass."""
    seq = [stories_ref.bos_id] + stories_ref.greedy([stories_ref.bos_id], 40)
    full = stories_ref.logits(seq)
    cache = stories_ref.new_cache()
    step = np.concatenate([stories_ref.forward([t], cache) for t in seq])
    np.testing.assert_allclose(step, full, rtol=0, atol=1e-10)
    # Causality: a prefix's logits do not depend on later tokens.
    np.testing.assert_allclose(stories_ref.logits(seq[:10]), full[:10], rtol=0, atol=1e-10)


# -- SmolLM2-135M-Instruct Q4_1 ------------------------------------------------------------------------

def test_smollm_config(smollm_ref):
    r = smollm_ref
    assert (r.n_layers, r.dim, r.n_heads, r.n_kv_heads, r.head_dim, r.ffn_dim, r.vocab_size) == (
        30, 576, 9, 3, 64, 1536, 49152)
    assert r.rope_base == 100000.0 and r.n_rot == 64
    assert r.output is r.tok_embd  # tied embeddings


@pytest.mark.parametrize("k", range(len(SMOLLM_PROMPTS)))
def test_smollm_logits_match_hf(k, smollm_ref, smollm_hf, smollm_prompt_ids, record_property):
    ids = smollm_prompt_ids[k]
    ref = smollm_ref.logits(ids)
    hf = hf_logits(smollm_hf, ids)
    assert ref.shape == hf.shape == (len(ids), smollm_ref.vocab_size)
    diff = float(np.max(np.abs(ref - hf)))
    record_property("max_abs_diff", diff)
    print(f"prompt {k} ({len(ids)} tokens): max |ref - hf fp32| = {diff:.3e}, max |logit| = {np.abs(ref).max():.2f}")
    assert diff < SMOLLM_LOGITS_ATOL
    assert np.array_equal(ref.argmax(-1), hf.argmax(-1))


@pytest.mark.parametrize("k", range(len(SMOLLM_PROMPTS)))
def test_smollm_greedy_matches_hf(k, smollm_ref, smollm_hf, smollm_prompt_ids):
    ids = smollm_prompt_ids[k]
    ref = smollm_ref.greedy(ids, SMOLLM_GREEDY_NEW)
    hf = hf_greedy(smollm_hf, ids, SMOLLM_GREEDY_NEW)
    assert len(ref) == len(hf) == SMOLLM_GREEDY_NEW
    assert ref == hf
