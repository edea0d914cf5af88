"""The Responses API's tools as every API's: flat function tools and Codex's custom tools (free-form input) as
chat functions, checked; tool_choice as a ToolChoice; and the custom tool a call is forced to."""

from __future__ import annotations

from typing import Protocol

from phasewise import json_types, tool_calling
from phasewise.json_types import JsonObject
from phasewise.server.api_error import bad_request
from phasewise.server.chat_request import ToolChoice, ToolMode


class ResponsesTools(Protocol):
    """What these read of a Responses body."""
    tools: list[JsonObject] | None
    tool_choice: str | JsonObject | None
    parallel_tool_calls: bool | None


def custom_names(tools: list[JsonObject] | None) -> frozenset[str]:
    """The names of the request's custom tools (free-form input: their calls are custom_tool_call items)."""
    return frozenset(json_types.text(t["name"]) for t in tools or ()
                     if t.get("type") == "custom" and isinstance(t.get("name"), str))


def _custom_function(i: int, tool: JsonObject) -> JsonObject:
    """A custom tool (Codex's: free-form text input) as a function of one string, `input`, for the prompt
    and for calls under tool_choice auto (their input not held to a grammar, as no auto call is). A call
    forced to it writes its input bare, held to its grammar (`forced_custom`)."""
    fmt = tool.get("format") or {"type": "text"}
    string: JsonObject = {"type": "string", "description": "the tool's input, free-form text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "grammar"):
        raise bad_request(f"tools.{i}.format must be {{\"type\": \"text\"}} or a grammar", "tools")
    if fmt.get("type") == "grammar":
        syntax, definition = fmt.get("syntax"), fmt.get("definition")
        if syntax not in ("lark", "regex") or not isinstance(definition, str):
            raise bad_request(f"tools.{i}.format: a grammar needs syntax lark or "
                              "regex and its definition", "tools")
        string["description"] = f"the tool's input: text in this {syntax} grammar: {definition}"
    fn: JsonObject = {"name": tool.get("name"), "parameters": {
        "type": "object", "properties": {"input": string}, "required": ["input"],
        "additionalProperties": False}}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def forced_custom(body: ResponsesTools) -> JsonObject | None:
    """The custom tool the call is forced to, when it has a grammar (tool_choice names it, or "required" and
    it is the only tool): the whole output is then its input, held to the grammar (vLLM's structured
    outputs: {"grammar": Lark} or {"regex": ...}). None otherwise."""
    tools, choice = body.tools or [], body.tool_choice
    named = choice.get("name") if isinstance(choice, dict) else None
    chosen = [t for t in tools if t.get("name") == named] if named else tools if choice == "required" else []
    if len(chosen) != 1 or chosen[0].get("type") != "custom":
        return None
    fmt = chosen[0].get("format")
    if not isinstance(fmt, dict) or fmt.get("type") != "grammar" or \
            not isinstance(fmt.get("definition"), str):
        return None
    return chosen[0]


def chat_tools(tools: list[JsonObject] | None) -> list[JsonObject] | None:
    """Responses' flat function tools (and custom tools, as functions of their input) as chat tools;
    other kinds of tool are a 400 naming tools."""
    if tools is None:
        return None
    out: list[JsonObject] = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind == "custom":
            out.append(_custom_function(i, tool))
            continue
        if kind != "function":
            raise bad_request(f"tools.{i}: only function and custom tools are "
                              f"supported, got type {kind!r}", "tools")
        if "function" in tool and "name" not in tool:        # the chat shape, taken as it is
            out.append(tool)
            continue
        fn: JsonObject = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                          if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def checked_tools(tools: list[JsonObject] | None) -> list[JsonObject] | None:
    """The tools as chat functions, checked (errors name tools[i].name and tools[i].parameters); None for
    none or an empty list."""
    functions = chat_tools(tools)
    if not functions:
        return None
    try:
        return tool_calling.check_tools(functions, lambda i, key: f"tools[{i}].{key}")
    except ValueError as e:
        raise bad_request(str(e), "tools") from None


def tool_choice(body: ResponsesTools, has_tools: bool) -> ToolChoice:
    """The Responses tool_choice ("none", "auto", "required", or {"type": "function" | "custom", "name"}) and
    parallel_tool_calls as every API's."""
    choice, parallel = body.tool_choice, body.parallel_tool_calls is not False
    mode: ToolMode
    if isinstance(choice, dict):
        if choice.get("type") not in ("function", "custom") or not isinstance(choice.get("name"), str):
            raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function" (or '
                              '"custom"), "name": ...}', "tool_choice")
        mode, name = "required", json_types.text(choice["name"])
    elif choice in (None, "auto"):
        mode, name = "auto", None
    elif choice in ("none", "required"):
        mode, name = "none" if choice == "none" else "required", None
    else:
        raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function" (or '
                          '"custom"), "name": ...}', "tool_choice")
    if mode == "required" and not has_tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    return ToolChoice(mode, name, parallel)
