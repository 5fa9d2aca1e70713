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

  replica.py   Replica and its gate (GateFailed)
  failover.py  relaying a request to a backend's replicas, again elsewhere when one dies (relay)
  routing.py   the routing table: the Routes actor, set_table, current_table
  ingress.py   Ingress: routing by fingerprint or weight, /health and /metrics of the deployment
  deploy.py    deploying backends and the ingress, joining Ray, `tinydet serve --ray` (run)

Its names are used from here: `cluster.deploy_backend`, `cluster.Replica`, ...
"""

from __future__ import annotations

from .deploy import (HEALTH_PERIOD_S, backend_info, connect, deploy_backend, deploy_ingress, remove_all, run, running,
                     spec)
from .failover import ATTEMPTS, Backend, Diverged, pinned_call, relay
from .ingress import Ingress, _name  # noqa: F401 - rollout.py uses cluster._name
from .replica import METRICS_PERIOD_S, REPLICA, GateFailed, Replica
from .routing import INGRESS_APP, ROUTES, Routes, backend_entry, current_table, set_table

__all__ = ["ATTEMPTS", "HEALTH_PERIOD_S", "INGRESS_APP", "METRICS_PERIOD_S", "REPLICA", "ROUTES", "Backend", "Diverged",
           "GateFailed", "Ingress", "Replica", "Routes", "backend_entry", "backend_info", "connect", "current_table",
           "deploy_backend", "deploy_ingress", "pinned_call", "relay", "remove_all", "run", "running", "set_table",
           "spec"]

# The classes keep the name they had when this package was one module, tinydet.serve.cluster.X: Ray
# pickles Replica, Ingress and Routes by that name into their replicas and actor (where a replica of
# another tinydet version, `tinydet rollout --runtime-env`, finds them by it too), and Ray's messages
# and `serve status` name GateFailed by it.
for _cls in (Backend, Diverged, GateFailed, Ingress, Replica, Routes):
    _cls.__module__ = __name__
del _cls
