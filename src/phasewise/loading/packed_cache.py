"""The packed-weight cache: a GGUF's layers as `plan_file_weights` packs them, kept on disk so later
loads map them instead of repacking (as OpenVINO's cache_dir keeps compiled blobs).

One file per model under `<cache>/packed/`, named by the GGUF's content (size, header and sampled
blocks: loading/file_key.py, so a copied or moved file hits) and `PACK_VERSION` (the packed layouts
of kernels/quant.py; the layout is the same at every ISA level, so one file serves all). The file:
MAGIC, a JSON header's length (u64), the header (version, file size, checkpoint names, each weight's
fmt, n, k, u5_tiles and its tensors as [offset, shape, dtype], parts in "rest"), then every tensor at
a page-aligned offset. No pickle and no torch.load: a load reads the header and maps the file copy-on-write
(`torch.from_file`), so the page cache holds it once for every process and nothing is copied.

A first load writes it in place (`Writer`): the layouts are known from the GGUF's shapes before
anything is packed, so the file is made at its final size under a temporary name (its blocks
reserved: a full disk fails here, not with a SIGBUS later), mapped shared, and each weight is
packed into its slice; the model's weights are those slices (one copy). Complete, it is renamed.
A file that does not read, is cut short, or whose weights do not match the model's layers is
ignored and rewritten. Files under MIN_BYTES (test models) are not cached. The folder's tidiness
(each pack's source files, its last use, the size limit and what is evicted) is loading/pack_store.py's.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import TypedDict

import torch

from phasewise.kernels import quant
from phasewise.loading.file_key import content_key
from phasewise.loading.pack_store import SUFFIX, PackStore, max_bytes

PACK_VERSION = 4          # bump when kernels/quant.py's layouts or this file's change (2: k4, q6k at
                          # the file's width; 3: parts; 4: a JSON header and raw tensors, written in place)
MIN_BYTES = 32 << 20      # smaller GGUFs pack in well under a second: not cached
MAGIC = b"PWPACK\x00\x01"
ALIGN = 4096              # each tensor's offset: page-aligned, so any view of it is aligned for every dtype
_DTYPES = {str(t).removeprefix("torch."): t for t in (torch.uint8, torch.int8, torch.float16, torch.float32)}


_Entry = tuple[int, list[int], str]   # a tensor's [offset, shape, dtype] (a JSON array: read back as a list)


class _Record(TypedDict):
    """One weight in the header."""
    fmt: str
    n: int
    k: int
    u5_tiles: int
    blocks: _Entry
    scale: _Entry | None
    rest: list[_Record]


class _Header(TypedDict):
    """The file's header, as written; read back unchecked (what a damaged one lacks fails in `load`)."""
    version: int
    linears: dict[str, _Record]
    embedding: _Record | str | None       # the tied linear's path, or a table of its own
    names: list[str]
    size: int


def wanted(gguf_path: Path, min_bytes: int = MIN_BYTES) -> bool:
    return gguf_path.stat().st_size >= min_bytes


def store() -> PackStore:
    """The packed-weight cache's folder, `<cache>/packed`, with its limit."""
    from phasewise.config import default_cache_dir

    return PackStore(default_cache_dir() / "packed", max_bytes())


def cache_path(gguf_path: Path) -> Path:
    """Where the packs of `gguf_path` are kept, named by its content (loading/file_key.py): a copied or
    moved file finds the packs of the original (and is listed among its sources, its last use now)."""
    packs = store()
    key = hashlib.sha256(f"{content_key(gguf_path)}|{PACK_VERSION}".encode()).hexdigest()[:20]
    found = next(iter(sorted(packs.folder.glob(f"*-{key}{SUFFIX}"))), None)
    if found is None:
        return packs.folder / f"{gguf_path.stem}-{key}{SUFFIX}"
    packs.used(found, gguf_path)
    return found


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Layout:
    """Offsets (from the data's start) of every tensor of some weights, in order."""

    def __init__(self) -> None:
        self.size = 0

    def record(self, w: quant.PackedWeight) -> _Record:
        return {"fmt": w.fmt, "n": w.n, "k": w.k, "u5_tiles": w.u5_tiles, "blocks": self._place(w.blocks),
                "scale": None if w.scale is None else self._place(w.scale),
                "rest": [self.record(p) for p in w.rest]}

    def _place(self, t: torch.Tensor) -> _Entry:
        offset, self.size = self.size, _align(self.size + t.numel() * t.element_size())
        return offset, list(t.shape), str(t.dtype).removeprefix("torch.")


