"""A pool of fixed-size KV blocks: reference counts, a prefix-cache map, and three kinds of free block.

A free block that holds no cached prefix goes on a stack, and allocation takes the most recently
freed first: the next request reuses memory still in the CPU's caches, and a pool larger than the
work never touches its other pages (the KV tensor's pages are mapped from the OS on first write,
which cost a 512-token prefill ~6% when every request walked the whole pool). A free block that
holds a cached prefix keeps its contents and hash at the back of an LRU queue: a later request with
the same prefix can take it back (a cache hit) until allocation, with the stack empty, reaches it
at the front of the queue, where its hash is dropped (eviction) and it is reused.

A cached block may be kept until a time (`keep`: a cache_control breakpoint's TTL): freed before then,
it waits in a second LRU queue, which allocation reaches only when the first is empty. Before evicting,
allocation moves the kept blocks whose time has passed to the front of the first queue (their lease is
over: evicted first). Kept blocks are evicted last, never refused to a request.

`stats` counts the cache's work since the start, evictions by cause: `lru` (an unkept block at the front of
the queue), `ttl` (a kept block whose time had passed, evicted ahead of those) and `kept` (a kept block
within its time, taken because no other free block was left).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass


@dataclass
class CacheStats:
    """The RAM prefix cache's counters since the start (EngineStats carries a copy); blocks of every KV
    group."""
    hit_blocks: int = 0           # cached blocks admitted requests took (not those the disk tier loaded)
    evicted_lru: int = 0          # entries dropped to reuse their block: unkept, least recently freed first,
    evicted_ttl: int = 0          # kept ones whose time had passed (taken before those),
    evicted_kept: int = 0         # and kept ones within their time (no other free block was left)


class BlockPool:
    def __init__(self, num_blocks: int, now: Callable[[], float] = time.monotonic) -> None:
        """now: the clock `keep` times are on (seconds)."""
        self.num_blocks, self.now = num_blocks, now
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_key: list[Hashable | None] = [None] * num_blocks   # kept to rule out hash collisions
        self.cached: dict[int, int] = {}                              # hash → block id
        self.free_stack: list[int] = list(range(num_blocks - 1, -1, -1))   # uncached; pop() is the top
        self.free_cached: OrderedDict[int, None] = OrderedDict()             # least recently freed first
        self.kept_until = [0.0] * num_blocks                                  # `now` time; 0: not kept
        # cached, kept, least recently freed first
        self.free_kept: OrderedDict[int, None] = OrderedDict()
        # no kept free block expires before
        self._next_expiry = math.inf
        self.loaded: set[int] = set()           # cached blocks the disk tier filled, no request took yet
        self.stats = CacheStats()

    @property
    def num_free(self) -> int:
        """Blocks not referenced by any request (cached or not): what allocation can take."""
        return len(self.free_stack) + len(self.free_cached) + len(self.free_kept)

    @property
    def usage(self) -> float:
        """Share of blocks referenced by requests, 0..1."""
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, n: int) -> list[int] | None:
        """n blocks with ref count 1, or None (and nothing taken) when fewer than n are free: uncached
        ones first, most recently freed first, then cached ones, least recently freed first
        (evicting their cache entries), kept ones last."""
        if n > self.num_free:
            return None
        blocks, released = [], False
        for _ in range(n):
            if self.free_stack:
                b = self.free_stack.pop()
            else:
                if not released:
                    self._release_expired()
                    released = True
                kept = not self.free_cached
                b, _ = (self.free_kept if kept else self.free_cached).popitem(last=False)
                self._evict(b, "kept" if kept else "ttl" if self.kept_until[b] else "lru")
            self.ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each; blocks reaching zero are freed in order: the last one freed
        is the first an allocation takes back, or (cached) the last one evicted."""
        now = self.now()
        for b in block_ids:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"block {b} freed twice")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if self.block_hash[b] is None:
                    self.free_stack.append(b)
                elif self.kept_until[b] > now:
                    self.free_kept[b] = None
                    self._next_expiry = min(self._next_expiry, self.kept_until[b])
                else:
                    self.free_cached[b] = None

    def _release_expired(self) -> None:
        """Kept free blocks whose time has passed go to the front of the LRU queue (evicted first)."""
        now = self.now()
        if now < self._next_expiry:
            return
        expired = [b for b in self.free_kept if self.kept_until[b] <= now]
        for b in reversed(expired):
            del self.free_kept[b]
            self.free_cached[b] = None
            self.free_cached.move_to_end(b, last=False)
        self._next_expiry = min((self.kept_until[b] for b in self.free_kept), default=math.inf)

    # ---- prefix cache ---------------------------------------------------------------

    def lookup(self, block_hash: int, key: Hashable) -> int | None:
        """The cached block holding exactly `key`, or None."""
        b = self.cached.get(block_hash)
        return b if b is not None and self.block_key[b] == key else None

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cache hits (cached blocks), pulling free ones out of the LRU queue."""
        for b in block_ids:
            if self.ref_counts[b] == 0:
                (self.free_cached if b in self.free_cached else self.free_kept).pop(b)
            self.ref_counts[b] += 1

    def cache(self, block_id: int, block_hash: int, key: Hashable) -> bool:
        """Record that a full block holds `key`, unless it already holds one; the first block cached for a
        hash keeps it. True when this block became the cache's entry for `key` (new to the cache)."""
        if self.block_hash[block_id] is not None:
            return False
        self.block_hash[block_id], self.block_key[block_id] = block_hash, key
        return self.cached.setdefault(block_hash, block_id) == block_id

    def keep(self, block_id: int, until: float) -> None:
        """Evict this cached block (held now) after unkept ones until `until` (a later time stays)."""
        self.kept_until[block_id] = max(self.kept_until[block_id], until)

    def hit(self, block_ids: Iterable[int]) -> None:
        """Count cache hits an admitted request took (those the disk tier just loaded are its hits)."""
        for b in block_ids:
            if b in self.loaded:
                self.loaded.discard(b)
            else:
                self.stats.hit_blocks += 1

    def _evict(self, b: int, cause: str) -> None:
        """Drop block b's cache entry (if it is the entry of its hash), counted under `cause`."""
        h = self.block_hash[b]
        if h is not None:
            if self.cached.get(h) == b:
                del self.cached[h]
                stats = self.stats
                if cause == "lru":
                    stats.evicted_lru += 1
                elif cause == "ttl":
                    stats.evicted_ttl += 1
                else:
                    stats.evicted_kept += 1
            self.block_hash[b] = self.block_key[b] = None
        self.kept_until[b] = 0.0
        self.loaded.discard(b)

    @property
    def num_cached(self) -> int:
        return len(self.cached)
