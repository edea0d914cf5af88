"""The OpenAI-compatible HTTP API over an AsyncEngine (FastAPI).

Routes never touch the LLMEngine directly: requests go through AsyncEngine.submit
(its thread tokenizes, checks the context and adds them) and come back as a
RequestStream. Streaming responses close their stream when the client goes away
(Starlette cancels the body on disconnect), which aborts the requests at once;
non-streaming ones race the generation against the client's disconnect.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from phasewise import __version__
from phasewise.outputs import CompletionOutput
from phasewise.server import responses as R
from phasewise.server.async_engine import AsyncEngine, SubRequest
from phasewise.server.request_stream import RequestStream
from phasewise.server.errors import ContextLengthError, EngineDeadError, EngineError, RequestError
from phasewise.server.metrics import ServerMetrics
from phasewise.server.protocol import (
    APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, bad_request,
    choice_params, error_body, openapi_body, openapi_schemas, parse_body, validation_message)

log = logging.getLogger("phasewise.server")


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    served_model_name: str
    model_aliases: tuple[str, ...] = ()       # other names a request may use (the model path as given)
    api_key: str | None = None
    max_waiting: int = 1024                   # queued sub-requests past which new ones get 503
    max_body_bytes: int = 4 * 1024 * 1024
    model_root: str = ""
    created: int = field(default_factory=lambda: int(time.time()))


class BodyLimit:
    """ASGI middleware: a body over the limit is answered 413 before the app sees the request."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large(send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":     # the client left before sending its body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._too_large(send)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()                     # then: the disconnect, when it comes

        await self.app(scope, replay, send)

    async def _too_large(self, send: Any) -> None:
        body = json.dumps(error_body(f"the request body is larger than {self.max_bytes} bytes",
                                     code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def create_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="phasewise", version=__version__, docs_url=None, redoc_url=None)   # /openapi.json
    app.openapi = lambda: _openapi(app)
    app.state.engine, app.state.config = engine, config
    app.state.metrics = metrics = ServerMetrics(config.served_model_name)
    engine.observer = metrics
    token_text = R.TokenText(engine.tokenizer)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    _install_error_handlers(app)

    def require_key(request: Request) -> None:
        if config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           param=None, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def check_model(name: str | None) -> None:
        if name is not None and name != config.served_model_name and name not in config.model_aliases:
            raise APIError(404, f"the model '{name}' does not exist (this server serves "
                                f"'{config.served_model_name}')", param="model", code="model_not_found")

    def admit(n: int) -> None:
        """Refuse n more sub-requests if they would make more than --max-waiting wait (a request
        bigger than that is let in when the engine is idle, or it could never run)."""
        if not engine.is_alive:
            raise APIError(503, "the engine has stopped", type="server_error", code="engine_dead")
        queued = engine.num_queued
        if engine.queued_after(n) > config.max_waiting and not engine.is_idle:
            raise APIError(503, f"the server is overloaded: {queued} requests are waiting "
                                f"(--max-waiting {config.max_waiting}); retry later",
                           type="server_error", code="overloaded", headers={"Retry-After": "1"})

    async def start(items: list[SubRequest], chat: bool) -> RequestStream:
        admit(len(items))
        try:
            return await engine.submit(items, chat)
        except RequestError as e:
            param = "messages" if e.param == "prompt" and chat else e.param
            if isinstance(e, ContextLengthError):
                raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
            raise bad_request(str(e), param) from None
        except ValueError as e:
            raise bad_request(str(e)) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), type="server_error", code="engine_dead") from None

    async def respond(request: Request, body: Any, rid: str, items: list[SubRequest], chat: bool,
                      events: Callable, final: Callable) -> Response:
        """The flow completions and chat share: start the sub-requests, then stream `events` (SSE) or
        collect every output into `final`'s body (499 when the client left first)."""
        stream = await start(items, chat)
        created, model = int(time.time()), body.model or config.served_model_name
        want_lp = items[0].params.logprobs is not None
        if body.stream:
            return _sse(events(stream, rid, created, model, want_lp=want_lp, include_usage=body.include_usage),
                        stream)
        outs = await _collect(request, stream)
        if outs is None:
            return Response(status_code=499)
        return JSONResponse(final(rid, created, model, outs, want_lp))

    keyed = [Depends(require_key)]

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(engine.stats), media_type=metrics.content_type)

    def model_card() -> dict:
        return {"id": config.served_model_name, "object": "model", "created": config.created, "owned_by": "phasewise",
                "root": config.model_root, "parent": None, "max_model_len": engine.max_model_len}

    @app.get("/v1/models", dependencies=keyed)
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=keyed)
    async def model(model_id: str) -> dict:
        check_model(model_id)                   # 404 in OpenAI's shape for another name
        return model_card()

    @app.post("/tokenize", dependencies=keyed, openapi_extra=openapi_body(TokenizeRequest))
    async def tokenize(request: Request) -> dict:
        body = parse_body(await request.body(), TokenizeRequest)
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give either prompt or messages")
        if body.messages is not None:
            messages = [m.as_dict() for m in body.messages]
            fn = lambda e: e.tokenizer.apply_chat_template(messages)    # noqa: E731
        else:
            text, special = body.prompt, body.add_special_tokens
            fn = lambda e: e.tokenizer.encode(text, add_special_tokens=special)    # noqa: E731
        try:
            ids = await engine.call(fn)
        except ValueError as e:
            raise bad_request(str(e)) from None
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.get("/tokenizer_info", dependencies=keyed)
    async def tokenizer_info() -> dict:
        """What a client needs to tokenize as the server does (vLLM's route; lm-evaluation-harness's
        `tokenizer_backend=remote` reads it, then uses /tokenize and /detokenize)."""
        hf = engine.tokenizer.hf
        return {"tokenizer_class": type(hf).__name__, "eos_token": hf.eos_token, "bos_token": hf.bos_token,
                "pad_token": hf.pad_token, "unk_token": hf.unk_token, "chat_template": hf.chat_template,
                "model_max_length": engine.max_model_len, "vocab_size": engine.model_config.vocab_size}

    @app.post("/detokenize", dependencies=keyed, openapi_extra=openapi_body(DetokenizeRequest))
    async def detokenize(request: Request) -> dict:
        body = parse_body(await request.body(), DetokenizeRequest)
        check_model(body.model)
        vocab = engine.model_config.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is out of range: the vocabulary has {vocab} tokens", "tokens")
        tokens = body.tokens
        return {"prompt": await engine.call(lambda e: e.tokenizer.decode(tokens))}

    @app.post("/v1/completions", dependencies=keyed, openapi_extra=openapi_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        body = parse_body(await request.body(), CompletionRequest)
        check_model(body.model)
        params = body.sampling_params()
        prompts, n = body.prompts(), body.n
        rid = f"cmpl-{uuid.uuid4().hex}"
        items = [SubRequest(_sub_id(rid, p * n + j, len(prompts) * n), prompts[p], choice_params(params, j))
                 for p in range(len(prompts)) for j in range(n)]
        return await respond(request, body, rid, items, False,
                             partial(_completion_events, n=n, tt=token_text, echo=body.echo),
                             partial(R.completion_body, n=n, tt=token_text, echo=body.echo))

    @app.post("/v1/chat/completions", dependencies=keyed, openapi_extra=openapi_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        body = parse_body(await request.body(), ChatCompletionRequest)
        check_model(body.model)
        params = body.sampling_params()
        messages = body.conversation()
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        items = [SubRequest(_sub_id(rid, j, body.n), messages, choice_params(params, j)) for j in range(body.n)]
        return await respond(request, body, rid, items, True, partial(_chat_events, n=body.n, tt=token_text),
                             partial(R.chat_body, tt=token_text))

    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema of the routes, with the request bodies' schemas as components (built once)."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schema.setdefault("components", {}).setdefault("schemas", {}).update(openapi_schemas())
        app.openapi_schema = schema
    return app.openapi_schema


def _sub_id(rid: str, i: int, total: int) -> str:
    return rid if total == 1 else f"{rid}-{i}"


async def _collect(request: Request, stream: RequestStream) -> list[CompletionOutput] | None:
    """The final outputs in submission order, or None when the client disconnected first (then aborted)."""
    async def run() -> list[CompletionOutput]:
        finals = {}
        async for delta in stream:
            if delta.finished:
                finals[delta.request_id] = delta.output
        return [finals[rid] for rid in stream.request_ids]

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(run()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        gone = not work.done()
        if gone:
            work.cancel()
        stream.close()
    if gone:
        return None
    try:
        return work.result()
    except EngineError as e:
        raise APIError(500, str(e), type="server_error", code="engine_error") from None


def _sse(gen: AsyncIterator[str], stream: RequestStream) -> StreamingResponse:
    # background: closes the stream even when the body never started (client gone at once)
    return StreamingResponse(gen, media_type="text/event-stream", background=BackgroundTask(stream.close),
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _event(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _events(stream: RequestStream, make_choice: Any, head: list[dict], rid: str, obj: str, created: int,
                  model: str, n: int, include_usage: bool) -> AsyncIterator[str]:
    """Shared SSE loop: one chunk per delta with something in it, timings on each choice's last chunk,
    the usage chunk when asked for, then [DONE]. An engine failure becomes an error event."""
    index = {rid_: i for i, rid_ in enumerate(stream.request_ids)}
    finals: dict[int, CompletionOutput] = {}
    try:
        for choice in head:
            yield _event(R.chunk(rid, obj, created, model, [choice], include_usage))
        async for delta in stream:
            i = index[delta.request_id]
            choice = make_choice(i, delta)
            if choice is None:
                continue
            extra = {}
            if delta.finished:
                finals[i] = delta.output
                extra["timings"] = R.timings(delta.output)
            yield _event(R.chunk(rid, obj, created, model, [choice], include_usage, **extra))
        if include_usage:
            outs = [finals[i] for i in sorted(finals)]
            yield _event(R.chunk(rid, obj, created, model, [], False, usage=R.usage(outs[::n], outs),
                                 timings=R.timings(outs[0])))
        yield "data: [DONE]\n\n"
    except EngineError as e:
        yield _event(error_body(str(e), "server_error", code="engine_error"))
        yield "data: [DONE]\n\n"
    finally:
        stream.close()


def _completion_events(stream: RequestStream, rid: str, created: int, model: str, n: int, want_lp: bool,
                       include_usage: bool, tt: R.TokenText, echo: bool = False) -> AsyncIterator[str]:
    offsets = [R.TextOffsets() for _ in stream.request_ids]
    unechoed = set(range(len(stream.request_ids))) if echo else set()   # choices whose prompt is still to send

    def make_choice(i: int, delta: Any) -> dict | None:
        text, ids, lps = R.echoed(delta.output, tt) if i in unechoed else ("", [], [])
        unechoed.discard(i)
        if not text and not delta.text and not delta.finished and not want_lp:
            return None
        choice = {"index": i, "text": text + delta.text, "logprobs": None, "finish_reason": None}
        if want_lp:
            choice["logprobs"] = tt.completion_logprobs(ids + delta.token_ids, lps + delta.logprobs, offsets[i])
        if delta.finished:
            choice["finish_reason"], choice["stop_reason"] = delta.output.finish_reason, delta.output.stop_reason
        return choice

    return _events(stream, make_choice, [], rid, "text_completion", created, model, n, include_usage)


def _chat_events(stream: RequestStream, rid: str, created: int, model: str, n: int, want_lp: bool,
                 include_usage: bool, tt: R.TokenText) -> AsyncIterator[str]:
    head = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(len(stream.request_ids))]

    def make_choice(i: int, delta: Any) -> dict | None:
        if not delta.text and not delta.finished and not want_lp:
            return None
        choice = {"index": i, "delta": {"content": delta.text} if delta.text else {}, "logprobs": None,
                  "finish_reason": None}
        if want_lp:
            choice["logprobs"] = tt.chat_logprobs(delta.token_ids, delta.logprobs)
        if delta.finished:
            choice["finish_reason"], choice["stop_reason"] = delta.output.finish_reason, delta.output.stop_reason
        return choice

    return _events(stream, make_choice, head, rid, "chat.completion.chunk", created, model, n, include_usage)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(message, kind), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return JSONResponse(error_body(f"internal server error: {first}", "server_error"), status_code=500)
