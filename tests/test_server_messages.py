"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) with the official anthropic client:
messages and their usage, streaming (the same message as a collected one), stop reasons, tool_use blocks
forced by tool_choice and the tool_result round trip, count_tokens, and errors in Anthropic's shape.
The event rendering of engine failures is checked without a server, on a stream that fails."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import anthropic
import httpx
import jsonschema
import pytest

from live_server import KEY, MAX_BODY, MODEL
from phasewise.core.request import RequestMetrics
from phasewise.outputs import CompletionOutput, StreamDelta
from phasewise.server.anthropic.output import Blocks, message_body, message_events
from phasewise.server.chat_call import ChatCall
from phasewise.server.errors import EngineError
from phasewise.server.api_error import APIError
from phasewise.tool_calling import ToolCallParser

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
TOOLS = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER},
         {"name": "add", "description": "Add two integers", "input_schema": ADD}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HELLO = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"temperature": 0}        # the SDK has no sampling arguments any more; the API still takes them


def client(server, api_key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=api_key, max_retries=0, timeout=120)


def create(server, model: str = MODEL, **kw) -> anthropic.types.Message:
    kw.setdefault("messages", HELLO)
    return client(server).messages.create(model=model, max_tokens=kw.pop("max_tokens", 24), extra_body=GREEDY, **kw)


def blocks(message) -> list[tuple]:
    """A message's content blocks as (type, text or (name, input)); tool_use ids differ from call to call."""
    return [(b.type, b.text if b.type == "text" else (b.name, b.input)) for b in message.content]


def tool_uses(message) -> list:
    return [b for b in message.content if b.type == "tool_use"]


def assert_valid_call(block, name: str | None = None) -> None:
    assert block.id.startswith("toolu_") and (name is None or block.name == name)
    jsonschema.validate(block.input, SCHEMAS[block.name])


def assert_anthropic_error(resp: httpx.Response, status: int, kind: str, *needles: str) -> str:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}, body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    for needle in needles:
        assert needle in body["error"]["message"], body
    return body["error"]["message"]


# ---- messages ---------------------------------------------------------------------------------------

def test_a_message_with_its_usage(server):
    out = create(server, system=[{"type": "text", "text": "You are terse."},
                                 {"type": "text", "text": "Answer in English.", "cache_control": {"type": "ephemeral"}}],
                 metadata={"user_id": "u-1"})
    assert out.id.startswith("msg_") and out.type == "message" and out.role == "assistant" and out.model == MODEL
    assert [b.type for b in out.content] == ["text"] and out.content[0].text.strip()
    assert out.stop_reason in ("end_turn", "max_tokens") and out.stop_sequence is None
    assert 0 < out.usage.output_tokens <= 24     # the marked system turn: its whole block written at 5m, or read
    assert out.usage.cache_creation_input_tokens == out.usage.cache_creation.ephemeral_5m_input_tokens <= 16
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens + out.usage.cache_creation_input_tokens > 10
    again = create(server, system="You are terse.\n\nAnswer in English.")   # a list of blocks joins as this does
    assert blocks(again) == blocks(out)
    assert again.usage.cache_read_input_tokens > 0           # the prefix cache served the same prompt


def test_max_tokens_and_stop_sequences_are_stop_reasons(server):
    cut = create(server, max_tokens=3)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    text = create(server).content[0].text
    stop = text.split()[2]
    out = create(server, stop_sequences=["NEVER-SEEN", stop])
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == stop
    assert stop not in out.content[0].text and text.startswith(out.content[0].text)


def test_the_stream_builds_the_same_message(server):
    whole = create(server)
    with client(server).messages.stream(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=HELLO) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert blocks(final) == blocks(whole) and text == whole.content[0].text
    assert (final.stop_reason, final.stop_sequence, final.usage.output_tokens) == \
        (whole.stop_reason, whole.stop_sequence, whole.usage.output_tokens)
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_the_events_on_the_wire(server):
    """As Claude Code sends it: ?beta=true, beta headers, system blocks with cache_control, metadata."""
    body = {"model": MODEL, "max_tokens": 8, "messages": HELLO, "stream": True, "metadata": {"user_id": "u"},
            "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}], **GREEDY}
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "fine-grained-tool-streaming-2025-05-14"}
    with httpx.stream("POST", server.url + "/v1/messages?beta=true", json=body, headers=headers, timeout=120) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    names = [line[len("event: "):] for line in lines[0::2]]
    data = [json.loads(line[len("data: "):]) for line in lines[1::2]]
    assert [d["type"] for d in data] == names                     # every event line names its data
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert data[-2]["delta"]["stop_reason"] == "max_tokens" and data[-2]["usage"]["output_tokens"] == 8


# ---- tools ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("choice, name", [({"type": "any", "disable_parallel_tool_use": True}, None),
                                          ({"type": "tool", "name": "add", "disable_parallel_tool_use": True}, "add")],
                         ids=["any", "tool"])
