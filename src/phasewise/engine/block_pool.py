"""A pool of fixed-size KV blocks, handed out by id with reference counts."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Block ids 0..num_blocks-1. Freed blocks go to the back of the free queue."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_queue: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Share of blocks in use, 0..1."""
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, n: int) -> list[int] | None:
        """n blocks with ref count 1, or None (and nothing taken) when fewer are free."""
        if n > len(self.free_queue):
            return None
        blocks = [self.free_queue.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each; blocks reaching zero return to the free queue in the given order."""
        for b in block_ids:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"block {b} freed twice")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_queue.append(b)
