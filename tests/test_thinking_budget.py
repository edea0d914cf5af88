"""Thinking budgets kept by the engine (SamplingParams.thinking, structured/thinking_gate.py) on the default
model, with prompts written the way Qwen3-style templates end (the block opened for the reply, or not):
a budget of N gives at most N thinking tokens, then the closing tag and an answer; the thinking itself is
what the model writes without a budget; a grammar holds on the answer only (unless it spells the block
itself); batched, preempted and speculative runs give the same tokens; the gate's masks after drafts are
the masks after accepting them."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from phasewise import LLM, SamplingParams, StructuredOutputs
from phasewise.core.request import RequestMetrics
from phasewise.core.sampling_params import ThinkingBlock

pytestmark = pytest.mark.slow

OPENED = "<|im_start|>user\nWhat is 1 plus 2?<|im_end|>\n<|im_start|>assistant\n<think>\n"   # Qwen3.5's way
CLOSED = "<|im_start|>user\nWhat is 1 plus 2?<|im_end|>\n<|im_start|>assistant\n"             # Qwen3's way
SCHEMA = {"type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"],
          "additionalProperties": False}
CLOSE = "</think>\n\n"


def params(budget: int | None, max_tokens: int = 40, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, thinking=ThinkingBlock(budget=budget), **kw)


def split(text: str) -> tuple[str, str]:
    thought, _, answer = text.partition(CLOSE)
    return thought, answer


@pytest.fixture(scope="module")
def free(llm):
    """What the model writes with no thinking block tracked and no end of sequence (as inside a block with a
    budget or a grammar): the reference."""
    return llm.generate([OPENED], SamplingParams(temperature=0, max_tokens=40, min_tokens=40))[0]


@pytest.mark.parametrize("budget", [0, 16])
def test_a_budget_gives_at_most_n_thinking_tokens_then_an_answer(llm, free, budget):
    out = llm.generate([OPENED], params(budget))[0]
    m = out.metrics
    assert m.thinking_tracked and m.thinking_tokens == budget and m.answer_start is not None
    n_close = len(llm.engine.tokenizer.encode(CLOSE, add_special_tokens=False))
    assert m.answer_start == budget + n_close
    assert out.token_ids[:budget] == free.token_ids[:budget]          # the thinking is the model's own
    thought, answer = split(out.text)
    assert out.text.startswith(thought + CLOSE) and answer.strip()     # then an answer
    assert m.ttfa_ms is not None and m.ttfa_ms > m.ttft_ms >= 0
    assert (m.thinking_ms > 0) == (budget > 0)


def test_without_a_budget_the_thinking_is_only_tracked(llm):
    plain = llm.generate([OPENED], SamplingParams(temperature=0, max_tokens=40))[0]
    out = llm.generate([OPENED], params(None))[0]
    assert out.token_ids == plain.token_ids                            # nothing is forced or refused
    assert out.metrics.thinking_tokens == len(out.token_ids) - (out.finish_reason == "stop")
    assert out.metrics.answer_start is None and out.metrics.ttfa_ms is None   # it never closed the block


def test_a_grammar_holds_after_the_block(llm, free):
    out = llm.generate([OPENED], params(8, max_tokens=60, structured_outputs=StructuredOutputs(json=SCHEMA)))[0]
    assert out.finish_reason == "stop"
    thought, answer = split(out.text)
    assert out.token_ids[:8] == free.token_ids[:8]                     # free thinking, then the schema
    jsonschema.validate(json.loads(answer), SCHEMA)
    unlimited = llm.generate([OPENED], params(None, max_tokens=12, structured_outputs=StructuredOutputs(json=SCHEMA)))
    assert unlimited[0].token_ids == free.token_ids[:12]               # thinking is free while it lasts


def test_a_reply_that_opens_the_block_itself(llm):
    """The prompt leaves no block open: the reply may open one (the start tag's tokens) or answer."""
    out = llm.generate([CLOSED], params(4, max_tokens=60, structured_outputs=StructuredOutputs(json=SCHEMA)))[0]
    assert out.finish_reason == "stop"
    if out.text.startswith("<think>"):
        thought, answer = split(out.text[len("<think>"):])
        assert out.metrics.thinking_tokens <= 4
    else:
        answer = out.text
        assert out.metrics.thinking_tokens == 0 and out.metrics.answer_start == 0
    jsonschema.validate(json.loads(answer), SCHEMA)


def test_a_grammar_that_spells_the_block_keeps_the_whole_reply(llm):
    so = StructuredOutputs(regex=r"<think>I think\.</think>The answer\.")
    out = llm.generate([CLOSED], params(1, structured_outputs=so))[0]
    assert out.text == "<think>I think.</think>The answer." and out.finish_reason == "stop"
    assert out.metrics.thinking_tokens >= 2 and out.metrics.answer_start is not None   # counted, not cut


def _asks() -> tuple[list[str], list[SamplingParams]]:
    prompts = [OPENED.replace("1 plus 2", q) for q in ("1 plus 2", "the capital of France", "a colour", "2 times 3")]
    budgets = [0, 16, None, 5]
    so = [None, None, None, StructuredOutputs(json=SCHEMA)]
    return prompts, [params(b, max_tokens=32, logprobs=5, structured_outputs=s) for b, s in zip(budgets, so)]


def assert_same(outs, refs) -> None:
    for out, ref in zip(outs, refs):
        first = next((i for i, (x, y) in enumerate(zip(out.token_ids, ref.token_ids)) if x != y), None)
        if first is None:
            assert out.token_ids == ref.token_ids
            assert out.metrics.thinking_tokens == ref.metrics.thinking_tokens
            assert out.metrics.answer_start == ref.metrics.answer_start
        else:   # a floating-point near tie (tests/test_engine_model.py): both in the other's top 5
            assert ref.token_ids[first] in dict(out.logprobs[first].top), (out.text, ref.text)


def test_budgets_batched_preempted_and_speculative_equal_each_alone(llm):
    prompts, ps = _asks()
    alone = [llm.generate([p], q)[0] for p, q in zip(prompts, ps)]
    for out, q in zip(alone, ps):
        budget = q.thinking.budget if q.thinking else None
        assert budget is None or out.metrics.thinking_tokens <= budget
    assert_same(llm.generate(prompts, ps), alone)
    small = LLM(dtype="fp32", kv_dtype="model", num_blocks=6, max_num_seqs=4, warmup=False)
    preempted = small.generate(prompts, ps)
    assert sum(o.metrics.preemptions for o in preempted) > 0
    assert_same(preempted, alone)
    for method in ("ngram", "draft"):
        spec = LLM(dtype="fp32", kv_dtype="model", speculative=method, num_speculative_tokens=4, warmup=False)
        assert_same(spec.generate(prompts, ps), alone)
        assert spec.engine.core.spec.num_draft_tokens > 0


# ---- the gate alone: masks after drafts are the masks after accepting them -------------------------------------

@pytest.fixture(scope="module")
def gates(llm):
    from phasewise.structured import ThinkingGates
    tokenizer = llm.engine.tokenizer
    return ThinkingGates(tokenizer, tokenizer.eos_token_ids), llm.engine.grammars, tokenizer


def allowed(gate, vocab: int, drafts=()) -> list[np.ndarray]:
    words = np.full((len(drafts) + 1, (vocab + 31) // 32), -1, dtype=np.int32)
    gate.fill(words, 0, drafts)
    return [np.flatnonzero(np.unpackbits(w.view(np.uint8), bitorder="little")[:vocab]) for w in words]


def test_a_block_the_prompt_closed_leaves_the_reply_to_answer(gates):
    """A template that turns thinking off writes an empty block: the reply is all answer, held to its grammar
    from the first token (no block to open)."""
    factory, compiler, tokenizer = gates
    prompt = tokenizer.encode(CLOSED + "<think>\n\n</think>\n\n", add_special_tokens=False)
    metrics = RequestMetrics(arrival=0.0)
    gate = factory.gate(ThinkingBlock(budget=3), prompt, compiler.compile(StructuredOutputs(json=SCHEMA)), metrics)
    assert gate.phase == "answer" and metrics.answer_start == 0
    assert gate.valid_prefix(tokenizer.encode("<think>", add_special_tokens=False)) == 0
    free = factory.gate(ThinkingBlock(budget=3), prompt, None, RequestMetrics(arrival=0.0))
    assert free.phase == "answer" and not free.constrains


@pytest.mark.parametrize("opened, so", [(True, None), (True, StructuredOutputs(json=SCHEMA)),
                                        (False, StructuredOutputs(json=SCHEMA)), (False, None)])
def test_gate_masks_after_drafts_equal_masks_after_accepting(gates, opened, so):
    factory, compiler, tokenizer = gates
    prompt = tokenizer.encode(OPENED if opened else CLOSED, add_special_tokens=False)
    reply = [t for text in ("" if opened else "<think>", "one two", CLOSE, '{"sum": 3}')
             for t in tokenizer.encode(text, add_special_tokens=False)]       # the tags as the gate writes them
    vocab = compiler.vocab_size

    def gate():
        return factory.gate(ThinkingBlock(budget=2), prompt, compiler.compile(so) if so else None,
                            RequestMetrics(arrival=0.0))
    g = gate()
    assert g.valid_prefix(reply) == len(reply)
    drafted = allowed(g, vocab, reply[:10])               # drafts across every phase
    stepped = gate()
    for i, t in enumerate(reply[:10]):
        assert np.array_equal(drafted[i], allowed(stepped, vocab)[0]), i
        assert stepped.accept(t), (i, t)
    assert g.valid_prefix(reply) == len(reply)                          # the drafts left it where it was
    for t in reply[10:]:
        assert stepped.accept(t)
    assert stepped.error is None and stepped.phase == "answer"
    eos = next(iter(tokenizer.eos_token_ids))
    assert g.valid_prefix([*reply, eos]) == len(reply) + 1                  # a draft that ends it, checked
    assert g.valid_prefix(reply) == len(reply)                              # without consuming it
    bad = gate()
    if opened:                                                          # no end of sequence while thinking
        assert bad.valid_prefix([eos]) == 0 and not bad.accept(eos) and bad.finished


# ---- a budget never cuts a character: the default model's byte-level BPE writes 🎉 as three tokens ---------------

PARTY = "<|im_start|>user\nCelebrate!<|im_end|>\n<|im_start|>assistant\n<think>\n" + "\U0001F389" * 6


@pytest.mark.parametrize("budget", range(1, 8))
def test_a_budget_never_cuts_a_character(llm, budget):
    """The model goes on writing 🎉 (three tokens): wherever the budget falls, the block closes on a whole
    character (its last tokens finish one or start none), after exactly `budget` thinking tokens."""
    free = llm.generate([PARTY], SamplingParams(temperature=0, max_tokens=9, min_tokens=9))[0]
    assert free.text == "\U0001F389" * 3                               # what the model writes unbounded
    out = llm.generate([PARTY], params(budget, max_tokens=24))[0]
    assert out.metrics.thinking_tokens == budget
    thought = b"".join(llm.engine.tokenizer.token_bytes(t) for t in out.token_ids[:budget])
    assert thought.decode("utf-8") + CLOSE in out.text                 # whole UTF-8 (no U+FFFD), then closed
    assert budget % 3 or out.token_ids[:budget] == free.token_ids[:budget]   # whole emoji: the model's own


def test_utf8_masks_are_what_each_token_allows(gates):
    from phasewise.structured.utf8_masks import Utf8Masks, utf8_after

    factory, compiler, tokenizer = gates
    assert [utf8_after(0, "\U0001F389".encode()[:n]) for n in range(5)] == [0, 3, 2, 1, 0]
    assert utf8_after(1, b"a") == utf8_after(0, b"\x89") == 4                  # broken either way
    masks, n_words = Utf8Masks(tokenizer.token_bytes, tokenizer.vocab_size), (compiler.vocab_size + 31) // 32
    for state, left in ((0, 1), (2, 2), (3, 3), (1, 1)):
        bits = np.unpackbits(masks.words(state, left, n_words).view(np.uint8), bitorder="little")
        expected = [masks.allows(state, tokenizer.token_bytes(t), left) for t in range(tokenizer.vocab_size)]
        assert bits[:tokenizer.vocab_size].astype(bool).tolist() == expected, (state, left)
