"""KV groups and sliding windows in the torch-free engine core: a windowed group holds only the
blocks its window still sees, prefix-cache hits need the window's blocks, nothing leaks, and the
tokens are those of a run with plenty of memory."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from test_engine_core import add_and_drive, request, run_all, token_for

from phasewise.config import SchedulerConfig
from phasewise.core.engine_core import EngineCore
from phasewise.core.handoffs import RunnerOutput, SampledToken, SchedulerOutput
from phasewise.core.kv_cache_manager import NULL_BLOCK
from phasewise.core.request import FinishReason, Request, RequestStatus
from phasewise.lab.memory import ModelShape
from phasewise.models.config import ModelConfig
from phasewise.core.sampling_params import SamplingParams
from phasewise.runner.request_state import RequestStates


class GroupRunner:
    """A fake runner that checks, per KV group, that every key a query can see is in place (a
    windowed group: only the window), then "computes" the chunk into each group's blocks."""

    def __init__(self, windows: tuple[int | None, ...], block_size: int) -> None:
        self.windows, self.bs = windows, block_size
        self.slots: dict[int, tuple[int, int]] = {}       # slot → (group, token)
        self.steps: list[SchedulerOutput] = []
        self.requests = RequestStates(torch.device("cpu"))

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self.steps.append(sched)
        self.requests.update(sched.new_requests, sched.finished_ids, sched.chunks)
        sampled = {}
        for c in sched.chunks:
            r, start, n = self.requests[c.request_id], c.start, c.num_tokens
            assert len(c.block_tables) == len(self.windows)
            for g, (w, table) in enumerate(zip(self.windows, c.block_tables)):
                assert len(table) * self.bs >= start + n
                first = 0 if w is None else max(0, start - w + 1)   # the oldest key the first query sees
                for p in range(first, start):
                    b = table[p // self.bs]
                    assert b != NULL_BLOCK, f"{r.request_id}: group {g} lost position {p}"
                    assert self.slots.get(b * self.bs + p % self.bs) == (g, r.token_ids[p]), f"stale KV at {p}"
                for p in range(start, start + n):
                    self.slots[table[p // self.bs] * self.bs + p % self.bs] = (g, r.token_ids[p])
            if c.samples:
                sampled[r.request_id] = SampledToken(token_for(r.request_id, r.num_tokens))
        out = RunnerOutput(sampled)
        self.requests.commit(out)
        return out


def make(windows, num_blocks=200, block_size=4, budget=16, max_seqs=8, max_len=10_000, prefix_caching=True):
    runner = GroupRunner(windows, block_size)
    core = EngineCore(runner, SchedulerConfig(budget, max_seqs), num_blocks, block_size, max_len, prefix_caching,
                      kv_windows=windows)
    return core, runner


def held_blocks(core: EngineCore) -> list[int]:
    return [b for r in core.scheduler.running for t in r.block_tables for b in t if b != NULL_BLOCK]


def test_gemma3_groups_from_its_config():
    cfg = ModelConfig(architecture="gemma3", vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=18,
                      num_heads=4, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e6,
                      max_position_embeddings=32768, sliding_window=512,
                      sliding_layers=tuple(i for i in range(18) if (i + 1) % 6))
    assert cfg.kv_groups[0] == (5, 11, 17) and len(cfg.kv_groups) == 6
    assert all(len(g) == 3 for g in cfg.kv_groups)
    assert cfg.kv_group_windows == (None,) + (512,) * 5
    assert cfg.kv_place(17) == (0, 2) and cfg.kv_place(0) == (1, 0) and cfg.kv_place(16) == (5, 2)
    plain = ModelConfig(architecture="llama", vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=30,
                        num_heads=4, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                        max_position_embeddings=2048)
    assert plain.kv_groups == (tuple(range(30)),) and plain.kv_group_windows == (None,)


def test_an_8192_token_gemma3_sequence_holds_a_fifth_of_full_kv_as_the_calculator_says():
    """Three global layers keep 8,192 tokens, fifteen local ones their 512: at most 25% of what 18
    full layers would hold, measured from the pool's blocks after every step."""
    windows, bs, n = (None,) + (512,) * 5, 16, 8192
    core, _ = make(windows, num_blocks=6 * 520, block_size=bs, budget=512, max_len=n + 8)
    r = Request("long", [1 + i % 90 for i in range(n)], SamplingParams(max_tokens=2, ignore_eos=True), frozenset())
    core.add_request(r)
    used = []
    while r.num_computed_tokens < n:
        core.step()
        used.append(core.kv.pool.num_blocks - core.kv.pool.num_free)
    full_layer_blocks = 18 * (n // bs)                     # every layer holding every token
    ours = used[-1] * 3                                     # a block holds 3 layers
    assert ours <= 0.25 * full_layer_blocks and max(used) * 3 <= 0.25 * full_layer_blocks
    gemma = ModelShape(layers=18, kv_heads=1, head_dim=256, window=512, window_layers=15)
    calculated = gemma.windowed_kv_bytes_per_sequence(n, block_size=bs) / gemma.kv_bytes_per_sequence(n)
    assert ours / full_layer_blocks == pytest.approx(calculated)
    run_all(core)
    assert core.kv.pool.num_free == core.kv.pool.num_blocks


def test_a_windowed_group_frees_what_its_window_left_behind():
    core, _ = make((None, 8), block_size=4, budget=6)
    r = request("a", 30, 10)
    core.add_request(r)
    while not r.is_finished:
        core.step()
        if r.is_finished:
            break
        full, windowed = r.block_tables
        first = max(0, r.num_computed_tokens - 8 + 1) // 4
        assert NULL_BLOCK not in full
        assert windowed[:first] == [NULL_BLOCK] * first and NULL_BLOCK not in windowed[first:]
    assert r.output_token_ids == [token_for("a", 30 + k) for k in range(10)]


def test_a_prefix_hit_needs_the_window_blocks_of_every_group():
    core, runner = make((None, 8), block_size=4, budget=64)
    a = request("a", 40, 2)
    core.add_request(a)
    run_all(core)
    b = Request("b", a.token_ids[:40] + [91, 92], SamplingParams(max_tokens=2, ignore_eos=True), frozenset())
    core.add_request(b)
    core.step()                     # its window's blocks are still cached (freed, not yet reused): a hit
    assert b.num_cached_tokens == 40
    assert b.block_tables[1][:8] == [NULL_BLOCK] * 8      # a hit of 40 tokens needs keys from 33 on
    run_all(core)
    assert b.output_token_ids == [token_for("b", 42), token_for("b", 43)]


@settings(max_examples=50, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 20), st.integers(0, 2)), min_size=1, max_size=8),
    windows=st.sampled_from([(None, 5), (None, 5, 5), (9,), (3, 3), (None, 16, 16, 16)]),
    num_blocks=st.integers(30, 80),
    budget=st.integers(1, 20),
    max_seqs=st.integers(1, 5),
    abort_at=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 7)), max_size=3),
    prefix_caching=st.booleans(),
)
def test_random_streams_with_windows_keep_their_keys_and_leak_nothing(reqs, windows, num_blocks, budget, max_seqs,
                                                                      abort_at, prefix_caching):
    core, runner = make(windows, num_blocks, 4, budget, max_seqs, 10_000, prefix_caching)
    pool = core.kv.pool

    def check(added: list[Request]) -> None:
        held = held_blocks(core)
        assert len(set(held)) == num_blocks - pool.num_free
        assert sorted(held) == sorted(b for b in range(num_blocks) for _ in range(pool.ref_counts[b]))
        for r in core.scheduler.running:          # a windowed table: nothing behind the window, nothing missing
            for w, table in zip(windows, r.block_tables):
                first = 0 if w is None else max(0, r.num_computed_tokens - w + 1) // 4
                assert all(b == NULL_BLOCK for b in table[:first]) and NULL_BLOCK not in table[first:]

    added = add_and_drive(core, reqs, abort_at, lambda n: core.kv.max_blocks(n, budget) <= num_blocks, check)
    assert pool.num_free == num_blocks
    for r in added:
        assert r.is_finished and r.status is RequestStatus.FINISHED
        if r.finish_reason is FinishReason.LENGTH:
            n = r.num_prompt_tokens
            assert r.output_token_ids == [token_for(r.request_id, n + k) for k in range(len(r.output_token_ids))]
