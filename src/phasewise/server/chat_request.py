"""ChatRequest: one chat call as its API's translator states it, once.

/v1/chat/completions (openai/protocol.py), /v1/responses (responses/protocol.py) and /v1/messages
(anthropic/protocol.py) each check their own body, naming their own fields in their errors, and build
this typed request from it; nothing downstream reads an API's body again. `chat_call` turns it into
engine requests (their ChatPrompt and SamplingParams), the tool grammar and the reading of the reply
(thinking, answer, calls); the thinking budget and the template's switch land there for all three.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from phasewise import json_types
from phasewise.core.sampling_params import SamplingParams
from phasewise.engine.client import ChatPrompt
from phasewise.json_types import JsonObject
from phasewise.server.api_error import bad_request

ToolMode = Literal["none", "auto", "required"]


@dataclass(frozen=True)
class ToolChoice:
    """What every API's tool_choice means: no calls read ("none"), calls read when the model writes them
    ("auto"), or a call forced ("required"), to the tool `name` when set; parallel false: one call at most."""
    mode: ToolMode = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.mode == "required"

    def __str__(self) -> str:
        return repr(self.name) if self.name is not None else repr(self.mode)


@dataclass(frozen=True)
class ChatRequest:
    """prompt: the messages (OpenAI's chat shape, checked), the tools (checked OpenAI function tools, or
    None), the template's variables and how the prompt ends. params: sampling, limits, stops, logprobs and
    the structured output the API asked for (a forced call's grammar is added by chat_call). n: choices.
    max_tool_calls: calls past it are dropped (Responses' field). thinking_budget: thinking tokens at most;
    None (or -1) when the request set none: the server's --reasoning-budget then.
    include_reasoning false: the thinking is read and dropped (vLLM's). names: the API's own name of each
    engine field an error found after translation may name ("prompt", "max_tokens", "structured_outputs")."""
    prompt: ChatPrompt
    params: SamplingParams
    n: int = 1
    tool_choice: ToolChoice = ToolChoice()
    max_tool_calls: int | None = None
    thinking_budget: int | None = None
    include_reasoning: bool = True
    names: Mapping[str, str] = field(default_factory=dict)

    def field(self, engine_field: str | None) -> str | None:
        """The API's name of an engine field (its own when the API spells it the same)."""
        return self.names.get(engine_field, engine_field) if engine_field is not None else None

    @property
    def tool_names(self) -> frozenset[str]:
        return frozenset(json_types.text(json_types.obj(t["function"])["name"])
                         for t in self.prompt.tools or ())


def check_call_ids(messages: list[JsonObject], param: str, result: str = "tool result") -> None:
    """Every tool message answers a call of an earlier assistant message (its id), else a 400 naming
    `param` (result: what the API calls a tool's result, for the message)."""
    calls: set[str] = set()
    for m in messages:
        calls.update(json_types.text(call["id"]) for call in json_types.objects(m.get("tool_calls", []))
                     if isinstance(call.get("id"), str))
        answered = m.get("tool_call_id")
        if m["role"] == "tool" and answered not in calls:
            raise bad_request(f"{param}: the {result} for call id {answered!r} answers no tool call of an "
                              "earlier assistant message", param)
