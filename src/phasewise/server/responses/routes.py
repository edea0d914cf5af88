"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}, GET
/v1/responses/{id}/input_items and POST /v1/responses/{id}/cancel.

A request becomes the chat request it stands for (protocol.py) and runs on the chat route's
path (chat_call.py); its output becomes Responses items (output.py), streamed as the
Responses' own SSE events or returned in one response object. Responses are kept (unless `store`
is false) in a bounded ResponseStore, which `previous_response_id` continues and GET/DELETE read.
A `background` response is answered at once ("queued") and runs as a task (`BackgroundRuns`), which
GET polls and cancel stops. A prewarm (`prompt_cache_options.prewarm`) runs its prompt into the prefix cache
and is a completed response without output, whose stored conversation a later turn continues.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import replace
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from phasewise import json_types
from phasewise.json_types import JsonObject
from phasewise.outputs import CompletionOutput
from phasewise.tool_calling import ToolFormat
from phasewise.server.body_parsing import parse_body
from phasewise.server.chat_call import ChatCall, Submitter, chat_call
from phasewise.server.errors import EngineError
from phasewise.server.guards import Guards
from phasewise.server.api_error import APIError
from phasewise.server.chat_request import ChatRequest
from phasewise.server.request_stream import RequestStream
from phasewise.server.responses.store import ResponseStore, StoredResponse
from phasewise.server.responses.protocol import ResponsesRequest, chat_request, input_items
from phasewise.server.responses.tools import custom_names, forced_custom
from phasewise.server.responses.output import (OutputItems, assistant_message, new_id, response_body, sse,
                                               status_of)
from phasewise.server.sse import collect, failure, sse_response
from phasewise.server.thinking import Thinking


def responses_router(guards: Guards, store: ResponseStore) -> APIRouter:
    engine, config = guards.engine, guards.config
    submitter = Submitter(guards)
    thinking = Thinking(config.reasoning_parser, engine.tokenizer, config.reasoning_budget)
    background = BackgroundRuns()
    router = APIRouter(dependencies=[Depends(guards.require_key)])

    def stored(rid: str, param: str | None = None) -> StoredResponse:
        return stored_response(store, rid, param)

    @router.post("/v1/responses")
    async def create(request: Request) -> Response:
        body = parse_body(await request.body(), ResponsesRequest)
        guards.check_model(body.model)
        history = stored(body.previous_response_id, "previous_response_id").conversation \
            if body.previous_response_id else []
        chat, head = chat_request(body, history)
        chat, call, stream = await start(submitter, body, chat, head, engine.tokenizer.tool_format, thinking,
                                         guards.tenant(request))
        run = Run(body, call, chat.prompt.messages[head:], body.model or config.served_model_name, store)
        if body.background:
            return JSONResponse(background.start(run, stream))
        if body.stream:
            return sse_response(response_events(run, stream), stream)
        return await finished_response(request, run, stream)

    @router.get("/v1/responses/{response_id}")
    async def get(response_id: str) -> JsonObject:
        return stored(response_id).body

    @router.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> dict[str, str | bool]:
        stored(response_id)
        await background.cancel(response_id)
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @router.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, limit: int = 20, order: str = "desc",
                               after: str | None = None) -> JsonObject:
        """The response's input items, a page at a time (OpenAI's list: newest first unless order=asc)."""
        return items_page([*stored(response_id).input_items], limit, order, after)

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> JsonObject:
        """Stop a background response (its output so far kept, status "cancelled"); one that has finished
        is returned as it is. A response not created with background: true cannot be cancelled (400)."""
        if stored(response_id).body.get("background") is not True:
            raise APIError(400, "only a response created with background: true can be cancelled",
                           param="response_id")
        return await background.cancel(response_id) or stored(response_id).body

    return router


