"""The packed-weight cache's folder kept tidy: what is in it, its size limit, what goes first.

Each pack `<stem>-<key>.pack` (loading/packed_cache.py) has a `.src` beside it listing, one a line,
every GGUF path seen with its content. A pack whose every listed file is gone is dropped; a path
whose content has changed (packed again under a new key) leaves the lists of the other packs. The
pack's modification time is its last use (set on every load), and when a new pack would take the
folder past its limit, the least recently used packs go first; the new one is written whatever its size
(a model over the limit is the only one kept). The limit is $PHASEWISE_PACKED_CACHE_MAX (a size: 500M,
16G), DEFAULT_MAX without it. Every write is a rename, and removing a
pack another process has mapped leaves its map intact (the file lives until it is unmapped).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MAX = 16 << 30
ENV = "PHASEWISE_PACKED_CACHE_MAX"
SUFFIX = ".pack"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes of a size such as 800M, 16G, 1.5GiB or 4096; ValueError naming the text otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", text.upper())
    if m is None:
        raise ValueError(f"not a size: {text!r} (e.g. 800M, 16G)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def max_bytes() -> int:
    """The limit set by $PHASEWISE_PACKED_CACHE_MAX, else DEFAULT_MAX."""
    text = os.environ.get(ENV)
    if not text:
        return DEFAULT_MAX
    try:
        return parse_size(text)
    except ValueError as e:
        raise ValueError(f"{ENV}: {e}") from None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclass(frozen=True)
class Pack:
    """One pack of the folder, as listed."""
    path: Path
    size: int                   # bytes
    last_used: float            # seconds since the epoch
    sources: tuple[Path, ...]   # every GGUF path seen with its content

    @property
    def present(self) -> bool:
        return any(s.is_file() for s in self.sources)

    @property
    def model(self) -> str:
        """The first listed file still present, else the first listed, else the pack's stem."""
        here = [s for s in self.sources if s.is_file()]
        return str((here or list(self.sources) or [Path(self.path.stem)])[0])


class PackStore:
    """The packs under `folder`, kept within `limit` bytes."""

    def __init__(self, folder: Path, limit: int) -> None:
        self.folder, self.limit = folder, limit

    def sources(self, pack: Path) -> list[Path]:
        try:
            return [Path(line) for line in pack.with_suffix(".src").read_text().splitlines() if line.strip()]
        except OSError:
            return []

    def used(self, pack: Path, source: Path) -> None:
        """`pack` was just loaded for the GGUF at `source`: its last use is now, `source` is listed."""
        try:
            os.utime(pack)
            self.add_source(pack, source)
        except OSError:
            pass                                      # a read-only cache: it still serves, untidily

    def add_source(self, pack: Path, source: Path) -> None:
        listed, named = self.sources(pack), source.resolve()
        if named not in listed:
            _write_atomic(pack.with_suffix(".src"), "".join(f"{p}\n" for p in [*listed, named]))

    def packs(self) -> list[Pack]:
        """Every complete pack, the most recently used first."""
        found = []
        for path in self.folder.glob(f"*{SUFFIX}"):
            try:
                st = path.stat()
            except OSError:
                continue                              # removed meanwhile
            found.append(Pack(path, st.st_size, st.st_mtime, tuple(self.sources(path))))
        return sorted(found, key=lambda p: p.last_used, reverse=True)

    def remove(self, pack: Path) -> None:
        for suffix in (SUFFIX, ".src", ".pt"):
            pack.with_suffix(suffix).unlink(missing_ok=True)

    def make_room(self, size: int, source: Path) -> None:
        """Before writing a pack of `size` bytes for the GGUF at `source`: drop `source` from the other
        packs' lists, the packs left without a present file and the partial files of processes no
        longer running, then the least recently used packs until the new one fits the limit (the pack
        of the model in use is written whatever its size: over the limit, it is all that stays)."""
        named = source.resolve()
        for pack in self.packs():
            listed = self.sources(pack.path)
            if named in listed:
                listed.remove(named)
                _write_atomic(pack.path.with_suffix(".src"), "".join(f"{p}\n" for p in listed))
        self.prune(max(self.limit - size, 0))

    def prune(self, limit: int | None = None, everything: bool = False) -> list[Pack]:
        """Remove the packs whose files are all gone, partial files of dead processes, every pack if
        `everything`, then the least recently used packs until the rest (with running partials) is
        within `limit` (default: the store's). The packs removed."""
        limit = self.limit if limit is None else limit
        removed, kept, full = [], 0, everything
        for partial in self.folder.glob(".*.partial"):
            pid = partial.name.rsplit(".", 2)[-2]
            if pid.isdigit() and not _running(int(pid)):
                partial.unlink(missing_ok=True)
            else:
                kept += _size(partial)
        for pack in self.packs():                     # most recent first: past the limit, all older ones go
            full = full or pack.present and kept + pack.size > limit
            if full or not pack.present:
                self.remove(pack.path)
                removed.append(pack)
            else:
                kept += pack.size
        for src in self.folder.glob("*.src"):         # left from an older layout, or a pack removed meanwhile
            if not src.with_suffix(SUFFIX).exists():
                self.remove(src)
        return removed


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
