"""Typed hand-offs between scheduler, runner and callers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from phasewise.core.request import FinishReason, Request, TokenLogprobs
from phasewise.core.store_writer import DiskStats


class DraftProbs(Protocol):
    """A proposer's q per draft token ([k, V] rows; a torch.Tensor): the core only cuts it to the drafts kept."""

    def __getitem__(self, rows: slice) -> DraftProbs: ...


@dataclass(kw_only=True)
class ScheduledChunk:
    """Compute tokens [num_computed_tokens, num_computed_tokens + num_tokens) of a request this step.

    Speculative decoding: a chunk that samples may also carry draft tokens that would follow the
    request's last token. They are computed too (budget and KV slots reserved for `max_draft_tokens`
    of them), verified against the target's own distribution, and only the accepted ones become
    part of the request; rejected ones leave nothing behind but overwritable slots.
    """
    request: Request
    num_tokens: int                       # tokens of the request itself (drafts not included)
    max_draft_tokens: int = 0             # room reserved for drafts; the proposer fills up to this many
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: DraftProbs | None = None  # the proposer's q for each draft; None: a point mass on each

    @property
    def num_scheduled_tokens(self) -> int:
        """Rows this chunk adds to the forward pass: its own tokens plus the drafts."""
        return self.num_tokens + len(self.draft_token_ids)

    @property
    def input_token_ids(self) -> list[int]:
        start = self.request.num_computed_tokens
        return self.request.token_ids[start:start + self.num_tokens] + self.draft_token_ids

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
    num_draft_tokens: int = 0          # draft tokens to verify (known once the proposer has run)
    # a hybrid's recurrent-state copies (from slot, to slot) to make before the forward: checkpoints
    # saved, then restored (core/state_checkpoints.py)
    state_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None = None


@dataclass
class RunnerOutput:
    sampled: dict[str, SampledToken]   # request id → its new token (after any accepted drafts)
    accepted: dict[str, list[SampledToken]] = field(default_factory=dict)  # request id → accepted drafts, in order
    # request id → (first prompt position, its logprobs and the next ones'), for prompt_logprobs
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    grammar_ms: float = 0.0            # the grammar masks' time (structured outputs)
    threads: int = 0                   # threads that ran the step's kernels
    expert_choices: list[list[int]] | None = None   # a mixture of experts: per sparse layer, choices per expert


@dataclass(frozen=True, kw_only=True)
class EngineStats:
    """The engine at one moment (`EngineCore.stats()`, `LLMEngine.stats()`): what runs and waits, the
    KV pool, counters since the start. Frozen: the server's engine thread publishes one after each turn
    and the event loop reads it without locks."""
    num_waiting: int = 0
    num_running: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_cached_blocks: int = 0
    kv_usage: float = 0.0
    num_state_slots: int = 0               # a hybrid's recurrent-state slots for running requests,
    num_free_state_slots: int = 0          # those free,
    num_state_checkpoints: int = 0         # and the state checkpoints kept for prefix hits
    num_steps: int = 0
    spec_num_drafts: int = 0               # speculative decoding: request-steps that verified drafts,
    spec_num_draft_tokens: int = 0         # draft tokens verified,
    spec_num_accepted_tokens: int = 0      # and accepted (all since the engine started)
    num_received: int = 0                  # AsyncEngine: sub-requests its thread has taken in (added or refused), ever
    threads: int = 0                       # kernel threads in use (runner/thread_governor.py),
    cpus_busy_elsewhere: float = 0.0       # CPUs other programs kept busy lately,
    cpu_wait_seconds: float = 0.0          # and how long the engine's threads waited for a CPU, ever
    disk: DiskStats | None = None          # the prefix cache's disk tier (None: none), its counters


@dataclass(kw_only=True)
class StepRecord:
    """One engine step: what it ran and how long it took."""
    start: float
    duration_ms: float
    num_prefill_tokens: int
    num_decode_tokens: int
    batch_size: int
    num_draft_tokens: int = 0          # draft tokens verified
    num_accepted_tokens: int = 0       # of those, accepted
    grammar_ms: float = 0.0            # computing the grammar masks of the step's constrained rows
    threads: int = 0                   # threads that ran its kernels (runner/thread_governor.py)
    # a mixture of experts: per sparse layer, the (row, choice) pairs each expert took this step; only
    # the newest record keeps it (layers x experts numbers a step: EngineCore.step drops the last one's)
    expert_choices: list[list[int]] | None = None


@dataclass(kw_only=True)
class RequestOutput:
    """What one step produced for one request: a delta of new tokens, and whether it ended."""
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs]
    finished: bool
    finish_reason: FinishReason | None
    request: Request                   # the live request (prompt ids, metrics)
