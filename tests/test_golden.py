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


def _envs():
    """Every environment for every golden model. On numba's other targets the tiny stories260K (fp32,
    fp16) is the representative check; SmolLM2 there (fp32, fp16 and int8 on its shapes, 22 cases, the
    slowest checks of the suite) is the full matrix, marked `slow` (README: test tiers)."""
    for model in ("stories260k", "smollm2-135m-instruct"):
        for env in ENVIRONMENTS:
            slow = model.startswith("smollm") and env.startswith("numba ")
            yield pytest.param(model, env, id=f"{model}-{env}", marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("model, env", list(_envs()))
def test_golden_hashes(request, model, env):
    name, path = model, request.getfixturevalue("stories_path" if model.startswith("stories") else "smollm_path")
    golden = GOLDEN / f"{name}.json"
    if not ENVIRONMENTS[env]:
        bad = check_golden(model_loader(path), read_golden(golden), tinydet.hashing.file_sha256(path))
        assert bad == []
        return
    r = subprocess.run([sys.executable, "-m", "tinydet", "golden", "--model", str(path), "--check", str(golden)],
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
    r = CliRunner().invoke(main, ["golden", "--model", str(stories_path), "--write", str(target)])
    assert r.exit_code == 1 and "--overwrite" in r.output and target.read_text() == "{}"
    data = read_golden(GOLDEN / "stories260k.json")
    data["cases"] = data["cases"][1:3]
    data["cases"][1] = dict(data["cases"][1], logits_hash="0" * 64)
    import json
    target.write_text(json.dumps(data))
    r = CliRunner().invoke(main, ["golden", "--model", str(stories_path), "--check", str(target)])
    assert r.exit_code == 1 and "logits_hash" in r.output and "FAILED" in r.output


def test_golden_tool_cases_are_valid_calls_of_the_models_own_prompt(smollm_models):
    """The recorded chat cases (tools, reasoning): a required call validates against its schema
    (`jsonschema`, not the library that constrained it), and the prompt is what transformers renders
    for the same conversation and template."""
    pytest.importorskip("llguidance", reason="tool calls need the structured extra")
    import json

    import jsonschema
    from transformers.utils.chat_template_utils import render_jinja_template

    model = smollm_models("fp32")
    cases = [c for c in read_golden(GOLDEN / "smollm2-135m-instruct.json")["cases"] if "messages" in c]
    assert len(cases) == 3
    for c in cases:
        saved = model.tokenizer.chat_template
        model.tokenizer.chat_template = c.get("chat_template", saved)
        try:
            plan = model.chat_plan(c["messages"], tools=c["tools"], tool_choice=c["tool_choice"])
            g = model.chat(c["messages"], tools=c["tools"], tool_choice=c["tool_choice"], max_tokens=c["max_tokens"],
                           temperature=c["temperature"], top_p=c.get("top_p", 1.0), seed=c.get("seed", 0))
            # the generic form puts the tools in a system message: transformers renders that conversation
            from tinydet.chat.plan import _generic_messages

            want = render_jinja_template([_generic_messages(c["messages"], c["tools"])], chat_template=
                                         model.tokenizer.chat_template, add_generation_prompt=True)[0][0]
            assert plan.prompt == want
        finally:
            model.tokenizer.chat_template = saved
        schema = c["tools"][0]["function"]["parameters"]
        for call in g.message.tool_calls:
            jsonschema.validate(json.loads(call.arguments), schema)
        if c["tool_choice"] == "required" and "chat_template" not in c:
            assert g.message.tool_calls
