"""Prefill/decode disaggregation on 127.0.0.1: a prefill and a decode instance joined by their KV
link (torch.distributed, gloo), a proxy in front, driven through the official openai client;
then the prefill instance dies, and in a second pair the decode instance."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
from live_server import STARTUP_TIMEOUT, Server, free_port, stop_server

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Explain in detail how a bicycle works."}]


def _start(log_dir, name: str, *args: str) -> Server:
    port = free_port()
    log = log_dir / f"{name}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "phasewise.cli", "serve", "--host", "127.0.0.1", "--port",
                                 str(port), "--no-access-log", *args], stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return Server(proc, f"http://127.0.0.1:{port}", log)


def _healthy(*servers: Server) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT
    for s in servers:
        while True:
            if s.proc.poll() is not None:
                pytest.fail(f"{s.log.name} exited:\n{s.log.read_text()}")
            try:
                if httpx.get(s.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"{s.log.name} never became healthy:\n{s.log.read_text()}")
            time.sleep(0.5)


def _start_pair(logs) -> tuple[Server, Server, Server]:
    """Both instances at fp32 (the session's reference engine's precision), one thread each."""
    peer = f"tcp://127.0.0.1:{free_port()}"
    engine = ("--dtype", "fp32", "--kv-dtype", "model", "--kv-cache-memory", "0.1", "--threads", "1")
    decode = _start(logs, "decode", "--role", "decode", "--kv-peer", peer, *engine)
    prefill = _start(logs, "prefill", "--role", "prefill", "--kv-peer", peer, *engine)
    proxy = _start(logs, "proxy", "--role", "proxy", "--prefill", prefill.url, "--decode", decode.url)
    _healthy(prefill, decode, proxy)
    return prefill, decode, proxy


def _stop_pair(servers: tuple[Server, Server, Server]) -> None:
    for s in reversed(servers):
        if s.proc.poll() is None:
            stop_server(s)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    servers = _start_pair(tmp_path_factory.mktemp("pair"))
    yield servers
    _stop_pair(servers)
    assert "Traceback" not in servers[1].log.read_text(), servers[1].log.read_text()


def test_the_pair_answers_as_one_server_does(pair, llm):
    from phasewise.core.sampling_params import SamplingParams

    prefill, decode, proxy = pair
    ref = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=16)).text
    client = proxy.client()
    model = client.models.list().data[0].id
    out = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0)
    assert out.choices[0].message.content == ref
    assert out.usage.prompt_tokens_details.cached_tokens == 32        # the prompt's 2 whole blocks arrived
    chunks = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref
    text = client.completions.create(model=model, prompt=["one two", "three four"], max_tokens=4, temperature=0)
    assert len(text.choices) == 2                                      # several prompts: decode computes them
    for s in (prefill, decode):
        m = s.metrics()
        assert m["phasewise:num_requests_running"] == 0
        assert m["phasewise:kv_cache_free_blocks"] == m["phasewise:kv_cache_total_blocks"]


def test_a_prefill_instance_lost_mid_request_fails_only_what_needed_it(pair):
    """Killed while it runs a long prompt: that request gets a 502 from the proxy; the decode instance
    fails a transfer that cannot come (503) and keeps serving, holding no block."""
    import threading

    prefill, decode, proxy = pair
    long_prompt = " ".join(["word"] * 1500)
    model = proxy.client().models.list().data[0].id
    answer: dict = {}
    t = threading.Thread(target=lambda: answer.update(r=proxy.post("/v1/completions", {
        "model": model, "prompt": long_prompt, "max_tokens": 4})))
    t.start()
    time.sleep(0.5)                                   # the prompt is being prefilled (1 thread: ~1 s)
    prefill.proc.kill()
    prefill.proc.wait()
    t.join(60)
    r = answer["r"]
    assert r.status_code == 502 and r.json()["error"]["type"] == "server_error"
    r = decode.post("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 4,
                                             "kv_transfer_params": {"transfer_id": "never-sent"}})
    assert r.status_code == 503 and r.json()["error"]["code"] == "kv_transfer_failed"
    client = decode.client()
    out = client.chat.completions.create(model=client.models.list().data[0].id, messages=QUESTION, max_tokens=4,
                                         temperature=0)
    assert out.choices[0].finish_reason == "length"                    # the decode instance still serves
    m = decode.metrics()
    assert m["phasewise:kv_cache_free_blocks"] == m["phasewise:kv_cache_total_blocks"]
    assert httpx.get(proxy.url + "/health").status_code == 503


def test_a_decode_instance_lost_mid_stream_ends_that_stream_and_frees_the_prefill_side(tmp_path):
    """A pair of its own, its decode instance killed while it streams through the proxy: the client's
    stream ends with an error event and [DONE]; the prefill instance holds no block and still serves
    its own clients; a request through the proxy fails with its 503 (the KV link is down for good: a
pair is restarted together)."""
    import json

    servers = prefill, decode, proxy = _start_pair(tmp_path)
    try:
        model = proxy.client().models.list().data[0].id
        body = {"model": model, "messages": QUESTION, "max_tokens": 500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body, timeout=120) as resp:
            lines = (line for line in resp.iter_lines() if line.startswith("data: "))
            text = lambda line: (json.loads(line[6:]).get("choices") or [{}])[0].get("delta", {}).get("content")  # noqa: E731
            first = next(line for line in lines if text(line))
            decode.proc.kill()
            decode.proc.wait()
            rest = list(lines)
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["error"]["code"] == "decode_lost"
        assert len(rest) < 500                                           # it did not run to the end
        r = proxy.post("/v1/chat/completions", {"model": model, "messages": QUESTION, "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["code"] == "kv_transfer_failed", r.text
        client = prefill.client()
        out = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4)
        assert out.choices[0].finish_reason == "length"                  # the prefill instance still serves
        m = prefill.metrics()
        assert m["phasewise:num_requests_running"] == 0
        assert m["phasewise:kv_cache_free_blocks"] == m["phasewise:kv_cache_total_blocks"]
        assert httpx.get(proxy.url + "/health").status_code == 503
    finally:
        _stop_pair(servers)
    assert "Traceback" not in prefill.log.read_text(), prefill.log.read_text()


def test_the_proxy_ends_a_cut_stream_with_an_error():
    """The proxy passes the decode instance's stream on; cut mid-way, it ends with an error event."""
    import asyncio

    from phasewise.server.proxy import _relay_stream

    class Cut(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'data: {"choices": []}\n\n'
            raise httpx.RemoteProtocolError("peer closed connection")

    async def relay() -> bytes:
        return b"".join([c async for c in _relay_stream(httpx.Response(200, stream=Cut()))])

    out = asyncio.run(relay()).decode()
    events = [e[len("data: "):] for e in out.split("\n\n") if e.startswith("data: ")]
    assert events[0] == '{"choices": []}' and events[-1] == "[DONE]"
    assert '"code": "decode_lost"' in events[-2] and "lost mid-stream" in events[-2]
