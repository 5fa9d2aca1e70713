"""The int8 golden hashes (tests/golden/smollm2-135m-instruct.json) against an independent reference.

A float64 reference cannot reproduce int8's logits: rounding activations to 8 bits makes the pass
chaotic (a 1e-7 change of the embeddings moves SmolLM2's logits by ~1). So each case is checked op by
op: its whole sequence (prompt and generated tokens) runs once with an op hook, and every matrix
product in it (q, k, v, attention output, gate, up, down, logits) must equal, bit for bit, the NumPy
rules of tests/intref.py applied to the op's recorded input, with the weights read from the file by
the `gguf` package. The other ops are fp32's (held by fp32's golden hashes). The logits rows that chose
the tokens must then hash to the case's logits_hash, and for greedy cases their argmaxes must be the
tokens that hash to its output_hash."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import tinydet
from tinydet.hashing import hash_ids, hash_logits
from tinydet.tools.golden import read_golden

import intref

GOLDEN = Path(__file__).parent / "golden" / "smollm2-135m-instruct.json"
# op -> (the op whose rows it multiplies, its GGUF matrix; None: the output matrix)
PRODUCTS = {"q": ("attn_norm", "attn_q"), "k": ("attn_norm", "attn_k"), "v": ("attn_norm", "attn_v"),
            "attn_output": ("attention", "attn_output"), "gate": ("ffn_norm", "ffn_gate"),
            "up": ("ffn_norm", "ffn_up"), "down": ("activation", "ffn_down"), "logits": ("final_norm", None)}


@pytest.fixture(scope="module")
def weights(smollm_path):
    """GGUF tensor name -> (type name, raw rows (n, row bytes), n, k), read by the gguf package."""
    import gguf

    out = {}
    for t in gguf.GGUFReader(str(smollm_path)).tensors:
        if len(t.shape) == 2:
            n, k = int(t.shape[1]), int(t.shape[0])
            out[t.name] = (t.tensor_type.name, np.asarray(t.data).reshape(n, -1), n, k)
    return out


def _ops(model, ids):
    """(layer, op) -> (positions, width) float32 rows of one forward pass over ids, with every op seen."""
    seen = {}

    def hook(layer, op, pos, slots, rows):
        seen.setdefault((layer, op), []).append((np.asarray(pos).copy(), np.array(rows, np.float32)))

    be = model.backend
    be.forward_batch([(0, list(ids))], be.new_cache(len(ids)), all_logits=True, hook=hook)
    out = {}
    for key, parts in seen.items():
        pos = np.concatenate([p for p, _ in parts])
        rows = np.concatenate([r for _, r in parts])
        assert (pos == np.arange(len(ids))).all()
        out[key] = rows
    return out


def _halves(n, head_dim):
    """Column order of q and k in tinydet: per head, GGUF's dims 0, 2, 4, ... then 1, 3, 5, ..."""
    head = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    return (np.arange(0, n, head_dim)[:, None] + head[None, :]).reshape(-1)


def test_int8_golden_cases_equal_the_integer_rules_op_by_op(smollm_path, weights):
    cases = [c for c in read_golden(GOLDEN)["cases"] if c["dtype"] == "int8"]
    assert len(cases) == 6
    model = tinydet.load(smollm_path, dtype="int8", threads=1)
    out_name = "output.weight" if "output.weight" in weights else "token_embd.weight"
    for case in cases:
        kw = {k: case[k] for k in ("max_tokens", "temperature", "top_p", "seed") if k in case}
        g = model.generate(case["prompt"], **kw)
        assert g.output_hash == case["output_hash"], case
        prompt = model.prompt_ids(case["prompt"])
        ids = prompt + list(g.token_ids[:-1])
        ops = _ops(model, ids)
        checked = 0
        for (layer, op), rows in ops.items():
            if op not in PRODUCTS:
                continue
            src, tensor = PRODUCTS[op]
            name = out_name if tensor is None else f"blk.{layer}.{tensor}.weight"
            tname, raw, n, k = weights[name]
            want = intref.matrix_product(ops[(layer, src)], raw, tname, n, k)
            if op in ("q", "k"):  # tinydet keeps each head's rotated pairs as halves: even dims, then odd
                want = want[:, _halves(n, model.config.head_dim)]
            assert want.view(np.uint32).tolist() == rows.view(np.uint32).tolist(), (case["prompt"], layer, op)
            checked += 1
        assert checked == 7 * model.config.n_layers + 1
        chose = ops[(None, "logits")][len(prompt) - 1:]
        assert hash_logits(chose) == case["logits_hash"], case
        if case["temperature"] == 0.0:
            assert hash_ids(chose.argmax(axis=1)) == case["output_hash"], case
