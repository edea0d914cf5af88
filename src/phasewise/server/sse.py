"""What every API does with a request's RequestStream: an SSE response around its events, or one collected
list of outputs; and the failures an output can end in."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from phasewise.outputs import CompletionOutput
from phasewise.engine.output_processor import DEAD_END
from phasewise.server.errors import EngineError
from phasewise.server.api_error import APIError
from phasewise.server.request_stream import RequestStream


class GenerationError(EngineError):
    """A request the engine ended without a reply (finish_reason "error": its grammar refused a token;
    "abort"). No API's clients know those finish reasons: the call answers with an error naming the cause
    instead (each API in its own shape)."""


def failure(out: CompletionOutput) -> str | None:
    """Why a finished output has no reply (it ended in error, or was aborted), or None."""
    if out.finish_reason == "error":
        return out.error or "the request ended in error"
    if out.finish_reason == "abort":
        return "the request was aborted before it finished"
    return None


async def collect(request: Request, stream: RequestStream) -> list[CompletionOutput] | None:
    """The final outputs in submission order, or None when the client disconnected first (then aborted).
    An engine failure, or an output that ended in error, is an APIError (500)."""
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
        outputs = work.result()
        cause = next(filter(None, map(failure, outputs)), None)
        if cause is not None and cause.startswith(DEAD_END):     # a constraint the vocabulary cannot satisfy
            raise APIError(400, cause, code="constraint_unsatisfiable")
        if cause is not None:
            raise GenerationError(cause)
        return outputs
    except EngineError as e:
        raise APIError(500, str(e), type="server_error", code=error_code(e)) from None


def error_code(error: EngineError) -> str:
    return "generation_error" if isinstance(error, GenerationError) else "engine_error"


def sse_response(gen: AsyncIterator[str], stream: RequestStream) -> StreamingResponse:
    # background: closes the stream even when the body never started (client gone at once)
    return StreamingResponse(gen, media_type="text/event-stream", background=BackgroundTask(stream.close),
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
