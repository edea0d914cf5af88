"""The HTTP server over an AsyncEngine (FastAPI), assembled from its parts.

Routes never touch the LLMEngine directly: requests go through AsyncEngine.submit (its
thread tokenizes, checks the context and adds them) and come back as a RequestStream.
Streaming responses close their stream when the client goes away (Starlette cancels the
body on disconnect), which aborts the requests at once; non-streaming ones race the
generation against the client's disconnect (sse.py).

    guards.py            413 / 401 / 404 / 503 before a request runs; every error in OpenAI's shape
                         (Anthropic's on /v1/messages)
    openai/              /v1/models, /v1/completions, /v1/chat/completions
    responses/           /v1/responses (OpenAI's Responses API, on the chat path; kept in a bounded
                         ResponseStore)
    anthropic/           /v1/messages, /v1/messages/count_tokens (Anthropic's Messages API, on the chat path)
    tokenizer_routes.py  /tokenize, /detokenize, /tokenizer_info
    dashboard_routes.py  /dashboard (the page) and /dashboard/events (its live feed, dashboard_feed.py)
    here                 /health, /metrics, /openapi.json
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from phasewise import __version__
from phasewise.json_types import JsonObject
from phasewise.server.anthropic.routes import anthropic_router
from phasewise.server.async_engine import AsyncEngine
from phasewise.server.config import ServerConfig
from phasewise.server.dashboard_feed import DashboardFeed, Roofline
from phasewise.server.dashboard_routes import dashboard_router
from phasewise.server.guards import BodyLimit, Guards, install_error_handlers
from phasewise.server.metrics import ServerMetrics
from phasewise.server.observer import Observers
from phasewise.server.openai.routes import openai_router
from phasewise.server.openai.protocol import openapi_schemas
from phasewise.server.responses.store import ResponseStore
from phasewise.server.responses.routes import responses_router
from phasewise.server.tokenizer_routes import tokenizer_router



def create_app(engine: AsyncEngine, config: ServerConfig, roofline: Roofline | None = None) -> FastAPI:
    """`roofline`: the machine's roofs and the model's costs, for the dashboard's 'what binds now'.
    `app.state.stopping` (a function, set by whoever runs the server) ends the dashboard's streams."""
    app = _App(title="phasewise", version=__version__, docs_url=None, redoc_url=None)   # /openapi.json
    app.state.engine, app.state.config = engine, config
    app.state.stopping = lambda: False
    app.state.metrics = metrics = ServerMetrics(config.served_model_name)
    app.state.feed = feed = DashboardFeed(token_budget=engine.token_budget, max_num_seqs=engine.max_num_seqs,
                                          num_blocks=engine.num_blocks, roofline=roofline)
    engine.observer = Observers(metrics, feed)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    install_error_handlers(app)
    guards = Guards(engine, config)
    app.include_router(openai_router(guards))
    app.include_router(responses_router(guards, ResponseStore()))
    app.include_router(anthropic_router(guards))
    app.include_router(tokenizer_router(guards))
    app.include_router(dashboard_router(guards, feed))

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(engine.stats), media_type=metrics.content_type)

    return app


class _App(FastAPI):
    """FastAPI with the request bodies in /openapi.json (the routes parse their bodies themselves)."""

    def openapi(self) -> JsonObject:
        """FastAPI's schema of the routes, with the request bodies' schemas as components (built once)."""
        if self.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=self.title, version=self.version, routes=self.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(openapi_schemas())
            self.openapi_schema = schema
        return self.openapi_schema
