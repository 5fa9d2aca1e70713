"""`tinydet serve --ray` on a local Ray cluster (127.0.0.1): replicas gated by golden hashes, every answer
equal to the request alone under load, across replicas, through a replica's death, and pinned to a
fingerprint when two model versions are live; a rollout of a broken version rolls back."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("ray.serve", reason="the ray extra is not installed: pip install 'tinydet[ray]'")
pytestmark = pytest.mark.usefixtures("ray_turn")  # one local Ray cluster at a time (pytest -n)
import ray  # noqa: E402
from ray import serve  # noqa: E402

from test_serve import _mixed_requests, solo  # noqa: E402
from tinydet.serve import cluster, rollout  # noqa: E402
from tinydet.tools.golden import write_golden  # noqa: E402

NAME = "m"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _warm(model) -> None:
    """Run one request through `model`'s engine here, so the replicas find every kernel they use in
    numba's on-disk cache instead of compiling it (minutes on 2 cores)."""
    engine = model.engine(4, 16, 1 << 20)
    h = engine.submit(model.request("Once", 4))
    while not engine.idle:
        engine.step()
    h.wait()


@pytest.fixture(scope="module")
def deployment(stories_models, stories_path):
    """A local Ray cluster, the ingress, and backend tinydet-b1: 2 replicas of stories260K fp32."""
    for m in stories_models.values():
        _warm(m)
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False, _metrics_export_port=_free_port())
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        cluster.deploy_ingress()
        info = cluster.deploy_backend("tinydet-b1", cluster.spec(stories_path, name=NAME, max_batch=4,
                                                                 prefill_chunk=32), 2)
        cluster.set_table([cluster.backend_entry("tinydet-b1", info, 1.0)])
        url = f"http://127.0.0.1:{port}"
        _wait_health(url)
        yield url, info
    finally:
        serve.shutdown()
        ray.shutdown()


def _live() -> dict:
    """The backend with all the traffic (rollouts replace it)."""
    (b,) = cluster.current_table()["backends"]
    return b


def _wait_health(url, timeout=120):
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(f"{url}/health", timeout=10)
        if r.status_code == 200:
            return r.json()
        assert time.monotonic() < deadline, r.text
        time.sleep(0.1)


def _body(r: dict, stream: bool) -> dict:
    return dict(model=NAME, prompt=r["prompt"], max_tokens=r["max_tokens"], temperature=r["temperature"],
                return_token_ids=True, stream=stream, **{k: r[k] for k in ("top_p", "seed", "stop") if k in r})


def _ask(url, body: dict, on_first=None) -> dict:
    """One completion (streamed or not) as {text, token_ids, output_hash, logits_hash, finish_reason,
    system_fingerprint}; `on_first()` is called when a stream's first token arrives."""
    if not body.get("stream"):
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
        assert resp.status_code == 200, resp.text
        d = resp.json()
        c = d["choices"][0]
        return {**{k: c[k] for k in ("text", "token_ids", "output_hash", "logits_hash", "finish_reason")},
                "system_fingerprint": d["system_fingerprint"]}
    text, last, fp = [], None, None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            d = json.loads(line[6:])
            assert "error" not in d, d
            if on_first is not None and not text:
                on_first()
            c = d["choices"][0]
            text.append(c["text"])
            last, fp = c, d["system_fingerprint"]
    return {"text": "".join(text), **{k: last[k] for k in ("token_ids", "output_hash", "logits_hash", "finish_reason")},
            "system_fingerprint": fp}


def _want(model, r: dict) -> dict:
    g = solo(model, **r)
    return {"text": g.text, "token_ids": g.token_ids, "output_hash": g.output_hash, "logits_hash": g.logits_hash,
            "finish_reason": g.finish_reason, "system_fingerprint": model.fingerprint}


def _bad_canary(tmp_path, model) -> str:
    """A golden file whose hashes no build reproduces: a replica gated by it must never serve."""
    path = tmp_path / "bad-golden.json"
    write_golden(path, "stories260k", model.sha256, [dict(prompt="Once upon a time", dtype=model.dtype, max_tokens=8,
                                                          temperature=0.0, output_hash="0" * 64, logits_hash="0" * 64)])
    return str(path)


