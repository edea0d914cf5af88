"""Chrome / Perfetto traces: one track of engine steps, one track per request.

Open the JSON file in https://ui.perfetto.dev or chrome://tracing. Times are the
engine's perf_counter stamps, shifted so the trace starts at 0.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from phasewise.core.request import RequestMetrics
from phasewise.engine.step_event import StepEvent

if TYPE_CHECKING:
    from phasewise.core.request import Request
    from phasewise.json_types import JsonObject, JsonValue
    from phasewise.outputs import StreamDelta

ENGINE_PID, REQUESTS_PID = 1, 2


def _span(name: str, pid: int, tid: int, start: float, end: float, t0: float,
          **args: JsonValue) -> JsonObject:
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": (start - t0) * 1e6,
            "dur": max(end - start, 0.0) * 1e6, "args": args}


def chrome_trace(steps: Iterable[StepEvent], requests: Iterable[tuple[str, RequestMetrics]]) -> JsonObject:
    """The trace as a dict: engine steps (prefill/decode tokens, batch size) and, per request,
    its queueing, prefill chunks, decode, and preemptions (instant events)."""
    steps, requests = list(steps), list(requests)
    starts = [s.record.start for s in steps] + [m.arrival for _, m in requests]
    t0 = min(starts, default=0.0)
    events: list[JsonValue] = [
        {"name": "process_name", "ph": "M", "pid": ENGINE_PID, "args": {"name": "engine steps"}},
        {"name": "process_name", "ph": "M", "pid": REQUESTS_PID, "args": {"name": "requests"}},
    ]
    for step in steps:
        s = step.record
        kind = "prefill" if s.num_decode_tokens == 0 else "decode" if s.num_prefill_tokens == 0 else "mixed"
        events.append(_span(f"step ({kind})", ENGINE_PID, 0, s.start, s.start + s.duration_ms / 1e3, t0,
                            prefill_tokens=s.num_prefill_tokens, decode_tokens=s.num_decode_tokens,
                            batch_size=s.batch_size, draft_tokens=s.num_draft_tokens,
                            accepted_tokens=s.num_accepted_tokens,
                            grammar_ms=step.extras.grammar_ms, threads=step.extras.threads))
    for tid, (rid, m) in enumerate(requests, start=1):
        events.append({"name": "thread_name", "ph": "M", "pid": REQUESTS_PID, "tid": tid,
                       "args": {"name": rid}})
        if m.first_scheduled is not None:
            events.append(_span("queued", REQUESTS_PID, tid, m.arrival, m.first_scheduled, t0))
        for start, end, n in m.prefill_chunks:
            events.append(_span("prefill chunk", REQUESTS_PID, tid, start, end, t0, tokens=n))
        if m.token_times:
            events.append(_span("decode", REQUESTS_PID, tid, m.token_times[0], m.token_times[-1], t0,
                                tokens=len(m.token_times) - 1))
        for t in m.preempted_at:
            events.append({"name": "preempted", "ph": "i", "s": "t", "pid": REQUESTS_PID, "tid": tid,
                           "ts": (t - t0) * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(path: str | Path, steps: Iterable[StepEvent],
                requests: Iterable[tuple[str, RequestMetrics]]) -> None:
    Path(path).write_text(json.dumps(chrome_trace(steps, requests)))


class RequestRecorder:
    """A server observer that keeps the metrics of the latest finished requests for a trace."""

    def __init__(self, max_requests: int = 100_000) -> None:
        self.requests: deque[tuple[str, RequestMetrics]] = deque(maxlen=max_requests)

    def on_add(self, request: Request) -> None:
        pass

    def on_step(self, step: StepEvent, stats: object) -> None:   # the server's ServerStats
        pass

    def on_delta(self, delta: StreamDelta) -> None:
        pass

    def on_finish(self, request: Request, reason: str) -> None:
        self.requests.append((request.request_id, request.metrics))
