"""Bounded, derandomized fuzzing of the parser-level targets (fuzz/targets.py): every mutated input
either loads or raises a TinydetError with a one-line message; none escapes with another exception,
hangs or allocates past a bound from its size. The long runs are fuzz/campaign.py's."""

from __future__ import annotations

import json
import os
import random
import struct
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fuzz"))
from harness import FAILURES, run_one  # noqa: E402
from targets import TARGETS, make_scratch, write_case  # noqa: E402

FUZZ = settings(derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def scratch():
    d = make_scratch()
    cwd = os.getcwd()
    os.chdir(d)  # a relative path a target makes lands here
    yield d
    os.chdir(cwd)
    import shutil

    shutil.rmtree(d, ignore_errors=True)


def check(name: str, files: dict[str, bytes], scratch: Path) -> None:
    t = TARGETS[name]
    case = scratch / name / "case"
    write_case(case, files)
    out = run_one(lambda: t.run(case), sum(len(v) for v in files.values()), time_limit=30.0)
    assert out.kind not in FAILURES, f"{name}: {out.kind}: {out.detail}"


def mutated(name: str, n: int):
    """A test drawing `n` mutation seeds for the target's own mutator."""
    @settings(FUZZ, max_examples=n)
    @given(seed=st.integers(0, 2**32 - 1))
    def test(scratch, seed):
        check(name, TARGETS[name].make(random.Random(seed)), scratch)
    test.__doc__ = f"{name}: {TARGETS[name].__doc__}"
    return test


test_gguf = mutated("gguf", 80)
test_manifest = mutated("manifest", 150)
test_safetensors = mutated("safetensors", 80)
test_hf_dir = mutated("hf_dir", 60)
test_chat_template = mutated("chat_template", 30)  # a runaway costs the target's 0.25 s render bound
_api = mutated("api", 150)
_structured = mutated("structured", 300)
_tools = mutated("tools", 300)


def test_api(stories_path, scratch):
    """api: Model's public calls on stories260K with mutated arguments (at most 3 new tokens each). The
    model is loaded and its kernels compiled first: a cold compile on a busy machine is not a hang."""
    TARGETS["api"].model.logits([1])
    _api(scratch)


def test_tools(stories_path, scratch):
    """tools: mutated tools, tool_choice and tool-call histories through Model.chat on stories260K."""
    pytest.importorskip("llguidance", reason="the structured extra is not installed")
    TARGETS["tools"].model.logits([1])
    _tools(scratch)


def test_structured(stories_path, scratch):
    """structured: mutated JSON Schemas, regexes and grammars constraining stories260K."""
    pytest.importorskip("llguidance", reason="the structured extra is not installed")
    TARGETS["structured"].model.logits([1])
    _structured(scratch)

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                    max_leaves=12)
ENTRY = st.fixed_dictionaries({}, optional={
    "dtype": st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "F8_E4M3", "x"]) | JSON,
    "shape": st.lists(st.sampled_from([0, 1, 2, 3, 64, 2**31, 2**32, 2**63 - 1, 2**64 - 1, -1]), max_size=4) | JSON,
    "data_offsets": st.lists(st.sampled_from([0, 1, 16, 256, 2**32, 2**63, 2**64 - 1, -1]), max_size=3) | JSON})


@settings(FUZZ, max_examples=80)
@given(header=st.dictionaries(st.text(min_size=1, max_size=8), ENTRY | JSON, max_size=4),
       body=st.binary(max_size=300), length_delta=st.sampled_from([0, 0, 0, -1, 1, 2**40]))
def test_safetensors_header_json(scratch, header, body, length_delta):
    """Safetensors headers drawn as JSON (offsets, dtypes, shapes of any size, the header length)."""
    text = json.dumps(header).encode()
    n = max(0, len(text) + length_delta)
    check("safetensors", {"model.safetensors": struct.pack("<Q", n) + text + body}, scratch)


def test_harness_classifies_each_outcome():
    """The harness itself: each failure kind is detected (else the fuzz tests above could not fail)."""
    import time

    import numpy as np

    from tinydet.errors import ModelFormatError

    def refuse():
        raise ModelFormatError("f", "k", "bad")

    def multi_line():
        raise ModelFormatError("f", "k", "line\nline")

    def escape():
        raise ValueError("x")

    assert run_one(lambda: None, 10).kind == "ok"
    assert run_one(refuse, 10).kind == "refused"
    assert run_one(multi_line, 10).kind == "escape"
    assert run_one(escape, 10).kind == "escape"
    assert run_one(lambda: time.sleep(5), 10, time_limit=0.2).kind == "hang"
    assert run_one(lambda: np.ones(2**24).sum(), 10).kind == "alloc"  # 128 MiB for a 10-byte input
