"""`tinydet rollout`: a new model or tinydet version beside the running one, given traffic only once it
has proven its bits, else removed again.

  1. deploy   the new backend's replicas, each through its readiness gate (cluster.Replica);
  2. probe    the same requests to new and old, with the same pinned id, time and seed: where the
              fingerprints are equal the answers must be byte-identical; where they differ, the new
              answers are the new baseline (recorded in the plan's output);
  3. shift    traffic in steps (the routing table's weights), the new replicas watched at each step;
  4. retire   the old backends.
Any failure restores the old routing table and deletes the new backend.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time

from ray import serve

from . import cluster

DEFAULT_PROBES = [
    {"path": "/v1/completions", "body": {"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0}},
    {"path": "/v1/completions", "body": {"prompt": "The", "max_tokens": 32, "temperature": 0.8, "seed": 7,
                                         "logprobs": 2}},
    {"path": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "Say hello."}],
                                              "max_tokens": 16, "temperature": 0}},
]


class RolloutFailed(RuntimeError):
    pass


def read_probes(path) -> list[dict]:
    """Probe requests from a JSON Lines file: {"path": "/v1/completions", "body": {...}} per line."""
    from ..errors import TinydetError

    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                p = json.loads(line)
            except ValueError as e:
                raise TinydetError(f"--probe {path}, line {n}: not JSON ({e})") from None
            if not (isinstance(p, dict) and p.get("path") in ("/v1/completions", "/v1/chat/completions")
                    and isinstance(p.get("body"), dict)):
                raise TinydetError(f"--probe {path}, line {n}: expected {{\"path\": \"/v1/completions\" or "
                                   "\"/v1/chat/completions\", \"body\": {...}}")
            out.append(p)
    if not out:
        raise TinydetError(f"--probe {path}: no probe requests")
    return out


def plan(spec: dict, replicas: int, table: dict, probes: list[dict], steps: list[float],
         runtime_env: dict | None = None) -> dict:
    """What the rollout will do (printed by --dry-run)."""
    old = table["backends"]
    used = [int(b["app"].rsplit("-b", 1)[1]) for b in old if b["app"].rsplit("-b", 1)[-1].isdigit()]
    app = f"tinydet-b{max(used, default=0) + 1}"
    gate = f"the golden cases of {spec['canary_file']}" if spec["canary_file"] else "the model manifest's golden case"
    return {"deploy": {"app": app, "model": spec["model"], "sha256": spec["sha256"], "dtype": spec["dtype"],
                       "replicas": replicas, "threads": spec["threads"], "served_model_name": spec["name"],
                       "runtime_env": runtime_env, "gate": gate},
            "probe": {"requests": len(probes), "against": [{"app": b["app"], "fingerprint": b["fingerprint"]}
                                                           for b in old],
                      "rule": "byte-identical where the fingerprint is the same, else recorded as the new baseline"},
            "shift": [{"new": w, "old": round(1 - w, 6)} for w in steps],
            "retire": [b["app"] for b in old],
            "on_failure": "restore the routing table, delete " + app}


async def _answer(backend: cluster.Backend, call: tuple) -> tuple[int, bytes]:
    status, body = None, bytearray()
    async for item in cluster.relay([backend], call):
        if isinstance(item, tuple):
            status = item[0]
        else:
            body += item
    return status, bytes(body)


def _probe(new: cluster.Backend, olds: list[cluster.Backend], probes: list[dict], name: str, echo) -> list[dict]:
    """Each probe to the new backend and to every old one, with the same pinned call: the new answers'
    hashes; raises RolloutFailed where a same-fingerprint answer differs."""

    async def run():
        out = []
        for p in probes:
            body = json.dumps({"model": name, **p["body"]}).encode()
            call = cluster.pinned_call("POST", p["path"], "", [("content-type", "application/json")], body)
            status, got = await _answer(new, call)
            record = {"path": p["path"], "body": p["body"], "status": status,
                      "sha256": hashlib.sha256(got).hexdigest()}
            for old in (o for o in olds if o.fingerprint == new.fingerprint):
                want = await _answer(old, call)
                if want != (status, got):
                    raise RolloutFailed(f"probe {p['path']} {json.dumps(p['body'])}: {new.app} answered other bytes "
                                        f"than {old.app} with the same fingerprint {new.fingerprint} "
                                        f"({status}: {got[:200]!r} vs {want[0]}: {want[1][:200]!r})")
            out.append(record)
            echo(f"  probe {p['path']}: {status}, sha256 {record['sha256'][:16]}")
        return out

    return asyncio.run(run())


def _watch(app: str, seconds: float) -> None:
    """Raise RolloutFailed unless `app` stays running and healthy for `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        st = serve.status().applications.get(app)
        dep = st.deployments.get(cluster.REPLICA) if st is not None else None
        if dep is None or cluster._name(dep.status) != "HEALTHY":
            why = (dep.message if dep is not None else "") or (st.message if st is not None else "it is gone")
            raise RolloutFailed(f"{app} is not healthy: {why}")
        if time.monotonic() >= deadline:
            return
        time.sleep(0.25)


def rollout(spec: dict, replicas: int, probes: list[dict], steps: list[float], step_seconds: float,
            dry_run: bool = False, runtime_env: dict | None = None, echo=print) -> dict:
    """Roll the running deployment over to `spec` (module docstring). Returns the plan with its outcome:
    {"outcome": "done" | "dry-run", "fingerprint", "baseline": [...] or None}; raises RolloutFailed
    after rolling back."""
    table = cluster.current_table()
    if not table["backends"]:
        raise RolloutFailed("the running deployment has no backend to roll over from")
    p = plan(spec, replicas, table, probes, steps, runtime_env)
    echo(json.dumps(p, indent=2))
    if dry_run:
        return {**p, "outcome": "dry-run"}
    app = p["deploy"]["app"]
    old_backends = table["backends"]
    olds = [cluster.Backend(b["app"], b["fingerprint"], b["weight"]) for b in old_backends]
    try:
        echo(f"deploying {app}: {replicas} replicas, each through its gate")
        try:
            info = cluster.deploy_backend(app, spec, replicas, runtime_env=runtime_env)
        except cluster.GateFailed as e:
            raise RolloutFailed(str(e)) from None
        new = cluster.Backend(app, info["fingerprint"], 0.0)
        echo(f"{app} passed its gate: fingerprint {new.fingerprint}; probing")
        answers = _probe(new, olds, probes, spec["name"], echo)
        same = [o.app for o in olds if o.fingerprint == new.fingerprint]
        baseline = None if same else answers
        echo(f"probes equal to {', '.join(same)}" if same else
             f"new fingerprint: {len(answers)} probe answers recorded as the new baseline")
        for w in steps:
            cluster.set_table([*({**b, "weight": b["weight"] * (1 - w)} for b in old_backends),
                               cluster.backend_entry(app, info, w)])
            echo(f"traffic: {w:.0%} to {app}")
            _watch(app, step_seconds)
        cluster.set_table([cluster.backend_entry(app, info, 1.0)])
        for b in old_backends:
            serve.delete(b["app"])
        echo(f"retired {', '.join(b['app'] for b in old_backends)}")
        return {**p, "outcome": "done", "fingerprint": new.fingerprint, "baseline": baseline}
    except BaseException as e:
        echo(f"rolling back: {e}")
        try:
            cluster.set_table(old_backends)
        finally:
            serve.delete(app)
        if isinstance(e, Exception) and not isinstance(e, RolloutFailed):
            raise RolloutFailed(f"{type(e).__name__}: {e}") from e
        raise
