"""Request bodies of OpenAI's completions and chat completions (and vLLM's tokenizer routes), and their
conversion to SamplingParams.

Pydantic checks types only (unknown fields are ignored); ranges are checked by SamplingParams, whose
messages name the field. Every failure becomes an APIError (server/api_error.py).
"""

from __future__ import annotations

from typing import Annotated, TypeGuard

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, WithJsonSchema, field_validator,
                      model_validator)

from phasewise import tool_calling
from phasewise.core.sampling_params import SamplingParams
from phasewise.engine.client import ChatPrompt
from phasewise.json_types import JsonObject
from phasewise.server import constraints, thinking
from phasewise.server.api_error import bad_request
from phasewise.server.chat_request import ChatRequest, ToolChoice, ToolMode, check_call_ids
from phasewise.server.openai import caching
from phasewise.server.refused_fields import UNSUPPORTED_FIELDS
from phasewise.server.sampling_fields import INT64, BudgetFields, CommonParams, SamplingFields, make_params

MAX_CHOICES = 128          # n x prompts of one API call


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class KVTransferParams(BaseModel):
    model_config = ConfigDict(extra="ignore")
    transfer_id: str = Field(min_length=1, max_length=200)


class _Request(SamplingFields):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _Request:
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED_FIELDS and value is not None:
                raise bad_request(f"{name} is not supported by this server", name)
        return self

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    response_format: JsonObject | None = None            # OpenAI's structured outputs (server/constraints.py)
    # prefill/decode disaggregation (set by `serve --role proxy`): the transfer carrying this prompt's KV
    kv_transfer_params: KVTransferParams | None = None
    user: str | None = None

    def _fields(self) -> JsonObject:
        return {"response_format": self.response_format, **self.constraint_fields()}

    def _common(self) -> CommonParams:
        return self.common(self.n, constraints.structured_outputs(self._fields(), bad_request))

    @property
    def constraint_field(self) -> str | None:
        """The field that constrains the output (response_format, structured_outputs, ...), or None."""
        return constraints.given_field(self._fields())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


_IDS = {"type": "array", "items": {"type": "integer"}, "minItems": 1}
_PROMPT = {"anyOf": [{"type": "string"}, _IDS,
                     {"type": "array", "items": {"anyOf": [{"type": "string"}, _IDS]}, "minItems": 1}]}


class CompletionRequest(_Request):
    prompt: Annotated[list[str | list[int]], WithJsonSchema(_PROMPT)]     # one prompt or a batch: see _prompt
    max_tokens: int | None = Field(16, ge=-INT64, lt=INT64)   # OpenAI's and vLLM's default here
    logprobs: int | None = Field(None, ge=-INT64, lt=INT64)
    echo: StrictBool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: object) -> list[str | list[int]]:
        """One prompt or a batch: text, token ids, a list of texts, or a list of token-id lists."""
        def ids(x: object) -> TypeGuard[list[int]]:
            return isinstance(x, list) and bool(x) and all(isinstance(t, int)
                                                           and not isinstance(t, bool) for t in x)
        if isinstance(v, str):
            return [v]
        if ids(v):
            return [v]
        if isinstance(v, list) and v and all(isinstance(p, str) or ids(p) for p in v):
            return v
        raise ValueError("must be a string, a list of token ids, or a non-empty list of either")

    def prompts(self) -> list[str | list[int]]:
        return self.prompt

    def sampling_params(self) -> SamplingParams:
        """With echo, the prompt's tokens come back before the completion, with their logprobs when
        logprobs is set (the engine's prompt_logprobs), and max_tokens may be 0 (the prompt only)."""
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is not supported (use n)", "best_of")
        if self.n * len(self.prompt) > MAX_CHOICES:
            raise bad_request(f"n x the number of prompts must be at most {MAX_CHOICES}", "n")
        prompt_logprobs = None
        if self.echo and (self.logprobs is not None or self.max_tokens == 0):
            prompt_logprobs = self.logprobs or 0
        return make_params(self._common(), self.max_tokens, self.logprobs, prompt_logprobs)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None
    prompt_cache_breakpoint: JsonObject | None = None     # OpenAI's cache breakpoint (openai/caching.py)


ROLES = ("system", "developer", "user", "assistant", "tool")   # developer: OpenAI's newer name of system
TOOL_CHOICES = ("none", "auto", "required")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[JsonObject] | None = None          # an assistant's earlier calls
    tool_call_id: str | None = None                     # a tool result: the call it answers
    name: str | None = None
    reasoning_content: str | None = None                # an assistant's earlier thinking (vLLM's name)
    reasoning: str | None = None                        # the same, vLLM's newer name

    def as_dict(self) -> JsonObject:
        if self.role not in ROLES:
            raise bad_request(f"messages: a role must be one of {', '.join(ROLES)}, got "
                              f"{self.role!r}", "messages")
        content = self.content
        if isinstance(content, list):
            texts = [p.text for p in content if p.type == "text" and p.text is not None]
            if len(texts) != len(content):
                raise bad_request("only text content parts are supported", "messages")
            content = "".join(texts)
        message: JsonObject = {"role": "system" if self.role == "developer" else self.role,
                               "content": content or ""}
        if self.tool_calls:
            if self.role != "assistant":
                raise bad_request("messages: only an assistant message has tool_calls", "messages")
            message["tool_calls"] = [*self.tool_calls]
        if self.role == "tool":
            if not self.tool_call_id:
                raise bad_request("messages: a tool message needs tool_call_id (the id of "
                                  "the call it answers)",
                                  "messages")
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            message["name"] = self.name
        thought = self.reasoning_content or self.reasoning
        if thought and self.role == "assistant":
            message["reasoning_content"] = thought          # what Qwen3's templates read
        return message


