"""Thinking through the server with the official openai and anthropic SDKs, on minimal chat templates of
each family written here (--chat-template): Qwen3's (an `enable_thinking` switch that writes an empty
block when off), Qwen3.5's (the generation prompt opens `<think>` unless thinking is off), R1's (it
always opens it), and the default model's own (no thinking).
The default model's replies are forced with a regex where a test needs exact text: reasoning_content
and reasoning in chat (streamed or not), a reasoning item in Responses, signed thinking blocks in
Messages; a call after the thinking is a call, one inside it stays reasoning; earlier thinking is taken
back in each API (a thinking block's signature checked). A regex that writes `<think>` itself spells the
block (it holds from the reply's start); any other grammar holds after the block (budgets:
tests/test_server_thinking_budget.py)."""

from __future__ import annotations

import anthropic
import openai
import pytest

from live_server import MODEL, assert_openai_error, start_server, stop_server

pytestmark = pytest.mark.slow

QWEN3 = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
         "{% if m.role == 'assistant' and m.reasoning_content %}"
         "{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{% endif %}"
         "{{ m.content + '<|im_end|>\\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
         "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
         "{% endif %}{% endif %}")
R1 = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
      "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}")
# Qwen3.5's way: the generation prompt opens the block when thinking is on, writes an empty one when off
QWEN35 = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
          "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "What is 1 plus 2?"}]
THOUGHT = r"<think>I think\.</think>The answer\."
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]
CALL = r'<tool_call>\n\{"name": "add", "arguments": \{"a": 1, "b": 2\}\}\n</tool_call>'


def template_server(tmp_path_factory, name: str, source: str):
    folder = tmp_path_factory.mktemp(name)
    (folder / "template.jinja").write_text(source)
    return start_server(folder, "--chat-template", str(folder / "template.jinja"))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    s = template_server(tmp_path_factory, "qwen3", QWEN3)
    yield s
    stop_server(s)
    assert "Traceback" not in s.log.read_text(), s.log.read_text()


@pytest.fixture(scope="module")
def r1(tmp_path_factory):
    s = template_server(tmp_path_factory, "r1", R1)
    yield s
    stop_server(s)
    assert "Traceback" not in s.log.read_text(), s.log.read_text()


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    s = template_server(tmp_path_factory, "qwen35", QWEN35)
    yield s
    stop_server(s)
    assert "Traceback" not in s.log.read_text(), s.log.read_text()


def chat(server, regex: str | None = THOUGHT, **kw):
    extra = {**kw.pop("extra_body", {}), **({"guided_regex": regex} if regex else {})}
    return server.client().chat.completions.create(model=MODEL, messages=kw.pop("messages", ASK), temperature=0,
                                                   max_tokens=kw.pop("max_tokens", 80), extra_body=extra, **kw)


def streamed(chunks) -> tuple[str, str, dict, list]:
    """(reasoning, content, calls by index, the order the kinds came in) from a chat stream."""
    reasoning, content, calls, order = "", "", {}, []
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        assert extra.get("reasoning_content") == extra.get("reasoning")
        for kind, text in (("reasoning", extra.get("reasoning_content")), ("content", delta.content)):
            if text:
                reasoning, content = (reasoning + text, content) if kind == "reasoning" else (reasoning, content + text)
                order += [kind] if not order or order[-1] != kind else []
        for c in delta.tool_calls or []:
            call = calls.setdefault(c.index, ["", ""])
            call[0] += c.function.name or ""
            call[1] += c.function.arguments or ""
    return reasoning, content, calls, order


# ---- chat completions ---------------------------------------------------------------------------------------

def test_chat_returns_the_thinking_apart(qwen3):
    message = chat(qwen3).choices[0].message
    assert message.content == "The answer."
    assert message.reasoning_content == "I think." and message.reasoning == "I think."
    reasoning, content, calls, order = streamed(chat(qwen3, stream=True))
    assert (reasoning, content, calls, order) == ("I think.", "The answer.", {}, ["reasoning", "content"])
    hidden = chat(qwen3, extra_body={"include_reasoning": False}).choices[0].message
    assert hidden.content == "The answer." and "reasoning_content" not in (hidden.model_extra or {})
    assert streamed(chat(qwen3, stream=True, extra_body={"include_reasoning": False}))[:2] == ("", "The answer.")


