"""The prefix cache's disk tier, the core's side: which blocks go to disk and which come back.

Keys: every full block of a request gets a digest chained like its RAM hash (blake2b-128 of the
parent's digest and the block's token ids; the first block's parent is the request's cache salt, or
nothing), since Python's hash of the RAM key is not stable across processes. Equal digests mean equal
prefixes under equal salts; the store's fingerprint directory keeps models and precisions apart.

Writing: after each step, the blocks the prefix cache registered in it (`KVCacheManager.take_new_cached`)
are copied out by the runner (`BlockIO.copy_out`, bytes in the KV cache's own format) and handed to the
writer thread; a block already on disk only has its expiry refreshed. Reading: before a step is
scheduled, each waiting request that may be admitted looks past its RAM hits for the longest run of
blocks on disk (one stat each), takes free blocks for them, has the runner fill them (`BlockIO.fill`)
and enters them in the prefix cache, cached and free: the scheduler then takes them as ordinary hits.
The time spent is the request's `metrics.disk_load_ms`, the tokens its `metrics.disk_tokens`.

TTL: a block written or used by a request is kept at least its `SamplingParams.cache_ttl` seconds
more (default: the engine's `prompt_cache_ttl`). Full-attention models only (no windows, no recurrent
state: the engine refuses the disk tier for those).
"""

from __future__ import annotations

import hashlib
import logging
import time
from array import array
from collections.abc import Iterable, Sequence
from typing import Protocol

from phasewise.core.kv_cache_manager import KVCacheManager
from phasewise.core.prompt_store import CorruptEntry, PromptStore
from phasewise.core.request import Request
from phasewise.core.store_writer import DiskStats, StoreWriter

log = logging.getLogger("phasewise.prompt_cache")


class BlockIO(Protocol):
    """The runner's side: KV blocks as bytes (runner/kv_cache.py's KVCache)."""

    def copy_out(self, block_ids: Sequence[int]) -> list[bytearray]:
        """Each block's contents in every layer, in the cache's own format."""

    def fill(self, block_ids: Sequence[int], payloads: Sequence[bytearray]) -> None:
        """Write copy_out's bytes into these blocks (ValueError for bytes of another layout)."""


def block_digests(token_ids: Sequence[int], num_blocks: int, block_size: int, salt: str | None,
                  digests: list[bytes] | None = None) -> list[bytes]:
    """The chained digests of the first `num_blocks` full blocks; `digests` (a request's) grows in place."""
    digests = [] if digests is None else digests
    root = hashlib.blake2b(b"salt\0" + salt.encode(), digest_size=16).digest() if salt is not None else b""
    while len(digests) < num_blocks:
        i = len(digests)
        h = hashlib.blake2b(digests[-1] if digests else root, digest_size=16)
        h.update(array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes())
        digests.append(h.digest())
    return digests[:num_blocks]


class DiskTier:
    def __init__(self, store: PromptStore, io: BlockIO, block_size: int, default_ttl: float) -> None:
        """default_ttl: seconds a block is kept after its last use when its request names no cache_ttl."""
        self.store, self.io, self.block_size, self.default_ttl = store, io, block_size, default_ttl
        self.stats = DiskStats()
        self.writer = StoreWriter(store, self.stats)

    def _ttl(self, req: Request) -> float:
        ttl = req.sampling_params.cache_ttl
        return self.default_ttl if ttl is None else ttl

    def _digests(self, req: Request, n: int) -> list[bytes]:
        return block_digests(req.token_ids, n, self.block_size, req.sampling_params.cache_salt, req.disk_digests)

    # ---- reading --------------------------------------------------------------------------

    def prefetch(self, kv: KVCacheManager, requests: Iterable[Request]) -> None:
        """Load from disk the blocks these waiting requests would miss in RAM (each request once). A
        failure costs the cache only: the request computes those blocks."""
        for req in requests:
            if not req.disk_checked and req.prompt_logprobs is None:
                req.disk_checked = True
                started = time.perf_counter()
                try:
                    n = self._load(kv, req)
                except Exception:                  # never a failed step for the cache's sake
                    log.exception("prompt cache: loading %s's prefix failed; computing it", req.request_id)
                    n = 0
                if n:
                    req.metrics.disk_tokens += n * kv.block_size
                    req.metrics.disk_load_ms += (time.perf_counter() - started) * 1e3

    def _load(self, kv: KVCacheManager, req: Request) -> int:
        """Blocks of req's prefix loaded after its RAM hits (never its last token's block)."""
        limit = (req.num_tokens - 1) // kv.block_size
        hits = kv.get_computed_blocks(req)[0]
        digests = self._digests(req, limit)
        end = len(hits)
        while end < limit and self.store.lookup(digests[end]):
            end += 1
        if end == len(hits):
            return 0
        kv.pool.touch(hits)                        # the RAM hits stay while fresh blocks are taken
        fresh = kv.pool.allocate(end - len(hits)) or []
        try:
            payloads = self._read(digests[len(hits):end], self._ttl(req)) if fresh else []
            self.io.fill(fresh[:len(payloads)], payloads)
            keys = kv.block_keys(req, end)[len(hits):len(hits) + len(payloads)]
            for b, (h, key) in zip(fresh, keys):
                kv.pool.cache(b, h, key)
            self.stats.blocks_read += len(payloads)
            self.stats.bytes_read += sum(map(len, payloads))
            return len(payloads)
        finally:
            kv.pool.free(fresh)                    # cached and free (the rest uncached): the scheduler's hits
            kv.pool.free(hits)

    def _read(self, digests: Sequence[bytes], ttl: float) -> list[bytearray]:
        """The payloads of the leading blocks that read and check out."""
        out = []
        for d in digests:
            try:
                payload = self.store.read(d, ttl)
            except CorruptEntry as e:
                self.stats.corrupt += 1
                log.warning("prompt cache: removed %s (it did not check out)", e)
                payload = None
            if payload is None:
                break
            out.append(payload)
        return out

    # ---- writing --------------------------------------------------------------------------

    def save(self, kv: KVCacheManager) -> None:
        """Hand the writer copies of the blocks the prefix cache registered since the last call (they
        are intact: no forward has run since); blocks already on disk are refreshed instead. A failure
        costs the cache only."""
        new = kv.take_new_cached()
        if not new:
            return
        try:
            self._save(new)
        except Exception:
            self.stats.write_errors += 1
            log.exception("prompt cache: copying %d blocks out failed; they stay uncached on disk", len(new))

    def _save(self, new: list[tuple[Request, int, int]]) -> None:
        blocks, jobs, seen = [], [], set()
        for req, i, block in new:
            d = self._digests(req, i + 1)[i]
            ttl = self._ttl(req)
            if d in seen or d in self.writer.pending:
                continue
            seen.add(d)
            if self.store.lookup(d):
                self.writer.refresh(d, ttl)
            else:
                blocks.append(block)
                jobs.append((d, ttl))
        if blocks:
            for (d, ttl), payload in zip(jobs, self.io.copy_out(blocks)):
                self.writer.write(d, payload, ttl)

    def flush(self) -> None:
        """Wait for the queued writes (a test, or before handing the directory to another engine)."""
        self.writer.flush()

    def sweep(self) -> None:
        """Evict expired entries, then LRU ones past the size, now (the writer does it as it writes)."""
        self.writer.flush()
        self.writer.sweep()

    def close(self) -> None:
        self.writer.close()
