"""The routing table (each backend's application, fingerprint and traffic weight): a detached actor
(`Routes`) that the ingress watches, so that `tinydet rollout` can change it from another process and
it outlives an ingress restart; reading it and changing it.
"""

from __future__ import annotations

import time

from ray import serve

INGRESS_APP = "tinydet"  # the Serve application of the ingress; backends are "tinydet-b1", "tinydet-b2", ...
ROUTES = "tinydet-routes"  # the detached actor holding the routing table


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


def backend_entry(app: str, info: dict, weight: float) -> dict:
    return {"app": app, "fingerprint": info["fingerprint"], "weight": weight}
