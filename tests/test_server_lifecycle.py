"""Nothing lost or leaked: clients that leave, slow consumers, a failing step, a dead engine thread,
SIGTERM; the engine built on its own thread; the serve trace.

No timed assertions: every wait is bounded, none is measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time
from typing import Any

import httpx
import pytest

from live_server import MODEL, assert_openai_error, start_server, stop_server

pytestmark = pytest.mark.slow

def test_disconnected_streams_are_aborted_and_free_their_blocks(server):
    before = server.metrics()
    with httpx.Client(timeout=120) as client, contextlib.ExitStack() as stack:
        responses = []
        for i in range(8):
            body = {"model": MODEL, "prompt": f"Story number {i}: once upon a time", "max_tokens": 400,
                    "ignore_eos": True, "stream": True}
            responses.append(stack.enter_context(client.stream("POST", server.url + "/v1/completions", json=body)))
        for resp in responses:            # each one is mid-way: it has produced tokens
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = 0
            while got < 2:
                got += next(lines).startswith("data: ")
        assert server.metrics()["phasewise:num_requests_running"] >= 1
    # the connections are closed: every request must be aborted, every block back
    deadline = time.monotonic() + 60
    while True:
        m = server.metrics()
        done = (m["phasewise:num_requests_running"] == 0 and m["phasewise:num_requests_waiting"] == 0
                and m["phasewise:kv_cache_free_blocks"] == m["phasewise:kv_cache_total_blocks"])
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert done, m
    assert m["phasewise:kv_cache_usage_perc"] == 0
    aborted = 'phasewise:requests_finished_total{finished_reason="abort",model_name="%s"}' % MODEL
    assert m[aborted] - before.get(aborted, 0) == 8
    assert m["phasewise:generation_tokens_total"] - before["phasewise:generation_tokens_total"] < 8 * 400


def test_a_non_streaming_client_that_leaves_aborts_its_request(server):
    aborted = 'phasewise:requests_finished_total{finished_reason="abort",model_name="%s"}' % MODEL
    before = server.metrics().get(aborted, 0)
    with pytest.raises(httpx.TimeoutException):     # gives up long before 5000 tokens are generated
        httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 5000,
                                                          "ignore_eos": True}, timeout=3)
    deadline = time.monotonic() + 60
    while server.metrics().get(aborted, 0) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    m = server.metrics()
    assert m[aborted] == before + 1 and m["phasewise:num_requests_running"] == 0


# ---- AsyncEngine in process (the session's engine, handed back clean) --------------------------------

def test_async_engine_survives_a_failed_step_and_aborts_on_early_exit(llm, monkeypatch):
    from phasewise import SamplingParams
    from phasewise.server import AsyncEngine, EngineError, SubRequest

    engine = llm.engine
    pool = engine.core.kv.pool
    runner = engine.core.runner
    real_execute = runner.execute
    calls = {"n": 0}

    def flaky(sched):
        calls["n"] += 1
        if calls["n"] == 2:                   # the second step of the first request fails
            raise RuntimeError("injected failure")
        return real_execute(sched)

    monkeypatch.setattr(runner, "execute", flaky)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def scenario() -> None:
        async_engine = AsyncEngine(engine)
        try:
            with pytest.raises(EngineError, match="injected failure"):
                async for _ in async_engine.generate("Hello", params):
                    pass
            deltas = [d async for d in async_engine.generate("Hello", params)]   # the thread lives on
            assert deltas[-1].finished and len(deltas[-1].output.token_ids) == 6
            with pytest.raises(ValueError, match="8192"):
                await async_engine.submit([SubRequest("too-long", "Hello", SamplingParams(max_tokens=9000))])
            long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            async for _ in async_engine.generate("Hello", long):
                break                         # the consumer leaves: the request is aborted
            for _ in range(200):
                if not engine.has_unfinished() and async_engine.stats.engine.num_running == 0:
                    break
                await asyncio.sleep(0.05)
            assert not engine.has_unfinished()
            assert await async_engine.call(lambda e: e.core.kv.pool.num_free) == pool.num_blocks
        finally:
            async_engine.shutdown()

    asyncio.run(scenario())
    assert not async_engine_thread_alive()
    assert pool.num_free == pool.num_blocks and not engine.has_unfinished()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")   # the thread dies, as injected
def test_a_dead_engine_thread_fails_health_and_answers_503_at_once(llm):
    """A bug that kills the engine thread while it handles a request: that request gets an error
    (it does not hang), /health says 503, and a new request gets 503 without waiting."""
    from phasewise.server import AsyncEngine, ServerConfig, create_app

    async def scenario() -> None:
        async_engine = AsyncEngine(llm.engine)
        app = create_app(async_engine, ServerConfig(served_model_name="m"))

        def broken(command) -> None:
            raise RuntimeError("injected bug in the engine loop")

        async_engine._handle = broken
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
                body = {"model": "m", "prompt": "Hello", "max_tokens": 4}
                first = await asyncio.wait_for(client.post("/v1/completions", json=body), 30)
                assert first.status_code == 503 and assert_openai_error(first, 503)["code"] == "engine_dead"
                assert (await client.get("/health")).status_code == 503
                again = await asyncio.wait_for(client.post("/v1/completions", json=body), 5)
                assert again.status_code == 503
        finally:
            async_engine.shutdown()

    asyncio.run(scenario())
    assert not async_engine_thread_alive()
    assert not llm.engine.has_unfinished()


def test_sigterm_lets_running_streams_finish_then_exits_0(tmp_path):
    """SIGTERM while a stream runs: no new connection is accepted, the stream gets all its tokens and
    [DONE], and the process exits 0."""
    s = start_server(tmp_path, "--shutdown-timeout", "60")
    try:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=120) as resp:
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            s.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        events = [json.loads(line[6:]) for line in [first, *rest[:-1]]]
        assert rest[-1] == "data: [DONE]"
        assert events[-1]["usage"]["completion_tokens"] == 200
        assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
        assert s.proc.wait(60) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(s.url + "/health", timeout=5)
    finally:
        stop_server(s)
    assert "Traceback" not in s.log.read_text(), s.log.read_text()


def async_engine_thread_alive() -> bool:
    return any(t.name == "phasewise-engine" and t.is_alive() for t in threading.enumerate())


@pytest.mark.slow
def test_serve_trace_holds_the_steps_and_every_finished_request(tmp_path):
    trace = tmp_path / "serve.json"
    s = start_server(tmp_path, "--trace", str(trace))
    try:
        for _ in range(2):
            s.client().completions.create(model=MODEL, prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True})
    finally:
        stop_server(s)
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = [e for e in events if e["name"] == "thread_name"]
    assert len(tracks) == 2
    decode = [e for e in events if e["name"] == "decode"]
    assert [e["args"]["tokens"] for e in decode] == [2, 2]
    assert any(e["name"].startswith("step") for e in events)
    assert "wrote the trace of 2 requests" in s.log.read_text()


# ---- phasewise bench serve against this server ------------------------------------------------------


def test_an_engine_given_as_a_function_is_built_on_the_engine_thread(llm):
    """The server builds its engine on the thread that steps it (one OpenMP pool); what building
    raises comes out of the constructor, and no thread is left behind."""
    from phasewise.server import AsyncEngine

    where = []

    def build():
        where.append(threading.current_thread().name)
        return llm.engine

    async_engine = AsyncEngine(build)
    try:
        assert where == ["phasewise-engine"] and async_engine.engine is llm.engine
        assert async_engine.max_num_seqs == llm.engine.core.scheduler.config.max_num_seqs
    finally:
        async_engine.shutdown()

    def broken():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine(broken)
    assert not async_engine_thread_alive()


def test_a_stream_nobody_reads_is_aborted_and_a_queued_request_that_leaves_never_runs(llm, monkeypatch):
    """A consumer that stops reading (a client that no longer reads its socket) holds at most
    max_pending chunks: then its request is aborted and its blocks freed, while another stream runs
    on; a consumer that comes back reads what was held, then the error. A request closed while it
    waits for a seat is taken out of the queue and never scheduled."""
    import dataclasses

    from phasewise import SamplingParams
    from phasewise.server import AsyncEngine, SubRequest
    from phasewise.server.errors import SlowClientError
    from phasewise.server.observer import Observer

    finished: dict[str, tuple[Any, str]] = {}

    class Record(Observer):
        def on_finish(self, request, reason: str) -> None:
            finished[request.request_id] = (request, reason)

    long = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)    # outlives 30 + 8 steps
    pool = llm.engine.core.kv.pool

    async def scenario() -> None:
        engine = AsyncEngine(llm.engine, Record(), max_pending=8)
        try:
            idle = await engine.submit([SubRequest("idle", "Hello", long)])
            read = [d async for d in engine.generate("Hello", SamplingParams(temperature=0, max_tokens=30,
                                                                             ignore_eos=True))]
            assert read[-1].finished and len(read[-1].output.token_ids) == 30
            got = []
            with pytest.raises(SlowClientError):
                async for d in idle:
                    got.append(d)
            assert len(got) == 8 and finished["idle"][1] == "abort"
            assert len(finished["idle"][0].output_token_ids) < 30
            scheduler = llm.engine.core.scheduler
            monkeypatch.setattr(scheduler, "config", dataclasses.replace(scheduler.config, max_num_seqs=1))
            first = await engine.submit([SubRequest("first", "Hello", long)])
            queued = await engine.submit([SubRequest("queued", "Hello", long)])
            queued.close()                      # its client went away while it waited for the one seat
            async for d in first:
                pass
            request, reason = finished["queued"]
            assert reason == "abort" and request.metrics.first_scheduled is None and not request.output_token_ids
            for _ in range(100):
                if engine.stats.engine.num_running == engine.stats.engine.num_waiting == 0:
                    break
                await asyncio.sleep(0.05)
            assert await engine.call(lambda e: e.stats().num_free_blocks) == pool.num_blocks
        finally:
            engine.shutdown()

    asyncio.run(scenario())
    assert not async_engine_thread_alive() and not llm.engine.has_unfinished()
