"""The reasoning parser: reasoning, content and tool calls the same at every split of the text into
deltas (two deltas cut at each character, and one character at a time), for both parsers and both
starts (a prompt that opened <think> or not); a <tool_call> inside the thinking stays reasoning; and
the parser the server picks from a chat template."""

from __future__ import annotations

import pytest

from phasewise.reasoning import ReasoningParser, choose_parser, prompt_opens_thinking
from phasewise.server.reply_parser import ReplyParser
from phasewise.tool_calling import ToolCallParser

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'

# (text, parser, prompt_open) → (reasoning, content)
CASES = [
    (f"<think>a</think>b{CALL}", "qwen3", False, "a", f"b{CALL}"),
    ("<think>\nI think.\n</think>\n\nThe answer.", "qwen3", False, "I think.", "The answer."),
    ("The answer, no thinking.", "qwen3", False, "", "The answer, no thinking."),
    ("<thin> is not a tag", "qwen3", False, "", "<thin> is not a tag"),
    ("  <think>x</think>y", "qwen3", False, "x", "y"),
    ("I think.</think>answer", "qwen3", True, "I think.", "answer"),
    ("I think.</think>answer", "qwen3", False, "", "I think.</think>answer"),
    ("cut off while thinking </thi", "qwen3", True, "cut off while thinking </thi", ""),
    ("<think>never closed", "qwen3", False, "never closed", ""),
    ("I think.\n</think>\n\nanswer", "deepseek_r1", None, "I think.", "answer"),
    ("<think>I think.</think>answer", "deepseek_r1", None, "I think.", "answer"),
    ("no end tag at all", "deepseek_r1", None, "no end tag at all", ""),
    ("x</think></think>y", "deepseek_r1", None, "x", "</think>y"),
    (f"<think>maybe {CALL} no</think>done", "qwen3", False, f"maybe {CALL} no", "done"),
    ("<think>a \n\n b</think>", "qwen3", False, "a \n\n b", ""),
    ("", "qwen3", True, "", ""),
    ("<think></think>", "qwen3", False, "", ""),
]


def run(text: str, cuts: list[int], name: str, prompt_open: bool | None) -> tuple[str, str]:
    parser, reasoning, content, last = ReasoningParser(name, prompt_open), "", "", 0
    for cut in cuts + [len(text)]:
        r, c = parser.feed(text[last:cut], final=cut == len(text))
        reasoning, content, last = reasoning + r, content + c, cut
    assert parser.reasoning == reasoning
    return reasoning, content


@pytest.mark.parametrize("text, name, prompt_open, reasoning, content", CASES)
def test_every_split_gives_the_same_reasoning_and_content(text, name, prompt_open, reasoning, content):
    assert run(text, [], name, prompt_open) == (reasoning, content)
    for cut in range(len(text) + 1):
        assert run(text, [cut], name, prompt_open) == (reasoning, content), cut
    assert run(text, list(range(1, len(text))), name, prompt_open) == (reasoning, content)


def test_nothing_is_given_out_while_it_may_still_be_a_tag():
    parser = ReasoningParser("qwen3", False)
    assert parser.feed("<thi") == ("", "")
    assert parser.feed("nk>Hm") == ("Hm", "")
    assert parser.feed("m </th") == ("m", "")        # the space and the tag's start held
    assert parser.feed("ink>\n") == ("", "")
    assert parser.feed("Yes") == ("", "Yes")
    assert parser.closed


def reply(text: str, cuts: list[int], prompt_open: bool) -> tuple[str, str, list[tuple[str, str]]]:
    """(reasoning, content, calls) as a client rebuilds them from a ReplyParser's pieces."""
    parser = ReplyParser(ReasoningParser("qwen3", prompt_open), ToolCallParser("hermes", frozenset({"add"})))
    reasoning, content, calls, last = "", "", {}, 0
    for cut in cuts + [len(text)]:
        for piece in parser.feed(text[last:cut], final=cut == len(text)):
            reasoning += piece.get("reasoning", "")
            content += piece.get("content", "")
            for c in piece.get("tool_calls", ()):
                call = calls.setdefault(c["index"], ["", ""])
                call[0] += c["function"].get("name", "")
                call[1] += c["function"].get("arguments", "")
        last = cut
    return reasoning, content, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("prompt_open", [False, True])
def test_calls_are_read_from_the_answer_only(prompt_open):
    inside = ("" if prompt_open else "<think>") + f"I could write {CALL} here.</think>No call."
    after = ("" if prompt_open else "<think>") + f"I will add.</think>\n\n{CALL}"
    for cuts in ([], *([i] for i in range(len(after) + 1)), list(range(1, len(after)))):
        assert reply(after, cuts, prompt_open) == ("I will add.", "", [("add", '{"a": 1, "b": 2}')])
    for cuts in ([], *([i] for i in range(len(inside) + 1)), list(range(1, len(inside)))):
        assert reply(inside, cuts, prompt_open) == (f"I could write {CALL} here.", "No call.", [])


QWEN3 = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
         "not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def test_the_parser_a_template_calls_for():
    assert choose_parser(QWEN3, "<|im_start|>assistant\n") == "qwen3"
    assert choose_parser("{{ '<｜Assistant｜><think>\\n' }}", "<｜Assistant｜><think>\n") == "deepseek_r1"
    assert choose_parser("{{ messages }}", "user: hi\nassistant:") is None
    assert choose_parser("{% if '<think>' in m %}{% endif %}", "assistant:") == "qwen3"
    assert prompt_opens_thinking("a<think>\n") and not prompt_opens_thinking("<think>\n\n</think>\n\n")
    with pytest.raises(ValueError):
        ReasoningParser("granite")
