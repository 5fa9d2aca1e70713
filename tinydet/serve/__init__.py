"""`tinydet serve`: an OpenAI-compatible HTTP server whose answers do not depend on the load.

  protocol.py  the request bodies (pydantic) and OpenAI's error shape
  service.py   the model, its engine thread, the determinism canary, the structured log
  app.py       the HTTP side (Starlette): endpoints, streaming, auth, errors
  metrics.py   /metrics (prometheus_client)

Needs the `serve` extra (`pip install "tinydet[serve]"`): Starlette, uvicorn, pydantic, prometheus_client.
"""

from __future__ import annotations

import signal


def run(service, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout: float = 30.0,
        on_bound=None) -> None:
    """Serve until SIGTERM or Ctrl-C. SIGTERM stops accepting connections, lets running requests
    finish (up to `shutdown_timeout` seconds), stops the engine and returns (exit status 0)."""
    import uvicorn

    from .app import create_app

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if sig == signal.SIGTERM:  # a clean stop, not re-raised after shutdown as uvicorn would
                self.should_exit = True
                return
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if on_bound is not None and self.servers:
                on_bound(self.servers[0].sockets[0].getsockname()[1])

    config = uvicorn.Config(create_app(service), host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=shutdown_timeout, lifespan="on")
    _Server(config).run()
