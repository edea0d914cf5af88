"""What the server refuses, and how: OpenAI-shaped errors with the right status for bad input,
unknown models, oversized bodies, a missing key, and a burst past the waiting room.

No timed assertions: every wait is bounded, none is measured.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from live_server import CHAT, KEY, MAX_BODY, MODEL, QUESTION, assert_openai_error

pytestmark = pytest.mark.slow


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
    ({**CHAT, "messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ({**CHAT, "messages": [{"role": "user", "content": "hi", "tool_calls": []}, {"role": "user", "content": "",
                                                                                 "tool_calls": [{"id": "1"}]}]},
     "messages"),                                                         # only an assistant calls tools
    ({**CHAT, "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),   # vLLM's
    ({**CHAT, "mirostat": 2}, "mirostat"),                                          # llama.cpp's
])
def test_invalid_chat_parameters_are_400(server, body, param):
    """Bad values, and fields that would change the output but are not implemented: a 400 naming
    the field, never a 200 that silently ignores it."""
    err = assert_openai_error(server.post("/v1/chat/completions", body), 400, param)
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_fields_that_change_nothing_pass_and_developer_is_system(server):
    body = {**CHAT, "max_tokens": 2, "user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
            "cache_prompt": True, "messages": [{"role": "developer", "content": "Be brief."}, *CHAT["messages"]]}
    assert server.post("/v1/chat/completions", body).status_code == 200
    as_system = {**body, "messages": [{"role": "system", "content": "Be brief."}, *CHAT["messages"]]}
    ids = [server.post("/tokenize", {"messages": b["messages"]}).json()["tokens"] for b in (body, as_system)]
    assert ids[0] == ids[1]


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2, 3]", b'{"prompt": NaN}', b"\xff\xfe"])
def test_malformed_bodies_get_a_clean_400(server, raw):
    resp = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_openai_error(resp, 400)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize"])
@pytest.mark.parametrize("where", ["field", "schema"])
def test_a_body_nested_thousands_deep_is_a_400(server, path, where):
    """Refused before anything parses it (the parser's recursion was a 500), and the next request is served."""
    deep = "[" * 3000 + "]" * 3000
    extra = f'"stop": {deep}' if where == "field" else \
        f'"response_format": {{"type": "json_schema", "json_schema": {{"name": "x", "schema": {{"items": {deep}}}}}}}'
    raw = f'{{"model": "{MODEL}", "prompt": "hi", "messages": [{{"role": "user", "content": "hi"}}], {extra}}}'
    resp = httpx.post(server.url + path, content=raw.encode(), headers={"content-type": "application/json"})
    err = assert_openai_error(resp, 400, "128 levels deep")
    assert err["param"] is None
    ok = server.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200


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


def test_a_burst_admits_the_running_seats_plus_the_waiting_room(guarded):
    """20 requests at once against --max-num-seqs 4 --max-waiting 8: exactly 4 + 8 are served (the
    ones the scheduler starts at once do not count as waiting), the rest get 503 with Retry-After,
    and /health answers throughout. Each admitted request runs for seconds, so none ends before the
    burst is in."""
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {**CHAT, "max_tokens": 160, "ignore_eos": True}
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



def test_an_output_its_grammar_ended_in_error_is_an_error_naming_it():
    """finish_reason "error" is no finish reason OpenAI's clients know: a stream ends with an error event
    naming the cause (then [DONE]), a collected answer is a 500 naming it."""
    from phasewise.core.request import RequestMetrics
    from phasewise.outputs import CompletionOutput, StreamDelta
    from phasewise.server.openai.output import TokenText
    from phasewise.server.openai.stream import chat_events
    from phasewise.server.sse import failure

    out = CompletionOutput(request_id="r", prompt=None, prompt_token_ids=[1], text="<", token_ids=[5],
                           finish_reason="error", stop_reason=None, logprobs=None, metrics=RequestMetrics(arrival=0.0),
                           error="the output's grammar refused token 5 ('<')")

    class Vocab:
        def token_bytes(self, token_id):
            return b"<"

    class Stream:
        request_ids, closed = ["r"], False

        async def __aiter__(self):
            yield StreamDelta(request_id="r", text="<", token_ids=[5], logprobs=[], finished=True, output=out)

        def close(self):
            self.closed = True

    async def events():
        return [e async for e in chat_events(Stream(), "c", 0, MODEL, n=1, want_lp=False, include_usage=False,
                                             tt=TokenText(Vocab()))]

    got = asyncio.run(events())
    assert got[-1] == "data: [DONE]\n\n" and "finish_reason" not in got[-2]
    error = json.loads(got[-2][len("data: "):])["error"]
    assert error["code"] == "generation_error" and "refused token 5" in error["message"]
    assert "refused token 5" in failure(out)
