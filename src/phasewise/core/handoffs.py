"""Typed hand-offs between scheduler, runner and callers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from phasewise.core.block_pool import CacheStats
from phasewise.core.request import FinishReason, Grammar, Request, TokenLogprobs
from phasewise.core.sampling_params import SamplingParams
from phasewise.core.store_writer import DiskStats


class DraftProbs(Protocol):
    """A proposer's q per draft token ([k, V] rows; a torch.Tensor): the core only cuts it to the
    drafts kept."""

    def __getitem__(self, rows: slice) -> DraftProbs: ...


@dataclass(kw_only=True)
class NewRequest:
    """What the runner keeps of a request, handed over with its first scheduled chunk: the runner holds
    its own copy (runner/request_state.py) until the request's id comes back in `finished_ids`."""
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]           # outputs made elsewhere (a disaggregated prefill's first token)
    sampling_params: SamplingParams
    grammar: Grammar | None               # the core's grammar (structured outputs, thinking):
                                          # read, never advanced

    @classmethod
    def of(cls, req: Request) -> NewRequest:
        return cls(request_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids),
                   output_token_ids=list(req.output_token_ids), sampling_params=req.sampling_params,
                   grammar=req.grammar)


@dataclass(kw_only=True)
class ScheduledChunk:
    """Compute tokens [start, start + num_tokens) of a request this step, as plain data.

    Speculative decoding: a chunk that samples may also carry draft tokens that would follow the
    request's last token. The runner's proposer fills them (up to `max_draft_tokens`, the budget and
    KV slots reserved); they are computed too, verified against the target's own distribution, and
    only the accepted ones become part of the request; rejected ones leave nothing behind but
    overwritable slots.
    """
    request_id: str
    start: int                            # the request's tokens with KV before the chunk
                                          # (its first row's position)
    token_ids: list[int]                  # the chunk's own tokens (drafts not included)
    num_request_tokens: int               # the request's tokens (prompt + output) when scheduled
    num_prompt_tokens: int
    block_tables: list[list[int]]         # the request's, per KV group (read-only for the step)
    state_slot: int | None = None         # a hybrid's recurrent-state slot
    tail_slot: int | None = None          # an int8 KV cache's slot for the request's newest keys
    preemptions: int = 0                  # the request's preemptions so far (a proposer's K/V went with them)
    max_draft_tokens: int = 0             # room reserved for drafts; the proposer fills up to this many
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: DraftProbs | None = None  # the proposer's q for each draft; None: a point mass on each

    @classmethod
    def of(cls, req: Request, num_tokens: int, max_draft_tokens: int = 0,
           draft_token_ids: list[int] | None = None) -> ScheduledChunk:
        """`num_tokens` of `req` from its computed tokens on."""
        start = req.num_computed_tokens
        return cls(request_id=req.request_id, start=start, token_ids=req.token_ids[start:start + num_tokens],
                   num_request_tokens=req.num_tokens, num_prompt_tokens=req.num_prompt_tokens,
                   block_tables=req.block_tables, state_slot=req.state_slot, tail_slot=req.tail_slot,
                   preemptions=req.metrics.preemptions,
                   max_draft_tokens=max_draft_tokens, draft_token_ids=list(draft_token_ids or []))

    @property
    def num_tokens(self) -> int:
        """Tokens of the request itself (drafts not included)."""
        return len(self.token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Rows this chunk adds to the forward pass: its own tokens plus the drafts."""
        return self.num_tokens + len(self.draft_token_ids)

    @property
    def input_token_ids(self) -> list[int]:
        return self.token_ids + self.draft_token_ids

    @property
    def samples(self) -> bool:
        """The chunk reaches the request's last token, so a new token is sampled from it."""
        return self.start + self.num_tokens == self.num_request_tokens

    @property
    def is_decode(self) -> bool:
        """One new output token's KV (otherwise: a prompt chunk, or recomputation after preemption)."""
        return self.num_tokens == 1 and self.start >= self.num_prompt_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    num_prefill_tokens: int = 0        # tokens of chunks that are not the one-token decode
                                       # of a running request
    num_decode_tokens: int = 0
    num_draft_tokens: int = 0          # draft tokens to verify (known once the proposer has run)
    # a hybrid's recurrent-state copies (from slot, to slot) to make before the forward: checkpoints
    # saved, then restored (core/state_checkpoints.py)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)   # requests the runner has not seen
    finished_ids: list[str] = field(default_factory=list)          # requests ended since the last step

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
    # request id → its accepted drafts, in order
    accepted: dict[str, list[SampledToken]] = field(default_factory=dict)
    # request id → (first prompt position, its logprobs and the next ones'), for prompt_logprobs
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    propose_ms: float = 0.0            # the proposer's time (speculative decoding), within the step


@dataclass(frozen=True, kw_only=True)
class EngineStats:
    """The engine core at one moment (`EngineCore.stats()`, `LLMEngine.stats()`): what runs and waits,
    the KV pool, counters since the start. Frozen: the server's engine thread publishes one after each
    turn and the event loop reads it without locks. What the runner and the server measure they report
    in their own stats (runner/step_extras.py, server/server_stats.py), composed where they are shown."""
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
    ram: CacheStats = field(default_factory=CacheStats)   # the prefix cache in RAM: hits, evictions (a copy)
    disk: DiskStats | None = None          # the prefix cache's disk tier (None: none): its live counters
                                           # (its writer thread moves them while the engine idles)


@dataclass(kw_only=True)
class StepRecord:
    """One engine step as the core saw it: what it ran and how long it took (the runner's own figures of
    the step: runner/step_extras.py)."""
    start: float
    duration_ms: float
    num_prefill_tokens: int
    num_decode_tokens: int
    batch_size: int
    num_draft_tokens: int = 0          # draft tokens verified
    num_accepted_tokens: int = 0       # of those, accepted


@dataclass(kw_only=True)
class RequestOutput:
    """What one step produced for one request: a delta of new tokens, and whether it ended."""
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs]
    finished: bool
    finish_reason: FinishReason | None
    request: Request                   # the live request (prompt ids, metrics)
