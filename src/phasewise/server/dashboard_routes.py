"""/dashboard: the page (static files shipped in the package) and its live feed (server-sent events).

The page and its scripts carry no data and load without a key; the feed,
/dashboard/events, follows the API's key rule (401 without 'Authorization: Bearer
<key>' when --api-key is set). The page reads it with fetch() rather than
EventSource, which cannot send that header. Each event is one JSON snapshot
(dashboard_feed.py), every `every` seconds (the page's refresh choice, 0.5 to 60;
`interval` unless given), carrying what is new since the last; the stream ends when
the client leaves or the server shuts down.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from importlib import resources

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from phasewise import __version__
from phasewise.server.dashboard_feed import DashboardFeed
from phasewise.server.guards import Guards
from phasewise.server.api_error import APIError

STATIC = resources.files("phasewise.server") / "dashboard"
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}


def _static(name: str) -> Response:
    suffix = "." + name.rsplit(".", 1)[-1] if "." in name else ""
    item = STATIC / name
    if "/" in name or suffix not in TYPES or not item.is_file():
        raise APIError(404, f"GET /dashboard/{name}: no such file", param=None, type="not_found_error")
    return Response(item.read_bytes(), media_type=TYPES[suffix], headers={"Cache-Control": "no-cache"})


def dashboard_router(guards: Guards, feed: DashboardFeed, interval: float = 1.0) -> APIRouter:
    router = APIRouter()
    engine, config = guards.engine, guards.config

    @router.get("/dashboard", include_in_schema=False)
    async def page() -> Response:
        return _static("index.html")

    @router.get("/dashboard/events", dependencies=[Depends(guards.require_key)], include_in_schema=False)
    async def events(request: Request, after: int = 0, every: float | None = None) -> StreamingResponse:
        stopping = request.app.state.stopping
        period = interval if every is None else every
        if not 0.5 <= period <= 60:
            raise APIError(400, f"every must be between 0.5 and 60 seconds, got {period}", param="every")

        async def stream() -> AsyncIterator[str]:
            cursor = max(0, after)
            hello = {"model": config.served_model_name, "version": __version__, "interval_s": period}
            yield f"event: hello\ndata: {json.dumps(hello)}\n\n"
            while engine.is_alive and not stopping():
                snap = feed.snapshot(cursor, engine.stats)
                cursor = snap["seq"]
                yield f"data: {json.dumps(snap, separators=(',', ':'))}\n\n"
                await asyncio.sleep(period)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @router.get("/dashboard/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        return _static(name)

    return router