def test_a_forced_call_is_a_tool_use_block(server, choice, name):
    out = create(server, tools=TOOLS, tool_choice=choice, max_tokens=40,
                 messages=ASK if name is None else [{"role": "user", "content": "What is 2 plus 40?"}])
    assert out.stop_reason == "tool_use" and len(tool_uses(out)) == 1
    assert_valid_call(tool_uses(out)[0], name)


def test_a_streamed_call_has_the_same_input(server):
    kw = {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
          "messages": ASK}
    whole = create(server, max_tokens=40, **kw)
    with client(server).messages.stream(model=MODEL, max_tokens=40, extra_body=GREEDY, **kw) as stream:
        partial = "".join(e.partial_json for e in stream if e.type == "input_json")
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and json.loads(partial) == tool_uses(whole)[0].input
    assert blocks(final) == blocks(whole)


def test_the_round_trip_and_count_tokens(server):
    """tool_use → tool_result → a text answer; count_tokens counts each prompt as the request ran it."""
    c = client(server)
    call = create(server, tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True}, messages=ASK,
                  max_tokens=40)
    use = tool_uses(call)[0]
    history = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in call.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": [{"type": "text", "text": '{"temperature": 21}'}]}]}]
    answer = create(server, tools=TOOLS, tool_choice={"type": "none"}, messages=history)
    assert answer.content and not tool_uses(answer) and answer.stop_reason in ("end_turn", "max_tokens")
    for out, messages in ((call, ASK), (answer, history)):
        counted = c.messages.count_tokens(model=MODEL, messages=messages, tools=TOOLS)
        assert counted.input_tokens == out.usage.input_tokens + out.usage.cache_read_input_tokens
    assert c.messages.count_tokens(model=MODEL, messages=ASK).input_tokens < \
        c.messages.count_tokens(model=MODEL, messages=ASK, tools=TOOLS).input_tokens


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}], ids=["any", "tool"])
def test_a_forced_call_on_a_template_with_tools(qwen_server, choice):
    out = create(qwen_server, model="qwen", tools=TOOLS, tool_choice=choice, messages=ASK, max_tokens=40)
    assert out.stop_reason == "tool_use" and tool_uses(out)
    for block in tool_uses(out):
        assert_valid_call(block, choice.get("name"))
    counted = client(qwen_server).messages.count_tokens(model="qwen", messages=ASK, tools=TOOLS)
    assert counted.input_tokens == out.usage.input_tokens + out.usage.cache_read_input_tokens


@pytest.mark.parametrize("spelling", ["output_config", "output_format"])
@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_validates(server, spelling, stream):
    """Anthropic's structured outputs (output_config.format; the beta's output_format) as a JSON schema."""
    schema = {"type": "object", "additionalProperties": False, "required": ["colour"],
              "properties": {"colour": {"enum": ["red", "green", "blue"]}}}
    spec = {"type": "json_schema", "schema": schema}
    extra = {**GREEDY, **({"output_config": {"format": spec}} if spelling == "output_config" else {"output_format": spec})}
    kw = {"model": MODEL, "max_tokens": 30, "messages": [{"role": "user", "content": "Pick a colour."}],
          "extra_body": extra}
    if stream:
        with client(server).messages.stream(**kw) as s:
            message = s.get_final_message()
    else:
        message = client(server).messages.create(**kw)
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), schema)


# ---- errors -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, needle", [
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "budget_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
     "'image'"),
    ({"messages": [{"role": "user", "content": [{"type": "mystery"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "document", "source": {}}]}]}]}, "messages[0].content[0].content[0]"),
    ({"messages": [*HELLO, {"role": "assistant", "content": "Red, "}]}, "trailing whitespace"),   # a prefill
    ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}, "clear_tool_uses"),
    ({"container": "container_1"}, "container"),
    ({"temperature": -1}, "temperature"),
    ({"tools": [{"name": "has space", "input_schema": ADD}]}, "tools[0].name"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "wat"}}}}, "output_config"),
    ({"output_config": {"format": {"type": "yaml"}}}, "output_config"),
])
def test_bad_requests_are_400s_naming_the_field(server, fields, needle):
    body = {"model": MODEL, "max_tokens": 8, "messages": HELLO, **fields}
    with pytest.raises(anthropic.BadRequestError) as e:
        client(server).post("/v1/messages", cast_to=anthropic.types.Message, body=body)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert needle in e.value.body["error"]["message"]


