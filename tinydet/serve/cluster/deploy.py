"""Deploying: a backend's gated replicas and the ingress as Serve applications, removing them, joining
or starting the Ray cluster, and `tinydet serve --ray` from start to stop (`run`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from ray import serve

from .ingress import Ingress
from .replica import REPLICA, GateFailed, Replica
from .routing import INGRESS_APP, _routes, backend_entry, current_table, set_table

HEALTH_PERIOD_S = 5.0  # how often Ray calls Replica.check_health


def spec(model, dtype="fp32", threads=1, name=None, max_batch=8, max_queue=64, prefill_chunk=512,
         prefix_cache_bytes=256 << 20, api_key=None, log_path=None, canary_file=None, canary_interval=600.0,
         sha256=None, check_memory=None, speculative=None) -> dict:
    """What a backend's replicas run: `tinydet serve`'s options (picklable), and the model file's
    SHA-256 when it is pinned (a replica whose file has another fails its gate). `speculative`: "ngram",
    a dtype or a draft model's path, as `Model.speculative` takes it (the same bytes, the same fingerprint)."""
    return dict(model=str(model), dtype=dtype, threads=threads, name=name or Path(str(model)).name,
                max_batch=max_batch, max_queue=max_queue, prefill_chunk=prefill_chunk,
                prefix_cache_bytes=prefix_cache_bytes, api_key=api_key, log_path=log_path, canary_file=canary_file,
                canary_interval=canary_interval, sha256=sha256, check_memory=check_memory,
                speculative=speculative)


def _why(message: str) -> str:
    """The replica's own reason from Ray's deployment message (which wraps it in tracebacks)."""
    lines = [line for line in message.splitlines() if line.strip()]
    for line in reversed(lines):
        if "GateFailed: " in line:
            return line.split("GateFailed: ", 1)[1]
    return lines[-1] if lines else message


def running() -> bool:
    """Whether a tinydet deployment (its ingress) runs on the connected cluster."""
    return INGRESS_APP in serve.status().applications


def backend_info(app: str) -> dict:
    """A replica's info() of backend `app` (its name, fingerprint, model)."""
    return serve.get_deployment_handle(REPLICA, app_name=app).info.remote().result()


def deploy_backend(app: str, spec: dict, replicas: int, constructor_retries: int = 2, shutdown_timeout: float = 30.0,
                   runtime_env: dict | None = None, wait_for_cpus: float = 0.0) -> dict:
    """Run `replicas` gated replicas of `spec` as the Serve application `app` (no HTTP route of its own)
    and return a replica's info (fingerprint, ...). Raises GateFailed, with Ray's message, when they do
    not all pass their gate, and when the cluster has too few CPUs free for them (after waiting up to
    `wait_for_cpus` seconds for nodes to join); the application is then deleted. `runtime_env`: Ray's,
    for the replicas (e.g. {"pip": ["tinydet==X"]} to run another tinydet version)."""
    import ray

    need, deadline = replicas * spec["threads"], time.monotonic() + wait_for_cpus
    while need > (free := ray.available_resources().get("CPU", 0)):
        if time.monotonic() >= deadline:
            raise GateFailed(f"{app}: {replicas} replicas x {spec['threads']} threads need {need} CPUs; the Ray "
                             f"cluster has {free:g} free (add a node, or fewer replicas or threads)")
        time.sleep(1.0)
    actor = {"num_cpus": spec["threads"], **({"runtime_env": runtime_env} if runtime_env else {})}
    d = serve.deployment(Replica, name=REPLICA, num_replicas=replicas, max_ongoing_requests=spec["max_batch"] +
                         spec["max_queue"], ray_actor_options=actor,
                         health_check_period_s=HEALTH_PERIOD_S, max_constructor_retry_count=constructor_retries,
                         graceful_shutdown_timeout_s=shutdown_timeout)
    try:
        handle = serve.run(d.bind(spec), name=app, route_prefix=None)
    except RuntimeError as e:
        message = str(e)
        try:
            st = serve.status().applications.get(app)
            if st is not None:
                dep = st.deployments.get(REPLICA)
                message = (dep.message if dep is not None else "") or st.message or message
        finally:
            serve.delete(app)
        raise GateFailed(f"{app}: its replicas did not pass their gate: {_why(message)}") from None
    return handle.info.remote().result()


