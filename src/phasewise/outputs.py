"""What callers of the public API get back."""

from __future__ import annotations

from dataclasses import dataclass

from phasewise.core.request import TokenLogprobs
from phasewise.core.request import RequestMetrics


@dataclass(kw_only=True)
class CompletionOutput:
    """A finished (or, while streaming, the growing) result of one request."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None          # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: str | int | None      # the stop string or stop token that ended it
    logprobs: list[TokenLogprobs] | None
    metrics: RequestMetrics
    cached_tokens: int = 0
    # prompt_logprobs: per prompt token (None for the first), once the prompt has run
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    error: str | None = None           # finish_reason "error": what went wrong (a grammar refused a token)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(kw_only=True)
class StreamDelta:
    """What one engine step added to one request."""
    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finished: bool
    output: CompletionOutput           # the request's output so far (final when finished)
