"""`phasewise serve --role proxy --prefill URL --decode URL`: the entry of a disaggregated pair.

Each completion or chat request goes first to the prefill instance as a one-token, unstreamed
request tagged with a fresh kv_transfer_params.transfer_id; when it has answered (its prompt's KV
blocks are on their way to the decode instance over the pair's KV link), the request as the
client sent it, with the same tag, goes to the decode instance, whose answer (streamed or not)
is passed back unchanged. The proxy loads no model; an error from either instance reaches the
client as that instance gave it. Requests the prefill instance cannot take as one prompt (a
list of completion prompts) go straight to the decode instance, which then computes them.
An instance that cannot be reached is a 502; a decode instance lost mid-stream ends the stream
with an error event and [DONE], as the server's own streams end when its engine fails.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from phasewise.json_types import JsonObject
from phasewise.server.body_parsing import MAX_DEPTH, nesting_depth
from phasewise.server.api_error import error_body


def _passed(request: Request) -> dict[str, str]:
    """The request's headers the proxy passes on (its API key)."""
    auth = request.headers.get("authorization")
    return {"authorization": auth} if auth else {}


def _relay(r: httpx.Response) -> Response:
    return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))


def create_proxy(prefill: str, decode: str) -> FastAPI:
    app = FastAPI(title="phasewise proxy", docs_url=None, redoc_url=None, openapi_url=None)
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
    prefill, decode = prefill.rstrip("/"), decode.rstrip("/")

    @app.get("/health")
    async def health() -> Response:
        try:
            ok = [(await client.get(url + "/health")).status_code == 200 for url in (prefill, decode)]
        except httpx.TransportError:
            ok = [False]
        return Response(status_code=200 if all(ok) else 503)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return _relay(await client.get(decode + "/v1/models", headers=_passed(request)))

    async def forward(request: Request, path: str) -> Response:
        body = _json_object(await request.body())
        if isinstance(body, Response):
            return body
        headers = _passed(request)
        first, body = pair_bodies(path, body)
        try:
            if first is not None:
                r = await client.post(prefill + path, json=first, headers=headers)
                if r.status_code != 200:
                    return _relay(r)
            if not body.get("stream"):
                return _relay(await client.post(decode + path, json=body, headers=headers))
            forward = client.build_request("POST", decode + path, json=body, headers=headers)
            r = await client.send(forward, stream=True)
        except httpx.TransportError as e:
            return JSONResponse(error_body(f"an instance of the pair cannot be reached: {e}", "server_error"),
                                status_code=502)
        return StreamingResponse(_relay_stream(r), status_code=r.status_code,
                                 media_type=r.headers.get("content-type"),
                                 background=BackgroundTask(r.aclose))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions")

    @app.on_event("shutdown")
    async def close() -> None:
        await client.aclose()

    return app


def _json_object(raw: bytes) -> JsonObject | Response:
    """A request body as a JSON object, or the 400 that says why it is not one."""
    if nesting_depth(raw) > MAX_DEPTH:
        return JSONResponse(error_body(f"the request body nests arrays and objects more than {MAX_DEPTH} "
                                       "levels deep"), status_code=400)
    try:
        body = json.loads(raw)
    except ValueError:
        return JSONResponse(error_body("the body is not valid JSON"), status_code=400)
    if not isinstance(body, dict):
        return JSONResponse(error_body("the body must be a JSON object"), status_code=400)
    return body


def pair_bodies(path: str, body: JsonObject) -> tuple[JsonObject | None, JsonObject]:
    """A completion or chat request as the pair takes it: (the prefill instance's one-token, unstreamed
    request, tagged with a fresh transfer id, or None when the decode instance computes it all: a list of
    completion prompts; the decode instance's request, the client's with the same tag). The proxy's and
    `serve --ray --prefill-decode`'s relay's (deploy/relay.py)."""
    prompt = body.get("prompt")
    if not path.endswith("chat/completions") and (
            isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) and len(prompt) > 1):
        return None, body
    tag: JsonObject = {"transfer_id": uuid.uuid4().hex}
    first = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens")}
    first.update(max_tokens=1, min_tokens=0, stream=False, n=1, kv_transfer_params=tag)
    return first, {**body, "kv_transfer_params": tag}


async def _relay_stream(r: httpx.Response) -> AsyncIterator[bytes]:
    """The decode instance's bytes as they come; if it is lost mid-way, an error event and [DONE]."""
    try:
        async for chunk in r.aiter_raw():
            yield chunk
    except httpx.HTTPError as e:
        body = error_body(f"the decode instance was lost mid-stream: {e}", "server_error", code="decode_lost")
        yield f"\n\ndata: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()
