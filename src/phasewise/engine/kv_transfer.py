"""The engine's side of KV blocks between engines (prefill/decode disaggregation): copy a computed
prompt's blocks out of one engine's prefix cache, enter them in another's, and send or receive them
over the KV link. The server's side is server/disaggregation.py, the transport
distributed/kv_link.py."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from phasewise.distributed.kv_link import KVLink, Payload
from phasewise.core.kv_cache_manager import KVCacheManager
from phasewise.runner.kv_cache import KVBlocks, KVCache


class KVTransfer:
    """One engine's KV blocks in and out: `blocks` is its core's block manager, `cache` the tensors
    they index; `role` (prefill or decode, None for neither) and `peer` (the pair's init address)
    open the link to the other instance; `tensor_parallel`: the cache is split over ranks (not
    implemented there yet). Called on the engine's thread."""

    def __init__(self, blocks: KVCacheManager, cache: KVCache, role: str | None, peer: str | None,
                 tensor_parallel: bool) -> None:
        self.blocks, self.cache, self.tensor_parallel = blocks, cache, tensor_parallel
        self.link: KVLink | None = None
        if role:
            if peer is None:
                raise ValueError("a prefill or decode role needs a KV peer (tcp://HOST:PORT, "
                                 "the same on both sides)")
            self.link = KVLink(role, peer)

    def export(self, token_ids: list[int], salt: str | None = None) -> KVBlocks:
        """The blocks of the prefix cache that hold the longest computed prefix of token_ids under this
        cache salt (whole blocks, never the last token's: the receiver computes that one), copied out. Run
        the prompt first (e.g. max_tokens=1): its blocks stay cached after it ends."""
        self._no_tp("exporting KV blocks")
        blocks = self.blocks.cached_prefix(token_ids, salt)
        bs = self.cache.block_size
        return KVBlocks(list(token_ids[:len(blocks) * bs]), bs, self.cache.read_blocks(blocks))

    def adopt(self, kv: KVBlocks, salt: str | None = None) -> int:
        """Enter another engine's blocks (same model, block size and KV precision) in the prefix cache:
        a request with that prefix and cache salt then computes only the rest. Returns the tokens entered;
        ValueError when the layouts differ or the pool has no room for them."""
        self._no_tp("importing KV blocks")
        if kv.block_size != self.cache.block_size:
            raise ValueError(f"KV blocks of {kv.block_size} tokens cannot enter a cache of "
                             f"{self.cache.block_size}")
        n = len(kv.token_ids)
        for name, t in self.cache.read_blocks([0]).items():      # this cache's layout, one block long
            want = (*t.shape[:2], t.shape[2] * kv.num_blocks, *t.shape[3:])
            theirs = kv.parts.get(name)
            if theirs is None or theirs.dtype != t.dtype or tuple(theirs.shape) != want or n % kv.block_size:
                got = None if theirs is None else f"{tuple(theirs.shape)} {theirs.dtype}"
                raise ValueError(f"the KV blocks' {name} ({got}) does not match this engine's cache "
                                 f"({want} {t.dtype})")
        placed = self.blocks.adopt_prefix(kv.token_ids, kv.num_blocks, salt)
        if placed is None:
            raise ValueError(f"no room for {kv.num_blocks} KV blocks: {self.blocks.pool.num_free} are free")
        fill = [i for i, (_, fresh) in enumerate(placed) if fresh]
        if fill:
            self.cache.write_blocks([placed[i][0] for i in fill],
                                    {name: torch.cat([kv.block(i)[name] for i in fill], dim=2)
                                     for name in kv.parts})
        return kv.num_blocks * kv.block_size

    def send(self, transfer_id: str, token_ids: list[int], salt: str | None = None) -> Future[None]:
        """A prefill instance: send the cached blocks of this computed prompt (of this cache salt) to the
        decode instance; the future resolves once they are sent."""
        if self.link is None or self.link.role != "prefill":
            raise ValueError("only a prefill instance (--role prefill) sends KV blocks")
        kv = self.export(token_ids, salt)
        return self.link.send(transfer_id, (kv.token_ids, kv.block_size, kv.parts))

    def expect(self, transfer_id: str) -> Future[KVBlocks]:
        """A decode instance: the future of the blocks the prefill instance sends under transfer_id
        (a KVBlocks for `adopt`)."""
        if self.link is None or self.link.role != "decode":
            raise ValueError("only a decode instance (--role decode) receives KV blocks")
        out: Future[KVBlocks] = Future()

        def done(f: Future[Payload]) -> None:
            if f.exception() is not None:
                out.set_exception(f.exception())
            else:
                out.set_result(KVBlocks(*f.result()))
        self.link.expect(transfer_id).add_done_callback(done)
        return out

    def forget(self, transfer_id: str) -> None:
        """Drop a transfer that is no longer awaited (its blocks, if they come, are discarded)."""
        if self.link is not None:
            self.link.forget(transfer_id)

    def _no_tp(self, what: str) -> None:
        if self.tensor_parallel:
            raise ValueError(f"{what} is not implemented under tensor parallelism yet")
