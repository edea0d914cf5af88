"""A GGUF's own blocks as the model's weights: no fp32 copy of what the file holds in blocks (the
linear layers and the token table), the table's lookups exactly the rows the fp32 model had, and the
packaged models joined from their part packages."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import PagedRunner, bind

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


def _mapped_file(t: torch.Tensor) -> str | None:
    """The file whose map holds `t`'s bytes (/proc/self/maps), None when anonymous memory does (no name, or
    the kernel's own: [heap] for small allocations, [anon:...])."""
    ptr = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr and ptr + t.numel() * t.element_size() <= hi:
                name = fields[5].strip() if len(fields) > 5 else ""
                return None if not name or name.startswith("[") else name
    return None


def _packed_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    return [t for m in model.modules() if isinstance(m, (Linear, Embedding)) for name, t in m.named_buffers()
            if name.startswith(("blocks", "scale")) and t is not None]


def test_packed_cache_maps_what_the_first_load_packed(default_model_path, tmp_path, monkeypatch, capsys, chosen_ops):
    """The first q4 load packs into the packed-weight cache file as it writes it: its weights are
    views of that file's map (one copy), bit for bit what packing without the cache gives (logits and
    greedy tokens too); the next load maps it without packing anything; a damaged or cut file is
    repacked and rewritten; packed_cache=False neither reads nor writes it."""
    from phasewise.kernels import gguf_blocks
    from phasewise.loading import quantize

    monkeypatch.setenv("PHASEWISE_CACHE", str(tmp_path))
    plain, _ = load_model(default_model_path, "q4", packed_cache=False)
    assert {_mapped_file(t) for t in _packed_tensors(plain)} == {None} and not (tmp_path / "packed").exists()
    first, _ = load_model(default_model_path, "q4")
    files = list((tmp_path / "packed").glob("*.pack"))
    assert len(files) == 1 and not list((tmp_path / "packed").glob(".*partial"))
    assert {_mapped_file(t) for t in _packed_tensors(first)} == {str(files[0].resolve())}
    for a, b in zip(first.buffers(), plain.buffers(), strict=True):
        assert torch.equal(a, b)
    bind(plain, chosen_ops)
    bind(first, chosen_ops)
    ids = list(range(5, 25))
    (want, want_ids), (got, got_ids) = PagedRunner(plain).greedy(ids, 3), PagedRunner(first).greedy(ids, 3)
    assert torch.equal(got, want) and got_ids == want_ids
    monkeypatch.setattr(quantize, "pack_gguf", lambda *a, **k: pytest.fail("packed again"))
    second, _ = load_model(default_model_path, "q4")
    for a, b in zip(first.buffers(), second.buffers(), strict=True):
        assert torch.equal(a, b)
    assert {_mapped_file(t) for t in _packed_tensors(second)} == {str(files[0].resolve())}
    assert second.model.embed_tokens.form == "blocks"
    assert second.model.embed_tokens.blocks is second.lm_head.blocks       # still one tied table
    monkeypatch.setattr(quantize, "pack_gguf", gguf_blocks.pack_gguf)
    size = files[0].stat().st_size
    for cut in (4096, size - 1):         # the header cut; the last byte (a new file: the loaded ones map the old)
        damaged = tmp_path / "damaged"
        damaged.write_bytes(files[0].read_bytes()[:cut])
        damaged.replace(files[0])
        third, _ = load_model(default_model_path, "q4")
        assert "ignoring the packed-weight cache" in capsys.readouterr().err
        assert files[0].stat().st_size == size
        assert torch.equal(third.lm_head.blocks, plain.lm_head.blocks)


