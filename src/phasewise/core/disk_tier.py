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
Both calls' CPU and wall time on the engine's thread are counted (`DiskStats.lookups`, `saves`), as are
the writer's jobs (`DiskStats.writer`): what the tier costs the engine (benchmarks/prompt_cache_overhead.py).

A hybrid's recurrent state goes with them: each state checkpoint (core/state_checkpoints.py) within
the prompt (at chunk ends and the prompt's last block boundary; not every block of the output, as a
Gated DeltaNet's state is megabytes) is written as its own entry (`BlockIO.copy_state`, under the
digest of the block it ends, marked), and a
run read from disk ends at the last block whose state is on disk (or checkpointed in RAM); that state
is filled into a checkpoint slot (`StateCheckpoints.adopt`, `BlockIO.fill_state`), which the admission
then restores as for any hit.

TTL: a block written or used by a request is kept at least its `SamplingParams.cache_ttl` seconds
more (default: the engine's `prompt_cache_ttl`), or its cache breakpoint's ttl when longer.
Models with sliding windows are refused (their windowed groups' blocks are not stored).
"""

from __future__ import annotations

import hashlib
import logging
import time
import weakref
from array import array
from collections.abc import Iterable, Sequence
from typing import Protocol

from phasewise.core.kv_cache_manager import KVCacheManager
from phasewise.core.prompt_store import CorruptEntry, PromptStore
from phasewise.core.request import BlockKey, Request
from phasewise.core.store_writer import DiskStats, StoreWriter, clocks

log = logging.getLogger("phasewise.prompt_cache")


class BlockIO(Protocol):
    """The runner's side: KV blocks as bytes (runner/kv_cache.py's KVCache)."""

    def copy_out(self, block_ids: Sequence[int]) -> list[bytearray]:
        """Each block's contents in every layer, in the cache's own format."""

    def fill(self, block_ids: Sequence[int], payloads: Sequence[bytearray]) -> None:
        """Write copy_out's bytes into these blocks (ValueError for bytes of another layout)."""

    def copy_state(self, slot: int) -> bytearray:
        """A hybrid's recurrent state in this slot, every recurrent layer, as bytes."""

    def fill_state(self, slot: int, payload: bytearray) -> None:
        """Write copy_state's bytes into this slot (ValueError for bytes of another layout)."""


def state_digest(block: bytes) -> bytes:
    """The entry of the recurrent state where the block of this digest ends."""
    return hashlib.blake2b(block + b"state", digest_size=16).digest()


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
        # an engine dropped without close(), or the interpreter's exit: the queued writes finish,
        # the thread ends
        weakref.finalize(self, self.writer.close)

    def _ttl(self, req: Request, block: int) -> float:
        """Seconds to keep block `block` of req: its cache_ttl (or the default), or its breakpoint's
        when longer."""
        params = req.sampling_params
        ttl = self.default_ttl if params.cache_ttl is None else params.cache_ttl
        marked = params.marked_ttl((block + 1) * self.block_size) if params.cache_breakpoints else None
        return ttl if marked is None else max(ttl, marked)

    def _digests(self, req: Request, n: int) -> list[bytes]:
        salt = req.sampling_params.cache_salt
        return block_digests(req.token_ids, n, self.block_size, salt, req.disk_digests)

    # ---- reading --------------------------------------------------------------------------

    def prefetch(self, kv: KVCacheManager, requests: Iterable[Request]) -> None:
        """Load from disk the blocks these waiting requests would miss in RAM (each request once). A
        failure costs the cache only: the request computes those blocks."""
        called = clocks()
        try:
            self._prefetch(kv, requests)
        finally:
            self.stats.lookups.add(*called)

    def _prefetch(self, kv: KVCacheManager, requests: Iterable[Request]) -> None:
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
                    took = time.perf_counter() - started
                    req.metrics.disk_tokens += n * kv.block_size
                    req.metrics.disk_load_ms += took * 1e3
                    self.stats.load_seconds += took

    def _load(self, kv: KVCacheManager, req: Request) -> int:
        """Blocks of req's prefix loaded after its RAM hits (never its last token's block; a hybrid's
        run ends where a state checkpoint is found)."""
        limit = (req.num_tokens - 1) // kv.block_size
        hits = kv.get_computed_blocks(req)[0]
        digests = self._digests(req, limit)
        end = len(hits)
        while end < limit and self.store.lookup(digests[end]):
            end += 1
        state = None
        if kv.checkpoints is not None:               # back to the last block with a state to resume from
            keys = kv.block_keys(req, end)
            while end > len(hits) and kv.checkpoints.lookup(*keys[end - 1]) is None \
                    and not self.store.lookup(state_digest(digests[end - 1])):
                end -= 1
            if end > len(hits) and kv.checkpoints.lookup(*keys[end - 1]) is None:
                state = self._read([state_digest(digests[end - 1])], [self._ttl(req, end - 1)])
                if not state:
                    return 0
        if end == len(hits):
            return 0
        kv.pool.touch(hits)                        # the RAM hits stay while fresh blocks are taken
        fresh = kv.pool.allocate(end - len(hits)) or []
        try:
            ttls = [self._ttl(req, i) for i in range(len(hits), end)]
            payloads = self._read(digests[len(hits):end], ttls) if fresh else []
            if state is not None and len(payloads) < end - len(hits):
                return 0                           # the state's block did not read: none of the run helps
            self.io.fill(fresh[:len(payloads)], payloads)
            keys = kv.block_keys(req, end)[len(hits):len(hits) + len(payloads)]
            if state is not None and not self._adopt_state(kv, keys[-1], state[0]):
                return 0
            for b, (h, key) in zip(fresh, keys):
                if kv.pool.cache(b, h, key):
                    kv.pool.loaded.add(b)          # its first taker's hit is the disk's, not RAM's
            self.stats.blocks_read += len(payloads)
            self.stats.bytes_read += sum(map(len, payloads))
            return len(payloads)
        finally:
            kv.pool.free(fresh)                    # cached and free (the rest uncached): the scheduler's hits
            kv.pool.free(hits)

    def _adopt_state(self, kv: KVCacheManager, key: tuple[int, BlockKey], payload: bytearray) -> bool:
        """A hybrid's state read from disk, entered as the checkpoint of the prefix ending with this block."""
        assert kv.checkpoints is not None
        slot = kv.checkpoints.adopt(*key)
        if slot is None:                           # every checkpoint slot awaits a copy this step
            return False
        self.io.fill_state(slot, payload)
        self.stats.bytes_read += len(payload)
        return True

    def _read(self, digests: Sequence[bytes], ttls: Sequence[float]) -> list[bytearray]:
        """The payloads of the leading blocks that read and check out (each kept its ttl more)."""
        out = []
        for d, ttl in zip(digests, ttls):
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
        called = clocks()
        try:
            self._save(kv)
        finally:
            self.stats.saves.add(*called)

    def _save(self, kv: KVCacheManager) -> None:
        new, states = kv.take_new_cached()
        if not new and not states:
            return
        try:
            blocks = self._to_write(new, False)
            for (d, ttl, _), payload in zip(blocks, self.io.copy_out([b for _, _, b in blocks])):
                self.writer.write(d, payload, ttl)
            prompt_states = [(r, i, slot) for r, i, slot in states
                             if (i + 1) * self.block_size <= r.num_prompt_tokens]
            for d, ttl, slot in self._to_write(prompt_states, True):
                self.writer.write(d, self.io.copy_state(slot), ttl)
        except Exception:
            self.stats.write_errors += 1
            log.exception("prompt cache: copying %d blocks out failed; they stay uncached on disk", len(new))

    def _to_write(self, new: list[tuple[Request, int, int]], states: bool) -> list[tuple[bytes, float, int]]:
        """(digest, ttl, block id or state slot) of the entries not on disk yet; those on disk are
        refreshed."""
        out, seen = [], set()
        for req, i, where in new:
            d = self._digests(req, i + 1)[i]
            d = state_digest(d) if states else d
            ttl = self._ttl(req, i)
            if d in seen or d in self.writer.pending:
                continue
            seen.add(d)
            if self.store.lookup(d):
                self.writer.refresh(d, ttl)
            else:
                out.append((d, ttl, where))
        return out

    def flush(self) -> None:
        """Wait for the queued writes (a test, or before handing the directory to another engine)."""
        self.writer.flush()

    def sweep(self) -> None:
        """Evict expired entries, then LRU ones past the size, now (the writer does it as it writes)."""
        self.writer.flush()
        self.writer.sweep()

    def close(self) -> None:
        self.writer.close()
