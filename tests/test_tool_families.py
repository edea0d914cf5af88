"""Forced tool calls in each chat-template family's own format, through the chat route's own request
handling (ChatCompletionRequest → chat_call: the family's forcing grammar and parser) on the default
model with that family's template: Llama 3.1/3.2 (JSON with "parameters"), Mistral ([TOOL_CALLS] and a
JSON list), and the generic <tool_call> prompt of a template without tools. Qwen2.5's own template
(Hermes blocks) is served in tests/test_server_tools.py."""

from __future__ import annotations

import json

import jsonschema
import pytest

from phasewise import LLM
from phasewise.server.chat_call import chat_call
from phasewise.server.openai.protocol import ChatCompletionRequest

pytestmark = pytest.mark.slow

ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer", "maximum": 1000}, "b": {"type": "integer", "maximum": 1000}}}
CITY = {"type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 20}}}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}},
         {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": CITY}}]
SCHEMAS = {"add": ADD, "get_weather": CITY}

# Minimal templates in each family's format (the real ones render the same markers).
LLAMA3 = """{{- bos_token }}{%- if tools %}<|start_header_id|>system<|end_header_id|>

Call a function by answering {"name": function name, "parameters": its arguments}.
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|eot_id|>{%- endif %}
{%- for m in messages %}{%- if m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ m.content }}<|eot_id|>{%- elif m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{%- for c in m.tool_calls %}{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}\
{%- endfor %}<|eot_id|>{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""
MISTRAL = """{{- bos_token }}{%- for m in messages %}{%- if m.role == 'user' %}\
{%- if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}\
[INST]{{ m.content }}[/INST]{%- elif m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | tojson }}{{ eos_token }}\
{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{%- else %}{{ m.content }}{{ eos_token }}\
{%- endif %}{%- endfor %}"""


@pytest.fixture(scope="module")
def llm():
    with LLM(kv_cache_memory=0.25) as llm:
        yield llm


@pytest.fixture(params=["llama3_json", "mistral", "hermes"])
def family(request, llm):
    """The default model wearing one family's template (hermes: its own, which has no tools: the generic prompt)."""
    hf = llm.engine.tokenizer.hf
    kept = hf.chat_template
    hf.chat_template = {"llama3_json": LLAMA3, "mistral": MISTRAL, "hermes": kept}[request.param]
    yield request.param
    hf.chat_template = kept


def run(llm, body: dict) -> tuple[str, list]:
    call = chat_call(ChatCompletionRequest.model_validate(body).chat_request(), llm.engine.tokenizer.tool_format, "t")
    item = call.items[0]
    out = llm.chat(item.prompt.messages, item.params, tools=item.prompt.tools)
    parser = call.parser()                 # None under tool_choice "none": nothing is parsed
    if parser is None:
        return out.text, []
    parser.feed(out.text, final=True)
    return out.text, parser.calls


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
@pytest.mark.parametrize("parallel", [False, True])
def test_forced_calls_in_the_familys_format(llm, family, choice, parallel):
    assert llm.engine.tokenizer.tool_format == family
    body = {"messages": [{"role": "user", "content": "What is the weather in Oslo?"}], "tools": TOOLS,
            "tool_choice": choice, "parallel_tool_calls": parallel, "temperature": 0, "max_tokens": 80}
    text, calls = run(llm, body)
    marker = {"llama3_json": '{"name": "', "mistral": '[TOOL_CALLS][{"name": "', "hermes": '<tool_call>\n{"name": "'}
    assert text.startswith(marker[family]), text
    assert calls and (parallel or len(calls) == 1), text
    for c in calls:
        assert c.name == "get_weather" or choice == "required"
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
        assert len(c.id) == 9 and c.id.isalnum() if family == "mistral" else c.id.startswith("call_")


def test_a_call_and_its_result_render_in_the_familys_format(llm, family):
    """The round trip: the call sent back as the assistant's tool_calls and its result as a tool message."""
    body = {"messages": [{"role": "user", "content": "What is the weather in Oslo?"}], "tools": TOOLS,
            "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0, "max_tokens": 80}
    _, calls = run(llm, body)
    history = [*body["messages"], {"role": "assistant", "content": None, "tool_calls": [c.as_dict() for c in calls]},
               {"role": "tool", "tool_call_id": calls[0].id, "content": "12 degrees"}]
    prompt = llm.engine.tokenizer.render_chat(
        chat_call(ChatCompletionRequest.model_validate({**body, "messages": history}).chat_request(), family,
                  "t").items[0].prompt.messages,
        tools=TOOLS)
    assert "12 degrees" in prompt and calls[0].name in prompt
    answer, after = run(llm, {**body, "messages": history, "tool_choice": "none", "max_tokens": 16})
    assert isinstance(answer, str) and not after      # tool_choice none: no call is read out of the answer
