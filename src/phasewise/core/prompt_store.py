"""The prompt cache's disk tier as files: one file per full KV block, in the KV cache's own bytes.

Layout: `<root>/<fingerprint>/<2 hex>/<digest hex>.kvb`. The fingerprint (engine/prompt_cache.py) names
the model file's content, precision, KV dtype, block size and layout, so an engine only ever sees the
blocks of its own kind; the digest is the block's chained digest (core/disk_tier.py). A file is a
fixed header (magic, format version, payload length, CRC-32 of header and payload, digest,
fingerprint) and the payload. A reader takes no lock: a file that does not check out (cut short,
a flipped byte, another block's bytes) is a miss and is removed.

Times live in the file's own stamps, so every process sharing the directory sees them without an
index: mtime is the entry's expiry, atime its last use, both set from the handed-in clock (never the
kernel's). A write goes to a temporary name and is renamed into place, so a process killed mid-way
leaves a whole file or none (a stray temporary is swept later); two processes writing one block both
write whole files, and the last rename wins. No fsync: a cache need not survive a power cut, and a file
the machine's crash left cut short or empty fails its CRC, a miss (fsync was 80% of the writer's CPU
and took it from the kernels' threads). Eviction (`sweep`) removes expired entries first, then the
least recently used until the directory fits its size.
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

MAGIC = b"PWKVBLK\0"
VERSION = 1
HEADER = struct.Struct("<8sIQI16s16s")      # magic, version, payload bytes, crc32, digest, fingerprint
CRC_COVERS = 20                               # header bytes under the CRC (before it); digest and fingerprint
                                              # are compared whole
SUFFIX = ".kvb"
TMP_PREFIX = ".tmp-"
STALE_TMP_S = 3600.0                          # a temporary file this old was left by a crash
LOW_WATER = 0.9                               # a size sweep frees down to this share of the limit


class Clock(Protocol):
    """Wall-clock seconds (time.time's scale): what TTLs are measured in."""

    def now(self) -> float: ...


class WallClock:
    def now(self) -> float:
        return time.time()


@dataclass
class SweepResult:
    expired: int = 0          # entries removed because their TTL had passed
    evicted: int = 0          # entries removed, least recently used first, to fit the size
    bytes_left: int = 0       # what the directory holds after the sweep


def _ns(seconds: float) -> int:
    return int(round(seconds * 1e9))


class PromptStore:
    """The files of one fingerprint under `root` (shared with other fingerprints and processes), the
    whole root kept within `max_bytes`."""

    def __init__(self, root: Path, fingerprint: bytes, max_bytes: int, clock: Clock) -> None:
        """ValueError (one line) when the directory cannot be created or written: a clear error at start."""
        if len(fingerprint) != 16:
            raise ValueError("a prompt-cache fingerprint is 16 bytes")
        self.root, self.fingerprint, self.max_bytes, self.clock = Path(root), fingerprint, max_bytes, clock
        self.dir = self.root / fingerprint.hex()
        check_writable(self.dir)

    def path(self, digest: bytes) -> Path:
        h = digest.hex()
        return self.dir / h[:2] / (h + SUFFIX)

    # ---- the read path (no locks) -------------------------------------------------------

    def lookup(self, digest: bytes) -> bool:
        """Whether an unexpired entry of this block exists (one stat; its contents are checked on read)."""
        try:
            st = os.stat(self.path(digest))
        except OSError:
            return False
        return st.st_mtime_ns > _ns(self.clock.now())

    def read(self, digest: bytes, ttl: float) -> bytearray | None:
        """The block's payload, its expiry pushed to at least now + ttl; None for a miss. A file that
        does not check out is removed (CorruptEntry is raised for the caller to count it)."""
        path = self.path(digest)
        try:
            with open(path, "rb", buffering=0) as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                del data[f.readinto(data) or 0:]
        except OSError:
            return None
        payload = self._check(data, digest)
        if payload is None:
            _remove(path)
            raise CorruptEntry(path)
        self.refresh(digest, ttl)
        return payload

    def _check(self, data: bytearray, digest: bytes) -> bytearray | None:
        if len(data) < HEADER.size:
            return None
        magic, version, n, crc, their_digest, fingerprint = HEADER.unpack_from(data)
        if magic != MAGIC or version != VERSION or n != len(data) - HEADER.size or their_digest != digest \
                or fingerprint != self.fingerprint:
            return None
        body = data[HEADER.size:]
        return body if zlib.crc32(body, zlib.crc32(data[:CRC_COVERS])) == crc else None

    def refresh(self, digest: bytes, ttl: float) -> None:
        """Mark a use now and keep the entry at least `ttl` seconds more (a longer expiry stays)."""
        path = self.path(digest)
        now = self.clock.now()
        try:
            expiry = max(os.stat(path).st_mtime_ns, _ns(now + ttl))
            os.utime(path, ns=(_ns(now), expiry))
        except OSError:
            pass                                   # gone meanwhile (another process swept it): a miss later

    # ---- the write path (the writer's thread) -------------------------------------------

    def write(self, digest: bytes, payload: bytes | bytearray, ttl: float) -> int:
        """Write one block's entry atomically, expiring in `ttl` seconds (or later, if an entry of it
        exists with a later expiry); the bytes written. OSError (a full disk...) leaves nothing behind."""
        path = self.path(digest)
        path.parent.mkdir(exist_ok=True)
        head = HEADER.pack(MAGIC, VERSION, len(payload), 0, digest, self.fingerprint)
        crc = zlib.crc32(payload, zlib.crc32(head[:CRC_COVERS]))
        head = HEADER.pack(MAGIC, VERSION, len(payload), crc, digest, self.fingerprint)
        tmp = path.parent / f"{TMP_PREFIX}{path.name}-{os.getpid()}-{os.urandom(4).hex()}"
        now = self.clock.now()
        try:
            with open(tmp, "xb") as f:
                f.write(head)
                f.write(payload)
            expiry = _ns(now + ttl)
            try:
                expiry = max(expiry, os.stat(path).st_mtime_ns)
            except OSError:
                pass
            os.utime(tmp, ns=(_ns(now), expiry))
            os.replace(tmp, path)
        except BaseException:
            _remove(tmp)
            raise
        return len(head) + len(payload)

    # ---- eviction -----------------------------------------------------------------------

    def sweep(self) -> SweepResult:
        """Remove expired entries (of every fingerprint under the root), then the least recently used
        until the root holds at most LOW_WATER x max_bytes if it held more than max_bytes; stale
        temporaries go too. Safe while other processes read, write and sweep."""
        now = _ns(self.clock.now())
        out, live = SweepResult(), []
        for entry in _entries(self.root):
            try:
                st = entry.stat()
            except OSError:
                continue
            if entry.name.startswith(TMP_PREFIX):
                if st.st_mtime_ns < now - _ns(STALE_TMP_S):
                    _remove(Path(entry.path))
            elif st.st_mtime_ns <= now:
                out.expired += _remove(Path(entry.path))
            else:
                live.append((st.st_atime_ns, st.st_size, entry.path))
        total = sum(size for _, size, _ in live)
        if total > self.max_bytes:
            live.sort()
            for _, size, p in live:
                if total <= self.max_bytes * LOW_WATER:
                    break
                out.evicted += _remove(Path(p))
                total -= size
        out.bytes_left = total
        return out

    def size(self) -> int:
        """Bytes of the entries under the root (every fingerprint)."""
        total = 0
        for entry in _entries(self.root):
            try:
                total += entry.stat().st_size
            except OSError:
                pass
        return total


def check_writable(directory: Path) -> None:
    """Create the directory if need be and write a file in it; ValueError (one line) when that fails."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f"{TMP_PREFIX}probe-{os.getpid()}-{os.urandom(4).hex()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"the prompt cache directory {directory} is not writable: "
                         f"{e.strerror or e}") from None


class CorruptEntry(Exception):
    """A cache file that did not check out (it has been removed)."""


def _entries(root: Path) -> list[os.DirEntry[str]]:
    """Every file two levels under each fingerprint directory of root."""
    found: list[os.DirEntry[str]] = []
    for top in _scan(str(root)):
        if top.is_dir(follow_symlinks=False):
            for bucket in _scan(top.path):
                if bucket.is_dir(follow_symlinks=False):
                    found.extend(e for e in _scan(bucket.path) if e.is_file(follow_symlinks=False))
                elif bucket.name.startswith(TMP_PREFIX):
                    found.append(bucket)
    return found


def _scan(path: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def _remove(path: Path) -> int:
    """1 when this call removed the file, 0 when it was already gone (another process took it)."""
    try:
        os.unlink(path)
        return 1
    except OSError:
        return 0
