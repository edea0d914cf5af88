"""Structured outputs on the default model: every kind of constraint holds, batched beside free requests,
under preemption, sampled, cut by max_tokens or a stop string; bad constraints are ValueErrors that say why;
the token masks themselves against llguidance's own matcher."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from phasewise import LLM, SamplingParams, StructuredOutputs
from phasewise.sampling.sampler import unpack_bitmask

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}}
ASK = [{"role": "user", "content": "Describe Alice, 31, as JSON."}]
GBNF = 'root ::= "The answer is " digit+ "."\ndigit ::= [0-9]'
LARK = 'start: "Colour: " COLOUR\nCOLOUR: "red" | "green" | "blue"'


def greedy(so: StructuredOutputs, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 64), structured_outputs=so, **kw)


@pytest.mark.parametrize("so, check", [
    (StructuredOutputs(json=PERSON), lambda t: jsonschema.validate(json.loads(t), PERSON)),
    (StructuredOutputs(json=json.dumps(PERSON)), lambda t: jsonschema.validate(json.loads(t), PERSON)),
    (StructuredOutputs(json_object=True), lambda t: isinstance(json.loads(t), dict) or pytest.fail(t)),
    (StructuredOutputs(regex=r"\d{3}-\d{4}"), lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t) or pytest.fail(t)),
    (StructuredOutputs(choice=["yes", "no", "it depends"]), lambda t: t in ("yes", "no", "it depends") or pytest.fail(t)),
    (StructuredOutputs(grammar=GBNF), lambda t: re.fullmatch(r"The answer is [0-9]+\.", t) or pytest.fail(t)),
    (StructuredOutputs(grammar=LARK), lambda t: re.fullmatch(r"Colour: (red|green|blue)", t) or pytest.fail(t)),
], ids=["schema", "schema-text", "json-object", "regex", "choice", "gbnf", "lark"])
def test_each_kind_of_constraint_holds_and_ends_the_request(llm, so, check):
    ask = [{"role": "user", "content": 'Reply with a JSON object with one key, "ok", set to true.'}] \
        if so.json_object else ASK
    out = llm.chat(ask, greedy(so, logprobs=2))
    assert out.finish_reason == "stop", out.text
    check(out.text)
    assert len(out.logprobs) == len(out.token_ids)


@pytest.mark.parametrize("so, words", [
    (StructuredOutputs(json={"type": "objekt"}), "invalid JSON schema"),
    (StructuredOutputs(json={"type": "string", "format": "no-such-format"}), "invalid JSON schema"),
    (StructuredOutputs(regex="(a"), "invalid regex"),
    (StructuredOutputs(grammar='root ::= "a" undefined'), "invalid grammar"),
    (StructuredOutputs(grammar="start: (("), "invalid grammar"),
])
def test_a_constraint_that_does_not_compile_is_a_value_error_naming_it(llm, so, words):
    with pytest.raises(ValueError, match=words):
        llm.chat(ASK, greedy(so))
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("kw", [{}, {"json": {}, "regex": "a"}, {"choice": []}, {"json": "{"}, {"json": "[1]"},
                                {"json": [1]}])
def test_structured_outputs_needs_exactly_one_valid_constraint(kw):
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputs(**kw)


def test_max_tokens_cuts_a_json_output_with_finish_reason_length(llm):
    out = llm.chat(ASK, greedy(StructuredOutputs(json=PERSON), max_tokens=5))
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_a_stop_string_ends_a_constrained_output(llm):
    out = llm.chat(ASK, greedy(StructuredOutputs(json=PERSON), stop=['"age"']))
    assert out.finish_reason == "stop" and out.stop_reason == '"age"' and '"age"' not in out.text


def test_constrained_beside_free_requests_and_under_preemption_equal_each_alone():
    """At the default precision (whose kernels compute a row the same way in any batch)."""
    so = [StructuredOutputs(json=PERSON), None, StructuredOutputs(regex=r"[A-Z][a-z]+ (is|was) [a-z ]{5,40}\."),
          None, StructuredOutputs(choice=["north", "south"]), StructuredOutputs(json_object=True)]
    asks = [ASK, [{"role": "user", "content": "Name a colour."}],
            [{"role": "user", "content": "Say something about Paris."}],
            [{"role": "user", "content": "Count to five."}], [{"role": "user", "content": "Which way is warmer?"}],
            [{"role": "user", "content": 'Reply with a JSON object with one key, "ok", set to true.'}]]
    params = [greedy(s, max_tokens=32, logprobs=5) for s in so]
    fast = LLM(kv_cache_memory=0.1, warmup=False)
    alone = [fast.chat(a, p) for a, p in zip(asks, params)]
    together = fast.chat(asks, params)
    small = LLM(num_blocks=8, max_num_seqs=6, warmup=False)
    preempted = small.chat(asks, params)
    assert sum(o.metrics.preemptions for o in preempted) > 0
    for outs in (together, preempted):
        for out, ref in zip(outs, alone):
            first = next((i for i, (x, y) in enumerate(zip(out.token_ids, ref.token_ids)) if x != y), None)
            if first is None:
                assert out.token_ids == ref.token_ids and out.finish_reason == ref.finish_reason
            else:   # a floating-point near tie (tests/test_engine_model.py): both in the other's top 5
                assert ref.token_ids[first] in dict(out.logprobs[first].top), (out.text, ref.text)
    jsonschema.validate(json.loads(alone[0].text), PERSON)
    assert small.engine.core.kv.pool.num_free == 8


def test_sampled_choices_all_hold_the_schema(llm):
    outs = llm.generate(["A person:"] * 6, [SamplingParams(temperature=1.2, top_p=0.95, max_tokens=120, seed=seed,
                                                          structured_outputs=StructuredOutputs(json=PERSON))
                                           for seed in range(6)])
    assert len({o.text for o in outs}) > 1
    for o in outs:
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), PERSON)
        else:
            assert o.finish_reason == "length"


def test_grammars_compile_once_per_distinct_constraint(llm):
    grammars = llm.engine.grammars
    llm.chat(ASK, greedy(StructuredOutputs(regex="x{2}")))
    n = len(grammars._cache)
    llm.chat(ASK, greedy(StructuredOutputs(regex="x{2}")))
    assert len(grammars._cache) == n
    llm.chat(ASK, greedy(StructuredOutputs(regex="x{3}")))
    assert len(grammars._cache) == n + 1


def test_the_offline_api_renders_tools_and_a_grammar_forces_the_call(llm):
    from phasewise.tool_calling import ToolCallParser, call_grammar

    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["word"],
        "properties": {"word": {"type": "string", "maxLength": 20}}}}}]
    fmt = llm.tokenizer.tool_format
    out = llm.chat([{"role": "user", "content": "What does 'lighthouse' mean?"}],
                   greedy(StructuredOutputs(grammar=call_grammar(tools, fmt, "lookup", parallel=False))), tools=tools)
    parser = ToolCallParser(fmt)
    parser.feed(out.text, final=True)
    assert out.finish_reason == "stop" and [c.name for c in parser.calls] == ["lookup"]
    jsonschema.validate(json.loads(parser.calls[0].arguments), tools[0]["function"]["parameters"])
    assert '"name": "lookup"' in llm.tokenizer.render_chat([{"role": "user", "content": "hi"}], tools=tools)


class _Grammar:
    """A grammar that allows a fixed set of tokens (what the runner asks of one)."""

    constrains = True

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed

    def valid_prefix(self, tokens) -> int:
        return int(tokens[0] in self.allowed)

    def fill(self, bitmask, row, drafts=()) -> None:
        bitmask[row] = 0
        for t in self.allowed:
            bitmask[row, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))


class _Req:
    def __init__(self, i: int, params: SamplingParams, grammar: _Grammar) -> None:
        self.request_id, self.sampling_params, self.grammar = f"r{i}", params, grammar
        self.prompt_token_ids, self.output_token_ids, self.generator = [1], [], None


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_p=0.8)], ids=["greedy", "t=1", "top-p"])
def test_sampling_first_and_masking_only_refused_tokens_is_exact(params):
    """The sample stage (StepMasks) samples rows without filters unmasked and masks only those whose token the grammar
    refuses, then takes the argmax of the same draws over the allowed tokens: the tokens are distributed
    as under the mask from the start (greedy: the same argmax)."""
    from phasewise.runner.model_runner import ModelRunner
    from phasewise.sampling.metadata import SamplingMetadata
    from phasewise.sampling.sampler import sample
    from phasewise.structured import StepMasks

    V, allowed, rows = 40, {1, 3, 6, 33}, 4000
    runner = ModelRunner.__new__(ModelRunner)
    runner.vocab_size, runner.device, runner.kernels, runner.eos_token_ids = V, torch.device("cpu"), None, frozenset()
    torch.manual_seed(0)
    logits = torch.randn(V).repeat(rows, 1)
    logits[:, 33] += 1.5
    reqs = [_Req(i, params, _Grammar(allowed)) for i in range(rows)]
    masks = StepMasks(reqs, [], V)              # top-p: every mask up front; otherwise none until refused
    assert (masks.sampling is None) == (params.top_p == 1)
    got = runner._sample(logits, reqs, masks.sampling, masks.check)
    tokens = np.array([got[r.request_id].token_id for r in reqs])
    assert set(tokens) <= allowed
    masked = logits[0].clone()
    masked[[t for t in range(V) if t not in allowed]] = float("-inf")
    if params.temperature == 0:
        assert (tokens == int(masked.argmax())).all()
        return
    want = sample(masked.repeat(rows, 1), SamplingMetadata.build([params] * rows, [[1]] * rows, [[]] * rows,
                                                                 [None] * rows, V, frozenset())).token_ids.numpy()
    for t in allowed:                          # frequencies within 3% (4,000 draws: sd <= 0.8%)
        assert abs((tokens == t).mean() - (want == t).mean()) < 0.03, t


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=1, max_size=70), min_size=1, max_size=4))
def test_unpacked_bitmask_has_the_bits_of_each_word(rows):
    V = len(rows[0])
    bits = np.array([(r + [False] * V)[:V] for r in rows])
    padded = np.pad(bits, ((0, 0), (0, -V % 32)))
    words = (padded.reshape(len(rows), -1, 32).astype(np.int64) << np.arange(32)).sum(-1).astype(np.uint32)
    got = unpack_bitmask(words.view(np.int32), V, torch.device("cpu"))
    assert got.tolist() == bits.tolist()


def test_masks_after_drafts_are_the_masks_after_committing_them(llm):
    """The runner's rows for a draft chunk equal the masks of a matcher advanced token by token."""
    from phasewise.structured import grammar_bitmask

    grammars, tok = llm.engine.grammars, llm.tokenizer
    drafts = tok.encode('{"name": "Al', add_special_tokens=False)
    live = grammars.compile(StructuredOutputs(json=PERSON))
    assert live.valid_prefix(drafts + tok.encode("\n", add_special_tokens=False)) == len(drafts)   # not in a string
    rows = grammar_bitmask([(None, ()), (live, drafts)], grammars.vocab_size)
    assert (rows[0] == -1).all()
    stepped = grammars.compile(StructuredOutputs(json=PERSON))
    for i in range(len(drafts) + 1):
        one = grammar_bitmask([(stepped, ())], grammars.vocab_size)
        assert (one[0] == rows[1 + i]).all(), i
        if i < len(drafts):
            assert stepped.accept(drafts[i])
    assert live.valid_prefix(drafts) == len(drafts)        # filling the draft rows left it where it was
    # drafts that complete the grammar and end the sequence: the matcher comes back to where it was
    done = tok.encode('{"name": "Al", "age": 3, "tags": []}', add_special_tokens=False) + [min(tok.eos_token_ids)]
    fresh = grammars.compile(StructuredOutputs(json=PERSON))
    assert fresh.valid_prefix(done) == len(done)
    grammar_bitmask([(fresh, done)], grammars.vocab_size)
    assert fresh.valid_prefix(done) == len(done) and all(fresh.accept(t) for t in done[:-1]) and fresh.finished
