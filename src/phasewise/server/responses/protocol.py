"""The body of POST /v1/responses (OpenAI's Responses API) and its translation into a chat request.

`ResponsesRequest` takes the Responses' own fields; `chat_request` turns it (after the stored
conversation its previous_response_id continues) into the `ChatCompletionRequest` the chat route
would get, so every check and the engine path are the chat route's: input items → messages
(function_call → an assistant's tool_calls, function_call_output → a tool message), instructions →
a system message first, flat function tools → chat tools, text.format → response_format,
max_output_tokens → max_tokens. `renamed` puts the chat errors' field names back in Responses terms.
"""

from __future__ import annotations

import json
import re
import uuid

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, model_validator

from phasewise.json_types import JsonObject, JsonValue
from phasewise import json_types
from phasewise.server.body_parsing import validation_message
from phasewise.server.api_error import APIError, bad_request
from phasewise.server.openai.protocol import INT64, ChatCompletionRequest
from phasewise.server.refused_fields import UNSUPPORTED_FIELDS
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
# The chat route's extra sampling and constraint fields, passed through as they are.
PASSED = ("seed", "stop", "presence_penalty", "frequency_penalty", "top_k", "min_p", "repetition_penalty",
          "ignore_eos", "min_tokens", "stop_token_ids", "skip_special_tokens", "logit_bias", "structured_outputs",
          "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
          "json_schema", "grammar", *BUDGET_FIELDS)
# why, where a refusal can say more
WHY = {"top_logprobs": " (output_text logprobs are not given here; /v1/chat/completions has logprobs)",
       "context_management": " (no compaction: with truncation \"auto\" the oldest turns are dropped to fit)"}
# A chat error's field → (the Responses param, the name its message uses)
RENAMES = {"messages": ("input", "input"), "response_format": ("text", "text.format"),
           "max_tokens": ("max_output_tokens", "max_output_tokens"),
           "reasoning_effort": ("reasoning", "reasoning.effort")}
_RENAME_RE = re.compile(r"\b(messages|response_format|max_tokens|reasoning_effort)\b")
_CHAT_TOOL_RE = re.compile(r"\btools\[(\d+)\]\.function\.")       # a chat tool's field; flat here
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    """Types only; unknown fields pass unless refused (REFUSED, CHAT_SPELLINGS) or passed on (PASSED)."""
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    input: str | list[JsonObject] | None = None           # text, or items: see input_messages
    instructions: str | None = None
    tools: list[JsonObject] | None = None
    tool_choice: str | JsonObject | None = None
    parallel_tool_calls: StrictBool | None = None
    text: JsonObject | None = None                        # {"format": {...}, "verbosity": ...}
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
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
            raise bad_request(f"reasoning.effort must be one of {', '.join(EFFORTS)}, got {effort!r}", "reasoning")
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
    def stored(self) -> bool:
        return self.store is not False          # OpenAI's default: stored

    @property
    def text_format(self) -> JsonObject:
        fmt = (self.text or {}).get("format")
        return fmt if isinstance(fmt, dict) else {"type": "text"}


def renamed(e: APIError) -> APIError:
    """The chat route's error with its field names as the Responses API spells them."""
    param = RENAMES[e.param][0] if e.param in RENAMES else e.param
    message = _CHAT_TOOL_RE.sub(r"tools[\1].", _RENAME_RE.sub(lambda m: RENAMES[m[1]][1], e.message))
    return APIError(e.status, message, e.type, param, e.code, e.headers)


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
                raise bad_request(f"input.{i}: a function_call needs call_id, name and arguments (strings)", "input")
            calls[call_id] = name
            call: JsonObject = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
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
                              "function_call, function_call_output, custom_tool_call and custom_tool_call_output "
                              "are)", "input")
    return _join_reasoning(messages)


def _reasoning(item: JsonObject, i: int) -> str:
    """A reasoning item's text: its reasoning_text parts (else its summary's), joined."""
    parts = item.get("content") or item.get("summary") or []
    texts = [p.get("text") for p in parts if isinstance(p, dict)] if isinstance(parts, list) else [None]
    if not all(isinstance(t, str) for t in texts):
        raise bad_request(f"input.{i}: a reasoning item's content and summary are lists of text parts", "input")
    return "\n\n".join(t for t in texts if isinstance(t, str))


def _join_reasoning(messages: list[JsonObject]) -> list[JsonObject]:
    """Each reasoning item's thinking on the assistant turn that follows it (its message or calls); one
    that no assistant turn follows is dropped."""
    out: list[JsonObject] = []
    for m in messages:
        last = out[-1] if out else None
        if last is not None and last["role"] == "assistant" and not last["content"] and "tool_calls" not in last \
                and "reasoning_content" in last and m["role"] == "assistant":
            thought = "\n\n".join(json_types.text(x["reasoning_content"]) for x in (last, m) if "reasoning_content" in x)
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
    prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "custom_tool_call": "ctc",
              "custom_tool_call_output": "ctco"}.get(kind, "item")
    return f"{prefix}_{uuid.uuid4().hex}"


