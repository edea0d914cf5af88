"""Speculative decoding in the torch-free engine core: a fake target, fake and n-gram proposers.

The fake target emits a token that depends only on the request and the position, and
"verifies" drafts greedily against it; its KV cache is a dict slot -> token, so any KV
read before it was written with the committed token is caught.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from hypothesis import given, settings, strategies as st

from phasewise.config import SchedulerConfig, SpeculativeConfig
from phasewise.core.engine_core import EngineCore
from phasewise.core.handoffs import RunnerOutput, SampledToken, SchedulerOutput
from phasewise.core.request import FinishReason, Request, RequestStatus
from phasewise.core.sampling_params import SamplingParams
from phasewise.runner.request_state import RequestStates
from phasewise.spec_decode.ngram import NgramIndex, NgramProposer

BS = 4


def token_for(request_id: str, position: int) -> int:
    return 1 + zlib.crc32(f"{request_id}:{position}".encode()) % 97


class FakeTarget:
    """Checks KV and slots like test_engine_core's FakeRunner, drafts included."""

    def __init__(self, proposer, target=token_for) -> None:
        self.proposer, self.target = proposer, target
        self.steps: list[SchedulerOutput] = []
        self.slots: dict[int, int] = {}
        self.seen: list[list[tuple[int, int]]] = []   # per step: (draft room, outputs so far) per chunk
        self.requests = RequestStates(torch.device("cpu"))

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self.steps.append(sched)
        self.requests.update(sched.new_requests, sched.finished_ids, sched.chunks)
        wanted = [c for c in sched.chunks if c.max_draft_tokens]     # the runner's proposer fills the room
        self.proposer.propose(wanted, [self.requests[c.request_id] for c in wanted])
        sched.num_draft_tokens = sum(len(c.draft_token_ids) for c in wanted)
        self.seen.append([(c.max_draft_tokens, len(self.requests[c.request_id].output_token_ids))
                          for c in sched.chunks])
        sampled, accepted = {}, {}
        for c in sched.chunks:
            r, start, n, table = self.requests[c.request_id], c.start, c.num_scheduled_tokens, c.block_tables[0]
            assert len(c.draft_token_ids) <= c.max_draft_tokens
            assert len(table) * BS >= start + n                   # slots for the drafts too
            slot = [table[p // BS] * BS + p % BS for p in range(start + n)]
            for p in range(start):
                assert self.slots.get(slot[p]) == r.token_ids[p], f"{r.request_id}: stale KV at {p}"
            for p, t in zip(range(start, start + n), c.input_token_ids):
                self.slots[slot[p]] = t
            if not c.samples:
                assert not c.draft_token_ids
                continue
            T, ok = r.num_tokens, []
            for i, d in enumerate(c.draft_token_ids):
                if d != self.target(r.request_id, T + i):
                    break
                ok.append(SampledToken(d))
            sampled[r.request_id] = SampledToken(self.target(r.request_id, T + len(ok)))
            if c.draft_token_ids:
                accepted[r.request_id] = ok
        out = RunnerOutput(sampled, accepted)
        self.requests.commit(out)
        return out


class FakeProposer:
    """Proposes the target's tokens, a wrong one where a hash says so, and sometimes fewer."""

    def __init__(self, wrong_one_in: int = 3, target=token_for) -> None:
        self.wrong, self.target = wrong_one_in, target

    def propose(self, chunks, states) -> None:
        for c, r in zip(chunks, states):
            T = r.num_tokens
            h = zlib.crc32(f"{r.request_id}/{T}".encode())
            k = c.max_draft_tokens - h % 2
            c.draft_token_ids = [self.target(r.request_id, T + i) if (h >> (i + 1)) % self.wrong else 0
                                 for i in range(k)]


def make_core(num_blocks=64, budget=32, max_seqs=8, k=4, proposer=None, prefix_caching=True, target=token_for):
    runner = FakeTarget(proposer or FakeProposer(target=target), target)
    core = EngineCore(runner, SchedulerConfig(budget, max_seqs), num_blocks, BS, 10_000, prefix_caching, k)
    return core, runner


def request(rid: str, prompt, max_tokens: int, **kw) -> Request:
    prompt = list(range(1, prompt + 1)) if isinstance(prompt, int) else prompt
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw), frozenset({0}))


