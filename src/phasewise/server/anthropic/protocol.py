"""The Anthropic Messages API's request bodies, their translation into one ChatCompletionRequest, and its
error shape.

A Messages body becomes an OpenAI chat body (system → a system message, tool_use blocks → tool_calls,
tool_result blocks → tool messages, tools → functions, tool_choice mapped) validated by
ChatCompletionRequest, so every check is the chat route's; an error that names a chat field is re-raised
naming the Messages field. Unknown fields pass; one that would change the output and is not implemented
(`UNSUPPORTED_FIELDS`) is a 400 naming it. Errors on these paths take Anthropic's shape
{"type": "error", "error": {"type", "message"}}.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, model_validator

from phasewise import json_types
from phasewise.json_types import JsonObject, JsonValue
from phasewise.server.body_parsing import validation_message
from phasewise.server.api_error import APIError, bad_request
from phasewise.server.openai.protocol import INT64, ChatCompletionRequest
from phasewise.server.thinking import BUDGET_FIELDS

PATH = "/v1/messages"

# Fields of the Messages API that would change the output and that this server does not implement
# (an output_config of effort alone changes nothing here and passes; context_management: see below).
UNSUPPORTED_FIELDS = frozenset({"container", "mcp_servers"})
THINKING_TYPES = ("enabled", "disabled", "adaptive")
MIN_BUDGET = 1024                          # Anthropic's least thinking.budget_tokens

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}

# chat fields (an APIError's param) → the Messages fields they came from, where the names differ
_RENAMES = {"stop": "stop_sequences", "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
            "response_format": "output_config"}


def is_messages_path(path: str) -> bool:
    """A path of the Messages API, whose errors take Anthropic's shape."""
    return path == PATH or path.startswith(PATH + "/")


def error_body(status: int, message: str, param: str | None = None) -> JsonObject:
    """Anthropic's error body for an HTTP status; the message names the field when it does not already."""
    if param and param not in message:
        message = f"{param}: {message}"
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[JsonObject]                   # text, or content blocks


class _Body(BaseModel):
    """What /v1/messages and /v1/messages/count_tokens share: the prompt."""
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    messages: list[InputMessage]
    system: str | list[JsonObject] | None = None
    tools: list[JsonObject] | None = None
    tool_choice: JsonObject | None = None
    thinking: JsonObject | None = None                # {"type": "enabled", "budget_tokens": N}, disabled, adaptive

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _Body:
        if self.thinking is not None and self.thinking.get("type") not in THINKING_TYPES:
            raise bad_request(f"thinking.type: Input should be {', '.join(map(repr, THINKING_TYPES))}", "thinking")
        for name, value in (self.model_extra or {}).items():
            if name == "output_config" and value is not None and not (
                    isinstance(value, dict) and set(value) <= {"effort", "format"}):
                raise bad_request("output_config takes only format (and effort, which changes nothing here)",
                                  "output_config")
            if name == "context_management" and value is not None:
                _check_context_management(value)
            if name in UNSUPPORTED_FIELDS and value is not None:
                raise bad_request(f"{name} is not supported by this server", name)
        return self

    def chat_fields(self) -> JsonObject:
        """The OpenAI chat body's fields of the prompt: messages, tools, tool_choice, parallel_tool_calls."""
        fields: JsonObject = {"model": self.model, "messages": [*_system(self.system), *_messages(self.messages)]}
        if self.messages and self.messages[-1].role == "assistant":
            fields["continue_final_message"] = True              # a prefill: the reply continues it
        if self.tools is not None:
            fields["tools"] = [_tool(i, t) for i, t in enumerate(self.tools)]
        choice = self.tool_choice
        if choice is not None:
            fields["tool_choice"] = _tool_choice(choice, self.tools is not None)
            if choice.get("disable_parallel_tool_use", False) not in (True, False):
                raise bad_request("tool_choice.disable_parallel_tool_use must be true or false", "tool_choice")
            if choice.get("disable_parallel_tool_use"):
                fields["parallel_tool_calls"] = False
        extra = self.model_extra or {}
        fields.update({name: extra[name] for name in BUDGET_FIELDS if name in extra})   # vLLM's, llama-server's
        if self.thinking is not None:      # the template's switch, and the budget the engine keeps
            kind = self.thinking["type"]
            fields["chat_template_kwargs"] = {"enable_thinking": kind != "disabled"}
            budget = self.thinking.get("budget_tokens") if kind == "enabled" else 0   # checked: _check_budget
            if kind != "adaptive" and type(budget) is int and not any(name in extra for name in BUDGET_FIELDS):
                fields["thinking_token_budget"] = budget
        return fields

    def thinking_blocks(self) -> list[tuple[str, str, str]]:
        """(thinking, signature, where) of every thinking block in the assistant turns, to verify."""
        return [(json_types.text(b["thinking"]), json_types.text(b["signature"]), f"messages[{i}].content[{j}]")
                for i, m in enumerate(self.messages) if m.role == "assistant" and isinstance(m.content, list)
                for j, b in enumerate(m.content) if b.get("type") == "thinking" and _is_thinking(b)]

    @property
    def single_call(self) -> bool:
        """tool_choice.disable_parallel_tool_use: at most one tool_use block in the reply."""
        return bool(self.tool_choice and self.tool_choice.get("disable_parallel_tool_use"))


