"""ReplyParser: a reply's text → reasoning, content and tool calls, as it streams.

Reasoning is split off first (reasoning.ReasoningParser); tool calls are read from the answer only
(tool_calling.ToolCallParser), so a `<tool_call>` written while thinking stays reasoning. `feed`
returns the tool parser's delta pieces ({"content"}, {"tool_calls"}) after a {"reasoning": text}
piece when the step added thinking.
"""

from __future__ import annotations

from phasewise.json_types import JsonObject
from phasewise.reasoning import ReasoningParser
from phasewise.tool_calling import ToolCall, ToolCallParser


class ReplyParser:
    """reasoning None: no thinking is read (the text is all answer); tools None: no calls are read;
    shown false: the thinking is read and dropped (include_reasoning false)."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None,
                 shown: bool = True) -> None:
        self.reasoning_parser, self.tools, self.shown = reasoning, tools, shown
        self.answer = ""              # the answer's text so far (calls and all)
        self.cut = False              # the output was cut off by the token limit

    def feed(self, text: str, final: bool = False, cut: bool = False) -> list[JsonObject]:
        """cut (with final): the output was cut off by the token limit (an unfinished call is dropped)."""
        thought, answer = self.reasoning_parser.feed(text, final) if self.reasoning_parser else ("", text)
        self.answer += answer
        self.cut = cut
        pieces: list[JsonObject] = [{"reasoning": thought}] if thought and self.shown else []
        if self.tools is not None:
            return pieces + self.tools.feed(answer, final, cut)
        return pieces + ([{"content": answer}] if answer else [])

    @property
    def thinks(self) -> bool:
        """Replies are read for thinking (the chat message then has reasoning fields, null or not)."""
        return self.reasoning_parser is not None and self.shown

    @property
    def reasoning(self) -> str:
        return self.reasoning_parser.reasoning if self.reasoning_parser and self.shown else ""

    @property
    def calls(self) -> list[ToolCall]:
        return self.tools.calls if self.tools else []

    @property
    def content(self) -> str:
        """The answer without its calls (all of it when it made none; a call cut off is dropped)."""
        return self.tools.content if self.tools and (self.tools.calls or self.cut) else self.answer