def run_all(core: EngineCore, check=lambda: None) -> dict[str, Request]:
    done = {}
    for _ in range(10_000):
        if not core.has_unfinished():
            return done
        for o in core.step():
            assert o.new_token_ids == o.request.output_token_ids[len(o.request.output_token_ids)
                                                                   - len(o.new_token_ids):]
            if o.finished:
                done[o.request_id] = o.request
        check()
    raise AssertionError("engine did not finish")


def expected(r: Request) -> list[int]:
    n = r.num_prompt_tokens
    return [token_for(r.request_id, n + i) for i in range(len(r.output_token_ids))]


def test_drafts_are_verified_and_rejected_ones_do_not_advance():
    core, runner = make_core()
    r = request("a", 6, 30)
    core.add_request(r)
    records = []
    run_all(core, lambda: records.append(core.last_step))
    assert r.output_token_ids == expected(r) and len(r.output_token_ids) == 30
    m = r.metrics
    assert 0 < m.spec_accepted_tokens < m.spec_draft_tokens
    assert len(runner.steps) < 30                                  # several tokens per step
    assert m.spec_draft_tokens == sum(len(c.draft_token_ids) for s in runner.steps for c in s.chunks)
    assert core.spec.num_draft_tokens == m.spec_draft_tokens and core.spec.num_accepted_tokens == m.spec_accepted_tokens
    assert sum(s.num_accepted_tokens for s in records) == m.spec_accepted_tokens
    assert 1 < m.spec_mean_accepted_len <= 5 and 0 < m.spec_acceptance_rate < 1
    assert len(set(m.token_times)) < len(m.token_times)           # tokens of one step share its time
    assert core.kv.pool.num_free == 64


def test_drafts_fit_the_budget_max_tokens_and_are_dropped_before_preempting():
    core, runner = make_core(budget=3, k=4)
    r = request("a", 2, 7)
    core.add_request(r)
    run_all(core)
    for s, seen in zip(runner.steps, runner.seen):
        assert sum(c.num_scheduled_tokens for c in s.chunks) <= 3
        for room, n_out in seen:
            assert room <= max(0, min(2, 7 - n_out - 1))
    assert r.output_token_ids == expected(r) and len(r.output_token_ids) == 7

    core, runner = make_core(num_blocks=3, budget=64, k=4)        # room for one request's drafts only
    a, b = request("a", 3, 5), request("b", 3, 5, seed=1)
    core.add_request(a)
    core.add_request(b)
    core.step()                                                    # both prefill: one block each
    core.step()
    assert [c.max_draft_tokens for c in runner.steps[-1].chunks] == [3, 0]
    assert b.status is RequestStatus.RUNNING and b.metrics.preemptions == 0
    run_all(core)                                                  # (later the pool really is short)
    assert a.output_token_ids == expected(a) and b.output_token_ids == expected(b)


def test_stop_token_inside_accepted_drafts_ends_the_request_there():
    out = [token_for("s", p) for p in range(2, 40)]
    stop = out[5]
    core, _ = make_core(proposer=FakeProposer(wrong_one_in=1000))
    r = Request("s", [5, 6], SamplingParams(max_tokens=30, stop_token_ids=[stop]), frozenset())
    core.add_request(r)
    run_all(core)
    assert r.finish_reason is FinishReason.STOP and r.output_token_ids == out[:out.index(stop) + 1]
    assert core.kv.pool.num_free == 64


