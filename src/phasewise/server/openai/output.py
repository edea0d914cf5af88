"""Engine outputs → the bodies of OpenAI's completions and chat completions: choices, chunks, logprobs,
usage."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Protocol

from phasewise.core.request import TokenLogprobs
from phasewise.json_types import JsonObject, JsonValue
from phasewise.outputs import CompletionOutput
from phasewise import json_types
from phasewise.server.reply_parser import ReplyParser
from phasewise.server.timings import timings


class TokenBytes(Protocol):
    """What TokenText reads of a tokenizer (phasewise.tokenization.tokenizer.Tokenizer has it)."""

    def token_bytes(self, token_id: int) -> bytes: ...


def usage(per_prompt: Sequence[CompletionOutput], outputs: Sequence[CompletionOutput]) -> JsonObject:
    """Prompt tokens counted once per prompt (not per choice), of them those the prefix cache served
    (cached_tokens) and those of cache breakpoints' prefixes the request wrote (cache_write_tokens);
    completion tokens over all choices, of them the thinking's (reasoning_tokens)."""
    prompt = sum(len(o.prompt_token_ids) for o in per_prompt)
    completion = sum(len(o.token_ids) for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in per_prompt),
                                      "cache_write_tokens": sum(sum(o.metrics.cache_written.values())
                                                                for o in per_prompt)},
            "completion_tokens_details": {"reasoning_tokens": reasoning_tokens(outputs)}}


def reasoning_tokens(outputs: Sequence[CompletionOutput]) -> int:
    """The outputs' tokens inside thinking blocks, as the engine counted them."""
    return sum(o.metrics.thinking_tokens for o in outputs)


