"""The prefix cache's disk tier without torch: block files (checksums, atomic writes, TTL and LRU under a
fake clock), the core's load and save around a step, cache salts, and the faults that may only cost the
cache. Engines on real models: tests/test_prompt_cache.py."""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

import pytest

from phasewise.core.disk_tier import DiskTier, block_digests
from phasewise.core.kv_cache_manager import KVCacheManager
from phasewise.core.prompt_store import STALE_TMP_S, CorruptEntry, PromptStore
from phasewise.core.request import Request
from phasewise.core.sampling_params import SamplingParams

BS = 4
FP = bytes(range(16))


class FakeClock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def now(self) -> float:
        return self.t


class FakeBlocks:
    """A KV cache of bytes: block b holds whatever was last written to it (a new one holds its own id)."""

    def __init__(self) -> None:
        self.data: dict[int, bytes] = {}

    def copy_out(self, block_ids):
        return [self.data.get(b, b"") for b in block_ids]

    def fill(self, block_ids, payloads):
        for b, p in zip(block_ids, payloads):
            self.data[b] = p


def _store(root: Path, clock: FakeClock, max_bytes: int = 1 << 30, fp: bytes = FP) -> PromptStore:
    return PromptStore(root, fp, max_bytes, clock)


def _request(tokens, rid="r", salt=None, ttl=None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4, cache_salt=salt, cache_ttl=ttl), frozenset())


def _run_prompt(kv: KVCacheManager, tier: DiskTier, io: FakeBlocks, req: Request) -> None:
    """What a step does for a prompt: load from disk, admit with its hits, compute the rest (the fake KV of a
    block is its tokens), commit, save, finish."""
    tier.prefetch(kv, [req])
    hits = kv.get_computed_blocks(req)
    cached = len(hits[0]) * BS
    assert kv.allocate_slots(req, req.num_tokens - cached, hits)
    req.num_computed_tokens = cached
    req.num_cached_tokens = cached
    for i, b in enumerate(req.block_ids):
        if i * BS >= cached:
            io.data[b] = repr(req.token_ids[i * BS:(i + 1) * BS]).encode()
    req.num_computed_tokens = req.num_tokens
    kv.commit(req)
    tier.save(kv)
    kv.free(req)


def _engine(root: Path, clock: FakeClock, ttl: float = 300.0, num_blocks: int = 32):
    kv = KVCacheManager(num_blocks, BS)
    kv.new_cached = []
    io = FakeBlocks()
    return kv, io, DiskTier(_store(root, clock), io, BS, ttl)


def test_a_fresh_engine_loads_the_prompt_it_saw_from_disk(tmp_path):
    clock = FakeClock()
    tokens = list(range(100, 123))                              # 5 whole blocks and 3 tokens
    kv, io, tier = _engine(tmp_path, clock)
    _run_prompt(kv, tier, io, _request(tokens))
    tier.close()
    kv2, io2, tier2 = _engine(tmp_path, clock)                  # "after a restart": nothing in RAM
    req = _request(tokens)
    tier2.prefetch(kv2, [req])
    hits = kv2.get_computed_blocks(req)[0]
    assert len(hits) == 5 and req.metrics.disk_tokens == 20 and tier2.stats.blocks_read == 5
    assert [io2.data[b] for b in hits] == [repr(tokens[i * BS:(i + 1) * BS]).encode() for i in range(5)]
    assert kv2.pool.num_free == 32                               # cached and free until a request takes them
    longer = _request(tokens + [7] * 9, "longer")               # the same prefix, more after it: RAM hits first
    tier2.prefetch(kv2, [longer])
    assert len(kv2.get_computed_blocks(longer)[0]) == 5 and tier2.stats.blocks_read == 5
    other = _request([1] + tokens[1:], "other")                 # another first block: nothing on disk
    tier2.prefetch(kv2, [other])
    assert kv2.get_computed_blocks(other) == [[]]
    tier2.close()


