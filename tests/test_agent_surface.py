"""What agent clients send (issue 65), through their official SDKs where one sends that shape: tools: [],
model aliases, calls cut off by the token limit, forced calls held to their properties, tool results
answering no call, each API's temperature range, strict booleans, text.format without a schema, and
constraints the vocabulary cannot satisfy (found by the fuzz test)."""

from __future__ import annotations

import asyncio
import json
import time

import anthropic
import openai
import pytest
from pydantic import BaseModel, Field

from live_server import MODEL, assert_openai_error, start_server, stop_server

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "maxLength": 20}}}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
FLAT_TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
MESSAGES_TOOLS = [{"name": "get_weather", "input_schema": WEATHER}]


def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)


# ---- tools: [] ------------------------------------------------------------------------------------

def test_an_empty_tools_list_means_no_tools_on_every_route(server):
    chat = server.client().chat.completions.create(model=MODEL, messages=ASK, tools=[], tool_choice="auto",
                                                   max_tokens=4)
    assert chat.choices[0].message.tool_calls is None
    response = server.client().responses.create(model=MODEL, input="Hi", tools=[], max_output_tokens=4)
    assert response.status in ("completed", "incomplete")
    message = claude(server).messages.create(model=MODEL, messages=ASK, tools=[], max_tokens=4)
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert_openai_error(server.post("/v1/chat/completions", {"messages": ASK, "tools": [], "tool_choice": "required"}),
                        400, "tool_choice needs tools")


class City(BaseModel):
    city: str = Field(max_length=12)
    sunny: bool


def test_an_agent_without_tools_returns_its_output_type(server):
    """openai-agents sends tools: [] and text.format json_schema for an Agent with an output_type: the
    schema constrains the tiny model's answer, which the SDK parses into the pydantic model."""
    agents = pytest.importorskip("agents")
    from agents.models.openai_responses import OpenAIResponsesModel

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    agent = agents.Agent(name="weather", instructions="Answer with the city and whether it is sunny.",
                         output_type=City, model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                         model_settings=agents.ModelSettings(temperature=0, max_tokens=60))
    result = asyncio.run(agents.Runner.run(agent, "Is it sunny in Paris?", max_turns=1))
    assert isinstance(result.final_output, City) and result.final_output.city


# ---- aliases ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def aliased(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("aliased"), "--served-model-name", "smol", "claude-sonnet-4-5",
                     "gpt-5-codex")
    yield s
    stop_server(s)
    assert "Traceback" not in s.log.read_text(), s.log.read_text()


def test_served_model_names_take_aliases(aliased):
    """The first name is reported; every name is accepted, as Claude Code and Codex send their own."""
    assert [m.id for m in aliased.client().models.list()] == ["smol"]
    message = claude(aliased).messages.create(model="claude-sonnet-4-5", messages=ASK, max_tokens=4)
    assert message.model == "claude-sonnet-4-5" and message.usage.output_tokens > 0
    response = aliased.client().responses.create(model="gpt-5-codex", input="Hi", max_output_tokens=4)
    assert response.model == "gpt-5-codex"
    with pytest.raises(anthropic.NotFoundError):
        claude(aliased).messages.create(model="claude-opus-4-1", messages=ASK, max_tokens=4)


def test_model_names_and_the_cli_flag():
    from pathlib import Path

    from phasewise.cli import build_parser
    from phasewise.server.config import model_names

    path = Path("/m/SmolLM2.gguf")
    assert model_names(None, "smollm2", path) == ("SmolLM2", ("smollm2", "/m/SmolLM2.gguf"))
    assert model_names(["a", "b", "c"], None, path) == ("a", ("b", "c", "/m/SmolLM2.gguf"))
    args = build_parser().parse_args(["serve", "--served-model-name", "a", "claude-x"])
    assert args.served_model_name == ["a", "claude-x"]


