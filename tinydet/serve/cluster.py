"""`tinydet serve --ray`: replicas of one pinned model on Ray Serve, interchangeable because their bits
are the same, each taking traffic only after it has reproduced the model's golden hashes.

  Replica   one `tinydet serve` (service.py and app.py) in a Ray Serve replica. Its constructor loads the
            model and runs the determinism canary (the gate): a replica that fails it raises, so Ray
            never routes to it, and `serve status` shows why. HTTP requests reach it as calls (`http`)
            that stream the app's answer: its status and headers, then its body.
  Ingress   the HTTP front on --host/--port: /health and /metrics for the whole deployment; every other
            request goes to a replica of a backend (one Serve application per model version) chosen by
            the request's system_fingerprint, else by the traffic weights. A replica that dies under a
            request is replaced by another, and the client gets the bytes it would have got: the ingress
            fixes the answer's id, time and seed before the first try.

The routing table (each backend's application, fingerprint and traffic weight) lives in a detached
actor (`Routes`) that the ingress watches, so `tinydet rollout` can change it from another process and
it outlives an ingress restart.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import secrets
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

from ray import serve
from ray.exceptions import RayActorError
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse

from .protocol import APIError, _json, read_body

log = logging.getLogger("tinydet.serve.cluster")

INGRESS_APP = "tinydet"  # the Serve application of the ingress; backends are "tinydet-b1", "tinydet-b2", ...
REPLICA = "Replica"  # the deployment name in each backend application
ROUTES = "tinydet-routes"  # the detached actor holding the routing table
ATTEMPTS = 8  # tries of one request across replicas before a 503
HEALTH_PERIOD_S = 5.0  # how often Ray calls Replica.check_health
METRICS_PERIOD_S = 2.0  # how often a replica copies its metrics into Ray's


# -- a replica ------------------------------------------------------------------------------------

class GateFailed(RuntimeError):
    """A replica that did not pass its readiness gate (its determinism canary, or loading)."""


class Replica:
    """One model behind the app of `tinydet serve`. `spec` holds `tinydet serve`'s options (`spec()`)."""

    def __init__(self, spec: dict):
        from ..api import load
        from ..errors import TinydetError
        from .app import create_app
        from .service import Service

        def loader():
            m = load(spec["model"], dtype=spec["dtype"], threads=spec["threads"], check_memory=spec["check_memory"])
            if spec["sha256"] and m.sha256 != spec["sha256"]:
                raise TinydetError(f"{spec['model']}: SHA-256 {m.sha256}, but this deployment pins {spec['sha256']}")
            return m

        self.service = s = Service(loader, spec["name"], spec["max_batch"], spec["max_queue"], spec["prefill_chunk"],
                                   spec["prefix_cache_bytes"], spec["api_key"], spec["log_path"],
                                   spec["canary_file"], spec["canary_interval"])
        s.start()
        while s.state == "loading":
            time.sleep(0.02)
        if s.state != "ready":
            s.stop()
            raise GateFailed(f"tinydet replica not ready (readiness gate): {s.problem}")
        self.app = create_app(s)  # without its lifespan: the service is started already
        ctx = serve.get_replica_context()
        self.tags = {"replica": ctx.replica_id.unique_id, "app": ctx.app_name, "fingerprint": s.fingerprint}
        log.info("replica %s of %s passed its gate: fingerprint %s", self.tags["replica"], ctx.app_name, s.fingerprint)
        self._gauges: dict = {}
        self._tasks: set = set()
        threading.Thread(target=self._metrics_loop, name="tinydet-metrics", daemon=True).start()

    def info(self) -> dict:
        s = self.service
        return {"name": s.name, "fingerprint": s.fingerprint, "sha256": s.model.sha256, "dtype": s.model.dtype,
                "replica": self.tags["replica"]}

    def check_health(self) -> None:
        """Ray's health check: a replica whose canary has since given other hashes is replaced."""
        s = self.service
        if s.state != "ready":
            raise GateFailed(f"not serving: {s.problem}")
        if s.mismatches:
            raise GateFailed(f"the determinism canary gave other hashes than recorded ({s.mismatches} runs)")

    async def http(self, pinned: dict, method: str, path: str, query: str, headers: list, body: bytes):
        """One HTTP request through the app: yields (status, headers), then the body's parts (bytes)."""
        out: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        delivered = False

        async def receive():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            await out.put(message)

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
                 "query_string": query.encode("latin-1"), "client": (pinned.get("client") or "ingress", 0),
                 "server": ("replica", 0),
                 "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers],
                 "state": {"pinned": pinned}}

        async def run():
            try:
                await self.app(scope, receive, send)
            finally:
                await out.put(None)

        task = asyncio.create_task(run())
        self._tasks.add(task)  # held until done: the loop keeps only a weak reference
        task.add_done_callback(self._tasks.discard)
        try:
            while (m := await out.get()) is not None:
                if m["type"] == "http.response.start":
                    yield m["status"], [(k.decode("latin-1"), v.decode("latin-1")) for k, v in m.get("headers", [])]
                elif m["type"] == "http.response.body" and m.get("body"):
                    yield bytes(m["body"])
        finally:
            gone.set()  # the caller went away (or the answer is complete): the app cancels what still runs

    def _metrics_loop(self) -> None:
        """Every sample of this replica's /metrics, copied into Ray's metrics with the replica's tags:
        Ray's Prometheus endpoint then holds every replica's, and the ingress's /metrics shows them."""
        from ray.util.metrics import Gauge

        while not self.service._stop.wait(METRICS_PERIOD_S):
            try:
                for family in self.service.metrics.registry.collect():
                    for sample in family.samples:
                        keys = tuple(sorted(sample.labels)) + tuple(self.tags)
                        g = self._gauges.get(sample.name)
                        if g is None:
                            g = self._gauges[sample.name] = Gauge(sample.name, family.documentation or sample.name,
                                                                  tag_keys=keys)
                        g.set(float(sample.value), tags={**sample.labels, **self.tags})
            except Exception:  # noqa: BLE001 - metrics never take a replica down
                log.exception("copying metrics to Ray failed")

    def __del__(self):
        svc = getattr(self, "service", None)
        if svc is not None:
            svc.stop(timeout=1.0)


