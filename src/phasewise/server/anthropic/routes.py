"""The Anthropic Messages API: POST /v1/messages (a message, or its SSE events) and
/v1/messages/count_tokens.

The body is checked and translated into a ChatRequest (protocol.py, translate.py) and runs as a chat
completion does (chat_call.py); its reply becomes content blocks (output.py). Thinking blocks sent
back must carry the signature given (signature.py).
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from phasewise.json_types import JsonObject
from phasewise.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from phasewise.server.body_parsing import parse_body
from phasewise.server.chat_call import Submitter, chat_call
from phasewise.server.guards import Guards
from phasewise.server.api_error import APIError
from phasewise.server.anthropic.output import message_body, message_events
from phasewise.server.sse import collect, sse_response
from phasewise.server.thinking import Thinking
from phasewise.config import default_cache_dir
from phasewise.server.anthropic.signature import ThinkingSignature


def anthropic_router(guards: Guards) -> APIRouter:
    engine = guards.engine
    submitter = Submitter(guards)
    config = guards.config
    thinking = Thinking(config.reasoning_parser, engine.tokenizer, config.reasoning_budget)
    signature = ThinkingSignature.kept_in(default_cache_dir())
    router = APIRouter(dependencies=[Depends(guards.require_key)])

    def check_signatures(body: MessagesRequest | CountTokensRequest) -> None:
        for text, signed, where in body.thinking_blocks():
            if not signature.verify(text, signed):
                raise APIError(400, f"{where}: Invalid `signature` in `thinking` block", param="messages")

    # not in /openapi.json: its fuzzing expects OpenAI's error shape of every route it finds
    @router.post("/v1/messages", include_in_schema=False)
    async def messages(request: Request) -> Response:
        body = parse_body(await request.body(), MessagesRequest)
        guards.check_model(body.model)
        check_signatures(body)
        message_id = f"msg_{uuid.uuid4().hex[:24]}"
        call = chat_call(body.chat_request(), engine.tokenizer.tool_format, message_id, thinking)
        stream = await submitter.start(call.items, True, call.fields, guards.tenant(request))
        model = body.model or guards.config.served_model_name
        if body.stream:
            return sse_response(message_events(stream, call, model, body.single_call, signature), stream)
        outs = await collect(request, stream)
        if outs is None:
            return Response(status_code=499)
        return JSONResponse(message_body(call, model, outs[0], body.single_call, signature))

    @router.post("/v1/messages/count_tokens", include_in_schema=False)
    async def count_tokens(request: Request) -> JsonObject:
        """The prompt's tokens as a /v1/messages request with the same system, messages and tools has them."""
        body = parse_body(await request.body(), CountTokensRequest)
        guards.check_model(body.model)
        item = chat_call(body.chat_request(), engine.tokenizer.tool_format, "count", thinking).items[0]
        try:
            ids = await engine.call(lambda e: e.encode_prompt(item.prompt, True))
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        return {"input_tokens": len(ids)}

    return router