def test_blocks_loaded_from_disk_are_the_disks_hits_and_later_ones_rams(tmp_path):
    clock = FakeClock()
    tokens = list(range(100, 123))                              # 5 whole blocks and 3 tokens
    kv, io, tier = _engine(tmp_path, clock)
    _run_prompt(kv, tier, io, _request(tokens))
    tier.close()
    kv2, io2, tier2 = _engine(tmp_path, clock)
    _run_prompt(kv2, tier2, io2, _request(tokens, "a"))
    assert (tier2.stats.blocks_read, kv2.pool.stats.hit_blocks) == (5, 0)
    _run_prompt(kv2, tier2, io2, _request(tokens, "b"))        # the same blocks again, now from RAM
    assert (tier2.stats.blocks_read, kv2.pool.stats.hit_blocks) == (5, 5)
    tier2.close()


def test_a_salt_joins_the_first_block_so_different_salts_share_nothing(tmp_path):
    clock = FakeClock()
    tokens = list(range(50, 67))
    kv, io, tier = _engine(tmp_path, clock)
    _run_prompt(kv, tier, io, _request(tokens, "a", salt="tenant-a"))
    for salt, expect in ((None, 0), ("tenant-b", 0), ("tenant-a", 4)):          # in RAM
        assert len(kv.get_computed_blocks(_request(tokens, salt=salt))[0]) == expect
    tier.close()
    kv2, _, tier2 = _engine(tmp_path, clock)
    for salt, expect in ((None, 0), ("tenant-b", 0), ("tenant-a", 4)):          # on disk
        req = _request(tokens, salt=salt)
        tier2.prefetch(kv2, [req])
        assert req.metrics.disk_tokens == 4 * expect
    assert block_digests(tokens, 1, BS, None) != block_digests(tokens, 1, BS, "")   # no salt is not the empty salt
    tier2.close()



def test_the_time_counters_count_the_engine_threads_calls_and_the_writers_jobs(tmp_path):
    """What benchmarks/prompt_cache_overhead.py reads: each prefetch and save the engine's thread makes is a
    call of its counter, whatever it did; each block the writer wrote is a job that took CPU time."""
    clock = FakeClock()
    kv, io, tier = _engine(tmp_path, clock)
    _run_prompt(kv, tier, io, _request(list(range(100, 123)), "a"))      # a prefetch and a save: 5 blocks
    _run_prompt(kv, tier, io, _request(list(range(200, 213)), "b"))      # and 3 more
    tier.prefetch(kv, [])                                                # calls that find nothing to do
    tier.save(kv)
    tier.flush()
    s = tier.stats
    assert (s.lookups.calls, s.saves.calls) == (3, 3)
    assert s.writer.calls == s.blocks_written == 8 and s.writer.cpu_s > 0 and s.writer.wall_s > 0
    assert all(side.cpu_s >= 0 and side.wall_s > 0 for side in (s.lookups, s.saves))
    _run_prompt(kv, tier, io, _request(list(range(100, 123)), "c"))      # in RAM: 5 expiries refreshed
    tier.flush()
    assert (s.lookups.calls, s.saves.calls, s.writer.calls, s.blocks_written) == (4, 4, 8 + 5, 8)
    tier.close()

def test_ttls_hold_to_the_second_and_a_use_refreshes_them(tmp_path):
    clock = FakeClock(5000.0)
    store = _store(tmp_path, clock)
    d1, d2 = b"\1" * 16, b"\2" * 16
    store.write(d1, b"x" * 100, ttl=300)
    store.write(d2, b"y" * 100, ttl=3600)                       # a "1h" block
    clock.t = 5299.0
    assert store.lookup(d1) and store.read(d1, ttl=300) == b"x" * 100   # read at 5299: kept to 5599
    clock.t = 5598.0
    assert store.lookup(d1) and store.sweep().expired == 0
    clock.t = 5599.0
    assert not store.lookup(d1) and store.lookup(d2)
    result = store.sweep()
    assert result.expired == 1 and not store.path(d1).exists() and store.path(d2).exists()
    store.write(d2, b"y" * 100, ttl=60)                         # written again with a shorter TTL: the later stays
    clock.t = 5000.0 + 3599
    assert store.lookup(d2)
    clock.t = 5000.0 + 3600
    assert not store.lookup(d2) and store.sweep().expired == 1