def test_two_replicas_mixed_load_equals_each_request_alone(deployment, stories_models):
    """24 mixed requests (half streamed) from 8 concurrent clients: each answer is the request's
    `generate` alone, none lost, and both replicas are up behind /health."""
    url, info = deployment
    stories = stories_models["fp32"]
    health = _wait_health(url)
    assert health["backends"][0]["replicas"] == {"RUNNING": 2}
    assert info["fingerprint"] == stories.fingerprint
    reqs = _mixed_requests(24)
    want = [_want(stories, r) for r in reqs]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: _ask(url, _body(reqs[i], stream=i % 2 == 1)), range(len(reqs))))
    for r, g, w in zip(reqs, got, want):
        assert g == w, r


def test_fingerprint_pinning_with_two_versions_live(deployment, stories_models, stories_path):
    """Backends of two fingerprints (fp32, fp16) share the traffic: a request carrying a fingerprint
    gets only that version's answer; one nobody computes gets a 409; unpinned requests reach both."""
    url, info = deployment
    live = _live()
    fp16 = stories_models["fp16"]
    other = cluster.deploy_backend("tinydet-fp16", cluster.spec(stories_path, "fp16", name=NAME), 1)
    assert other["fingerprint"] == fp16.fingerprint != info["fingerprint"]
    try:
        cluster.set_table([{**live, "weight": 0.5}, cluster.backend_entry("tinydet-fp16", other, 0.5)])
        r = dict(prompt="Lily and Ben", max_tokens=24, temperature=0.9, seed=5)
        for model in stories_models.values():
            want = _want(model, r)
            with ThreadPoolExecutor(4) as pool:
                got = list(pool.map(lambda i: _ask(url, {**_body(r, i % 2 == 0),
                                                         "system_fingerprint": model.fingerprint}), range(8)))
            assert all(g == want for g in got)
        assert _want(stories_models["fp32"], r)["logits_hash"] != _want(fp16, r)["logits_hash"]
        resp = httpx.post(f"{url}/v1/completions", json={**_body(r, False), "system_fingerprint": "tinydet-x"})
        assert resp.status_code == 409 and resp.json()["error"]["code"] == "fingerprint_mismatch"
        seen = {_ask(url, _body(r, False))["system_fingerprint"] for _ in range(24)}
        assert seen == {info["fingerprint"], other["fingerprint"]}
    finally:
        cluster.set_table([live])
        serve.delete("tinydet-fp16")


def test_a_replica_that_fails_its_gate_never_serves(deployment, stories_models, stories_path, tmp_path):
    """A backend whose golden hashes do not match: its replicas never become ready, the deployment
    says why, and traffic stays on the gated replicas."""
    url, info = deployment
    live = _live()
    bad = cluster.spec(stories_path, name=NAME, canary_file=_bad_canary(tmp_path, stories_models["fp32"]))
    with pytest.raises(cluster.GateFailed, match="canary at start gave other hashes"):
        cluster.deploy_backend("tinydet-bad", bad, 1, constructor_retries=1)
    assert "tinydet-bad" not in serve.status().applications
    assert _live() == live
    r = dict(prompt="Tom", max_tokens=8, temperature=0.0)
    assert _ask(url, _body(r, False)) == _want(stories_models["fp32"], r)


def test_rollout_of_a_broken_version_rolls_back(deployment, stories_models, stories_path, tmp_path):
    url, info = deployment
    before = cluster.current_table()
    bad = cluster.spec(stories_path, name=NAME, canary_file=_bad_canary(tmp_path, stories_models["fp32"]))
    with pytest.raises(rollout.RolloutFailed, match="canary at start gave other hashes"):
        rollout.rollout(bad, 1, rollout.DEFAULT_PROBES, [0.5, 1.0], 0.5, echo=lambda m: None)
    after = cluster.current_table()
    assert after["backends"] == before["backends"]
    app = before["backends"][0]["app"]
    assert set(serve.status().applications) == {cluster.INGRESS_APP, app}
    assert _wait_health(url)["backends"][0]["app"] == app
    r = dict(prompt="Tom", max_tokens=8, temperature=0.0)
    assert _ask(url, _body(r, False)) == _want(stories_models["fp32"], r)


