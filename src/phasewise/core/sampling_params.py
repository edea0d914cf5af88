"""SamplingParams: what a request asks of the sampler and of the stop rules."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from phasewise.json_types import JsonObject


ConstraintKind = Literal["json", "regex", "choice", "grammar"]
CONSTRAINT_KINDS: tuple[ConstraintKind, ...] = ("json", "regex", "choice", "grammar")


class ConstraintError(ValueError):
    """A structured_outputs constraint that does not compile (the message says why)."""


@dataclass(kw_only=True)
class StructuredOutputs:
    """A constraint on the output: set exactly one of json (a JSON schema, dict or text), json_object
    (any JSON object), regex, choice (one of these strings) or grammar (Lark, or llama.cpp's GBNF).

    strict=False lets a JSON schema use keywords the grammar compiler does not implement (they are then
    not enforced, as OpenAI's non-strict mode); with strict=True such a schema is refused.
    """

    json: JsonObject | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    strict: bool = True

    def __post_init__(self) -> None:
        kinds = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError("structured_outputs needs exactly one of json, json_object, regex, choice, "
                             f"grammar; got {', '.join(kinds) or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs choice must be a non-empty list of strings")
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs json is not valid JSON: {e}") from None
        else:
            schema = self.json
        if schema is not None and not isinstance(schema, dict):
            raise ValueError("structured_outputs json must be a JSON schema object")

    @property
    def kind(self) -> ConstraintKind:
        """json, regex, choice or grammar (json_object is a json schema)."""
        return "json" if self.json_object else next(k for k in CONSTRAINT_KINDS
                                                    if getattr(self, k) is not None)

    @property
    def text(self) -> str:
        """The constraint as one string (a schema as compact JSON, its key order kept: the output follows
        it); with kind, the compile cache's key."""
        if self.json_object:
            return '{"type": "object"}'
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            value = json.loads(value)
        return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


@dataclass(frozen=True, kw_only=True)
class ThinkingBlock:
    """A reply that may think in a block (`start` ... `end`) before it answers, as the chat template has the
    model write it. The engine tracks the block (RequestMetrics.thinking_tokens, answer_start) and keeps
    its budget: after `budget` thinking tokens it forces `end` and `after_end` (what the template writes
    after the block), then the model answers; 0 closes the block at once, None lets the model think as
    long as it likes. While a budget or a structured output holds, the block cannot end the reply (no
    end-of-sequence inside it). A structured output applies to the answer only (the thinking is free),
    unless its own text opens with `start` (it then spells the block itself, and the budget gives way).
    Whether the reply starts inside the block is read from the prompt (a template may open it there);
    otherwise the reply may open it with `start` first."""

    budget: int | None = None
    start: str = "<think>"
    end: str = "</think>"
    after_end: str = "\n\n"

    def __post_init__(self) -> None:
        if self.budget is not None and self.budget < 0:
            raise ValueError(f"thinking budget must be >= 0 (or None: unlimited), got {self.budget}")
        if not self.start or not self.end:
            raise ValueError("thinking start and end tags must not be empty")


@dataclass(kw_only=True)
class SamplingParams:
    """Per-request sampling settings, validated on construction (ValueError names the field).

    temperature 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable
    those filters. repetition_penalty (1 = off) divides positive logits and
    multiplies negative ones of every token seen in the prompt or output;
    presence_penalty and frequency_penalty (0 = off) subtract from the logits of
    tokens already generated, OpenAI style. logprobs=None returns none; an int N
    returns the chosen token's logprob plus the top N (0 means only the chosen).
    prompt_logprobs (None: none) does the same for every prompt token after the first, from the
    model's distribution at the position before it (vLLM's prompt_logprobs: what evaluation
    harnesses score); such a request skips the prefix cache, since a cached prefix has no
    logits. max_tokens 0: the prompt only, nothing generated: it is run into the prefix cache (a
    pre-warm) and, with prompt_logprobs, scored.
    structured_outputs constrains every token to a grammar (a JSON schema, regex, choice list or
    grammar); the request ends ("stop") as soon as the grammar is complete and nothing may follow.
    thinking (a ThinkingBlock): the reply may think first; its budget, and a grammar on the answer only.
    cache_salt (vLLM's field): requests of different salts never share a prefix-cache block, in RAM or
    on disk (one tenant cannot time another's prompts). cache_ttl: seconds the prompt cache's disk tier
    keeps this request's blocks after their last use (None: the engine's default; the server maps
    OpenAI's prompt_cache_retention to it). cache_breakpoints: (n, ttl) pairs, Anthropic's cache_control
    breakpoints in tokens: each whole block within the prompt's first n tokens is kept at least ttl
    seconds after each use, on disk (beyond cache_ttl) and in RAM (evicted after unkept blocks), and the
    tokens of those blocks this request enters in the prefix cache are counted by ttl
    (`RequestMetrics.cache_written`).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None
    thinking: ThinkingBlock | None = None
    cache_salt: str | None = None
    cache_ttl: float | None = None
    cache_breakpoints: tuple[tuple[int, float], ...] = ()

    MAX_LOGPROBS = 20

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0 (0: the prompt only), got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {self.MAX_LOGPROBS}], got "
                             f"{self.prompt_logprobs}")
        if self.cache_ttl is not None and not self.cache_ttl > 0:
            raise ValueError(f"cache_ttl must be a positive number of seconds, got {self.cache_ttl}")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(self.cache_salt).__name__}")
        self.cache_breakpoints = tuple((n, ttl) for n, ttl in self.cache_breakpoints)
        if not all(isinstance(n, int) and n > 0 and ttl > 0 for n, ttl in self.cache_breakpoints):
            raise ValueError("cache_breakpoints must be (tokens > 0, seconds > 0) pairs, got "
                             f"{self.cache_breakpoints}")

    def marked_ttl(self, end: int) -> float | None:
        """The longest ttl of the cache breakpoints covering the prompt's first `end` tokens (None: none
        does)."""
        return max((ttl for n, ttl in self.cache_breakpoints if n >= end), default=None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
