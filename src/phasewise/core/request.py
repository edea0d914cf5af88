"""A request's state inside the engine, and the timestamps that account for its time."""

from __future__ import annotations

import enum
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from phasewise.core.sampling_params import SamplingParams

BlockKey = tuple[Hashable, tuple[int, ...]]   # a full block's (parent block's hash, its token ids)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"          # eos, a stop token or a stop string
    LENGTH = "length"      # max_tokens or the context length
    ABORT = "abort"
    ERROR = "error"


@dataclass(kw_only=True)
class RequestMetrics:
    """Wall-clock stamps (time.perf_counter seconds) of one request's life."""
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)   # when each output token was produced
    prefill_chunks: list[tuple[float, float, int]] = field(default_factory=list)  # (start, end, tokens)
    preempted_at: list[float] = field(default_factory=list)   # when it lost its blocks, each time
    finished: float | None = None
    spec_steps: int = 0              # steps that verified draft tokens of this request
    spec_draft_tokens: int = 0       # draft tokens proposed and verified
    spec_accepted_tokens: int = 0    # of those, accepted by the target
    # adaptive speculation: k → decodes it was chosen for
    spec_k_chosen: dict[int, int] = field(default_factory=dict)
    # the costs of its last choice: plain, row, draft (ms)
    spec_costs: tuple[float, float, float] | None = None
    grammar_compile_ms: float | None = None   # structured outputs: compiling (or copying) its grammar
    disk_tokens: int = 0              # prompt tokens the prompt cache's disk tier loaded for it,
    disk_load_ms: float = 0.0         # and the time that took (before it was first scheduled)
    # prompt tokens of cache breakpoints' prefixes (SamplingParams.cache_breakpoints) this request entered in
    # the prefix cache (computed here, not read), by breakpoint ttl in seconds: Anthropic's cache creation
    cache_written: dict[float, int] = field(default_factory=dict)
    # a reply that may think (SamplingParams.thinking), as its ThinkingGate counts it:
    thinking_tracked: bool = False            # the reply's thinking is tracked (otherwise it is all answer)
    thinking_tokens: int = 0                  # output tokens inside the thinking block
    # output index of the answer's first token, once the block has ended
    answer_start: int | None = None

    @property
    def preemptions(self) -> int:
        return len(self.preempted_at)

    @property
    def queue_ms(self) -> float:
        return _ms(self.arrival, self.first_scheduled)

    @property
    def ttft_ms(self) -> float:
        return _ms(self.arrival, self.first_token)

    @property
    def prompt_ms(self) -> float:
        """Prefill: first scheduled → first token."""
        return _ms(self.first_scheduled, self.first_token)

    @property
    def decode_ms(self) -> float:
        """First token → last token: the time of the decode steps."""
        return _ms(self.first_token, self.token_times[-1]) if self.token_times else 0.0

    @property
    def itl_ms(self) -> list[float]:
        """Gaps between consecutive output tokens."""
        t = self.token_times
        return [(b - a) * 1e3 for a, b in zip(t, t[1:])]

    @property
    def thinking_ms(self) -> float:
        """First token → the token that ended the thinking (or the last token, while it goes on); 0 when
        nothing was thought."""
        t = self.token_times
        if not self.thinking_tokens or not t:
            return 0.0
        end = self.answer_start - 1 if self.answer_start else len(t) - 1
        return _ms(self.first_token, t[min(end, len(t) - 1)])

    @property
    def ttfa_ms(self) -> float | None:
        """Time to the first answer token: arrival → the answer's first token, after any thinking (the
        first token when the thinking is not tracked); None before an answer token came."""
        if not self.thinking_tracked:
            return self.ttft_ms if self.first_token is not None else None
        a, t = self.answer_start, self.token_times
        return _ms(self.arrival, t[a]) if a is not None and a < len(t) else None

    @property
    def e2e_ms(self) -> float:
        return _ms(self.arrival, self.finished)

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 without speculation)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_mean_accepted_len(self) -> float:
        """Tokens one verification step commits: accepted drafts plus the target's own token (1..k+1)."""
        return 1 + self.spec_accepted_tokens / self.spec_steps if self.spec_steps else 0.0