class TextOffsets:
    """Characters of text so far, counted from token bytes (a character split over tokens counts
    once, at the token that completes it): the legacy completions format's text_offset."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.chars = 0

    def add(self, data: bytes) -> int:
        """The offset of a token with these bytes; then counts its completed characters."""
        at = self.chars
        self.chars += len(self._decoder.decode(data))
        return at


class TokenText:
    """Token id → its bytes and its display text (special tokens kept), cached; and the logprob
    bodies built from them. A token that is not whole UTF-8 on its own (part of a character) is
    shown as OpenAI shows it, "bytes:\\xNN...", and its `bytes` are its own."""

    def __init__(self, tokenizer: TokenBytes) -> None:
        self.bytes = lru_cache(maxsize=65536)(tokenizer.token_bytes)
        self._text = lru_cache(maxsize=65536)(self._display)

    def _display(self, token_id: int) -> str:
        data = self.bytes(token_id)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)

    def __call__(self, token_id: int) -> str:
        return self._text(token_id)

    def completion_logprobs(self, token_ids: Sequence[int], lps: Sequence[TokenLogprobs | None],
                            offsets: TextOffsets | None = None) -> JsonObject:
        """The legacy completions format (tokens, token_logprobs, top_logprobs, text_offset: one entry per
        token in each list); text_offset continues `offsets` (a stream's, chunk to chunk). A None entry (an
        echoed prompt's first token) has null logprobs, as in vLLM."""
        offsets = offsets or TextOffsets()
        return {
            "tokens": [self(t) for t in token_ids],
            "token_logprobs": [lp.logprob if lp else None for lp in lps],
            "top_logprobs": [{self(i): v for i, v in lp.top} if lp else None for lp in lps],
            "text_offset": [offsets.add(self.bytes(t)) for t in token_ids],
        }

    def text(self, token_ids: Sequence[int]) -> str:
        return b"".join(self.bytes(t) for t in token_ids).decode("utf-8", errors="replace")

    def chat_logprobs(self, token_ids: Sequence[int], lps: Sequence[TokenLogprobs], ended: bool = False
                      ) -> JsonObject:
        """{"content": one entry per token of the message's content: token, logprob, bytes and its
        top_logprobs (each token, logprob, bytes)}. `ended`: the last token is the stop token that ended
        the turn (an end-of-turn or a stop_token_ids token), which the content does not hold, so it has
        no entry (the entries' bytes rebuild the content)."""
        def entry(i: int, v: float) -> JsonObject:
            return {"token": self(i), "logprob": v, "bytes": list(self.bytes(i))}
        n = len(token_ids) - 1 if ended and token_ids else len(token_ids)
        return {"content": [{**entry(t, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                            for t, lp in zip(token_ids[:n], lps[:n])]}


def ended_on_stop_token(out: CompletionOutput, text: str, tt: TokenText) -> bool:
    """The output finished on a stop token (an end of turn or one of stop_token_ids; not a stop
    string, not its length) that `text` (its text, or its last delta's) does not end with: skipped
    as a special token, so the content does not hold it."""
    return (out.finish_reason == "stop" and not isinstance(out.stop_reason, str) and bool(out.token_ids)
            and not text.endswith(tt(out.token_ids[-1])))


def _stop_reason(out: CompletionOutput) -> str | int | None:
    return out.stop_reason


def echoed(out: CompletionOutput, tt: TokenText) -> tuple[str, list[int], list[TokenLogprobs | None]]:
    """With echo: the prompt's text (as sent, or its tokens' text), tokens and logprobs, which come
    before the completion's."""
    text = out.prompt if out.prompt is not None else tt.text(out.prompt_token_ids)
    return text, list(out.prompt_token_ids), list(out.prompt_logprobs or [None] * len(out.prompt_token_ids))


def completion_body(rid: str, created: int, model: str, outputs: Sequence[CompletionOutput],
                    want_logprobs: bool, *, n: int, tt: TokenText, echo: bool = False) -> JsonObject:
    """outputs: n choices per prompt, prompt by prompt."""
    choices: list[JsonValue] = []
    for i, out in enumerate(outputs):
        text, ids, lps = echoed(out, tt) if echo else ("", [], [])
        lps += out.logprobs or []
        logprobs = tt.completion_logprobs(ids + out.token_ids, lps) if want_logprobs else None
        choice: JsonObject = {"index": i, "text": text + out.text, "logprobs": logprobs,
                              "finish_reason": out.finish_reason, "stop_reason": _stop_reason(out)}
        if len(outputs) > 1:
            choice["timings"] = timings(out)
        choices.append(choice)
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage(outputs[::n], outputs), "timings": timings(outputs[0])}


def tool_finish_reason(reason: str | None, parser: ReplyParser | None) -> str | None:
    """"tool_calls" for an output that ended on its own after calling tools (OpenAI's finish reason)."""
    return "tool_calls" if parser is not None and parser.calls and reason == "stop" else reason


ParserFactory = Callable[[], ReplyParser | None]   # a fresh parser for a choice (ChatCall.parser)


def no_parser() -> None:
    """The ParserFactory of a request without tools: its text is all content."""
    return None


def chat_message(out: CompletionOutput, parser: ReplyParser | None) -> tuple[JsonObject, str | None]:
    """The assistant message of a finished output and its finish reason: with a parser, the thinking as
    reasoning_content (and vLLM's newer `reasoning`; null when none), the calls found in the answer as
    tool_calls (content: the text around them, or null)."""
    if parser is None:
        return {"role": "assistant", "content": out.text}, out.finish_reason
    cut = out.finish_reason == "length"          # a call cut off by max_tokens is dropped, not given as text
    parser.feed(out.text, final=True, cut=cut)
    message: JsonObject = {"role": "assistant",
                           "content": parser.content or (None if parser.reasoning else "")}
    if parser.thinks:
        message["reasoning_content"] = message["reasoning"] = parser.reasoning or None
    if not parser.calls:
        return message, out.finish_reason
    message.update(content=parser.content or None, tool_calls=[c.as_dict() for c in parser.calls])
    return message, tool_finish_reason(out.finish_reason, parser)


def merge_delta(pieces: Sequence[JsonObject]) -> JsonObject:
    """A parser's pieces of one step as one chat delta: reasoning (as reasoning_content and reasoning) and
    content joined, each call's pieces in one entry."""
    delta: JsonObject = {}
    calls: list[JsonValue] = []
    functions: dict[int, JsonObject] = {}           # each call's function entry, by the call's index
    for piece in pieces:
        if "reasoning" in piece:
            thought = json_types.text(delta.get("reasoning", "")) + json_types.text(piece["reasoning"])
            delta["reasoning_content"] = delta["reasoning"] = thought
        if "content" in piece:
            delta["content"] = json_types.text(delta.get("content", "")) + json_types.text(piece["content"])
        for call in json_types.objects(piece.get("tool_calls")):
            index, function = json_types.integer(call["index"]), json_types.obj(call["function"])
            same = functions.get(index)
            if same is None:
                functions[index] = dict(function)
                calls.append({**call, "function": functions[index]})
                delta["tool_calls"] = calls
            else:
                more = json_types.text(function["arguments"])
                same["arguments"] = json_types.text(same.get("arguments", "")) + more
    return delta


def chat_body(rid: str, created: int, model: str, outputs: Sequence[CompletionOutput], want_logprobs: bool,
              *, tt: TokenText, parser: ParserFactory = no_parser) -> JsonObject:
    choices: list[JsonValue] = []
    for i, out in enumerate(outputs):
        message, finish_reason = chat_message(out, parser())
        logprobs = None if not want_logprobs else \
            tt.chat_logprobs(out.token_ids, out.logprobs or [], ended_on_stop_token(out, out.text, tt))
        choice: JsonObject = {"index": i, "message": message, "logprobs": logprobs,
                              "finish_reason": finish_reason, "stop_reason": _stop_reason(out)}
        if len(outputs) > 1:
            choice["timings"] = timings(out)
        choices.append(choice)
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage(outputs[:1], outputs), "timings": timings(outputs[0])}


def chunk(rid: str, obj: str, created: int, model: str, choices: list[JsonValue],
          include_usage: bool, **extra: JsonValue) -> JsonObject:
    body: JsonObject = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if include_usage:
        body["usage"] = None
    body.update(extra)
    return body