def _check_context_management(value: JsonValue) -> None:
    """context_management's edits: clearing thinking while keeping all of it changes nothing (what Claude
    Code sends); any other edit (clearing tool uses, thinking turns) is not implemented: a 400 naming it."""
    edits = value.get("edits") if isinstance(value, dict) else None
    if not isinstance(edits, list):
        raise bad_request("context_management must be {\"edits\": [...]}", "context_management")
    for i, edit in enumerate(edits):
        kind = edit.get("type") if isinstance(edit, dict) else None
        keep = edit.get("keep", "all") if isinstance(edit, dict) else None
        if not (isinstance(kind, str) and kind.startswith("clear_thinking") and keep == "all"):
            raise bad_request(f"context_management.edits[{i}]: only clear_thinking with keep \"all\" (which changes "
                              f"nothing) is supported here, got {kind!r}", "context_management")


class MessagesRequest(_Body):
    max_tokens: int = Field(ge=1, lt=INT64)            # required, as in Anthropic's API
    stop_sequences: list[str] | None = None
    stream: StrictBool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-1, lt=INT64)
    metadata: JsonObject | None = None               # accepted and ignored

    def chat_body(self) -> ChatCompletionRequest:
        """The ChatCompletionRequest this request runs as (400 naming the Messages field otherwise)."""
        if self.temperature is not None and not 0 <= self.temperature <= 1:
            raise bad_request(f"temperature must be in [0, 1], got {self.temperature}", "temperature")
        self._check_budget()
        stop: list[JsonValue] | None = None if self.stop_sequences is None else [*self.stop_sequences]
        fields: JsonObject = {**self.chat_fields(), "max_tokens": self.max_tokens, "stop": stop, "stream": self.stream}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        output_format = self.output_format()
        if output_format is not None:
            fields["response_format"] = output_format
        return validate_chat(fields)

    def _check_budget(self) -> None:
        """Anthropic's rules of thinking.budget_tokens, in its words."""
        if self.thinking is None or self.thinking["type"] != "enabled":
            return
        budget = self.thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool):
            raise bad_request("thinking.enabled.budget_tokens: Field required", "thinking")
        if budget < MIN_BUDGET:
            raise bad_request(f"thinking.enabled.budget_tokens: Input should be greater than or equal to {MIN_BUDGET}",
                              "thinking")
        if self.max_tokens <= budget:
            raise bad_request("`max_tokens` must be greater than `thinking.budget_tokens`", "max_tokens")

    def output_format(self) -> JsonObject | None:
        """Structured outputs (`output_config.format`, or the beta's `output_format`): {"type": "json_schema",
        "schema": S} as the chat route's response_format."""
        extra = self.model_extra or {}
        config = extra.get("output_config") or {}
        spec = config.get("format") if isinstance(config, dict) else None
        spec = spec if spec is not None else extra.get("output_format")
        if spec is None:
            return None
        if not isinstance(spec, dict) or spec.get("type") != "json_schema" or not isinstance(spec.get("schema"), dict):
            raise bad_request('output format must be {"type": "json_schema", "schema": {...}}', "output_config")
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": spec["schema"], "strict": True}}


class CountTokensRequest(_Body):
    def chat_body(self) -> ChatCompletionRequest:
        return validate_chat(self.chat_fields())


def validate_chat(fields: JsonObject) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        raise renamed(bad_request(*validation_message(e.errors(include_url=False, include_input=False)))) from None
    except APIError as e:
        raise renamed(e) from None


def renamed(e: APIError) -> APIError:
    """The chat route's error for a Messages request: fields named as the Messages API names them."""
    param, message = _RENAMES.get(e.param or "", e.param), e.message
    if e.param is not None and e.param in _RENAMES and message.startswith(e.param):
        message = _RENAMES[e.param] + message[len(e.param):]
    if e.param == "tools":
        message = message.replace(".function.parameters", ".input_schema").replace(".function.name", ".name")
    return APIError(e.status, message, e.type, param, e.code, e.headers)


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
    return bad_request(f"{where}: {kind!r} blocks are not supported here (only {allowed})", where.split("[")[0])


def _system(system: str | list[JsonObject] | None) -> list[JsonObject]:
    return [] if system is None else [{"role": "system", "content": _text(system, "system")}]


def _messages(messages: list[InputMessage]) -> list[JsonObject]:
    """Anthropic's turns as OpenAI chat messages. A final assistant turn is a prefill the reply continues
    (`continue_final_message`; as Anthropic, its text may not end in whitespace)."""
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
    if messages and messages[-1].role == "assistant" and _text_of(out[-1]) != _text_of(out[-1]).rstrip():
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
        elif kind == "thinking" and _is_thinking(block):     # its signature: checked by the route
            thoughts.append(json_types.text(block["thinking"]))
        elif (kind == "tool_use" and isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
              and isinstance(block.get("input", {}), dict)):
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
        else:
            raise _bad_block(block, f"{where}[{j}]", "text, thinking and tool_use")
    message: JsonObject = {"role": "assistant", "content": "\n\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning_content"] = "\n\n".join(thoughts)
    return message


def _is_thinking(block: JsonObject) -> bool:
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


def _tool(i: int, tool: JsonObject) -> JsonObject:
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


_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def _tool_choice(choice: JsonObject, has_tools: bool) -> str | JsonObject | None:
    kind = choice.get("type")
    if kind in _CHOICES:
        return _CHOICES[kind] if has_tools or kind != "auto" else None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request('tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or '
                      '{"type": "tool", "name": ...}', "tool_choice")

