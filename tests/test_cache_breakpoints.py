"""Cache breakpoints (Anthropic's cache_control, in tokens: SamplingParams.cache_breakpoints) in the core,
without torch: their blocks are kept in RAM past unmarked ones until their ttl passes, kept on disk at least
their ttl, and the tokens a request writes under them are counted exactly (what the Messages API reports as
cache creation). The API side: tests/test_server_prompt_cache.py."""

from __future__ import annotations

import pytest

from phasewise.core.block_pool import BlockPool, CacheStats
from phasewise.core.disk_tier import DiskTier, block_digests
from phasewise.core.kv_cache_manager import KVCacheManager
from phasewise.core.prompt_store import PromptStore
from phasewise.core.request import Request
from phasewise.core.sampling_params import SamplingParams

BS = 4


class Clock:
    def __init__(self, t: float = 1_000.0) -> None:
        self.t = t

    def now(self) -> float:
        return self.t

    __call__ = now


def _request(tokens: list[int], rid: str = "r", marks=(), ttl: float | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4, cache_breakpoints=marks, cache_ttl=ttl), frozenset())


def _run(kv: KVCacheManager, req: Request, free: bool = True) -> int:
    """Admit req with its prefix hits, compute its prompt, commit; its cached tokens."""
    hits = kv.get_computed_blocks(req)
    cached = len(hits[0]) * BS
    assert kv.allocate_slots(req, req.num_tokens - cached, hits)
    req.num_computed_tokens = req.num_tokens
    kv.commit(req)
    if free:
        kv.free(req)
    return cached


def test_marked_ttl_is_the_longest_breakpoint_covering_a_block():
    p = SamplingParams(cache_breakpoints=((8, 3600.0), (20, 300.0)))
    assert [p.marked_ttl(end) for end in (4, 8, 12, 20, 24)] == [3600.0, 3600.0, 300.0, 300.0, None]
    assert SamplingParams().marked_ttl(4) is None
    for bad in (((0, 300.0),), ((8, 0.0),), ((8.5, 300.0),)):
        with pytest.raises(ValueError, match="cache_breakpoints"):
            SamplingParams(cache_breakpoints=bad)


def test_creation_counts_the_marked_blocks_a_request_computed_by_ttl():
    """Blocks 0-1 under the 1h breakpoint, 2-3 under the 5m one, 4 unmarked (17 prompt tokens: 4 full blocks
    and a partial one). A second request reads the first three (never its last token's block) and computes
    the fourth again, which the cache already holds: nothing written."""
    kv = KVCacheManager(32, BS)
    prompt = list(range(100, 117))
    marks = ((8, 3600.0), (16, 300.0))
    first = _request(prompt, "a", marks)
    assert _run(kv, first) == 0
    assert first.metrics.cache_written == {3600.0: 8, 300.0: 8}
    again = _request(prompt[:16], "b", marks)
    assert _run(kv, again) == 12
    assert again.metrics.cache_written == {}
    longer = _request(prompt + list(range(200, 208)), "c", ((24, 300.0),))
    assert _run(kv, longer) == 16
    assert longer.metrics.cache_written == {300.0: 8}    # blocks 4 and 5: computed here, marked
    unmarked = _request(list(range(300, 317)), "d")
    _run(kv, unmarked)
    assert unmarked.metrics.cache_written == {}


def test_kept_blocks_are_evicted_after_unkept_ones_until_their_ttl_passes():
    clock = Clock()
    kv = KVCacheManager(6, BS, now=clock)
    marked, plain, other = list(range(100, 109)), list(range(200, 209)), list(range(300, 309))

    def hits(tokens: list[int]) -> int:
        return len(kv.get_computed_blocks(_request(tokens))[0])

    def hog(n: int) -> None:
        """Take n blocks and give them back uncached."""
        req = _request(list(range(900, 900 + n * BS)), "hog")
        assert kv.allocate_slots(req, req.num_tokens)
        kv.free(req)

    _run(kv, _request(marked, "m", ((8, 300.0),)))     # blocks 0-1 kept 300 s (its third is not full)
    _run(kv, _request(plain, "p"))                       # 2 cached blocks, freed after the marked ones
    hog(5)                                               # 2 uncached, the 2 unkept, then 1 kept
    assert (hits(marked), hits(plain)) == (1, 0)
    _run(kv, _request(other, "o"))
    clock.t += 301                                       # past the keep: its block goes first now
    hog(4)                                               # 3 uncached, then the expired one
    assert (hits(marked), hits(other)) == (0, 2)


