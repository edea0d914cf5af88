"""The body of POST /v1/responses (OpenAI's Responses API) and its translation into a ChatRequest.

`ResponsesRequest` takes the Responses' own fields (and the sampling fields of vLLM and llama.cpp the
chat route takes), each checked here and named in its errors as the Responses API names it;
`chat_request` turns it (after the stored conversation its previous_response_id continues) into the
ChatRequest every chat API comes down to: input items → messages (function_call → an assistant's
tool_calls, function_call_output → a tool message), instructions → a system message first, flat
function and custom tools → chat functions (tools.py), text.format → the structured output.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import replace

from pydantic import ConfigDict, Field, StrictBool, model_validator

from phasewise import json_types
from phasewise.core.sampling_params import StructuredOutputs
from phasewise.engine.client import ChatPrompt
from phasewise.json_types import JsonObject, JsonValue
from phasewise.server import constraints, thinking
from phasewise.server.api_error import bad_request
from phasewise.server.chat_request import ChatRequest, check_call_ids
from phasewise.server.openai import caching
from phasewise.server.refused_fields import UNSUPPORTED_FIELDS
from phasewise.server.responses.tools import checked_tools, forced_custom, tool_choice
from phasewise.server.sampling_fields import INT64, BudgetFields, SamplingFields, make_params
from phasewise.server.thinking import BUDGET_FIELDS, EFFORTS

# Fields that would change the output and are not implemented here: a 400 naming them. The chat
# route's list, less what the Responses API has too, plus the Responses' own.
REFUSED = (UNSUPPORTED_FIELDS - {"tools", "tool_choice", "parallel_tool_calls", "max_completion_tokens",
                                  *BUDGET_FIELDS}) | {
    "conversation", "prompt", "top_logprobs", "context_management", "n", "logprobs"}
# include: what needs output this server gives (none of these tools runs here, and reasoning is the
# model's own); message.output_text.logprobs is not given (chat completions have logprobs)
INCLUDABLE = frozenset({"reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
                        "web_search_call.action.sources", "code_interpreter_call.outputs",
                        "computer_call_output.output.image_url", "message.input_image.image_url"})
# text.verbosity as a line of the system message (medium: the model's own length)
VERBOSITY = {"low": "Answer as briefly as the question allows.", "medium": None,
             "high": "Answer thoroughly, with detail and examples."}
# The chat spellings of Responses fields: a 400 that names the field to use.
CHAT_SPELLINGS = {"messages": "input", "response_format": "text.format", "max_tokens": "max_output_tokens",
                  "max_completion_tokens": "max_output_tokens"}
# why, where a refusal can say more
WHY = {"top_logprobs": " (output_text logprobs are not given here; /v1/chat/completions has logprobs)",
       "context_management": " (no compaction: with truncation \"auto\" the oldest turns are dropped to fit)"}
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(SamplingFields, BudgetFields):
    """Types, and what is refused: unknown fields pass unless refused (REFUSED, CHAT_SPELLINGS)."""
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    input: str | list[JsonObject] | None = None           # text, or items: see input_messages
    instructions: str | None = None
    tools: list[JsonObject] | None = None
    tool_choice: str | JsonObject | None = None
    parallel_tool_calls: StrictBool | None = None
    text: JsonObject | None = None                        # {"format": {...}, "verbosity": ...}
    max_output_tokens: int | None = Field(None, ge=1, lt=INT64)
    stream: StrictBool = False
    store: StrictBool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    reasoning: JsonObject | None = None
    include: list[str] | None = None
    truncation: str | None = None
    background: StrictBool | None = None
    max_tool_calls: int | None = Field(None, ge=0, lt=INT64)      # honoured: calls past it are dropped
    user: str | None = None
    prompt_cache_options: JsonObject | None = None        # OpenAI's mode and ttl (openai/caching.py)

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> ResponsesRequest:
        for name, value in (self.model_extra or {}).items():
            if value is None:
                continue
            if name in CHAT_SPELLINGS:
                raise bad_request(f"{name} is not a /v1/responses field: use {CHAT_SPELLINGS[name]}", name)
            if name in REFUSED:
                raise bad_request(f"{name} is not supported by this server{WHY.get(name, '')}", name)
        effort = (self.reasoning or {}).get("effort")
        if effort is not None and effort not in EFFORTS:
            raise bad_request(f"reasoning.effort must be one of {', '.join(EFFORTS)}, got "
                              f"{effort!r}", "reasoning")
        refused = [name for name in self.include or () if name not in INCLUDABLE]
        if refused:
            raise bad_request(f"include: {', '.join(refused)} is not supported by this server (logprobs: use "
                              "/v1/chat/completions)", "include")
        if self.truncation not in (None, "disabled", "auto"):
            raise bad_request('truncation must be "auto" (the oldest turns dropped to fit the context) or '
                              '"disabled" (a conversation longer than the context is a 400)', "truncation")
        if self.background and (self.stream or self.store is False):
            raise bad_request("background needs store (not false) and cannot be streamed here", "background")
        if (self.text or {}).get("verbosity", "medium") not in VERBOSITY:
            raise bad_request("text.verbosity must be low, medium or high", "text")
        return self

    @property
    def prewarm(self) -> bool:
        """prompt_cache_options.prewarm: the prompt only, run into the prefix cache; no output."""
        return caching.prewarm(self.prompt_cache_options)

    @property
    def stored(self) -> bool:
        return self.store is not False          # OpenAI's default: stored

    @property
    def text_format(self) -> JsonObject:
        fmt = (self.text or {}).get("format")
        return fmt if isinstance(fmt, dict) else {"type": "text"}


def input_messages(body: ResponsesRequest, known_calls: dict[str, str]) -> list[JsonObject]:
    """The request's input as chat messages. known_calls: call_id → function name of the calls so far
    (the stored conversation's), which a function_call_output's tool message is named by."""
    if body.input is None:
        return []
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[JsonObject] = []
    calls = dict(known_calls)
    for i, item in enumerate(body.input):
        kind = str(item.get("type", "message"))
        if kind == "message":
            messages.append(_message(item, i))
        elif kind == "reasoning":
            messages.append({"role": "assistant", "content": "", "reasoning_content": _reasoning(item, i)})
        elif kind in ("function_call", "custom_tool_call"):
            if kind == "custom_tool_call":       # its input as the one argument of its function (chat_tools)
                item = {**item, "arguments": json.dumps({"input": item.get("input")}, ensure_ascii=False)
                        if isinstance(item.get("input"), str) else None}
            call_id, name, arguments = (item.get(k) for k in ("call_id", "name", "arguments"))
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, str):
                raise bad_request(f"input.{i}: a function_call needs call_id, name "
                                  "and arguments (strings)", "input")
            calls[call_id] = name
            call: JsonObject = {"id": call_id, "type": "function",
                                "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                json_types.array(last.setdefault("tool_calls", [])).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise bad_request(f"input.{i}: a function_call_output needs a call_id", "input")
            output = _text(item.get("output"), f"input.{i}.output")
            message: JsonObject = {"role": "tool", "tool_call_id": call_id, "content": output}
            if call_id in calls:
                message["name"] = calls[call_id]
            messages.append(message)
        else:
            raise bad_request(f"input.{i}: items of type {kind!r} are not supported (message, reasoning, "
                              "function_call, function_call_output, custom_tool_call and "
                              "custom_tool_call_output are)", "input")
    return _join_reasoning(messages)


def _reasoning(item: JsonObject, i: int) -> str:
    """A reasoning item's text: its reasoning_text parts (else its summary's), joined."""
    parts = item.get("content") or item.get("summary") or []
    texts = [p.get("text") for p in parts if isinstance(p, dict)] if isinstance(parts, list) else [None]
    if not all(isinstance(t, str) for t in texts):
        raise bad_request(f"input.{i}: a reasoning item's content and summary "
                          "are lists of text parts", "input")
    return "\n\n".join(t for t in texts if isinstance(t, str))


def _join_reasoning(messages: list[JsonObject]) -> list[JsonObject]:
    """Each reasoning item's thinking on the assistant turn that follows it (its message or calls); one
    that no assistant turn follows is dropped."""
    out: list[JsonObject] = []
    for m in messages:
        last = out[-1] if out else None
        if last is not None and last["role"] == "assistant" and not last["content"] \
                and "tool_calls" not in last and "reasoning_content" in last and m["role"] == "assistant":
            thought = "\n\n".join(json_types.text(x["reasoning_content"]) for x in (last, m)
                                  if "reasoning_content" in x)
            out[-1] = {**m, "reasoning_content": thought}
        else:
            out.append(m)
    return [m for m in out if not (m["role"] == "assistant" and not m["content"] and "tool_calls" not in m
                                   and "reasoning_content" in m)]


def input_items(body: ResponsesRequest) -> list[JsonObject]:
    """The request's input as the items GET /v1/responses/{id}/input_items lists: each with an id, a
    message's content as parts (text: input_text)."""
    given: list[JsonObject] = [{"role": "user", "content": body.input}] if isinstance(body.input, str) \
        else [*(body.input or [])]
    items: list[JsonObject] = []
    for item in given:
        kind = str(item.get("type", "message"))
        out: JsonObject = {"type": kind, **item}
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            out["content"] = [{"type": part, "text": item["content"]}]
        out.setdefault("id", new_item_id(kind))
        out.setdefault("status", "completed")
        items.append(out)
    return items


