"""Anthropic's cache_control breakpoints as the engine's cache points.

A breakpoint, {"type": "ephemeral"} with an optional ttl ("5m", the default, or "1h"), sits on a tool, a
system block, a message's content block, or on the body itself (the whole prompt, Anthropic's automatic
caching). Its prefix is the request as far as that block in Anthropic's order (tools, system, messages):
the request cut just after it, a `CachePoint` the engine measures in tokens (the prompt's tokens within the
text the prompt and the cut render alike: `engine.llm_engine.encode_marked`; a template that renders the
tools inside the system turn makes a tool's prefix reach no further than where the two renderings part).
Checked here, each a 400 naming its field: the shape and ttl, at most four breakpoints, and no 1h one after
a 5m one.
"""

from __future__ import annotations

from collections.abc import Sequence

from phasewise.engine.client import CachePoint, ChatPrompt
from phasewise.json_types import JsonObject, JsonValue
from phasewise.server.anthropic.translate import InputMessage, chat_messages, system_messages
from phasewise.server.api_error import bad_request

TTLS = {"5m": 300.0, "1h": 3600.0}     # seconds
MAX_BREAKPOINTS = 4


def ttl_seconds(value: JsonValue, where: str, param: str) -> float | None:
    """A cache_control's ttl in seconds (None: absent or null); a 400 naming `where` otherwise."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "ephemeral":
        raise bad_request(f'{where} must be {{"type": "ephemeral"}}, '
                          'with an optional ttl of "5m" or "1h"', param)
    ttl = value.get("ttl", "5m")
    if not isinstance(ttl, str) or ttl not in TTLS:
        raise bad_request(f'{where}.ttl must be "5m" or "1h", got {ttl!r}', param)
    return TTLS[ttl]


def cache_points(tools: Sequence[JsonObject] | None, functions: list[JsonObject] | None,
                 system: str | list[JsonObject] | None, messages: list[InputMessage], whole: JsonValue,
                 template_kwargs: JsonObject | None) -> tuple[CachePoint, ...]:
    """The body's breakpoints in order: on tools (`functions`: them as the prompt lists them), system blocks,
    messages' content blocks, then the body's own (`whole`, its top-level cache_control)."""
    found: list[tuple[str, float, ChatPrompt]] = []

    def cut(msgs: list[JsonObject], fns: list[JsonObject] | None) -> ChatPrompt:
        return ChatPrompt(msgs, fns, template_kwargs, add_generation_prompt=False)

    for i, tool in enumerate(tools or ()):
        if (ttl := ttl_seconds(tool.get("cache_control"), f"tools[{i}].cache_control", "tools")) is not None:
            found.append((f"tools[{i}]", ttl, cut([], (functions or [])[:i + 1])))
    blocks = system if isinstance(system, list) else []
    for j, block in enumerate(blocks):
        ttl = ttl_seconds(block.get("cache_control"), f"system[{j}].cache_control", "system")
        if ttl is not None:
            found.append((f"system[{j}]", ttl, cut(system_messages(blocks[:j + 1]), functions)))
    head = system_messages(system)
    for i, m in enumerate(messages):
        for j, block in enumerate(m.content if isinstance(m.content, list) else ()):
            where = f"messages[{i}].content[{j}]"
            ttl = ttl_seconds(block.get("cache_control"), f"{where}.cache_control", "messages")
            if ttl is not None:
                upto = [*messages[:i], InputMessage(role=m.role, content=m.content[:j + 1])]
                found.append((where, ttl, cut([*head, *chat_messages(upto, prefill=False)], functions)))
    if (ttl := ttl_seconds(whole, "cache_control", "cache_control")) is not None:
        found.append(("cache_control", ttl, cut([*head, *chat_messages(messages, prefill=False)], functions)))
    _check(found)
    return tuple(CachePoint(prompt, ttl) for _, ttl, prompt in found)


def _check(found: list[tuple[str, float, ChatPrompt]]) -> None:
    if len(found) > MAX_BREAKPOINTS:
        raise bad_request(f"at most {MAX_BREAKPOINTS} blocks may carry cache_control, found {len(found)} "
                          f"({', '.join(w for w, _, _ in found)})", found[MAX_BREAKPOINTS][0].split("[")[0])
    for (before, shorter, _), (where, longer, _) in zip(found, found[1:]):
        if longer > shorter:
            raise bad_request(f"{where}: a cache_control ttl of 1h may not follow a shorter one ({before}): "
                              "breakpoints with longer ttls come first (tools, system, messages)",
                              where.split("[")[0])
