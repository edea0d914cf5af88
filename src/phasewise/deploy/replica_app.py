"""What an engine replica serves over HTTP, and /metrics gathered from every replica.

`ReplicaApp` wraps the FastAPI app of `phasewise serve` (the whole OpenAI surface, unchanged): each
response names the replica that gave it (`x-phasewise-replica`, its Serve replica id) and, when HAProxy's
router pinned the request to it (direct ingress; `route.RouteIngress` has HAProxy set the request header),
says so (`x-phasewise-pinned: haproxy`; absent when Serve's proxy carried the request), and GET /metrics,
when the replica is the application's ingress, answers for the whole deployment: each replica's text,
labelled, and their sums (`replica_metrics.merge_metrics`). `gather_metrics` visits the replicas one by
one through a DeploymentHandle: each visit names the replicas already asked and `PrefixAffinityRouter`
picks one not among them, until none is left.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable, TypeAlias

from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle

from phasewise.deploy.replica_metrics import merge_metrics

if TYPE_CHECKING:
    # ASGI's: scopes and messages are dicts
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

# A handle to the engine replicas' deployment: ray.py's EngineReplica, not named here (ray.py imports
# this module)
ReplicaHandle: TypeAlias = DeploymentHandle[object]

REPLICA_HEADER = "x-phasewise-replica"       # which replica served a response: its Serve replica id
PINNED_HEADER = "x-phasewise-pinned"         # "haproxy": HAProxy's router pinned the request to this replica
MAX_REPLICAS = 256                           # /metrics asks at most this many replicas
METRICS_TIMEOUT_S = 10.0                     # ... each within this
PROMETHEUS_TEXT = b"text/plain; version=0.0.4; charset=utf-8"
log = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class MetricsVisit:
    """A call of `EngineReplica.metrics_text` in a visit of every replica: the router picks one not in `skip`
    while there is one."""
    skip: frozenset[str]
    block_hashes: tuple[bytes, ...] = ()


class ReplicaApp:
    """See the module's docstring. `gather`: the whole deployment's /metrics text (None: this replica's
    own)."""

    def __init__(self, app: ASGIApp, replica_id: str,
                 gather: Callable[[], Awaitable[str]] | None = None) -> None:
        self._app, self._replica, self._gather = app, replica_id.encode(), gather

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        if self._gather is not None and scope["method"] == "GET" and scope["path"] == "/metrics":
            await send_metrics(send, await self._gather(), (REPLICA_HEADER.encode(), self._replica))
            return

        named_by = [(REPLICA_HEADER.encode(), self._replica)]
        named_by += [(k, v) for k, v in scope.get("headers", ()) if k.lower() == PINNED_HEADER.encode()][:1]

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *named_by]}
            await send(message)

        await self._app(scope, receive, named)


async def send_metrics(send: Send, text: str, *headers: tuple[bytes, bytes]) -> None:
    """A gathered /metrics text as the response (503 when no replica answered)."""
    await send({"type": "http.response.start", "status": 200 if text else 503,
                "headers": [(b"content-type", PROMETHEUS_TEXT), *headers]})
    await send({"type": "http.response.body", "body": text.encode()})


async def own_metrics(app: ASGIApp) -> str:
    """The app's own GET /metrics text."""
    chunks: list[bytes] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app({"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
               "scheme": "http", "path": "/metrics", "raw_path": b"/metrics", "root_path": "",
               "query_string": b"", "headers": [], "client": None, "server": None}, receive, send)
    return b"".join(chunks).decode(errors="replace")


async def gather_metrics(*handles: ReplicaHandle | None) -> str:
    """Every replica's /metrics (`EngineReplica.metrics_text`) of these deployments, as one text; "" when
    none answered."""
    texts: dict[str, str] = {}
    for handle in handles:
        if handle is None:
            continue
        handle = handle.options(stream=False)
        seen: set[str] = set()
        for _ in range(MAX_REPLICAS):
            try:
                visit = MetricsVisit(frozenset(seen))
                replica, text = await asyncio.wait_for(handle.metrics_text.remote(visit), METRICS_TIMEOUT_S)
            except RayActorError:               # Serve forgets that replica: ask the next
                continue
            except asyncio.TimeoutError:
                log.warning("a replica did not answer /metrics within %.0f s", METRICS_TIMEOUT_S)
                break
            if replica in seen:
                break
            seen.add(replica)
            texts[replica] = text
    return merge_metrics(texts) if texts else ""
