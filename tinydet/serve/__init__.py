"""`tinydet serve`: an OpenAI-compatible HTTP server whose answers do not depend on the load.

  protocol.py   the request bodies (pydantic) read and checked, OpenAI's error shape, JSON answers
  service.py    the model, its engine thread, the determinism canary, the structured log
  streaming.py  a request's choices on the engine thread, answered as one JSON body or as SSE
  responses.py  OpenAI's answer shapes: completions and chat completions, whole and as chunks
  app.py        the HTTP side (Starlette): the routes, auth and request checks, errors, the request log
  metrics.py    /metrics (prometheus_client)
  cluster/      `tinydet serve --ray`: gated replicas on Ray Serve, the ingress, failover, the routing table
  rollout.py    `tinydet rollout`: deploy, probe, shift traffic, retire, or roll back

Needs the `serve` extra (`pip install "tinydet[serve]"`): Starlette, uvicorn, pydantic, prometheus_client.
"""

from __future__ import annotations

import asyncio
import signal

import uvicorn


class Server(uvicorn.Server):
    """uvicorn's server with SIGTERM as a clean stop (exit status 0; uvicorn would re-raise it after
    shutdown), and `end_running(message)` (the app's: a 503 that says why) called a moment before the
    grace for running requests (`timeout_graceful_shutdown`) runs out, so that they end with that
    error rather than with a connection cut mid-answer."""

    def __init__(self, config: uvicorn.Config, end_running=None, on_bound=None):
        super().__init__(config)
        self.end_running, self.on_bound = end_running, on_bound

    def handle_exit(self, sig, frame):
        if sig == signal.SIGTERM:
            self.should_exit = True
            return
        super().handle_exit(sig, frame)

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.on_bound is not None and self.servers:
            self.on_bound(self.servers[0].sockets[0].getsockname()[1])

    async def shutdown(self, sockets=None):
        grace, timer = self.config.timeout_graceful_shutdown, None
        if grace is not None and self.end_running is not None:  # a moment early, so the errors reach clients
            message = (f"the server is shutting down, and this request did not finish in the {grace:g} s that "
                       "running requests are given (tinydet serve --shutdown-timeout)")
            timer = asyncio.get_running_loop().call_later(grace - min(1.0, grace / 2), self.end_running, message)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()


def run(service, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout: float = 30.0,
        on_bound=None) -> None:
    """Serve until SIGTERM or Ctrl-C. SIGTERM stops accepting connections, lets running requests
    finish (up to `shutdown_timeout` seconds; those still running then get a 503), stops the engine
    and returns (exit status 0)."""
    from .app import create_app

    app = create_app(service)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=shutdown_timeout, lifespan="on")
    Server(config, app.state.end_running, on_bound).run()