def test_a_request_ttl_keeps_its_blocks_and_the_default_applies_otherwise(tmp_path):
    clock = FakeClock()
    kv, io, tier = _engine(tmp_path, clock, ttl=300)
    _run_prompt(kv, tier, io, _request(list(range(9)), "default"))
    _run_prompt(kv, tier, io, _request(list(range(20, 29)), "hour", ttl=3600))
    tier.flush()
    clock.t += 300
    tier.sweep()
    assert tier.stats.evicted_ttl == 2                          # the default TTL's two blocks
    clock.t += 3300
    tier.sweep()
    assert tier.stats.evicted_ttl == 4
    tier.close()


def test_past_the_size_the_least_recently_used_go_first(tmp_path):
    clock = FakeClock()
    store = _store(tmp_path, clock, max_bytes=1000)
    digests = [bytes([i]) * 16 for i in range(5)]
    for d in digests:                                           # 5 x (56 + 200) bytes: over 1000
        store.write(d, b"z" * 200, ttl=3600)
        clock.t += 1
    store.read(digests[0], ttl=3600)                            # the oldest is used again
    result = store.sweep()
    left = [d for d in digests if store.lookup(d)]
    assert result.evicted == 2 and left == [digests[0], digests[3], digests[4]]
    assert result.bytes_left <= 900


@pytest.mark.parametrize("damage", ["flip", "truncate", "other_block", "other_model"])
def test_a_damaged_file_is_a_miss_and_is_removed(tmp_path, damage):
    clock = FakeClock()
    store = _store(tmp_path, clock)
    d, other = b"\5" * 16, b"\6" * 16
    store.write(d, bytes(range(256)) * 4, ttl=60)
    path = store.path(d)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[700] ^= 0x10
    elif damage == "truncate":                                  # a block cut short (a crash mid-copy)
        data = data[:500]
    elif damage == "other_block":                               # another block's file under this name
        store.write(other, bytes(1024), ttl=60)
        data = bytearray(store.path(other).read_bytes())
    else:                                                       # another fingerprint's bytes
        alien = _store(tmp_path, clock, fp=b"\7" * 16)
        alien.write(d, bytes(range(256)) * 4, ttl=60)
        data = bytearray(alien.path(d).read_bytes())
    path.write_bytes(bytes(data))
    assert store.lookup(d)                                      # a stat cannot tell
    with pytest.raises(CorruptEntry):
        store.read(d, ttl=60)
    assert not path.exists() and store.read(d, ttl=60) is None


def test_a_corrupt_block_on_disk_cuts_the_run_there_and_the_rest_is_recomputed(tmp_path):
    clock = FakeClock()
    tokens = list(range(300, 323))
    kv, io, tier = _engine(tmp_path, clock)
    _run_prompt(kv, tier, io, _request(tokens))
    tier.close()
    third = tier.store.path(block_digests(tokens, 3, BS, None)[2])
    third.write_bytes(third.read_bytes()[:-1] + b"\0")
    kv2, io2, tier2 = _engine(tmp_path, clock)
    req = _request(tokens)
    tier2.prefetch(kv2, [req])
    assert len(kv2.get_computed_blocks(req)[0]) == 2 and tier2.stats.corrupt == 1
    assert kv2.pool.num_cached == 2                             # nothing entered for the bad block or after it
    tier2.close()


def test_a_full_disk_leaves_serving_uncached_with_one_warning(tmp_path, monkeypatch, caplog):
    clock = FakeClock()
    kv, io, tier = _engine(tmp_path, clock)

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "replace", full)   # where a full disk fails the write
    with caplog.at_level(logging.WARNING, logger="phasewise.prompt_cache"):
        _run_prompt(kv, tier, io, _request(list(range(13)), "a"))
        _run_prompt(kv, tier, io, _request(list(range(40, 53)), "b"))
        tier.flush()
    assert tier.stats.write_errors == 6 and tier.stats.blocks_written == 0
    assert sum("No space left" in r.getMessage() for r in caplog.records) == 1
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]   # no temporary left behind
    monkeypatch.undo()
    _run_prompt(kv, tier, io, _request(list(range(60, 73)), "c"))   # space again: writes resume
    tier.flush()
    assert tier.stats.blocks_written == 3
    tier.close()


