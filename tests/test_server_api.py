"""`phasewise serve` as clients use it: the routes, streaming, choices, logprobs, stop strings and
metrics, through the official openai client and httpx.

No timed assertions: every wait is bounded, none is measured.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from live_server import MODEL, QUESTION, sse_events

pytestmark = pytest.mark.slow

LONG_PROMPT = ("You are a careful assistant who answers questions about the solar system. " * 12
               + "Question: which planet is the largest?")
TIMING_KEYS = {"queue_ms", "ttft_ms", "prompt_n", "cache_n", "prompt_ms", "prompt_per_second", "predicted_n",
               "predicted_ms", "predicted_per_second", "itl_ms_p50", "itl_ms_p99", "preemptions"}


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


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_chat_logprobs_rebuild_the_content_when_the_turn_ends(server, stream, skip_special_tokens):
    """An answer that ends on its end-of-turn token: one logprobs entry per token of the content, so
    the entries' bytes are the content's (the end-of-turn token has one only where the content
    shows it, with skip_special_tokens false)."""
    messages = [{"role": "user", "content": "Say OK."}]
    kw = dict(model=MODEL, messages=messages, temperature=0, max_tokens=64, logprobs=True,
              extra_body={"skip_special_tokens": skip_special_tokens})
    if stream:
        chunks = [c for c in server.client().chat.completions.create(stream=True, **kw) if c.choices]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        entries = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        finish = chunks[-1].choices[0].finish_reason
    else:
        out = server.client().chat.completions.create(**kw)
        text, entries, finish = out.choices[0].message.content, out.choices[0].logprobs.content, \
            out.choices[0].finish_reason
    assert finish == "stop"
    assert bytes(b for e in entries for b in e.bytes).decode() == text
    assert text.endswith("<|im_end|>") != skip_special_tokens


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
    assert m["phasewise:threads"] >= 1                          # the kernels' threads, and what others take
    assert m["phasewise:cpus_busy_elsewhere"] >= 0 and m["phasewise:cpu_wait_seconds_total"] >= 0


