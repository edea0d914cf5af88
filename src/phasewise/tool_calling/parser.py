"""ToolCallParser: a model's output → content and tool calls, as the text streams in.

Three output formats. "hermes" (Qwen2.5, Qwen3, Hermes, and phasewise's own prompt for templates
without tools): calls are `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, possibly
several, possibly after some text; with the request's tool names, also a reply that is nothing but
untagged call objects, bare or in a ```json fence (as small models write them). "llama3_json" (Llama
3.1, 3.2): the whole reply is one JSON object `{"name": ..., "parameters": {...}}`, optionally after
`<|python_tag|>`; several are joined by "; ".
"mistral": the whole reply is `[TOOL_CALLS]` and a JSON list of `{"name", "arguments"}` objects (or,
in Mistral's newer templates, `[TOOL_CALLS]name[ARGS]{...}` per call); its call ids are 9 letters
and digits, as Mistral's templates demand of the ids sent back.

`feed` returns OpenAI delta pieces: {"content": text} or {"tool_calls": [{"index", "id", "type",
"function": {"name", "arguments"}}]} for a new call, then {"tool_calls": [{"index", "function":
{"arguments": fragment}}]} for its arguments as they arrive. The fragments of a call add up to its
`arguments`; text that might still turn out to be part of a call is held back until it is known.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

import regex

from phasewise import json_types

if TYPE_CHECKING:
    from phasewise.json_types import JsonObject

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
ToolFormat = Literal["hermes", "llama3_json", "mistral"]   # how a model writes its tool calls
FORMATS: tuple[ToolFormat, ...] = get_args(ToolFormat)
_ALNUM = string.ascii_letters + string.digits
# the start of a call object whose name comes first: {"name": "f", "arguments": (arguments follow)
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')
# Untagged calls as small models write them (Qwen2.5-Coder among them; llama.cpp reads the same): a call
# object, several, or a list of them, bare or in a ```json / ```xml fence, maybe inside a wrapper tag. A
# reply that opens so is held to its end (regex's partial match tells while the opening is still unsure).
_WRAPPERS = "function_call|tools|response"
_BARE_OPEN = regex.compile(r"\s*(?:```(?:json|xml)?[ \t]*\n\s*(?:<(?:tool_call|%s)>\s*)?|<(?:%s)>\s*)?[\[{]"
                           % (_WRAPPERS, _WRAPPERS))
_FENCE = re.compile(r"```(?:json|xml)?[ \t]*\n(?P<body>.*?)\s*```", re.S)
_NEXT = re.compile(r"\S")
_NAME_KEY = re.compile(r'\{\s*"name"\s*:')
_WRAPPED = re.compile(r"<(?P<tag>tool_call|%s)>(?P<body>.*?)(?:</(?P=tag)>)?" % _WRAPPERS, re.S)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str            # a JSON object's text

    def as_dict(self) -> JsonObject:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _call_object(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a call object's text, or None when it is not one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return _call_value(obj)


def _call_value(obj: object) -> tuple[str, str] | None:
    """(name, arguments JSON) of a parsed call object, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):          # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return (obj["name"], json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None


