"""The Anthropic Messages API's request bodies, their translation into one ChatRequest, and its error shape.

A Messages body is checked here, its errors naming its own fields, and becomes the ChatRequest every chat
API comes down to (its messages and tools in OpenAI's chat shape: translate.py). Unknown fields pass; one
that would change the output and is not implemented (`UNSUPPORTED_FIELDS`) is a 400 naming it. Errors on
these paths take Anthropic's shape {"type": "error", "error": {"type", "message"}}.
"""

from __future__ import annotations

from pydantic import ConfigDict, Field, StrictBool, model_validator

from phasewise import json_types
from phasewise.core.sampling_params import SamplingParams, StructuredOutputs
from phasewise.engine.client import ChatPrompt
from phasewise.json_types import JsonObject, JsonValue
from phasewise.server.anthropic.caching import cache_points
from phasewise.server.anthropic.translate import (InputMessage, chat_messages, checked_tools, is_thinking,
                                                  system_messages, tool_choice)
from phasewise.server.api_error import bad_request
from phasewise.server.chat_request import ChatRequest, check_call_ids
from phasewise.server.sampling_fields import INT64, BudgetFields, CommonParams, make_params
from phasewise.server.thinking import thinking_budget

PATH = "/v1/messages"

# Fields of the Messages API that would change the output and that this server does not implement
# (an output_config of effort alone changes nothing here and passes; context_management: see below).
UNSUPPORTED_FIELDS = frozenset({"container", "mcp_servers"})
THINKING_TYPES = ("enabled", "disabled", "adaptive")
MIN_BUDGET = 1024                          # Anthropic's least thinking.budget_tokens

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error"}
# the engine's fields an error may name after translation → the Messages fields they came from
NAMES = {"prompt": "messages", "stop": "stop_sequences", "structured_outputs": "output_config"}


def is_messages_path(path: str) -> bool:
    """A path of the Messages API, whose errors take Anthropic's shape."""
    return path == PATH or path.startswith(PATH + "/")


def error_body(status: int, message: str, param: str | None = None) -> JsonObject:
    """Anthropic's error body for an HTTP status; the message names the field when it does not already."""
    if param and param not in message:
        message = f"{param}: {message}"
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class _Body(BudgetFields):
    """What /v1/messages and /v1/messages/count_tokens share: the prompt."""
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    messages: list[InputMessage]
    system: str | list[JsonObject] | None = None
    tools: list[JsonObject] | None = None
    tool_choice: JsonObject | None = None
    # {"type": "enabled", "budget_tokens": N}, disabled, adaptive
    thinking: JsonObject | None = None

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _Body:
        if self.thinking is not None and self.thinking.get("type") not in THINKING_TYPES:
            raise bad_request("thinking.type: Input should be "
                              f"{', '.join(map(repr, THINKING_TYPES))}", "thinking")
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

    def _request(self, params: SamplingParams) -> ChatRequest:
        """The ChatRequest of this prompt with these params: a final assistant turn is a prefill the reply
        continues; `thinking` sets the template's switch and the budget (unless a budget field is given)."""
        if not self.messages:
            raise bad_request("messages: at least one message is required", "messages")
        messages = [*system_messages(self.system), *chat_messages(self.messages)]
        check_call_ids(messages, "messages", "tool_result")
        tools = checked_tools(self.tools)
        kind = self.thinking["type"] if self.thinking is not None else None
        budget = thinking_budget(self.budget_fields(), None)
        if budget is None and kind in ("enabled", "disabled"):
            given = self.thinking.get("budget_tokens") if self.thinking and kind == "enabled" else 0
            budget = given if type(given) is int else None          # checked: _check_budget
        continued = self.messages[-1].role == "assistant"
        kwargs: JsonObject | None = {"enable_thinking": kind != "disabled"} if kind else None
        whole = (self.model_extra or {}).get("cache_control")          # the body's own: the whole prompt
        points = cache_points(self.tools, tools, self.system, self.messages, whole, kwargs)
        prompt = ChatPrompt(messages, tools, kwargs, not continued, continued, points)
        return ChatRequest(prompt, params, tool_choice=tool_choice(self.tool_choice, tools is not None),
                           thinking_budget=budget, names=NAMES)

    def thinking_blocks(self) -> list[tuple[str, str, str]]:
        """(thinking, signature, where) of every thinking block in the assistant turns, to verify."""
        return [(json_types.text(b["thinking"]), json_types.text(b["signature"]),
                 f"messages[{i}].content[{j}]")
                for i, m in enumerate(self.messages) if m.role == "assistant" and isinstance(m.content, list)
                for j, b in enumerate(m.content) if b.get("type") == "thinking" and is_thinking(b)]

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
            raise bad_request(f"context_management.edits[{i}]: only clear_thinking with keep \"all\" (which "
                              f"changes nothing) is supported here, got {kind!r}", "context_management")