# -- relaying a request to replicas, with failover -------------------------------------------------

@dataclass
class Backend:
    app: str
    fingerprint: str
    weight: float
    handle: object = None

    def __post_init__(self):
        if self.handle is None:
            self.handle = serve.get_deployment_handle(REPLICA, app_name=self.app)


class Diverged(RuntimeError):
    """A retry's bytes differ from the bytes already sent: the replicas do not compute the same bits."""


async def relay(backends: list[Backend], call: tuple, on_retry=None):
    """Send `call` (Replica.http's arguments) to a replica of one of `backends` (by weight) and yield its
    (status, headers) and then its body's parts. When the replica dies, the call goes again, to
    whichever replica Ray routes it to, and only bytes past those already yielded are yielded: every
    replica of a fingerprint gives the same bytes, which is checked on the overlap. `on_retry(app)` is
    called before each retry."""
    sent = bytearray()
    head = None
    for attempt in range(ATTEMPTS):
        b = random.choices(backends, [max(x.weight, 1e-9) for x in backends])[0]
        gen = b.handle.options(stream=True).http.remote(*call)
        got, done = 0, False
        try:
            async for item in gen:
                if isinstance(item, tuple):
                    if head is None:
                        head = item
                        yield item
                    elif item[0] != head[0]:
                        raise Diverged(f"a retry answered {item[0]}, the first try {head[0]}")
                    continue
                lo, got = got, got + len(item)
                if lo < len(sent):
                    overlap = item[:len(sent) - lo]
                    if bytes(sent[lo:lo + len(overlap)]) != overlap:
                        raise Diverged("a retry's bytes differ from those already sent")
                    item = item[len(overlap):]
                if item:
                    sent += item
                    yield item
            done = True
            return
        except RayActorError as e:  # the replica died or is unreachable: again, elsewhere
            log.warning("%s: a replica of %s failed under a request (%s); retrying (%d/%d)", call[2], b.app,
                        type(e).__name__, attempt + 1, ATTEMPTS)
            if on_retry is not None:
                on_retry(b.app)
            await asyncio.sleep(min(0.05 * 2 ** attempt, 2.0))
        finally:
            if not done:  # the caller went away (or this try failed): the replica stops computing it
                gen.cancel()
    raise APIError(503, f"no replica could answer after {ATTEMPTS} tries", type="server_error", code="unavailable",
                   headers={"Retry-After": "1"})


def pinned_call(method: str, path: str, query: str, headers: list, body: bytes, client: str = "") -> tuple:
    """Replica.http's arguments with the answer's id, time and seed fixed here, once, for every try
    (and the client's address, for the replica's request log)."""
    pinned = {"id": uuid.uuid4().hex, "created": int(time.time()), "seed": secrets.randbits(63), "client": client}
    return pinned, method, path, query, headers, body


# -- the ingress ----------------------------------------------------------------------------------