async def start(submitter: Submitter, body: ResponsesRequest, chat: ChatRequest, head: int,
                tool_format: ToolFormat, thinking: Thinking, tenant: str | None = None
                ) -> tuple[ChatRequest, ChatCall, RequestStream]:
    """Submit the call (with truncation "auto", dropping the oldest turn until it fits the context):
    the chat request that ran, its ChatCall and its stream. tenant: the API key's cache salt."""
    rid = new_id("resp")
    while True:
        call = chat_call(chat, tool_format, rid, thinking)
        try:
            return chat, call, await submitter.start(call.items, True, call.fields, tenant)
        except APIError as e:
            shorter = truncated(chat, head) if body.truncation == "auto" else None
            if e.code != "context_length_exceeded" or shorter is None:
                raise
            chat = shorter


def truncated(chat: ChatRequest, head: int) -> ChatRequest | None:
    """truncation "auto": the request without its oldest turn (the messages after the instructions up to
    the next user message, so no tool result loses its call); None when only the last turn is left."""
    messages = chat.prompt.messages
    starts = [i for i, m in enumerate(messages[head:]) if m["role"] == "user" and i > 0]
    if not starts:
        return None
    kept = [*messages[:head], *messages[head + starts[0]:]]
    return replace(chat, prompt=replace(chat.prompt, messages=kept))


def stored_response(store: ResponseStore, rid: str, param: str | None = None) -> StoredResponse:
    """A stored response, or a 404 saying why it may not be there (`param`: the field that named it)."""
    item = store.get(rid)
    if item is None:
        what = "previous response" if param else "response"
        raise APIError(404, f"the {what} '{rid}' is not stored here (never stored, deleted, or evicted: "
                            f"the server keeps the last {store.max_responses})", param=param or "response_id",
                       code="previous_response_not_found" if param else "not_found")
    return item


async def finished_response(request: Request, run: Run, stream: RequestStream) -> Response:
    """A response not streamed: the whole output, stored as `Run.keep` says (499 if the client left)."""
    outs = await collect(request, stream)        # an output that ended in error: a 500 naming it
    if outs is None:
        return Response(status_code=499)
    out = outs[0]
    if status_of(out) == "failed":               # collect raises first; kept for a caller without it
        raise APIError(500, failure(out) or "the request ended without an output", type="server_error",
                       code="engine_error")
    return JSONResponse(run.finish(out))


