"""Thinking on the server: which reasoning parser reads the replies (`--reasoning-parser`, or the one the
chat template calls for), whether a request's prompt ends inside an open `<think>`, and the switch each
API's fields set (`chat_template_kwargs`, `reasoning_effort`, Responses' `reasoning.effort`,
Anthropic's `thinking`), which reaches the template as `enable_thinking`.

Budgets are accepted and not enforced here (the engine's job).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING

from phasewise.json_types import JsonObject
from phasewise.reasoning import PARSERS, ReasoningParser, choose_parser, prompt_opens_thinking

if TYPE_CHECKING:
    from phasewise.tokenization.tokenizer import Tokenizer

CHOICES = ("auto", "none", *PARSERS)           # --reasoning-parser (engine/args.py)
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")   # OpenAI's reasoning efforts
OFF_EFFORTS = ("none", "minimal")              # these turn thinking off where the template has the switch
# variables and functions the renderer gives the template itself: a request's chat_template_kwargs cannot set them
RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt", "tokenize", "chat_template",
                      "continue_final_message", "return_dict", "tokenizer_kwargs", "bos_token", "eos_token",
                      "pad_token", "unk_token", "raise_exception", "strftime_now", "namespace", "dict", "range",
                      "lipsum", "cycler", "joiner"})


class Thinking:
    """One server's reading of thinking. choice: a CHOICES entry ("auto": the template's own parser,
    reasoning.choose_parser; "none": replies are read as they are)."""

    def __init__(self, choice: str, tokenizer: Tokenizer) -> None:
        if choice not in CHOICES:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(CHOICES)}, got {choice!r}")
        self.tokenizer = tokenizer
        self._opens = lru_cache(maxsize=64)(self._probe)
        self.name: str | None = None if choice == "none" else choice
        if choice == "auto":
            template = tokenizer.chat_template if tokenizer.has_chat_template() else ""
            self.name = choose_parser(template, self._render("{}")) if template else None

    def parser(self, template_kwargs: JsonObject | None, constrained: bool = False) -> ReasoningParser | None:
        """A fresh parser for one reply of a request with these template variables (None: no thinking).
        constrained: the reply has a grammar, which starts at its first token (not after the block, yet):
        it is reasoning only where it opens `<think>` itself."""
        if self.name is None:
            return None
        opened = not constrained and (self.name == "deepseek_r1" or
                                      self._opens(json.dumps(template_kwargs or {}, sort_keys=True)))
        return ReasoningParser(self.name, opened)

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
    its reasoning effort unless they set it. error(message, field): the API's 400."""
    kwargs: JsonObject = dict(given or {})
    for name in kwargs:
        if name in RESERVED or not name.isidentifier():
            raise error(f"chat_template_kwargs cannot set {name!r}", "chat_template_kwargs")
    if effort is not None:
        if effort not in EFFORTS:
            raise error(f"{effort_field} must be one of {', '.join(EFFORTS)}, got {effort!r}", effort_field)
        kwargs.setdefault("enable_thinking", effort not in OFF_EFFORTS)
    return kwargs
