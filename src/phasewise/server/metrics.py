"""Prometheus metrics of one server: a registry per app (never the global one).

Token and latency figures are observed on the engine thread as tokens are
produced (prometheus_client is thread-safe); the gauges are set from the engine's
published snapshot when /metrics is scraped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
    disable_created_metrics, generate_latest)
from prometheus_client.core import CounterMetricFamily

from phasewise.outputs import StreamDelta
from phasewise.core.request import Request
from phasewise.engine.step_event import StepEvent
from phasewise.server.observer import Observer
from phasewise.server.server_stats import ServerStats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
GRAMMAR_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0, 5.0)
REQUEST_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


Read = Callable[[ServerStats], float]


def _disk(field: str) -> Read:
    """A DiskStats counter (0 without a disk tier)."""
    return lambda s: getattr(s.engine.disk, field) if s.engine.disk is not None else 0


# The engine's own totals, read at each scrape: (name, help, a label's name or None, (label value, read)...)
ENGINE_COUNTERS: tuple[tuple[str, str, str | None, tuple[tuple[str, Read], ...]], ...] = (
    ("phasewise:spec_decode_num_drafts", "Speculative decoding: request-steps that verified draft tokens.",
     None, (("", lambda s: s.engine.spec_num_drafts),)),
    ("phasewise:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens proposed and verified.",
     None, (("", lambda s: s.engine.spec_num_draft_tokens),)),
    ("phasewise:spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted by the target "
     "(acceptance rate = accepted / draft tokens; mean accepted length = 1 + accepted / drafts).",
     None, (("", lambda s: s.engine.spec_num_accepted_tokens),)),
    ("phasewise:cpu_wait_seconds", "Time the engine's threads were runnable but waited for a CPU (other "
     "programs taking cores; Linux run-queue delay).", None, (("", lambda s: s.threads.cpu_wait_seconds),)),
    # the prefix cache in RAM, since the start
    ("phasewise:prompt_cache_ram_hit_blocks", "KV blocks admitted requests took from the prefix cache in RAM "
     "(those the disk tier had just loaded for them count as disk hits).", None,
     (("", lambda s: s.engine.ram.hit_blocks),)),
    ("phasewise:prompt_cache_ram_hit_bytes", "Bytes of those blocks.", None,
     (("", lambda s: s.engine.ram.hit_blocks * s.kv_block_bytes),)),
    ("phasewise:prompt_cache_ram_evictions",
     "KV blocks the prefix cache in RAM dropped to reuse them for new KV: "
     "cause=lru, unmarked blocks, least recently freed first; cause=ttl, cache_control blocks whose TTL had "
     "passed (dropped before those); cause=kept, cache_control blocks within their TTL (no other free block "
     "was left).", "cause", (("lru", lambda s: s.engine.ram.evicted_lru),
                             ("ttl", lambda s: s.engine.ram.evicted_ttl),
                             ("kept", lambda s: s.engine.ram.evicted_kept))),
    # the prefix cache's disk tier (--prompt-cache-dir), since the start (0 without it)
    ("phasewise:prompt_cache_disk_hit_blocks", "KV blocks loaded from the prompt cache's disk tier.",
     None, (("", _disk("blocks_read")),)),
    ("phasewise:prompt_cache_disk_read_bytes", "Bytes loaded from the disk tier.", None,
     (("", _disk("bytes_read")),)),
    ("phasewise:prompt_cache_disk_load_seconds",
     "Time spent loading blocks found on the disk tier (a phase of "
     "the requests' prefill).", None, (("", _disk("load_seconds")),)),
    ("phasewise:prompt_cache_disk_written_blocks",
     "KV blocks (and recurrent states) written to the disk tier.",
     None, (("", _disk("blocks_written")),)),
    ("phasewise:prompt_cache_disk_written_bytes", "Bytes written to the disk tier.",
     None, (("", _disk("bytes_written")),)),
    ("phasewise:prompt_cache_disk_evictions", "Disk-tier entries removed by sweeps: cause=ttl, their TTL had "
     "passed; cause=size, least recently used first, to fit --prompt-cache-size.",
     "cause", (("ttl", _disk("evicted_ttl")), ("size", _disk("evicted_lru")))),
    ("phasewise:prompt_cache_disk_errors", "Disk-tier failures, each costing the cache only: kind=write, a "
     "write that failed (full disk, unwritable directory); kind=corrupt, a file that did not check out "
     "(removed, its block computed again); kind=dropped, a copy dropped with the writer too far behind.",
     "kind",
     (("write", _disk("write_errors")), ("corrupt", _disk("corrupt")), ("dropped", _disk("dropped")))),
)


class _EngineCollector:
    """Counters that mirror the engine's own totals (speculative decoding, CPU waits, the prompt cache in RAM
    and on disk) from the latest snapshot."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats = ServerStats()

    def collect(self) -> Iterator[CounterMetricFamily]:
        for name, doc, label, rows in ENGINE_COUNTERS:
            c = CounterMetricFamily(name, doc, labels=["model_name", *([label] if label else [])])
            for value, read in rows:
                c.add_metric([self.model_name, *([value] if label else [])], read(self.stats))
            yield c


