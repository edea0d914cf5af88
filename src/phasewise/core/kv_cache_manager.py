"""Which KV blocks each request holds: prefix-cache hits, growth on demand, freeing, and the
blocks a sliding window no longer sees.

KV groups: the model's layers are split into groups of equal size (one group for a model
whose layers all attend to everything); every block id of the one pool belongs to one group
at a time and holds the K/V of that group's layers for `block_size` tokens. A request has a
block table per group (`request.block_tables[g]`). A group with a window (Gemma 3's local layers,
Mistral) frees the blocks wholly behind its window as the request moves on: their entries
become NULL_BLOCK, so a long sequence holds its full context only in the full-attention groups.

Prefix caching: every full block of a request's tokens gets a hash chained on its parent
block's hash, so equal hashes mean equal prefixes (per group: each group caches its own
blocks). A new request takes the longest cached prefix whose blocks every group still has
(a windowed group only those its window needs), but never the block holding its last prompt
token: that token's logits must be computed. The blocks within a request's cache breakpoints
(`SamplingParams.cache_breakpoints`) are kept in the pool (`BlockPool.keep`) their ttl past each commit
that registers or finds them; those it registers itself count in `metrics.cache_written`.

State slots: a hybrid model's recurrent layers keep a fixed state per sequence, not KV. The
manager hands each running request one of `num_state_slots` slots (`request.state_slot`) with its
first blocks, and takes it back with them; the runner's state tensors are indexed by it. A prefix
hit on such a model also needs the state where the hit ends: `StateCheckpoints` keeps copies at
block boundaries (core/state_checkpoints.py), and a hit is cut back to the last boundary with one.
An int8 KV cache keeps each running sequence's newest keys in fp32 in a tail slot: the manager hands
those out (`request.tail_slot`) and takes them back alike; a hit needs none (it ends on a block boundary).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence

from phasewise.core.block_pool import BlockPool
from phasewise.core.request import BlockKey, Request
from phasewise.core.state_checkpoints import StateCheckpoints

NULL_BLOCK = -1     # a table entry whose block was freed behind a window (never read)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: Sequence[int | None] = (None,), num_state_slots: int = 0,
                 num_state_checkpoints: int = 0, now: Callable[[], float] = time.monotonic,
                 num_tail_slots: int = 0) -> None:
        """windows: one entry per KV group, its sliding window in tokens (None: full attention).
        num_state_slots: a hybrid's recurrent-state slots (0: the model keeps none), then its
        num_state_checkpoints slots for checkpoints (0: no prefix hits for it). now: the clock that cache
        breakpoints' blocks are kept by (seconds). num_tail_slots: an int8 KV cache's tail slots (0: a
        float cache)."""
        if not windows:
            raise ValueError("at least one KV group")
        self.block_size = block_size
        self.checkpoints = StateCheckpoints(num_state_slots, num_state_checkpoints) \
            if num_state_slots and num_state_checkpoints and enable_prefix_caching else None
        self.enable_prefix_caching = enable_prefix_caching and \
            (not num_state_slots or self.checkpoints is not None)
        self.windows = tuple(windows)
        self.pool = BlockPool(num_blocks, now)
        self.num_state_slots = num_state_slots
        self.free_state_slots = list(range(num_state_slots - 1, -1, -1))   # a stack: slot 0 first
        self.free_tail_slots = list(range(num_tail_slots - 1, -1, -1))
        self.num_tail_slots = num_tail_slots
        # (request, block index, block id) of the blocks cached since take_new_cached, and (request, block
        # index, state slot) of the states checkpointed where a block ends, while a disk tier wants them
        # (None: nobody does)
        self.new_cached: list[tuple[Request, int, int]] | None = None
        self.new_states: list[tuple[Request, int, int]] = []

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_blocks(self, num_tokens: int, chunk: int) -> int:
        """The most blocks one request of `num_tokens` can hold at once, computing `chunk` tokens
        a step: its whole context in full groups, a window and a chunk in windowed ones."""
        full = self.blocks_for(num_tokens)
        return sum(full if w is None else min(full, self.blocks_for(w + chunk) + 1) for w in self.windows)

    @property
    def usage(self) -> float:
        return self.pool.usage

    # ---- hashing ----------------------------------------------------------------------

    def _block_keys(self, request: Request, num_blocks: int) -> list[tuple[int, BlockKey]]:
        """(hash, key) of the request's first `num_blocks` full blocks, computed once and kept; a cache
        salt joins the first block's key, so requests of different salts share none."""
        return chain_keys(request.token_ids, num_blocks, self.block_size, request.block_hashes,
                          salt_root(request.sampling_params.cache_salt))

    @staticmethod
    def _in_group(group: int, h: int, key: BlockKey) -> tuple[int, Hashable]:
        """A block's cache entry in `group` (group 0 keeps the plain hash)."""
        return (h, key) if group == 0 else (hash((group, h)), (group, key))

    # ---- allocation -------------------------------------------------------------------

    def _first_needed(self, group: int, num_computed: int) -> int:
        """The first block the next query (at position num_computed) can still see in `group`."""
        w = self.windows[group]
        return 0 if w is None else max(0, num_computed - w + 1) // self.block_size

    def get_computed_blocks(self, request: Request) -> list[list[int]]:
        """Per group, the cached blocks that give the request a computed prefix (NULL_BLOCK where a
        window no longer needs one); every table has the same length n (n * block_size tokens)."""
        empty: list[list[int]] = [[] for _ in self.windows]
        if not self.enable_prefix_caching:
            return empty
        keys = self._block_keys(request, (request.num_tokens - 1) // self.block_size)  # never the last token
        found: list[list[int | None]] = []        # per group, its cached block (or None) for each key
        limit = len(keys)                         # a full group serves at most its run from the start
        for g, w in enumerate(self.windows):
            hits = [self.pool.lookup(*self._in_group(g, h, key)) for h, key in keys[:limit]]
            if w is None:
                limit = next((i for i, b in enumerate(hits) if b is None), limit)
            found.append(hits)
        if self.checkpoints is not None:          # a hybrid resumes from a state checkpoint: the last one
            checkpoints = self.checkpoints
            limit = next((n for n in range(limit, 0, -1) if checkpoints.lookup(*keys[n - 1]) is not None), 0)
        for n in range(limit, 0, -1):             # the longest prefix whose windows are there too
            if all(b is not None for g, w in enumerate(self.windows) if w is not None
                   for b in found[g][self._first_needed(g, n * self.block_size):n]):
                firsts = [self._first_needed(g, n * self.block_size) for g in range(self.num_groups)]
                return [[NULL_BLOCK] * first + _held(found[g][first:n]) for g, first in enumerate(firsts)]
        return empty

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: Sequence[Sequence[int]] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones (plus, for a newly
        admitted request, the cache hits `computed_blocks`, per group, which it then holds). False,
        with nothing changed, when the pool is short."""
        pool, groups = self.pool, range(self.num_groups)
        needs_slot = self.num_state_slots > 0 and request.state_slot is None
        needs_tail = self.num_tail_slots > 0 and request.tail_slot is None
        if (needs_slot and not self.free_state_slots) or (needs_tail and not self.free_tail_slots):
            return False
        if not request.block_tables:
            request.block_tables = [[] for _ in groups]
        hits = [list(computed_blocks[g]) if computed_blocks else [] for g in groups]
        computed = request.num_computed_tokens + (len(hits[0]) * self.block_size if computed_blocks else 0)
        total = self.blocks_for(computed + num_new_tokens)
        needed = sum(total - len(request.block_tables[g]) - len(hits[g]) for g in groups)
        taken = [b for g in groups for b in hits[g] if b != NULL_BLOCK]
        hits_now_free = sum(1 for b in taken if pool.ref_counts[b] == 0)
        if needed > pool.num_free - hits_now_free:
            return False
        pool.touch(taken)
        pool.hit(taken)
        if needs_slot:
            request.state_slot = self.free_state_slots.pop()
        if needs_tail:
            request.tail_slot = self.free_tail_slots.pop()
        if hits[0] and self.checkpoints is not None and request.state_slot is not None:
            self.checkpoints.restore(*request.block_hashes[len(hits[0]) - 1], request.state_slot)
        for g in groups:
            table = request.block_tables[g]
            table.extend(hits[g])
            if total > len(table):
                new = pool.allocate(total - len(table))
                assert new is not None                # counted above: the pool has them
                table.extend(new)
        return True

    def _free_behind_windows(self, request: Request) -> None:
        """Free each windowed group's blocks that no query from num_computed_tokens on can see. What
        an earlier step freed is already NULL below them, so the scan walks down only the new ones."""
        for g, w in enumerate(self.windows):
            if w is None or g >= len(request.block_tables):
                continue
            table = request.block_tables[g]
            end = i = min(self._first_needed(g, request.num_computed_tokens), len(table))
            while i > 0 and table[i - 1] != NULL_BLOCK:
                i -= 1
            self.pool.free(table[i:end])
            table[i:end] = [NULL_BLOCK] * (end - i)

    def commit(self, request: Request) -> None:
        """After a step: register the blocks now full of computed tokens in the prefix cache, and free
        what the windows left behind (so the pool holds no more than the next step needs)."""
        self._cache_full_blocks(request)
        self._free_behind_windows(request)
        n, bs = request.num_computed_tokens, self.block_size
        if self.checkpoints is not None and n and n % bs == 0 and request.state_slot is not None:
            self.checkpoints.save(*self._block_keys(request, n // bs)[-1], request.state_slot)
            if self.new_cached is not None:
                self.new_states.append((request, n // bs - 1, request.state_slot))

    def take_state_copies(self) -> list[tuple[int, int]]:
        """The recurrent-state copies (from slot, to slot) the runner makes before the next forward."""
        return [] if self.checkpoints is None else self.checkpoints.take_copies()

    def prompt_boundary(self, request: Request) -> int | None:
        """Where a hybrid's prompt chunk should end so that its state is checkpointed there: the last
        block boundary before its last prompt token (the longest prefix a later request can hit)."""
        if self.checkpoints is None:
            return None
        return (request.num_prompt_tokens - 1) // self.block_size * self.block_size

    def _cache_full_blocks(self, request: Request) -> None:
        if not self.enable_prefix_caching:
            return
        full = request.num_computed_tokens // self.block_size
        if full <= request.num_cached_blocks:
            return
        params = request.sampling_params
        now = self.pool.now() if params.cache_breakpoints else 0.0
        for i, (h, key) in enumerate(self._block_keys(request, full)[request.num_cached_blocks:],
                                     start=request.num_cached_blocks):
            ttl = params.marked_ttl((i + 1) * self.block_size) if params.cache_breakpoints else None
            for g, table in enumerate(request.block_tables):
                if table[i] != NULL_BLOCK:
                    new = self.pool.cache(table[i], *self._in_group(g, h, key))
                    if ttl is not None:             # a breakpoint's block, written or read: kept ttl more
                        self.pool.keep(table[i], now + ttl)
                        if new and g == 0:
                            written = request.metrics.cache_written
                            written[ttl] = written.get(ttl, 0) + self.block_size
            if self.new_cached is not None:
                self.new_cached.append((request, i, request.block_tables[0][i]))
        request.num_cached_blocks = full

    def take_new_cached(self) -> tuple[list[tuple[Request, int, int]], list[tuple[Request, int, int]]]:
        """Since the last call: (request, block index, block id) of each block cached (or found cached), and
        for a hybrid (request, block index, state slot) of each state checkpointed where that block ends;
        the blocks and slots keep those contents until the next forward. Starts the record."""
        new, states = self.new_cached or [], self.new_states
        self.new_cached, self.new_states = [], []
        return new, states

    def block_keys(self, request: Request, num_blocks: int) -> list[tuple[int, BlockKey]]:
        """The RAM cache's (hash, key) of the request's first blocks (what `pool.cache` takes)."""
        return self._block_keys(request, num_blocks)

    # ---- KV handed from one engine to another (prefill/decode disaggregation) -----------

    def cached_prefix(self, token_ids: Sequence[int], salt: str | None = None) -> list[int]:
        """The cached blocks holding the longest computed prefix of token_ids under this cache salt
        (whole blocks, never the block of the last token, as a request would take them);
        full-attention models only."""
        self._only_full("exporting KV blocks")
        whole = (len(token_ids) - 1) // self.block_size
        keys = chain_keys(token_ids, whole, self.block_size, root=salt_root(salt))
        blocks = []
        for h, key in keys:
            b = self.pool.lookup(h, key) if self.enable_prefix_caching else None
            if b is None:
                break
            blocks.append(b)
        return blocks

    def adopt_prefix(self, token_ids: Sequence[int], num_blocks: int, salt: str | None = None
                     ) -> list[tuple[int, bool]] | None:
        """Take free blocks for the first `num_blocks` blocks of token_ids and enter them in the prefix
        cache as if computed here by a request of this cache salt (the caller fills them before any request
        runs), then release them: cached and free, a request with this prefix and salt takes them as hits.
        A block already cached here is kept as it is. Returns (block id, whether the caller must fill it)
        for each, or None when the pool is short (nothing taken)."""
        self._only_full("importing KV blocks")
        if not self.enable_prefix_caching:
            raise ValueError("importing KV blocks needs prefix caching (they arrive as cached blocks)")
        keys = chain_keys(token_ids, num_blocks, self.block_size, root=salt_root(salt))
        have = [self.pool.lookup(h, key) for h, key in keys]
        fresh = self.pool.allocate(sum(1 for b in have if b is None))
        if fresh is None:
            return None
        it = iter(fresh)
        blocks = [(b, False) if b is not None else (next(it), True) for b in have]
        for (b, _), (h, key) in zip(blocks, keys):
            self.pool.cache(b, h, key)
        self.pool.free(fresh)
        return blocks

    def _only_full(self, what: str) -> None:
        if len(self.windows) != 1 or self.windows[0] is not None or self.num_state_slots:
            raise ValueError(f"{what} is not implemented for models with sliding-window or recurrent "
                             "layers yet")

    def free(self, request: Request) -> None:
        """Return every block of the request, tail first (so tails are evicted first)."""
        for table in request.block_tables:
            self.pool.free(b for b in reversed(table) if b != NULL_BLOCK)
        request.block_tables = []
        request.num_cached_blocks = 0
        if request.state_slot is not None:
            self.free_state_slots.append(request.state_slot)
            request.state_slot = None
        if request.tail_slot is not None:
            self.free_tail_slots.append(request.tail_slot)
            request.tail_slot = None


def _held(blocks: Sequence[int | None]) -> list[int]:
    """Cache hits the caller found all present."""
    held = [b for b in blocks if b is not None]
    assert len(held) == len(blocks)
    return held


def salt_root(salt: str | None) -> Hashable:
    """The first block's parent under a cache salt (None: no salt)."""
    return None if salt is None else ("salt", salt)


def chain_keys(token_ids: Sequence[int], num_blocks: int, block_size: int,
               hashes: list[tuple[int, BlockKey]] | None = None,
               root: Hashable = None) -> list[tuple[int, BlockKey]]:
    """(hash, key) of the first `num_blocks` full blocks of token_ids, each chained on its parent's
    hash, the first on `root` (a cache salt's); `hashes` (a request's, kept across steps) is extended
    in place."""
    hashes = [] if hashes is None else hashes
    while len(hashes) < num_blocks:
        i = len(hashes)
        parent = hashes[-1][0] if hashes else root
        key = (parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        hashes.append((hash(key), key))
    return hashes[:num_blocks]