def _ms(a: float | None, b: float | None) -> float:
    return (b - a) * 1e3 if a is not None and b is not None else 0.0


@dataclass
class TokenLogprobs:
    """The chosen token's logprob and the top-N alternatives (from the raw model distribution)."""
    logprob: float
    top: list[tuple[int, float]]


class Grammar(Protocol):
    """What the core asks of a request's grammar (structured outputs; a structured.GrammarMatcher)."""

    def accept(self, token_id: int) -> bool: ...
    def valid_prefix(self, token_ids: Sequence[int]) -> int: ...
    @property
    def finished(self) -> bool: ...
    @property
    def error(self) -> str | None: ...


class SequenceView(Protocol):
    """What sampling and grammar masks read of a request (the runner's `RequestState`)."""
    request_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    grammar: Grammar | None


class Request:
    """Token ids (prompt then output), how many have KV computed, and the KV blocks that hold them."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: frozenset[int] = frozenset(), max_model_len: int | None = None,
                 arrival: float | None = None, grammar: Grammar | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.token_ids: list[int] = list(prompt_token_ids)   # prompt + output
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[TokenLogprobs] = []   # per output token, when logprobs were asked for
        # per prompt position (the first None), when prompt_logprobs were asked for; filled as chunks run
        self.prompt_logprobs: list[TokenLogprobs | None] | None = \
            [None] * len(prompt_token_ids) if sampling_params.prompt_logprobs is not None else None
        self.num_computed_tokens = 0                # tokens whose K/V are in the cache
        self.block_tables: list[list[int]] = []    # per KV group, its blocks (core/kv_cache_manager.py)
        # (hash, key) per full block, filled by the KV manager
        self.block_hashes: list[tuple[int, BlockKey]] = []
        self.num_cached_blocks = 0                  # leading blocks registered in the prefix cache
        self.num_cached_tokens: int | None = None   # prompt tokens found in the prefix cache at admission
        self.disk_digests: list[bytes] = []         # per full block, its digest on disk (core/disk_tier.py)
        self.disk_checked = False                   # the disk tier has looked for its prefix
        self.state_slot: int | None = None          # a hybrid's recurrent-state slot while it holds blocks
        self.tail_slot: int | None = None           # an int8 KV cache's tail slot while it holds blocks
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        # the speculation policy's (core/spec_policy.py): its acceptance
        self.spec_choice: object = None
        self.grammar = grammar                      # structured outputs or thinking: a
                                                    # structured.GrammarMatcher or ThinkingGate
        self.metrics = RequestMetrics(arrival=arrival if arrival is not None else time.perf_counter())

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
        if self.grammar is not None:
            # a refused token leaves the grammar failed: check_finish ends it
            self.grammar.accept(token_id)

    def check_finish(self) -> FinishReason | None:
        """After a token is appended: eos / stop token, a complete grammar (nothing may follow), max_tokens,
        or the context length. A grammar that refused the token is an error."""
        params, n_out = self.sampling_params, len(self.output_token_ids)
        last = self.output_token_ids[-1]
        if self.grammar is not None and self.grammar.finished:
            return FinishReason.ERROR if self.grammar.error else FinishReason.STOP
        if n_out >= params.min_tokens:
            if last in params.stop_token_ids or (not params.ignore_eos and last in self.eos_token_ids):
                return FinishReason.STOP
        if params.max_tokens is not None and n_out >= params.max_tokens:
            return FinishReason.LENGTH
        if self.max_model_len is not None and self.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    @property
    def block_ids(self) -> list[int]:
        """The first KV group's table: the whole context's blocks for a model without windows."""
        return self.block_tables[0] if self.block_tables else []

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={sum(map(len, self.block_tables))})")
