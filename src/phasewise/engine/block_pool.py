"""A pool of fixed-size KV blocks: reference counts, a prefix-cache map, and an LRU free queue.

A block whose reference count drops to zero goes to the back of the free queue
but keeps its contents and its hash: a later request with the same prefix can
take it back (a cache hit) until allocation reaches it at the front of the
queue, where its hash is dropped (eviction) and it is reused.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

BlockKey = tuple[Hashable, tuple[int, ...]]   # (parent block's hash, this block's token ids)


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_key: list[BlockKey | None] = [None] * num_blocks   # kept to rule out hash collisions
        self.cached: dict[int, int] = {}                              # hash → block id
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free(self) -> int:
        """Blocks not referenced by any request (cached or not): what allocation can take."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Share of blocks referenced by requests, 0..1."""
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, n: int) -> list[int] | None:
        """n blocks with ref count 1, least recently freed first (evicting their cache entries),
        or None (and nothing taken) when fewer than n are free."""
        if n > len(self.free_queue):
            return None
        blocks = []
        for _ in range(n):
            b, _ = self.free_queue.popitem(last=False)
            self._evict(b)
            self.ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each; blocks reaching zero join the back of the free queue in order."""
        for b in block_ids:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"block {b} freed twice")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_queue[b] = None

    # ---- prefix cache ---------------------------------------------------------------

    def lookup(self, block_hash: int, key: BlockKey) -> int | None:
        """The cached block holding exactly `key`, or None."""
        b = self.cached.get(block_hash)
        return b if b is not None and self.block_key[b] == key else None

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cache hits, pulling free ones out of the free queue."""
        for b in block_ids:
            if self.ref_counts[b] == 0:
                del self.free_queue[b]
            self.ref_counts[b] += 1

    def cache(self, block_id: int, block_hash: int, key: BlockKey) -> None:
        """Record that a full block holds `key`; the first block cached for a hash keeps it."""
        if self.block_hash[block_id] is not None:
            return
        self.block_hash[block_id], self.block_key[block_id] = block_hash, key
        self.cached.setdefault(block_hash, block_id)

    def _evict(self, b: int) -> None:
        h = self.block_hash[b]
        if h is not None:
            if self.cached.get(h) == b:
                del self.cached[h]
            self.block_hash[b] = self.block_key[b] = None

    @property
    def num_cached(self) -> int:
        return len(self.cached)
