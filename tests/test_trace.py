"""Chrome traces built from hand-made timelines."""

from __future__ import annotations

from phasewise.core.handoffs import StepRecord
from phasewise.core.request import RequestMetrics
from phasewise.engine.step_event import StepEvent, StepExtras
from phasewise.lab.trace import REQUESTS_PID, chrome_trace


def test_trace_of_a_preempted_request():
    m = RequestMetrics(arrival=10.0, first_scheduled=10.5, first_token=11.0, token_times=[11.0, 11.1, 11.3],
                       prefill_chunks=[(10.5, 10.7, 8), (10.8, 11.0, 4)], preempted_at=[11.15], finished=11.3)
    steps = [StepEvent(StepRecord(start=10.5, duration_ms=200.0, num_prefill_tokens=8, num_decode_tokens=0,
                                  batch_size=1), StepExtras()),
             StepEvent(StepRecord(start=10.8, duration_ms=200.0, num_prefill_tokens=4, num_decode_tokens=2,
                                  batch_size=3), StepExtras(grammar_ms=1.5, threads=2))]
    events = chrome_trace(steps, [("r1", m)])["traceEvents"]
    spans = {(e["name"], round(e["ts"]), round(e["dur"])) for e in events if e["ph"] == "X"}
    assert ("queued", 0, 500_000) in spans
    assert ("step (prefill)", 500_000, 200_000) in spans
    assert ("step (mixed)", 800_000, 200_000) in spans
    mixed = next(e for e in events if e["name"] == "step (mixed)")
    assert (mixed["args"]["grammar_ms"], mixed["args"]["threads"]) == (1.5, 2)   # the runner's part
    assert ("decode", 1_000_000, 300_000) in spans
    chunks = [e for e in events if e["name"] == "prefill chunk"]
    assert [c["args"]["tokens"] for c in chunks] == [8, 4] and all(c["pid"] == REQUESTS_PID for c in chunks)
    (pre,) = [e for e in events if e["name"] == "preempted"]
    assert round(pre["ts"]) == 1_150_000 and m.preemptions == 1
