"""The ingress: the HTTP front on --host/--port. /health and /metrics are for the whole deployment;
every other request goes to a replica of a backend (one Serve application per model version) chosen by
the request's system_fingerprint, else by the traffic weights (the routing table, `routing.py`), and
is relayed with failover (`failover.py`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.request

from ray import serve
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse

from ..protocol import APIError, _json, read_body
from .failover import Backend, Diverged, pinned_call, relay
from .replica import REPLICA
from .routing import _routes

log = logging.getLogger("tinydet.serve.cluster")


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
