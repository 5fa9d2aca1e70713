"""Golden hashes: the repository's recorded hashes hold here, under numba's other targets (a generic
x86-64, and on an AVX-512 host an AVX2-only one, with its own tile shapes) and with NumPy's AVX2/AVX-512
dispatch turned off."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import tinydet
from tinydet.cli import main
from tinydet.tools.golden import check_golden, model_loader, read_golden
from tinydet.registry import get_manifest
from tinydet.tools.verify import npy_dispatch_to_disable, numba_targets

GOLDEN = Path(__file__).parent / "golden"
ENVIRONMENTS = {
    "this machine": {},
    **{f"numba {name}": env for name, env in numba_targets().items()},
    "numpy without AVX2/AVX-512": {"NPY_DISABLE_CPU_FEATURES": npy_dispatch_to_disable()},
}


@pytest.fixture(params=["stories260k", "smollm2-135m-instruct"])
def golden_model(request):
    fixture = "stories_path" if request.param.startswith("stories") else "smollm_path"
    return request.param, request.getfixturevalue(fixture)


@pytest.mark.parametrize("env", list(ENVIRONMENTS))
def test_golden_hashes(golden_model, env):
    name, path = golden_model
    golden = GOLDEN / f"{name}.json"
    if not ENVIRONMENTS[env]:
        bad = check_golden(model_loader(path), read_golden(golden), tinydet.hashing.file_sha256(path))
        assert bad == []
        return
    r = subprocess.run([sys.executable, "-m", "tinydet", "golden", str(path), "--check", str(golden)],
                       capture_output=True, text=True, env=dict(os.environ, **ENVIRONMENTS[env]), timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASSED" in r.stdout


def test_manifest_golden_is_in_the_golden_file(golden_model):
    name, _ = golden_model
    m = get_manifest(name).golden
    cases = read_golden(GOLDEN / f"{name}.json")["cases"]
    assert m and any(all(c.get(k) == v for k, v in m.items()) for c in cases)


def test_stories_golden_is_pinned_to_the_published_text(stories_models, stories_greedy_text):
    case = read_golden(GOLDEN / "stories260k.json")["cases"][0]
    assert (case["prompt"], case["dtype"], case["max_tokens"], case["temperature"]) == ("", "fp32", 256, 0.0)
    g = stories_models["fp32"].generate("", max_tokens=256)
    assert g.text + "\n" == stories_greedy_text and g.output_hash == case["output_hash"]


def test_golden_refuses_to_overwrite_and_detects_change(tmp_path, stories_path):
    target = tmp_path / "g.json"
    target.write_text("{}")
    r = CliRunner().invoke(main, ["golden", str(stories_path), "--write", str(target)])
    assert r.exit_code == 1 and "--overwrite" in r.output and target.read_text() == "{}"
    data = read_golden(GOLDEN / "stories260k.json")
    data["cases"] = data["cases"][1:3]
    data["cases"][1] = dict(data["cases"][1], logits_hash="0" * 64)
    import json
    target.write_text(json.dumps(data))
    r = CliRunner().invoke(main, ["golden", str(stories_path), "--check", str(target)])
    assert r.exit_code == 1 and "logits_hash" in r.output and "FAILED" in r.output
