"""What refuses a request before it runs, and the shape every refusal takes.

`BodyLimit` answers 413 before the app reads an oversized body; `Guards` checks the API
key (401), the model name (404) and the waiting room (503 with Retry-After); the error
handlers turn every exception into OpenAI's error JSON (400 rather than FastAPI's 422,
500 with one line and no traceback), or Anthropic's on the Messages API's paths.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from phasewise.server.anthropic import protocol as anthropic
from phasewise.server.async_engine import AsyncEngine
from phasewise.server.config import ServerConfig
from phasewise.server.body_parsing import validation_message
from phasewise.server.api_error import APIError, error_body

log = logging.getLogger("phasewise.server")


@dataclass(frozen=True)
class Guards:
    engine: AsyncEngine
    config: ServerConfig

    def require_key(self, request: Request) -> None:
        """A FastAPI dependency: with --api-key set, 'Authorization: Bearer <key>' (OpenAI's) or
        'x-api-key: <key>' (Anthropic's) with one of its keys, or 401. With several keys, each is a tenant:
        its requests' cache salt is the key's (`tenant`)."""
        keys = self.config.api_keys
        if not keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = [token] if scheme.lower() == "bearer" else []
        given += request.headers.getlist("x-api-key")
        matched = [k for k in keys
                   if any(secrets.compare_digest(t.strip().encode(), k.encode()) for t in given)]
        if not matched:
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>' or "
                                "'x-api-key: <key>'",
                           param=None, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if len(keys) > 1:
            request.state.cache_tenant = tenant_salt(matched[0])

    @staticmethod
    def tenant(request: Request) -> str | None:
        """The cache salt of the key this request came with, when the server has several (else None)."""
        salt = getattr(request.state, "cache_tenant", None)
        return salt if isinstance(salt, str) else None

    def check_model(self, name: str | None) -> None:
        config = self.config
        if name is not None and name != config.served_model_name and name not in config.model_aliases:
            raise APIError(404, f"the model '{name}' does not exist (this server serves "
                                f"'{config.served_model_name}')", param="model", code="model_not_found")

    def admit(self, n: int) -> None:
        """Refuse n more sub-requests if they would make more than --max-waiting wait (a request
        bigger than that is let in when the engine is idle, or it could never run)."""
        engine, limit = self.engine, self.config.max_waiting
        if not engine.is_alive:
            raise APIError(503, "the engine has stopped", type="server_error", code="engine_dead")
        queued = engine.num_queued
        if engine.queued_after(n) > limit and not engine.is_idle:
            raise APIError(503, f"the server is overloaded: {queued} requests are waiting "
                                f"(--max-waiting {limit}); retry later",
                           type="server_error", code="overloaded", headers={"Retry-After": "1"})


def tenant_salt(key: str) -> str:
    """The cache salt of an API key's requests: a digest of the key (the same in every process and replica,
    so its blocks on disk outlive a restart), never the key itself."""
    return "tenant-" + hashlib.sha256(b"phasewise cache tenant\0" + key.encode()).hexdigest()[:32]


class BodyLimit:
    """ASGI middleware: a body over the limit is answered 413 before the app sees the request."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large(scope, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":     # the client left before sending its body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._too_large(scope, send)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()                     # then: the disconnect, when it comes

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, send: Send) -> None:
        message = f"the request body is larger than {self.max_bytes} bytes"
        body = json.dumps(anthropic.error_body(413, message)
                          if anthropic.is_messages_path(scope.get("path", ""))
                          else error_body(message, code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _error(request: Request, exc: APIError) -> JSONResponse:
    """exc in OpenAI's shape, or in Anthropic's on the Messages API's paths."""
    body = (anthropic.error_body(exc.status, exc.message, exc.param)
            if anthropic.is_messages_path(request.url.path)
            else exc.body())
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        error = APIError(exc.status_code, message, kind, headers=getattr(exc, "headers", None))
        return _error(request, error)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        return _error(request, APIError(400, message, param=param))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return _error(request, APIError(500, f"internal server error: {first}", "server_error"))
