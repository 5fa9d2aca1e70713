"""What `tinydet serve` runs behind HTTP: the model, loaded in the background; one engine thread that
owns it and its KV slots; the determinism canary; the structured log.

The HTTP side (`app.py`, `streaming.py`) only submits requests and reads their events; it never computes.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from ..engine import Handle, Request
from ..errors import TinydetError
from .metrics import Metrics
from .protocol import APIError

log = logging.getLogger("tinydet.serve")

DEFAULT_PROBE = dict(prompt="Once upon a time", max_tokens=16, temperature=0.0)


class JsonLog:
    """One JSON object per line, appended (None: nowhere)."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path else None
        self._lock = threading.Lock()
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.path.open("a", encoding="utf-8").close()
            except OSError as e:
                raise TinydetError(f"--log {path}: cannot write ({e.strerror})") from None

    def write(self, record: dict) -> None:
        if self.path is None:
            return
        line = json.dumps({"time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"), **record},
                          ensure_ascii=False)
        with self._lock, self.path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")


class Service:
    """The model behind the server. `loader()` returns a `tinydet.Model` (called on a background
    thread by `start`, so the HTTP side can answer /health with 503 meanwhile)."""

    def __init__(self, loader: Callable[[], object], name: str, max_batch: int = 8, max_queue: int = 64,
                 prefill_chunk: int | None = None, prefix_cache_bytes: int = 256 << 20, api_key: str | None = None,
                 log_path: str | Path | None = None, canary_file: str | Path | None = None,
                 canary_interval: float = 600.0):
        self.loader, self.name = loader, name
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        self.prefix_cache_bytes, self.api_key = prefix_cache_bytes, api_key
        self.canary_file, self.canary_interval = canary_file, canary_interval
        self.log = JsonLog(log_path)
        self.metrics = Metrics(self)
        self.model = self.engine = None
        self.fingerprint: str | None = None
        self.state, self.problem = "loading", None  # "loading" | "ready" | "failed"
        self.mismatches = 0  # canary runs whose hashes differed from the recorded ones
        self.created = int(time.time())
        self._stop = threading.Event()
        self._submit_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._canary: list[tuple[dict, dict | None]] = []  # (case, expected hashes or None: not yet known)

    # -- life -------------------------------------------------------------------------------------

    def start(self) -> None:
        t = threading.Thread(target=self._start, name="tinydet-load", daemon=True)
        t.start()
        self._threads.append(t)

    def _start(self) -> None:
        try:
            self.model = self.loader()
            if self._stop.is_set():  # stopped while loading: nothing more to start
                return
            self.fingerprint = self.model.fingerprint
            self.engine = self.model.engine(self.max_batch, self.prefill_chunk, self.prefix_cache_bytes)
            engine_thread = threading.Thread(target=self._serve, name="tinydet-engine", daemon=True)
            engine_thread.start()
            self._threads.append(engine_thread)
            self._canary = self._canary_cases()
            if not self.run_canary() and not self._stop.is_set():
                self._fail("the determinism canary at start gave other hashes than recorded; not taking traffic")
                return
        except (TinydetError, OSError) as e:
            self._fail(str(e))
            return
        except Exception as e:  # noqa: BLE001 - the server stays up to say why
            log.exception("loading failed")
            self._fail(f"{type(e).__name__}: {e}")
            return
        if self._stop.is_set():
            return
        self.state = "ready"
        self.metrics.ready.set(1)
        log.info("ready: %s (%s), fingerprint %s", self.name, self.model.path, self.fingerprint)
        self.log.write({"event": "ready", "model": self.name, "fingerprint": self.fingerprint})
        if self.canary_interval > 0:
            t = threading.Thread(target=self._canary_loop, name="tinydet-canary", daemon=True)
            t.start()
            self._threads.append(t)

    def _fail(self, problem: str) -> None:
        self.state, self.problem = "failed", problem
        log.error("not serving: %s", problem)
        self.log.write({"event": "failed", "model": self.name, "error": problem})

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                self.engine.serve(self._stop)
            except Exception:  # the failed pass ended its requests (500); the engine goes on
                log.exception("a forward pass failed; its requests got an error")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine thread once its current step is done (the HTTP side has drained first).
        While the model still loads there is nothing to drain (every request got a 503): the load, or
        the first pass compiling kernels for minutes, is not waited for; its daemon threads end with
        the process (a SIGTERM then stopped the server only after 10 s per thread)."""
        self._stop.set()
        if self.engine is not None:
            self.engine.wake()
        if self.state == "loading":
            log.info("stopped while loading")
            return
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout)

    # -- requests ---------------------------------------------------------------------------------

    def check_ready(self) -> None:
        if self.state == "loading":
            raise APIError(503, "the model is still loading", type="server_error", code="loading",
                           headers={"Retry-After": "1"})
        if self.state == "failed":
            raise APIError(503, f"not serving: {self.problem}", type="server_error", code="unavailable")

    def submit(self, requests: list[Request], listeners: list[Callable]) -> list[Handle]:
        """Queue one HTTP request's engine requests together, or none of them (429 when the queue is full)."""
        with self._submit_lock:
            running, waiting = self.engine.counts
            free = max(self.max_batch - running, 0)
            if waiting + len(requests) - free > self.max_queue:
                raise APIError(429, f"the server is at capacity ({waiting} requests waiting, --max-queue "
                                    f"{self.max_queue}); retry later", type="rate_limit_error", code="queue_full",
                               headers={"Retry-After": "1"})
            handles = [self.engine.submit(r, f) for r, f in zip(requests, listeners)]
        for r in requests:
            self.metrics.prompt_tokens.inc(len(r.prompt_ids))
        return handles

    # -- the determinism canary -------------------------------------------------------------------

    def _canary_cases(self) -> list[tuple[dict, dict | None]]:
        """The cases to re-run: those of --canary's golden file for this dtype, else the model
        manifest's golden case when it is for this dtype's bits, else a probe whose first run is the
        baseline. (native computes fp32's bits, so fp32 cases serve it too.)"""
        m = self.model
        fits = lambda d: d == m.dtype or (d == "fp32" and m.dtype == "native")  # noqa: E731
        from ..tools.golden import SETTINGS, read_golden

        keys = [k for k in SETTINGS if k != "dtype"]  # a golden case's request, as Model.request takes it
        if self.canary_file:
            data = read_golden(self.canary_file)
            if data["model_sha256"] != m.sha256:
                raise TinydetError(f"--canary {self.canary_file}: its hashes are for the model with SHA-256 "
                                   f"{data['model_sha256']}, this one is {m.sha256}")
            # a chat case (messages, tools) is a Model.chat request: the canary re-runs plain requests
            cases = [c for c in data["cases"] if fits(c.get("dtype", "fp32")) and "messages" not in c]
            if not cases:
                raise TinydetError(f"--canary {self.canary_file}: no case for dtype {m.dtype}")
            return [({k: c[k] for k in keys if k in c}, {h: c[h] for h in ("output_hash", "logits_hash")})
                    for c in cases]
        from ..registry.manifest import get_manifest, known_models

        for known in known_models():
            man = get_manifest(known)
            g = man.golden
            if man.sha256 == m.sha256 and g and fits(g.get("dtype", "fp32")):
                return [({k: g[k] for k in keys if k in g}, {h: g[h] for h in ("output_hash", "logits_hash")})]
        return [(dict(DEFAULT_PROBE), None)]

    def run_canary(self) -> bool:
        """Run every canary case through the engine (beside whatever else runs) and compare."""
        ok = True
        handles = [self.engine.submit(self.model.request(**case)) for case, _ in self._canary]
        for i, ((case, want), h) in enumerate(zip(self._canary, handles)):
            while True:  # in slices: a stop ends the engine's steps, and this request with them
                try:
                    g = h.wait(0.5)
                    break
                except TimeoutError:
                    if self._stop.is_set():
                        return ok
            got = {"output_hash": g.output_hash, "logits_hash": g.logits_hash}
            self.metrics.canary_runs.inc()
            if want is None:
                self._canary[i] = (case, got)  # the baseline for later runs
                self.log.write({"event": "canary", "result": "baseline", **got})
            elif got != want:
                ok = False
                self.mismatches += 1
                self.metrics.canary_mismatches.inc()
                log.error("DETERMINISM CANARY MISMATCH for %r: expected %s, got %s", case, want, got)
                self.log.write({"event": "canary", "result": "mismatch", "case": case, "expected": want, "got": got})
            else:
                self.log.write({"event": "canary", "result": "match", **got})
        return ok

    def _canary_loop(self) -> None:
        while not self._stop.wait(self.canary_interval):
            try:
                self.run_canary()
            except Exception:  # noqa: BLE001 - a failed canary run is logged, serving goes on
                log.exception("canary run failed")
