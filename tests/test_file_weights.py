"""A GGUF's own blocks as the model's weights: no fp32 copy of what the file holds in blocks (the
linear layers and the token table), the table's lookups exactly the rows the fp32 model had, and the
packaged models joined from their part packages."""

from __future__ import annotations

import sys

import pytest
import torch

from phasewise.layers.embedding import Embedding
from phasewise.layers.linear import Linear
from phasewise.loading.gguf import ModelLoadError
from phasewise.loading.loader import load_model
from phasewise.loading.packaged import PartedModel, join_parts


@pytest.fixture(scope="module")
def q4_and_fp32(default_model_path):
    return load_model(default_model_path, "q4")[0], load_model(default_model_path)[0]


def test_q4_model_holds_no_fp32_copy_of_the_files_blocks(q4_and_fp32, default_model_path):
    """Every linear and the (tied) token table stay in the file's blocks; what is left in fp32 is
    norms and biases, a few KB a layer."""
    q4, _ = q4_and_fp32
    q4_path = default_model_path
    table = q4.model.embed_tokens
    assert isinstance(table, Embedding) and table.fmt == "q8"
    assert table.blocks is q4.lm_head.blocks                   # tied: one table for the lookup and the head
    layers = [m for m in q4.modules() if isinstance(m, (Linear, Embedding))]
    assert len(layers) == 4 * q4.config.num_layers + 2 and all(m.form == "blocks" for m in layers)
    assert q4.lm_head.weight is None and table.weight is None
    fp32 = sum(t.numel() * t.element_size() for t in q4.parameters())
    assert fp32 < 64 * 1024 * q4.config.num_layers, fp32
    from phasewise.loading.loader import q4_weight_bytes

    held = {t.data_ptr(): t.numel() * t.element_size() for m in q4.modules() if isinstance(m, (Linear, Embedding))
            for t in (m.blocks, m.scale) if t is not None}
    assert q4_weight_bytes(q4_path)[0] == sum(held.values())   # `phasewise memory`'s figure, without packing


def test_quant_embedding_gives_the_files_rows(q4_and_fp32, ops):
    """Lookups, with kernels and on the reference path, equal the fp32 model's table (the file's
    values, dequantized by the gguf package)."""
    q4, fp32 = q4_and_fp32
    ids = torch.tensor([[0, 1, 49151], [7, 7, 300]])
    expected = fp32.model.embed_tokens(ids)
    table = q4.model.embed_tokens
    try:
        for kernels in (None, ops):
            table.bind_kernels(kernels)
            assert torch.equal(table(ids), expected)
        with pytest.raises((IndexError, RuntimeError), match="outside"):
            table(torch.tensor([q4.config.vocab_size]))
    finally:
        table.bind_kernels(None)


def _fake_parts(tmp_path, monkeypatch, pieces: list[bytes]) -> tuple[str, ...]:
    names = []
    for i, data in enumerate(pieces, 1):
        pkg = tmp_path / "site" / f"fake_model_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
        names.append(pkg.name)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return tuple(names)


def test_parted_model_joins_in_part_order_once(tmp_path, monkeypatch):
    pieces = [bytes([i]) * (1000 + i) for i in range(1, 12)]          # part10 after part9, not after part1
    model = PartedModel("m.gguf", _fake_parts(tmp_path, monkeypatch, pieces), "make m")
    target = tmp_path / "cache" / "m.gguf"
    assert join_parts(model, target).read_bytes() == b"".join(pieces)
    stamp = target.stat().st_mtime_ns
    assert join_parts(model, target).stat().st_mtime_ns == stamp      # a whole join is reused
    target.write_bytes(b"cut")                                        # a short one is joined again
    assert join_parts(model, target).read_bytes() == b"".join(pieces)
    assert not list(target.parent.glob("*.partial"))


def test_parted_model_missing_a_part_names_the_install(tmp_path, monkeypatch):
    names = _fake_parts(tmp_path, monkeypatch, [b"a", b"b"])
    model = PartedModel("m.gguf", (*names, "fake_model_part_absent"), "make m")
    with pytest.raises(ModelLoadError, match="make m .*fake_model_part_absent"):
        join_parts(model, tmp_path / "m.gguf")
    sys.modules.pop("fake_model_part1", None)


def test_packed_cache_maps_what_the_first_load_packed(default_model_path, tmp_path, monkeypatch, capsys):
    """The first q4 load writes the packed-weight cache; the next maps it without packing anything
    (the same weights, bit for bit); a damaged file is repacked and rewritten; packed_cache=False
    neither reads nor writes it."""
    from phasewise.kernels import gguf_blocks
    from phasewise.loading import quantize

    monkeypatch.setenv("PHASEWISE_CACHE", str(tmp_path))
    first, _ = load_model(default_model_path, "q4")
    files = list((tmp_path / "packed").glob("*.pt"))
    assert len(files) == 1
    monkeypatch.setattr(quantize, "pack_gguf", lambda *a, **k: pytest.fail("packed again"))
    second, _ = load_model(default_model_path, "q4")
    for a, b in zip(first.buffers(), second.buffers()):
        assert torch.equal(a, b)
    assert second.model.embed_tokens.form == "blocks"
    assert second.model.embed_tokens.blocks is second.lm_head.blocks       # still one tied table
    monkeypatch.setattr(quantize, "pack_gguf", gguf_blocks.pack_gguf)
    files[0].write_bytes(files[0].read_bytes()[:4096])                     # cut short
    third, _ = load_model(default_model_path, "q4")
    assert "ignoring the packed-weight cache" in capsys.readouterr().err
    assert files[0].stat().st_size > 4096
    assert torch.equal(third.lm_head.blocks, first.lm_head.blocks)
    files[0].unlink()
    load_model(default_model_path, "q4", packed_cache=False)
    assert not files[0].exists()


def test_memory_check_names_the_kv_pool_that_fits(default_model_path):
    """A model that cannot fit says so in one line before loading, naming the --kv-cache-memory that would."""
    from phasewise.loading.loader import OVERHEAD, check_memory, q4_weight_bytes

    packed, stored = q4_weight_bytes(default_model_path)
    assert 0.99 * stored <= packed <= 1.01 * stored           # Q4_1 and Q8_0 as the file holds them
    check_memory(default_model_path, 2**30, available=packed + 2**30 + OVERHEAD)
    with pytest.raises(ModelLoadError, match=r"--kv-cache-memory 0\.\d\d would fit"):
        check_memory(default_model_path, 2**31, available=packed + 2**30 + OVERHEAD)
    with pytest.raises(ModelLoadError, match="the weights alone do not fit"):
        check_memory(default_model_path, 0, available=packed)
