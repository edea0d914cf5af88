"""ReasoningParser: a model's output → (reasoning, content) deltas, as the text streams in.

The names are vLLM's. "qwen3" (Qwen3, Qwen3.5, QwQ-style templates that offer `enable_thinking`): the
output may open with `<think>` (older templates) or the prompt may already have opened it (Qwen3.5's);
either way the text up to `</think>` is reasoning and the rest the answer. An output that opens with
anything else, after a prompt that opened no block (`enable_thinking` false writes an empty one), is
all answer. "deepseek_r1" (the R1 distills): the prompt opens the block, so the output is reasoning
until `</think>` (a leading `<think>` is dropped); with no `</think>` at all the whole output is
reasoning, as in vLLM (a reply cut off while thinking). A `<tool_call>` inside the block stays
reasoning: tool calls are read from the answer only.

Tags may be split anywhere across deltas: text that may still turn out to be a tag is held back until
it is known. Whitespace around the reasoning and at the start of the answer after `</think>` is
dropped (Qwen's templates strip both when they render the turn again).
"""

from __future__ import annotations

from typing import Literal, get_args

OPEN, CLOSE = "<think>", "</think>"
ParserName = Literal["qwen3", "deepseek_r1"]   # how replies' thinking is split from the answer
PARSERS: tuple[ParserName, ...] = get_args(ParserName)


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def prompt_opens_thinking(prompt: str) -> bool:
    """The prompt ends inside a `<think>` block it opened (the template wrote `<think>` for the reply)."""
    return prompt.rfind(OPEN) > prompt.rfind(CLOSE)


def choose_parser(template: str, generation_prompt: str) -> ParserName | None:
    """The parser a chat template calls for, None when it writes no thinking. generation_prompt: the
    template's rendering of one user message with the generation prompt (its tail is what matters).
    A template with a thinking switch (`enable_thinking`) or `<think>` in it is qwen3's, unless its
    generation prompt always opens the block with no switch (the R1 distills, QwQ): deepseek_r1."""
    if "enable_thinking" in template:
        return "qwen3"
    if prompt_opens_thinking(generation_prompt):
        return "deepseek_r1"
    return "qwen3" if OPEN in template else None


class ReasoningParser:
    """One reply's text split as it streams. name: a PARSERS entry; prompt_open: the output starts as
    reasoning, the prompt having opened the block (prompt_opens_thinking); None: the parser's own
    assumption (deepseek_r1's prompt opens it, qwen3's may not)."""

    def __init__(self, name: ParserName = "qwen3", prompt_open: bool | None = None) -> None:
        if name not in PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r} (one of {', '.join(PARSERS)})")
        self.name = name
        self.reasoning = ""           # the reasoning given out so far
        self.closed = False           # `</think>` came: the rest is answer
        self._buf = ""                # text not yet given out
        self._space = ""              # the reasoning's trailing whitespace, held until more reasoning follows
        # "lead": the output's start, where a `<think>` may open the block; then "reasoning", "after" (the
        # answer's leading whitespace, dropped) and "content"
        self._state = "lead"
        # the start, with no <think>
        self._thinking = name == "deepseek_r1" if prompt_open is None else prompt_open

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) given out for this delta; final: the output ended, nothing is held."""
        self._buf += text
        thought, answer = "", ""
        if self._state == "lead":
            self._lead(final)
        if self._state == "reasoning":
            thought = self._reasoning(final)
        if self._state == "after":
            self._buf = self._buf.lstrip()
            if self._buf or final:
                self._state = "content"
        if self._state == "content":
            answer, self._buf = self._buf, ""
        return thought, answer

    def _lead(self, final: bool) -> None:
        """At the output's start: an opening `<think>` (after whitespace) is dropped and starts reasoning."""
        start = self._buf.lstrip()
        if start.startswith(OPEN):
            self._buf, self._state = start[len(OPEN):].lstrip(), "reasoning"
        elif OPEN.startswith(start) and not final:
            return                                   # may still become `<think>`
        elif self._thinking:
            self._buf, self._state = start, "reasoning"
        else:
            self._state = "content"

    def _reasoning(self, final: bool) -> str:
        """Reasoning up to `</think>` (then the state moves on), or all that cannot be part of one; its
        trailing whitespace is held until more reasoning follows."""
        if not self.reasoning:
            self._buf = self._buf.lstrip()
        end = self._buf.find(CLOSE)
        if end >= 0:
            piece, self._buf = self._buf[:end], self._buf[end + len(CLOSE):]
            self._state, self.closed = "after", True
        else:
            cut = len(self._buf) - (0 if final else _held(self._buf, CLOSE))
            piece, self._buf = self._buf[:cut], self._buf[cut:]
        whole = self._space + piece
        text = whole.rstrip()
        self._space = "" if self.closed or final else whole[len(text):]
        self.reasoning += text
        return text
