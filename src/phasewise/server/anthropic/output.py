"""A Messages reply: its content blocks (thinking, text, tool_use), the SSE events that build them, and the
message around them.

The reply's text goes through the chat path's ReplyParser, whose pieces become content blocks: thinking
(signed: signature.py), text, and tool_use with its input (streamed as input_json_delta fragments). A
streamed and a collected reply are built by the same `Blocks`, so they hold the same blocks.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from phasewise import json_types
from phasewise.json_types import JsonObject
from phasewise.outputs import CompletionOutput
from phasewise.server.anthropic.caching import TTLS
from phasewise.server.anthropic.protocol import error_body
from phasewise.server.anthropic.signature import ThinkingSignature
from phasewise.server.api_error import APIError
from phasewise.server.chat_call import ChatCall
from phasewise.server.errors import EngineError
from phasewise.server.reply_parser import ReplyParser
from phasewise.server.request_stream import RequestStream
from phasewise.server.sse import failure
from phasewise.server.timings import timings

Event = tuple[str, JsonObject]              # (event name, its data)


class Blocks:
    """A reply's content blocks, built from a ReplyParser's pieces (or plain text) as they come:
    `add` returns the events that open, extend and close blocks; `content` is the blocks so far.
    single_call: tool calls after the first are dropped (disable_parallel_tool_use); signature: what
    signs a thinking block as it closes (a signature_delta before its content_block_stop). A tool_use
    block's events are held until it closes, so a call cut off by max_tokens (which the parser drops)
    never shows as a half tool_use."""

    def __init__(self, parser: ReplyParser | None, single_call: bool,
                 signature: ThinkingSignature | None = None
                 ) -> None:
        self.parser, self.single_call, self.signature = parser, single_call, signature or ThinkingSignature()
        self.content: list[JsonObject] = []
        self._open: str | int | None = None         # "text", a call's index, or None
        self._arguments: list[str] = []             # each call's input JSON text so far
        self._held: list[Event] = []                # the open tool_use block's events

    def add(self, text: str, final: bool, cut: bool = False) -> list[Event]:
        """cut: the output ended at max_tokens (a call it was writing is dropped, not half given)."""
        pieces: list[JsonObject] = self.parser.feed(text, final, cut) if self.parser else \
            [{"content": text}] if text else []
        events: list[Event] = []
        for piece in pieces:
            if "reasoning" in piece:
                events += self._thinking(json_types.text(piece["reasoning"]))
            if "content" in piece:
                events += self._text(json_types.text(piece["content"]))
            for call in json_types.objects(piece.get("tool_calls")):
                events += self._call(call)
        if final:
            events += self._close()
        self._held += events
        start = self._open_call_start()
        events, self._held = (self._held, []) if start is None else (self._held[:start], self._held[start:])
        return events

    def _open_call_start(self) -> int | None:
        """Where the open tool_use block's events start among those held (None: no tool_use is open)."""
        if not isinstance(self._open, int):
            return None
        index = len(self.content) - 1
        return next((i for i, (name, data) in enumerate(self._held)
                     if name == "content_block_start" and data["index"] == index), len(self._held))

    @property
    def calls(self) -> bool:
        return any(b["type"] == "tool_use" for b in self.content)

    def _start(self, kind: str | int, block: JsonObject) -> list[Event]:
        events = self._close()
        self._open = kind
        self.content.append(block)
        shown = {**block, "input": {}} if block["type"] == "tool_use" else dict(block)
        return events + [("content_block_start",
                          {"type": "content_block_start", "index": len(self.content) - 1,
                           "content_block": shown})]

    def _delta(self, delta: JsonObject) -> Event:
        return "content_block_delta", {"type": "content_block_delta",
                                       "index": len(self.content) - 1, "delta": delta}

    def _text(self, text: str) -> list[Event]:
        events = [] if self._open == "text" else self._start("text", {"type": "text", "text": ""})
        block = self.content[-1]
        block["text"] = json_types.text(block["text"]) + text
        return events + [self._delta({"type": "text_delta", "text": text})]

    def _thinking(self, text: str) -> list[Event]:
        events = [] if self._open == "thinking" else \
            self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        block = self.content[-1]
        block["thinking"] = json_types.text(block["thinking"]) + text
        return events + [self._delta({"type": "thinking_delta", "thinking": text})]

    def _call(self, call: JsonObject) -> list[Event]:
        """`call`: a ToolCallParser piece's tool_calls entry (a new call, or a fragment of its arguments)."""
        index, events = json_types.integer(call["index"]), []
        if self.single_call and index > 0:
            return []
        function = json_types.obj(call["function"])
        if "id" in call:
            self._arguments.append("")
            toolu = "toolu_" + json_types.text(call["id"]).removeprefix("call_")
            events = self._start(index,
                                 {"type": "tool_use", "id": toolu, "name": function["name"], "input": {}})
        fragment = json_types.text(function.get("arguments") or "")
        if not fragment:
            return events
        self._arguments[index] += fragment
        return events + [self._delta({"type": "input_json_delta", "partial_json": fragment})]

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        events: list[Event] = []
        if isinstance(self._open, int):
            if self.parser is not None and self._open >= len(self.parser.calls):   # cut off: dropped
                start = self._open_call_start()
                self._held, self._open = self._held[:start], None
                self.content.pop()
                return []
            self.content[-1]["input"] = _input(self._arguments[self._open])
        if self._open == "thinking":
            block = self.content[-1]
            block["signature"] = self.signature.sign(json_types.text(block["thinking"]))
            events.append(self._delta({"type": "signature_delta", "signature": block["signature"]}))
        self._open = None
        return events + [("content_block_stop",
                          {"type": "content_block_stop", "index": len(self.content) - 1})]