def test_thinking_off_is_the_templates_empty_block(qwen3):
    on = chat(qwen3, regex="The answer")
    off = chat(qwen3, regex="The answer", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    effort = chat(qwen3, regex="The answer", reasoning_effort="none")
    assert on.usage.prompt_tokens < off.usage.prompt_tokens == effort.usage.prompt_tokens
    assert chat(qwen3, regex="The answer", reasoning_effort="high").usage.prompt_tokens == on.usage.prompt_tokens
    for out in (on, off, effort):
        assert out.choices[0].message.content == "The answer" and out.choices[0].message.reasoning_content is None


def test_a_call_after_the_thinking_is_a_call_and_one_inside_it_is_not(qwen3):
    after = chat(qwen3, regex=f"<think>I will add\\.</think>{CALL}", tools=TOOLS).choices[0]
    assert after.finish_reason == "tool_calls" and after.message.reasoning_content == "I will add."
    assert [(c.function.name, c.function.arguments) for c in after.message.tool_calls] == [("add", '{"a": 1, "b": 2}')]
    reasoning, content, calls, _ = streamed(chat(qwen3, regex=f"<think>I will add\\.</think>{CALL}", tools=TOOLS,
                                                 stream=True))
    assert (reasoning, content, calls) == ("I will add.", "", {0: ["add", '{"a": 1, "b": 2}']})
    inside = chat(qwen3, regex=f"<think>Maybe {CALL}</think>No call\\.", tools=TOOLS).choices[0]
    assert inside.finish_reason == "stop" and inside.message.tool_calls is None
    assert inside.message.content == "No call." and "<tool_call>" in inside.message.reasoning_content
    reasoning, content, calls, _ = streamed(chat(qwen3, regex=f"<think>Maybe {CALL}</think>No call\\.", tools=TOOLS,
                                                 stream=True))
    assert (content, calls) == ("No call.", {}) and reasoning == inside.message.reasoning_content


def test_earlier_thinking_is_sent_back_to_the_template(qwen3):
    history = [*ASK, {"role": "assistant", "content": "3", "reasoning_content": "1 + 2 = 3"},
               {"role": "user", "content": "And 2 plus 2?"}]
    without = [*ASK, {"role": "assistant", "content": "3"}, {"role": "user", "content": "And 2 plus 2?"}]
    assert chat(qwen3, messages=history).usage.prompt_tokens > chat(qwen3, messages=without).usage.prompt_tokens


@pytest.mark.parametrize("fields, param", [({"reasoning_effort": "extreme"}, "reasoning_effort"),
                                           ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                                           ({"chat_template_kwargs": {"raise_exception": 1}}, "chat_template_kwargs")])
def test_bad_thinking_fields_are_400s(qwen3, fields, param):
    err = assert_openai_error(qwen3.post("/v1/chat/completions", {"model": MODEL, "messages": ASK, **fields}), 400)
    assert err["param"] == param


def test_r1_thinks_until_the_end_tag_and_a_reply_without_one_is_all_thinking(r1):
    out = chat(r1, regex=None, max_tokens=6).choices[0]      # the default model never closes the block
    assert out.message.content is None and out.message.reasoning_content
    reasoning, content, _, _ = streamed(chat(r1, regex=None, max_tokens=6, stream=True))
    assert content == "" and reasoning == out.message.reasoning_content
    constrained = chat(r1, regex="The answer", extra_body={"thinking_token_budget": 4}).choices[0].message
    assert constrained.content == "The answer" and constrained.reasoning_content    # the grammar holds after it


def test_a_prompt_that_opens_the_block_starts_the_reply_in_it_unless_thinking_is_off(qwen35):
    on = chat(qwen35, regex=None, max_tokens=6).choices[0].message      # the default model never closes it
    assert on.content is None and on.reasoning_content
    off = chat(qwen35, regex=None, max_tokens=6, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content and off.choices[0].message.reasoning_content is None
    low = chat(qwen35, regex=None, max_tokens=6, reasoning_effort="minimal").choices[0].message
    assert low.content == off.choices[0].message.content and low.reasoning_content is None


def test_a_template_without_thinking_takes_the_fields_and_has_no_reasoning(server):
    said = chat(server, regex=THOUGHT, extra_body={"chat_template_kwargs": {"enable_thinking": True}},
                reasoning_effort="low").choices[0].message
    assert said.content == "<think>I think.</think>The answer."
    assert "reasoning_content" not in (said.model_extra or {})
    reply = message(server, max_tokens=8, thinking={"type": "adaptive"}, extra_body={"temperature": 0})
    assert [b.type for b in reply.content] == ["text"]


# ---- Responses -----------------------------------------------------------------------------------------------

def respond(server, **kw):
    return server.client().responses.create(model=MODEL, input=kw.pop("input", "What is 1 plus 2?"), temperature=0,
                                            max_output_tokens=80, extra_body={"guided_regex": THOUGHT}, **kw)


def test_responses_have_a_reasoning_item_first(qwen3):
    out = respond(qwen3, reasoning={"effort": "medium"})
    assert [i.type for i in out.output] == ["reasoning", "message"]
    assert out.output[0].summary == [] and [(c.type, c.text) for c in out.output[0].content] == \
        [("reasoning_text", "I think.")]
    assert out.output_text == "The answer." and out.reasoning.effort == "medium"
    events = list(respond(qwen3, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    done = [e.text for e in events if e.type == "response.reasoning_text.done"]
    assert deltas == "I think." and done == ["I think."]
    final = events[-1].response
    assert final.status == "completed" and [i.type for i in final.output] == ["reasoning", "message"]
    again = respond(qwen3, input=[{"type": "message", "role": "user", "content": "What is 1 plus 2?"},
                                  out.output[0].model_dump(exclude_none=True), out.output[1].model_dump(),
                                  {"type": "message", "role": "user", "content": "And 2 plus 2?"}])
    assert again.output_text == "The answer."
    assert respond(qwen3, previous_response_id=out.id, input="And 2 plus 2?").output_text == "The answer."
    with pytest.raises(openai.BadRequestError) as e:
        respond(qwen3, reasoning={"effort": "extreme"})
    assert e.value.body["param"] == "reasoning"


# ---- Messages ------------------------------------------------------------------------------------------------

def anthropic_client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)


def message(server, **kw):
    return anthropic_client(server).messages.create(model=MODEL, max_tokens=kw.pop("max_tokens", 2000),
                                                    messages=kw.pop("messages", ASK), **kw)


def test_messages_have_signed_thinking_blocks_that_come_back(r1):
    thinking = {"type": "enabled", "budget_tokens": 1024}
    out = message(r1, thinking=thinking, max_tokens=1030, extra_body={"temperature": 0, "max_tokens": 1030})
    assert out.content[0].type == "thinking" and out.content[0].thinking and out.content[0].signature
    assert out.model_extra["timings"]["thinking_n"] == 1024 and out.content[1].type == "text"   # the budget kept
    with anthropic_client(r1).messages.stream(model=MODEL, max_tokens=1030, messages=ASK, thinking=thinking,
                                              extra_body={"temperature": 0}) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert kinds[0] == "thinking_delta" and kinds[kinds.index("text_delta") - 1] == "signature_delta"
    assert final.content[0].thinking == out.content[0].thinking
    assert final.content[0].signature == out.content[0].signature
    block = out.content[0].model_dump()
    history = [*ASK, {"role": "assistant", "content": [block, {"type": "text", "text": "3"}]},
               {"role": "user", "content": "And 2 plus 2?"}]
    reply = message(r1, messages=history, max_tokens=4, extra_body={"temperature": 0})   # the signature holds
    assert reply.usage.output_tokens > 0           # (4 tokens may all be thinking the reply leaves out)
    edited = [*ASK, {"role": "assistant", "content": [{**block, "thinking": block["thinking"] + "!"}]},
              {"role": "user", "content": "And 2 plus 2?"}]
    with pytest.raises(anthropic.BadRequestError) as e:
        message(r1, messages=edited, max_tokens=4)
    assert e.value.body["type"] == "error" and "signature" in e.value.body["error"]["message"]


@pytest.mark.parametrize("thinking, max_tokens, needle", [
    ({"type": "enabled", "budget_tokens": 100}, 2000, "greater than or equal to 1024"),
    ({"type": "enabled", "budget_tokens": 2000}, 2000, "`max_tokens` must be greater than `thinking.budget_tokens`"),
    ({"type": "sometimes"}, 2000, "thinking.type"),
])
def test_anthropics_thinking_rules(qwen3, thinking, max_tokens, needle):
    with pytest.raises(anthropic.BadRequestError) as e:
        message(qwen3, thinking=thinking, max_tokens=max_tokens)
    assert needle in e.value.body["error"]["message"]


def test_thinking_disabled_and_adaptive_reach_the_template(qwen3):
    def prompt(thinking: dict) -> int:
        usage = message(qwen3, max_tokens=1, thinking=thinking).usage
        return usage.input_tokens + (usage.cache_read_input_tokens or 0)
    assert prompt({"type": "disabled"}) > prompt({"type": "adaptive"})


# ---- the parser the server picks ------------------------------------------------------------------------------

@pytest.mark.parametrize("source, name, starts", [(QWEN3, "qwen3", False), (QWEN35, "qwen3", True),
                                                 (R1, "deepseek_r1", True)])
def test_the_server_reads_the_template_for_its_parser_and_start(default_model_path, source, name, starts):
    from phasewise.server.thinking import Thinking
    from phasewise.tokenization.tokenizer import Tokenizer

    thinking = Thinking("auto", Tokenizer.load(default_model_path).with_chat_template(source))
    assert thinking.name == name
    parser = thinking.parser({})
    assert parser.feed("abc", final=True) == (("abc", "") if starts else ("", "abc"))
    off = thinking.parser({"enable_thinking": False})
    assert off.feed("abc", final=True) == (("abc", "") if name == "deepseek_r1" else ("", "abc"))
    assert Thinking("none", Tokenizer.load(default_model_path).with_chat_template(source)).parser({}) is None


def test_a_variable_the_template_cannot_use_is_a_value_error(default_model_path):
    from phasewise.tokenization.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(default_model_path).with_chat_template("{{ date_string + '!' }}")
    assert tokenizer.render_chat(ASK, template_kwargs={"date_string": "today"}) == "today!"
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        tokenizer.render_chat(ASK, template_kwargs={"date_string": 3})


# ---- without a server: the blocks and items a reply with thinking and a call makes -----------------------------

REPLY = '<think>I will add.</think>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def reply_parser():
    from phasewise.reasoning import ReasoningParser
    from phasewise.server.reply_parser import ReplyParser
    from phasewise.tool_calling import ToolCallParser

    return ReplyParser(ReasoningParser("qwen3", False), ToolCallParser("hermes", frozenset({"add"})))


@pytest.mark.parametrize("cut", range(0, len(REPLY) + 1, 7))
def test_messages_blocks_thinking_signed_then_the_call(cut):
    from phasewise.server.anthropic.output import Blocks
    from phasewise.server.anthropic.signature import ThinkingSignature

    signature = ThinkingSignature(b"k" * 32)
    blocks = Blocks(reply_parser(), single_call=False, signature=signature)
    events = blocks.add(REPLY[:cut], final=False) + blocks.add(REPLY[cut:], final=True)
    assert [b["type"] for b in blocks.content] == ["thinking", "tool_use"]
    assert blocks.content[0]["thinking"] == "I will add."
    assert signature.verify("I will add.", blocks.content[0]["signature"])
    assert not signature.verify("I will add!", blocks.content[0]["signature"])
    assert blocks.content[1]["input"] == {"a": 1, "b": 2}
    kinds = [data["delta"]["type"] if name == "content_block_delta" else name for name, data in events]
    assert kinds[kinds.index("signature_delta") + 1] == "content_block_stop"
    assert kinds.index("signature_delta") < kinds.index("input_json_delta")


@pytest.mark.parametrize("cut", range(0, len(REPLY) + 1, 7))
def test_responses_items_reasoning_then_the_call(cut):
    from phasewise.server.responses.output import OutputItems, assistant_message

    items = OutputItems(reply_parser())
    events = items.feed(REPLY[:cut]) + items.feed(REPLY[cut:], final=True) + items.finish("completed")
    assert [i["type"] for i in items.items] == ["reasoning", "function_call"]
    assert items.items[0]["content"] == [{"type": "reasoning_text", "text": "I will add."}]
    assert items.items[0]["summary"] == [] and items.items[0]["status"] == "completed"
    assert items.items[1]["name"] == "add" and items.items[1]["arguments"] == '{"a": 1, "b": 2}'
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.function_call_arguments.delta")
    assert assistant_message(items.items)["reasoning_content"] == "I will add."


def test_a_thinking_signature_holds_across_a_restart_and_not_elsewhere(tmp_path):
    """The key is kept in the cache directory: a server started again verifies what it signed before; a
    server with another directory's key (another machine's) does not, nor does it accept edited text."""
    from phasewise.server.anthropic.signature import ThinkingSignature

    first = ThinkingSignature.kept_in(tmp_path / "a")
    signed = first.sign("let me think")
    assert (tmp_path / "a" / "thinking_key").stat().st_mode & 0o777 == 0o600
    again = ThinkingSignature.kept_in(tmp_path / "a")
    assert again.verify("let me think", signed) and not again.verify("let me think!", signed)
    assert not ThinkingSignature.kept_in(tmp_path / "b").verify("let me think", signed)
