"""A replica: one `tinydet serve` (service.py and app.py) in a Ray Serve replica. Its constructor loads
the model and runs the determinism canary (the gate): a replica that fails it raises, so Ray never
routes to it, and `serve status` shows why. HTTP requests reach it as calls (`http`) that stream the
app's answer: its status and headers, then its body.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from ray import serve

log = logging.getLogger("tinydet.serve.cluster")

REPLICA = "Replica"  # the deployment name in each backend application
METRICS_PERIOD_S = 2.0  # how often a replica copies its metrics into Ray's


class GateFailed(RuntimeError):
    """A replica that did not pass its readiness gate (its determinism canary, or loading)."""


class Replica:
    """One model behind the app of `tinydet serve`. `spec` holds `tinydet serve`'s options (`spec()`)."""

    def __init__(self, spec: dict):
        from ...api import load
        from ...errors import TinydetError
        from ..app import create_app
        from ..service import Service

        def loader():
            m = load(spec["model"], dtype=spec["dtype"], threads=spec["threads"], check_memory=spec["check_memory"])
            if spec["sha256"] and m.sha256 != spec["sha256"]:
                raise TinydetError(f"{spec['model']}: SHA-256 {m.sha256}, but this deployment pins {spec['sha256']}")
            m.speculative = spec.get("speculative")
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