# ---- calls cut off by the token limit ----------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["collected", "streamed"])
def test_a_cut_off_call_ends_as_chat_finish_reason_length_without_markup(server, stream):
    kw = dict(model=MODEL, messages=ASK, tools=CHAT_TOOLS, tool_choice="required", max_tokens=8, temperature=0)
    if not stream:
        choice = server.client().chat.completions.create(**kw).choices[0]
        content, calls, reason = choice.message.content, choice.message.tool_calls, choice.finish_reason
    else:
        chunks = list(server.client().chat.completions.create(stream=True, **kw))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls, reason = None, chunks[-1].choices[0].finish_reason
    assert reason == "length"
    assert "<tool_call>" not in (content or "") and '"name"' not in (content or "")
    assert not calls


def test_a_cut_off_call_ends_as_an_incomplete_response(server):
    response = server.client().responses.create(model=MODEL, input="What is the weather in Paris?", tools=FLAT_TOOLS,
                                                tool_choice="required", max_output_tokens=8, temperature=0)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert not [item for item in response.output if item.type == "function_call"]
    assert "<tool_call>" not in response.output_text


def test_a_cut_off_call_ends_as_max_tokens_without_a_half_tool_use(server):
    message = claude(server).messages.create(model=MODEL, messages=ASK, tools=MESSAGES_TOOLS, max_tokens=8,
                                             tool_choice={"type": "any"}, extra_body={"temperature": 0})
    assert message.stop_reason == "max_tokens"
    assert [b.type for b in message.content if b.type == "tool_use"] == []
    assert "<tool_call>" not in "".join(b.text for b in message.content if b.type == "text")


def test_the_parser_drops_an_unfinished_call_when_cut():
    from phasewise.tool_calling import ToolCallParser

    for text in ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', 'Sure.\n<tool_ca',
                 'Sure.\n<tool_call>\n{"name": "get_we'):
        whole = ToolCallParser("hermes", frozenset({"get_weather"}))
        whole.feed(text, final=True, cut=True)
        streamed = ToolCallParser("hermes", frozenset({"get_weather"}))
        for ch in text:
            streamed.feed(ch)
        streamed.feed("", final=True, cut=True)
        for parser in (whole, streamed):
            assert parser.content == "Sure." and parser.calls == []
    parser = ToolCallParser("hermes", frozenset({"get_weather"}))
    parser.feed('{"name": "get_weather", "arguments": {"ci', final=True, cut=True)
    assert parser.content == "" and parser.calls == []
    parser = ToolCallParser("hermes", frozenset({"get_weather"}))     # a JSON answer cut off stays text
    parser.feed('{"answer": 4', final=True, cut=True)
    assert parser.content == '{"answer": 4'


# ---- forced calls follow properties ------------------------------------------------------------------

def test_forced_call_arguments_are_closed_to_unknown_keys():
    from phasewise.tool_calling.prompt import call_grammar, closed

    assert closed(WEATHER)["additionalProperties"] is False
    nested = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}}},
              "additionalProperties": {"type": "object", "properties": {"c": {}}}}
    out = closed(nested)
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["additionalProperties"]["additionalProperties"] is False       # the schema's own choice, closed
    assert closed({"type": "object", "properties": {}, "additionalProperties": True})["additionalProperties"] is True
    assert "additionalProperties" not in closed({"type": "object"})         # no properties: any keys
    grammar = call_grammar(CHAT_TOOLS, "hermes")
    schema = json.loads(grammar.split("%json ", 1)[1].rsplit(' "\\n</tool_call>"', 1)[0])
    assert schema["properties"]["arguments"]["additionalProperties"] is False


def test_forced_calls_carry_only_the_tools_properties(server):
    for seed in range(3):
        out = server.client().chat.completions.create(model=MODEL, messages=ASK, tools=CHAT_TOOLS, seed=seed,
                                                      tool_choice="required", parallel_tool_calls=False,
                                                      max_tokens=60)
        for call in out.choices[0].message.tool_calls or []:
            assert set(json.loads(call.function.arguments)) <= {"city"}


