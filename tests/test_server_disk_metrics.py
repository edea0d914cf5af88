"""The disk tier's counters on a live server's /metrics, against the files on disk: blocks and bytes
written; after a restart, blocks and bytes loaded, a flipped byte counted as an error, entries whose TTL
passed and least recently used ones past --prompt-cache-size counted as evictions by cause."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from live_server import MODEL, start_server, stop_server
from phasewise.core.disk_tier import block_digests
from phasewise.core.prompt_store import HEADER

pytestmark = pytest.mark.slow

BLOCK = 16


def _counter(server, name: str, **labels: str) -> float:
    """A counter's value (labels besides model_name as given)."""
    pairs = ",".join(f'{k}="{v}"' for k, v in sorted({**labels, "model_name": MODEL}.items()))
    return server.metrics().get(f"phasewise:prompt_cache_disk_{name}_total{{{pairs}}}", -1.0)


def _files(cache: Path) -> list[Path]:
    return sorted(cache.rglob("*.kvb"))


def _entry(cache: Path, digest: bytes) -> Path:
    return next(cache.glob(f"*/{digest.hex()[:2]}/{digest.hex()}.kvb"))


def _settled(server, cache: Path, at_least: int, deadline_s: float = 60) -> int:
    """The written-blocks counter once it reaches `at_least` and counts every file on disk."""
    deadline = time.monotonic() + deadline_s
    while True:
        written = _counter(server, "written_blocks")
        if written == len(_files(cache)) >= at_least or time.monotonic() > deadline:
            return int(written)
        time.sleep(0.2)


def _ask(server, ids: list[int]) -> dict:
    return server.post("/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0}).json()


def test_the_disk_counters_on_metrics_are_what_happened_on_disk(tmp_path):
    cache = tmp_path / "cache"
    kept = [1000 + (i * 37) % 5000 for i in range(8 * BLOCK + 3)]       # 8 whole blocks each
    dropped = [2000 + (i * 53) % 5000 for i in range(8 * BLOCK + 3)]
    server = start_server(tmp_path, "--prompt-cache-dir", str(cache))
    try:
        assert _counter(server, "written_blocks") == 0 and _counter(server, "evictions", cause="ttl") == 0
        _ask(server, kept)
        _ask(server, dropped)
        assert _settled(server, cache, 16) == 16             # each prompt's 8 whole blocks
        assert _counter(server, "written_bytes") == sum(p.stat().st_size for p in _files(cache))
        assert _counter(server, "hit_blocks") == 0 and _counter(server, "errors", kind="write") == 0
    finally:
        stop_server(server)

    entry_bytes = _files(cache)[0].stat().st_size
    ids = block_digests(kept, 8, BLOCK, None)
    corrupt = _entry(cache, ids[2])                         # a flipped byte in the third block's payload
    data = bytearray(corrupt.read_bytes())
    data[-1] ^= 0xFF
    corrupt.write_bytes(data)
    os.utime(corrupt, ns=(corrupt.stat().st_atime_ns, int((time.time() + 3600) * 1e9)))
    expired = [_entry(cache, d) for d in block_digests(dropped, 8, BLOCK, None)]
    for p in expired:                                       # their TTL passed (expiry is the mtime)
        os.utime(p, (time.time(), time.time() - 10))

    limit = 4 * entry_bytes
    server = start_server(tmp_path, "--prompt-cache-dir", str(cache), "--prompt-cache-size", repr(limit / 2**30))
    try:
        out = _ask(server, kept)
        assert out["timings"]["disk_n"] == 2 * BLOCK          # blocks 0 and 1; the third did not check out
        assert _counter(server, "hit_blocks") == 2
        assert _counter(server, "read_bytes") == 2 * (entry_bytes - HEADER.size)       # the payloads
        assert _counter(server, "load_seconds") > 0
        assert _counter(server, "errors", kind="corrupt") == 1
        deadline = time.monotonic() + 60                    # the writer's first write sweeps the directory
        while _counter(server, "evictions", cause="size") <= 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _counter(server, "evictions", cause="ttl") == len(expired)
        assert _counter(server, "evictions", cause="size") > 0
        assert not any(p.exists() for p in expired)
        assert sum(p.stat().st_size for p in _files(cache)) <= limit
        assert _counter(server, "errors", kind="write") == _counter(server, "errors", kind="dropped") == 0
    finally:
        stop_server(server)
