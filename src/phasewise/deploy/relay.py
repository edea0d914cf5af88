"""The ingress's ASGI app (`Relay`): each HTTP request to an engine replica through a streaming
DeploymentHandle, its response back as it comes.

It reads the whole body first (Serve's proxy routes before reading one, so a router behind the proxy would
see no prompt), hashes the prompt's blocks for `PrefixAffinityRouter`, and relays the replica's ASGI
messages. A request whose replica died before answering anything (an unstreamed one: before its whole
answer; a streamed one: before its response began) is sent again, up to `RETRIES` times, to a live
replica: each request names the replicas it must not go to (`RelayedRequest.avoid`: every replica this
relay saw die, ActorDiedError, in the last `DEAD_FOR_S`, which Serve may still list as running; not one
merely unreachable), and `PrefixAffinityRouter` leaves them out, waiting for Serve's replacement when
none is left. A stream
that has begun is never restarted (its tokens would be sent twice): a replica that dies mid-stream ends it
with an error event (`data: {"error": ...}`, then `[DONE]`), and a cut JSON body is cut. GET /metrics
answers for every replica, labelled, and in sum (`replica_app.gather_metrics`).

With a prefill deployment (`--prefill-decode`), a completion or chat request goes first to a prefill replica
as the disaggregation proxy sends it (`server.proxy.pair_bodies`: one token, unstreamed, tagged with a
transfer id), then, once its KV blocks are on their way over the pair's KV link, to a decode replica
with the same tag; an error from the prefill replica is the answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ray.exceptions import ActorDiedError, RayActorError
from ray.serve.handle import DeploymentResponseGenerator

from phasewise.deploy.prefix_router import prompt_block_hashes
from phasewise.deploy.replica_app import REPLICA_HEADER, ReplicaHandle, gather_metrics, send_metrics

if TYPE_CHECKING:
    # ASGI's: a scope and its messages are plain dicts
    from starlette.types import Message, Receive, Scope, Send

    from phasewise.json_types import JsonValue

RETRIES = 3                                  # a request whose replica died before it answered: sent again
# a replica seen dying is avoided this long (Serve drops it sooner)
DEAD_FOR_S = 120.0
PAIR_PATHS = ("/v1/completions", "/v1/chat/completions")
SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "query_string",
              "headers", "client", "server")
log = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class RelayedRequest:
    """One HTTP request, from the ingress to an engine replica: the ASGI scope's plain fields, the whole body,
    the prompt's block hashes (the router's key), and the replicas not to send it to (their actor ids,
    hex)."""
    scope: Scope
    body: bytes
    block_hashes: tuple[bytes, ...]
    avoid: frozenset[str] = frozenset()


class Relay:
    """See the module's docstring. `prefill`: the prefill replicas of a disaggregated deployment, whose
    `engine` replicas are then its decode replicas."""

    def __init__(self, engine: ReplicaHandle,
                 prefill: ReplicaHandle | None = None) -> None:
        self._engine = engine.options(stream=True)
        self._prefill = prefill.options(stream=True) if prefill is not None else None
        self._dead: dict[str, float] = {}            # actor id (hex) of a replica seen dying → when

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        body = await _read_body(receive)
        fields: Scope = {k: scope[k] for k in SCOPE_KEYS if k in scope}
        if scope["method"] == "GET" and scope["path"] == "/metrics":
            await send_metrics(send, await gather_metrics(self._engine, self._prefill))
            return
        parsed = _json(body)
        hashes = prompt_block_hashes(parsed)
        if self._prefill is not None and scope["method"] == "POST" and scope["path"] in PAIR_PATHS \
                and isinstance(parsed, dict):
            from phasewise.server.proxy import pair_bodies

            first, second = pair_bodies(scope["path"], parsed)
            if first is not None:
                prefill = json.dumps(first).encode()
                try:
                    _, status, answer = await self._collect(
                        self._prefill, RelayedRequest(_with_length(fields, len(prefill)), prefill, hashes))
                except Exception as e:          # noqa: BLE001 (the client gets an error, never a hang)
                    failed = f"the prefill replica failed ({type(e).__name__})"
                    await _send_failure(send, failed, False, False)
                    return
                if status != 200:
                    await send({"type": "http.response.start", "status": status,
                                "headers": [(b"content-type", b"application/json")]})
                    await send({"type": "http.response.body", "body": answer})
                    return
                body = json.dumps(second).encode()
                fields = _with_length(fields, len(body))
        await self._relay(RelayedRequest(fields, body, hashes), send)

    async def _relay(self, request: RelayedRequest, send: Send) -> None:
        started = event_stream = False
        for attempt in range(RETRIES + 1):
            request = replace(request, avoid=request.avoid | self._recently_dead())
            try:
                async for messages in _stream(self._engine, request):
                    for m in messages:
                        if m["type"] == "http.response.start":
                            started = True
                            event_stream = any(k.lower() == b"content-type"
                                               and v.startswith(b"text/event-stream")
                                               for k, v in m.get("headers", ()))
                        await send(m)
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:           # the replica died or failed: the client sees an error, no hang
                # not a replica merely unreachable
                died = e.actor_id if isinstance(e, ActorDiedError) else None
                if died:
                    self._dead[died] = time.monotonic()
                    request = replace(request, avoid=request.avoid | {died})
                if not started and attempt < RETRIES and isinstance(e, RayActorError):
                    log.warning("a replica died before answering a request: sending it to another (%s)",
                                type(e).__name__)
                    continue
                await _send_failure(send, f"the replica serving this request failed ({type(e).__name__})",
                                    started, event_stream)
                return

    def _recently_dead(self) -> frozenset[str]:
        """The replicas seen dying within DEAD_FOR_S (older ones forgotten)."""
        now = time.monotonic()
        for actor in [a for a, when in self._dead.items() if now - when > DEAD_FOR_S]:
            del self._dead[actor]
        return frozenset(self._dead)

    @staticmethod
    async def _collect(handle: ReplicaHandle, request: RelayedRequest) -> tuple[str, int, bytes]:
        """One whole (unstreamed) response: (the replica that gave it, status, body)."""
        replica, status, chunks = "", 500, []
        async for messages in _stream(handle, request):
            for m in messages:
                if m["type"] == "http.response.start":
                    status = m["status"]
                    replica = next((v.decode() for k, v in m.get("headers", ())
                                    if k.decode().lower() == REPLICA_HEADER), "")
                elif m["type"] == "http.response.body":
                    chunks.append(m.get("body", b""))
        return replica, status, b"".join(chunks)


def _stream(handle: ReplicaHandle, request: RelayedRequest
            ) -> DeploymentResponseGenerator[list[Message]]:
    """A replica's `handle` on `request`: its ASGI messages, a batch at a time (the relay's handles
    stream)."""
    response = handle.handle.remote(request)
    if not isinstance(response, DeploymentResponseGenerator):
        raise TypeError("the relay calls replicas through streaming handles (options(stream=True))")
    return response


def _with_length(scope: Scope, length: int) -> Scope:
    """The scope with its content-length header saying `length` (a body the relay rewrote)."""
    headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() != b"content-length"]
    return {**scope, "headers": [*headers, (b"content-length", str(length).encode())]}


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(chunks)


def _json(body: bytes) -> JsonValue:
    try:
        return json.loads(body) if body else None
    except ValueError:
        return None


async def _send_failure(send: Send, message: str, started: bool, event_stream: bool) -> None:
    from phasewise.server.api_error import error_body

    error = json.dumps(error_body(message, "server_error", code="replica_failed")).encode()
    if not started:
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1")]})
        await send({"type": "http.response.body", "body": error})
    elif event_stream:
        await send({"type": "http.response.body", "body": b"data: " + error + b"\n\ndata: [DONE]\n\n"})
    else:                                    # a JSON body cut short: the client's parser fails on it
        await send({"type": "http.response.body", "body": b""})
