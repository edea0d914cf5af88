"""`RouteIngress`: which engine replica serves a request, asked by Ray Serve's HAProxy ingress.

With direct ingress (Ray Serve's HAProxy mode, `--ray-ingress direct`), HAProxy receives each HTTP request,
POSTs its body to this deployment's `/internal/route`, and forwards the request itself to the HTTP port of
the replica named in the answer (with a request header saying so, `replica_app.PINNED_HEADER`, which the
replica echoes): the response streams from the replica through HAProxy alone, with no
Python process and no Ray call in between. Here the body's prompt is hashed into blocks and Serve's router
of the engine deployment (`PrefixAffinityRouter`, through `DeploymentHandle.choose_replica` without a slot
reservation) picks the replica. The answer is `{"host", "port", "replica_id", "request_headers"}`, the
contract of Ray's HAProxy Lua action (Ray 2.60's `ingress_request_router.lua.tmpl`; Ray Serve LLM's direct
streaming uses the same hook, `Application._with_ingress_request_router`, which Ray marks internal: the Ray
pin keeps it).
"""

import json             # no `from __future__ import annotations`: FastAPI reads the handlers' annotations

from fastapi import FastAPI, HTTPException, Request
from ray import serve
from ray.serve.exceptions import DeploymentUnavailableError

from phasewise.deploy.prefix_router import RoutePick, prompt_block_hashes
from phasewise.deploy.replica_app import PINNED_HEADER, ReplicaHandle
from phasewise.json_types import JsonObject

route_app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)


@serve.ingress(route_app)
class RouteIngress:
    """See the module's docstring. `engine`: the engine deployment, which must be the application's
    ingress."""

    def __init__(self, engine: ReplicaHandle) -> None:
        self._engine = engine
        self._engine._init()

    @route_app.post("/internal/route")
    async def route(self, request: Request) -> JsonObject:
        body = await request.body()
        try:
            parsed = json.loads(body) if body else None
        except ValueError:                   # a body cut by HAProxy's buffer, or not JSON: no prefix
                                             # to follow
            parsed = None
        try:
            async with self._engine.choose_replica(RoutePick(prompt_block_hashes(parsed)),
                                                   _reserve=False) as chosen:
                replica = chosen._replica
                endpoint = replica.backend_http_endpoint
                if endpoint is None:
                    raise RuntimeError(f"replica {chosen.replica_id} has no HTTP port yet")
                return {"host": endpoint[0], "port": endpoint[1],
                        "replica_id": replica.replica_id.to_full_id_str(),
                        "request_headers": {PINNED_HEADER: "haproxy"}}
        except (RuntimeError, DeploymentUnavailableError) as e:
            raise HTTPException(status_code=503, detail=str(e)) from None

    @route_app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}
