"""The OpenAI API proper: /v1/models, /v1/completions and /v1/chat/completions.

Completions and chat share one flow (`respond`): build the sub-requests (one per prompt and
choice), admit and submit them, then stream SSE chunks or collect one JSON body.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from functools import partial

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from phasewise.json_types import JsonObject
from phasewise.server.openai import output as R
from phasewise.server.async_engine import SubRequest
from phasewise.server.body_parsing import parse_body
from phasewise.server.chat_call import Submitter, chat_call, choice_params, salted, sub_id
from phasewise.server.guards import Guards
from phasewise.server.disaggregation import DisaggregatedPair
from phasewise.server.api_error import bad_request
from phasewise.server.openai.protocol import CompletionRequest, ChatCompletionRequest, openapi_body
from phasewise.server.openai.stream import chat_events, completion_events
from phasewise.server.sse import collect, sse_response
from phasewise.server.thinking import Thinking


class Responder:
    """How an OpenAI route answers once its sub-requests are built: start them, then stream SSE or
    collect one body, with a disaggregated pair's KV transfer around it."""

    def __init__(self, guards: Guards) -> None:
        self.config, self.pair = guards.config, DisaggregatedPair(guards.engine)
        self.submitter = Submitter(guards)

    async def respond(self, request: Request, body: CompletionRequest | ChatCompletionRequest, rid: str,
                      items: list[SubRequest], chat: bool, events: Callable[..., AsyncIterator[str]],
                      final: Callable[..., JsonObject], fields: Mapping[str, str]) -> Response:
        """Start the sub-requests, then stream `events` (SSE) or collect every output into `final`'s
        body (499 when the client left first). With kv_transfer_params (from `serve --role proxy`):
        a decode instance first imports the prompt's KV blocks the prefill instance sends; a prefill
        instance sends them once its (one-token) answer is done. fields: the API's names of engine fields."""
        transfer = body.kv_transfer_params.transfer_id if body.kv_transfer_params else None
        # the key's cache salt: its blocks, sent and received
        items = salted(items, Guards.tenant(request))
        salt = items[0].params.cache_salt
        if transfer and self.config.role == "decode":
            await self.pair.receive(transfer, salt)
        stream = await self.submitter.start(items, chat, fields)
        created, model = int(time.time()), body.model or self.config.served_model_name
        want_lp = items[0].params.logprobs is not None
        if transfer and self.config.role == "prefill":
            if body.stream or len(items) != 1:
                raise bad_request("a prefill instance's request carries one prompt, one choice, no stream",
                                  "kv_transfer_params")
        elif body.stream:
            return sse_response(events(stream, rid, created, model, want_lp=want_lp,
                                       include_usage=body.include_usage), stream)
        outs = await collect(request, stream)
        if outs is None:
            return Response(status_code=499)
        if transfer and self.config.role == "prefill":
            await self.pair.send(transfer, items[0].prompt, chat, salt)
        return JSONResponse(final(rid, created, model, outs, want_lp))


def openai_router(guards: Guards) -> APIRouter:
    engine, config = guards.engine, guards.config
    token_text = R.TokenText(engine.tokenizer)
    respond = Responder(guards).respond
    thinking = Thinking(config.reasoning_parser, engine.tokenizer, config.reasoning_budget)
    router = APIRouter(dependencies=[Depends(guards.require_key)])

    def model_card() -> JsonObject:
        return {"id": config.served_model_name, "object": "model", "created": config.created,
                "owned_by": "phasewise", "root": config.model_root, "parent": None,
                "max_model_len": engine.max_model_len}

    @router.get("/v1/models")
    async def models() -> JsonObject:
        return {"object": "list", "data": [model_card()]}

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JsonObject:
        guards.check_model(model_id)                   # 404 in OpenAI's shape for another name
        return model_card()

    @router.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        body = parse_body(await request.body(), CompletionRequest)
        guards.check_model(body.model)
        params = body.sampling_params()
        prompts, n = body.prompts(), body.n
        rid = f"cmpl-{uuid.uuid4().hex}"
        items = [SubRequest(sub_id(rid, p * n + j, len(prompts) * n), prompts[p], choice_params(params, j))
                 for p in range(len(prompts)) for j in range(n)]
        return await respond(request, body, rid, items, False,
                             partial(completion_events, n=n, tt=token_text, echo=body.echo),
                             partial(R.completion_body, n=n, tt=token_text, echo=body.echo),
                             {"structured_outputs": body.constraint_field} if body.constraint_field else {})

    @router.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        body = parse_body(await request.body(), ChatCompletionRequest)
        guards.check_model(body.model)
        call = chat_call(body.chat_request(), engine.tokenizer.tool_format,
                         f"chatcmpl-{uuid.uuid4().hex}", thinking)
        return await respond(request, body, call.rid, call.items, True,
                             partial(chat_events, n=body.n, tt=token_text, parser=call.parser),
                             partial(R.chat_body, tt=token_text, parser=call.parser), call.fields)

    return router

