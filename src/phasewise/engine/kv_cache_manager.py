"""Which KV blocks each request holds: grow on demand, free on finish, abort or preemption."""

from __future__ import annotations

from phasewise.engine.block_pool import BlockPool
from phasewise.engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def usage(self) -> float:
        return self.pool.usage

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more computed tokens; False (nothing taken) when the pool is short."""
        needed = self.blocks_for(request.num_computed_tokens + num_new_tokens) - len(request.block_ids)
        if needed <= 0:
            return True
        blocks = self.pool.allocate(needed)
        if blocks is None:
            return False
        request.block_ids.extend(blocks)
        return True

    def free(self, request: Request) -> None:
        """Return every block of the request, tail first (so tails are reused first)."""
        self.pool.free(list(reversed(request.block_ids)))
        request.block_ids = []
