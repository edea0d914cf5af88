"""The dashboard's feed (what the engine thread gathers, what a page is sent) and its routes on a live
server with an API key. The page itself is tested in a real browser: tests/browser/."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from live_server import KEY, QUESTION, MODEL, assert_openai_error
from phasewise.core.handoffs import EngineStats, StepRecord
from phasewise.engine.step_event import StepEvent, StepExtras, ThreadStats
from phasewise.server.server_stats import ServerStats
from phasewise.core.request import Request
from phasewise.core.sampling_params import SamplingParams
from phasewise.server.dashboard_feed import DashboardFeed, Roofline, binding

ROOF = Roofline(dram_gbs=20.0, compute_gops=400.0, compute_name="int8 dot products", weight_bytes=1e8,
                flops_per_token=2e8, head_flops=0.0)


def _step(t: float, ms: float, prefill: int, decode: int, batch: int = 1) -> dict:
    return {"t": t, "ms": ms, "prefill": prefill, "decode": decode, "batch": batch, "draft": 0, "accepted": 0}


def test_binding_says_decode_reads_weights_and_prefill_computes():
    """A decode step of 4 tokens in 10 ms reads 1e8 bytes: 10 GB/s, half of DRAM, against 80 GOP/s,
    a fifth of the compute roof. A 512-token prefill step in 500 ms: 0.2 GB/s, 205 GOP/s (51%)."""
    steps = [_step(0.0, 10.0, 0, 4), _step(0.01, 10.0, 0, 4), _step(0.02, 500.0, 512, 0)]
    out = binding(steps, ROOF)
    dec, pre = out["kinds"]["decode"], out["kinds"]["prefill"]
    assert dec["gbs"] == pytest.approx(10.0) and dec["gops"] == pytest.approx(80.0)
    assert dec["binds"] == "memory bandwidth" and dec["bandwidth_share"] == pytest.approx(0.5)
    assert pre["gops"] == pytest.approx(204.8) and pre["binds"] == "compute"
    assert pre["time_share"] == pytest.approx(500 / 520) and out["dominant"] == "prefill"
    slow = binding([_step(0.0, 100.0, 0, 4)], ROOF)["kinds"]["decode"]     # 1 GB/s, 8 GOP/s: 5% and 2%
    assert slow["binds"] == "neither roof" and slow["bandwidth_share"] == pytest.approx(0.05)
    bare = binding(steps, None)["kinds"]["decode"]
    assert "binds" not in bare and bare["tokens_per_s"] == pytest.approx(400.0)
    assert binding([], ROOF) == {"kinds": {}}


def _delta(request: Request, n: int, prompt_tokens: int, cached: int, finished: bool = False):
    output = SimpleNamespace(metrics=request.metrics, prompt_token_ids=[0] * prompt_tokens, cached_tokens=cached)
    return SimpleNamespace(request_id=request.request_id, token_ids=[1] * n, finished=finished, output=output)


def _stats(used: int, running: int, threads: ThreadStats | None = None) -> ServerStats:
    return ServerStats(engine=EngineStats(num_running=running, num_blocks=100, num_free_blocks=100 - used,
                                          num_cached_blocks=used), threads=threads or ThreadStats())


def _event(record: StepRecord, **extras: Any) -> StepEvent:
    return StepEvent(record, StepExtras(**extras))


def test_feed_sends_what_is_new_since_the_cursor_and_every_live_request():
    clock = [10.0]
    feed = DashboardFeed(token_budget=64, max_num_seqs=4, num_blocks=100, roofline=ROOF, clock=lambda: clock[0])
    a, b = Request("a", [1] * 8, SamplingParams(), arrival=9.0), Request("b", [1] * 8, SamplingParams(), arrival=9.5)
    feed.on_add(a)
    feed.on_add(b)
    a.metrics.first_scheduled, a.num_cached_tokens = 9.1, 4
    a.metrics.prefill_chunks.append((9.1, 9.2, 8))
    a.metrics.first_token = 9.2
    a.metrics.token_times += [9.2]
    feed.on_step(_event(StepRecord(start=9.1, duration_ms=100.0, num_prefill_tokens=8, num_decode_tokens=0,
                                  batch_size=1)), _stats(2, 1))
    feed.on_delta(_delta(a, 1, 8, 4))
    first = feed.snapshot(0, _stats(2, 1))
    assert [s["prefill"] for s in first["steps"]] == [8] and first["finished"] == []
    assert {r["id"] for r in first["live"]} == {"a", "b"}
    live_a = next(r for r in first["live"] if r["id"] == "a")
    assert live_a["chunks"] == [[9.1, 9.2, 8]] and live_a["reason"] is None and live_a["cached_tokens"] == 4
    assert first["engine"]["used"] == 2 and first["engine"]["token_budget"] == 64
    assert first["prefix_hit_rate"] == pytest.approx(0.5)

    a.metrics.token_times += [9.25, 9.35]          # two more tokens: gaps of 50 and 100 ms
    a.metrics.grammar_compile_ms = 1.5             # a structured output: its grammar's cost shows
    feed.on_step(_event(StepRecord(start=9.3, duration_ms=50.0, num_prefill_tokens=0, num_decode_tokens=2,
                                  batch_size=1), grammar_ms=0.25, threads=1),
                 _stats(2, 1, ThreadStats(threads=1, cpus_busy_elsewhere=0.93)))
    feed.on_delta(_delta(a, 2, 8, 4))
    a.metrics.finished = 9.35
    feed.on_finish(a, "length")
    clock[0] = 10.5                                # past the half-second cache of the windowed figures
    second = feed.snapshot(first["seq"], _stats(0, 0))
    assert [(s["decode"], s["grammar_ms"], s["threads"], s["others"]) for s in second["steps"]] == [(2, 0.25, 1, 0.93)]
    assert second["finished"][0]["grammar_compile_ms"] == 1.5
    assert [(r["id"], r["reason"], r["tokens"]) for r in second["finished"]] == [("a", "length", 3)]
    assert second["finished"][0]["itl_mean_ms"] == pytest.approx(75.0)
    assert second["finished"][0]["itl_max_ms"] == pytest.approx(100.0)
    assert [r["id"] for r in second["live"]] == ["b"] and second["engine"]["used"] == 0
    lat = second["latency"]
    assert lat["itl_ms"]["n"] == 2 and lat["itl_ms"]["p50"] == pytest.approx(75.0)
    assert lat["ttft_ms"]["n"] == 1 and lat["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert lat["e2e_ms"]["p99"] == pytest.approx(350.0)
    assert second["binding"]["kinds"]["decode"]["binds"] == "neither roof"      # 2 GB/s: 10% of DRAM
    assert feed.snapshot(second["seq"], _stats(0, 0))["steps"] == []

    clock[0] = 100.0                               # a minute later, the window has emptied
    late = feed.snapshot(second["seq"], _stats(0, 0))
    assert late["latency"]["itl_ms"]["n"] == 0 and late["throughput"]["output_tok_s"] == 0.0


def test_a_request_that_thinks_shows_its_thinking_phase():
    from phasewise.server.dashboard_feed import request_summary

    r = Request("t", [1] * 8, SamplingParams(), arrival=9.0)
    m = r.metrics
    m.first_scheduled, m.first_token, m.token_times = 9.1, 9.2, [9.2, 9.3, 9.4, 9.5]
    m.thinking_tracked, m.thinking_tokens = True, 2
    live = request_summary(r, None)
    assert (live["thinking_tokens"], live["answer_at"], live["ttfa_ms"]) == (2, None, None)   # still thinking
    m.answer_start = 3                                       # two thinking tokens, a closing one, the answer
    done = request_summary(r, "stop")
    assert done["answer_at"] == 9.5 and done["ttfa_ms"] == pytest.approx(500.0)
    plain = request_summary(Request("p", [1] * 8, SamplingParams(), arrival=9.0), None)
    assert (plain["thinking_tokens"], plain["answer_at"], plain["ttfa_ms"]) == (0, None, None)


def test_the_experts_spread_is_each_layers_share_over_the_last_seconds():
    """Two sparse layers of four experts: the recent steps' choices summed per layer into shares, how
    many experts a step read; older steps and dense models (no choices) leave it out."""
    clock = [20.0]
    feed = DashboardFeed(token_budget=64, max_num_seqs=4, num_blocks=100, clock=lambda: clock[0])
    dense = StepRecord(start=10.0, duration_ms=5.0, num_prefill_tokens=0, num_decode_tokens=1, batch_size=1)
    feed.on_step(_event(dense), _stats(1, 1))
    assert feed.snapshot(0, _stats(1, 1))["experts"] is None
    old = _event(replace(dense, start=12.0), expert_choices=[[0, 0, 0, 9], [9, 0, 0, 0]])   # over 5 s before now
    feed.on_step(old, _stats(1, 1))
    feed.on_step(_event(replace(dense, start=18.0), expert_choices=[[2, 0, 0, 0], [1, 1, 0, 0]]), _stats(1, 1))
    feed.on_step(_event(replace(dense, start=19.0), expert_choices=[[1, 1, 0, 0], [0, 1, 0, 1]]), _stats(1, 1))
    clock[0] = 21.0
    snap = feed.snapshot(0, _stats(1, 1))
    assert [s.get("experts_read") for s in snap["steps"]] == [None, 2, 3, 4]
    e = snap["experts"]
    assert (e["layers"], e["experts"], e["steps"], e["read_max"]) == (2, 4, 2, 4)
    assert e["share"] == [[0.75, 0.25, 0.0, 0.0], [0.25, 0.5, 0.0, 0.25]] and e["read_mean"] == 3.5


# ---- on a live server (an API key) ----------------------------------------------------------------


def _snapshots(url: str, headers: dict, after: int = 0):
    with httpx.stream("GET", url + f"/dashboard/events?after={after}", headers=headers, timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        event = None
        for line in resp.iter_lines():
            if line.startswith("event: "):
                event = line[len("event: "):]
            elif line.startswith("data: "):
                yield event or "message", json.loads(line[len("data: "):])
                event = None


@pytest.mark.slow
def test_dashboard_routes_and_the_key_rule(guarded):
    page = httpx.get(guarded.url + "/dashboard")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    for name in ("dashboard.js", "charts.js", "files.js", "dashboard.css"):
        assert f"/dashboard/{name}" in page.text
        assert httpx.get(guarded.url + f"/dashboard/{name}").status_code == 200
    assert_openai_error(httpx.get(guarded.url + "/dashboard/nothing.js"), 404, "no such file")
    assert_openai_error(httpx.get(guarded.url + "/dashboard/events"), 401, "API key")
    assert_openai_error(httpx.get(guarded.url + "/dashboard/events",
                                  headers={"Authorization": "Bearer wrong"}), 401)
    key = {"Authorization": f"Bearer {KEY}"}
    for every in ("0.1", "100", "nan"):                   # the page's refresh: 0.5 to 60 s
        assert_openai_error(httpx.get(guarded.url + f"/dashboard/events?every={every}", headers=key), 400, "every")
    with httpx.stream("GET", guarded.url + "/dashboard/events?every=5", headers=key, timeout=60) as resp:
        hello = json.loads(next(line for line in resp.iter_lines() if line.startswith("data: "))[len("data: "):])
    assert hello["interval_s"] == 5


@pytest.mark.slow
def test_dashboard_events_follow_a_request_to_its_end(guarded):
    headers = {"Authorization": f"Bearer {KEY}"}
    events = _snapshots(guarded.url, headers)
    kind, hello = next(events)
    assert kind == "hello" and hello["model"] == MODEL
    cursor = next(events)[1]["seq"]
    out = guarded.client(KEY).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8)
    found, steps = None, []
    for i, (kind, snap) in enumerate(_snapshots(guarded.url, headers, cursor)):
        if kind == "hello":
            continue
        steps += snap["steps"]
        found = next((r for r in snap["finished"] if r["id"].startswith(out.id)), found)
        # the windowed figures are shared by every open page and refreshed twice a second
        if (found is not None and snap["engine"]["running"] == 0 and snap["latency"]["ttft_ms"]["n"]) or i > 40:
            break
    assert found["reason"] == out.choices[0].finish_reason and found["tokens"] == out.usage.completion_tokens
    assert found["ttft_ms"] > 0 and found["chunks"] and found["prompt_tokens"] == out.usage.prompt_tokens
    assert snap["engine"]["used"] == 0 and snap["latency"]["ttft_ms"]["n"] >= 1
    # every step the request ran, since the cursor: its prompt, then a decode token per step
    assert sum(s["prefill"] for s in steps) >= out.usage.prompt_tokens - found["cached_tokens"]
    assert sum(s["decode"] for s in steps) >= out.usage.completion_tokens - 1