class Ingress:
    """The HTTP front (module docstring), routing by the table in `Routes`."""

    async def __init__(self):
        self.backends: list[Backend] = []
        self.version = -1  # of the routing table in use
        self.health: dict = {"status": "starting", "backends": []}
        self._gauge = None
        from ray.util.metrics import Counter

        self._retries = Counter("tinydet_ingress_retries", "Requests sent again after their replica died",
                                tag_keys=("app",))
        self._poller = asyncio.get_running_loop().create_task(self._poll())

    def _use(self, table: dict) -> None:
        old = {b.app: b.handle for b in self.backends}
        self.backends = [Backend(b["app"], b["fingerprint"], float(b["weight"]), old.get(b["app"]))
                         for b in table["backends"]]
        self.version = table["version"]

    def table(self) -> dict:
        """The routing table in use."""
        return {"version": self.version, "backends": [{"app": b.app, "fingerprint": b.fingerprint,
                                                       "weight": b.weight} for b in self.backends]}

    # -- health -----------------------------------------------------------------------------------

    async def _poll(self) -> None:
        from ray.util.metrics import Gauge

        self._gauge = Gauge("tinydet_backend_replicas", "Replicas of each backend, by state",
                            tag_keys=("app", "fingerprint", "state"))
        seen: dict = {}
        routes = None
        while True:
            try:
                routes = routes or _routes()
                table = await routes.get.remote()
                if table["version"] != self.version:
                    self._use(table)
                status = await asyncio.to_thread(serve.status)
                self.health = self._health(status, seen)
            except Exception as e:  # noqa: BLE001 - reported by /health, polled again
                self.health = {"status": "unknown", "error": f"{type(e).__name__}: {e}", "backends": []}
            await asyncio.sleep(0.5)

    def _health(self, status, seen: dict) -> dict:
        rows, ok = [], bool(self.backends)
        for b in self.backends:
            app = status.applications.get(b.app)
            dep = app.deployments.get(REPLICA) if app is not None else None
            states = {_name(k): v for k, v in (dep.replica_states if dep is not None else {}).items()}
            for state in set(states) | seen.get(b.app, set()):
                self._gauge.set(states.get(state, 0), tags={"app": b.app, "fingerprint": b.fingerprint, "state": state})
            seen[b.app] = set(states)
            ready = (app is not None and _name(app.status) == "RUNNING" and dep is not None
                     and _name(dep.status) == "HEALTHY" and set(states) == {"RUNNING"})
            ok = ok and ready
            row = {"app": b.app, "system_fingerprint": b.fingerprint, "weight": b.weight, "ready": ready,
                   "replicas": states}
            message = (dep.message if dep is not None else "") or (app.message if app is not None else "no such application")
            if not ready and message:
                row["message"] = message
            rows.append(row)
        return {"status": "ok" if ok else "unavailable", "backends": rows}

    # -- HTTP -------------------------------------------------------------------------------------

    async def __call__(self, req: HTTPRequest) -> Response:
        try:
            if req.url.path == "/health" and req.method == "GET":
                return _json(self.health, 200 if self.health["status"] == "ok" else 503)
            if req.url.path == "/metrics" and req.method == "GET":
                return Response(await asyncio.to_thread(_ray_metrics), media_type="text/plain; version=0.0.4")
            return await self._forward(req)
        except APIError as e:
            return _json(e.body(), e.status, e.headers)

    async def _forward(self, req: HTTPRequest) -> Response:
        body = await read_body(req)
        backends = self._route(body)
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in req.headers.raw]
        call = pinned_call(req.method, req.url.path, req.url.query, headers, body, req.client.host if req.client else "")
        gen = relay(backends, call, lambda app: self._retries.inc(1, tags={"app": app}))
        status, head = await gen.__anext__()
        head = [(k, v) for k, v in head if k.lower() != "content-length"]
        sse = any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in head)

        async def rest():
            try:
                async for part in gen:
                    yield part
            except (APIError, Diverged) as e:  # after the status: into the stream, as the app does
                log.error("%s: %s", req.url.path, e)
                if sse:
                    err = e if isinstance(e, APIError) else APIError(500, str(e), type="server_error")
                    yield f"data: {json.dumps(err.body())}\n\ndata: [DONE]\n\n".encode()
            finally:
                await gen.aclose()

        response = StreamingResponse(rest(), status)
        response.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in head]
        return response

    def _route(self, body: bytes) -> list[Backend]:
        """The backends a request may go to: those of its system_fingerprint, else those with traffic."""
        if not self.backends:
            raise APIError(503, "no backend is deployed", type="server_error", code="unavailable")
        fp = None
        try:
            obj = json.loads(body) if body else None
            fp = obj.get("system_fingerprint") if isinstance(obj, dict) else None
        except ValueError:
            pass  # the replica answers the 400
        if isinstance(fp, str):
            match = [b for b in self.backends if b.fingerprint == fp]
            if not match:
                live = ", ".join(sorted({b.fingerprint for b in self.backends}))
                raise APIError(409, f"system_fingerprint: the request expects {fp} but this deployment computes "
                                    f"{live}", param="system_fingerprint", code="fingerprint_mismatch")
            return match
        live = [b for b in self.backends if b.weight > 0]
        if not live:
            raise APIError(503, "no backend has traffic", type="server_error", code="unavailable")
        return live


