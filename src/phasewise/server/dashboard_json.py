"""The dashboard's JSON: what `DashboardFeed.snapshot` returns and the page (dashboard/*.js) reads."""

from __future__ import annotations

from typing import TypedDict


class RooflineJson(TypedDict):
    dram_gbs: float
    compute_gops: float
    compute_name: str


class _StepBase(TypedDict):
    t: float                       # its start (perf_counter seconds)
    ms: float
    prefill: int                   # prompt tokens
    decode: int                    # decode tokens (drafts aside)
    batch: int                     # rows
    draft: int                     # draft tokens verified
    accepted: int                  # of those, accepted
    grammar_ms: float
    threads: int
    others: float                  # CPUs other programs kept busy
    used: int                      # KV blocks after it: referenced, cached, free
    cached: int
    free: int
    running: int
    waiting: int
    seq: int


class StepJson(_StepBase, total=False):
    experts_read: int              # a mixture of experts: of all layers' experts, those the step read


class RequestJson(TypedDict):
    """A request in brief: its stamps in perf_counter seconds, its counts, its latencies in ms."""
    id: str
    arrival: float
    scheduled: float | None
    chunks: list[list[float]]      # [start, end, tokens] per prefill chunk
    first_token: float | None
    last_token: float | None
    tokens: int
    prompt_tokens: int
    cached_tokens: int
    preempted: list[float]
    finished: float | None
    reason: str | None             # None while it runs
    ttft_ms: float | None
    itl_mean_ms: float | None
    itl_max_ms: float | None
    grammar_compile_ms: float | None
    thinking_tokens: int           # output tokens inside a thinking block (the timeline's thinking phase)
    answer_at: float | None        # when the answer's first token came, after any thinking
    ttfa_ms: float | None          # arrival → that token


class FinishedJson(RequestJson):
    seq: int


class _KindBase(TypedDict):
    steps: int
    time_share: float
    tokens_per_s: float


class KindJson(_KindBase, total=False):
    gbs: float                     # with a roofline: achieved, as shares of the roofs, and which binds
    gops: float
    bandwidth_share: float
    compute_share: float
    binds: str


class _BindingBase(TypedDict):
    kinds: dict[str, KindJson]     # "prefill", "decode": those with steps


class BindingJson(_BindingBase, total=False):
    dominant: str                  # the kind that takes most of the time, when there is one


class ExpertsJson(TypedDict):
    layers: int
    experts: int
    steps: int
    share: list[list[float]]       # [sparse layer][expert]
    read_mean: float
    read_max: int


class PercentilesJson(TypedDict):
    n: int
    p50: float
    p90: float
    p99: float


class WindowJson(TypedDict):
    latency: dict[str, PercentilesJson]     # ttft_ms, itl_ms, e2e_ms
    throughput: dict[str, float]            # prompt_tok_s, output_tok_s, busy (a share of the time)
    prefix_hit_rate: float | None
    binding: BindingJson
    experts: ExpertsJson | None


class EngineJson(TypedDict):
    running: int
    waiting: int
    blocks: int
    used: int
    cached: int
    free: int
    token_budget: int
    max_num_seqs: int
    state_slots: int                        # a hybrid's recurrent-state slots (0: none), those in use,
    state_used: int
    checkpoints: int                        # and its state checkpoints


class SnapshotJson(WindowJson):
    now: float
    seq: int
    steps: list[StepJson]
    finished: list[FinishedJson]
    live: list[RequestJson]
    engine: EngineJson
    window_s: float
    roofline: RooflineJson | None
