"""Thinking on the server: which reasoning parser reads the replies (`--reasoning-parser`, or the one the
chat template calls for), whether a request's prompt ends inside an open `<think>`, and the switch each
API's fields set (`chat_template_kwargs`, `reasoning_effort`, Responses' `reasoning.effort`,
Anthropic's `thinking`), which reaches the template as `enable_thinking`, and the request's thinking
budget, which the engine keeps (SamplingParams.thinking, a ThinkingBlock: after N thinking tokens it
forces `</think>` and the answer follows).

A budget comes from, first to last: the per-request fields of vLLM (`thinking_token_budget`) and
llama-server (`thinking_budget_tokens`, and `reasoning_budget_tokens` as some of its versions spell it;
-1 there means the server's default), Anthropic's `thinking.budget_tokens` (`disabled`: 0, `adaptive`: none),
the reasoning effort (EFFORT_BUDGETS), or else the server's `--reasoning-budget` (llama-server's flag:
-1, the default, unrestricted; 0 no thinking). A budget of 0 turns the template's switch off too
(`enable_thinking` false, unless the request set it), so a template with the switch writes an empty
block; elsewhere the engine closes the block at once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING

from phasewise.core.sampling_params import ThinkingBlock
from phasewise.json_types import JsonObject
from phasewise.reasoning import PARSERS, ParserName, ReasoningParser, choose_parser, prompt_opens_thinking

if TYPE_CHECKING:
    from phasewise.tokenization.tokenizer import Tokenizer

CHOICES = ("auto", "none", *PARSERS)           # --reasoning-parser (engine/args.py)
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")   # OpenAI's reasoning efforts
OFF_EFFORTS = ("none", "minimal")              # these turn thinking off where the template has the switch
# the thinking budget (tokens) each effort asks for: none and minimal think not at all; "medium", OpenAI's
# default effort, is the budget only when a request names it (without an effort there is no budget)
EFFORT_BUDGETS = {"none": 0, "minimal": 0, "low": 1024, "medium": 4096, "high": 16384, "xhigh": 32768}
# the per-request budget fields taken: vLLM's, llama-server's (and its other spelling); -1: unrestricted
BUDGET_FIELDS = ("thinking_token_budget", "thinking_budget_tokens", "reasoning_budget_tokens")
# variables and functions the renderer gives the template itself: a request's chat_template_kwargs
# cannot set them
RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt", "tokenize", "chat_template",
                      "continue_final_message", "return_dict", "tokenizer_kwargs", "bos_token", "eos_token",
                      "pad_token", "unk_token", "raise_exception", "strftime_now", "namespace", "dict",
                      "range", "lipsum", "cycler", "joiner"})


class Thinking:
    """One server's reading of thinking. choice: a CHOICES entry ("auto": the template's own parser,
    reasoning.choose_parser; "none": replies are read as they are)."""

    def __init__(self, choice: str, tokenizer: Tokenizer, default_budget: int = -1) -> None:
        if choice not in CHOICES:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(CHOICES)}, got {choice!r}")
        self.tokenizer = tokenizer
        self.default_budget = default_budget        # --reasoning-budget: for requests that give none
        self._opens = lru_cache(maxsize=64)(self._probe)
        self.name: ParserName | None = next((p for p in PARSERS if p == choice), None)   # a parser named
        if choice == "auto":
            template = tokenizer.chat_template if tokenizer.has_chat_template() else ""
            self.name = choose_parser(template, self._render("{}")) if template else None

    def parser(self, template_kwargs: JsonObject | None) -> ReasoningParser | None:
        """A fresh parser for one reply of a request with these template variables (None: no thinking).
        A grammar on the reply holds after the block (the engine's ThinkingGate), so it changes nothing
        here."""
        if self.name is None:
            return None
        opened = self.name == "deepseek_r1" or self._opens(json.dumps(template_kwargs or {}, sort_keys=True))
        return ReasoningParser(self.name, opened)

    def budget(self, asked: int | None) -> int | None:
        """The thinking tokens a request may write (None: unlimited): its own budget, else (none, or -1) the
        server's default (--reasoning-budget, llama-server's: -1 unlimited, 0 no thinking)."""
        return resolved_budget(asked, self.default_budget)

    def block(self, budget: int | None) -> ThinkingBlock | None:
        """The engine's view of a reply's thinking (tracked, kept in the budget; None: replies are not
        read for thinking). Both parsers' blocks are `<think>` ... `</think>`, with a blank line after."""
        return None if self.name is None else ThinkingBlock(budget=budget)

    def _probe(self, kwargs_json: str) -> bool:
        """Whether the generation prompt, with these variables, ends inside an open `<think>`."""
        return prompt_opens_thinking(self._render(kwargs_json))

    def _render(self, kwargs_json: str) -> str:
        try:
            return self.tokenizer.render_chat([{"role": "user", "content": "?"}],
                                              template_kwargs=json.loads(kwargs_json))
        except ValueError:
            return ""


def template_kwargs(given: JsonObject | None, effort: str | None, error: Callable[[str, str], Exception],
                    effort_field: str = "reasoning_effort") -> JsonObject:
    """A request's variables for the chat template: its chat_template_kwargs, and enable_thinking from
    its reasoning effort unless they set it (a budget of 0 sets it too: chat_call). error(message, field):
    the API's 400."""
    kwargs: JsonObject = dict(given or {})
    for name in kwargs:
        if name in RESERVED or not name.isidentifier():
            raise error(f"chat_template_kwargs cannot set {name!r}", "chat_template_kwargs")
    if effort is not None:
        if effort not in EFFORTS:
            raise error(f"{effort_field} must be one of {', '.join(EFFORTS)}, got {effort!r}", effort_field)
        kwargs.setdefault("enable_thinking", effort not in OFF_EFFORTS)
    return kwargs


def thinking_budget(fields: dict[str, int | None], effort: str | None) -> int | None:
    """A request's thinking budget: its first budget field given (BUDGET_FIELDS, by name; -1: unlimited),
    else its effort's (EFFORT_BUDGETS), else None (not said: the server's --reasoning-budget)."""
    for name in BUDGET_FIELDS:
        value = fields.get(name)
        if value is not None:
            return value
    return EFFORT_BUDGETS.get(effort) if effort is not None else None


def resolved_budget(asked: int | None, default: int = -1) -> int | None:
    """A request's budget; when it gave none (None, or -1 as llama-server takes it), `default`; None:
    unlimited."""
    budget = asked if asked is not None and asked >= 0 else default
    return None if budget < 0 else budget
