"""Corrupt GGUF files, mutated by hypothesis: truncated, bytes of the header overwritten (counts,
lengths, offsets, dims, types), metadata with absurd or wrongly typed values. Loading must either
work or raise ValueError (what the CLI turns into one line and exit 2): never another exception,
a hang, or a multi-GB allocation (each load runs under an address-space limit 1.5 GB above what
the process already maps)."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

DIMS = {"block_count": 2, "context_length": 128, "embedding_length": 64, "feed_forward_length": 96,
        "attention.head_count": 4, "attention.head_count_kv": 2, "vocab_size": 80}
HUGE = [0, 1, 3, 2 ** 31 - 1, 2 ** 32 - 1, 2 ** 40, 2 ** 63 - 1, 2 ** 64 - 1]


def write_tiny(path: Path, meta: dict | None = None) -> int:
    """A valid two-layer llama GGUF (random weights, Q8_0 and F32); `meta` replaces or adds metadata
    (key → value, its type from the value: int → uint64 or int64, float, str, list). Returns where
    the tensor data starts (the header is what comes before)."""
    d = DIMS
    values: dict = {f"llama.{k}": v for k, v in d.items()}
    values["llama.attention.layer_norm_rms_epsilon"] = 1e-5
    values.update(meta or {})
    arch = values.pop("general.architecture", "llama")
    w = gguf.GGUFWriter(str(path), "llama") if arch == "llama" else _writer_with_arch(path, arch)
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float, str, list)):
            raise TypeError(value)
        if isinstance(value, int):
            (w.add_int64 if value < 0 else w.add_uint64 if value >= 2 ** 32 else w.add_uint32)(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    rng = np.random.default_rng(0)
    h, ff = d["embedding_length"], d["feed_forward_length"]
    kv = d["attention.head_count_kv"] * h // d["attention.head_count"]

    def add(name: str, *shape: int) -> None:
        array = rng.standard_normal(shape).astype(np.float32) * 0.05
        if len(shape) == 2:
            q = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, array)

    add("token_embd.weight", d["vocab_size"], h)
    add("output_norm.weight", h)
    for i in range(d["block_count"]):
        add(f"blk.{i}.attn_norm.weight", h)
        add(f"blk.{i}.attn_q.weight", h, h)
        add(f"blk.{i}.attn_k.weight", kv, h)
        add(f"blk.{i}.attn_v.weight", kv, h)
        add(f"blk.{i}.attn_output.weight", h, h)
        add(f"blk.{i}.ffn_norm.weight", h)
        add(f"blk.{i}.ffn_gate.weight", ff, h)
        add(f"blk.{i}.ffn_up.weight", ff, h)
        add(f"blk.{i}.ffn_down.weight", h, ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from phasewise.loading.gguf_header import read_header

    try:
        return min(t.offset for t in read_header(path)[1].values())
    except ValueError:                         # the metadata itself makes the header unreadable
        return path.stat().st_size


def _writer_with_arch(path: Path, arch: object) -> gguf.GGUFWriter:
    """A writer whose general.architecture is `arch` (any type), not the llama the rest is for."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.kv_data[0].pop("general.architecture")
    if isinstance(arch, str):
        w.add_string("general.architecture", arch)
    elif isinstance(arch, int):
        w.add_uint64("general.architecture", arch % 2 ** 64)
    elif isinstance(arch, float):
        w.add_float32("general.architecture", arch)
    else:
        w.add_array("general.architecture", arch)
    return w


def load_or_refuse(path: Path) -> str:
    """'loaded' or 'refused' (a ValueError); anything else fails the test. Runs under an address-space
    limit, so a huge allocation fails as MemoryError/RuntimeError instead of taking the machine."""
    from phasewise.loading.loader import load_model

    with open("/proc/self/status") as f:
        mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (mapped + (3 << 29), hard))
    try:
        load_model(path)
        return "loaded"
    except ValueError:
        return "refused"
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def test_the_tiny_file_loads(tmp_path):
    write_tiny(tmp_path / "ok.gguf")
    assert load_or_refuse(tmp_path / "ok.gguf") == "loaded"


@FUZZ
@given(cut=st.floats(0.0, 0.999))
def test_truncated(tmp_path, cut):
    path = tmp_path / "t.gguf"
    write_tiny(path)
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * cut)])
    assert load_or_refuse(path) == "refused"


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # garbage weights decode to NaN
@FUZZ
@given(where=st.floats(0.0, 1.0), value=st.sampled_from(HUGE) | st.integers(0, 2 ** 64 - 1),
       width=st.sampled_from([1, 4, 8]))
def test_header_bytes_overwritten(tmp_path, where, value, width):
    """A count, length, type, dim or offset of the header replaced (little-endian, 1, 4 or 8 bytes)."""
    path = tmp_path / "h.gguf"
    header = write_tiny(path)
    data = bytearray(path.read_bytes())
    at = min(int(where * header), header - width)
    data[at:at + width] = (value % (1 << (8 * width))).to_bytes(width, "little")
    path.write_bytes(bytes(data))
    load_or_refuse(path)


META_KEYS = [f"llama.{k}" for k in DIMS] + ["llama.attention.key_length", "llama.rope.dimension_count",
                                            "llama.rope.freq_base", "general.alignment", "general.architecture",
                                            "llama.attention.layer_norm_rms_epsilon", "llama.rope.scaling.type"]
VALUES = (st.sampled_from(HUGE) | st.integers(-2 ** 63, -1) | st.sampled_from([0.0, -1.0, float("nan"), 1e30])
          | st.sampled_from(["", "llama", "\udcff", "x" * 300]) | st.lists(st.integers(0, 9), max_size=3))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # a new alignment: garbage weights
@FUZZ
@given(key=st.sampled_from(META_KEYS), value=VALUES)
def test_metadata_values(tmp_path, key, value):
    """A dimension, a count, the alignment or a name with an absurd or wrongly typed value (written
    after the good one: a GGUF reader keeps the last)."""
    path = tmp_path / "m.gguf"
    try:
        write_tiny(path, {key: value})
    except (UnicodeEncodeError, ValueError, OverflowError):
        return                                 # not even writable
    load_or_refuse(path)


def test_cli_says_one_line_and_exits_2(tmp_path):
    path = tmp_path / "c.gguf"
    write_tiny(path, {"llama.embedding_length": 2 ** 40})
    done = subprocess.run([sys.executable, "-m", "phasewise.cli", "generate", "hi", "--model", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "error" in done.stderr