def new_item_id(kind: str) -> str:
    prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
              "custom_tool_call": "ctc", "custom_tool_call_output": "ctco"}.get(kind, "item")
    return f"{prefix}_{uuid.uuid4().hex}"


def _message(item: JsonObject, i: int) -> JsonObject:
    role = item.get("role")
    if role not in ROLES:
        raise bad_request(f"input.{i}: a message's role must be one of "
                          f"{', '.join(ROLES)}, got {role!r}", "input")
    # developer: OpenAI's newer name of system
    return {"role": "system" if role == "developer" else role,
            "content": _text(item.get("content"), f"input.{i}.content")}


def _text(content: JsonValue, where: str) -> str:
    """A string, or a list of text parts joined (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") in TEXT_PARTS]
        strings = [t for t in texts if isinstance(t, str)]
        if len(strings) == len(content):
            return "".join(strings)
    raise bad_request(f"{where}: must be a string or a list of text parts (input_text, output_text); "
                      "images, files and audio are not supported", "input")


def text_format(body: ResponsesRequest) -> StructuredOutputs | None:
    """text.format as a structured output (None: plain text)."""
    fmt = (body.text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object with a type", "text")
    kind, strict = fmt.get("type"), fmt.get("strict")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind != "json_schema":
        raise bad_request(f"text.format.type must be text, json_object or json_schema, got {kind!r}", "text")
    if not isinstance(fmt.get("schema"), dict):
        raise bad_request("text.format.schema: a json_schema format needs its schema "
                          "(a JSON schema object)", "text")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("text.format.strict must be true or false", "text")
    # OpenAI's default is strict=false: keywords the compiler does not implement are then not enforced
    return StructuredOutputs(json=json_types.obj(fmt["schema"]), strict=bool(strict))


def structured_output(body: ResponsesRequest) -> tuple[StructuredOutputs | None, str | None]:
    """The output's constraint and the field that set it: text.format ("text"), a forced custom tool's
    grammar ("tools"), or one of vLLM's and llama.cpp's fields; at most one of them."""
    given = [name for name, value in (("text", text_format(body)), ("tools", forced_custom(body))) if value]
    other = constraints.given_field(body.constraint_fields())
    if other is not None:
        given.append(other)
    if len(given) > 1:
        raise bad_request(f"only one of {', '.join(given)} may constrain a request", given[1])
    if not given:
        return None, None
    custom = forced_custom(body)
    if given[0] == "tools" and custom is not None:     # the output is the tool's input, in its grammar
        fmt = json_types.obj(custom["format"])
        definition = json_types.text(fmt["definition"])
        return StructuredOutputs(grammar=definition) if fmt.get("syntax") == "lark" \
            else StructuredOutputs(regex=definition), "tools"
    if given[0] == "text":
        return text_format(body), "text"
    return constraints.structured_outputs(body.constraint_fields(), bad_request), given[0]


def chat_request(body: ResponsesRequest, history: list[JsonObject]) -> tuple[ChatRequest, int]:
    """The ChatRequest this body makes after `history` (the stored conversation it continues), and how
    many of its messages come before the conversation (the instructions' system message: not stored)."""
    known = {json_types.text(c["id"]): json_types.text(json_types.obj(c["function"])["name"])
             for m in history for c in json_types.objects(m.get("tool_calls"))}      # the stored calls
    verbosity = VERBOSITY.get(json_types.text((body.text or {}).get("verbosity") or "medium"))
    system = "\n\n".join(s for s in (body.instructions, verbosity) if s)
    head: list[JsonObject] = [{"role": "system", "content": system}] if system else []
    messages = [*head, *history, *input_messages(body, known)]
    if not messages:
        raise bad_request("input must not be empty", "input")
    check_call_ids(messages, "input", "function_call_output")
    tools = checked_tools(body.tools)
    choice = tool_choice(body, tools is not None)
    constraint, field = structured_output(body)
    # a forced custom call's input is the whole output: no call to parse
    if field == "tools":
        choice = replace(choice, mode="none", name=None)
    params = make_params(body.common(1, constraint), 0 if body.prewarm else body.max_output_tokens, None,
                         max_tokens_field="max_output_tokens", prompt_only=body.prewarm)
    effort = json_types.obj(body.reasoning).get("effort") if body.reasoning else None
    effort = effort if isinstance(effort, str) else None
    kwargs = thinking.template_kwargs(None, effort, bad_request, "reasoning")
    names = {"prompt": "input", "max_tokens": "max_output_tokens",
             **({"structured_outputs": field} if field else {})}
    before = [*head, *history]
    points = caching.cache_points(_cache_marks(body, before, known), body.prompt_cache_options, messages,
                                  lambda cut: ChatPrompt(cut, tools, kwargs or None,
                                                         add_generation_prompt=False),
                                  "input", prewarm_taken=True)
    request = ChatRequest(ChatPrompt(messages, tools, kwargs or None, cache_points=points), params, 1, choice,
                          body.max_tool_calls,
                          thinking.thinking_budget(body.budget_fields(), effort), names=names)
    return request, len(head)


def _cache_marks(body: ResponsesRequest, before: list[JsonObject],
                 known: dict[str, str]) -> list[caching.Mark]:
    """The input's parts with a prompt_cache_breakpoint, each with the messages as far as it (after `before`:
    the instructions and the stored conversation)."""
    marks: list[caching.Mark] = []
    items = body.input if isinstance(body.input, list) else []
    for i, item in enumerate(items):
        parts = item.get("content")
        parts = parts if isinstance(parts, list) else []
        for j, part in enumerate(parts):
            if isinstance(part, dict) and part.get("prompt_cache_breakpoint") is not None:
                upto = body.model_copy(update={"input": [*items[:i], {**item, "content": parts[:j + 1]}]})
                marks.append((f"input[{i}].content[{j}]", part["prompt_cache_breakpoint"],
                              [*before, *input_messages(upto, known)]))
    return marks