class ToolCallParser:
    """tool_names: the request's tools. With them, a hermes reply that is nothing but untagged call objects
    (as small models often write them) naming them is those calls; such a reply is held back until it
    ends. max_calls: calls past it are dropped, text and all (parallel_tool_calls false, as vLLM does)."""

    def __init__(self, fmt: ToolFormat = "hermes", tool_names: set[str] | frozenset[str] = frozenset(),
                 max_calls: int | None = None) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool-call format {fmt!r}")
        self.fmt, self.tool_names, self.max_calls = fmt, tool_names, max_calls
        self._calls: list[ToolCall] = []   # every call found; `calls` the ones given out
        self.content = ""             # the content given out so far
        self._buf = ""                # text not yet given out
        # trailing whitespace of the content, held until more content (a call drops it)
        self._space = ""
        self._in_call = False
        self._head: int | None = None   # in a call whose name is out: where its arguments start in _buf
        self._sent = 0                # characters of the current call's arguments given out
        self._mode: str | None = None   # "call"/"bare" or "text" once the reply's first character decides

    def feed(self, text: str, final: bool = False, cut: bool = False) -> list[JsonObject]:
        """cut (with final): the output was cut off by the token limit, so an unfinished call is dropped
        (its text, and from `calls` the call itself if its name was out) rather than given out as text."""
        if final and cut:
            out = self.feed(text)                  # what is whole, then the unfinished call is dropped
            dropped = self._drop_unfinished()
            out = [d for d in out
                   if not any(c.get("index") == dropped for c in json_types.objects(d.get("tool_calls")))]
            return out + self.feed("", final=True)
        self._buf += text
        bare = self.fmt == "hermes" and bool(self.tool_names)
        out = self._bare(final) if bare else []
        if not bare or self._mode == "text":
            out += self._hermes(final) if self.fmt == "hermes" else self._whole_reply(final)
        if final and self._space and not self._calls:
            out.append(self._content("", flush=True))
        return [d for d in out if d]

    def _drop_unfinished(self) -> int | None:
        """The output was cut off: the call being written (or the start of its tag, or a held reply that
        opens as a call) is dropped, and so is a call whose name was given out before its end (its index
        returned)."""
        held = _held(self._buf, OPEN) if self.fmt == "hermes" and self._mode != "bare" else 0
        if self.fmt == "hermes" and self._in_call:
            self._buf, self._in_call, self._space = "", False, ""
            if self._head is not None:
                self._calls.pop()
                return len(self._calls)
        elif held:
            self._buf, self._space = self._buf[:len(self._buf) - held], ""
        elif self._mode in ("bare", "call") and _unfinished_call(self._buf):
            self._buf = ""
        return None

    @property
    def calls(self) -> list[ToolCall]:
        return self._calls[:self.max_calls]

    def _dropping(self) -> bool:
        """The current call is past max_calls: none of it is given out."""
        return self.max_calls is not None and len(self._calls) > self.max_calls

    def _content(self, text: str, flush: bool = False) -> JsonObject:
        """Give out content, but hold its trailing whitespace until more content follows (a call drops it)."""
        text = self._space + text
        body = text if flush else text.rstrip()
        self._space = text[len(body):]
        if not body:
            return {}
        self.content += body
        return {"content": body}

    def _new_call(self, name: str, arguments: str = "") -> JsonObject:
        call_id = "".join(secrets.choice(_ALNUM) for _ in range(9)) if self.fmt == "mistral" \
            else f"call_{uuid.uuid4().hex[:24]}"
        self._calls.append(ToolCall(call_id, name, arguments))
        if self._dropping():
            return {}
        return {"tool_calls": [{"index": len(self._calls) - 1, "id": self._calls[-1].id, "type": "function",
                                "function": {"name": name, "arguments": arguments}}]}

    def _arguments(self, upto: str) -> JsonObject:
        """Give out the current call's arguments up to the text `upto` (a prefix of its final text)."""
        piece, call = upto[self._sent:], self._calls[-1]
        if not piece:
            return {}
        self._sent, call.arguments = len(upto), call.arguments + piece
        if self._dropping():
            return {}
        return {"tool_calls": [{"index": len(self._calls) - 1, "function": {"arguments": piece}}]}

    def _hermes(self, final: bool) -> list[JsonObject]:
        out: list[JsonObject] = []
        while True:
            if not self._in_call:
                at = self._buf.find(OPEN)
                if at < 0:
                    keep = 0 if final else _held(self._buf, OPEN)
                    out.append(self._content(self._buf[:len(self._buf) - keep]))
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                out.append(self._content(self._buf[:at]))
                self._buf, self._in_call, self._head, self._sent = self._buf[at + len(OPEN):], True, None, 0
            end = self._buf.find(CLOSE)
            body = self._buf if end < 0 else self._buf[:end]
            if self._head is None and (m := _HEAD.match(body)):
                out.append(self._new_call(json.loads(f'"{m.group(1)}"')))
                self._head = m.end()
            if end < 0 and not final:
                if self._head is not None:   # hold back the last "}" (the call's own) and the space before it
                    args = body[self._head:]
                    cut = args.rfind("}")
                    out.append(self._arguments(args[:cut if cut >= 0 else len(args)].rstrip()))
                return out
            out.extend(self._end_call(body, closed=end >= 0))
            self._buf, self._in_call = ("" if end < 0 else self._buf[end + len(CLOSE):]), False
            if end < 0:
                return out

    def _end_call(self, body: str, closed: bool) -> list[JsonObject]:
        """The call's whole text is known (closed: it ended with CLOSE): give out what is left of it."""
        if self._head is not None:                 # its name is out: the arguments are the text up to its "}"
            args = body[self._head:].rstrip()
            return [self._arguments(args[:-1].rstrip() if args.endswith("}") else args)]
        parsed = _call_object(body.strip())
        if parsed is None:                         # not a call after all: it was content
            return [self._content(OPEN + body + (CLOSE if closed else ""))]
        return [self._new_call(*parsed)]

    def _bare(self, final: bool) -> list[JsonObject]:
        """hermes with tool names: a reply opening as an untagged call (_BARE_OPEN) waits for its end, then
        is calls if it is nothing but calls of the request's tools."""
        if self._mode is None:
            opening = _BARE_OPEN.match(self._buf, partial=not final)
            if opening is not None and opening.partial:
                return []                          # too short to tell
            self._mode = "bare" if opening is not None else "text"
        if self._mode != "bare" or not final:
            return []
        parsed = _bare_calls(self._buf)
        if parsed and all(name in self.tool_names for name, _ in parsed):
            self._buf = ""
            return [self._new_call(*p) for p in parsed]
        self._mode = "text"                        # not a call: parse it as any other reply
        return []

    def _whole_reply(self, final: bool) -> list[JsonObject]:
        """llama3_json and mistral: a reply that starts as a call is held to its end, then read whole."""
        tag = PYTHON_TAG if self.fmt == "llama3_json" else TOOL_CALLS
        if self._mode is None:
            start = self._buf.lstrip()
            if not start or (tag.startswith(start) and not final):
                return []
            opens = ("{", tag) if self.fmt == "llama3_json" else (tag,)
            self._mode = "call" if start.startswith(opens) else "text"
        if self._mode == "text":
            text, self._buf = self._buf, ""
            return [self._content(text, flush=True)]
        if not final:
            return []
        text, self._buf = self._buf.strip(), ""
        parsed = _llama3_calls(text) if self.fmt == "llama3_json" else _mistral_calls(text)
        if parsed is None:
            return [self._content(text, flush=True)]
        return [self._new_call(*p) for p in parsed]


