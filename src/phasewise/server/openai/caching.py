"""OpenAI's prompt caching fields as the engine's cache points: the body's `prompt_cache_options` and the
`prompt_cache_breakpoint` of a content part (a chat message's text part, a Responses input_text part).

A breakpoint, {"mode": "explicit"} with an optional ttl ("30m" or "12h"; default: the request's
`prompt_cache_options.ttl`, itself "30m" by default), marks the end of a reusable prefix: the request
cut just after that part, a `CachePoint` the engine measures in tokens as it does Anthropic's
cache_control (anthropic/caching.py), whose whole blocks are kept at least the ttl after each use, in
RAM and on disk. `prompt_cache_options` given with mode "implicit" (its default) adds one breakpoint
after the whole conversation (the prompt less its generation prompt) at its ttl; "explicit" adds none.
As OpenAI does, a request writes its latest four breakpoints (three and the implicit one). A body
with neither keeps the engine's default caching. Usage reports the marked tokens the request wrote
(`cache_write_tokens`; Responses also by ttl). Checked here, each a 400 naming the field: the shapes and
ttls; `prewarm` (Responses only: the prompt into the cache, no output; chat completions have no such field);
`comparison_response_id` (OpenAI's cache diagnostics) changes no output and passes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from phasewise.engine.client import CachePoint, ChatPrompt
from phasewise.json_types import JsonObject, JsonValue
from phasewise.server.api_error import bad_request

TTLS = {"30m": 1800.0, "12h": 43_200.0}     # seconds
TTL_NAMES = {v: k for k, v in TTLS.items()}
MAX_BREAKPOINTS = 4
OPTIONS = "prompt_cache_options"

Mark = tuple[str, JsonValue, list[JsonObject]]      # (where, the breakpoint, the messages as far as its part)


def prewarm(options: JsonValue) -> bool:
    """prompt_cache_options.prewarm: the prompt run into the cache, no output (a 400 unless a boolean)."""
    value = options.get("prewarm") if isinstance(options, dict) else None
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"{OPTIONS}.prewarm must be true or false, got {value!r}", OPTIONS)
    return value is True


def options_ttl(options: JsonValue, prewarm_taken: bool = False) -> tuple[bool, float] | None:
    """prompt_cache_options as (whether it adds the implicit breakpoint, its ttl in seconds); None
    when absent. prewarm_taken: the API has the prewarm field (Responses; a 400 otherwise)."""
    if options is None:
        return None
    if not isinstance(options, dict):
        raise bad_request(f"{OPTIONS} must be an object", OPTIONS)
    unknown = set(options) - {"mode", "ttl", "prewarm", "comparison_response_id"}
    if unknown:
        raise bad_request(f"{OPTIONS}: unknown field {sorted(unknown)[0]!r}", OPTIONS)
    mode, ttl = options.get("mode", "implicit"), options.get("ttl", "30m")
    if mode not in ("implicit", "explicit"):
        raise bad_request(f'{OPTIONS}.mode must be "implicit" or "explicit", got {mode!r}', OPTIONS)
    if not isinstance(ttl, str) or ttl not in TTLS:
        raise bad_request(f'{OPTIONS}.ttl must be "30m" or "12h", got {ttl!r}', OPTIONS)
    if prewarm(options) and not prewarm_taken:
        raise bad_request(f"{OPTIONS}.prewarm is not supported by chat completions "
                          "(POST /v1/responses takes it)", OPTIONS)
    return mode == "implicit", TTLS[ttl]


def breakpoint_ttl(value: JsonValue, where: str, default: float, param: str) -> float | None:
    """A part's prompt_cache_breakpoint in seconds (None: absent or null); a 400 naming `where` otherwise."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("mode") != "explicit" or set(value) - {"mode", "ttl"}:
        raise bad_request(f'{where} must be {{"mode": "explicit"}}, '
                          'with an optional ttl of "30m" or "12h"', param)
    ttl = value.get("ttl")
    if ttl is None:
        return default
    if not isinstance(ttl, str) or ttl not in TTLS:
        raise bad_request(f'{where}.ttl must be "30m" or "12h", got {ttl!r}', param)
    return TTLS[ttl]


def cache_points(marks: Sequence[Mark], options: JsonValue, whole: list[JsonObject],
                 cut: Callable[[list[JsonObject]], ChatPrompt], param: str,
                 prewarm_taken: bool = False) -> tuple[CachePoint, ...]:
    """The body's breakpoints (`marks`, in prompt order) and the implicit one after `whole` (the
    conversation), as cache points of the prompts `cut` makes of their messages; the latest four are
    kept."""
    implicit, default = options_ttl(options, prewarm_taken) or (False, TTLS["30m"])
    ttls = [(breakpoint_ttl(value, f"{where}.prompt_cache_breakpoint", default, param), messages)
            for where, value, messages in marks]
    points = [(ttl, messages) for ttl, messages in ttls if ttl is not None]
    points = points[-(MAX_BREAKPOINTS - 1 if implicit else MAX_BREAKPOINTS):]
    if implicit:
        points.append((default, whole))
    return tuple(CachePoint(cut(messages), ttl) for ttl, messages in points)


def written_by_ttl(written: dict[float, int]) -> JsonObject:
    """A request's marked tokens written (RequestMetrics.cache_written), by OpenAI's ttl names."""
    return {f"ttl_{name}_tokens": written.get(seconds, 0) for seconds, name in TTL_NAMES.items()}