def _header(linears: dict[str, quant.PackedWeight], embedding: quant.PackedWeight | None,
            names: set[str]) -> tuple[bytes, int]:
    """The header's bytes (MAGIC and length included, padded to ALIGN) and the whole file's size."""
    layout = _Layout()
    tied = next((p for p, w in linears.items() if w is embedding), None)
    records = {p: layout.record(w) for p, w in linears.items()}
    table = tied if tied is not None or embedding is None else layout.record(embedding)
    body: _Header = {"version": PACK_VERSION, "linears": records, "embedding": table, "names": sorted(names),
                     "size": 0}
    while True:                              # the size holds the header's own length: settle it
        text = json.dumps(body, separators=(",", ":")).encode()
        start = _align(16 + len(text))
        if body["size"] == start + layout.size:
            break
        body["size"] = start + layout.size
    head = MAGIC + len(text).to_bytes(8, "little") + text
    return head + bytes(start - len(head)), start + layout.size


def _weights(header: _Header, base: torch.Tensor, start: int
             ) -> tuple[dict[str, quant.PackedWeight], quant.PackedWeight | None]:
    """The header's weights as views of the mapped file `base` (uint8), data from `start`."""
    def view(entry: _Entry) -> torch.Tensor:
        offset, shape, dtype = entry
        dt = _DTYPES[dtype]
        nbytes = dt.itemsize * int(torch.Size(shape).numel())
        if offset % ALIGN or start + offset + nbytes > base.numel():
            raise ValueError(f"a tensor at {offset} (+{nbytes}) outside the file")
        return base[start + offset:start + offset + nbytes].view(dt).view(shape)

    def weight(r: _Record) -> quant.PackedWeight:
        return quant.PackedWeight(fmt=r["fmt"], n=r["n"], k=r["k"], blocks=view(r["blocks"]),
                                  scale=None if r["scale"] is None else view(r["scale"]),
                                  u5_tiles=r["u5_tiles"], rest=tuple(weight(p) for p in r["rest"]))

    linears = {p: weight(r) for p, r in header["linears"].items()}
    table = header["embedding"]
    return linears, linears[table] if isinstance(table, str) else None if table is None else weight(table)


def _read_header(path: Path) -> tuple[_Header, int]:
    with open(path, "rb") as f:
        head = f.read(16)
        if len(head) < 16 or head[:8] != MAGIC:
            raise ValueError("not a packed-weight file")
        length = int.from_bytes(head[8:], "little")
        return json.loads(f.read(length)), _align(16 + length)


