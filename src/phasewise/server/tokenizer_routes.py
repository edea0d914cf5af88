"""/tokenize, /detokenize and /tokenizer_info: the server's tokenizer, for clients that count or score."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from phasewise.server.guards import Guards
from phasewise import tool_calling
from phasewise.json_types import JsonObject
from phasewise.server.body_parsing import parse_body
from phasewise.server.api_error import bad_request
from phasewise.server.openai.protocol import DetokenizeRequest, TokenizeRequest, openapi_body


def tokenizer_router(guards: Guards) -> APIRouter:
    engine = guards.engine
    router = APIRouter(dependencies=[Depends(guards.require_key)])

    @router.post("/tokenize", openapi_extra=openapi_body(TokenizeRequest))
    async def tokenize(request: Request) -> JsonObject:
        body = parse_body(await request.body(), TokenizeRequest)
        guards.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give either prompt or messages")
        if body.messages is not None:
            messages = [m.as_dict() for m in body.messages]
            try:
                tools = None if body.tools is None else tool_calling.check_tools(body.tools)
            except ValueError as e:
                raise bad_request(str(e), "tools") from None
            fn = lambda e: e.tokenizer.apply_chat_template(messages, tools=tools)    # noqa: E731
        else:
            text, special = body.prompt, body.add_special_tokens
            fn = lambda e: e.tokenizer.encode(text, add_special_tokens=special)    # noqa: E731
        try:
            ids = await engine.call(fn)
        except ValueError as e:
            raise bad_request(str(e)) from None
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @router.get("/tokenizer_info")
    async def tokenizer_info() -> JsonObject:
        """What a client needs to tokenize as the server does (vLLM's route; lm-evaluation-harness's
        `tokenizer_backend=remote` reads it, then uses /tokenize and /detokenize)."""
        hf = engine.tokenizer.hf
        template = hf.chat_template                    # a dict: templates by name
        return {"tokenizer_class": type(hf).__name__, "eos_token": hf.eos_token, "bos_token": hf.bos_token,
                "pad_token": hf.pad_token, "unk_token": hf.unk_token,
                "chat_template": {**template} if isinstance(template, dict) else template,
                "model_max_length": engine.max_model_len, "vocab_size": engine.model_config.vocab_size}

    @router.post("/detokenize", openapi_extra=openapi_body(DetokenizeRequest))
    async def detokenize(request: Request) -> JsonObject:
        body = parse_body(await request.body(), DetokenizeRequest)
        guards.check_model(body.model)
        vocab = engine.model_config.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is out of range: the vocabulary has {vocab} tokens", "tokens")
        tokens = body.tokens
        return {"prompt": await engine.call(lambda e: e.tokenizer.decode(tokens))}

    return router
