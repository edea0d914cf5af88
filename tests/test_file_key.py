"""A model file's identity by content (loading/file_key.py) and the packed-weight cache found by it: a
copied, moved or touched file keeps its key, an edit in its head or in a sampled block changes it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from phasewise.loading import file_key, packed_cache


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 1]))


def test_the_key_follows_the_content(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(os.urandom(file_key.HEAD + 3 * file_key.BLOCK) + bytes(5 << 20))
    key = file_key.content_key(path)
    os.utime(path, ns=(1, 1))
    (tmp_path / "d").mkdir()
    assert file_key.content_key(path) == key == file_key.content_key(Path(shutil.copy(path, tmp_path / "d" / "x")))
    size = path.stat().st_size
    for at in (0, file_key.HEAD - 1, size - 1):          # the header, the end of the head, the last block
        _flip(path, at)
        assert file_key.content_key(path) != key
        _flip(path, at)
        assert file_key.content_key(path) == key
    with open(path, "ab") as f:
        f.write(b"\0")
    assert file_key.content_key(path) != key             # the size


def test_a_moved_or_copied_file_finds_its_packs(tmp_path, monkeypatch):
    """The pack of a file moved away is found under its new name, which joins the pack's sources (so
    pruning, which drops packs whose every source is gone, keeps it); a copy finds it too."""
    monkeypatch.setenv("PHASEWISE_CACHE", str(tmp_path / "cache"))
    first = tmp_path / "first.gguf"
    first.write_bytes(os.urandom(1 << 20))
    pack = packed_cache.cache_path(first)
    pack.parent.mkdir(parents=True)
    pack.write_bytes(b"packed")
    pack.with_suffix(".src").write_text(str(first.resolve()))        # one path, as older versions wrote
    moved = Path(shutil.move(first, tmp_path / "moved.gguf"))
    assert packed_cache.cache_path(moved) == pack
    assert packed_cache.store().sources(pack) == [first.resolve(), moved.resolve()]
    copy = Path(shutil.copy(moved, tmp_path / "copy.gguf"))
    assert packed_cache.cache_path(copy) == pack
    assert packed_cache.store().sources(pack) == [first.resolve(), moved.resolve(), copy.resolve()]
    _flip(copy, 100)
    assert packed_cache.cache_path(copy) != pack