def test_rollout_to_the_same_fingerprint_probes_equal_then_shifts(deployment, stories_models, stories_path):
    """A rollout whose new replicas have the same fingerprint (they decode speculatively, drafting at
    fp16: the same bytes): the probes are byte-identical, traffic moves in steps, the old backend is
    retired and answers stay equal to the request alone."""
    url, info = deployment
    old = _live()["app"]
    spec = cluster.spec(stories_path, name=NAME, max_batch=4, prefill_chunk=32, speculative="fp16")
    out = rollout.rollout(spec, 2, rollout.DEFAULT_PROBES, [0.5, 1.0], 0.5, echo=lambda m: None)
    assert out["outcome"] == "done" and out["fingerprint"] == info["fingerprint"] and out["baseline"] is None
    table = cluster.current_table()["backends"]
    new = table[0]["app"]
    assert [(b["app"], b["weight"]) for b in table] == [(new, 1.0)] and new != old
    assert set(serve.status().applications) == {cluster.INGRESS_APP, new}
    r = dict(prompt="The sun was hot", max_tokens=16, temperature=0.7, seed=3)
    assert _ask(url, _body(r, True)) == _want(stories_models["fp32"], r)


def test_killing_a_replica_under_load_loses_nothing(deployment, stories_models):
    """16 long requests (half streamed) on 2 replicas; one replica is killed once they run. Every
    answer equals the request alone (retried elsewhere, streams resumed past the bytes sent), and Ray
    brings the replica back."""
    url, info = deployment
    stories = stories_models["fp32"]
    rng = random.Random(7)
    reqs = [dict(prompt=rng.choice(["Once upon a time", "Tom", "The little dog"]), max_tokens=300,
                 temperature=0.8, seed=i) for i in range(16)]
    want = [_want(stories, r) for r in reqs]
    started = threading.Event()

    def ask(i):
        return _ask(url, _body(reqs[i], stream=i % 2 == 1), on_first=started.set)

    app = _live()["app"]
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"SERVE_REPLICA::{app}#")]
    assert len(names) == 2
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(ask, i) for i in range(len(reqs))]
        assert started.wait(60)  # a stream has its first token: every request is on a replica by now
        time.sleep(0.1)
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
        got = [f.result() for f in futures]
    for r, g, w in zip(reqs, got, want):
        assert g == w, r
    health = _wait_health(url)
    assert health["backends"][0]["replicas"] == {"RUNNING": 2}
    deadline = time.monotonic() + 60
    while True:  # Ray's metrics reach its endpoint every few seconds
        text = httpx.get(f"{url}/metrics", timeout=30).text
        retries = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("ray_tinydet_ingress_retries_total{") and f'app="{app}"' in line]
        if retries and sum(retries) >= 1:
            break
        assert time.monotonic() < deadline, "no retry counted in /metrics"
        time.sleep(1)


def test_metrics_aggregate_every_replica(deployment):
    """/metrics holds each replica's canary counters (tagged with the replica) and the replicas per
    state of each backend."""
    url, info = deployment
    app = _live()["app"]
    deadline = time.monotonic() + 60
    while True:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        runs = {line.split('replica="')[1].split('"')[0] for line in text.splitlines()
                if line.startswith("ray_tinydet_canary_runs_total{") and f'app="{app}"' in line}
        mismatches = [line for line in text.splitlines() if line.startswith("ray_tinydet_canary_mismatches_total{")
                      and f'app="{app}"' in line]
        running = [line for line in text.splitlines() if line.startswith("ray_tinydet_backend_replicas{")
                   and f'app="{app}"' in line and 'state="RUNNING"' in line]
        if len(runs) >= 2 and running and running[-1].endswith(" 2.0"):
            break
        assert time.monotonic() < deadline, text[-3000:]
        time.sleep(1)
    assert all(line.endswith(" 0.0") for line in mismatches)


def test_a_client_that_leaves_mid_stream_frees_its_slot(deployment):
    """The stream is cancelled through the ingress down to the replica's engine: the request ends as
    "disconnected" there, and no sequence is left running."""
    url, info = deployment
    app = _live()["app"]
    body = dict(model=NAME, prompt="Once upon a time", max_tokens=480, temperature=0, stream=True)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
        assert next(resp.iter_lines()).startswith("data: ")
    deadline = time.monotonic() + 60
    while True:  # Ray's metrics reach its endpoint every few seconds
        lines = [line for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines()
                 if f'app="{app}"' in line]
        gone = sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("ray_tinydet_requests_total{")
                   and 'outcome="disconnected"' in line)
        running = [float(line.rsplit(" ", 1)[1]) for line in lines
                   if line.startswith("ray_tinydet_num_requests_running{")]
        if gone >= 1 and running and not any(running):
            break
        assert time.monotonic() < deadline, "\n".join(lines)[-3000:]
        time.sleep(1)
