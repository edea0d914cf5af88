"""The SSE chunks of OpenAI's completions and chat completions, from a request's RequestStream."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from phasewise.json_types import JsonObject
from phasewise.outputs import CompletionOutput, StreamDelta
from phasewise.server.api_error import error_body
from phasewise.server.errors import EngineError
from phasewise.server.openai import output as R
from phasewise.server.request_stream import RequestStream
from phasewise.server.sse import GenerationError, error_code, failure
from phasewise.server.timings import timings


def _event(obj: JsonObject) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _events(stream: RequestStream, make_choice: Callable[[int, StreamDelta], JsonObject | None],
                  head: list[JsonObject], rid: str, obj: str, created: int, model: str, n: int,
                  include_usage: bool) -> AsyncIterator[str]:
    """Shared SSE loop: one chunk per delta with something in it, timings on each choice's last chunk,
    the usage chunk when asked for, then [DONE]. An engine failure becomes an error event."""
    index = {rid_: i for i, rid_ in enumerate(stream.request_ids)}
    finals: dict[int, CompletionOutput] = {}
    try:
        for choice in head:
            yield _event(R.chunk(rid, obj, created, model, [choice], include_usage))
        async for delta in stream:
            i = index[delta.request_id]
            cause = failure(delta.output) if delta.finished else None
            if cause is not None:
                raise GenerationError(cause)
            made = make_choice(i, delta)
            if made is None:
                continue
            extra: JsonObject = {}
            if delta.finished:
                finals[i] = delta.output
                extra["timings"] = timings(delta.output)
            yield _event(R.chunk(rid, obj, created, model, [made], include_usage, **extra))
        if include_usage:
            outs = [finals[i] for i in sorted(finals)]
            yield _event(R.chunk(rid, obj, created, model, [], False, usage=R.usage(outs[::n], outs),
                                 timings=timings(outs[0])))
        yield "data: [DONE]\n\n"
    except EngineError as e:
        yield _event(error_body(str(e), "server_error", code=error_code(e)))
        yield "data: [DONE]\n\n"
    finally:
        stream.close()


def completion_events(stream: RequestStream, rid: str, created: int, model: str, n: int, want_lp: bool,
                      include_usage: bool, tt: R.TokenText, echo: bool = False) -> AsyncIterator[str]:
    offsets = [R.TextOffsets() for _ in stream.request_ids]
    # choices whose prompt is still to send
    unechoed = set(range(len(stream.request_ids))) if echo else set()

    def make_choice(i: int, delta: StreamDelta) -> JsonObject | None:
        text, ids, lps = R.echoed(delta.output, tt) if i in unechoed else ("", [], [])
        unechoed.discard(i)
        if not text and not delta.text and not delta.finished and not want_lp:
            return None
        choice: JsonObject = {"index": i, "text": text + delta.text, "logprobs": None, "finish_reason": None}
        if want_lp:
            choice["logprobs"] = tt.completion_logprobs(ids + delta.token_ids,
                                                        [*lps, *delta.logprobs], offsets[i])
        if delta.finished:
            choice["finish_reason"] = delta.output.finish_reason
            choice["stop_reason"] = delta.output.stop_reason
        return choice

    return _events(stream, make_choice, [], rid, "text_completion", created, model, n, include_usage)


def chat_events(stream: RequestStream, rid: str, created: int, model: str, n: int, want_lp: bool,
                include_usage: bool, tt: R.TokenText,
                parser: R.ParserFactory = R.no_parser) -> AsyncIterator[str]:
    """With a parser (ChatCall.parser: the request has tools), each choice's text goes through its own:
    calls stream as delta.tool_calls (index, id, name, then argument fragments), the rest as content."""
    head: list[JsonObject] = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None} for i in range(len(stream.request_ids))]
    parsers = [parser() for _ in stream.request_ids]

    def make_choice(i: int, delta: StreamDelta) -> JsonObject | None:
        message: JsonObject
        choice_parser = parsers[i]
        if choice_parser is None:
            message = {"content": delta.text} if delta.text else {}
        else:
            cut = delta.finished and delta.output.finish_reason == "length"
            message = R.merge_delta(choice_parser.feed(delta.text, final=delta.finished, cut=cut))
        if not message and not delta.finished and not want_lp:
            return None
        choice: JsonObject = {"index": i, "delta": message, "logprobs": None, "finish_reason": None}
        if want_lp:
            ended = delta.finished and R.ended_on_stop_token(delta.output, delta.text, tt)
            choice["logprobs"] = tt.chat_logprobs(delta.token_ids, delta.logprobs, ended)
        if delta.finished:
            choice["finish_reason"] = R.tool_finish_reason(delta.output.finish_reason, choice_parser)
            choice["stop_reason"] = delta.output.stop_reason
        return choice

    return _events(stream, make_choice, head, rid, "chat.completion.chunk", created, model, n, include_usage)