class MessagesRequest(_Body):
    max_tokens: int = Field(ge=0, lt=INT64)            # required, as in Anthropic's API; 0: a pre-warm
    stop_sequences: list[str] | None = None
    stream: StrictBool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-1, lt=INT64)
    metadata: JsonObject | None = None               # accepted and ignored

    def chat_request(self) -> ChatRequest:
        """The ChatRequest this request runs as (400 naming the Messages field otherwise)."""
        if self.temperature is not None and not 0 <= self.temperature <= 1:
            raise bad_request(f"temperature must be in [0, 1], got {self.temperature}", "temperature")
        if self.max_tokens == 0:
            self._check_prewarm()
        self._check_budget()
        fields: CommonParams = {"n": 1, "stop": [*(self.stop_sequences or [])],
                                "structured_outputs": self.output_format()}
        if self.temperature is not None:
            fields["temperature"] = self.temperature
        if self.top_p is not None:
            fields["top_p"] = self.top_p
        if self.top_k is not None:
            fields["top_k"] = self.top_k
        return self._request(make_params(fields, self.max_tokens, None, prompt_only=True))

    def _check_prewarm(self) -> None:
        """max_tokens 0 (Anthropic's pre-warm: the prompt into the cache, no content) with what would need
        output: a 400 naming the field, as Anthropic's API refuses them."""
        refused = {"stream": self.stream, "thinking": (self.thinking or {}).get("type") == "enabled",
                   "output_config": self.output_format() is not None,
                   "tool_choice": (self.tool_choice or {}).get("type") in ("tool", "any")}
        name = next((name for name, given in refused.items() if given), None)
        if name is not None:
            raise bad_request(f"max_tokens 0 (a cache pre-warm, no output) cannot be combined with {name}",
                              name)

    def _check_budget(self) -> None:
        """Anthropic's rules of thinking.budget_tokens, in its words."""
        if self.thinking is None or self.thinking["type"] != "enabled":
            return
        budget = self.thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool):
            raise bad_request("thinking.enabled.budget_tokens: Field required", "thinking")
        if budget < MIN_BUDGET:
            raise bad_request("thinking.enabled.budget_tokens: Input should be greater than or "
                              f"equal to {MIN_BUDGET}",
                              "thinking")
        if self.max_tokens <= budget:
            raise bad_request("`max_tokens` must be greater than `thinking.budget_tokens`", "max_tokens")

    def output_format(self) -> StructuredOutputs | None:
        """Structured outputs (`output_config.format`, or the beta's `output_format`): {"type": "json_schema",
        "schema": S}, held strictly."""
        extra = self.model_extra or {}
        config = extra.get("output_config") or {}
        spec = config.get("format") if isinstance(config, dict) else None
        spec = spec if spec is not None else extra.get("output_format")
        if spec is None:
            return None
        if not isinstance(spec, dict) or spec.get("type") != "json_schema" or \
                not isinstance(spec.get("schema"), dict):
            raise bad_request('output format must be {"type": "json_schema", '
                              '"schema": {...}}', "output_config")
        return StructuredOutputs(json=json_types.obj(spec["schema"]), strict=True)


class CountTokensRequest(_Body):
    def chat_request(self) -> ChatRequest:
        """The prompt of the /v1/messages request with the same system, messages, tools and thinking."""
        return self._request(SamplingParams())
