"""dtype="int8" on the real SmolLM2 file (Q4_1 matrices, a tied Q8_0 output): every cell of the
determinism matrix (threads, prefill chunks, KV cache or recompute, batch places) gives the baseline's
bits, its logits stay near native's (which are within 3e-5 of float64), and greedy text stays coherent."""

from __future__ import annotations

import numpy as np
import pytest

import tinydet
from tinydet.tools.verify import run_matrix

PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg built a "
          "machine with movable metal type in the German city of Mainz. Within fifty years printers had set up "
          "shops in more than two hundred towns across Europe, and millions of books had been printed.")


@pytest.fixture(scope="module")
def models(smollm_path):
    return tinydet.load(smollm_path, dtype="native"), tinydet.load(smollm_path, dtype="int8")


def test_storage_and_fingerprint_name_the_integer_mode(models):
    native, int8 = models
    st = int8.backend.storage()
    assert st["wqkv"] == "Q4_1:int8" and st["output"] == "Q8_0:int8"
    assert f"-int8-{int8.sha256[:12]}-" in int8.fingerprint and int8.fingerprint != native.fingerprint


def test_every_cell_of_the_determinism_matrix(models, smollm_path, restore_threads):
    int8 = models[1]
    ids = int8.prompt_ids("Once upon a time")
    cells = run_matrix(lambda d, t: int8, smollm_path, ids, 6, dtypes=("int8",), subprocesses=False)
    bad = [(c.group, c.variant) for c in cells if not c.ok]
    assert not bad, bad


def test_logits_near_native_at_40_tokens(models):
    native, int8 = models
    ids = native.prompt_ids(PROMPT)[:40]
    assert len(ids) == 40
    a, b = int8.logits(ids), native.logits(ids)
    err = np.abs(a - b).max()
    print(f"max |int8 - native| over 40 positions: {err:.3g} (|logits| up to {np.abs(b).max():.3g})")
    assert 0 < err < 1.5
    # the same next token nearly everywhere
    assert (a.argmax(axis=1) == b.argmax(axis=1)).mean() >= 0.9


def test_greedy_text_is_coherent(models):
    native, int8 = models
    a = int8.generate("The capital of France is", max_tokens=24)
    b = native.generate("The capital of France is", max_tokens=24)
    same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
    print(f"int8: {a.text!r}\nnative: {b.text!r}\nfirst different token: {same}")
    assert "Paris" in a.text


def test_trace_works_and_matches_the_untraced_logits(models):
    """With an op hook every fusion is undone; every op's rows and the logits are the same bits, in one
    pass or in chunks, as without a hook."""
    from tinydet.tools.trace import run_trace

    int8 = models[1]
    ids = int8.prompt_ids("Once upon a time, there was a little girl")
    traces = [run_trace(int8, ids, chunk=c, keep_values=False) for c in (None, 3)]
    key = lambda r: (-1 if r["layer"] is None else r["layer"], r["op"], r["pos"], r["slot"], r["sha256"])  # noqa: E731
    a, b = (sorted(key(r) for r in t.records) for t in traces)  # a chunk's ops come before the next chunk's
    assert len(a) > 100 and a == b
    logits = [r for r in traces[0].records if r["op"] == "logits"]
    want = int8.logits(ids)
    from tinydet.hashing import hash_logits

    assert [r["sha256"] for r in logits] == [hash_logits(want[i:i + 1]) for i in range(len(ids))]


def test_cli_generate_int8(models, smollm_path):
    from click.testing import CliRunner

    from tinydet.cli import main

    r = CliRunner().invoke(main, ["generate", "--model", str(smollm_path), "--dtype", "int8", "--threads", "2",
                                  "--max-tokens", "8", "--temperature", "0", "The capital of France is"])
    assert r.exit_code == 0, r.output
    assert "Paris" in r.output


def test_gemma3_k_quants(gemma3_path):
    """Gemma 3 270M Q4_K_M: every kind in integers, the Q4_K and Q5_0 kinds, the Q8_0 table and the kinds
    of mixed types (Q5_0+Q8_0, Q4_K+Q6_K, `intmixed.py`); logits near native's, greedy text coherent."""
    native, int8 = (tinydet.load(gemma3_path, dtype=d, threads=2) for d in ("native", "int8"))
    st = int8.backend.storage()
    assert st["wo"] == "Q4_K:int8" and st["w13"] == "Q5_0:int8" and st["output"] == "Q8_0:int8"
    assert st["w2"] == "Q4_K:int8+Q6_K:int8" and st["wqkv"] == "Q5_0:int8+Q8_0:int8", st
    ids = native.prompt_ids(PROMPT)[:40]
    a, b = int8.logits(ids), native.logits(ids)
    agree = (a.argmax(axis=1) == b.argmax(axis=1)).mean()
    print(f"Gemma 3: max |int8 - native| over {len(ids)} positions: {np.abs(a - b).max():.3g} "
          f"(max |native| {np.abs(b).max():.3g}), argmax agrees at {agree:.1%}")
    # 1.53 measured with every kind in integers (the mixed kinds against 8-bit activations too; with them
    # on native's float path the max stayed under this test's earlier bound, 1.5); argmax 97.5%
    assert np.abs(a - b).max() < 2.0 and agree >= 0.9
    g = int8.generate("The capital of France is", max_tokens=16)
    assert "France" in g.text or "Paris" in g.text, g.text
