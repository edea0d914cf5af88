"""Typed hand-offs between scheduler, runner and callers."""

from __future__ import annotations

from dataclasses import dataclass

from phasewise.engine.request import FinishReason, Request


@dataclass
class ScheduledChunk:
    """Compute tokens [num_computed_tokens, num_computed_tokens + num_tokens) of a request this step."""
    request: Request
    num_tokens: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the request's last token, so a new token is sampled from it."""
        return self.request.num_computed_tokens + self.num_tokens == self.request.num_tokens

    @property
    def is_decode(self) -> bool:
        """One new output token's KV (otherwise: a prompt chunk, or recomputation after preemption)."""
        return self.num_tokens == 1 and self.request.num_computed_tokens >= self.request.num_prompt_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    num_prefill_tokens: int = 0        # tokens of chunks that are not the one-token decode of a running request
    num_decode_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class TokenLogprobs:
    """The chosen token's logprob and the top-N alternatives (from the raw model distribution)."""
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None = None


@dataclass
class RunnerOutput:
    sampled: dict[str, SampledToken]   # request id → its new token


@dataclass
class StepRecord:
    """One engine step: what it ran and how long it took."""
    start: float
    duration_ms: float
    num_prefill_tokens: int
    num_decode_tokens: int
    batch_size: int


@dataclass
class RequestOutput:
    """What one step produced for one request: a delta of new tokens, and whether it ended."""
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs]
    finished: bool
    finish_reason: FinishReason | None
    request: Request                   # the live request (prompt ids, metrics)