class Writer:
    """A cache file being filled: `linears` and `embedding` are the weights given (meta tensors
    are fine: only shapes count) as views of its shared map, to be filled with `fill`; `commit`
    renames the complete file into place, `abort` removes it."""

    def __init__(self, path: Path, source: Path, linears: dict[str, quant.PackedWeight],
                 embedding: quant.PackedWeight | None, names: set[str]) -> None:
        self.path, self.source = path, source
        self.partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        head, size = _header(linears, embedding, names)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.store = PackStore(path.parent, max_bytes())
        self.store.make_room(size, source)
        try:
            with open(self.partial, "wb") as f:
                f.write(head)
                if hasattr(os, "posix_fallocate"):              # blocks reserved: writing the map cannot fail
                    os.posix_fallocate(f.fileno(), 0, size)
                else:
                    f.truncate(size)
            base = torch.from_file(str(self.partial), shared=True, size=size, dtype=torch.uint8)
            self.linears, self.embedding = _weights(_read_header(self.partial)[0], base, len(head))
        except BaseException:
            self.partial.unlink(missing_ok=True)
            raise

    @staticmethod
    def fill(slot: quant.PackedWeight, packed: quant.PackedWeight, tile: int = 0) -> None:
        """Copy `packed` into its `slot` of the map (the same layout, part by part), or a run of rows
        of a one-part slot into its tiles from `tile`."""
        for s, p in zip(slot.parts, packed.parts, strict=True):
            nt = p.blocks.shape[0]
            whole = tile == 0 and (s.n, s.u5_tiles, s.blocks.shape[0]) == (p.n, p.u5_tiles, nt)
            rows = len(slot.parts) == 1 and not p.u5_tiles and tile + nt <= s.blocks.shape[0]
            side = (None, None) if s.scale is None or p.scale is None else \
                (s.scale.shape[1:], p.scale.shape[1:])
            if (s.fmt, s.k, s.blocks.shape[1:]) != (p.fmt, p.k, p.blocks.shape[1:]) or \
                    not (whole or rows) or \
                    (s.scale is None) != (p.scale is None) or side[0] != side[1]:
                raise ValueError(f"a packed {p.fmt} [{p.n}, {p.k}] weight does not fit its "
                                 f"{s.fmt} [{s.n}, {s.k}] slot")
            s.blocks[tile:tile + nt].copy_(p.blocks)
            if s.scale is not None and p.scale is not None:     # both or neither (checked above)
                s.scale[tile:tile + nt].copy_(p.scale)

    def commit(self) -> None:
        """Put the complete file in place (the weights stay mapped whatever happens to its name)."""
        try:
            os.replace(self.partial, self.path)
            self.store.add_source(self.path, self.source)
        except OSError as e:
            print(f"phasewise: warning: cannot write the packed-weight cache {self.path}: {e}",
                  file=sys.stderr)

    def abort(self) -> None:
        self.partial.unlink(missing_ok=True)


def create(path: Path, source: Path, linears: dict[str, quant.PackedWeight],
           embedding: quant.PackedWeight | None, names: set[str]) -> Writer | None:
    """A Writer of the cache file `path` for the GGUF `source`; None (with a warning) when it cannot
    be made (a full disk costs the next load its speed, nothing else)."""
    try:
        return Writer(path, source, linears, embedding, names)
    except (OSError, RuntimeError) as e:          # RuntimeError: torch.from_file could not map it
        print(f"phasewise: warning: cannot write the packed-weight cache {path}: {e}", file=sys.stderr)
        return None


def load(path: Path) -> tuple[dict[str, quant.PackedWeight], quant.PackedWeight | None, set[str]] | None:
    """(linears by layer path, token table, checkpoint names), mapped from `path`; None when absent
    or unreadable."""
    if not path.is_file():
        return None
    try:
        header, start = _read_header(path)
        if header.get("version") != PACK_VERSION:
            return None
        size = path.stat().st_size
        if header["size"] != size:
            raise ValueError(f"{size} bytes, the header says {header['size']}")
        base = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)   # copy-on-write map
        linears, embedding = _weights(header, base, start)
        weights = [*linears.values(), *([embedding] if embedding is not None else [])]
        for w in [p for w in weights for p in w.parts]:
            if w.fmt not in quant.FORMATS or w.blocks.shape[-1] != w.format.block_bytes or \
                    w.blocks.shape[0] * quant.TILE < w.n or w.blocks.shape[1] * quant.QK != w.k:
                return None
        return linears, embedding, set(header["names"])
    except Exception as e:  # noqa: BLE001 - a damaged cache file of any kind is repacked, not fatal
        print(f"phasewise: warning: ignoring the packed-weight cache {path} ({type(e).__name__}: {e})",
              file=sys.stderr)
        return None
