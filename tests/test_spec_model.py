"""Speculative decoding on the default model: greedy outputs unchanged for both proposers, batched and
under preemption; seeded sampling reproducible; stop strings; the metrics in outputs, the command and
/metrics."""

from __future__ import annotations

import pytest

from phasewise import LLM, SamplingParams
from phasewise.cli import build_parser
from phasewise.config import SpeculativeConfig
from phasewise.core.spec_policy import SpecPolicy
from phasewise.engine.args import speculative_config_from_args
from phasewise.report import perf_lines, timings

pytestmark = pytest.mark.slow

TEXT = ("The lighthouse keeper climbed the stairs every evening at six. He lit the lamp, wound the clock, "
        "and wrote the weather in a small green book. In forty years he never missed a night.")
PROMPTS = [
    f"Repeat this text word for word:\n{TEXT}",
    f"Summarize in one sentence:\n{TEXT}",
    f"Rewrite this text in the past perfect tense:\n{TEXT}",
    "Write one sentence about the moon.",
    "List three fruits.",
    "Write a haiku about rain.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
PENALISED = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5, repetition_penalty=1.3,
                           presence_penalty=0.5, min_tokens=8)
PARAMS = [GREEDY, GREEDY, GREEDY, GREEDY, PENALISED, GREEDY]
POOL = 16                       # blocks: six requests of ~6-8 blocks each cannot all run at once


def chats(llm_, params=PARAMS):
    return llm_.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)


def assert_same_greedy(outs, refs):
    """Token-identical, or (as in test_engine_model.py) at the first difference both candidates are in the
    other run's top 5: a floating-point near tie between a k+1-row verification and a 1-row decode."""
    identical = 0
    for out, ref in zip(outs, refs):
        assert len(out.token_ids) == len(ref.token_ids)
        identical += out.token_ids == ref.token_ids
        for i, (x, y) in enumerate(zip(out.token_ids, ref.token_ids)):
            if x != y:
                assert x in dict(ref.logprobs[i].top) and y in dict(out.logprobs[i].top), (out.text, ref.text)
                break
    assert identical >= len(refs) - 1, f"only {identical} of {len(refs)} token-identical"


@pytest.fixture(scope="module")
def alone(llm):
    return [llm.chat([{"role": "user", "content": p}], params) for p, params in zip(PROMPTS, PARAMS)]


@pytest.fixture(scope="module", params=["ngram", "draft"])
def spec_llm(request):
    """A small pool, so that running all prompts together preempts; k fixed at 4 (the tests of adaptation
    put a policy in)."""
    spec = SpeculativeConfig.parse(request.param, num_speculative_tokens=4, adaptive=False)
    return LLM(dtype="fp32", kv_dtype="model", speculative=spec, num_blocks=POOL, warmup=False)


class Scripted(SpecPolicy):
    """Drafts per decode from a fixed cycle, whatever was measured: k switches mid-request, 0 included."""

    def __init__(self, ks: list[int]) -> None:
        super().__init__(max(ks))
        self.ks, self.i = ks, 0

    def decide(self, req, st):
        self.i += 1
        return self.ks[self.i % len(self.ks)]


def _with_policy(llm_, policy, run):
    llm_.engine.core.use_spec_policy(policy)
    try:
        return run()
    finally:
        llm_.engine.core.use_spec_policy(None)


@pytest.mark.parametrize("policy", [lambda: Scripted([4, 0, 2, 0, 0, 1, 3, 4, 4, 0]), lambda: SpecPolicy(4)],
                         ids=["scripted", "measured"])
