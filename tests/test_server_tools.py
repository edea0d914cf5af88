"""Tool calling through the server with the official openai client: tools rendered (the default
model's template has no tool support: the generic prompt), calls forced by tool_choice "required" or a
named function and parsed into message.tool_calls with finish_reason "tool_calls", streamed as OpenAI
streams them, tool results sent back; bad tools and tool_choice are 400s naming the field."""

from __future__ import annotations

import json

import jsonschema
import pytest

from live_server import CHAT, MODEL, assert_openai_error

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def create(server, **kw):
    return server.client().chat.completions.create(model=MODEL, messages=kw.pop("messages", ASK), tools=TOOLS,
                                                   temperature=0, max_tokens=80, **kw)


def assert_valid_calls(calls):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_forces_calls_with_valid_arguments(server):
    out = create(server, tool_choice="required", parallel_tool_calls=False)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    assert_valid_calls(choice.message.tool_calls)


def test_a_named_function_is_the_one_called(server):
    out = create(server, tool_choice={"type": "function", "function": {"name": "add"}}, parallel_tool_calls=False,
                 messages=[{"role": "user", "content": "What is 2 plus 40?"}])
    calls = out.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["add"]
    assert_valid_calls(calls)


def test_streamed_calls_add_up_to_the_same_calls(server):
    whole = create(server, tool_choice="required", parallel_tool_calls=False).choices[0].message.tool_calls
    chunks = list(create(server, tool_choice="required", parallel_tool_calls=False, stream=True))
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(c.index, {"id": None, "name": "", "arguments": ""})
            if c.id:
                assert call["id"] is None          # the id and name come once, first
                call["id"], call["name"] = c.id, c.function.name
            call["arguments"] += c.function.arguments or ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in whole]


def test_auto_answers_or_calls_and_none_never_calls(server):
    for choice in (None, "auto"):
        message = create(server, **({"tool_choice": choice} if choice else {})).choices[0].message
        if message.tool_calls:
            assert_valid_calls(message.tool_calls)
        else:
            assert message.content
    out = create(server, tool_choice="none")
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason in ("stop", "length")


def streamed_calls(chunks) -> list[dict]:
    """The assistant message's tool_calls as a client rebuilds them from the chunks."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(c.index, {"id": c.id, "type": "function", "function": {"name": "", "arguments": ""}})
            call["function"]["name"] += c.function.name or ""
            call["function"]["arguments"] += c.function.arguments or ""
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["auto", "required", "named"])
def test_the_round_trip_call_result_answer(server, choice, stream):
    """The SDK round trip: a call, its result sent back as a tool message, then the final answer."""
    if stream:
        calls = streamed_calls(create(server, tool_choice=choice, parallel_tool_calls=False, stream=True))
    else:
        message = create(server, tool_choice=choice, parallel_tool_calls=False).choices[0].message
        calls = [c.model_dump() for c in message.tool_calls or []]
    if not calls:                          # auto: the model may answer at once
        assert choice == "auto"
        return
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": calls},
               *({"role": "tool", "tool_call_id": c["id"], "content": '{"temperature": 21, "sky": "clear"}'}
                 for c in calls)]
    final = create(server, messages=history, tool_choice="none").choices[0]
    assert final.message.content and final.message.tool_calls is None
    tokens = server.post("/tokenize", {"messages": history, "tools": TOOLS}).json()["tokens"]
    text = server.post("/detokenize", {"tokens": tokens}).json()["prompt"]
    assert '<tool_response>\n{"temperature": 21, "sky": "clear"}\n</tool_response>' in text
    assert '<tool_call>\n{"name": "' + calls[0]["function"]["name"] in text and "get_weather" in text


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "required"}, "tool_choice"),                                       # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    *(({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}],
        **({"tool_choice": choice} if choice else {})}, "tools") for choice in (None, "auto", "none", "required")),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"minimum": "x"}}}}}]},
     "tools"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tools_and_tool_choice_are_400s(server, fields, param):
    err = assert_openai_error(server.post("/v1/chat/completions", {**CHAT, **fields}), 400)
    assert err["param"] == param


def test_a_tool_message_needs_the_id_of_its_call(server):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "21 degrees"}]
    err = assert_openai_error(server.post("/v1/chat/completions", {**CHAT, "messages": history, "tools": TOOLS}), 400,
                              "tool_call_id")
    assert err["param"] == "messages"


QWEN_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                "parameters": WEATHER}},
              {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}], ids=["required", "named"])
def test_forced_calls_on_a_template_with_tools(qwen_server, choice, stream):
    """Qwen2.5's own template (Hermes <tool_call> blocks, an added token of that text): required and named
    calls come back as calls whose arguments validate, with finish_reason tool_calls."""
    kw = {"model": "qwen", "messages": [{"role": "user", "content": "What is 2 plus 40?"}], "tools": QWEN_TOOLS,
          "tool_choice": choice, "parallel_tool_calls": False, "temperature": 0, "max_tokens": 60}
    client = qwen_server.client()
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in streamed_calls(chunks)]
    else:
        out = client.chat.completions.create(**kw).choices[0]
        assert out.finish_reason == "tool_calls" and out.message.content is None
        calls = [(c.function.name, c.function.arguments) for c in out.message.tool_calls]
    assert len(calls) == 1
    name, arguments = calls[0]
    assert name == "add" or choice == "required"
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_a_grammar_literal_is_the_added_token_of_its_text(qwen_server):
    """No tools: a grammar whose literal is <tool_call> takes Qwen's added token of that text (it refused it
    once, and the request ended with finish_reason "error")."""
    out = qwen_server.client().chat.completions.create(
        model="qwen", messages=[{"role": "user", "content": "Say hi."}], temperature=0, max_tokens=20,
        extra_body={"structured_outputs": {"grammar": 'start: "<tool_call>" " hi"'}}).choices[0]
    assert out.finish_reason == "stop" and out.message.content == "<tool_call> hi"


def test_parallel_forced_calls_end_by_themselves(server):
    """With parallel_tool_calls (the default) a forced reply holds one to 8 calls, then ends: the default
    model, which knows no tool format, would otherwise call until max_tokens."""
    out = server.client().chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0,
                                                  max_tokens=1000, tool_choice="required").choices[0]
    assert out.finish_reason == "tool_calls" and 1 <= len(out.message.tool_calls) <= 8
    assert_valid_calls(out.message.tool_calls)
