"""A /v1/responses call's output: its items (messages, function calls), the stream events that add up
to them, and the response object around them.

`OutputItems` reads an output's text as it streams (through a ReplyParser when the request has tools
or the server reads thinking): thinking opens a reasoning item, content a message item, a call a
function_call item; each step gives the Responses stream events of what changed. A collected output
goes through the same class, so a streamed response and a collected one have the same items.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence

from phasewise.json_types import JsonObject, JsonValue
from phasewise.outputs import CompletionOutput
from phasewise import json_types
from phasewise.server.openai.caching import written_by_ttl
from phasewise.server.reply_parser import ReplyParser
from phasewise.server.timings import timings
from phasewise.server.responses.protocol import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """The output items of one engine output; `feed` and `finish` return the stream events (dicts with
    a type, without sequence_number) of what each step added. custom: the request's custom tools, whose
    calls become custom_tool_call items (their input: the `input` argument); bare_call: the custom tool
    a call is forced to, whose input is the whole output. A call item's events are held until it closes,
    so a call cut off by max_output_tokens (which the parser drops) never shows. prompt_only: a prewarm's
    output, no items at all."""

    def __init__(self, parser: ReplyParser | None, custom: frozenset[str] = frozenset(),
                 bare_call: str | None = None, prompt_only: bool = False) -> None:
        self.parser, self.custom, self.bare_call, self.prompt_only = parser, custom, bare_call, prompt_only
        self.items: list[JsonObject] = []
        self._open: JsonObject | None = None              # the item being written, last of items
        self._custom_args = ""                            # a custom call's arguments (JSON) so far
        self._held: list[JsonObject] = []                 # the open call item's events

    def feed(self, text: str, final: bool = False, cut: bool = False) -> list[JsonObject]:
        """cut: the output ended at max_output_tokens (a call it was writing is dropped, not half given)."""
        if self.bare_call is not None:
            return self._bare_input(text)
        pieces: list[JsonObject] = self.parser.feed(text, final, cut) if self.parser else \
            [{"content": text}] if text else []
        events: list[JsonObject] = []
        for piece in pieces:
            if "reasoning" in piece:
                events += self._reasoning(json_types.text(piece["reasoning"]))
            if "content" in piece:
                events += self._content(json_types.text(piece["content"]))
            for call in json_types.objects(piece.get("tool_calls")):
                function = json_types.obj(call["function"])
                arguments = json_types.text(function["arguments"])
                if "id" in call:
                    events += self._call(json_types.text(call["id"]),
                                         json_types.text(function["name"]), arguments)
                else:
                    events += self._arguments(arguments)
        return self._release(events)

    def finish(self, status: str) -> list[JsonObject]:
        """Close the open item (status "completed" or "incomplete"); no output at all is one empty message
        (none for a prewarm)."""
        if self.prompt_only:
            return []
        if self._open is not None and self.parser is not None and "call_id" in self._open \
                and self._open["call_id"] not in {c.id for c in self.parser.calls}:     # cut off: dropped
            self._held = self._held[:self._open_call_start()]
            self.items.pop()
            self._open = None
        events = [] if self.items else \
            self._bare_input("") if self.bare_call is not None else self._content("")
        return self._release(events + self._close("completed" if status == "completed" else "incomplete"))

    def _release(self, events: list[JsonObject]) -> list[JsonObject]:
        """The events that may go out: all but those of an open call item."""
        self._held += events
        start = self._open_call_start()
        out, self._held = (self._held, []) if start is None else (self._held[:start], self._held[start:])
        return out

    def _open_call_start(self) -> int | None:
        """Where the open call item's events start among those held (None: no call item is open)."""
        if self._open is None or "call_id" not in self._open or self.bare_call is not None:
            return None                                    # a message or reasoning item streams as it comes
        index = len(self.items) - 1
        return next((i for i, e in enumerate(self._held)
                     if e["type"] == "response.output_item.added" and e["output_index"] == index),
                    len(self._held))

    def _where(self) -> JsonObject:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1}

    def _add(self, item: JsonObject) -> list[JsonObject]:
        events = self._close("completed")
        self.items.append(item)
        self._open = item
        return events + [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                          "item": json.loads(json.dumps(item))}]

    def _content(self, text: str) -> list[JsonObject]:
        events: list[JsonObject] = []
        if self._open is None or self._open["type"] != "message":
            content: list[JsonValue] = []
            events += self._add({"type": "message", "id": new_id("msg"), "status": "in_progress",
                                 "role": "assistant", "content": content})
            part: JsonObject = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append({"type": "response.content_part.added", **self._where(), "content_index": 0,
                           "part": dict(part)})
            content.append(part)
        if text:
            part = _text_part(self._open)
            part["text"] = json_types.text(part["text"]) + text
            events.append({"type": "response.output_text.delta", **self._where(), "content_index": 0,
                           "delta": text, "logprobs": []})
        return events

    def _reasoning(self, text: str) -> list[JsonObject]:
        """Thinking: a reasoning item (its text in one reasoning_text part), opened by the first."""
        events: list[JsonObject] = []
        if self._open is None or self._open["type"] != "reasoning":
            part: JsonObject = {"type": "reasoning_text", "text": ""}
            events += self._add({"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [part],
                                 "status": "in_progress"})
            events.append({"type": "response.content_part.added", **self._where(), "content_index": 0,
                           "part": dict(part)})
        part = _text_part(self._open)
        part["text"] = json_types.text(part["text"]) + text
        return events + [{"type": "response.reasoning_text.delta", **self._where(), "content_index": 0,
                          "delta": text}]

    def _call(self, call_id: str, name: str, arguments: str) -> list[JsonObject]:
        if name in self.custom:
            self._custom_args = arguments
            return self._add({"type": "custom_tool_call", "id": new_id("ctc"), "call_id": call_id,
                              "name": name, "input": "", "status": "in_progress"})
        events = self._add({"type": "function_call", "id": new_id("fc"), "call_id": call_id, "name": name,
                            "arguments": "", "status": "in_progress"})
        return events + self._arguments(arguments)

    def _bare_input(self, text: str) -> list[JsonObject]:
        """A forced custom call's input, the output's text as it comes."""
        events: list[JsonObject] = []
        if self._open is None:
            events = self._add({"type": "custom_tool_call", "id": new_id("ctc"), "call_id": new_id("call"),
                                "name": self.bare_call, "input": "", "status": "in_progress"})
        if text and self._open is not None:
            self._open["input"] = json_types.text(self._open["input"]) + text
            events.append({"type": "response.custom_tool_call_input.delta", **self._where(), "delta": text})
        return events

    def _arguments(self, fragment: str) -> list[JsonObject]:
        if self._open is not None and self._open["type"] == "custom_tool_call":
            self._custom_args += fragment        # given whole when the call ends (_close)
            return []
        if not fragment or self._open is None or self._open["type"] != "function_call":
            return []
        self._open["arguments"] = json_types.text(self._open["arguments"]) + fragment
        return [{"type": "response.function_call_arguments.delta", **self._where(), "delta": fragment}]

    def _close(self, status: str) -> list[JsonObject]:
        item = self._open
        if item is None:
            return []
        where, self._open = self._where(), None
        item["status"] = status
        events: list[JsonObject]
        if item["type"] == "message":
            part = _text_part(item)
            events = [{"type": "response.output_text.done", **where, "content_index": 0, "text": part["text"],
                       "logprobs": []},
                      {"type": "response.content_part.done", **where, "content_index": 0, "part": dict(part)}]
        elif item["type"] == "reasoning":
            part = _text_part(item)
            events = [{"type": "response.reasoning_text.done", **where, "content_index": 0,
                       "text": part["text"]},
                      {"type": "response.content_part.done", **where, "content_index": 0, "part": dict(part)}]
        elif item["type"] == "custom_tool_call":
            events = self._custom_done(item, where)
        else:
            events = [{"type": "response.function_call_arguments.done", **where, "name": item["name"],
                       "arguments": item["arguments"]}]
        return events + [{"type": "response.output_item.done", "output_index": where["output_index"],
                          "item": json.loads(json.dumps(item))}]


    def _custom_done(self, item: JsonObject, where: JsonObject) -> list[JsonObject]:
        """A custom call's input events: a parsed call's input (its `input` argument) whole, then done."""
        events: list[JsonObject] = []
        if self.bare_call is None:
            try:
                given = json.loads(self._custom_args or "{}")
            except ValueError:
                given = None
            value = given.get("input") if isinstance(given, dict) else None
            item["input"] = value if isinstance(value, str) else self._custom_args
            if item["input"]:
                events.append({"type": "response.custom_tool_call_input.delta", **where,
                               "delta": item["input"]})
        return events + [{"type": "response.custom_tool_call_input.done", **where, "input": item["input"]}]


