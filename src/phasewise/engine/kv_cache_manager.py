"""Which KV blocks each request holds: prefix-cache hits, growth on demand, and freeing.

Prefix caching: every full block of a request's tokens gets a hash chained on
its parent block's hash, so equal hashes mean equal prefixes. A new request
takes the longest run of cached blocks that matches its tokens, but never the
block holding its last prompt token: that token's logits must be computed.
"""

from __future__ import annotations

from phasewise.engine.block_pool import BlockKey, BlockPool
from phasewise.engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def usage(self) -> float:
        return self.pool.usage

    # ---- hashing ----------------------------------------------------------------------

    def _block_keys(self, request: Request, num_blocks: int) -> list[tuple[int, BlockKey]]:
        """(hash, key) of the request's first `num_blocks` full blocks, computed once and kept."""
        hashes = request.block_hashes
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1][0] if hashes else None
            key = (parent, tuple(request.token_ids[i * bs:(i + 1) * bs]))
            hashes.append((hash(key), key))
        return hashes[:num_blocks]

    # ---- allocation -------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The cached blocks that hold a prefix of the request (tokens: len(result) * block_size)."""
        if not self.enable_prefix_caching:
            return []
        usable = (request.num_tokens - 1) // self.block_size   # never cover the last token
        hits = []
        for h, key in self._block_keys(request, usable):
            b = self.pool.lookup(h, key)
            if b is None:
                break
            hits.append(b)
        return hits

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: tuple[int, ...] | list[int] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones (plus, for a newly
        admitted request, the cache hits `computed_blocks`, which it then holds). False, with
        nothing changed, when the pool is short."""
        pool = self.pool
        held = len(request.block_ids) + len(computed_blocks)
        computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        needed = self.blocks_for(computed + num_new_tokens) - held
        hits_now_free = sum(1 for b in computed_blocks if pool.ref_counts[b] == 0)
        if needed > pool.num_free - hits_now_free:
            return False
        pool.touch(computed_blocks)
        request.block_ids.extend(computed_blocks)
        if needed > 0:
            request.block_ids.extend(pool.allocate(needed))
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that are now full of computed tokens in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        full = request.num_computed_tokens // self.block_size
        if full <= request.num_cached_blocks:
            return
        for i, (h, key) in enumerate(self._block_keys(request, full)[request.num_cached_blocks:],
                                     start=request.num_cached_blocks):
            self.pool.cache(request.block_ids[i], h, key)
        request.num_cached_blocks = full

    def free(self, request: Request) -> None:
        """Return every block of the request, tail first (so tails are evicted first)."""
        self.pool.free(reversed(request.block_ids))
        request.block_ids = []
        request.num_cached_blocks = 0
