"""Prompt caching through the APIs: Anthropic's cache_control (checked, mapped to cache points, its usage
exact against the engine's own counts and the template's tokens), OpenAI's prompt_cache_retention and
vLLM's cache_salt, a cache salt per API key, and the disk tier's expiries the TTLs set. The mapping is
checked without a server first; then one live server (two API keys, a disk tier whose default TTL is a
minute) through the official SDKs. The core's side: tests/test_cache_breakpoints.py."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import anthropic
import openai
import pytest

from live_server import MODEL, start_server, stop_server
from phasewise.core.disk_tier import block_digests
from phasewise.core.sampling_params import SamplingParams
from phasewise.server.anthropic.caching import cache_points
from phasewise.server.anthropic.protocol import MessagesRequest
from phasewise.server.api_error import APIError
from phasewise.server.async_engine import SubRequest
from phasewise.server.chat_call import salted
from phasewise.server.guards import tenant_salt
from phasewise.server.openai.protocol import ChatCompletionRequest
from phasewise.server.responses.protocol import ResponsesRequest
from phasewise.server.responses.protocol import chat_request as responses_chat_request

KEYS = ("key-one-1234", "key-two-5678")
BLOCK = 16                                   # the engine's default block size
MARK_5M, MARK_1H = {"type": "ephemeral"}, {"type": "ephemeral", "ttl": "1h"}
DEFAULT_TTL = 60                             # the server's --prompt-cache-ttl
# more than two blocks of tokens: a breakpoint after it reaches at least one whole block past the system's
QUESTION = ("How do I fix a flat tyre on a road bike with tubeless tyres and a slow leak at the valve, "
            "without a pump of my own, when the nearest shop is twenty kilometres away in the hills?")


def _text(text: str, mark: dict | None = None) -> dict:
    return {"type": "text", "text": text, **({"cache_control": mark} if mark else {})}


# ---- the mapping, without a server --------------------------------------------------------------------

def _points(**body):
    body.setdefault("messages", [{"role": "user", "content": "Hi"}])
    return MessagesRequest(model=MODEL, max_tokens=4, **body).chat_request().prompt.cache_points


def test_breakpoints_become_cut_prompts_in_anthropic_order():
    tools = [{"name": "a", "input_schema": {"type": "object"}},
             {"name": "b", "input_schema": {"type": "object"}, "cache_control": MARK_1H}]
    messages = [{"role": "user", "content": [_text("one"), _text("two", MARK_5M), _text("three")]},
                {"role": "assistant", "content": [_text("ok ", MARK_5M)]},     # a cut may end in whitespace
                {"role": "user", "content": "next"}]
    points = _points(tools=tools, system=[_text("sys", MARK_1H), _text("more")], messages=messages)
    assert [p.ttl for p in points] == [3600.0, 3600.0, 300.0, 300.0]
    tool_cut, system_cut, block_cut, reply_cut = (p.cut for p in points)
    assert tool_cut.messages == [] and [t["function"]["name"] for t in tool_cut.tools] == ["a", "b"]
    assert system_cut.messages == [{"role": "system", "content": "sys"}] and len(system_cut.tools) == 2
    assert block_cut.messages[1:] == [{"role": "user", "content": "one\n\ntwo"}]
    assert block_cut.messages[0] == {"role": "system", "content": "sys\n\nmore"}
    assert reply_cut.messages[-1] == {"role": "assistant", "content": "ok "} and len(reply_cut.messages) == 3
    assert not any(p.cut.add_generation_prompt or p.cut.continue_final for p in points)
    whole, = _points(messages=messages[2:], cache_control=MARK_1H, system="sys")   # the body's own: all of it
    assert whole.ttl == 3600.0 and len(whole.cut.messages) == 2 and whole.cut.tools is None
    assert _points() == ()


@pytest.mark.parametrize("body, needle", [
    ({"system": [_text("s", {"type": "ephemeral", "ttl": "10m"})]}, 'system[0].cache_control.ttl must be "5m" or "1h"'),
    ({"system": [_text("s", {"type": "persistent"})]}, 'system[0].cache_control must be {"type": "ephemeral"}'),
    ({"cache_control": "yes"}, 'cache_control must be {"type": "ephemeral"}'),
    ({"messages": [{"role": "user", "content": [_text(str(i), MARK_5M) for i in range(5)]}]},
     "at most 4 blocks may carry cache_control, found 5"),
    ({"system": [_text("s", MARK_5M)], "messages": [{"role": "user", "content": [_text("u", MARK_1H)]}]},
     "messages[0].content[0]: a cache_control ttl of 1h may not follow a shorter one (system[0])"),
])
def test_a_bad_breakpoint_is_a_400_naming_it(body, needle):
    with pytest.raises(APIError) as e:
        _points(**body)
    assert e.value.status == 400 and needle in e.value.message


@pytest.mark.parametrize("field, value", [
    ("stream", True), ("thinking", {"type": "enabled", "budget_tokens": 1024}), ("tool_choice", {"type": "any"}),
    ("output_config", {"format": {"type": "json_schema", "schema": {"type": "object"}}})])
def test_a_prewarm_with_what_needs_output_is_a_400_naming_it(field, value):
    def body(**extra) -> MessagesRequest:
        return MessagesRequest(model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "Hi"}], **extra)

    assert body().chat_request().params.max_tokens == 0
    with pytest.raises(APIError) as e:
        body(**{field: value}).chat_request()
    assert e.value.status == 400 and e.value.param == field and "pre-warm" in e.value.message


def test_retention_and_salt_map_to_the_engine():
    def params(**kw) -> SamplingParams:
        return ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], **kw).sampling_params()

    assert params(prompt_cache_retention="24h", prompt_cache_key="s1").cache_ttl == 86_400
    assert params(prompt_cache_retention="in_memory").cache_ttl is None and params().cache_salt is None
    assert params(cache_salt="t").cache_salt == "t"
    responses = ResponsesRequest(input="Hi", prompt_cache_retention="24h")
    assert responses.common(1, None)["cache_ttl"] == 86_400
    for field, value in (("prompt_cache_retention", "forever"), ("cache_salt", "")):
        with pytest.raises(APIError) as e:
            params(**{field: value})
        assert e.value.param == field


def test_a_tenant_salt_comes_first_and_is_no_key():
    salts = [tenant_salt(k) for k in KEYS]
    assert salts[0] != salts[1] and salts[0] == tenant_salt(KEYS[0])
    assert not any(k in s or s in k for k in KEYS for s in salts)
    items = [SubRequest("a", "p", SamplingParams()), SubRequest("b", "p", SamplingParams(cache_salt="x"))]
    assert [it.params.cache_salt for it in salted(items, salts[0])] == [salts[0], f"{salts[0]}/x"]
    assert salted(items, None) is items


def test_cache_points_in_tokens_cover_what_the_cut_renders_alike(tokenizer):
    """One tokenization gives the prompt's ids (as apply_chat_template's) and each point's reach: the tokens
    within the text the cut renders alike, here the longest common prefix of the two tokenizations."""
    from phasewise.engine.client import CachePoint, ChatPrompt
    from phasewise.engine.llm_engine import encode_marked

    messages = [{"role": "system", "content": _system()}, {"role": "user", "content": "Which chain lube?"},
                {"role": "assistant", "content": "A dry one, in summer."}, {"role": "user", "content": "And in rain?"}]
    tools = [{"type": "function", "function": {"name": "shop", "parameters": {"type": "object"}}}]
    cuts = [ChatPrompt(messages[:k], tools, add_generation_prompt=False) for k in (1, 2, 4)]
    prompt = ChatPrompt(messages, tools, cache_points=tuple(CachePoint(c, 300.0 * k) for k, c in enumerate(cuts, 1)))
    ids, marks = encode_marked(tokenizer, prompt)
    assert ids == tokenizer.apply_chat_template(messages, tools=tools)
    assert marks == tuple((_lcp(ids, tokenizer.apply_chat_template(c.messages, False, c.tools)), 300.0 * k)
                          for k, c in enumerate(cuts, 1))
    assert 0 < marks[0][0] < marks[1][0] < marks[2][0] < len(ids)
    empty = CachePoint(ChatPrompt([], add_generation_prompt=False), 60.0)     # renders nothing (or fails)
    assert encode_marked(tokenizer, ChatPrompt(messages, cache_points=(empty,)))[1] == ()


# ---- a live server ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cached_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prompt-cache")
    s = start_server(folder, "--api-key", *KEYS, "--prompt-cache-dir", str(folder / "cache"),
                     "--prompt-cache-ttl", str(DEFAULT_TTL))
    s.cache_dir = folder / "cache"
    yield s
    stop_server(s)
    log = s.log.read_text()
    assert "Traceback" not in log and not any(k in log for k in KEYS), log


@pytest.fixture(scope="module")
def tokenizer():
    from phasewise.loading.loader import default_model_path
    from phasewise.tokenization.tokenizer import Tokenizer

    return Tokenizer.load(default_model_path())


def claude(server, key: str = KEYS[0]) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=120)


def _system() -> str:
    """A system prompt of several blocks no other test sends."""
    return f"Session {uuid.uuid4().hex}. " + "You answer questions about bicycles in one plain sentence. " * 6


def _lcp(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _created(tokenizer, system: str, turns: list[dict], marks: list[tuple[int, str]]) -> tuple[list[int], dict]:
    """The prompt's tokens and, per ttl, how far its breakpoints reach in whole blocks: (messages kept, ttl)
    marks (0 messages: the system turn alone), measured as the server defines it (the longest common
    prefix with the cut's rendering)."""
    head = [{"role": "system", "content": system}]
    ids = tokenizer.apply_chat_template(head + turns)
    reach = {ttl: _lcp(ids, tokenizer.apply_chat_template(head + turns[:n], add_generation_prompt=False))
             // BLOCK * BLOCK for n, ttl in marks}
    return ids, reach


@pytest.mark.slow
def test_anthropic_cache_usage_is_what_the_engine_did(cached_server, tokenizer):
    """Turn 1 writes the system prompt's blocks at 1h and the question's at 5m; the same request again reads
    every whole block and writes nothing; the next turn reads what turn 1 left and writes its new blocks."""
    system, question = _system(), QUESTION
    client = claude(cached_server)

    def ask(turns: list[dict]) -> tuple[anthropic.types.Usage, int]:
        message = client.messages.create(model=MODEL, max_tokens=8, system=[_text(system, MARK_1H)], messages=turns,
                                         extra_body={"temperature": 0})
        return message.usage, message.model_extra["timings"]["cache_n"]

    first = [{"role": "user", "content": [_text(question, MARK_5M)]}]
    ids, reach = _created(tokenizer, system, [{"role": "user", "content": question}], [(0, "1h"), (1, "5m")])
    assert 0 < reach["1h"] < reach["5m"]
    use, cache_n = ask(first)
    assert (use.cache_read_input_tokens, cache_n) == (0, 0)
    assert use.cache_creation.ephemeral_1h_input_tokens == reach["1h"]
    assert use.cache_creation.ephemeral_5m_input_tokens == reach["5m"] - reach["1h"]
    assert use.cache_creation_input_tokens == reach["5m"]
    assert use.input_tokens == len(ids) - reach["5m"]

    use, cache_n = ask(first)
    assert use.cache_read_input_tokens == cache_n == (len(ids) - 1) // BLOCK * BLOCK
    assert use.cache_creation_input_tokens == 0 and use.input_tokens == len(ids) - cache_n

    reply = "Take the wheel off, find the hole, patch the tube, and pump it up again."
    turns = [{"role": "user", "content": question}, {"role": "assistant", "content": reply},
             {"role": "user", "content": [_text("And a tubeless tyre?", MARK_5M)]}]
    plain = [*turns[:2], {"role": "user", "content": "And a tubeless tyre?"}]
    ids, reach = _created(tokenizer, system, plain, [(0, "1h"), (3, "5m")])
    use, cache_n = ask(turns)
    assert use.cache_read_input_tokens == cache_n >= reach["1h"]
    assert use.cache_creation.ephemeral_1h_input_tokens == 0
    assert use.cache_creation_input_tokens == use.cache_creation.ephemeral_5m_input_tokens == reach["5m"] - cache_n
    assert use.input_tokens == len(ids) - cache_n - use.cache_creation_input_tokens


@pytest.mark.slow
def test_a_prewarm_writes_the_prompt_and_the_next_request_reads_it(cached_server, tokenizer):
    """Anthropic's pre-warm (max_tokens 0): no content, stop_reason max_tokens, the system's whole blocks
    written at 1h exactly, every whole block on disk (the 1h ones kept an hour); the real question after it
    reads the prefix the two share and writes nothing."""
    system, client = _system(), claude(cached_server)
    before = time.time()
    warm = client.messages.create(model=MODEL, max_tokens=0, system=[_text(system, MARK_1H)],
                                  messages=[{"role": "user", "content": "warmup"}])
    ids, reach = _created(tokenizer, system, [{"role": "user", "content": "warmup"}], [(0, "1h")])
    assert warm.content == [] and warm.stop_reason == "max_tokens" and warm.usage.output_tokens == 0
    use = warm.usage
    assert use.cache_creation_input_tokens == use.cache_creation.ephemeral_1h_input_tokens == reach["1h"] > 0
    assert use.cache_read_input_tokens == 0 and use.input_tokens == len(ids) - reach["1h"]
    expiries = _expiries(cached_server, ids, tenant_salt(KEYS[0]))
    assert all(before + 3600 - 1 <= e <= time.time() + 3600 + 1 for e in expiries[:reach["1h"] // BLOCK])

    real = client.messages.create(model=MODEL, max_tokens=4, system=[_text(system, MARK_1H)],
                                  messages=[{"role": "user", "content": QUESTION}], extra_body={"temperature": 0})
    real_ids = tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": QUESTION}])
    read = min(_lcp(ids, real_ids), len(real_ids) - 1) // BLOCK * BLOCK
    assert real.usage.cache_read_input_tokens == read >= reach["1h"]
    assert real.usage.cache_creation_input_tokens == 0 and real.usage.output_tokens > 0


@pytest.mark.slow
def test_a_streamed_message_reports_its_cache_usage_at_start(cached_server):
    with claude(cached_server).messages.stream(model=MODEL, max_tokens=8, system=[_text(_system(), MARK_1H)],
                                               messages=[{"role": "user", "content": "Hi"}]) as stream:
        start = next(e for e in stream if e.type == "message_start").message.usage
        final = stream.get_final_message().usage
    assert start.cache_creation_input_tokens == final.cache_creation_input_tokens > 0
    assert start.cache_creation.ephemeral_1h_input_tokens == final.cache_creation_input_tokens
    assert start.input_tokens == final.input_tokens


@pytest.mark.slow
def test_bad_cache_fields_are_400s_in_each_api_shape(cached_server):
    with pytest.raises(anthropic.BadRequestError, match="ttl must be"):
        claude(cached_server).messages.create(model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": [_text("Hi", {"type": "ephemeral", "ttl": "2h"})]}])
    client = cached_server.client(KEYS[0])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
                                       prompt_cache_retention="forever")
    assert e.value.body["param"] == "prompt_cache_retention"
    with pytest.raises(openai.BadRequestError, match="prompt_cache_retention"):
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, extra_body={"prompt_cache_retention": 1})


def _expiries(server, ids: list[int], salt: str | None) -> list[float]:
    """When the disk tier's entries of the prompt's whole blocks expire (wall-clock s), once all are written."""
    names = [f"*/{d.hex()[:2]}/{d.hex()}.kvb" for d in block_digests(ids, len(ids) // BLOCK, BLOCK, salt)]
    deadline = time.monotonic() + 60           # the writer thread writes them after the step
    while True:
        found = [next(Path(server.cache_dir).glob(name), None) for name in names]
        if all(found) or time.monotonic() > deadline:
            return [p.stat().st_mtime if p else 0.0 for p in found]
        time.sleep(0.2)


@pytest.mark.slow
def test_ttls_set_the_disk_expiries(cached_server, tokenizer):
    """A 1h breakpoint's blocks expire an hour after the write, the 5m one's five minutes after, the rest
    after the server's default; prompt_cache_retention 24h keeps a whole prompt a day. The salt of the
    key (two keys: a tenant each) names the entries."""
    system, question = _system(), QUESTION
    before = time.time()
    claude(cached_server).messages.create(model=MODEL, max_tokens=4, system=[_text(system, MARK_1H)], messages=[
        {"role": "user", "content": [_text(question, MARK_5M)]}], extra_body={"temperature": 0})
    ids, reach = _created(tokenizer, system, [{"role": "user", "content": question}], [(0, "1h"), (1, "5m")])
    expiries = _expiries(cached_server, ids, tenant_salt(KEYS[0]))
    after = time.time()
    ttls = [3600 if (i + 1) * BLOCK <= reach["1h"] else 300 if (i + 1) * BLOCK <= reach["5m"] else DEFAULT_TTL
            for i in range(len(expiries))]
    assert {3600, 300} <= set(ttls)
    for expiry, ttl in zip(expiries, ttls):
        assert before + ttl - 1 <= expiry <= after + ttl + 1

    before = time.time()
    text = _system()
    out = cached_server.client(KEYS[0]).chat.completions.create(
        model=MODEL, max_tokens=1, messages=[{"role": "user", "content": text}], prompt_cache_retention="24h",
        prompt_cache_key="session-7")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    assert out.usage.prompt_tokens == len(ids)
    expiries = _expiries(cached_server, ids, tenant_salt(KEYS[0]))
    assert all(before + 86_400 - 1 <= e <= time.time() + 86_400 + 1 for e in expiries)


@pytest.mark.slow
def test_tenants_and_salts_never_share_a_block(cached_server):
    text = _system()

    def cached(key: str, **kw) -> int:
        out = cached_server.client(key).chat.completions.create(
            model=MODEL, max_tokens=1, messages=[{"role": "user", "content": text}], **kw)
        assert out.usage.prompt_tokens_details.cached_tokens == out.model_extra["timings"]["cache_n"]
        return out.usage.prompt_tokens_details.cached_tokens

    first = cached(KEYS[0])                     # the template's default system turn: sent before, with this key
    hit = cached(KEYS[0])
    assert hit > first
    assert cached(KEYS[1]) == 0 and cached(KEYS[1]) == hit              # the other key (first used here): its own
    assert cached(KEYS[0], extra_body={"cache_salt": "x"}) == 0         # a salt of its own, within the key's
    assert cached(KEYS[1], extra_body={"cache_salt": "x"}) == 0
    assert cached(KEYS[0], extra_body={"cache_salt": "x"}) == hit
    response = cached_server.client(KEYS[0]).responses.create(model=MODEL, input=[{"role": "user", "content": text}],
                                                              max_output_tokens=1)
    assert response.usage.input_tokens_details.cached_tokens == response.model_extra["timings"]["cache_n"] == hit


# ---- OpenAI's prompt_cache_options and prompt_cache_breakpoint -------------------------------------------

BREAK, BREAK_12H = {"mode": "explicit"}, {"mode": "explicit", "ttl": "12h"}


def _chat_points(messages: list[dict], **body):
    return ChatCompletionRequest(messages=messages, **body).chat_request().prompt.cache_points


def _part(text: str, mark: dict | None = None) -> dict:
    return {"type": "text", "text": text, **({"prompt_cache_breakpoint": mark} if mark else {})}


def test_openai_breakpoints_become_cut_prompts_and_options_add_the_whole():
    messages = [{"role": "system", "content": [_part("sys", BREAK_12H)]},
                {"role": "user", "content": [_part("one"), _part("two", BREAK), _part("three")]}]
    system_cut, part_cut, whole = _chat_points(messages, prompt_cache_options={"ttl": "12h"})
    assert (system_cut.ttl, part_cut.ttl, whole.ttl) == (43_200.0, 43_200.0, 43_200.0)   # a bare mark: the request's
    assert system_cut.cut.messages == [{"role": "system", "content": "sys"}]
    assert part_cut.cut.messages[1] == {"role": "user", "content": "onetwo"}
    assert whole.cut.messages[1] == {"role": "user", "content": "onetwothree"}
    assert not any(p.cut.add_generation_prompt for p in (system_cut, part_cut, whole))
    assert [p.ttl for p in _chat_points(messages)] == [43_200.0, 1800.0]           # no options: no implicit point
    assert [p.ttl for p in _chat_points(messages, prompt_cache_options={"mode": "explicit"})] == [43_200.0, 1800.0]
    many = [{"role": "user", "content": [_part(str(i), BREAK) for i in range(6)]}]
    kept = _chat_points(many, prompt_cache_options={})
    assert [p.cut.messages[0]["content"] for p in kept] == ["0123", "01234", "012345", "012345"]    # latest 3 + whole
    responses = ResponsesRequest(instructions="Be brief.", prompt_cache_options={"ttl": "30m"}, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "a", "prompt_cache_breakpoint": BREAK_12H},
                                     {"type": "input_text", "text": "b"}]}])
    marked, implicit = responses_chat_request(responses, [])[0].prompt.cache_points
    assert marked.ttl == 43_200.0 and marked.cut.messages == [{"role": "system", "content": "Be brief."},
                                                              {"role": "user", "content": "a"}]
    assert implicit.ttl == 1800.0 and implicit.cut.messages[-1] == {"role": "user", "content": "ab"}


@pytest.mark.parametrize("body, needle", [
    ({"prompt_cache_options": {"ttl": "1h"}}, 'prompt_cache_options.ttl must be "30m" or "12h"'),
    ({"prompt_cache_options": {"mode": "always"}}, 'prompt_cache_options.mode must be "implicit" or "explicit"'),
    ({"prompt_cache_options": {"prewarm": True}}, "prompt_cache_options.prewarm is not supported"),
    ({"messages": [{"role": "user", "content": [_part("u", {"mode": "explicit", "ttl": "5m"})]}]},
     'messages[0].content[0].prompt_cache_breakpoint.ttl must be "30m" or "12h"'),
    ({"messages": [{"role": "user", "content": [_part("u", {"mode": "implicit"})]}]},
     'messages[0].content[0].prompt_cache_breakpoint must be {"mode": "explicit"}'),
])
def test_a_bad_openai_cache_field_is_a_400_naming_it(body, needle):
    body.setdefault("messages", [{"role": "user", "content": "Hi"}])
    with pytest.raises(APIError) as e:
        ChatCompletionRequest(**body).chat_request()
    assert e.value.status == 400 and needle in e.value.message


@pytest.mark.slow
def test_openai_cache_writes_are_what_the_engine_did(cached_server, tokenizer):
    """Chat with prompt_cache_options (its implicit breakpoint: the whole conversation, 30m) writes those
    blocks and says so; again, it reads them and writes nothing; the disk keeps them 30 minutes. Responses
    with a 12h breakpoint after the system turn splits its writes by ttl."""
    system, client = _system(), cached_server.client(KEYS[0])
    messages = [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]
    ids, reach = _created(tokenizer, system, [{"role": "user", "content": QUESTION}], [(1, "30m")])
    before = time.time()
    usages = [client.chat.completions.create(model=MODEL, max_tokens=1, messages=messages, temperature=0,
                                             prompt_cache_options={"ttl": "30m"}).usage for _ in range(2)]
    assert [u.prompt_tokens_details.cache_write_tokens for u in usages] == [reach["30m"], 0]
    assert [u.prompt_tokens_details.cached_tokens for u in usages] == [0, (len(ids) - 1) // BLOCK * BLOCK]
    expiries = _expiries(cached_server, ids, tenant_salt(KEYS[0]))
    for i, expiry in enumerate(expiries):
        ttl = 1800 if (i + 1) * BLOCK <= reach["30m"] else DEFAULT_TTL
        assert before + ttl - 1 <= expiry <= time.time() + ttl + 1

    system = _system()
    ids, reach = _created(tokenizer, system, [{"role": "user", "content": QUESTION}], [(0, "12h"), (1, "30m")])
    response = client.responses.create(model=MODEL, max_output_tokens=1, prompt_cache_options={"ttl": "30m"}, input=[
        {"role": "system", "content": [{"type": "input_text", "text": system, "prompt_cache_breakpoint": BREAK_12H}]},
        {"role": "user", "content": QUESTION}])
    details = response.usage.input_tokens_details
    assert details.cache_write_tokens_details.ttl_12h_tokens == reach["12h"] > 0
    assert details.cache_write_tokens_details.ttl_30m_tokens == reach["30m"] - reach["12h"] > 0
    assert details.cache_write_tokens == reach["30m"] and details.cached_tokens == 0


@pytest.mark.slow
def test_a_responses_prewarm_writes_the_prompt_without_output(cached_server, tokenizer):
    """prompt_cache_options.prewarm: a completed response without output items (streamed: no item events),
    its writes exact (the implicit breakpoint: the conversation, 30m); the next turn continuing it reads them."""
    system, client = _system(), cached_server.client(KEYS[0])
    ids, reach = _created(tokenizer, system, [{"role": "user", "content": QUESTION}], [(1, "30m")])
    warm = client.responses.create(model=MODEL, instructions=system, input=QUESTION,
                                   prompt_cache_options={"prewarm": True})
    assert warm.status == "completed" and warm.output == [] and warm.usage.output_tokens == 0
    details = warm.usage.input_tokens_details
    assert details.cache_write_tokens == reach["30m"] > 0 and details.cached_tokens == 0
    assert warm.usage.input_tokens == len(ids)

    follow = "Answer in one word."
    turn = client.responses.create(model=MODEL, instructions=system, previous_response_id=warm.id, input=follow,
                                   max_output_tokens=4, temperature=0)
    turn_ids = tokenizer.apply_chat_template([{"role": "system", "content": system},
                                              {"role": "user", "content": QUESTION}, {"role": "user", "content": follow}])
    assert turn.usage.input_tokens == len(turn_ids)
    read = min(_lcp(ids, turn_ids), len(turn_ids) - 1) // BLOCK * BLOCK
    assert turn.usage.input_tokens_details.cached_tokens == read >= reach["30m"]

    events = list(client.responses.create(model=MODEL, input=QUESTION, stream=True,
                                          prompt_cache_options={"prewarm": True}))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.completed"]
    assert events[-1].response.output == [] and events[-1].response.usage.output_tokens == 0