def _name(state) -> str:
    return getattr(state, "value", state)


def _ray_metrics() -> str:
    """tinydet's and Ray Serve's samples from every node's Ray metrics endpoint."""
    import ray

    out = []
    for node in ray.nodes():
        port = node.get("MetricsExportPort")
        if not node.get("Alive") or not port:
            continue
        try:
            with urllib.request.urlopen(f"http://{node['NodeManagerAddress']}:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError as e:
            out.append(f"# node {node['NodeManagerAddress']}: metrics unreachable ({e})")
            continue
        for line in text.splitlines():
            name = line.split(" ", 3)[2] if line.startswith("# ") and len(line.split(" ")) > 2 else line
            if name.startswith(("ray_tinydet_", "ray_serve_")) and "_created" not in name.split("{")[0]:
                out.append(line)
    return "\n".join(out) + "\n"


# -- deploying ------------------------------------------------------------------------------------

def spec(model, dtype="fp32", threads=1, name=None, max_batch=8, max_queue=64, prefill_chunk=512,
         prefix_cache_bytes=256 << 20, api_key=None, log_path=None, canary_file=None, canary_interval=600.0,
         sha256=None, check_memory=None) -> dict:
    """What a backend's replicas run: `tinydet serve`'s options (picklable), and the model file's
    SHA-256 when it is pinned (a replica whose file has another fails its gate)."""
    return dict(model=str(model), dtype=dtype, threads=threads, name=name or Path(str(model)).name,
                max_batch=max_batch, max_queue=max_queue, prefill_chunk=prefill_chunk,
                prefix_cache_bytes=prefix_cache_bytes, api_key=api_key, log_path=log_path, canary_file=canary_file,
                canary_interval=canary_interval, sha256=sha256, check_memory=check_memory)


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


class Routes:
    """The routing table, {"version", "backends": [{"app", "fingerprint", "weight"}]}: a detached actor,
    so that it outlives an ingress restart and a rollout can change it from another process. The
    ingress reads it twice a second."""

    def __init__(self):
        self.table = {"version": 0, "backends": []}

    def get(self) -> dict:
        return self.table

    def put(self, backends: list[dict]) -> int:
        self.table = {"version": self.table["version"] + 1, "backends": backends}
        return self.table["version"]


def _routes(create: bool = False):
    import ray

    if create:
        actor = ray.remote(num_cpus=0, max_restarts=0)(Routes)
        return actor.options(name=ROUTES, namespace="serve", lifetime="detached", get_if_exists=True).remote()
    return ray.get_actor(ROUTES, namespace="serve")


def deploy_ingress() -> None:
    """The ingress application (routes "/") and its routing table, empty."""
    _routes(create=True)
    d = serve.deployment(Ingress, name="Ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
                         max_ongoing_requests=1024)
    serve.run(d.bind(), name=INGRESS_APP, route_prefix="/")


def set_table(backends: list[dict], timeout: float = 30.0) -> None:
    """Change the routing table, and return once the ingress routes by it."""
    import ray

    version = ray.get(_routes().put.remote(backends))
    ingress = serve.get_app_handle(INGRESS_APP)
    deadline = time.monotonic() + timeout
    while ingress.table.remote().result()["version"] < version:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the ingress did not take routing table {version} within {timeout:g} s")
        time.sleep(0.05)


def current_table() -> dict:
    """The routing table ({"version", "backends": [...]})."""
    import ray

    return ray.get(_routes().get.remote())


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


def backend_entry(app: str, info: dict, weight: float) -> dict:
    return {"app": app, "fingerprint": info["fingerprint"], "weight": weight}


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def connect(address: str | None) -> bool:
    """Join the Ray cluster at `address`, or start a local one (None). Returns whether it was started here."""
    import ray

    from ..errors import TinydetError

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

    from ..errors import TinydetError

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