# ---- tool results answer a call ----------------------------------------------------------------------

def test_a_tool_result_answering_no_call_is_a_400(server):
    with pytest.raises(openai.BadRequestError, match="call id 'nope'"):
        server.client().chat.completions.create(model=MODEL, max_tokens=4, messages=[
            *ASK, {"role": "tool", "tool_call_id": "nope", "content": "sunny"}])
    with pytest.raises(openai.BadRequestError, match="call id 'nope'"):
        server.client().responses.create(model=MODEL, max_output_tokens=4, input=[
            {"role": "user", "content": "Weather?"}, {"type": "function_call_output", "call_id": "nope", "output": "x"}])
    with pytest.raises(anthropic.BadRequestError, match="call id 'toolu_nope'"):
        claude(server).messages.create(model=MODEL, max_tokens=4, messages=[
            *ASK, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}])
    ok = claude(server).messages.create(model=MODEL, max_tokens=4, tools=MESSAGES_TOOLS, messages=[
        *ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                 "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}])
    assert ok.usage.output_tokens > 0


# ---- each API's ranges and types -------------------------------------------------------------------

def test_temperature_has_each_apis_range(server):
    for path, body in (("/v1/chat/completions", {"messages": ASK, "max_tokens": 2}),
                       ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                       ("/v1/responses", {"input": "Hi", "max_output_tokens": 2})):
        for bad in (2.5, -0.1):
            assert_openai_error(server.post(path, {**body, "temperature": bad}), 400, "temperature")
        assert server.post(path, {**body, "temperature": 2}).status_code == 200
    with pytest.raises(anthropic.BadRequestError, match="temperature"):
        claude(server).messages.create(model=MODEL, messages=ASK, max_tokens=2, extra_body={"temperature": 1.5})


def test_booleans_are_strict(server):
    for path, body in (("/v1/chat/completions", {"messages": ASK}), ("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/responses", {"input": "Hi"}), ("/v1/messages", {"messages": ASK, "max_tokens": 2})):
        resp = server.post(path, {**body, "stream": "yes"})
        assert resp.status_code == 400 and "stream" in resp.text, resp.text
    assert_openai_error(server.post("/v1/chat/completions", {"messages": ASK, "logprobs": 1}), 400, "logprobs")


def test_a_json_schema_format_needs_its_schema(server):
    with pytest.raises(openai.BadRequestError, match="schema"):
        server.client().responses.create(model=MODEL, input="Hi", text={"format": {"type": "json_schema",
                                                                                   "name": "x"}})


# ---- constraints the vocabulary cannot satisfy (found by tests/test_api_fuzz.py) ------------------------

@pytest.mark.parametrize("regex", ["\u0006", "a\u0006", "0\u0006"])
def test_a_constraint_the_vocabulary_cannot_write_is_a_400_at_admission(server, regex):
    err = assert_openai_error(server.post("/v1/completions", {"prompt": "0", "guided_regex": regex}), 400,
                              "vocabulary")
    assert err["param"] == "guided_regex"


def test_a_constraint_reaching_a_dead_end_is_a_400_not_an_output_outside_it(server):
    """After its choice, (a|b)\\x06 needs a byte no token spells: found while generating, a 400."""
    err = assert_openai_error(server.post("/v1/completions", {"prompt": "0", "guided_regex": "(a|b)\u0006"}), 400,
                              "cannot be completed")
    assert err["code"] == "constraint_unsatisfiable"


def test_a_control_character_the_vocabulary_has_is_written(server):
    """\\x7f has a token: the output is that character (invisible in a terminal, not empty)."""
    out = server.post("/v1/completions", {"prompt": "0", "guided_regex": "\u007f"}).json()
    assert out["choices"][0]["text"] == "\u007f" and out["choices"][0]["finish_reason"] == "stop"



# ---- GET /v1/responses/{id}/input_items, POST /v1/responses/{id}/cancel ----------------------------------

def test_input_items_list_a_responses_input(server):
    client = server.client()
    response = client.responses.create(model=MODEL, max_output_tokens=2, input=[
        {"role": "user", "content": "first"}, {"role": "assistant", "content": "second"},
        {"role": "user", "content": [{"type": "input_text", "text": "third"}]}])
    newest_first = client.responses.input_items.list(response.id)
    assert [i.content[0].text for i in newest_first.data] == ["third", "second", "first"]
    assert all(i.id for i in newest_first.data) and not newest_first.has_more
    page = client.responses.input_items.list(response.id, order="asc", limit=2)
    assert [i.content[0].text for i in page.data] == ["first", "second"] and page.has_more
    rest = client.responses.input_items.list(response.id, order="asc", after=page.data[-1].id)
    assert [i.content[0].text for i in rest.data] == ["third"]
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")


def test_a_background_response_runs_and_can_be_cancelled(server):
    client = server.client()
    done = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4)
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(done.id)              # not a background response
    long = client.responses.create(model=MODEL, input="Tell a long story.", max_output_tokens=1000,
                                   background=True, extra_body={"ignore_eos": True})
    assert long.status == "queued" and long.background
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    assert client.responses.cancel(long.id).status == "cancelled"     # a finished one comes back as it is
    short = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, background=True)
    for _ in range(600):
        polled = client.responses.retrieve(short.id)
        if polled.status not in ("queued", "in_progress"):
            break
        time.sleep(0.1)
    assert polled.status in ("completed", "incomplete") and polled.usage.output_tokens > 0
    assert client.responses.cancel(short.id).status == polled.status
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.create(model=MODEL, input="Hi", background=True, store=False)


