"""`tinydet verify`: the whole matrix passes on the real models; a broken kernel fails it."""

from __future__ import annotations

import json

import numba
import numpy as np
from click.testing import CliRunner

import tinydet
from tinydet.cli import main
from contract import VERIFY_CELLS as CELLS, VERIFY_CELLS_QUANTIZED
from tinydet.tools.verify import numba_targets, run_matrix


def test_verify_stories_passes_every_cell(stories_path):
    r = CliRunner().invoke(main, ["verify", "--model", str(stories_path), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["passed"]
    groups = {(c["dtype"], c["group"], c["variant"]) for c in out["cells"]}
    for dtype in ("fp32", "fp16", "native"):
        for g in ("repeat", "threads", "prefill", "kv cache", "batch", "speculative", "numba target",
                  "numpy dispatch"):
            assert any(k[0] == dtype and k[1] == g for k in groups), (dtype, g)
    assert len(out["cells"]) == CELLS and all(c["ok"] for c in out["cells"])
    assert {c["variant"] for c in out["cells"] if c["group"] == "numba target"} == set(numba_targets())
    # native storage gives fp32's hash in every cell (a constrained request's own, in its cells)
    assert len({c["hash"] for c in out["cells"] if c["dtype"] in ("fp32", "native") and c["group"] not in ("structured", "tools")}) == 1
    for group in ("structured", "tools"):
        cells = [c for c in out["cells"] if c["group"] == group]
        assert len(cells) == 12 and len({c["hash"] for c in cells if c["dtype"] in ("fp32", "native")}) == 1


def test_verify_smollm_passes(smollm_path):
    r = CliRunner().invoke(main, ["verify", "--model", str(smollm_path), "--max-tokens", "8"])
    assert r.exit_code == 0, r.output
    assert f"PASSED: {VERIFY_CELLS_QUANTIZED}/{VERIFY_CELLS_QUANTIZED}" in r.output  # int8's cells too
    assert "int8   baseline" in r.output


def test_verify_catches_a_thread_dependent_kernel(stories_path):
    def racy(layer, op, pos, slots, rows):
        """Every matrix product's result, through the backend's fault-injection hooks."""
        if op in ("q", "k", "v", "attn_output", "gate", "up", "down", "logits") and numba.get_num_threads() > 2:
            rows += np.float32(1e-6) * rows  # a result that depends on the thread count

    def load(dtype, threads):
        model = tinydet.load(stories_path, dtype=dtype, threads=threads)
        model.backend.hooks.append(racy)
        return model

    cells = run_matrix(load, stories_path, [1, 403, 407], 4, dtypes=("fp32",), subprocesses=False)
    bad = {(c.group, c.variant) for c in cells if not c.ok}
    assert bad == {("threads", "3"), ("threads", "4"), ("structured", "3 threads, chunks of 7"),
                   ("tools", "3 threads, chunks of 7")}