def _text_part(message: JsonObject | None) -> JsonObject:
    """A message item's output_text part, or a reasoning item's reasoning_text part (its one content part)."""
    assert message is not None
    return json_types.obj(json_types.array(message["content"])[0])


def assistant_message(items: Sequence[JsonObject]) -> JsonObject:
    """The output items as one chat message, for the stored conversation."""
    text = "".join(json_types.text(p["text"]) for it in items if it["type"] == "message"
                   for p in json_types.objects(it["content"]))
    calls: list[JsonValue] = [
        {"id": it["call_id"], "type": "function",
         "function": {"name": it["name"], "arguments": it["arguments"]
                       if it["type"] == "function_call" else
                       json.dumps({"input": it["input"]}, ensure_ascii=False)}}
        for it in items if it["type"] in ("function_call", "custom_tool_call")]
    message: JsonObject = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    thought = "".join(json_types.text(p["text"]) for it in items if it["type"] == "reasoning"
                      for p in json_types.objects(it["content"]))
    if thought:
        message["reasoning_content"] = thought
    return message


def usage(out: CompletionOutput) -> JsonObject:
    """cached_tokens: the prompt tokens the prefix cache served; cache_write_tokens: those of cache
    breakpoints' prefixes the request wrote, also by ttl (openai/caching.py)."""
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    written = out.metrics.cache_written
    details: JsonObject = {"cached_tokens": out.cached_tokens, "cache_write_tokens": sum(written.values()),
                           "cache_write_tokens_details": written_by_ttl(written)}
    return {"input_tokens": prompt, "input_tokens_details": details,
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": out.metrics.thinking_tokens},
            "total_tokens": prompt + completion}


