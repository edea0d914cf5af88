"""SamplingParams: what a request asks of the sampler and of the stop rules."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    logits. With prompt_logprobs set, max_tokens may be 0: the prompt is run and scored,
    nothing is generated.
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
        if self.max_tokens is not None and self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise ValueError(f"max_tokens must be at least 1 (or 0 with prompt_logprobs), got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.prompt_logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
