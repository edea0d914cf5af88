"""Our lean GGUF header reader agrees with gguf.GGUFReader, and rejects broken files cleanly."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter, GGMLQuantizationType
from gguf.quants import quantize

from phasewise.loading.gguf_header import GGUFFormatError, SkippedArray, read_header


def _compare(path):
    fields, tensors = read_header(path)
    reader = GGUFReader(path)
    for key, field in reader.fields.items():
        ours = fields[key]
        if isinstance(ours, SkippedArray):
            assert len(ours) == len(field.data)
            continue
        theirs = field.contents()
        if isinstance(theirs, float):
            assert ours == pytest.approx(theirs)
        else:
            assert ours == theirs, key
    assert list(tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = tensors[t.name]
        assert info.ggml_type == t.tensor_type and info.offset == t.data_offset and info.nbytes == t.n_bytes
        assert info.shape == tuple(int(d) for d in reversed(t.shape))


def test_matches_gguf_reader_on_default_model(default_model_path):
    _compare(default_model_path)


def test_matches_gguf_reader_on_written_file(tmp_path):
    path = tmp_path / "t.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_string("custom.name", "héllo")
    w.add_array("custom.ints", [1, 2, 3])
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(2000)])
    w.add_float32("custom.f", 0.25)
    w.add_bool("custom.b", True)
    rng = np.random.default_rng(0)
    w.add_tensor("a", rng.standard_normal((3, 64)).astype(np.float32))
    q = quantize(rng.standard_normal((4, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    w.add_tensor("b", q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _compare(path)
    fields, _ = read_header(path)
    assert isinstance(fields["tokenizer.ggml.tokens"], SkippedArray)
    assert fields["custom.ints"] == [1, 2, 3] and fields["custom.name"] == "héllo"


@pytest.mark.parametrize("cut", [3, 30, 200, 2000, -10])
def test_truncated_file_is_a_format_error(default_model_path, tmp_path, cut):
    data = default_model_path.read_bytes()[:cut] if cut > 0 else default_model_path.read_bytes()[:cut]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data)
    with pytest.raises(GGUFFormatError):
        read_header(bad)
