"""Relaying one request to the replicas of a backend, with failover: when the replica dies under it, the
request goes again to another, and the client gets only the bytes past those it already has (checked
equal on the overlap). The ingress fixes the answer's id, time and seed before the first try
(`pinned_call`), so every try gives the same bytes.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
import uuid
from dataclasses import dataclass

from ray import serve
from ray.exceptions import RayActorError

from ..protocol import APIError
from .replica import REPLICA

log = logging.getLogger("tinydet.serve.cluster")

ATTEMPTS = 8  # tries of one request across replicas before a 503


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
