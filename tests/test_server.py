"""`phasewise serve` as clients use it: a live server process on 127.0.0.1, the official openai client, httpx.

No timed assertions: every wait is bounded, none is measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct.Q4_1"
KEY = "test-key-123"
MAX_BODY = 200_000
STARTUP_TIMEOUT = 240.0
QUESTION = [{"role": "user", "content": "Name three colours."}]
LONG_PROMPT = ("You are a careful assistant who answers questions about the solar system. " * 12
               + "Question: which planet is the largest?")
TIMING_KEYS = {"queue_ms", "ttft_ms", "prompt_n", "cache_n", "prompt_ms", "prompt_per_second", "predicted_n",
               "predicted_ms", "predicted_per_second", "itl_ms_p50", "itl_ms_p99", "preemptions"}


# ---- helpers --------------------------------------------------------------------------------------

@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path

    def client(self, api_key: str = "none", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120, **kw)

    def post(self, path: str, body=None, headers=None, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers=headers, timeout=120, **kw)

    def metrics(self) -> dict[str, float]:
        """name{labels} → value, plus bare names summed over their labels."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        out: dict[str, float] = {}
        for name, labels, value in re.findall(r"^([\w:]+)(\{[^}]*\})? (\S+)$", text, re.M):
            pairs = sorted(re.findall(r'\w+="[^"]*"', labels))
            out[name + ("{" + ",".join(pairs) + "}" if pairs else "")] = float(value)
            out[name] = out.get(name, 0.0) + float(value)
        return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log_dir: Path, *extra: str) -> Server:
    port = free_port()
    log = log_dir / "server.log"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "phasewise.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--kv-cache-memory", "0.25", "--no-access-log", *extra],
            stdout=f, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited ({proc.returncode}):\n{log.read_text()}")
        try:
            if httpx.get(server.url + "/health", timeout=5).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop_server(server)
    pytest.fail(f"the server did not answer /health within {STARTUP_TIMEOUT} s:\n{log.read_text()}")