# ---- item 9: fields accepted where they can be honoured, else a 400 saying so ------------------------------

def test_an_assistant_prefill_is_continued(server):
    """Anthropic: a final assistant message is a prefill the reply continues (its text not repeated);
    chat: vLLM's continue_final_message."""
    ask = [{"role": "user", "content": "Name three colours."}, {"role": "assistant", "content": "The colours are red,"}]
    message = claude(server).messages.create(model=MODEL, max_tokens=12, messages=ask, extra_body={"temperature": 0})
    text = message.content[0].text
    chat = server.post("/v1/chat/completions", {"messages": ask, "continue_final_message": True,
                                                "add_generation_prompt": False, "max_tokens": 12, "temperature": 0})
    assert chat.json()["choices"][0]["message"]["content"] == text
    assert not text.startswith("The colours are")
    with pytest.raises(anthropic.BadRequestError, match="trailing whitespace"):
        claude(server).messages.create(model=MODEL, max_tokens=4, messages=[
            ask[0], {"role": "assistant", "content": "Sure "}])
    assert_openai_error(server.post("/v1/chat/completions", {"messages": ask[:1], "continue_final_message": True}),
                        400, "final assistant message")
    assert_openai_error(server.post("/v1/completions", {"prompt": "Hi", "continue_final_message": True}), 400,
                        "continue_final_message")


def test_the_continued_prompt_ends_inside_the_final_message():
    from phasewise.tokenization.tokenizer import _continued

    text = "<|im_start|>assistant\nThe colours are red,<|im_end|>\n"
    assert _continued(text, {"role": "assistant", "content": "The colours are red,"}) == \
        "<|im_start|>assistant\nThe colours are red,"
    with pytest.raises(ValueError):
        _continued(text, {"role": "assistant", "content": ""})


def test_what_agent_clients_send_to_the_responses_api_is_honoured(server):
    """Codex and openai-agents send include, text.verbosity and max_tool_calls."""
    client = server.client()
    response = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, text={"verbosity": "low"},
                                       include=["reasoning.encrypted_content"], max_tool_calls=1)
    assert response.text.verbosity == "low" and response.max_tool_calls == 1
    tools = FLAT_TOOLS + [{"type": "function", "name": "get_time", "parameters": WEATHER}]
    capped = client.responses.create(model=MODEL, input="Weather and time in Paris and Rome?", tools=tools,
                                     tool_choice="required", max_tool_calls=1, max_output_tokens=120, temperature=0)
    assert len([item for item in capped.output if item.type == "function_call"]) == 1
    with pytest.raises(openai.BadRequestError, match="include"):
        client.responses.create(model=MODEL, input="Hi", include=["message.output_text.logprobs"])


