"""OpenAI's Responses API (/v1/responses) with the official openai client: string and item-list input
rendered as the chat route would render them, the streamed events adding up to the collected response,
function tools called (forced or not) with arguments valid against their parameters and answered with
function_call_output, text.format constraining the output, stored responses continued with
previous_response_id, read with GET and removed with DELETE, and 400s naming what is not supported."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from live_server import MODEL, assert_openai_error

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER,
          "strict": True},
         {"type": "function", "name": "add", "description": "Add two integers", "parameters": ADD, "strict": True}]
CHAT_TOOLS = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")}}
              for t in TOOLS]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = "What is the weather in Paris?"
SHORT = "Say hello in one word."


def create(server, **kw):
    return server.client().responses.create(model=kw.pop("model", MODEL), temperature=0,
                                            max_output_tokens=kw.pop("max_output_tokens", 40), **kw)


def prompt_tokens(server, messages, tools=None) -> int:
    """How many tokens the chat route's template makes of these messages (and tools)."""
    return len(server.post("/tokenize", {"messages": messages, **({"tools": tools} if tools else {})}).json()["tokens"])


def assert_valid_calls(output, n=None):
    calls = [item for item in output if item.type == "function_call"]
    assert calls and (n is None or len(calls) == n), output
    for call in calls:
        assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return calls


def test_string_input_answers_with_a_message_and_usage(server):
    r = create(server, input="Name three colours.")
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL and r.error is None
    assert r.status in ("completed", "incomplete")
    message = r.output[0]
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert r.output_text and message.content[0].type == "output_text" and message.content[0].annotations == []
    u = r.usage
    assert u.input_tokens == prompt_tokens(server, [{"role": "user", "content": "Name three colours."}])
    assert 0 < u.output_tokens <= 40 and u.total_tokens == u.input_tokens + u.output_tokens
    assert u.output_tokens_details.reasoning_tokens == 0 and u.input_tokens_details.cached_tokens >= 0
    assert r.temperature == 0 and r.max_output_tokens == 40 and r.store is True and r.tools == []


def test_max_output_tokens_makes_it_incomplete(server):
    r = create(server, input="Count from one to one hundred in words.", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.output_text


def test_item_list_input_is_rendered_as_chat_messages(server):
    items = [{"role": "developer", "content": "Answer briefly."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi, I am Ada."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello Ada."}]},
             {"role": "user", "content": "What is my name?"}]
    r = create(server, input=items, instructions="You are a helpful assistant.")
    chat = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Hi, I am Ada."}, {"role": "assistant", "content": "Hello Ada."},
            {"role": "user", "content": "What is my name?"}]
    assert r.usage.input_tokens == prompt_tokens(server, chat)
    assert r.instructions == "You are a helpful assistant." and r.output_text


def stream_events(server, **kw) -> list:
    return list(create(server, stream=True, **kw))


def test_streamed_events_add_up_to_the_collected_response(server):
    whole = create(server, input=SHORT)
    events = stream_events(server, input=SHORT)
    assert whole.status == "completed"
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[2:6] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
                          "response.output_text.delta"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert next(e for e in events if e.type == "response.output_text.done").text == text
    assert events[0].response.id == events[-1].response.id and events[0].response.status == "in_progress"
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    assert server.client().responses.retrieve(events[-1].response.id).output_text == text     # stored too
    # the SDK's stream helper rebuilds the same response; the raw stream names each event on its `event:` line
    with server.client().responses.stream(model=MODEL, input=SHORT, temperature=0,
                                          max_output_tokens=40) as s:
        assert s.get_final_response().output_text == whole.output_text
    raw = server.post("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 3, "stream": True}).text
    blocks = [b for b in raw.split("\n\n") if b.strip()]
    assert all(b.startswith("event: ") and json.loads(b.split("data: ", 1)[1])["type"] == b.split("\n")[0][7:]
               for b in blocks)


def test_a_function_tool_round_trip(server):
    """A forced call, its result sent back as function_call_output, then the answer."""
    r = create(server, input=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    calls = assert_valid_calls(r.output, n=1)
    assert r.status == "completed" and r.output_text == ""
    assert r.tool_choice == "required" and r.tools[0].name == "get_weather" and r.parallel_tool_calls is False
    result = '{"temperature": 21, "sky": "clear"}'
    items = [{"role": "user", "content": ASK}, *(c.model_dump(exclude_none=True) for c in calls),
             {"type": "function_call_output", "call_id": calls[0].call_id, "output": result}]
    final = create(server, input=items, tools=TOOLS, tool_choice="none")
    assert final.output_text and [o.type for o in final.output] == ["message"]
    c = calls[0]
    chat = [{"role": "user", "content": ASK},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}]},
            {"role": "tool", "tool_call_id": c.call_id, "name": c.name, "content": result}]
    assert final.usage.input_tokens == prompt_tokens(server, chat, CHAT_TOOLS)


