"""What the chat-shaped APIs share: a chat request made ready to run, and its submission to the engine.

/v1/chat/completions, /v1/responses and /v1/messages all come down to one `ChatCompletionRequest`
(the latter two translate their bodies into it), which `chat_call` turns into the engine requests and
the tool-call parsing of their output; `Submitter.start` admits and submits them, turning the engine's
refusals into APIErrors (each API renders them in its own shape).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from phasewise.engine.admission import ContextLengthError, RequestError
from phasewise.core.sampling_params import ConstraintError
from phasewise.server.async_engine import SubRequest
from phasewise.server.errors import EngineDeadError
from phasewise import json_types
from phasewise.json_types import JsonObject
from phasewise.server.guards import Guards
from phasewise.server.api_error import APIError, bad_request
from phasewise.server.openai.protocol import ChatCompletionRequest, choice_params
from phasewise.server.reply_parser import ReplyParser
from phasewise.server.request_stream import RequestStream
from phasewise.server.thinking import Thinking
from phasewise.tool_calling import ToolCallParser


@dataclass(frozen=True)
class ChatCall:
    """A chat request ready to run: its engine requests (one per choice) and how to read thinking and
    tool calls out of their text (tool_format None: no tools, or tool_choice "none"; max_calls 1 with
    parallel_tool_calls false; thinking None: no reasoning parser)."""
    rid: str
    items: list[SubRequest]
    tool_format: str | None
    tool_names: frozenset[str]
    max_calls: int | None
    constraint_field: str | None
    thinking: Thinking | None = None
    template_kwargs: JsonObject | None = None
    include_reasoning: bool = True

    def parser(self) -> ReplyParser | None:
        """A fresh parser for one choice's text, or None when nothing is parsed."""
        tools = ToolCallParser(self.tool_format, self.tool_names, self.max_calls) if self.tool_format else None
        reasoning = self.thinking.parser(self.template_kwargs) if self.thinking else None
        return ReplyParser(reasoning, tools, self.include_reasoning) if tools or reasoning else None


def chat_call(body: ChatCompletionRequest, template_tool_format: str, rid: str,
              thinking: Thinking | None = None, max_tool_calls: int | None = None) -> ChatCall:
    """The request's sub-requests; 400 (APIError) for what is wrong with it. template_tool_format: the
    format the model's chat template calls tools in (Tokenizer.tool_format); thinking: the server's;
    max_tool_calls: calls past it are dropped (the Responses field; parallel_tool_calls false is one)."""
    params, tool_format = body.tool_params(body.sampling_params(), template_tool_format)
    block = thinking.block(body.thinking_budget()) if thinking else None
    if block is not None:                  # the engine tracks the thinking, keeps its budget, grammars after it
        params = replace(params, thinking=block)
    messages, tools, kwargs = body.conversation(), body.checked_tools(), body.template_kwargs()
    names = frozenset(json_types.text(json_types.obj(t["function"])["name"]) for t in tools or ())   # checked tools
    ending = body.ending()
    items = [SubRequest(sub_id(rid, j, body.n), messages, choice_params(params, j), tools, kwargs or None, ending)
             for j in range(body.n)]
    limits = [n for n in (max_tool_calls, None if body.parallel_tool_calls else 1) if n is not None]
    return ChatCall(rid, items, tool_format, names, min(limits, default=None), body.constraint_field,
                    thinking, kwargs, body.include_reasoning)


def sub_id(rid: str, i: int, total: int) -> str:
    """The engine request id of an API call's i-th of `total` sub-requests."""
    return rid if total == 1 else f"{rid}-{i}"


class Submitter:
    """Admits and submits an API call's engine requests; the engine's refusals become APIErrors."""

    def __init__(self, guards: Guards) -> None:
        self.guards, self.engine = guards, guards.engine

    async def start(self, items: list[SubRequest], chat: bool, constraint_field: str | None = None,
                    prompt_param: str = "messages") -> RequestStream:
        """prompt_param: the field a chat request's prompt came from, named by a context-length error."""
        self.guards.admit(len(items))
        try:
            return await self.engine.submit(items, chat)
        except ConstraintError as e:
            raise bad_request(str(e), constraint_field) from None
        except RequestError as e:
            param = prompt_param if e.param == "prompt" and chat else e.param
            if isinstance(e, ContextLengthError):
                raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
            raise bad_request(str(e), param) from None
        except ValueError as e:
            raise bad_request(str(e)) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), type="server_error", code="engine_dead") from None
