"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A request becomes the chat request it stands for (responses_api.py) and runs on the chat route's
path (chat_call.py); its output becomes Responses items (responses_output.py), streamed as the
Responses' own SSE events or returned in one response object. Responses are kept (unless `store`
is false) in a bounded ResponseStore, which `previous_response_id` continues and GET/DELETE read.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from phasewise.json_types import JsonObject
from phasewise.outputs import CompletionOutput
from phasewise.server.body_parsing import parse_body
from phasewise.server.chat_call import ChatCall, Submitter, chat_call
from phasewise.server.errors import EngineError
from phasewise.server.guards import Guards
from phasewise.server.protocol import APIError
from phasewise.server.request_stream import RequestStream
from phasewise.server.response_store import ResponseStore, StoredResponse
from phasewise.server.responses_api import ResponsesRequest, chat_request, renamed
from phasewise.server.responses_output import OutputItems, assistant_message, new_id, response_body, sse, status_of
from phasewise.server.sse import collect, failure, sse_response


def responses_router(guards: Guards, store: ResponseStore) -> APIRouter:
    engine, config = guards.engine, guards.config
    submitter = Submitter(guards)
    router = APIRouter(dependencies=[Depends(guards.require_key)])

    def stored(rid: str, param: str | None = None) -> StoredResponse:
        item = store.get(rid)
        if item is None:
            what = "previous response" if param else "response"
            raise APIError(404, f"the {what} '{rid}' is not stored here (never stored, deleted, or evicted: "
                                f"the server keeps the last {store.max_responses})", param=param or "response_id",
                           code="previous_response_not_found" if param else "not_found")
        return item

    @router.post("/v1/responses")
    async def create(request: Request) -> Response:
        body = parse_body(await request.body(), ResponsesRequest)
        guards.check_model(body.model)
        history = stored(body.previous_response_id, "previous_response_id").conversation \
            if body.previous_response_id else []
        try:
            chat, head = chat_request(body, history)
            call = chat_call(chat, engine.tokenizer.tool_format, new_id("resp"))
            stream = await submitter.start(call.items, True, chat.constraint_field, prompt_param="input")
        except APIError as e:
            raise renamed(e) from None
        run = Run(body, call, chat.conversation()[head:], body.model or config.served_model_name, store)
        if body.stream:
            return sse_response(response_events(run, stream), stream)
        outs = await collect(request, stream)        # an output that ended in error: a 500 naming it
        if outs is None:
            return Response(status_code=499)
        out = outs[0]
        items = OutputItems(call.parser())
        items.feed(out.text, final=True, cut=out.finish_reason == "length")
        status = status_of(out)
        if status == "failed":                       # collect raises first; kept for a caller without it
            raise APIError(500, failure(out) or "the request ended without an output", type="server_error",
                           code="engine_error")
        items.finish(status)
        response = run.response(status, items.items, out)
        run.keep(response, items.items)
        return JSONResponse(response)

    @router.get("/v1/responses/{response_id}")
    async def get(response_id: str) -> JsonObject:
        return stored(response_id).body

    @router.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> dict[str, str | bool]:
        stored(response_id)
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return router


class Run:
    """One started call: what its response says, and what is stored of it when it ends."""

    def __init__(self, body: ResponsesRequest, call: ChatCall, conversation: list[JsonObject], model: str,
                 store: ResponseStore) -> None:
        self.body, self.call, self.conversation, self.model, self.store = body, call, conversation, model, store
        self.rid, self.created = call.rid, int(time.time())

    def response(self, status: str, items: list[JsonObject], out: CompletionOutput | None = None,
                 error: str | None = None) -> JsonObject:
        return response_body(self.body, self.rid, self.created, self.model, status, items, out, error)

    def keep(self, response: JsonObject, items: list[JsonObject]) -> None:
        """Store a response (its output: `items`) that did not fail (unless the request said store: false)."""
        if self.body.stored and response["status"] != "failed":
            self.store.put(response, self.conversation + [assistant_message(items)])


async def response_events(run: Run, stream: RequestStream) -> AsyncIterator[str]:
    """response.created and .in_progress, the items' events as the text comes, then .completed or
    .incomplete; an engine failure (or an output that ended in error) ends it with response.failed
    naming the cause."""
    seq = itertools.count()
    items = OutputItems(run.call.parser())
    head = run.response("in_progress", [])
    yield sse({"type": "response.created", "response": head}, next(seq))
    yield sse({"type": "response.in_progress", "response": head}, next(seq))
    out: CompletionOutput | None = None
    error = None
    try:
        async for delta in stream:
            cut = delta.finished and delta.output.finish_reason == "length"
            for event in items.feed(delta.text, final=delta.finished, cut=cut):
                yield sse(event, next(seq))
            if delta.finished:
                out = delta.output
    except EngineError as e:
        error = str(e)
    finally:
        stream.close()
    status = "failed" if out is None else status_of(out)
    if status == "failed" and error is None:
        error = (failure(out) if out is not None else None) or "the request ended without an output"
    for event in items.finish(status):
        yield sse(event, next(seq))
    response = run.response(status, items.items, out, error)
    run.keep(response, items.items)
    yield sse({"type": f"response.{status}", "response": response}, next(seq))