def test_greedy_with_k_switching_mid_request_equals_no_speculation(spec_llm, alone, policy):
    """k changing from one decode to the next (0, then drafts again: the draft model catches up on what it
    did not see) keeps greedy outputs, alone and batched under preemption; the perf lines say what was chosen."""
    one_by_one = _with_policy(spec_llm, policy(), lambda: [spec_llm.chat([{"role": "user", "content": p}], params)
                                                         for p, params in zip(PROMPTS, PARAMS)])
    assert_same_greedy(one_by_one, alone)
    together = _with_policy(spec_llm, policy(), lambda: chats(spec_llm))
    assert_same_greedy(together, alone)
    chosen = one_by_one[0].metrics.spec_k_chosen
    assert sum(chosen.values()) > 0 and timings(one_by_one[0])["spec_k_chosen"]
    assert any(line.startswith("drafts chosen") for line in perf_lines(one_by_one[0], 0.0))
    if isinstance(policy(), Scripted):                       # plain and drafted decodes in one request
        assert len(chosen) > 2 and 0 in chosen and one_by_one[0].metrics.spec_draft_tokens > 0
    pool = spec_llm.engine.core.kv.pool
    assert pool.num_free == pool.num_blocks


def test_greedy_alone_and_batched_with_preemption_equal_no_speculation(spec_llm, alone):
    one_by_one = [spec_llm.chat([{"role": "user", "content": p}], params) for p, params in zip(PROMPTS, PARAMS)]
    assert_same_greedy(one_by_one, alone)
    assert all(o.metrics.preemptions == 0 for o in one_by_one)
    together = chats(spec_llm)
    assert sum(o.metrics.preemptions for o in together) > 0
    assert_same_greedy(together, alone)
    pool = spec_llm.engine.core.kv.pool
    assert pool.num_free == pool.num_blocks
    for o in one_by_one + together:                          # logprobs for every committed token
        assert len(o.logprobs) == len(o.token_ids)
    spec = spec_llm.engine.core.spec
    assert spec.num_draft_tokens > 0 and 0 < spec.num_accepted_tokens <= spec.num_draft_tokens
    grounded = one_by_one[0].metrics                         # "repeat this text": drafts mostly right
    assert grounded.spec_acceptance_rate > 0.5 and grounded.spec_mean_accepted_len > 2