def items_page(items: list[JsonObject], limit: int, order: str, after: str | None) -> JsonObject:
    """A page of OpenAI's list shape: `limit` items (1-100) after the item `after`, in `order`."""
    if not 1 <= limit <= 100:
        raise APIError(400, f"limit must be in [1, 100], got {limit}", param="limit")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be asc or desc, got {order!r}", param="order")
    items = items if order == "asc" else items[::-1]
    ids = [item.get("id") for item in items]
    if after is not None:
        if after not in ids:
            raise APIError(400, f"after: no input item {after!r} in this response", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": [*page], "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


class Run:
    """One started call: what its response says, and what is stored of it when it ends."""

    def __init__(self, body: ResponsesRequest, call: ChatCall, conversation: list[JsonObject], model: str,
                 store: ResponseStore) -> None:
        self.body, self.call, self.conversation = body, call, conversation
        self.model, self.store = model, store
        self.rid, self.created = call.rid, int(time.time())

    def response(self, status: str, items: list[JsonObject], out: CompletionOutput | None = None,
                 error: str | None = None) -> JsonObject:
        return response_body(self.body, self.rid, self.created, self.model, status, items, out, error)

    def keep(self, response: JsonObject, items: list[JsonObject]) -> None:
        """Store a response (its output: `items`) that did not fail (unless the request said store: false); a
        prewarm's conversation ends with its input, which a later turn continues."""
        if self.body.stored and response["status"] != "failed":
            reply = [] if self.body.prewarm else [assistant_message(items)]
            self.store.put(response, self.conversation + reply, input_items(self.body))

    def output_items(self) -> OutputItems:
        """A fresh reading of the output into items (custom tools' calls as custom_tool_call items)."""
        bare = forced_custom(self.body)
        return OutputItems(self.call.parser(), custom_names(self.body.tools),
                           json_types.text(bare["name"]) if bare is not None else None, self.body.prewarm)

    def status(self, out: CompletionOutput) -> str:
        """The response's status: a prewarm that ran its prompt is complete (its max_tokens 0 reached)."""
        status = status_of(out)
        return "completed" if self.body.prewarm and status == "incomplete" else status

    def finish(self, out: CompletionOutput, cancelled: bool = False) -> JsonObject:
        """The response of a finished output (stored as `keep` says)."""
        items = self.output_items()
        items.feed(out.text, final=True, cut=out.finish_reason == "length" or cancelled)
        status = "cancelled" if cancelled else self.status(out)
        items.finish(status)
        response = self.response(status, items.items, out)
        self.keep(response, items.items)
        return response


class BackgroundRuns:
    """Responses created with background: true: each runs as a task on the event loop until its output
    is done (then stored as any response is) or it is cancelled (its output so far kept)."""

    def __init__(self) -> None:
        self._runs: dict[str, tuple[asyncio.Task[JsonObject], Run, RequestStream]] = {}

    def start(self, run: Run, stream: RequestStream) -> JsonObject:
        """Start the run; its response as it stands ("queued"), stored so that GET can poll it."""
        queued = run.response("queued", [])
        run.store.put(queued, run.conversation, input_items(run.body))
        task = asyncio.ensure_future(self._collect(run, stream))
        self._runs[run.rid] = task, run, stream
        task.add_done_callback(lambda _: self._runs.pop(run.rid, None))
        return queued

    async def _collect(self, run: Run, stream: RequestStream) -> JsonObject:
        last: CompletionOutput | None = None
        error = None
        try:
            async for delta in stream:
                if last is None:
                    run.store.put(run.response("in_progress", []), run.conversation, input_items(run.body))
                last = delta.output
        except EngineError as e:
            error = str(e)
        except asyncio.CancelledError:            # cancel: the output so far is the response's
            return self._cancelled(run, stream, last)
        finally:
            stream.close()
        if last is None or status_of(last) == "failed":
            cause = error or (failure(last) if last is not None else None) or \
                "the request ended without an output"
            response = run.response("failed", [], last, cause)
            run.store.put(response, run.conversation, input_items(run.body))   # kept: GET polls it
            return response
        return run.finish(last)

    @staticmethod
    def _cancelled(run: Run, stream: RequestStream, last: CompletionOutput | None) -> JsonObject:
        stream.close()                            # aborts the engine request
        if last is not None:
            return run.finish(last, cancelled=True)
        response = run.response("cancelled", [])
        run.store.put(response, run.conversation, input_items(run.body))
        return response

    async def cancel(self, rid: str) -> JsonObject | None:
        """Stop a running response: its final response, or None when it is not running."""
        entry = self._runs.pop(rid, None)
        if entry is None or entry[0].done():
            return None
        task, run, stream = entry
        task.cancel()
        try:
            return await task
        except asyncio.CancelledError:            # cancelled before it started
            return self._cancelled(run, stream, None)


async def response_events(run: Run, stream: RequestStream) -> AsyncIterator[str]:
    """response.created and .in_progress, the items' events as the text comes, then .completed or
    .incomplete; an engine failure (or an output that ended in error) ends it with response.failed
    naming the cause."""
    seq = itertools.count()
    items = run.output_items()
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
    status = "failed" if out is None else run.status(out)
    if status == "failed" and error is None:
        error = (failure(out) if out is not None else None) or "the request ended without an output"
    for event in items.finish(status):
        yield sse(event, next(seq))
    response = run.response(status, items.items, out, error)
    run.keep(response, items.items)
    yield sse({"type": f"response.{status}", "response": response}, next(seq))
