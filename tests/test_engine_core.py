"""The torch-free engine core: block pool, KV manager, scheduler and EngineCore with a fake runner."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import zlib

import pytest
import torch
from hypothesis import given, settings, strategies as st

from phasewise.config import SchedulerConfig
from phasewise.core.block_pool import BlockPool, CacheStats
from phasewise.core.engine_core import EngineCore
from phasewise.core.handoffs import RunnerOutput, SampledToken, SchedulerOutput
from phasewise.core.request import FinishReason, Request, RequestStatus
from phasewise.report import percentile
from phasewise.core.sampling_params import SamplingParams
from phasewise.runner.request_state import RequestStates

EOS = 0


class FakeRunner:
    """Emits a token that depends only on the request and its position, never EOS unless told."""

    def __init__(self, block_size: int = 4) -> None:
        self.bs = block_size
        self.steps: list[SchedulerOutput] = []
        self.slots: dict[int, int] = {}   # the "KV cache": slot → the token whose KV it holds
        self.requests = RequestStates(torch.device("cpu"))   # what the runner knows, from plain data only

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Checks that every earlier position's KV is in place (computed or a prefix-cache hit),
        then "computes" the chunk's KV into its slots."""
        self.steps.append(sched)
        self.requests.update(sched.new_requests, sched.finished_ids, sched.chunks)
        sampled = {}
        for c in sched.chunks:
            r, start, table = self.requests[c.request_id], c.start, c.block_tables[0]
            assert c.num_tokens >= 1 and c.token_ids == r.token_ids[start:start + c.num_tokens]
            assert len(table) * self.bs >= start + c.num_tokens  # room for the KV
            slot = [table[p // self.bs] * self.bs + p % self.bs for p in range(start + c.num_tokens)]
            for p in range(start):
                assert self.slots.get(slot[p]) == r.token_ids[p], f"{r.request_id}: stale KV at {p}"
            for p in range(start, start + c.num_tokens):
                self.slots[slot[p]] = r.token_ids[p]
            if c.samples:
                sampled[r.request_id] = SampledToken(token_for(r.request_id, r.num_tokens))
        out = RunnerOutput(sampled)
        self.requests.commit(out)
        return out


def token_for(request_id: str, position: int) -> int:
    """Deterministic across processes (str hashes are salted per process; crc32 is not)."""
    return 1 + zlib.crc32(f"{request_id}:{position}".encode()) % 97


def make_core(num_blocks=64, budget=16, max_seqs=8, max_len=512, prefix_caching=True):
    runner = FakeRunner()
    core = EngineCore(runner, SchedulerConfig(budget, max_seqs), num_blocks, 4, max_len, prefix_caching)
    return core, runner


def request(rid: str, prompt_len: int, max_tokens: int, family: int = 0) -> Request:
    prompt = [100 * family + i for i in range(1, prompt_len + 1)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), frozenset({EOS}))


def run_all(core: EngineCore) -> dict[str, Request]:
    done = {}
    for _ in range(10_000):
        if not core.has_unfinished():
            return done
        for o in core.step():
            if o.finished:
                done[o.request_id] = o.request
    raise AssertionError("engine did not finish")


def add_and_drive(core: EngineCore, reqs, abort_at, fits, after_step) -> list[Request]:
    """Add the (prompt length, max tokens, family) requests that `fits` (what admission lets through:
    engine/admission.py, tests/test_admission.py), then step until all finish, aborting (step, request
    index) pairs and calling after_step() each step."""
    added = []
    for i, (p, m, family) in enumerate(reqs):
        if fits(p + m):
            core.add_request(r := request(f"r{i}", p, m, family))
            added.append(r)
    step = 0
    while core.has_unfinished():
        for when, which in abort_at:
            if when == step and which < len(added):
                core.abort(added[which].request_id)
        core.step()
        step += 1
        assert step < 5_000
        after_step(added)
    return added


def test_engine_core_imports_no_torch():
    code = "import sys, phasewise, phasewise.core.engine_core; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_block_pool_exact_ids_and_order():
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.allocate(2) is None and pool.num_free == 1
    pool.free([4, 3, 2])                       # uncached: the last freed is the first taken back
    assert pool.allocate(2) == [2, 3]
    with pytest.raises(RuntimeError):
        pool.free([4])
    key = (None, (1, 2))
    pool.cache(0, 7, key)
    pool.free([0, 1])                          # 0 holds a cached prefix, 1 nothing
    assert pool.allocate(3) == [1, 4, 5] and pool.lookup(7, key) == 0   # the cached one is kept
    assert pool.allocate(1) == [0] and pool.lookup(7, key) is None      # until nothing else is free


def test_prefix_cache_hits_exact_blocks_and_lru_eviction():
    core, runner = make_core(num_blocks=8, budget=64)
    pool = core.kv.pool
    a = Request("a", list(range(1, 11)), SamplingParams(max_tokens=1), frozenset())
    core.add_request(a)
    run_all(core)                                   # 10 tokens: blocks 0, 1 full (cached), 2 partial
    assert pool.free_stack == [7, 6, 5, 4, 3, 2]           # the partial block: taken back first
    assert list(pool.free_cached) == [1, 0]                 # freed tail first: evicted first
    assert pool.num_cached == 2 and a.num_cached_tokens == 0

    b = Request("b", list(range(1, 9)) + [50, 51, 52, 53], SamplingParams(max_tokens=2), frozenset())
    core.add_request(b)
    core.step()
    assert b.block_ids == [0, 1, 2] and b.num_cached_tokens == 8
    assert runner.steps[-1].chunks[0].num_tokens == 4          # only the uncached tail is computed
    run_all(core)

    c = Request("c", list(range(1, 9)), SamplingParams(max_tokens=2), frozenset())
    core.add_request(c)                             # its whole prompt is cached, but the last
    core.step()                                     # token's block is recomputed for its logits
    assert c.num_cached_tokens == 4 and c.block_ids[0] == 0
    run_all(core)
    assert core.stats().ram == CacheStats(hit_blocks=3)     # b's two blocks, c's one; nothing evicted yet

    # Fill the pool: the uncached blocks, then the least recently freed cached ones (evicted and
    # forgotten).
    d = Request("d", [90 + i for i in range(28)], SamplingParams(max_tokens=2), frozenset())
    core.add_request(d)
    core.step()
    assert pool.num_free == 1 and pool.num_cached == 8   # d's 7 full blocks + 1 survivor
    assert core.stats().ram.evicted_lru == 2             # (c's copy of block 1 was no entry of the cache)
    run_all(core)
    assert core.stats().ram.evicted_lru == 3             # d's next token took the survivor
    e = Request("e", list(range(1, 11)), SamplingParams(max_tokens=2), frozenset())
    core.add_request(e)
    core.step()
    assert e.num_cached_tokens == 0
    assert core.stats().ram == CacheStats(hit_blocks=3, evicted_lru=5)   # e's 3 blocks: d's partial, 2 of d's


def test_max_tokens_0_runs_the_prompt_into_the_cache_and_generates_nothing():
    core, runner = make_core(num_blocks=16, budget=4)
    warm = Request("warm", list(range(1, 11)), SamplingParams(max_tokens=0), frozenset())
    core.add_request(warm)
    assert run_all(core) == {"warm": warm} and len(runner.steps) == 3          # 10 tokens, 4 a step
    assert warm.output_token_ids == [] and warm.finish_reason is FinishReason.LENGTH
    assert core.kv.pool.num_cached == 2 and core.kv.pool.num_free == 16
    again = Request("again", list(range(1, 11)) + [60], SamplingParams(max_tokens=1), frozenset())
    core.add_request(again)
    core.step()
    assert again.num_cached_tokens == 8 and core.stats().ram.hit_blocks == 2


def test_chunked_prefill_keeps_decode_going():
    core, runner = make_core(budget=8)
    core.add_request(request("short", 3, 20))
    core.step()                               # prefill "short" (3 tokens)
    core.add_request(request("long", 40, 2))
    for _ in range(5):
        core.step()
    for sched in runner.steps[1:6]:           # while "long" is chunked, "short" decodes every step
        ids = [c.request_id for c in sched.chunks]
        assert ids == ["short", "long"] and sched.chunks[0].num_tokens == 1
        assert sched.num_decode_tokens == 1 and sched.num_prefill_tokens == 7
    long_chunks = [c.num_tokens for s in runner.steps for c in s.chunks if c.request_id == "long"]
    assert long_chunks[:5] == [7, 7, 7, 7, 7]


def test_abort_frees_blocks_at_once():
    core, _ = make_core(num_blocks=16)
    core.add_request(request("a", 10, 50))
    core.add_request(request("b", 10, 50))
    core.step()
    core.step()
    assert core.kv.pool.num_free < 16
    assert core.abort("a") and not core.abort("a")
    core.abort("b")
    assert core.kv.pool.num_free == 16 and not core.has_unfinished()


def test_stats_snapshot_counts_what_runs_waits_and_holds_blocks():
    core, _ = make_core(num_blocks=16, max_seqs=1)
    assert core.stats().num_free_blocks == core.stats().num_blocks == 16
    core.add_request(request("a", 10, 50))
    core.add_request(request("b", 10, 50))
    core.step()
    s = core.stats()
    assert (s.num_running, s.num_waiting, s.num_steps) == (1, 1, 1)
    assert s.num_free_blocks == 16 - 3 and s.kv_usage == 3 / 16
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.num_running = 0
    core.abort("a")
    core.abort("b")
    assert core.stats().num_free_blocks == 16 and core.stats().num_running == 0


def test_preemption_recomputes_and_output_is_unchanged():
    alone = {}
    for rid in ("a", "b", "c"):
        core, _ = make_core(num_blocks=64)
        core.add_request(request(rid, 9, 30))
        alone.update({k: r.output_token_ids for k, r in run_all(core).items()})
    core, runner = make_core(num_blocks=14, budget=32)   # 3 × 39 tokens need 30 blocks: preemption
    for rid in ("a", "b", "c"):
        core.add_request(request(rid, 9, 30))
    done = run_all(core)
    assert sum(r.metrics.preemptions for r in done.values()) > 0
    assert {k: r.output_token_ids for k, r in done.items()} == alone
    assert core.kv.pool.num_free == 14


def test_a_failing_step_fails_its_requests_and_frees_their_blocks():
    core, runner = make_core(num_blocks=16)
    a, b = request("a", 10, 5), request("b", 6, 5)
    core.add_request(a)
    core.step()
    core.add_request(b)

    def broken(sched):
        raise RuntimeError("kernel exploded")

    runner.execute = broken
    with pytest.raises(RuntimeError, match="exploded"):
        core.step()
    assert core.kv.pool.num_free == 16 and not core.has_unfinished()
    assert a.finish_reason is b.finish_reason is FinishReason.ERROR


def test_eos_and_max_tokens_finish():
    core, _ = make_core()
    r = Request("r", [5, 6], SamplingParams(max_tokens=3), frozenset({token_for("r", 3)}))
    core.add_request(r)
    run_all(core)
    assert r.finish_reason is FinishReason.STOP and r.output_token_ids == [token_for("r", 2), token_for("r", 3)]
    r2 = request("r2", 2, 3)
    core.add_request(r2)
    run_all(core)
    assert r2.finish_reason is FinishReason.LENGTH and len(r2.output_token_ids) == 3


def test_stop_token_ids_and_min_tokens():
    core, _ = make_core()
    expected = [token_for("s", p) for p in range(2, 12)]     # what the fake emits for a 2-token prompt
    stop = expected[2]
    r = Request("s", [5, 6], SamplingParams(max_tokens=10, stop_token_ids=[stop]), frozenset())
    core.add_request(r)
    run_all(core)
    assert r.finish_reason is FinishReason.STOP and r.output_token_ids == expected[: expected.index(stop) + 1]
    expected = [token_for("late", p) for p in range(2, 12)]
    stop = expected[0]
    late = Request("late", [5, 6], SamplingParams(max_tokens=10, min_tokens=4, stop_token_ids=[stop]), frozenset())
    core.add_request(late)
    run_all(core)
    later = [i for i, t in enumerate(expected) if t == stop and i >= 3]   # before min_tokens: ignored
    assert late.output_token_ids == expected[: later[0] + 1 if later else 10]


def test_step_records_account_for_every_token():
    core, runner = make_core(budget=8)
    for i in range(3):
        core.add_request(request(f"r{i}", 10, 4, family=i))
    records = []
    while core.has_unfinished():
        core.step()
        records.append(core.last_step)
    assert len(records) == len(runner.steps) == core.num_steps
    assert sum(s.num_prefill_tokens for s in records) == 30
    assert sum(s.num_decode_tokens for s in records) == 3 * 3     # the first token comes from prefill
    assert all(s.batch_size == len(r.chunks) and s.duration_ms >= 0 for s, r in zip(records, runner.steps))


def test_percentile_matches_linear_interpolation():
    assert percentile([], 50) == 0.0
    assert percentile([3.0], 90) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10, 0, 20], 90) == pytest.approx(18.0)