def deploy_ingress() -> None:
    """The ingress application (routes "/") and its routing table, empty."""
    _routes(create=True)
    d = serve.deployment(Ingress, name="Ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
                         max_ongoing_requests=1024)
    serve.run(d.bind(), name=INGRESS_APP, route_prefix="/")


def remove_all() -> None:
    """Delete the ingress, every backend in the routing table, and the table."""
    import ray

    try:
        apps = [b["app"] for b in current_table()["backends"]]
    except ValueError:  # no table
        apps = []
    for name in [INGRESS_APP, *apps]:
        serve.delete(name)
    try:
        ray.kill(_routes())
    except ValueError:
        pass


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def connect(address: str | None) -> bool:
    """Join the Ray cluster at `address`, or start a local one (None). Returns whether it was started here."""
    import ray

    from ...errors import TinydetError

    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    if address is None:
        # Twice the cores in Ray's accounting: room for a rollout's new replicas beside the old ones
        # (for a while the cores are shared, which costs speed, never bits).
        ray.init(num_cpus=2 * (os.cpu_count() or 1), include_dashboard=False, logging_level=logging.WARNING,
                 log_to_driver=False)
        return True
    host, _, port = address.rpartition("://")[2].rpartition(":")
    if host and port.isdigit():  # Ray retries an address nobody listens on for minutes: ask first
        import socket

        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except OSError as e:
            raise TinydetError(f"--ray-address {address}: nothing answers there ({e.strerror or e})") from None
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise TinydetError(f"--ray-address {address}: cannot join a Ray cluster there ({e})") from None
    return False


def run(spec: dict, replicas: int, host: str, port: int, address: str | None = None, shutdown_timeout: float = 30.0,
        echo=print, stop: threading.Event | None = None) -> None:
    """`tinydet serve --ray`: the ingress on host:port and `replicas` gated replicas of `spec`, until
    SIGTERM or Ctrl-C (or `stop`); then the applications are deleted and a local cluster stopped."""
    import signal

    import ray

    from ...errors import TinydetError

    stop = stop or threading.Event()
    own = connect(address)
    deployed = False
    try:
        cores = os.cpu_count() or 1
        if own and replicas * spec["threads"] > cores:
            raise TinydetError(f"--replicas {replicas} x --threads {spec['threads']} need {replicas * spec['threads']} "
                               f"cores; this machine has {cores}")
        if running():
            raise TinydetError(f"a tinydet deployment already runs on the Ray cluster at {address} (change it with "
                               "`tinydet rollout`)")
        port = port or _free_port(host)
        serve.start(http_options={"host": host, "port": port})
        deployed = True
        deploy_ingress()  # the ingress first: /health answers 503 while the replicas load and pass their gate
        echo(f"tinydet serve --ray: http://{host}:{port} ({replicas} replicas of {spec['name']} starting; /health "
             "says when every one has passed its gate)")
        app = "tinydet-b1"
        try:
            # A cluster joined by address may still be starting its nodes.
            info = deploy_backend(app, spec, replicas, shutdown_timeout=shutdown_timeout,
                                  wait_for_cpus=0.0 if own else 600.0)
        except GateFailed as e:
            raise TinydetError(str(e)) from None
        set_table([backend_entry(app, info, 1.0)])
        echo(f"tinydet serve --ray: ready, {replicas} replicas, system_fingerprint {info['fingerprint']}")
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        echo("tinydet serve --ray: stopping (running requests finish first)")
    finally:
        try:
            if own:
                serve.shutdown()
            elif deployed:
                remove_all()
        finally:
            ray.shutdown()