def test_seeded_sampling_reproduces_and_stop_strings_cut_like_without(spec_llm, llm):
    p = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=24, ignore_eos=True)
    a = spec_llm.chat([{"role": "user", "content": PROMPTS[1]}], p)
    b = spec_llm.chat([{"role": "user", "content": PROMPTS[1]}], p)
    assert a.token_ids == b.token_ids and a.metrics.spec_draft_tokens > 0
    ref = llm.chat([{"role": "user", "content": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=40))
    stop = ref.text[len(ref.text) // 2:len(ref.text) // 2 + 5]
    stopped = SamplingParams(temperature=0, max_tokens=40, stop=[stop])
    want = llm.chat([{"role": "user", "content": PROMPTS[0]}], stopped)
    got = spec_llm.chat([{"role": "user", "content": PROMPTS[0]}], stopped)
    assert got.text == want.text and got.finish_reason == "stop"
    assert got.token_ids == want.token_ids                  # no accepted draft past the stop string


SCHEMA = {"type": "object", "required": ["keeper", "lamp", "years"], "additionalProperties": False,
          "properties": {"keeper": {"type": "string"}, "lamp": {"enum": ["lit", "dark"]},
                         "years": {"type": "integer"}}}
ECHO = '{"keeper": "the lighthouse keeper", "lamp": "lit", "years": 40}'


def test_constrained_outputs_equal_no_speculation_and_reject_the_drafts_the_grammar_refuses(spec_llm, llm):
    """Drafts are cut at the first token the grammar refuses; the rows after accepted drafts are masked as
    if those drafts were committed: greedy outputs stay the plain engine's, alone and under preemption."""
    import json

    from phasewise import StructuredOutputs

    asks = [f"Repeat this JSON exactly: {ECHO}", f"Summarize as JSON:\n{TEXT}", "Describe a lighthouse as JSON.",
            f"Repeat this text word for word:\n{TEXT}"] * 2
    so = StructuredOutputs(json=SCHEMA)
    params = [SamplingParams(temperature=0, max_tokens=48, logprobs=5, structured_outputs=so)] * 6 + \
        [SamplingParams(temperature=0.9, seed=s, max_tokens=48, structured_outputs=so) for s in (1, 2)]
    messages = [[{"role": "user", "content": a}] for a in asks]
    want = llm.chat(messages[:6], params[:6])
    together = spec_llm.chat(messages, params)
    assert sum(o.metrics.preemptions for o in together) > 0
    for out, ref in zip(together, want):        # as assert_same_greedy, but a near tie may change the length
        first = next((i for i, (x, y) in enumerate(zip(out.token_ids, ref.token_ids)) if x != y), None)
        if first is None:
            assert out.token_ids == ref.token_ids, (out.text, ref.text)
        else:
            assert ref.token_ids[first] in dict(out.logprobs[first].top), (out.text, ref.text)
    assert json.loads(together[0].text) == json.loads(ECHO) and together[0].metrics.spec_accepted_tokens > 10
    for o in together:
        assert o.finish_reason == "length" or set(json.loads(o.text)) == {"keeper", "lamp", "years"}
    assert sum(o.metrics.spec_draft_tokens for o in together) > 0
    if spec_llm.engine.draft_model is not None:     # it drafts under the grammar: its drafts are seldom cut
        assert sum(o.metrics.spec_accepted_tokens for o in together) > 0.6 * sum(len(o.token_ids) for o in together)
    pool = spec_llm.engine.core.kv.pool
    assert pool.num_free == pool.num_blocks


def test_metrics_reach_timings_and_perf_lines(spec_llm):
    out = spec_llm.chat([{"role": "user", "content": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=24))
    t = timings(out)
    assert t["spec_draft_n"] == out.metrics.spec_draft_tokens > 0
    assert t["spec_accepted_n"] == out.metrics.spec_accepted_tokens
    assert 1 <= t["spec_mean_accepted_len"] <= 5 and 0 <= t["spec_acceptance_rate"] <= 1
    assert any(line.startswith("speculative") for line in perf_lines(out, 0.0))


def test_cli_flags_reach_the_config():
    for cmd in ("generate", "serve"):
        extra = ["hi"] if cmd == "generate" else []
        args = build_parser().parse_args([cmd, *extra, "--speculative", "draft:/x.gguf",
                                          "--num-speculative-tokens", "3", "--draft-quantization", "int8"])
        spec = speculative_config_from_args(args)
        assert (spec.method, spec.draft_model, spec.num_speculative_tokens, spec.draft_dtype) == \
            ("draft", "/x.gguf", 3, "int8")
    args = build_parser().parse_args(["generate", "hi", "--speculative", "ngram", "--ngram-min", "1"])
    spec = speculative_config_from_args(args)
    assert (spec.method, spec.ngram_min, spec.ngram_max, spec.adaptive) == ("ngram", 1, 4, True)
    args = build_parser().parse_args(["generate", "hi", "--speculative", "ngram", "--fixed-speculative-tokens"])
    assert not speculative_config_from_args(args).adaptive
    assert speculative_config_from_args(build_parser().parse_args(["generate", "hi"])).method is None


def test_server_metrics_expose_the_engine_totals(spec_llm):
    """Through AsyncEngine in process (the module's engine, handed back idle): /metrics' text."""
    import asyncio

    from phasewise.server import AsyncEngine
    from phasewise.server.metrics import ServerMetrics

    async def scenario() -> str:
        async_engine = AsyncEngine(spec_llm.engine)
        try:
            p = SamplingParams(temperature=0, max_tokens=16)
            deltas = [d async for d in async_engine.generate([{"role": "user", "content": PROMPTS[0]}], p, chat=True)]
            assert deltas[-1].finished
            await async_engine.call(lambda e: None)            # a turn later: the snapshot is published
            return ServerMetrics("m").render(async_engine.stats).decode()
        finally:
            async_engine.shutdown()

    text = asyncio.run(scenario())
    spec = spec_llm.engine.core.spec
    assert spec.num_draft_tokens > 0
    assert f'phasewise:spec_decode_num_drafts_total{{model_name="m"}} {float(spec.num_steps)}' in text
    assert f'phasewise:spec_decode_num_draft_tokens_total{{model_name="m"}} {float(spec.num_draft_tokens)}' in text
    assert (f'phasewise:spec_decode_num_accepted_tokens_total{{model_name="m"}} '
            f'{float(spec.num_accepted_tokens)}') in text