@settings(max_examples=60, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 25), st.integers(0, 2)), min_size=1, max_size=10),
    num_blocks=st.integers(11, 40),
    budget=st.integers(1, 24),
    max_seqs=st.integers(1, 6),
    abort_at=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 9)), max_size=4),
    prefix_caching=st.booleans(),
)
def test_random_streams_respect_limits_and_leak_nothing(reqs, num_blocks, budget, max_seqs, abort_at,
                                                        prefix_caching):
    core, runner = make_core(num_blocks, budget, max_seqs, 10_000, prefix_caching)
    pool = core.kv.pool

    def check(added: list[Request]) -> None:
        sched = runner.steps[-1] if runner.steps else None
        if sched is not None:
            assert sum(c.num_tokens for c in sched.chunks) <= budget
            assert len(sched.chunks) <= max_seqs
        held = [b for r in added if r.status is RequestStatus.RUNNING for b in r.block_ids]
        assert len(set(held)) == num_blocks - pool.num_free              # shared blocks counted once
        assert sorted(held) == sorted(b for b in range(num_blocks) for _ in range(pool.ref_counts[b]))
        assert all(pool.block_hash[b] is not None for b in pool.cached.values())

    added = add_and_drive(core, reqs, abort_at, lambda n: core.kv.blocks_for(n) <= num_blocks, check)
    assert pool.num_free == num_blocks and not core.scheduler.running and not core.scheduler.waiting
    if not prefix_caching:
        assert pool.num_cached == 0
    for r in added:
        assert r.is_finished
        if r.finish_reason is FinishReason.LENGTH:   # same tokens as if alone, whatever the batching
            n = r.num_prompt_tokens
            assert r.output_token_ids == [token_for(r.request_id, n + k) for k in range(len(r.output_token_ids))]
