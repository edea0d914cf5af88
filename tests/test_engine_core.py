"""The torch-free engine core: block pool, KV manager, scheduler and EngineCore with a fake runner."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from phasewise.config import SchedulerConfig
from phasewise.engine.block_pool import BlockPool
from phasewise.engine.core import EngineCore
from phasewise.engine.outputs import RunnerOutput, SampledToken, SchedulerOutput
from phasewise.engine.request import FinishReason, Request, RequestStatus, percentile
from phasewise.sampling.params import SamplingParams

EOS = 0


class FakeRunner:
    """Emits a token that depends only on the request and its position, never EOS unless told."""

    def __init__(self) -> None:
        self.steps: list[SchedulerOutput] = []
        self.computed: dict[str, list[int]] = {}   # request → positions whose KV was "computed"

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self.steps.append(sched)
        sampled = {}
        for c in sched.chunks:
            r = c.request
            assert len(r.block_ids) * 4 >= r.num_computed_tokens + c.num_tokens  # room for the KV
            self.computed.setdefault(r.request_id, []).extend(
                range(r.num_computed_tokens, r.num_computed_tokens + c.num_tokens))
            if c.samples:
                sampled[r.request_id] = SampledToken(token_for(r.request_id, r.num_tokens))
        return RunnerOutput(sampled)


def token_for(request_id: str, position: int) -> int:
    return 1 + (hash((request_id, position)) % 97)


def make_core(num_blocks=64, budget=16, max_seqs=8, max_len=512):
    runner = FakeRunner()
    core = EngineCore(runner, SchedulerConfig(budget, max_seqs), num_blocks, 4, max_len)
    return core, runner


def request(rid: str, prompt_len: int, max_tokens: int) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   frozenset({EOS}))


def run_all(core: EngineCore) -> dict[str, Request]:
    done = {}
    for _ in range(10_000):
        if not core.has_unfinished():
            return done
        for o in core.step():
            if o.finished:
                done[o.request_id] = o.request
    raise AssertionError("engine did not finish")


def test_engine_core_imports_no_torch():
    code = "import sys, phasewise, phasewise.engine.core; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_block_pool_exact_ids_and_order():
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.allocate(2) is None and pool.num_free == 1
    pool.free([4, 3, 2])
    assert list(pool.free_queue) == [5, 4, 3, 2]
    assert pool.allocate(2) == [5, 4]
    with pytest.raises(RuntimeError):
        pool.free([3])


def test_chunked_prefill_keeps_decode_going():
    core, runner = make_core(budget=8)
    core.add_request(request("short", 3, 20))
    core.step()                               # prefill "short" (3 tokens)
    core.add_request(request("long", 40, 2))
    for _ in range(5):
        core.step()
    for sched in runner.steps[1:6]:           # while "long" is chunked, "short" decodes every step
        ids = [c.request.request_id for c in sched.chunks]
        assert ids == ["short", "long"] and sched.chunks[0].num_tokens == 1
        assert sched.num_decode_tokens == 1 and sched.num_prefill_tokens == 7
    long_chunks = [c.num_tokens for s in runner.steps for c in s.chunks if c.request.request_id == "long"]
    assert long_chunks[:5] == [7, 7, 7, 7, 7]


def test_prompt_longer_than_context_is_rejected():
    core, _ = make_core(max_len=32)
    with pytest.raises(ValueError, match="32"):
        core.add_request(request("r", 32, 4))
    with pytest.raises(ValueError, match="KV blocks"):
        make_core(num_blocks=2)[0].add_request(request("r", 20, 4))


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


def test_percentile_matches_linear_interpolation():
    assert percentile([], 50) == 0.0
    assert percentile([3.0], 90) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10, 0, 20], 90) == pytest.approx(18.0)


@settings(max_examples=60, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 25)), min_size=1, max_size=10),
    num_blocks=st.integers(11, 40),
    budget=st.integers(1, 24),
    max_seqs=st.integers(1, 6),
    abort_at=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 9)), max_size=4),
)
def test_random_streams_respect_limits_and_leak_nothing(reqs, num_blocks, budget, max_seqs, abort_at):
    core, runner = make_core(num_blocks=num_blocks, budget=budget, max_seqs=max_seqs, max_len=10_000)
    added = []
    for i, (p, m) in enumerate(reqs):
        r = request(f"r{i}", p, m)
        try:
            core.add_request(r)
            added.append(r)
        except ValueError:
            assert core.kv.blocks_for(p + m) > num_blocks
    step = 0
    while core.has_unfinished():
        for when, which in abort_at:
            if when == step and which < len(added):
                core.abort(added[which].request_id)
        core.step()
        step += 1
        assert step < 5_000
        sched = runner.steps[-1] if runner.steps else None
        if sched is not None:
            assert sum(c.num_tokens for c in sched.chunks) <= budget
            assert len(sched.chunks) <= max_seqs
        held = sum(len(r.block_ids) for r in added if r.status is RequestStatus.RUNNING)
        assert held == num_blocks - core.kv.pool.num_free
    assert core.kv.pool.num_free == num_blocks and not core.scheduler.running and not core.scheduler.waiting
    for r in added:
        assert r.is_finished
        if r.finish_reason is FinishReason.LENGTH:   # same tokens as if alone, whatever the batching
            n = r.num_prompt_tokens
            assert r.output_token_ids == [token_for(r.request_id, n + k) for k in range(len(r.output_token_ids))]
            # every position's KV was computed at least once, and the last computation reached the end
            assert set(runner.computed[r.request_id]) >= set(range(r.num_tokens - 1))
