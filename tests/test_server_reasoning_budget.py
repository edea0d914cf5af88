"""`serve --reasoning-budget N` (llama-server's flag: the thinking budget of a request that sets none, or -1;
-1 unrestricted, 0 no thinking), and budgets that never cut a character in two: on a Qwen3.5-style template
written here whose generation prompt opens `<think>` and starts the thinking with emoji (the default model's
byte-level BPE writes each as three tokens, and goes on writing them), a block closed at any budget holds
whole characters, streamed and not, through the official SDKs."""

from __future__ import annotations

import anthropic
import pytest

from live_server import MODEL, start_server, stop_server

pytestmark = pytest.mark.slow

EMOJI = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
         "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
         "{% else %}{{ '<think>\\n' + '\U0001F389' * 6 }}{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "Celebrate!"}]
DEFAULT = 5


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reasoning-budget")
    (folder / "template.jinja").write_text(EMOJI)
    s = start_server(folder, "--chat-template", str(folder / "template.jinja"), "--reasoning-budget", str(DEFAULT))
    yield s
    stop_server(s)
    assert "Traceback" not in s.log.read_text(), s.log.read_text()


def chat(server, **extra) -> tuple[str, str, int]:
    """(reasoning, content, thinking tokens) of a greedy reply."""
    out = server.client().chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=24,
                                                  extra_body=extra)
    message = out.choices[0].message
    return message.reasoning_content or "", message.content or "", out.model_extra["timings"]["thinking_n"]


def streamed(server, **extra) -> str:
    chunks = server.client().chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=24,
                                                     extra_body=extra, stream=True)
    return "".join((c.delta.model_extra or {}).get("reasoning_content") or "" for ch in chunks for c in ch.choices)


@pytest.mark.parametrize("extra, thought", [({}, DEFAULT), ({"thinking_token_budget": -1}, DEFAULT),
                                            ({"thinking_budget_tokens": 3}, 3), ({"reasoning_effort": "none"}, 0)],
                         ids=["none", "-1", "own", "off"])
def test_the_servers_budget_holds_for_requests_that_set_none(server, extra, thought):
    reasoning, content, n = chat(server, **extra)
    assert n == thought and content and bool(reasoning) == (thought > 0)


def test_the_servers_budget_holds_in_messages(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    out = client.messages.create(model=MODEL, max_tokens=24, messages=ASK, extra_body={"temperature": 0})
    assert out.model_extra["timings"]["thinking_n"] == DEFAULT and [b.type for b in out.content] == ["thinking", "text"]


@pytest.mark.parametrize("budget", range(1, 8))
def test_a_budget_never_cuts_a_character_streamed_and_not(server, budget):
    reasoning, content, n = chat(server, thinking_token_budget=budget)
    assert n == budget and content
    assert "\ufffd" not in reasoning, reasoning
    assert streamed(server, thinking_token_budget=budget) == reasoning


def test_the_flag_takes_minus_1_or_a_count():
    from phasewise import cli

    parser = cli.build_parser()
    assert parser.parse_args(["serve"]).reasoning_budget == -1
    assert parser.parse_args(["serve", "--reasoning-budget", "0"]).reasoning_budget == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--reasoning-budget", "-2"])


def test_a_default_budget_of_0_turns_the_templates_switch_off():
    from phasewise.loading.loader import default_model_path
    from phasewise.server.chat_call import chat_call
    from phasewise.server.openai.protocol import ChatCompletionRequest
    from phasewise.server.thinking import Thinking
    from phasewise.tokenization.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(default_model_path())

    def item(default: int, **fields):
        request = ChatCompletionRequest.model_validate({"messages": ASK, **fields}).chat_request()
        return chat_call(request, "hermes", "r", Thinking("qwen3", tokenizer, default)).items[0]
    off = item(0)
    assert off.prompt.template_kwargs == {"enable_thinking": False} and off.params.thinking.budget == 0
    free = item(-1)
    assert free.prompt.template_kwargs is None and free.params.thinking.budget is None
    own = item(0, thinking_token_budget=7)
    assert own.prompt.template_kwargs is None and own.params.thinking.budget == 7
