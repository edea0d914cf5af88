"""Thinking budgets through the server, with the official openai (chat, Responses) and anthropic (Messages)
SDKs, on a minimal Qwen3.5-style template written here (the generation prompt opens `<think>` unless
thinking is off): budgets 0, 16 and unlimited, streamed and not, in all three APIs; a grammar (a JSON
schema, a regex, a forced tool call) holds after the block; usage counts the reasoning tokens in each API's
field, timings split the output into thinking and answer, /metrics has both histograms. The default model
never closes a block itself, so without a budget its reply is all thinking."""

from __future__ import annotations

import json
import re

import anthropic
import pytest

from live_server import MODEL, start_server, stop_server

pytestmark = pytest.mark.slow

QWEN35 = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
          "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "What is 1 plus 2?"}]
MAX = 32
SCHEMA = {"type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"],
          "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen35-budget")
    (folder / "template.jinja").write_text(QWEN35)
    s = start_server(folder, "--chat-template", str(folder / "template.jinja"))
    yield s
    stop_server(s)
    assert "Traceback" not in s.log.read_text(), s.log.read_text()


def budget_fields(budget: int | None) -> dict:
    return {} if budget is None else {"thinking_token_budget": budget}


def check_split(budget: int | None, reasoning: str | None, content: str | None, reasoning_tokens: int,
                completion_tokens: int, timings: dict) -> None:
    """A budget of N: N thinking tokens, then an answer; none: all thinking (the default model never
    closes the block); 0: no thinking at all."""
    assert timings["thinking_n"] == reasoning_tokens
    if budget is None:
        assert reasoning and not content and reasoning_tokens >= completion_tokens - 1
        assert timings["ttfa_ms"] is None and timings["thinking_ms"] > 0
    else:
        assert reasoning_tokens == budget and content
        assert bool(reasoning) == (budget > 0)
        assert timings["ttfa_ms"] >= timings["ttft_ms"]
        assert (timings["ttfa_ms"] > timings["ttft_ms"]) == (budget > 0)


# ---- chat completions ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("budget", [0, 16, None])
def test_chat_budgets_streamed_and_not(qwen35, budget):
    client = qwen35.client()
    kw = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=MAX, extra_body=budget_fields(budget))
    out = client.chat.completions.create(**kw)
    message = out.choices[0].message
    details = out.usage.completion_tokens_details
    check_split(budget, message.reasoning_content, message.content, details.reasoning_tokens,
                out.usage.completion_tokens, out.model_extra["timings"])
    reasoning, content, timings, usage = "", "", None, None
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
        usage = chunk.usage or usage
        timings = (chunk.model_extra or {}).get("timings") or timings
    assert (reasoning, content) == (message.reasoning_content or "", message.content or "")
    assert usage.completion_tokens_details.reasoning_tokens == details.reasoning_tokens
    assert timings["thinking_n"] == details.reasoning_tokens


def test_a_budget_of_0_is_the_templates_switch_off(qwen35):
    def prompt_tokens(**extra) -> int:
        return qwen35.client().chat.completions.create(model=MODEL, messages=ASK, max_tokens=1,
                                                       extra_body=extra).usage.prompt_tokens
    assert prompt_tokens(thinking_token_budget=0) == prompt_tokens(chat_template_kwargs={"enable_thinking": False})
    assert prompt_tokens(thinking_budget_tokens=0) > prompt_tokens(thinking_budget_tokens=-1) == prompt_tokens()


@pytest.mark.parametrize("field", ["thinking_budget_tokens", "reasoning_budget_tokens"])
def test_llama_servers_budget_fields(qwen35, field):
    out = qwen35.client().chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=MAX,
                                                  extra_body={field: 5})
    assert out.usage.completion_tokens_details.reasoning_tokens == 5 and out.choices[0].message.content


def test_a_grammar_holds_after_the_thinking(qwen35):
    client = qwen35.client()
    kw = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=60, extra_body={"thinking_token_budget": 4})
    schema = client.chat.completions.create(**kw, response_format={"type": "json_schema", "json_schema": {
        "name": "sum", "schema": SCHEMA, "strict": True}}).choices[0]
    assert schema.message.reasoning_content and json.loads(schema.message.content).keys() == {"sum"}
    regex = client.chat.completions.create(**{**kw, "extra_body": {**kw["extra_body"], "guided_regex": "[0-9]+"}})
    assert regex.choices[0].message.reasoning_content and re.fullmatch("[0-9]+", regex.choices[0].message.content)
    call = client.chat.completions.create(**kw, tools=TOOLS, tool_choice="required").choices[0]
    assert call.finish_reason == "tool_calls" and call.message.reasoning_content
    assert call.message.tool_calls[0].function.name == "add"
    assert json.loads(call.message.tool_calls[0].function.arguments).keys() == {"a", "b"}