def test_evictions_are_counted_by_cause_and_hits_as_taken():
    """lru: unkept blocks; kept: a marked block within its ttl, when nothing else is free; ttl: a marked block
    past its ttl (taken before the unkept ones). A block only read (no admission) is no hit."""
    clock = Clock()
    kv = KVCacheManager(6, BS, now=clock)
    stats = kv.pool.stats

    def hog(n: int) -> None:
        req = _request(list(range(900, 900 + n * BS)), "hog")
        assert kv.allocate_slots(req, req.num_tokens)
        kv.free(req)

    _run(kv, _request(list(range(100, 109)), "m", ((8, 300.0),)))     # 2 blocks kept 300 s
    plain = list(range(200, 209))
    assert (_run(kv, _request(plain, "p")), _run(kv, _request(plain, "again"))) == (0, 8)
    kv.get_computed_blocks(_request(plain))
    assert stats == CacheStats(hit_blocks=2)
    hog(5)                                                               # 2 uncached, 2 unkept, 1 kept
    assert stats == CacheStats(hit_blocks=2, evicted_lru=2, evicted_kept=1)
    _run(kv, _request(list(range(300, 309)), "o"))                      # 2 unkept blocks
    clock.t += 301
    hog(4)                                                               # 3 uncached, then the expired one
    assert stats == CacheStats(hit_blocks=2, evicted_lru=2, evicted_ttl=1, evicted_kept=1)


def test_a_read_refreshes_the_keep():
    clock = Clock()
    pool = BlockPool(3, now=clock)
    a, b, c = pool.allocate(3)
    for blk, h in ((a, 1), (b, 2)):
        pool.cache(blk, h, h)
    pool.keep(a, clock.t + 300)
    pool.free([a, b])
    assert list(pool.free_kept) == [a] and list(pool.free_cached) == [b]
    clock.t += 200
    pool.touch([a])                                                    # a hit
    pool.keep(a, clock.t + 300)
    pool.free([a])
    clock.t += 200                                                     # 400 s after the write, 200 after the read
    assert pool.allocate(1) == [b]                                     # the unkept one goes first
    assert pool.lookup(1, 1) == a
    pool.cache(b, 3, 3)
    pool.free([b])
    clock.t += 101                                                     # past the refreshed keep
    assert pool.allocate(1) == [a]                                     # expired: before the unkept one
    assert pool.lookup(1, 1) is None and pool.lookup(3, 3) == b and c not in pool.free_stack


def test_the_disk_keeps_a_marked_block_its_ttl_and_the_rest_the_default(tmp_path):
    clock = Clock()
    store = PromptStore(tmp_path, bytes(range(16)), 1 << 30, clock)

    class Bytes:
        def copy_out(self, ids):
            return [bytearray(b"x%d" % i) for i in ids]

        def fill(self, ids, payloads):
            pass

    kv = KVCacheManager(32, BS, now=clock)
    kv.new_cached = []
    tier = DiskTier(store, Bytes(), BS, default_ttl=300.0)
    req = _request(list(range(100, 113)), "a", ((4, 86_400.0), (8, 60.0)))   # a day; a minute (less than the default)
    _run(kv, req, free=False)
    tier.save(kv)
    tier.flush()
    digests = block_digests(req.token_ids, 3, BS, None)
    expiry = [store.path(d).stat().st_mtime_ns / 1e9 - clock.t for d in digests]
    assert expiry == pytest.approx([86_400.0, 300.0, 300.0])
    tier.close()