# The engine's state at a scrape: (name, help, its value in ServerStats)
ENGINE_GAUGES: tuple[tuple[str, str, Read], ...] = (
    ("phasewise:num_requests_waiting", "Requests waiting to be scheduled.", lambda s: s.engine.num_waiting),
    ("phasewise:num_requests_running", "Requests running (holding KV blocks).",
     lambda s: s.engine.num_running),
    ("phasewise:kv_cache_usage_perc", "KV-cache usage: blocks referenced by requests / total blocks (0..1).",
     lambda s: s.engine.kv_usage),
    ("phasewise:kv_cache_free_blocks", "KV blocks no request references (free, or cached for prefix reuse).",
     lambda s: s.engine.num_free_blocks),
    ("phasewise:kv_cache_total_blocks", "KV blocks in the pool.", lambda s: s.engine.num_blocks),
    ("phasewise:kv_cache_cached_blocks", "KV blocks registered in the prefix cache (referenced or not).",
     lambda s: s.engine.num_cached_blocks),
    ("phasewise:prompt_cache_ram_bytes", "Bytes of the KV blocks registered in the prefix cache in RAM.",
     lambda s: s.engine.num_cached_blocks * s.kv_block_bytes),
    ("phasewise:recurrent_state_slots", "A hybrid's recurrent-state slots for running requests (fixed bytes "
     "each, whatever the context).", lambda s: s.engine.num_state_slots),
    ("phasewise:recurrent_state_slots_used", "Recurrent-state slots held by running requests.",
     lambda s: s.engine.num_state_slots - s.engine.num_free_state_slots),
    ("phasewise:recurrent_state_checkpoints", "Recurrent-state checkpoints kept for prefix-cache hits.",
     lambda s: s.engine.num_state_checkpoints),
    ("phasewise:threads", "Threads running the model's kernels (fewer while other programs keep cores busy, "
     "unless --threads pins them).", lambda s: s.threads.threads),
    ("phasewise:cpus_busy_elsewhere", "CPUs (of those the engine may use) other programs kept busy lately.",
     lambda s: s.threads.cpus_busy_elsewhere),
)