def _input(arguments: str) -> JsonObject:
    """A call's input object; {} for arguments that are not one (a call cut off by max_tokens)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(out: CompletionOutput, calls: bool) -> str:
    if out.finish_reason == "length":
        return "max_tokens"
    if isinstance(out.stop_reason, str):
        return "stop_sequence"
    return "tool_use" if calls else "end_turn"


def usage(out: CompletionOutput) -> JsonObject:
    """Anthropic's usage, as the engine did it: cache_read_input_tokens the prompt tokens the prefix cache
    served (from RAM or disk, marked or not); cache_creation_input_tokens the tokens of cache_control
    breakpoints' prefixes this request entered in the cache (whole blocks it computed that the cache did not
    hold: `RequestMetrics.cache_written`), split by ttl; input_tokens the rest of the prompt."""
    read, written = out.cached_tokens, out.metrics.cache_written
    hour = sum(n for ttl, n in written.items() if ttl >= TTLS["1h"])
    created = sum(written.values())
    return {"input_tokens": max(0, len(out.prompt_token_ids) - read - created),
            "cache_creation_input_tokens": created, "cache_read_input_tokens": read,
            "output_tokens": len(out.token_ids),
            "cache_creation": {"ephemeral_5m_input_tokens": created - hour,
                               "ephemeral_1h_input_tokens": hour}}


def _message(rid: str, model: str, content: list[JsonObject], reason: str | None, sequence: str | None,
             use: JsonObject) -> JsonObject:
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": [*content],
            "stop_reason": reason, "stop_sequence": sequence, "usage": use}


def message_body(call: ChatCall, model: str, out: CompletionOutput, single_call: bool,
                 signature: ThinkingSignature | None = None) -> JsonObject:
    """The message of a finished output; APIError (500) when the engine gave none."""
    cause = failure(out)
    if cause is not None:
        raise APIError(500, cause, type="server_error", code="engine_error")
    blocks = Blocks(call.parser(), single_call, signature)
    blocks.add(out.text, final=True, cut=out.finish_reason == "length")
    sequence = out.stop_reason if isinstance(out.stop_reason, str) else None
    return {**_message(call.rid, model, blocks.content, stop_reason(out, blocks.calls), sequence, usage(out)),
            "timings": timings(out)}                 # phasewise's: where the time went (thinking apart)


def _sse(name: str, data: JsonObject) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _error(message: str) -> str:
    return _sse("error", error_body(500, message))


async def message_events(stream: RequestStream, call: ChatCall, model: str, single_call: bool,
                         signature: ThinkingSignature | None = None) -> AsyncIterator[str]:
    """message_start (once the prompt has run: its usage is known), a ping, the blocks' events,
    message_delta with the stop reason and usage, message_stop. An engine failure: an error event."""
    blocks = Blocks(call.parser(), single_call, signature)
    started = False
    try:
        async for delta in stream:
            out = delta.output
            if not started:
                started = True
                yield _sse("message_start", {"type": "message_start",
                                             "message": _message(call.rid, model, [], None, None,
                                                                 {**usage(out), "output_tokens": 0})})
                yield _sse("ping", {"type": "ping"})
            cause = failure(out) if delta.finished else None
            if cause is not None:
                yield _error(cause)
                return
            for name, data in blocks.add(delta.text, delta.finished, out.finish_reason == "length"):
                yield _sse(name, data)
            if delta.finished:
                sequence = out.stop_reason if isinstance(out.stop_reason, str) else None
                yield _sse("message_delta", {"type": "message_delta",
                                             "delta": {"stop_reason": stop_reason(out, blocks.calls),
                                                       "stop_sequence": sequence},
                                             "usage": usage(out), "timings": timings(out)})
                yield _sse("message_stop", {"type": "message_stop"})
    except EngineError as e:
        yield _error(str(e))
    finally:
        stream.close()