def test_a_named_function_streams_its_call(server):
    events = stream_events(server, input="What is 2 plus 40?", tools=TOOLS, parallel_tool_calls=False,
                           tool_choice={"type": "function", "name": "add"})
    final = events[-1].response
    assert events[-1].type == "response.completed"
    (call,) = assert_valid_calls(final.output)
    assert call.name == "add"
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.call_id == call.call_id and added.item.id == call.id
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert deltas == done.arguments == call.arguments
    assert not any(e.type == "response.output_text.delta" for e in events)


def test_a_forced_call_on_a_template_with_tools(qwen_server):
    r = create(qwen_server, model="qwen", input=ASK, tools=TOOLS, tool_choice="required", max_output_tokens=60)
    assert r.status == "completed"
    assert_valid_calls(r.output)


def test_text_format_constrains_the_output(server):
    schema = {"type": "object", "additionalProperties": False, "required": ["colour"],
              "properties": {"colour": {"type": "string", "maxLength": 12}}}
    r = create(server, input="Pick a colour.", max_output_tokens=30,
               text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), schema)
    r = create(server, input="Describe a cat in JSON.", max_output_tokens=30, text={"format": {"type": "json_object"}})
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)
    else:
        assert r.output_text.lstrip().startswith("{")


def test_previous_response_id_continues_a_stored_conversation(server):
    client = server.client()
    first = create(server, input="My name is Ada.", instructions="Be brief.", max_output_tokens=8)
    second = create(server, input="What is my name?", previous_response_id=first.id, max_output_tokens=8)
    assert second.previous_response_id == first.id
    chat = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"}]
    assert second.usage.input_tokens == prompt_tokens(server, chat)     # the instructions are not carried over
    third = create(server, input="Thanks.", previous_response_id=second.id, max_output_tokens=2)
    chat += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Thanks."}]
    assert third.usage.input_tokens == prompt_tokens(server, chat)
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text and got.usage == first.usage
    deleted = server.client().delete(f"/responses/{first.id}", cast_to=object)
    assert deleted == {"id": first.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    missing = server.post("/v1/responses", {"model": MODEL, "input": "Hi", "previous_response_id": first.id})
    assert assert_openai_error(missing, 404, first.id)["param"] == "previous_response_id"
    assert_openai_error(httpx.delete(f"{server.url}/v1/responses/{first.id}", timeout=30), 404, first.id)
    unstored = create(server, input="Hi", store=False, max_output_tokens=2)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize("fields, param", [
    ({"background": True, "store": False}, "background"),          # background needs store
    ({"reasoning": {"effort": "extreme"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"text": {"verbosity": "extreme"}}, "text"),
    ({"max_tool_calls": -1}, "max_tool_calls"),
    ({"truncation": "middle"}, "truncation"),
    ({"conversation": "conv_123"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"mirostat": 2}, "mirostat"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "function", "name": "has space"}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"text": {"format": {"type": "xml"}}}, "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objekt"}}}}, "text"),
    ({"messages": [{"role": "user", "content": "Hi"}]}, "messages"),
    ({"max_output_tokens": -1}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"role": "robot", "content": "Hi"}]}, "input"),
    ({"input": "word " * 12000}, "input"),
])
def test_what_is_not_supported_or_wrong_is_a_400_naming_it(server, fields, param):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4, **fields}
    err = assert_openai_error(server.post("/v1/responses", body), 400)
    assert err["param"] == param, err