@pytest.mark.parametrize("types", ["k", "q5"])
def test_packed_cache_of_every_layout(types, tmp_path, monkeypatch, chosen_ops):
    """A K-quant file (Q4_K q and k fused with a Q6_K v, Q5_K, Q6_K, an untied Q8_0 table and head)
    and a Q5_0 q, k with a Q8_0 v (U5 tiles) packed straight into the cache, by the kernels and by
    numpy, rows at a time or whole: the same bytes as packing in memory, and the same again mapped;
    writing removes the partial file of a load that died."""
    from model_builders import QT, build_hf, hf_config, write_gguf

    from phasewise.loading import packed_cache, quantize
    from phasewise.loading.gguf import GGUFFile
    from phasewise.models.registry import model_class

    kinds = {"k": {"attn_q": QT.Q4_K, "attn_k": QT.Q4_K, "attn_v": QT.Q6_K, "attn_output": QT.Q5_K,
                   "ffn_gate": QT.Q4_K, "ffn_up": QT.Q4_K, "ffn_down": QT.Q6_K},
             "q5": {"attn_q": QT.Q5_0, "attn_k": QT.Q5_0, "attn_v": QT.Q8_0, "ffn_down": QT.Q4_1}}[types]
    path = tmp_path / "m.gguf"
    write_gguf(path, build_hf(hf_config("llama", hidden_size=256, intermediate_size=512), seed=3), "llama",
               permute=True, types=lambda n: kinds.get(n.split(".")[-2], QT.Q8_0))
    monkeypatch.setenv("PHASEWISE_CACHE", str(tmp_path))
    gguf = GGUFFile(path)
    cfg = gguf.model_config()
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / "packed" / f".m-0.pack.{dead.pid}.partial"     # a load that died while writing
    stale.parent.mkdir()
    stale.write_bytes(b"partial")
    for kernels in (chosen_ops, None):
        want = quantize.plan_file_weights(model, cfg, gguf, cache=False, kernels=kernels)
        got = quantize.plan_file_weights(model, cfg, gguf, kernels=kernels, min_bytes=0)
        kept = packed_cache.load(packed_cache.cache_path(path))
        assert kept is not None and got.names == want.names == kept[2]
        assert got.embedding is not None and kept[1] is not None
        for a, b, c in [*zip(want.linears.values(), got.linears.values(), kept[0].values(), strict=True),
                        (want.embedding, got.embedding, kept[1])]:
            for pa, pb, pc in zip(a.parts, b.parts, c.parts, strict=True):
                assert (pa.fmt, pa.n, pa.k, pa.u5_tiles) == (pb.fmt, pb.n, pb.k, pb.u5_tiles) == \
                    (pc.fmt, pc.n, pc.k, pc.u5_tiles)
                assert torch.equal(pa.blocks, pb.blocks) and torch.equal(pa.blocks, pc.blocks)
                assert pa.scale is None or torch.equal(pa.scale, pb.scale) and torch.equal(pa.scale, pc.scale)
        writer = packed_cache.create(tmp_path / "rows.pack", path, {}, want.embedding, set())
        table = gguf.weight("model.embed_tokens.weight", cfg)
        quantize._pack_into(writer, writer.embedding, table, kernels, chunk_rows=48)   # rows at a time
        assert torch.equal(writer.embedding.blocks, want.embedding.blocks)
        writer.abort()
        packed_cache.cache_path(path).unlink()
    assert not stale.exists()
    if types == "q5":
        assert want.linears["model.layers.0.self_attn.qkv_proj"].u5_tiles


def test_memory_check_names_the_kv_pool_that_fits(default_model_path):
    """A model that cannot fit says so in one line before loading, naming the --kv-cache-memory that would."""
    from phasewise.config import PROCESS_OVERHEAD
    from phasewise.loading.loader import check_memory, q4_weight_bytes

    packed, stored = q4_weight_bytes(default_model_path)
    assert 0.99 * stored <= packed <= 1.01 * stored           # Q4_1 and Q8_0 as the file holds them
    check_memory(default_model_path, 2**30, available=packed + 2**30 + PROCESS_OVERHEAD)
    with pytest.raises(ModelLoadError, match=r"--kv-cache-memory 0\.\d\d would fit"):
        check_memory(default_model_path, 2**31, available=packed + 2**30 + PROCESS_OVERHEAD)
    with pytest.raises(ModelLoadError, match="the weights alone do not fit"):
        check_memory(default_model_path, 0, available=packed)
