"""The engine on the default model: batching, preemption and prefix caching never change greedy outputs."""

from __future__ import annotations

import pytest

from phasewise import LLM, SamplingParams

pytestmark = pytest.mark.slow

TOPICS = ["the sea", "a cat", "mountains", "bread", "rain", "a library", "trains", "the moon",
          "winter", "a garden", "music", "coffee", "a lighthouse", "bees", "paper", "a bridge"]
PROMPTS = [f"Write one sentence about {t}." for t in TOPICS]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
SYSTEM = ("You are a meticulous assistant for a museum of maritime history. " * 34).strip()


def assert_same_greedy(outs, refs):
    """Token-identical, or at the first difference both candidates lie in the other run's top-5
    (a floating-point batch effect on a near tie, as vLLM checks); later tokens then differ legitimately."""
    for out, ref in zip(outs, refs):
        assert len(out.token_ids) == len(ref.token_ids)
        for i, (x, y) in enumerate(zip(out.token_ids, ref.token_ids)):
            if x != y:
                assert x in dict(ref.logprobs[i].top) and y in dict(out.logprobs[i].top), (out.text, ref.text)
                break


@pytest.fixture(scope="module")
def alone(llm):
    return [llm.chat([{"role": "user", "content": p}], GREEDY) for p in PROMPTS]


def chats(llm_, params=GREEDY):
    return llm_.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)


def test_sixteen_together_equal_each_alone(llm, alone):
    assert_same_greedy(chats(llm), alone)
    assert llm.engine.core.kv.pool.num_free == llm.engine.core.kv.pool.num_blocks


def test_preemption_does_not_change_outputs(alone):
    small = LLM(dtype="fp32", kv_dtype="model", num_blocks=14, warmup=False)         # 16 requests of ~3 blocks each: must preempt
    outs = chats(small)
    assert sum(o.metrics.preemptions for o in outs) > 0
    assert_same_greedy(outs, alone)
    assert small.engine.core.kv.pool.num_free == 14


def test_prefix_caching_off_gives_the_same_outputs(alone):
    plain = LLM(dtype="fp32", kv_dtype="model", enable_prefix_caching=False, kv_cache_memory=0.1, warmup=False)
    outs = chats(plain)
    assert all(o.cached_tokens == 0 for o in outs)
    assert_same_greedy(outs, alone)


def test_shared_prefix_is_cached(llm):
    questions = ["When was the first lighthouse built?", "What is a sextant?", "Who was Magellan?",
                 "What is a clipper ship?", "How do tides work?"]
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = [llm.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}], p)
            for q in questions]
    n_prompt = len(outs[0].prompt_token_ids)
    assert n_prompt > 400 and outs[0].cached_tokens == 0
    for o in outs[1:]:
        assert o.cached_tokens >= n_prompt - 32 and o.cached_tokens % 16 == 0
        # only the uncached tail is prefilled (the TTFT this saves is measured in
        # benchmarks/offline_throughput.py, not asserted here: timings are noisy)
        assert sum(n for _, _, n in o.metrics.prefill_chunks) == len(o.prompt_token_ids) - o.cached_tokens