def test_errors_in_anthropics_shape(server):
    url = server.url + "/v1/messages"
    assert_anthropic_error(httpx.post(url, json={"model": MODEL, "messages": HELLO}), 400, "invalid_request_error",
                           "max_tokens")
    assert_anthropic_error(httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}), 400,
                           "invalid_request_error", "JSON")
    assert_anthropic_error(httpx.post(url, json={"model": MODEL, "max_tokens": 8, "messages": HELLO,
                                                 "system": "x" * MAX_BODY}), 413, "request_too_large")
    assert_anthropic_error(httpx.post(url + "/batches", json={}), 404, "not_found_error")
    with pytest.raises(anthropic.NotFoundError):
        create(server, model="claude-elsewhere")
    # the OpenAI routes keep OpenAI's shape
    assert set(httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL}).json()) == {"error"}


def test_the_api_key_as_x_api_key(guarded):
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(guarded, "wrong").messages.create(model=MODEL, max_tokens=4, messages=HELLO)
    assert e.value.body["error"]["type"] == "authentication_error"
    assert client(guarded, KEY).messages.create(model=MODEL, max_tokens=4, messages=HELLO).content
    assert client(guarded, KEY).messages.count_tokens(model=MODEL, messages=HELLO).input_tokens > 0
    assert_anthropic_error(httpx.post(guarded.url + "/v1/messages/count_tokens", json={"messages": HELLO}), 401,
                           "authentication_error", "x-api-key")
    refused = httpx.get(guarded.url + "/v1/models")                 # OpenAI's routes keep OpenAI's shape
    assert refused.status_code == 401 and set(refused.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(guarded.url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(guarded.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


# ---- rendering, without a server --------------------------------------------------------------------

def output(text: str, finish_reason: str, error: str | None = None) -> CompletionOutput:
    return CompletionOutput(request_id="r", prompt=None, prompt_token_ids=[1, 2, 3], text=text, token_ids=[5, 6],
                            finish_reason=finish_reason, stop_reason=None, logprobs=None,
                            metrics=RequestMetrics(arrival=0.0), cached_tokens=2, error=error)


class FakeStream:
    """Deltas, then (optionally) an engine failure, as a RequestStream gives them."""

    def __init__(self, deltas: list[StreamDelta], fail: bool) -> None:
        self.deltas, self.fail, self.closed = deltas, fail, False

    async def __aiter__(self) -> AsyncIterator[StreamDelta]:
        for d in self.deltas:
            yield d
        if self.fail:
            raise EngineError("the step failed")

    def close(self) -> None:
        self.closed = True


def events(deltas: list[StreamDelta], fail: bool = False, tool_format: str | None = None) -> list[tuple[str, dict]]:
    stream = FakeStream(deltas, fail)
    call = ChatCall("msg_1", [], tool_format, frozenset({"add"}), None, None)

    async def run() -> list[str]:
        return [e async for e in message_events(stream, call, MODEL, False)]

    raw = asyncio.run(run())
    assert stream.closed
    return [(e.split("\n")[0][len("event: "):], json.loads(e.split("\n")[1][len("data: "):])) for e in raw]


def delta(text: str, out: CompletionOutput, finished: bool = False) -> StreamDelta:
    return StreamDelta(request_id="r", text=text, token_ids=[5], logprobs=[], finished=finished, output=out)


def test_an_engine_failure_mid_stream_is_an_error_event():
    running = output("Hi", None)
    got = events([delta("Hi", running)], fail=True)
    assert [name for name, _ in got] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                        "error"]
    assert got[0][1]["message"]["usage"]["input_tokens"] == 1 and got[0][1]["message"]["usage"]["cache_read_input_tokens"] == 2
    assert got[-1][1] == {"type": "error", "error": {"type": "api_error", "message": "the step failed"}}
    refused = events([delta("Hi", running), delta("", output("Hi", "error", "the grammar failed"), True)])
    assert refused[-1][0] == "error" and "the grammar failed" in refused[-1][1]["error"]["message"]
    with pytest.raises(APIError) as e:
        message_body(ChatCall("msg_1", [], None, frozenset(), None, None), MODEL, output("", "error"), False)
    assert e.value.status == 500


def test_text_then_a_call_become_two_blocks():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 40}}\n</tool_call>'
    out = output(text, "stop")
    got = events([delta(text[:20], out), delta(text[20:], out, True)], tool_format="hermes")
    assert [n for n, _ in got] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                   "content_block_stop", "content_block_start", "content_block_delta",
                                   "content_block_stop", "message_delta", "message_stop"]
    assert got[2][1]["content_block"] == {"type": "text", "text": ""}
    assert got[5][1]["content_block"]["type"] == "tool_use" and got[5][1]["content_block"]["input"] == {}
    assert got[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    partial = "".join(d["delta"]["partial_json"] for n, d in got if n == "content_block_delta"
                      and d["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == {"a": 2, "b": 40}
    blocks = Blocks(ToolCallParser("hermes", frozenset({"add"})), single_call=False)
    blocks.add(text, final=True)
    assert blocks.content[0] == {"type": "text", "text": "Let me add."}
    assert blocks.content[1]["type"] == "tool_use" and blocks.content[1]["input"] == {"a": 2, "b": 40}