def _bare_calls(text: str) -> list[tuple[str, str]] | None:
    """The calls of a whole untagged reply: call objects or lists of them one after another, maybe in a
    fence and a wrapper tag; None when anything else is in it."""
    body = text.strip()
    for wrapper in (_FENCE, _WRAPPED):
        if m := wrapper.fullmatch(body):
            body = m["body"].strip()
    decoder, values, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            value, end = decoder.raw_decode(body, at)
        except ValueError:
            return None
        values.extend(value if isinstance(value, list) else [value])
        after = _NEXT.search(body, end)      # the next value's start, past whitespace
        at = after.start() if after else len(body)
    return _every([_call_value(v) for v in values]) if values else None


def _unfinished_call(text: str) -> bool:
    """A held reply (a bare call, llama3_json's or mistral's) that is not whole: it was cut off mid-call."""
    whole = _bare_calls(text) or _llama3_calls(text.strip()) or _mistral_calls(text.strip())
    return whole is None and (text.lstrip().startswith(TOOL_CALLS) or _NAME_KEY.search(text) is not None)


def _llama3_calls(text: str) -> list[tuple[str, str]] | None:
    body = text.removeprefix(PYTHON_TAG)
    return _every([_call_object(part) for part in body.split("; ")]) if body else None


def _mistral_calls(text: str) -> list[tuple[str, str]] | None:
    """`[TOOL_CALLS][{...}, ...]`, or `[TOOL_CALLS]name[ARGS]{...}` repeated; None when it is neither."""
    body = text.removeprefix(TOOL_CALLS).strip()
    if body.startswith("["):
        try:
            items = json.loads(body)
        except ValueError:
            return None
        if not isinstance(items, list) or not items:
            return None
        return _every([_call_object(json.dumps(item)) for item in items])
    calls = []
    for part in body.split(TOOL_CALLS):
        name, sep, args = part.partition(ARGS)
        call = _call_object(json.dumps({"name": name.strip(), "arguments": json.loads(args)})) \
            if sep and _is_json(args) else None
        if call is None:
            return None
        calls.append(call)
    return calls


def _every(calls: list[tuple[str, str] | None]) -> list[tuple[str, str]] | None:
    """The calls, when every part was one; else None."""
    found = [c for c in calls if c is not None]
    return found if len(found) == len(calls) else None


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
