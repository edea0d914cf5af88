"""The prefix cache's RAM counters on a live server's /metrics, against what its pool must have done: a small
pool filled by distinct prompts one at a time evicts, least recently freed first, exactly the blocks a
model of it predicts; a prompt sent again reads its whole blocks from RAM. The causes apart (ttl, kept)
and the split from disk hits: tests/test_cache_breakpoints.py, tests/test_disk_tier.py."""

from __future__ import annotations

import pytest

from live_server import MODEL, start_server, stop_server

pytestmark = pytest.mark.slow

BLOCK = 16
WHOLE = 8                                    # each prompt: 8 whole blocks and a partial one


def _metric(server, name: str, **labels: str) -> float:
    pairs = ",".join(f'{k}="{v}"' for k, v in sorted({**labels, "model_name": MODEL}.items()))
    return server.metrics()[f"phasewise:{name}{{{pairs}}}"]


def _prompt(i: int) -> list[int]:
    return [1000 + (i * 131 + j * 37) % 9000 for j in range(WHOLE * BLOCK + 3)]


def _ask(server, ids: list[int]) -> int:
    """The prompt's cached tokens."""
    out = server.post("/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0}).json()
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def _evictions(pool: int, prompts: int) -> int:
    """What a pool of `pool` blocks evicts serving distinct prompts one at a time: each takes WHOLE + 1 free
    blocks, uncached ones first, and leaves WHOLE cached and its partial block uncached."""
    cached = evicted = 0
    for _ in range(prompts):
        taken = max(0, WHOLE + 1 - (pool - cached))
        evicted += taken
        cached += WHOLE - taken
    return evicted


def test_ram_hits_bytes_and_lru_evictions_are_what_the_pool_did(tmp_path):
    server = start_server(tmp_path, "--kv-cache-memory", "0.02", "--max-num-seqs", "4")
    try:
        pool = int(_metric(server, "kv_cache_total_blocks"))
        assert 2 * (WHOLE + 1) < pool < 200 and _metric(server, "kv_cache_cached_blocks") == 0
        assert (_ask(server, _prompt(0)), _ask(server, _prompt(0))) == (0, WHOLE * BLOCK)
        hit_bytes = _metric(server, "prompt_cache_ram_hit_bytes_total")
        assert _metric(server, "prompt_cache_ram_hit_blocks_total") == WHOLE and hit_bytes > 0
        block_bytes = hit_bytes / WHOLE
        assert _metric(server, "prompt_cache_ram_bytes") == WHOLE * block_bytes
        assert _metric(server, "prompt_cache_ram_evictions_total", cause="lru") == 0

        prompts = pool // WHOLE + 2                 # past the pool: the oldest go
        for i in range(1, prompts):
            assert _ask(server, _prompt(i)) == 0
        evicted = _evictions(pool, prompts)
        assert evicted > WHOLE
        assert _metric(server, "prompt_cache_ram_evictions_total", cause="lru") == evicted
        assert _metric(server, "prompt_cache_ram_evictions_total", cause="ttl") == 0
        assert _metric(server, "prompt_cache_ram_evictions_total", cause="kept") == 0
        cached = prompts * WHOLE - evicted
        assert _metric(server, "kv_cache_cached_blocks") == cached
        assert _metric(server, "prompt_cache_ram_bytes") == cached * block_bytes
        assert _ask(server, _prompt(0)) == 0         # the least recently freed: evicted first
        assert _metric(server, "prompt_cache_ram_hit_blocks_total") == WHOLE
    finally:
        stop_server(server)