def stop_server(server: Server) -> None:
    server.proc.terminate()
    try:
        server.proc.wait(30)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait(10)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("server"), "--max-body-bytes", str(MAX_BODY))
    yield s
    stop_server(s)
    assert "Traceback" not in s.log.read_text(), s.log.read_text()


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A second server: an API key, four running requests at most, eight waiting at most."""
    s = start_server(tmp_path_factory.mktemp("guarded"), "--api-key", KEY, "--max-waiting", "8",
                     "--max-num-seqs", "4")
    yield s
    stop_server(s)
    assert "Traceback" not in s.log.read_text(), s.log.read_text()


def assert_openai_error(resp: httpx.Response, status: int, *needles: str) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    for leak in ("pydantic", "errors.pydantic.dev", "'loc'", "'input'", "Traceback", "detail"):
        assert leak not in resp.text, resp.text
    for needle in needles:
        assert needle in err["message"], err["message"]
    return err


def sse_events(resp: httpx.Response) -> list:
    events = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ---- the API --------------------------------------------------------------------------------------

def test_models_health_and_tokenizer_routes(server):
    assert httpx.get(server.url + "/health").status_code == 200
    models = server.client().models.list().data
    assert [m.id for m in models] == [MODEL]
    extra = models[0].to_dict()
    assert extra["max_model_len"] == 8192 and extra["root"].endswith(MODEL + ".gguf")
    assert server.client().models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as missing:
        server.client().models.retrieve("gpt-4")
    assert missing.value.body["code"] == "model_not_found"
    ids = server.post("/tokenize", {"prompt": "Hello world"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0
    assert server.post("/detokenize", {"tokens": ids["tokens"]}).json()["prompt"] == "Hello world"
    chat_ids = server.post("/tokenize", {"messages": QUESTION}).json()["tokens"]
    assert len(chat_ids) > ids["count"]
    info = httpx.get(server.url + "/tokenizer_info").json()    # what lm-eval's remote tokenizer reads
    eos = server.post("/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert len(eos) == 1 and "{%" in info["chat_template"] and info["model_max_length"] == 8192


def test_streamed_chat_equals_non_streamed(server):
    client = server.client()
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)
    text = full.choices[0].message.content
    assert text and full.choices[0].finish_reason in ("stop", "length")
    assert TIMING_KEYS <= set(full.to_dict()["timings"])
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == full.choices[0].finish_reason
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert TIMING_KEYS <= set(last.to_dict()["timings"])


def test_usage_and_prefix_cache_hits_on_a_repeated_long_prompt(server):
    client = server.client()
    n_prompt = server.post("/tokenize", {"prompt": LONG_PROMPT}).json()["count"]
    assert n_prompt > 64
    outs = [client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True}) for _ in range(2)]
    for out in outs:
        assert out.usage.prompt_tokens == n_prompt
        assert out.usage.completion_tokens == 4 and out.usage.total_tokens == n_prompt + 4
        assert out.choices[0].finish_reason == "length"
    cached = outs[1].usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < n_prompt
    timings = outs[1].to_dict()["timings"]
    assert timings["cache_n"] == cached and timings["prompt_n"] == n_prompt and timings["predicted_n"] == 3
    assert outs[0].choices[0].text == outs[1].choices[0].text


def test_a_burst_of_60_streams_at_the_defaults_is_admitted_and_completes(server):
    """60 at once on a server with the default --max-num-seqs (64) and --max-waiting: none refused."""
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, object]:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=8,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage
        return text, usage

    async def run() -> list:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(60)))

    results = asyncio.run(run())
    assert len(results) == 60
    for text, usage in results:
        assert usage is not None and usage.completion_tokens == 8
    assert sum(1 for text, _ in results if text) >= 56   # 8 tokens may all be whitespace, rarely


def test_n2_choices_differ_with_a_seed_and_share_the_prompt(server):
    client = server.client()
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, n=2, seed=7, temperature=1.0,
                                         max_tokens=16, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == 32
    single = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
    assert out.usage.prompt_tokens == single.usage.prompt_tokens       # counted once, not per choice
    assert out.choices[0].message.content != out.choices[1].message.content
    again = client.chat.completions.create(model=MODEL, messages=QUESTION, n=2, seed=7, temperature=1.0,
                                           max_tokens=16, extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]
    texts = ["", ""]
    for chunk in client.completions.create(model=MODEL, prompt="Once upon a time", n=2, max_tokens=6,
                                           stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert all(texts)


def test_chat_logprobs(server):
    out = server.client().chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=8,
                                                  logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.bytes == list(entry.token.encode())
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)   # greedy: the top one
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
    text = out.choices[0].message.content
    assert "".join(e.token for e in content).startswith(text)


def test_completion_logprobs_legacy_format(server):
    out = server.client().completions.create(model=MODEL, prompt="The capital of France is", temperature=0,
                                             max_tokens=6, logprobs=2, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    assert "".join(lp.tokens) == out.choices[0].text
    events = sse_events(server.post("/v1/completions", {"prompt": "The capital of France is", "temperature": 0,
                                                        "max_tokens": 6, "logprobs": 2, "ignore_eos": True,
                                                        "stream": True}))
    streamed = [t for e in events[:-1] for c in e["choices"] for t in c["logprobs"]["tokens"]]
    assert streamed == lp.tokens and events[-1] == "[DONE]"


def test_echo_returns_the_prompt_with_its_logprobs_as_evaluation_harnesses_read_them(server):
    """lm-evaluation-harness's loglikelihood request (echo, logprobs 1, max_tokens 1, token ids) and
    max_tokens 0: the prompt's tokens come first, the first with null logprobs; a token's logprob
    equals its top-1 exactly when it is the greedy one. Streamed, the prompt comes in the first chunk."""
    client = server.client()
    ids = server.post("/tokenize", {"prompt": "The capital of France is Paris"}).json()["tokens"]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v < 0 for v in lp.token_logprobs[1:]) and all(len(top) == 1 for top in lp.top_logprobs[1:])
    greedy_last = lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())   # the sampled token is greedy
    assert greedy_last and out.choices[0].text.startswith("The capital of France is Paris")
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 1
    only = client.completions.create(model=MODEL, prompt="The capital of France is Paris", max_tokens=0,
                                     logprobs=0, echo=True)
    c = only.choices[0]
    assert c.text == "The capital of France is Paris" and c.finish_reason == "length"
    assert c.logprobs.token_logprobs == lp.token_logprobs[:-1] and only.usage.completion_tokens == 0
    assert c.logprobs.text_offset[0] == 0 and "".join(c.logprobs.tokens) == c.text
    events = sse_events(server.post("/v1/completions", {"prompt": "The capital of France is Paris", "echo": True,
                                                        "max_tokens": 2, "logprobs": 0, "temperature": 0,
                                                        "stream": True}))
    first = events[0]["choices"][0]
    assert first["text"].startswith("The capital of France is Paris")
    assert first["logprobs"]["token_logprobs"][:len(ids)] == lp.token_logprobs[:-1]
    plain = client.completions.create(model=MODEL, prompt="Hi", max_tokens=0, echo=True)
    assert plain.choices[0].text == "Hi" and plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=0)


def test_stop_strings(server):
    client = server.client()
    ref = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)
    words = ref.choices[0].message.content.split()
    assert len(words) >= 3
    stop = words[2]
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24, stop=[stop])
    text = out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop" and stop not in text
    assert ref.choices[0].message.content.startswith(text)
    assert out.choices[0].to_dict()["stop_reason"] == stop
    comp = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=16,
                                     stop=" 7")
    assert comp.choices[0].finish_reason == "stop" and " 7" not in comp.choices[0].text


# ---- errors ---------------------------------------------------------------------------------------

CHAT = {"model": MODEL, "messages": QUESTION}


@pytest.mark.parametrize("body, param", [
    ({**CHAT, "temperature": -1}, "temperature"),
    ({**CHAT, "top_p": 2}, "top_p"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "n": 0}, "n"),
    ({**CHAT, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({**CHAT, "temperature": "hot"}, "temperature"),
    ({**CHAT, "max_tokens": 2.5}, "max_tokens"),
    ({**CHAT, "stop": [1, 2]}, "stop"),
    ({**CHAT, "messages": "hello"}, "messages"),
    ({**CHAT, "messages": [{"content": "no role"}]}, "messages"),
    ({"model": MODEL}, "messages"),
])
def test_invalid_chat_parameters_are_400(server, body, param):
    err = assert_openai_error(server.post("/v1/chat/completions", body), 400, param)
    assert err["param"] == param and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2, 3]", b'{"prompt": NaN}', b"\xff\xfe"])
def test_malformed_bodies_get_a_clean_400(server, raw):
    resp = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_openai_error(resp, 400)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", b'{"model": "%s", "prompt": "a\\ud800b"}', "prompt"),
    ("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": "\\udfff"}]}', "messages"),
    ("/tokenize", b'{"model": "%s", "prompt": "x\\ud83d"}', "prompt"),
])
def test_a_lone_surrogate_is_a_400_not_a_500(server, path, body, param):
    """JSON can spell an unpaired surrogate ("\\ud800"); no tokenizer can encode it: bad input."""
    resp = httpx.post(server.url + path, content=body.replace(b"%s", MODEL.encode()),
                      headers={"content-type": "application/json"})
    err = assert_openai_error(resp, 400, "surrogate")
    assert err["param"] == param
    assert httpx.get(server.url + "/health").status_code == 200


def test_openai_client_sees_bad_request_for_invalid_params(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert "temperature" in str(e.value)


def test_prompt_plus_max_tokens_over_the_context_is_400_with_both_numbers(server):
    for path, body in [("/v1/completions", {"model": MODEL, "prompt": "Hello there", "max_tokens": 9000}),
                       ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 9000, "stream": True})]:
        err = assert_openai_error(server.post(path, body), 400, "8192", "9000")
        assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    long_ids = list(range(100, 100 + 8200))
    err = assert_openai_error(server.post("/v1/completions", {"model": MODEL, "prompt": long_ids}), 400, "8192", "8200")
    assert err["param"] == "prompt"                       # the prompt alone is too long: not max_tokens
    err = assert_openai_error(server.post("/v1/completions", {"model": MODEL, "prompt": [1, 99_999]}), 400,
                              "99999", "out of range")
    assert err["param"] == "prompt"


def test_unknown_model_is_404_and_the_path_is_an_alias(server):
    err = assert_openai_error(server.post("/v1/chat/completions", {**CHAT, "model": "gpt-4o"}), 404, "gpt-4o")
    assert err["code"] == "model_not_found" and err["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="../../etc/passwd", messages=QUESTION, max_tokens=2)
    root = httpx.get(server.url + "/v1/models").json()["data"][0]["root"]
    assert server.post("/v1/completions", {"model": root, "prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_oversized_body_is_413(server):
    big = {"model": MODEL, "prompt": "a" * (MAX_BODY + 10)}
    assert_openai_error(server.post("/v1/completions", big), 413)

    def chunks():      # no Content-Length: counted as it arrives
        for _ in range(MAX_BODY // 10_000 + 2):
            yield b" " * 10_000
    resp = httpx.post(server.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_openai_error(resp, 413)
    assert httpx.get(server.url + "/health").status_code == 200


def test_unknown_route_and_unknown_fields(server):
    assert_openai_error(httpx.get(server.url + "/v1/nothing"), 404)
    resp = server.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "no_such_field": 1,
                                           "user": "someone", "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] >= 1


def test_api_key(guarded):
    body = {**CHAT, "max_tokens": 2}
    assert_openai_error(guarded.post("/v1/chat/completions", body), 401)
    assert_openai_error(guarded.post("/v1/chat/completions", body, headers={"Authorization": "Bearer wrong"}), 401)
    assert_openai_error(httpx.get(guarded.url + "/v1/models"), 401)
    with pytest.raises(openai.AuthenticationError):
        guarded.client("wrong").chat.completions.create(**body)
    out = guarded.client(KEY).chat.completions.create(**body)
    assert out.usage.completion_tokens >= 1
    assert httpx.get(guarded.url + "/health").status_code == 200
    assert httpx.get(guarded.url + "/metrics").status_code == 200


# ---- under stress ---------------------------------------------------------------------------------

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


def test_a_burst_admits_the_running_seats_plus_the_waiting_room(guarded):
    """20 requests at once against --max-num-seqs 4 --max-waiting 8: exactly 4 + 8 are served (the
    ones the scheduler starts at once do not count as waiting), the rest get 503 with Retry-After,
    and /health answers throughout. Each admitted request runs for seconds, so none ends before the
    burst is in."""
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {**CHAT, "max_tokens": 300, "ignore_eos": True}
    health: list[int] = []

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=guarded.url, headers=headers, timeout=300) as client:
            sent = [asyncio.create_task(client.post("/v1/chat/completions", json=body)) for _ in range(20)]
            while not all(t.done() for t in sent):
                health.append((await client.get("/health")).status_code)
                await asyncio.sleep(0.2)
            return [t.result() for t in sent]

    results = asyncio.run(burst())
    assert health and set(health) == {200}
    statuses = [r.status_code for r in results]
    assert statuses.count(200) == 12 and statuses.count(503) == 8, statuses
    for r in results:
        if r.status_code == 503:
            assert r.headers["retry-after"] == "1"
            assert assert_openai_error(r, 503)["code"] == "overloaded"
    later = guarded.post("/v1/chat/completions", {**CHAT, "max_tokens": 2}, headers=headers)
    assert later.status_code == 200, later.text


def test_metrics_exposition(server):
    server.client().completions.create(model=MODEL, prompt="Hello", max_tokens=4, extra_body={"ignore_eos": True})
    m = server.metrics()
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert m[f"phasewise:{name}_count"] > 0, name
    for name in ("prompt_tokens_total", "generation_tokens_total", "prefix_cache_hit_tokens_total",
                 "num_preemptions_total", "num_requests_waiting", "num_requests_running", "kv_cache_usage_perc",
                 "kv_cache_free_blocks"):
        assert f"phasewise:{name}" in m, name
    assert m["phasewise:prompt_tokens_total"] > 0 and m["phasewise:generation_tokens_total"] > 0
    assert m['phasewise:requests_finished_total{finished_reason="length",model_name="%s"}' % MODEL] > 0


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
                if not engine.has_unfinished() and async_engine.stats.num_running == 0:
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

def test_bench_serve_counts_tokens_from_the_servers_usage(server, tmp_path, capsys):
    from phasewise.cli import main

    out = tmp_path / "bench"
    code = main(["bench", "serve", "--base-url", server.url, "--num-prompts", "8", "--input-len", "32",
                 "--output-len", "8", "--max-concurrency", "4", "--num-warmup", "1", "--goodput", "e2e:600000",
                 "--result-dir", str(out)])
    assert code == 0, capsys.readouterr().err
    run = json.loads((out / "results.json").read_text())["runs"][0]
    assert (run["completed"], run["failed"]) == (8, 0)
    assert run["prompt_tokens"] == 8 * 32 and run["output_tokens"] == 8 * 8 and run["usage_reported"]
    assert run["goodput"]["requests"] == 8
    assert 0 < run["ttft_ms"]["median"] <= run["e2e_ms"]["median"]
    assert run["tpot_ms"]["median"] > 0 and run["itl_ms"]["p99"] >= run["itl_ms"]["median"]
    rows = (out / "requests.csv").read_text().splitlines()
    assert len(rows) == 1 + 8
    assert "TTFT median ms" in capsys.readouterr().out


def test_bench_serve_sweep_over_chat_draws_the_trade_off(server, tmp_path):
    import matplotlib.image

    from phasewise.cli import main

    out = tmp_path / "sweep"
    code = main(["bench", "serve", "--base-url", server.url + "/v1", "--endpoint", "chat", "--num-prompts", "4",
                 "--input-len", "12", "--output-len", "4", "--sweep", "1,4", "--num-warmup", "0",
                 "--result-dir", str(out)])
    assert code == 0
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [r["max_concurrency"] for r in runs] == [1, 4]
    assert all(r["completed"] == 4 and r["output_tokens"] == 16 for r in runs)
    image = matplotlib.image.imread(out / "sweep.png")
    assert image.ndim == 3 and image.shape[1] > 500


def test_bench_serve_against_no_server_fails_in_one_line(capsys):
    from phasewise.cli import main

    assert main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("phasewise: error: cannot reach")


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

    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
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
                if engine.stats.num_running == engine.stats.num_waiting == 0:
                    break
                await asyncio.sleep(0.05)
            assert await engine.call(lambda e: e.stats().num_free_blocks) == pool.num_blocks
        finally:
            engine.shutdown()

    asyncio.run(scenario())
    assert not async_engine_thread_alive() and not llm.engine.has_unfinished()