def status_of(out: CompletionOutput) -> str:
    """"completed", "incomplete" (max_output_tokens or the context ran out) or "failed"."""
    if out.finish_reason == "length":
        return "incomplete"
    return "completed" if out.finish_reason == "stop" else "failed"


def response_body(body: ResponsesRequest, rid: str, created: int, model: str, status: str,
                  items: list[JsonObject], out: CompletionOutput | None = None,
                  error: str | None = None) -> JsonObject:
    """The response object; `out`: the finished output (its usage), `error`: why it failed."""
    tool_choice = body.tool_choice if body.tool_choice is not None else "auto"
    return {
        "id": rid, "object": "response", "created_at": created, "status": status,
        "completed_at": created if status == "completed" else None,
        "error": {"code": "server_error", "message": error} if error else None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": model,
        "output": [*items], "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
        "store": body.stored, "temperature": body.temperature if body.temperature is not None else 1.0,
        "text": {"format": body.text_format, "verbosity": (body.text or {}).get("verbosity") or "medium"},
        "tool_choice": tool_choice, "max_tool_calls": body.max_tool_calls,
        "tools": [_tool(t) for t in body.tools or ()],
        "top_p": body.top_p if body.top_p is not None else 1.0, "truncation": body.truncation or "disabled",
        "usage": usage(out) if out is not None else None, "user": body.user,
        "metadata": {**(body.metadata or {})}, "background": bool(body.background),
        **({"timings": timings(out)} if out is not None else {}),      # phasewise's: where the time went
    }


def _tool(tool: JsonObject) -> JsonObject:
    if tool.get("type") == "custom":
        return {**tool}
    fn = tool.get("function")
    fn = fn if isinstance(fn, dict) else tool   # a chat-shaped tool is echoed flat
    return {"type": "function", "name": fn.get("name"), "description": fn.get("description"),
            "parameters": fn.get("parameters"), "strict": fn.get("strict")}


def sse(event: JsonObject, sequence_number: int) -> str:
    """One Responses stream event: its type on the `event:` line, the whole of it as data."""
    data = json.dumps({**event, "sequence_number": sequence_number}, ensure_ascii=False,
                      separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n"
