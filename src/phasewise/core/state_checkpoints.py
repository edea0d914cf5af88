"""Checkpoints of a hybrid's recurrent state at block boundaries: what a prefix-cache hit resumes from.

A recurrent layer's state (a Gated DeltaNet's, a short convolution's) after token t summarises every
token up to t, so a prefix hit on a hybrid needs, beside the attention layers' KV blocks, the state
as it was where the hit ends. When a request's computed tokens reach a block boundary, its state is
copied into a checkpoint slot, keyed by the chained hash of the block ending there; a later request
whose cached blocks reach that boundary copies it into its own slot. Checkpoint slots follow the
running requests' slots in the runner's state tensors and are reused least recently used first, so
their memory is fixed: `capacity` x the model's state per sequence.

The copies are plain (from slot, to slot) pairs that the runner makes before the next forward:
saves first (a slot freed since keeps its contents until a forward writes it), then restores.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class StateCheckpoints:
    def __init__(self, first_slot: int, capacity: int) -> None:
        """Checkpoint slots first_slot .. first_slot + capacity - 1."""
        self.capacity = capacity
        self.entries: OrderedDict[int, tuple[Hashable, int]] = OrderedDict()  # hash → (key, slot), LRU
        self.free = list(range(first_slot + capacity - 1, first_slot - 1, -1))
        self.saves: list[tuple[int, int]] = []
        self.restores: list[tuple[int, int]] = []

    def lookup(self, block_hash: int, key: Hashable) -> int | None:
        """The checkpoint slot of the prefix ending with this block, if kept (the key rules out
        collisions)."""
        entry = self.entries.get(block_hash)
        return entry[1] if entry is not None and entry[0] == key else None

    def save(self, block_hash: int, key: Hashable, from_slot: int) -> None:
        """Keep a copy of the state in `from_slot` as the prefix ending with this block (the least
        recently used checkpoint gives way when none is free)."""
        if self.lookup(block_hash, key) is not None:
            self.entries.move_to_end(block_hash)
            return
        if block_hash in self.entries:                 # a colliding hash: the newer prefix takes it
            self.free.append(self.entries.pop(block_hash)[1])
        slot = self.free.pop() if self.free else self.entries.popitem(last=False)[1][1]
        self.entries[block_hash] = (key, slot)
        self.saves.append((from_slot, slot))

    def adopt(self, block_hash: int, key: Hashable) -> int | None:
        """A slot for a checkpoint of this prefix whose state the caller writes now (read from disk),
        kept from here on: a free slot or the least recently used checkpoint's, never one a pending copy
        reads or writes. None when it is kept already or every slot is pending."""
        if self.lookup(block_hash, key) is not None:
            return None
        busy = {s for pair in self.saves + self.restores for s in pair}
        free = [s for s in self.free if s not in busy]
        if free:
            slot = free[-1]
            self.free.remove(slot)
        else:
            lru = next((h for h, (_, s) in self.entries.items() if s not in busy), None)
            if lru is None:
                return None
            slot = self.entries.pop(lru)[1]
        if block_hash in self.entries:                 # a colliding hash: the newer prefix takes it
            self.free.append(self.entries.pop(block_hash)[1])
        self.entries[block_hash] = (key, slot)
        return slot

    def restore(self, block_hash: int, key: Hashable, to_slot: int) -> None:
        """Start `to_slot` from the checkpoint of this prefix (which must be kept)."""
        slot = self.lookup(block_hash, key)
        assert slot is not None, "restoring a checkpoint that is not kept"
        self.entries.move_to_end(block_hash)
        self.restores.append((slot, to_slot))

    def take_copies(self) -> list[tuple[int, int]]:
        """The (from, to) slot copies to make before the next forward, saves first; then none pending."""
        copies = self.saves + self.restores
        self.saves, self.restores = [], []
        return copies
