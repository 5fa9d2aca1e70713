"""`tinydet serve --ray` and `tinydet rollout` as a user runs them: the README's commands, a local Ray
cluster started and stopped by the server, the official `openai` client against it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("ray.serve", reason="the ray extra is not installed: pip install 'tinydet[ray]'")
openai = pytest.importorskip("openai", reason="the openai client is not installed (the test extra has it)")
pytestmark = pytest.mark.usefixtures("ray_turn")  # one local Ray cluster at a time (pytest -n)

from foreground import tinydet_argv  # noqa: E402
from test_ray import _bad_canary, _free_port  # noqa: E402


def _tinydet(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "tinydet", *args], capture_output=True, text=True, timeout=timeout)


def test_serve_ray_rollout_and_sigterm(stories_path, stories_models, tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    # replicas decoding with prompt lookup: plain decoding's bytes, the plain fingerprint
    server = subprocess.Popen(tinydet_argv("serve", "--ray", "--replicas", "2", "--model", str(stories_path),
                                           "--served-model-name", "stories", "--port", str(port),
                                           "--speculative", "ngram"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "RAY_ADDRESS": ""})
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, server.stdout.read()
            try:
                r = httpx.get(f"{url}/health", timeout=5)
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "not ready in 3 minutes"
            time.sleep(0.5)
        health = r.json()
        assert health["backends"][0]["replicas"] == {"RUNNING": 2}
        stories = stories_models["fp32"]
        assert health["backends"][0]["system_fingerprint"] == stories.fingerprint

        c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        got = c.completions.create(model="stories", prompt="Once upon a time", max_tokens=20, temperature=0)
        want = stories.generate("Once upon a time", max_tokens=20)
        assert got.choices[0].text == want.text and got.system_fingerprint == stories.fingerprint
        assert [m.id for m in c.models.list().data] == ["stories"]

        dry = _tinydet("rollout", "--model", str(stories_path), "--replicas", "1", "--dry-run")
        assert dry.returncode == 0, dry.stderr
        plan = json.loads(dry.stdout[:dry.stdout.rindex("}") + 1])
        assert plan["deploy"]["app"] == "tinydet-b2" and plan["retire"] == ["tinydet-b1"]
        assert plan["deploy"]["served_model_name"] == "stories"  # the name in use, kept

        broken = _tinydet("rollout", "--model", str(stories_path), "--replicas", "1", "--canary",
                          _bad_canary(tmp_path, stories), "--step-seconds", "0")
        assert broken.returncode == 1
        assert "rollout failed and was rolled back" in broken.stderr and "canary" in broken.stderr
        assert httpx.get(f"{url}/health").json()["backends"][0]["app"] == "tinydet-b1"
        again = c.completions.create(model="stories", prompt="Once upon a time", max_tokens=20, temperature=0)
        assert again.choices[0].text == want.text
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
        out = server.communicate(timeout=120)[0]
    assert server.returncode == 0, out
    assert "stopping" in out
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=5)


@pytest.mark.parametrize("args,message", [
    (["serve", "--ray", "--ray-address", "127.0.0.1:1"], "--ray-address 127.0.0.1:1: nothing answers there"),
    (["serve", "--replicas", "2"], "--replicas and --ray-address go with --ray"),
    (["rollout", "--steps", "0.5,0.2,1"], "--steps 0.5,0.2,1: expected increasing shares"),
])
def test_bad_ray_options_are_one_line_errors(stories_path, args, message):
    r = _tinydet(*args, "--model", str(stories_path), timeout=60)
    assert r.returncode == 1 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
