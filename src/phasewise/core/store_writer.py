"""The disk tier's background thread: writes the block copies a step hands it, refreshes the expiry of
blocks used again, and sweeps the directory (TTL, then LRU within the size), so no step waits for the
disk. A failed write (a full disk, a directory made unwritable) loses that block's entry only: serving
goes on, one warning is logged and `DiskStats.write_errors` counts them. What the tier costs in time is
counted beside (`Spent`): the engine thread's calls into it, and this thread's jobs."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from phasewise.core.prompt_store import PromptStore

log = logging.getLogger("phasewise.prompt_cache")

MAX_QUEUED_BYTES = 256 << 20     # block copies waiting for the disk beyond this are dropped (a slow disk)
SWEEP_EVERY_S = 60.0             # clock seconds between sweeps while writing


@dataclass
class Spent:
    """What one side of the disk tier spent: calls (or jobs), the CPU time of the thread that made them
    (time.thread_time), and their wall time: two clock reads at each end of a call, none per byte."""
    calls: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0

    def add(self, cpu0: float, wall0: float) -> None:
        """One more call, begun on this thread at time.thread_time() cpu0 and time.perf_counter() wall0."""
        self.cpu_s += time.thread_time() - cpu0
        self.wall_s += time.perf_counter() - wall0
        self.calls += 1


def clocks() -> tuple[float, float]:
    """This thread's CPU time and the wall clock now: where a Spent call begins."""
    return time.thread_time(), time.perf_counter()


@dataclass
class DiskStats:
    """The disk tier's counters since the engine started (EngineStats carries them)."""
    blocks_read: int = 0          # blocks loaded from disk into the KV cache (hits)
    bytes_read: int = 0
    load_seconds: float = 0.0     # time spent loading them (lookups, reads, fills)
    blocks_written: int = 0
    bytes_written: int = 0
    evicted_ttl: int = 0          # entries removed by sweeps: expired,
    evicted_lru: int = 0          # and least recently used, to fit the size
    corrupt: int = 0              # files that did not check out (removed; the block was recomputed)
    write_errors: int = 0         # writes that failed (full disk, unwritable directory)
    dropped: int = 0              # copies dropped because the writer was too far behind
    # its cost in time (benchmarks/prompt_cache_overhead.py): the engine thread's calls into it, before a
    # step (lookups and loads: DiskTier.prefetch) and after it (digests, copies out, queueing: DiskTier.save),
    lookups: Spent = field(default_factory=Spent)
    saves: Spent = field(default_factory=Spent)
    writer: Spent = field(default_factory=Spent)   # and the writer thread's jobs (writes, refreshes, sweeps)


Job = tuple[bytes, bytes | bytearray | None, float]     # (digest, payload or None for a refresh, ttl seconds)


class StoreWriter:
    def __init__(self, store: PromptStore, stats: DiskStats) -> None:
        self.store, self.stats = store, stats
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.queued_bytes = 0
        self.lock = threading.Lock()            # queued_bytes, between the engine thread and this one
        self.pending: set[bytes] = set()        # digests queued for writing (the engine thread skips them)
        self.size = -1                          # the root's bytes as last swept plus what was written since
        self.next_sweep = 0.0
        self.warned = False
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="prompt-cache-writer", daemon=True)
        self.thread.start()

    def write(self, digest: bytes, payload: bytes | bytearray, ttl: float) -> None:
        """Queue a block's copy (dropped, and counted, when too much is already waiting or after close)."""
        with self.lock:
            if self.closed or self.queued_bytes + len(payload) > MAX_QUEUED_BYTES:
                self.stats.dropped += 1
                return
            self.queued_bytes += len(payload)
            self.pending.add(digest)
        self.jobs.put((digest, payload, ttl))

    def refresh(self, digest: bytes, ttl: float) -> None:
        """Queue a use of a block on disk: its expiry pushed to at least now + ttl."""
        if not self.closed:
            self.jobs.put((digest, None, ttl))

    def flush(self) -> None:
        """Wait until everything queued so far is on disk (or has failed)."""
        self.jobs.join()

    def close(self) -> None:
        """Finish what is queued, then stop the thread (later writes are dropped)."""
        with self.lock:
            self.closed = True
        if self.thread.is_alive():
            self.jobs.put(None)
            self.thread.join()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                self.jobs.task_done()
                return
            started = clocks()
            try:
                self._do(*job)
            except Exception:                   # a bug must not stop the writer (flush would wait forever)
                self.stats.write_errors += 1
                log.exception("prompt cache: the writer failed on a block")
            finally:
                self.stats.writer.add(*started)     # before task_done: a flush sees it counted
                self.jobs.task_done()

    def _do(self, digest: bytes, payload: bytes | bytearray | None, ttl: float) -> None:
        if payload is None:
            self.store.refresh(digest, ttl)
        else:
            try:
                n = self.store.write(digest, payload, ttl)
                self.stats.blocks_written += 1
                self.stats.bytes_written += n
                if self.size >= 0:
                    self.size += n
            except OSError as e:
                self.stats.write_errors += 1
                if not self.warned:
                    self.warned = True
                    log.warning("prompt cache: cannot write to %s (%s); serving goes on, blocks uncached",
                                self.store.dir, e.strerror or e)
            finally:
                with self.lock:
                    self.queued_bytes -= len(payload)
                    self.pending.discard(digest)
        if self.size < 0 or self.size > self.store.max_bytes or self.store.clock.now() >= self.next_sweep:
            self.sweep()

    def sweep(self) -> None:
        """Evict now (on this thread, or on the engine's while the writer is idle: tests, close)."""
        result = self.store.sweep()
        self.stats.evicted_ttl += result.expired
        self.stats.evicted_lru += result.evicted
        self.size = result.bytes_left
        self.next_sweep = self.store.clock.now() + SWEEP_EVERY_S