def test_metrics_have_thinking_time_and_time_to_first_answer_token(qwen35):
    qwen35.client().chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=MAX,
                                            extra_body={"thinking_token_budget": 3})
    metrics = qwen35.metrics()
    assert metrics["phasewise:thinking_time_seconds_count"] >= 1
    assert metrics["phasewise:time_to_first_answer_token_seconds_count"] >= 1


# ---- Responses -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("budget", [0, 16, None])
def test_responses_budgets_streamed_and_not(qwen35, budget):
    client = qwen35.client()
    kw = dict(model=MODEL, input="What is 1 plus 2?", temperature=0, max_output_tokens=MAX,
              extra_body=budget_fields(budget))
    out = client.responses.create(**kw)
    reasoning = "".join(c.text for i in out.output if i.type == "reasoning" for c in i.content or [])
    check_split(budget, reasoning, out.output_text, out.usage.output_tokens_details.reasoning_tokens,
                out.usage.output_tokens, out.model_extra["timings"])
    events = list(client.responses.create(**kw, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    final = events[-1].response
    assert final.output_text == out.output_text
    assert final.usage.output_tokens_details.reasoning_tokens == out.usage.output_tokens_details.reasoning_tokens


def test_responses_effort_none_thinks_not(qwen35):
    out = qwen35.client().responses.create(model=MODEL, input="What is 1 plus 2?", temperature=0,
                                           max_output_tokens=MAX, reasoning={"effort": "none"})
    assert [i.type for i in out.output] == ["message"] and out.usage.output_tokens_details.reasoning_tokens == 0


# ---- Messages ------------------------------------------------------------------------------------------------

MESSAGES_BUDGETS = [({"type": "disabled"}, {}, 0), ({"type": "adaptive"}, {"thinking_token_budget": 16}, 16),
                    ({"type": "adaptive"}, {}, None)]


@pytest.mark.parametrize("thinking, extra, budget", MESSAGES_BUDGETS, ids=["disabled", "16", "adaptive"])
def test_messages_budgets_streamed_and_not(qwen35, thinking, extra, budget):
    client = anthropic.Anthropic(base_url=qwen35.url, api_key="none", max_retries=0, timeout=120)
    kw = dict(model=MODEL, max_tokens=MAX, messages=ASK, thinking=thinking, extra_body={"temperature": 0, **extra})
    out = client.messages.create(**kw)
    kinds = [b.type for b in out.content]
    assert kinds == {0: ["text"], 16: ["thinking", "text"], None: ["thinking"]}[budget]
    thought = out.model_extra["timings"]["thinking_n"]
    assert thought == budget if budget is not None else thought > 0
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None), getattr(b, "text", None)) for b in final.content] == \
        [(b.type, getattr(b, "thinking", None), getattr(b, "text", None)) for b in out.content]


def test_anthropics_budget_reaches_the_engine():
    from phasewise.server.anthropic.protocol import MessagesRequest

    def budget(**kw) -> int | None:
        body = {"model": MODEL, "max_tokens": 2000, "messages": ASK, **kw}
        return MessagesRequest.model_validate(body).chat_request().thinking_budget
    assert budget(thinking={"type": "enabled", "budget_tokens": 1024}) == 1024
    assert budget(thinking={"type": "disabled"}) == 0
    assert budget(thinking={"type": "adaptive"}) is None and budget() is None
    assert budget(thinking={"type": "adaptive"}, thinking_token_budget=16) == 16


def test_each_effort_has_its_budget():
    from phasewise.server.openai.protocol import ChatCompletionRequest
    from phasewise.server.thinking import EFFORT_BUDGETS

    def budget(**kw) -> int | None:
        return ChatCompletionRequest.model_validate({"messages": ASK, **kw}).thinking_budget()
    assert [budget(reasoning_effort=e) for e in EFFORT_BUDGETS] == [0, 0, 1024, 4096, 16384, 32768]
    assert budget() is None and budget(reasoning_effort="high", thinking_token_budget=7) == 7
    assert budget(reasoning_effort="high", thinking_budget_tokens=-1) is None