def test_ngram_index_proposes_the_latest_longest_match():
    idx = NgramIndex(1, 3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert idx.propose(tokens, 3) == [7, 8, 5]                     # "2 3" last followed by 7 8 5
    tokens += [7, 1, 2, 3]
    assert idx.propose(tokens, 2) == [7, 8]                        # "1 2 3" beats the later "2 3"
    assert idx.propose([4, 5, 6], 3) == []                         # no earlier occurrence (new index)
    assert NgramIndex(2, 2).propose([1, 2, 1], 4) == []            # "2 1" never seen before
    assert NgramIndex(1, 1).propose([1, 2, 1], 4) == [2, 1]


def cyclic(request_id: str, position: int) -> int:
    return position % 8 + 1


def test_ngram_proposer_on_a_repeating_target_accepts_everything():
    core, runner = make_core(proposer=NgramProposer(2, 4), k=4, target=cyclic)
    r = request("c", list(range(1, 9)) * 2, 40)
    core.add_request(r)
    run_all(core)
    assert r.output_token_ids == [cyclic("c", 16 + i) for i in range(40)]
    assert r.metrics.spec_acceptance_rate == 1.0
    assert len(runner.steps) == 1 + 8            # prefill, then 7 steps of 5 tokens and one of 4 (max_tokens)


def test_speculative_config_parsing():
    assert SpeculativeConfig.parse(None).method is None and not SpeculativeConfig.parse("").enabled
    assert SpeculativeConfig.parse("ngram", num_speculative_tokens=3).num_speculative_tokens == 3
    d = SpeculativeConfig.parse("draft:/m.gguf", draft_dtype="int8")
    assert (d.method, d.draft_model, d.draft_dtype) == ("draft", "/m.gguf", "int8")
    assert SpeculativeConfig.parse("draft").draft_model is None
    for bad in ("eagle", "ngram:3"):
        with pytest.raises(ValueError):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError):
        SpeculativeConfig(method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError):
        SpeculativeConfig(method="ngram", ngram_min=3, ngram_max=2)


def cached_blocks_hold_their_tokens(core: EngineCore, runner: FakeTarget) -> None:
    """The prefix cache only ever holds committed tokens: a cached block's KV is its key's tokens."""
    pool = core.kv.pool
    for b in pool.cached.values():
        tokens = pool.block_key[b][1]
        assert [runner.slots.get(b * BS + i) for i in range(BS)] == list(tokens)


@settings(max_examples=60, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 25), st.integers(0, 2)), min_size=1, max_size=8),
    num_blocks=st.integers(10, 40),
    budget=st.integers(1, 24),
    max_seqs=st.integers(1, 6),
    k=st.integers(1, 5),
    wrong=st.integers(1, 5),
    abort_at=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 7)), max_size=3),
    prefix_caching=st.booleans(),
)
def test_random_streams_with_drafts_keep_outputs_and_leak_nothing(reqs, num_blocks, budget, max_seqs, k, wrong,
                                                                  abort_at, prefix_caching):
    core, runner = make_core(num_blocks, budget, max_seqs, k, FakeProposer(wrong), prefix_caching)
    pool = core.kv.pool
    added = []
    for i, (p, m, family) in enumerate(reqs):
        if core.blocks_needed(p + m) <= num_blocks:          # what admission lets through (engine/admission.py)
            core.add_request(r := request(f"r{i}", [100 * family + j for j in range(1, p + 1)], m))
            added.append(r)
    step = 0
    while core.has_unfinished():
        for when, which in abort_at:
            if when == step and which < len(added):
                core.abort(added[which].request_id)
        ran = len(runner.steps)
        core.step()
        step += 1
        assert step < 5_000
        if len(runner.steps) > ran:                      # (not when an abort emptied the engine)
            sched = runner.steps[-1]
            assert sum(c.num_scheduled_tokens for c in sched.chunks) <= budget
            assert len(sched.chunks) <= max_seqs
        held = [b for r in added if r.status is RequestStatus.RUNNING for b in r.block_ids]
        assert len(set(held)) == num_blocks - pool.num_free
        assert sorted(held) == sorted(b for b in range(num_blocks) for _ in range(pool.ref_counts[b]))
        for r in added:
            assert r.num_computed_tokens <= r.num_tokens
        cached_blocks_hold_their_tokens(core, runner)
    assert pool.num_free == num_blocks and not core.scheduler.running and not core.scheduler.waiting
    for r in added:
        assert r.is_finished
        if r.finish_reason is FinishReason.LENGTH:
            assert r.output_token_ids == expected(r)
            assert len(r.output_token_ids) == r.sampling_params.max_tokens


def test_draft_state_keeps_only_the_fed_drafts_that_were_accepted():
    from phasewise.spec_decode.draft_model import DraftState

    st = DraftState(num_committed=5, fed=[50, 51, 52])    # drafts fed at positions 5, 6, 7
    committed = [1, 2, 3, 4, 5]
    assert st.valid(committed + [50, 51, 99, 7]) == 7     # 50, 51 accepted, 52 rejected (99 instead)
    assert st.valid(committed + [98]) == 5                # the first draft rejected
    assert st.valid(committed + [50, 51, 52, 53, 54]) == 8   # all accepted, then the bonus
    assert st.valid(committed + [50]) == 6                # the request has not gone further