def test_what_the_anthropic_sdk_sends_is_accepted(server):
    """The anthropic SDK's 2.x fields that change nothing here (caching is the prefix cache's, tiers and
    regions are this one machine), context_management's no-op edit, and output_config's effort."""
    message = claude(server).messages.create(
        model=MODEL, max_tokens=4, messages=ASK, cache_control={"type": "ephemeral"}, service_tier="auto",
        speed="standard", inference_geo="us", metadata={"user_id": "u1"}, output_config={"effort": "low"},
        extra_body={"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}})
    assert message.usage.output_tokens > 0
    with pytest.raises(anthropic.BadRequestError, match="clear_tool_uses"):
        claude(server).messages.create(model=MODEL, max_tokens=4, messages=ASK, extra_body={
            "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}})


# ---- Codex's custom tools -------------------------------------------------------------------------

PATCH = 'start: "*** Begin Patch\\n" LINE+ "*** End Patch"\nLINE: /[a-z ]{1,20}\\n/'


def test_a_forced_custom_tool_writes_its_input_in_its_grammar(server):
    """Codex's apply_patch shape: a custom tool with a Lark grammar, forced; the whole output is the
    call's input, held to the grammar (streamed as custom_tool_call_input events)."""
    import regex

    tools = [{"type": "custom", "name": "apply_patch", "description": "Apply a patch",
              "format": {"type": "grammar", "syntax": "lark", "definition": PATCH}}]
    kw = dict(model=MODEL, input="Patch the file.", tools=tools, max_output_tokens=200, temperature=0,
              tool_choice={"type": "custom", "name": "apply_patch"})
    response = server.client().responses.create(**kw)
    [call] = response.output
    assert call.type == "custom_tool_call" and call.name == "apply_patch"
    whole = regex.compile(r"\*\*\* Begin Patch\n(?:[a-z ]{1,20}\n)+\*\*\* End Patch")
    assert whole.fullmatch(call.input, partial=response.status == "incomplete"), call.input
    events = list(server.client().responses.create(stream=True, **kw))
    deltas = "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta")
    done = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert done and done[0].input == deltas == call.input


def test_custom_tools_with_a_regex_and_their_results_round_trip(server):
    client = server.client()
    tools = [{"type": "custom", "name": "code", "format": {"type": "grammar", "syntax": "regex",
                                                            "definition": "[0-9]{3}"}}]
    response = client.responses.create(model=MODEL, input="Give a number.", tools=tools, tool_choice="required",
                                       max_output_tokens=10)
    [call] = response.output
    assert call.type == "custom_tool_call" and len(call.input) == 3 and call.input.isdigit()
    answer = client.responses.create(model=MODEL, tools=tools, max_output_tokens=4, input=[
        {"role": "user", "content": "Give a number."},
        {"type": "custom_tool_call", "call_id": call.call_id, "name": "code", "input": call.input},
        {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "accepted"}])
    assert answer.status in ("completed", "incomplete")
    free = client.responses.create(model=MODEL, input="Hi", tools=[{"type": "custom", "name": "free"}],
                                   max_output_tokens=4)
    assert free.tools[0].type == "custom"
    with pytest.raises(openai.BadRequestError, match="grammar"):
        client.responses.create(model=MODEL, input="Hi", tools=[{"type": "custom", "name": "x", "format": {
            "type": "grammar", "syntax": "ebnf", "definition": "x"}}])


def test_custom_calls_parsed_from_text_become_custom_tool_call_items():
    from phasewise.server.responses.output import OutputItems
    from phasewise.tool_calling import ToolCallParser

    items = OutputItems(ToolCallParser("hermes", frozenset({"apply_patch"})), frozenset({"apply_patch"}))
    text = '<tool_call>\n{"name": "apply_patch", "arguments": {"input": "*** Begin Patch\\nx\\n"}}\n</tool_call>'
    events = [e for ch in text for e in items.feed(ch)] + items.feed("", final=True) + items.finish("completed")
    [item] = items.items
    assert item["type"] == "custom_tool_call" and item["input"] == "*** Begin Patch\nx\n"
    assert [e["input"] for e in events if e["type"] == "response.custom_tool_call_input.done"] == [item["input"]]


def test_nested_booleans_are_strict_too(server):
    schema = {"name": "x", "schema": {"type": "object"}, "strict": "yes"}
    assert_openai_error(server.post("/v1/chat/completions", {"messages": ASK, "response_format": {
        "type": "json_schema", "json_schema": schema}}), 400, "strict")
    resp = server.post("/v1/messages", {"messages": ASK, "max_tokens": 2, "tools": MESSAGES_TOOLS,
                                        "tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}})
    assert resp.status_code == 400 and "disable_parallel_tool_use" in resp.text, resp.text


def test_truncation_auto_drops_the_oldest_turns_to_fit(server):
    long = [{"role": "user", "content": "word " * 12000}, {"role": "assistant", "content": "Noted."},
            {"role": "user", "content": "Say hi."}]
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="context"):
        client.responses.create(model=MODEL, input=long, max_output_tokens=4)
    response = client.responses.create(model=MODEL, input=long, max_output_tokens=4, truncation="auto")
    assert response.truncation == "auto" and response.usage.input_tokens < 100
    with pytest.raises(openai.BadRequestError, match="context"):      # the last turn alone does not fit
        client.responses.create(model=MODEL, input=long[:1], max_output_tokens=4, truncation="auto")


def test_a_streamed_reply_shows_no_tool_use_cut_off_by_max_tokens(server):
    """A tool_use block's events wait for its end: one the token limit cuts off never starts."""
    with claude(server).messages.stream(model=MODEL, messages=ASK, tools=MESSAGES_TOOLS, max_tokens=8,
                                        tool_choice={"type": "any"}, extra_body={"temperature": 0}) as stream:
        events = list(stream)
        message = stream.get_final_message()
    assert message.stop_reason == "max_tokens" and not [b for b in message.content if b.type == "tool_use"]
    assert not [e for e in events if e.type == "content_block_start" and e.content_block.type == "tool_use"]
    whole = claude(server).messages.create(model=MODEL, messages=ASK, tools=MESSAGES_TOOLS, max_tokens=60,
                                           tool_choice={"type": "any"}, extra_body={"temperature": 0})
    with claude(server).messages.stream(model=MODEL, messages=ASK, tools=MESSAGES_TOOLS, max_tokens=60,
                                        tool_choice={"type": "any"}, extra_body={"temperature": 0}) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, getattr(b, "input", None)) for b in streamed.content] == \
        [(b.type, getattr(b, "input", None)) for b in whole.content]


def test_a_streamed_response_shows_no_call_cut_off_by_max_output_tokens(server):
    kw = dict(model=MODEL, input="What is the weather in Paris?", tools=FLAT_TOOLS, tool_choice="required",
              temperature=0)
    events = list(server.client().responses.create(stream=True, max_output_tokens=8, **kw))
    assert events[-1].type == "response.incomplete" and not events[-1].response.output_text.count("<tool_call>")
    assert not [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert not [item for item in events[-1].response.output if item.type == "function_call"]
    whole = server.client().responses.create(max_output_tokens=60, **kw)
    streamed = list(server.client().responses.create(stream=True, max_output_tokens=60, **kw))[-1].response
    assert [(i.type, i.name, i.arguments) for i in streamed.output if i.type == "function_call"] == \
        [(i.type, i.name, i.arguments) for i in whole.output if i.type == "function_call"]