def test_fields_that_change_nothing_pass_and_unknown_models_are_404s(server):
    r = server.post("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "metadata": {"k": "v"},
                                      "user": "u", "service_tier": "auto", "safety_identifier": "s",
                                      "prompt_cache_key": "p", "include": [], "reasoning": {"effort": None}})
    assert r.status_code == 200, r.text
    assert r.json()["metadata"] == {"k": "v"}
    assert_openai_error(server.post("/v1/responses", {"model": "gpt-9", "input": "Hi"}), 404, "gpt-9")
    assert_openai_error(server.post("/v1/responses", {"model": MODEL}), 400, "input")


# ---- without a server: the stream's end on an engine failure, the store's bounds ------------------------------

def run_events(deltas, fail: Exception | None = None, tool_format: str | None = None):
    """response_events over a stream of these deltas (then `fail` raised), parsed; and the store."""
    import asyncio
    from types import SimpleNamespace

    from phasewise.core.request import RequestMetrics
    from phasewise.server.chat_call import ChatCall
    from phasewise.server.responses.store import ResponseStore
    from phasewise.server.responses.protocol import ResponsesRequest
    from phasewise.server.responses.routes import Run, response_events

    class Stream:
        closed = False

        async def __aiter__(self):
            for text, reason in deltas:
                out = SimpleNamespace(finish_reason=reason, stop_reason=None, prompt_token_ids=[1, 2], token_ids=[3],
                                      cached_tokens=0, error="the grammar refused ' no'" if reason == "error" else None,
                                      metrics=RequestMetrics(arrival=0.0))
                yield SimpleNamespace(text=text, finished=reason is not None, output=out)
            if fail is not None:
                raise fail

        def close(self):
            self.closed = True

    async def read(gen):
        return [chunk async for chunk in gen]

    store, stream = ResponseStore(), Stream()
    call = ChatCall("resp_1", [], tool_format, frozenset({"add"}), None, None)
    run = Run(ResponsesRequest(input="Hi"), call, [{"role": "user", "content": "Hi"}], MODEL, store)
    chunks = asyncio.run(read(response_events(run, stream)))
    assert stream.closed
    return [json.loads(c.split("data: ", 1)[1]) for c in chunks], store


def test_an_engine_failure_mid_stream_ends_it_with_response_failed():
    from phasewise.server.errors import EngineError

    events, store = run_events([("Hel", None), ("lo", None)], fail=EngineError("the engine thread died"))
    assert [e["type"] for e in events][-3:] == ["response.content_part.done", "response.output_item.done",
                                                "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["message"] == "the engine thread died"
    assert failed["output"][0]["content"][0]["text"] == "Hello" and len(store) == 0
    events, _ = run_events([("Hi", "error")])
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "the grammar refused ' no'"}


def test_streamed_items_follow_the_text_then_the_call():
    events, store = run_events([("Sure. <tool_call>\n{\"name\": \"add\", ", None),
                                ('"arguments": {"a": 1, "b": 2}}\n</tool_call>', "stop")], tool_format="hermes")
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    assert [(o["type"], o["status"]) for o in final["output"]] == [("message", "completed"),
                                                                    ("function_call", "completed")]
    assert final["output"][0]["content"][0]["text"] == "Sure."
    assert final["output"][1]["name"] == "add" and json.loads(final["output"][1]["arguments"]) == {"a": 1, "b": 2}
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert deltas == final["output"][1]["arguments"]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1]
    kept = store.get(final["id"]).conversation
    assert kept[-1]["tool_calls"][0]["function"]["name"] == "add" and kept[-1]["content"] == "Sure."


def test_the_store_is_bounded_by_count_and_bytes():
    from phasewise.server.responses.store import ResponseStore

    store = ResponseStore(max_responses=3, max_bytes=2000)
    for i in range(5):
        store.put({"id": f"r{i}"}, [{"role": "user", "content": "x"}])
    assert len(store) == 3 and store.get("r0") is None and store.get("r2") is not None
    store.put({"id": "r5"}, [])                  # r2 was read last: r3 is the least recently used
    assert store.get("r3") is None and store.get("r2") is not None
    store.put({"id": "big"}, [{"role": "user", "content": "y" * 1940}])     # the others go to make room
    assert 1940 < store.bytes <= 2000 and len(store) == 1 and store.get("big") is not None
    store.put({"id": "huge"}, [{"role": "user", "content": "z" * 3000}])
    assert store.get("huge") is None and store.delete("big") and not store.delete("big")