class ChatCompletionRequest(_Request, BudgetFields):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(None, ge=-INT64, lt=INT64)   # None: as many as the context allows
    max_completion_tokens: int | None = Field(None, ge=-INT64, lt=INT64)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=-INT64, lt=INT64)
    tools: list[JsonObject] | None = None                # checked by checked_tools
    # "none", "auto", "required" or a function's: forced_tool
    tool_choice: str | JsonObject | None = None
    parallel_tool_calls: StrictBool = True
    chat_template_kwargs: JsonObject | None = None       # the template's own variables (enable_thinking)
    reasoning_effort: str | None = None                  # "none", "minimal": thinking off; the others on
    # false: the thinking is dropped from the reply (vLLM)
    include_reasoning: bool = True
    # vLLM's: how the prompt ends (an assistant turn opened; or nothing; or the final assistant
    # message, continued)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    prompt_cache_options: JsonObject | None = None       # OpenAI's mode and ttl (openai/caching.py)

    def chat_request(self) -> ChatRequest:
        """The request every chat-shaped API comes down to (400 naming this body's fields otherwise)."""
        messages = self.conversation()
        continued = self.continues()
        tools = self.checked_tools()
        kwargs = thinking.template_kwargs(self.chat_template_kwargs, self.reasoning_effort,
                                          bad_request) or None
        points = caching.cache_points(self.cache_marks(), self.prompt_cache_options, messages,
                                      lambda cut: ChatPrompt(cut, tools, kwargs, add_generation_prompt=False),
                                      "messages")
        prompt = ChatPrompt(messages, tools, kwargs,
                            self.add_generation_prompt and not continued, continued, points)
        forced, name = self.forced_tool()
        mode: ToolMode = "none" if self.tool_choice == "none" else "required" if forced else "auto"
        names = {"prompt": "messages"}
        if self.constraint_field is not None:
            names["structured_outputs"] = self.constraint_field
        return ChatRequest(prompt, self.sampling_params(), self.n,
                           ToolChoice(mode, name, self.parallel_tool_calls),
                           thinking_budget=thinking.thinking_budget(self.budget_fields(),
                                                                    self.reasoning_effort),
                           include_reasoning=self.include_reasoning, names=names)

    def cache_marks(self) -> list[caching.Mark]:
        """The content parts with a prompt_cache_breakpoint, each with the messages as far as it."""
        before = [m.as_dict() for m in self.messages]
        return [(f"messages[{i}].content[{j}]", part.prompt_cache_breakpoint,
                 [*before[:i], m.model_copy(update={"content": m.content[:j + 1]}).as_dict()])
                for i, m in enumerate(self.messages) if isinstance(m.content, list)
                for j, part in enumerate(m.content) if part.prompt_cache_breakpoint is not None]

    def thinking_budget(self) -> int | None:
        """Thinking tokens at most (None: unlimited or not said), from the budget fields or the effort."""
        return thinking.resolved_budget(thinking.thinking_budget(self.budget_fields(), self.reasoning_effort))

    def conversation(self) -> list[JsonObject]:
        if not self.messages:
            raise bad_request("messages must not be empty", "messages")
        messages = [m.as_dict() for m in self.messages]
        check_call_ids(messages, "messages")
        return messages

    def continues(self) -> bool:
        """Whether the prompt ends inside the final assistant message (continue_final_message, which needs
        one to continue), else as add_generation_prompt says."""
        if not self.continue_final_message:
            return False
        if self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                              "continue_final_message")
        if not self.messages or self.messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs a final assistant message to continue",
                              "continue_final_message")
        return True

    def checked_tools(self) -> list[JsonObject] | None:
        """The tools (None without, or for an empty list: openai-agents sends one for an agent without
        tools), checked."""
        if not self.tools:
            if self.tool_choice not in (None, "none", "auto"):
                raise bad_request("tool_choice needs tools", "tool_choice")
            return None
        try:
            return tool_calling.check_tools(self.tools)
        except ValueError as e:
            raise bad_request(str(e), "tools") from None

    def forced_tool(self) -> tuple[bool, str | None]:
        """(whether tool_choice forces a call, the function it names or None for any of them)."""
        choice = self.tool_choice
        if choice is None or choice in TOOL_CHOICES:
            return choice == "required", None
        function = choice.get("function") if isinstance(choice, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not isinstance(choice, dict) or \
                choice.get("type", "function") != "function":
            raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", '
                              '"function": {"name": ...}}', "tool_choice")
        return True, name

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= SamplingParams.MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {SamplingParams.MAX_LOGPROBS}], "
                              f"got {self.top_logprobs}", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return make_params(self._common(), max_tokens, logprobs)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # with messages: rendered by the chat template, as in a chat request
    tools: list[JsonObject] | None = None
    add_special_tokens: StrictBool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


BODIES = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)


def openapi_body(model: type[BaseModel]) -> JsonObject:
    """A route's `openapi_extra`: its JSON body is `model` (the routes parse bodies themselves, to
    answer 400 in OpenAI's shape rather than FastAPI's 422, so FastAPI cannot see the model)."""
    ref: JsonObject = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def openapi_schemas() -> JsonObject:
    """The JSON Schemas of every request body (and what they use), for the OpenAPI components."""
    from pydantic.json_schema import models_json_schema

    _, top = models_json_schema([(m, "validation") for m in BODIES],
                                ref_template="#/components/schemas/{model}")
    return top["$defs"]
