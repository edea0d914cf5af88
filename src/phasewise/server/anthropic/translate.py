"""Anthropic's Messages bodies in OpenAI's chat shape, as ChatRequest holds them: system → a system message,
tool_use blocks → an assistant's tool_calls, tool_result blocks → tool messages, thinking blocks → its
reasoning_content, custom tools → functions. Errors name the Messages fields (messages[i].content[j], ...)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from phasewise import json_types, tool_calling
from phasewise.json_types import JsonObject, JsonValue
from phasewise.server.api_error import APIError, bad_request
from phasewise.server.chat_request import ToolChoice, ToolMode


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[JsonObject]                   # text, or content blocks


def _text(blocks: str | Sequence[JsonValue], where: str) -> str:
    """The text of a string or a list of text blocks."""
    if isinstance(blocks, str):
        return blocks
    parts: list[str] = []
    for j, block in enumerate(blocks):
        text = block.get("text") if isinstance(block, dict) and block.get("type") == "text" else None
        if not isinstance(text, str):
            raise _bad_block(block, f"{where}[{j}]", "text")
        parts.append(text)
    return "\n\n".join(parts)


def _bad_block(block: JsonValue, where: str, allowed: str) -> APIError:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in ("text", "thinking", "tool_use", "tool_result") and kind in allowed:
        return bad_request(f"{where}: a malformed {kind} block", where.split("[")[0])
    return bad_request(f"{where}: {kind!r} blocks are not supported here (only {allowed})",
                       where.split("[")[0])


def system_messages(system: str | list[JsonObject] | None) -> list[JsonObject]:
    return [] if system is None else [{"role": "system", "content": _text(system, "system")}]


def chat_messages(messages: list[InputMessage], prefill: bool = True) -> list[JsonObject]:
    """Anthropic's turns as OpenAI chat messages. A final assistant turn is a prefill the reply continues
    (`continue_final_message`; as Anthropic, its text may not end in whitespace), unless `prefill` is false
    (the turns are a cut of the conversation)."""
    out: list[JsonObject] = []
    for i, m in enumerate(messages):
        if m.role not in ("user", "assistant"):
            raise bad_request(f"messages[{i}].role must be 'user' or 'assistant', got {m.role!r}", "messages")
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "assistant":
            out.append(_assistant(m.content, where))
        else:
            out.extend(_user(m.content, where))
    if prefill and messages and messages[-1].role == "assistant" and \
            _text_of(out[-1]) != _text_of(out[-1]).rstrip():
        raise bad_request("messages: final assistant content cannot end with trailing whitespace", "messages")
    return out


def _text_of(message: JsonObject) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else ""


def _assistant(blocks: list[JsonObject], where: str) -> JsonObject:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[JsonValue] = []
    for j, block in enumerate(blocks):
        kind, text = block.get("type"), block.get("text")
        if kind == "text" and isinstance(text, str):
            texts.append(text)
        elif kind == "thinking" and is_thinking(block):     # its signature: checked by the route
            thoughts.append(json_types.text(block["thinking"]))
        elif (kind == "tool_use" and isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
              and isinstance(block.get("input", {}), dict)):
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"],
                                       "arguments": json.dumps(block.get("input", {}))}})
        else:
            raise _bad_block(block, f"{where}[{j}]", "text, thinking and tool_use")
    message: JsonObject = {"role": "assistant", "content": "\n\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning_content"] = "\n\n".join(thoughts)
    return message


def is_thinking(block: JsonObject) -> bool:
    return isinstance(block.get("thinking"), str) and isinstance(block.get("signature"), str)


def _user(blocks: list[JsonObject], where: str) -> list[JsonObject]:
    """A user turn: each tool_result a tool message, the text blocks between them one user message."""
    out: list[JsonObject] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        kind, text = block.get("type"), block.get("text")
        if kind == "text" and isinstance(text, str):
            texts.append(text)
        elif kind == "tool_result" and isinstance(block.get("tool_use_id"), str):
            if texts:
                out.append({"role": "user", "content": "\n\n".join(texts)})
                texts = []
            content = block.get("content", "")
            if not isinstance(content, (str, list)):
                raise _bad_block(block, f"{where}[{j}]", "text and tool_result")
            text = _text(content, f"{where}[{j}].content")
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        else:
            raise _bad_block(block, f"{where}[{j}]", "text and tool_result")
    if texts or not out:
        out.append({"role": "user", "content": "\n\n".join(texts)})
    return out


def function_tool(i: int, tool: JsonObject) -> JsonObject:
    """An Anthropic custom tool as an OpenAI function; server tools (a typed one) are refused."""
    if tool.get("type", "custom") != "custom":
        raise bad_request(f"tools[{i}].type {tool.get('type')!r} is not supported (only custom tools, "
                          "with name and input_schema)", "tools")
    if "input_schema" not in tool:
        raise bad_request(f"tools[{i}].input_schema: this field is required", "tools")
    function: JsonObject = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def tool_choice(choice: JsonObject | None, has_tools: bool) -> ToolChoice:
    """Anthropic's tool_choice ({"type": "auto" | "any" | "none"} or {"type": "tool", "name"}, with
    disable_parallel_tool_use) as every API's."""
    if choice is None:
        return ToolChoice()
    parallel = choice.get("disable_parallel_tool_use", False)
    if parallel not in (True, False):
        raise bad_request("tool_choice.disable_parallel_tool_use must be true or false", "tool_choice")
    kind, name = choice.get("type"), choice.get("name")
    mode: ToolMode
    if kind == "tool" and isinstance(name, str):
        mode, named = "required", name
    elif kind in ("auto", "any", "none"):
        mode, named = ("required" if kind == "any" else "none" if kind == "none" else "auto"), None
    else:
        raise bad_request('tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or '
                          '{"type": "tool", "name": ...}', "tool_choice")
    if mode == "required" and not has_tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    return ToolChoice(mode, named, not parallel)


def checked_tools(tools: list[JsonObject] | None) -> list[JsonObject] | None:
    """The tools as OpenAI functions, checked (errors name tools[i].name and tools[i].input_schema); None
    for none or an empty list."""
    if not tools:
        return None
    functions = [function_tool(i, t) for i, t in enumerate(tools)]
    try:
        return tool_calling.check_tools(functions, lambda i, key: f"tools[{i}].{_TOOL_KEYS[key]}")
    except ValueError as e:
        raise bad_request(str(e), "tools") from None


_TOOL_KEYS = {"name": "name", "parameters": "input_schema"}
