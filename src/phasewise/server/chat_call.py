"""What the chat-shaped APIs share: a ChatRequest made ready to run, and its submission to the engine.

/v1/chat/completions, /v1/responses and /v1/messages each build one `ChatRequest` (chat_request.py),
which `chat_call` turns into the engine requests (one per choice: the ChatPrompt and SamplingParams, with
a forced call's grammar and the thinking block the engine keeps) and the reading of their output (thinking,
answer, tool calls); `Submitter.start` admits and submits them, turning the engine's refusals into
APIErrors naming the API's own fields (each API renders them in its own shape).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from phasewise import tool_calling
from phasewise.core.sampling_params import ConstraintError, SamplingParams, StructuredOutputs
from phasewise.engine.admission import ContextLengthError, RequestError
from phasewise.json_types import JsonObject
from phasewise.server.api_error import APIError, bad_request
from phasewise.server.async_engine import SubRequest
from phasewise.server.chat_request import ChatRequest
from phasewise.server.errors import EngineDeadError
from phasewise.server.guards import Guards
from phasewise.server.reply_parser import ReplyParser
from phasewise.server.request_stream import RequestStream
from phasewise.server.thinking import Thinking, resolved_budget
from phasewise.tool_calling import ToolCallParser


@dataclass(frozen=True)
class ChatCall:
    """A chat request ready to run: its engine requests (one per choice) and how to read thinking and
    tool calls out of their text (tool_format None: no tools, or tool_choice "none"; max_calls 1 with
    parallel_tool_calls false; thinking None: no reasoning parser)."""
    rid: str
    items: list[SubRequest]
    tool_format: tool_calling.ToolFormat | None
    tool_names: frozenset[str]
    max_calls: int | None
    constraint_field: str | None
    thinking: Thinking | None = None
    template_kwargs: JsonObject | None = None
    include_reasoning: bool = True
    names: Mapping[str, str] | None = None        # the API's names of engine fields (ChatRequest.names)

    def parser(self) -> ReplyParser | None:
        """A fresh parser for one choice's text, or None when nothing is parsed."""
        tools = None if not self.tool_format else \
            ToolCallParser(self.tool_format, self.tool_names, self.max_calls)
        reasoning = self.thinking.parser(self.template_kwargs) if self.thinking else None
        return ReplyParser(reasoning, tools, self.include_reasoning) if tools or reasoning else None

    @property
    def fields(self) -> dict[str, str]:
        """Engine fields → the API's names, for Submitter.start (the constraint: the field that set it)."""
        names = dict(self.names or {})
        if self.constraint_field is not None:
            names["structured_outputs"] = self.constraint_field
        return names


def chat_call(request: ChatRequest, template_tool_format: tool_calling.ToolFormat, rid: str,
              thinking: Thinking | None = None) -> ChatCall:
    """The request's sub-requests; 400 (APIError) for a forced call the tools cannot make.
    template_tool_format: the format the model's chat template calls tools in (Tokenizer.tool_format);
    thinking: the server's (its parser, and the default budget for a request that gives none)."""
    params, tool_format = tool_params(request, template_tool_format)
    asked = request.thinking_budget
    budget = thinking.budget(asked) if thinking else resolved_budget(asked)
    prompt = request.prompt
    # no thinking: the template's switch off too, unless the request set it
    if budget == 0:
        prompt = replace(prompt, template_kwargs={"enable_thinking": False, **(prompt.template_kwargs or {})})
    block = thinking.block(budget) if thinking else None
    # the engine tracks the thinking, keeps its budget, grammars after it
    if block is not None:
        params = replace(params, thinking=block)
    items = [SubRequest(sub_id(rid, j, request.n), prompt, choice_params(params, j))
             for j in range(request.n)]
    choice = request.tool_choice
    limits = [n for n in (request.max_tool_calls, None if choice.parallel else 1) if n is not None]
    constraint = "tool_choice" if tool_format and choice.forced else \
        request.field("structured_outputs") if request.params.structured_outputs else None
    return ChatCall(rid, items, tool_format, request.tool_names, min(limits, default=None), constraint,
                    thinking, prompt.template_kwargs, request.include_reasoning, request.names)


def tool_params(request: ChatRequest, tool_format: tool_calling.ToolFormat
                ) -> tuple[SamplingParams, tool_calling.ToolFormat | None]:
    """The params, whose grammar forces a call when tool_choice asks for one, and the format to parse calls
    in (None: tool_choice "none" or no tools, nothing is parsed)."""
    params, tools, choice = request.params, request.prompt.tools, request.tool_choice
    if tools is None or choice.mode == "none":
        return params, None
    if choice.forced:
        if params.structured_outputs is not None:
            raise bad_request(f"tool_choice {choice} forces a tool call: it cannot be combined with "
                              f"{request.field('structured_outputs')}", "tool_choice")
        try:
            grammar = tool_calling.call_grammar(tools, tool_format, choice.name, choice.parallel)
        except ValueError as e:
            raise bad_request(str(e), "tool_choice") from None
        params = replace(params, structured_outputs=StructuredOutputs(grammar=grammar))
    return params, tool_format


def choice_params(params: SamplingParams, i: int) -> SamplingParams:
    """The params of choice i: with a seed, choice i gets seed + i so the choices differ."""
    if params.seed is None or i == 0:
        return params
    return replace(params, seed=(params.seed + i) % 2 ** 64)


def sub_id(rid: str, i: int, total: int) -> str:
    """The engine request id of an API call's i-th of `total` sub-requests."""
    return rid if total == 1 else f"{rid}-{i}"


class Submitter:
    """Admits and submits an API call's engine requests; the engine's refusals become APIErrors."""

    def __init__(self, guards: Guards) -> None:
        self.guards, self.engine = guards, guards.engine

    async def start(self, items: list[SubRequest], chat: bool, fields: Mapping[str, str] | None = None,
                    tenant: str | None = None) -> RequestStream:
        """fields: the API's names of the engine's fields ("prompt", "max_tokens", "structured_outputs"),
        which its errors name. tenant: the API key's cache salt (Guards.tenant), joined to the request's."""
        names = fields or {}
        self.guards.admit(len(items))
        try:
            return await self.engine.submit(salted(items, tenant), chat)
        except ConstraintError as e:
            raise bad_request(str(e), names.get("structured_outputs")) from None
        except RequestError as e:
            param = names.get(e.param, e.param) if e.param is not None else None
            if isinstance(e, ContextLengthError):
                raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
            raise bad_request(str(e), param) from None
        except ValueError as e:
            raise bad_request(str(e)) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), type="server_error", code="engine_dead") from None


def salted(items: list[SubRequest], tenant: str | None) -> list[SubRequest]:
    """The sub-requests with the tenant's cache salt before their own (a tenant cannot name another's
    salt)."""
    if tenant is None:
        return items
    return [replace(it, params=replace(it.params, cache_salt=tenant if it.params.cache_salt is None
                                       else f"{tenant}/{it.params.cache_salt}")) for it in items]
