"""The packed-weight cache kept tidy (loading/pack_store.py): within its limit by evicting the least
recently used packs, without the packs whose every model file is gone, and shown and cleared by
`phasewise cache list|prune`. Tiny GGUFs written here, packed into a tmp cache."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from model_builders import QT, build_hf, hf_config, write_gguf

from phasewise.cli import main
from phasewise.loading import pack_store, packed_cache, quantize
from phasewise.loading.gguf import GGUFFile
from phasewise.models.registry import model_class


def _gguf(path: Path, seed: int) -> Path:
    write_gguf(path, build_hf(hf_config("llama", hidden_size=128, intermediate_size=256), seed=seed), "llama",
               permute=True, types=lambda n: QT.Q8_0)
    return path


def _load(path: Path) -> quantize.FileWeights:
    """The file's packed weights through the cache (packed into it or mapped from it)."""
    gguf = GGUFFile(path)
    cfg = gguf.model_config()
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    return quantize.plan_file_weights(model, cfg, gguf, min_bytes=0)


@pytest.fixture
def models(tmp_path, monkeypatch):
    monkeypatch.setenv("PHASEWISE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(pack_store.ENV, raising=False)
    return [_gguf(tmp_path / f"{name}.gguf", seed) for seed, name in enumerate("abc")]


def _packs() -> dict[str, pack_store.Pack]:
    """The cache's packs by their first source's stem."""
    return {p.sources[0].stem: p for p in packed_cache.store().packs()}


def test_the_least_recently_used_go_first_and_packs_of_gone_files_go(models, monkeypatch):
    a, b, c = models
    _load(a)
    kept_b = _load(b)
    size = _packs()["a"].size
    assert _packs()["b"].size == size and set(_packs()) == {"a", "b"}
    os.utime(_packs()["a"].path, (1000, 1000))
    os.utime(_packs()["b"].path, (2000, 2000))
    _load(a)                                             # a mapped again: now the most recent
    assert _packs()["a"].last_used > _packs()["b"].last_used
    monkeypatch.setenv(pack_store.ENV, str(2 * size + size // 2))
    _load(c)                                             # a third would pass the limit: b goes
    assert set(_packs()) == {"a", "c"}
    assert torch.equal(kept_b.embedding.blocks, _load(b).embedding.blocks)   # a map outlives its file
    assert set(_packs()) == {"c", "b"}                   # b packed again, a evicted
    c.unlink()
    monkeypatch.setenv(pack_store.ENV, "100G")
    _load(a)                                             # writing drops the pack whose file is gone
    assert set(_packs()) == {"a", "b"}
    monkeypatch.setenv(pack_store.ENV, str(size // 2))   # a pack over the limit: the only one kept
    _load(_gguf(c, 7))
    assert set(_packs()) == {"c"}


def test_a_pack_lists_every_path_of_its_content_and_stays_while_one_is_present(models, tmp_path):
    a, b, _ = models
    _load(a)
    copy = Path(shutil.copy(a, tmp_path / "copy.gguf"))
    _load(copy)
    pack = _packs()["a"]
    assert pack.sources == (a.resolve(), copy.resolve()) and len(_packs()) == 1
    a.unlink()
    _load(b)
    assert set(_packs()) == {"a", "b"} and _packs()["a"].model == str(copy.resolve())
    _gguf(copy, 5)                                       # the copy's path now holds another model
    _load(copy)
    assert len(_packs()) == 2 and pack.path not in [p.path for p in _packs().values()]
    assert {p.model for p in _packs().values()} == {str(b.resolve()), str(copy.resolve())}


def test_cache_list_and_prune_on_the_command_line(models, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")                 # the table's rows unwrapped
    a, b, c = models
    for path in models:
        _load(path)
    os.utime(_packs()["a"].path, (1000, 1000))
    b.unlink()
    capsys.readouterr()
    assert main(["cache", "list"]) == 0
    shown = capsys.readouterr().out
    rows = {line.split("│")[2].strip(): line for line in shown.splitlines() if ".gguf" in line}
    assert set(rows) == {str(p.resolve()) for p in models}
    assert "no" in rows[str(b.resolve())].split("│")[-2] and "yes" in rows[str(a.resolve())].split("│")[-2]
    size = _packs()["a"].size
    assert main(["cache", "prune", "--max-size", str(size + size // 2)]) == 0   # b (gone), then a (oldest)
    assert set(_packs()) == {"c"} and "2 packs removed" in capsys.readouterr().out
    for bad in (["cache", "prune", "--max-size", "lots"], ["cache", "prune", "--all", "--max-size", "1G"],
                ["cache", "tidy"]):
        with pytest.raises(SystemExit) as e:
            main(bad)
        assert e.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1
    assert main(["cache", "prune", "--all"]) == 0 and _packs() == {}
    assert not [p for p in (tmp_path / "cache" / "packed").iterdir()]


def test_sizes_read_as_people_write_them():
    assert pack_store.parse_size("800M") == 800 << 20
    assert pack_store.parse_size("1.5GiB") == 3 << 29
    assert pack_store.parse_size("16g") == 16 << 30
    assert pack_store.parse_size("4096") == 4096
    for bad in ("", "-1G", "G", "12X", "1.2.3"):
        with pytest.raises(ValueError, match="not a size"):
            pack_store.parse_size(bad)