def test_an_unwritable_directory_is_a_clear_error_at_start(tmp_path):
    if os.geteuid() == 0:                                       # root writes through modes: a read-only mount
        root = Path("/sys/kernel")
        if not root.is_dir():
            pytest.skip("no read-only directory to try")
    else:
        root = tmp_path / "ro"
        root.mkdir()
        root.chmod(0o555)
    with pytest.raises(ValueError, match="not writable"):
        _store(root, FakeClock())
    file = tmp_path / "a-file"
    file.write_text("")
    with pytest.raises(ValueError, match="not writable"):
        _store(file, FakeClock())


def test_two_writers_of_one_block_and_a_reader_never_see_a_partial_file(tmp_path):
    """Two processes' stores writing the same block over and over while a third reads without locks:
    every read is a whole, checked payload (or a miss before the first rename)."""
    clock = FakeClock()
    a, b, reader = (_store(tmp_path, clock) for _ in range(3))
    d, payload = b"\x42" * 16, os.urandom(64 << 10)
    seen, stop = [], threading.Event()

    def write(store):
        for _ in range(40):
            store.write(d, payload, ttl=60)

    def read():
        while not stop.is_set():
            seen.append(reader.read(d, ttl=60))
    threads = [threading.Thread(target=write, args=(s,)) for s in (a, b)] + [threading.Thread(target=read)]
    for t in threads:
        t.start()
    for t in threads[:2]:
        t.join()
    stop.set()
    threads[2].join()
    assert all(p in (None, payload) for p in seen) and reader.read(d, ttl=60) == payload
    assert [p.name for p in store_files(tmp_path)] == [a.path(d).name]   # no temporary left


def store_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_a_crash_mid_write_leaves_a_temporary_that_a_later_sweep_removes(tmp_path):
    clock = FakeClock()
    store = _store(tmp_path, clock)
    d = b"\x11" * 16
    store.path(d).parent.mkdir(parents=True)
    tmp = store.path(d).parent / f".tmp-{store.path(d).name}-999-dead"
    tmp.write_bytes(b"half a block")                            # what kill -9 leaves before the rename
    os.utime(tmp, (clock.now(), clock.now()))
    assert not store.lookup(d)                                  # never read
    store.sweep()
    assert tmp.exists()                                         # maybe another process still writing it
    clock.t += STALE_TMP_S + 1
    store.sweep()
    assert not tmp.exists()


def test_a_block_that_cannot_be_filled_is_computed_and_nothing_is_held(tmp_path, caplog):
    clock = FakeClock()
    tokens = list(range(500, 517))
    kv, io, tier = _engine(tmp_path, clock)
    _run_prompt(kv, tier, io, _request(tokens))
    tier.close()
    kv2, io2, tier2 = _engine(tmp_path, clock)

    def refuse(block_ids, payloads):
        raise ValueError("a KV block of 3 bytes, this cache's are 4")
    io2.fill = refuse
    req = _request(tokens)
    with caplog.at_level(logging.ERROR, logger="phasewise.prompt_cache"):
        tier2.prefetch(kv2, [req])
    assert kv2.get_computed_blocks(req) == [[]] and req.metrics.disk_tokens == 0
    assert kv2.pool.num_free == 32 and kv2.pool.num_cached == 0 and "computing it" in caplog.text
    tier2.close()


def test_a_state_read_from_disk_never_takes_a_slot_a_pending_copy_uses():
    """Before a step is scheduled, the copies pending are the last step's saves (restores are made and taken
    in one schedule): a state read from disk takes neither their source nor their target slots."""
    from phasewise.core.state_checkpoints import StateCheckpoints

    ckpt = StateCheckpoints(first_slot=4, capacity=2)            # checkpoint slots 4 and 5
    ckpt.save(1, "a", from_slot=0)                               # a save into 4, pending
    assert ckpt.adopt(2, "b") == 5                               # the free slot not pending
    assert ckpt.adopt(2, "b") is None                            # kept already
    assert ckpt.adopt(3, "c") == 5 and ckpt.lookup(2, "b") is None   # the LRU entry not pending gives way
    assert ckpt.lookup(1, "a") == 4 and ckpt.take_copies() == [(0, 4)]
    assert ckpt.adopt(6, "d") == 4                               # nothing pending now: the LRU entry's slot
    one = StateCheckpoints(first_slot=1, capacity=1)
    one.save(1, "a", from_slot=0)
    assert one.adopt(2, "b") is None and one.lookup(1, "a") == 1   # its only slot awaits a save