def _message(item: JsonObject, i: int) -> JsonObject:
    role = item.get("role")
    if role not in ROLES:
        raise bad_request(f"input.{i}: a message's role must be one of {', '.join(ROLES)}, got {role!r}", "input")
    return {"role": role, "content": _text(item.get("content"), f"input.{i}.content")}


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
            raise bad_request(f"tools.{i}.format: a grammar needs syntax lark or regex and its definition", "tools")
        string["description"] = f"the tool's input: text in this {syntax} grammar: {definition}"
    fn: JsonObject = {"name": tool.get("name"), "parameters": {
        "type": "object", "properties": {"input": string}, "required": ["input"], "additionalProperties": False}}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def forced_custom(body: ResponsesRequest) -> JsonObject | None:
    """The custom tool the call is forced to, when it has a grammar (tool_choice names it, or "required" and
    it is the only tool): the whole output is then its input, held to the grammar (vLLM's structured
    outputs: {"grammar": Lark} or {"regex": ...}). None otherwise."""
    tools, choice = body.tools or [], body.tool_choice
    named = choice.get("name") if isinstance(choice, dict) else None
    chosen = [t for t in tools if t.get("name") == named] if named else tools if choice == "required" else []
    if len(chosen) != 1 or chosen[0].get("type") != "custom":
        return None
    fmt = chosen[0].get("format")
    if not isinstance(fmt, dict) or fmt.get("type") != "grammar" or not isinstance(fmt.get("definition"), str):
        return None
    return chosen[0]


def chat_tools(tools: list[JsonObject] | None) -> list[JsonValue] | None:
    """Responses' flat function tools (and custom tools, as functions of their input) as chat tools;
    other kinds of tool are a 400 naming tools."""
    if tools is None:
        return None
    out: list[JsonValue] = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind == "custom":
            out.append(_custom_function(i, tool))
            continue
        if kind != "function":
            raise bad_request(f"tools.{i}: only function and custom tools are supported, got type {kind!r}", "tools")
        if "function" in tool and "name" not in tool:        # the chat shape, taken as it is
            out.append(tool)
            continue
        fn: JsonObject = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                          if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | JsonObject | None) -> str | JsonObject | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") not in ("function", "custom") or not isinstance(choice.get("name"), str):
        raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function" (or "custom"), '
                          '"name": ...}', "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def response_format(body: ResponsesRequest) -> JsonObject | None:
    """text.format as the chat route's response_format (None: plain text)."""
    fmt = (body.text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object with a type", "text")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format.schema: a json_schema format needs its schema (a JSON schema object)",
                              "text")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    raise bad_request(f"text.format.type must be text, json_object or json_schema, got {kind!r}", "text")


def chat_request(body: ResponsesRequest, history: list[JsonObject]) -> tuple[ChatCompletionRequest, int]:
    """The chat request this body makes after `history` (the stored conversation it continues), and how
    many of its messages come before the conversation (the instructions' system message: not stored)."""
    known = {json_types.text(c["id"]): json_types.text(json_types.obj(c["function"])["name"])
             for m in history for c in json_types.objects(m.get("tool_calls"))}      # the stored calls
    verbosity = VERBOSITY.get(json_types.text((body.text or {}).get("verbosity") or "medium"))
    system = "\n\n".join(s for s in (body.instructions, verbosity) if s)
    head: list[JsonObject] = [{"role": "system", "content": system}] if system else []
    chat: JsonObject = {
        "model": body.model, "messages": [*head, *history, *input_messages(body, known)],
        "tools": chat_tools(body.tools), "tool_choice": chat_tool_choice(body.tool_choice),
        "response_format": response_format(body), "max_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p}
    if body.parallel_tool_calls is not None:
        chat["parallel_tool_calls"] = body.parallel_tool_calls
    if (body.reasoning or {}).get("effort") is not None:
        chat["reasoning_effort"] = json_types.obj(body.reasoning)["effort"]
    extra = body.model_extra or {}
    chat.update({name: extra[name] for name in PASSED if name in extra})
    custom = forced_custom(body)
    if custom is not None:                 # the output is the tool's input, in its grammar: no call to parse
        fmt = json_types.obj(custom["format"])
        chat["tool_choice"] = "none"
        chat["structured_outputs"] = {"grammar" if fmt.get("syntax") == "lark" else "regex": fmt["definition"]}
    try:
        return ChatCompletionRequest.model_validate(chat), len(head)
    except ValidationError as e:
        message, param = validation_message(e.errors(include_url=False, include_input=False, include_context=False))
        raise bad_request(message, param) from None