class ServerMetrics(Observer):
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str) -> None:
        disable_created_metrics()              # no *_created series: they only add noise to a scrape
        self.registry = r = CollectorRegistry()
        labels, values = ["model_name"], [model_name]

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(*values)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(*values)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(*values)

        self.ttft = histogram("phasewise:time_to_first_token_seconds",
                              "Time to first token: arrival to the first output token.", LATENCY_BUCKETS)
        self.ttfa = histogram("phasewise:time_to_first_answer_token_seconds",
                              "Time to the first answer token: arrival to the first output token after the "
                              "thinking (the first token of a reply that does not think).", REQUEST_BUCKETS)
        self.thinking = histogram("phasewise:thinking_time_seconds",
                                  "Thinking time of replies that thought: first token to the end of the "
                                  "thinking block (or the reply's end).", REQUEST_BUCKETS)
        self.itl = histogram("phasewise:inter_token_latency_seconds",
                             "Gap between consecutive output tokens of a request.", LATENCY_BUCKETS)
        self.e2e = histogram("phasewise:e2e_request_latency_seconds",
                             "End-to-end request latency: arrival to finish (or abort).", REQUEST_BUCKETS)
        self.queue = histogram("phasewise:request_queue_time_seconds",
                               "Time a request waited before it was first scheduled.", REQUEST_BUCKETS)
        self.engine_gauges = [(gauge(name, doc), read) for name, doc, read in ENGINE_GAUGES]
        self.prompt_tokens = counter("phasewise:prompt_tokens", "Prompt tokens of requests that reached "
                                     "their first token (cache hits included).")
        self.generation_tokens = counter("phasewise:generation_tokens", "Output tokens generated.")
        self.prefix_cache_hits = counter("phasewise:prefix_cache_hit_tokens",
                                         "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("phasewise:num_preemptions", "Preemptions (a request's KV freed and "
                                   "recomputed later), counted when the request ends.")
        finished = Counter("phasewise:requests_finished", "Finished requests by finish reason (abort: the "
                           "client went away; error: the engine failed).",
                           ["model_name", "finished_reason"], registry=r)
        self.finished = {reason: finished.labels(model_name, reason) for reason in FINISH_REASONS}
        self.structured = counter("phasewise:structured_output_requests",
                                  "Requests under a grammar (structured outputs, forced tool calls).")
        self.grammar_compile = histogram("phasewise:grammar_compile_seconds",
                                         "Compiling a request's grammar (a cached one: "
                                         "copying it).", GRAMMAR_BUCKETS)
        self.grammar_mask = histogram("phasewise:grammar_mask_seconds",
                                      "A step's grammar masks (steps with constrained "
                                      "requests).", GRAMMAR_BUCKETS)
        self.totals = _EngineCollector(model_name)
        r.register(self.totals)

    # ---- Observer: called on the engine thread -------------------------------------------------

    def on_add(self, request: Request) -> None:
        if request.sampling_params.structured_outputs is not None:
            self.structured.inc()
            self.grammar_compile.observe((request.metrics.grammar_compile_ms or 0.0) / 1e3)

    def on_step(self, step: StepEvent, stats: ServerStats) -> None:
        if step.extras.grammar_ms:
            self.grammar_mask.observe(step.extras.grammar_ms / 1e3)

    def on_delta(self, delta: StreamDelta) -> None:
        n = len(delta.token_ids)
        if n:
            self.generation_tokens.inc(n)
        m = delta.output.metrics
        times = m.token_times
        if not n:
            if delta.finished and not times:   # max_tokens 0 (the prompt only): its prompt still ran
                self.prompt_tokens.inc(len(delta.output.prompt_token_ids))
                self.prefix_cache_hits.inc(delta.output.cached_tokens)
            return
        first = len(times) - n                 # index of the delta's first token
        if first == 0:                         # the first token: prefill is over
            self.ttft.observe(m.ttft_ms / 1e3)
            self.queue.observe(m.queue_ms / 1e3)
            self.prompt_tokens.inc(len(delta.output.prompt_token_ids))
            self.prefix_cache_hits.inc(delta.output.cached_tokens)
        for i in range(max(first, 1), len(times)):   # every gap (accepted drafts share their step's time)
            self.itl.observe(times[i] - times[i - 1])
        answer = m.answer_start if m.thinking_tracked else 0
        if answer is not None and first <= answer < len(times):   # the answer's first token came
            self.ttfa.observe(_seconds(m.ttfa_ms))

    def on_finish(self, request: Request, reason: str) -> None:
        m = request.metrics
        if m.finished is not None:
            self.e2e.observe(m.e2e_ms / 1e3)
        if m.preemptions:
            self.preemptions.inc(m.preemptions)
        if m.thinking_tokens:
            self.thinking.observe(m.thinking_ms / 1e3)
        self.finished.get(reason, self.finished["error"]).inc()

    # ---- the scrape -------------------------------------------------------------------

    def render(self, stats: ServerStats) -> bytes:
        for gauge, read in self.engine_gauges:
            gauge.set(read(stats))
        self.totals.stats = stats
        return generate_latest(self.registry)


def _seconds(ms: float | None) -> float:
    return (ms or 0.0) / 1e3
