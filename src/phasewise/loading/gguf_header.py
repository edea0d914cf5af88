"""A lean reader of a GGUF file's header: metadata and tensor directory, without the vocabulary.

`gguf.GGUFReader` builds a numpy view for every element of every array, which
costs about 2.5 s on the default model's 49k-token vocabulary alone. The engine
only needs the scalar metadata and where each tensor lies, so this reader walks
the header with `struct`, keeps arrays of numbers (via numpy) and only the
length of long string arrays, unless asked for them by name (the tokenizer
reads the vocabulary and merges: ~0.1 s per 150k strings). Dequantization
stays with the `gguf` package.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

import numpy as np

if TYPE_CHECKING:
    from gguf.constants import GGMLQuantizationType

MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9
LONG_STRING_ARRAY = 1024   # longer string arrays are skipped, only their length kept


class GGUFFormatError(ValueError):
    pass


@dataclass(frozen=True)
class SkippedArray:
    """A long array of strings left unread (the vocabulary); only its length is known."""
    count: int

    def __len__(self) -> int:
        return self.count


# A metadata value: a number (struct's int, float or bool), a string, an array of values (numbers via
# numpy's tolist: Python scalars too), or a long string array left unread.
GGUFScalar: TypeAlias = int | float | bool | str
GGUFValue: TypeAlias = GGUFScalar | list["GGUFValue"] | SkippedArray


@dataclass(frozen=True, kw_only=True)
class TensorInfo:
    name: str
    ggml_type: int
    shape: tuple[int, ...]      # numpy order (outermost first): GGUF's dims reversed
    offset: int                 # absolute byte offset in the file
    nbytes: int


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> int | float | bool:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def uint(self, fmt: str = "<Q") -> int:
        """An unsigned integer ("<I" or "<Q"): a length, count, type or offset."""
        value: int = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.uint()
        if self.pos + n > len(self.buf):
            raise GGUFFormatError("string runs past the end of the file")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def skip_string(self) -> None:
        self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]

    def strings(self, count: int) -> list[GGUFValue]:
        """`count` strings in a row (a vocabulary: the loop kept to the bare calls)."""
        buf, pos, size, length = self.buf, self.pos, len(self.buf), struct.Struct("<Q").unpack_from
        out: list[GGUFValue] = []
        add = out.append
        for _ in range(count):
            n = length(buf, pos)[0]
            pos += 8
            if pos + n > size:
                raise GGUFFormatError("string runs past the end of the file")
            add(str(buf[pos:pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int, whole: bool = False) -> GGUFValue:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            etype, count = self.uint("<I"), self.uint()
            if etype in _NUMPY:
                dtype = np.dtype(_NUMPY[etype])
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
                self.pos += dtype.itemsize * count
                return arr
            if etype == STRING and whole:
                return self.strings(count)
            if etype == STRING and count > LONG_STRING_ARRAY:
                for _ in range(count):
                    self.skip_string()
                return SkippedArray(count)
            return [self.value(etype) for _ in range(count)]
        raise GGUFFormatError(f"unknown metadata value type {vtype}")


def read_header(path: Path, strings: Collection[str] = ()
                ) -> tuple[dict[str, GGUFValue], dict[str, TensorInfo]]:
    """(metadata key → value, tensor name → TensorInfo); GGUFFormatError on anything malformed. The
    string arrays named in `strings` are read whatever their length."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise GGUFFormatError(f"file is too short ({size} bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            buf = memoryview(mm)
            try:
                fields, tensors = _parse(_Cursor(buf), size, GGML_QUANT_SIZES, GGMLQuantizationType, strings)
            except (struct.error, ValueError, IndexError, OverflowError, MemoryError) as e:
                if isinstance(e, GGUFFormatError):
                    raise
                raise GGUFFormatError(f"truncated or corrupt header ({e})") from None
            finally:
                buf.release()
    return fields, tensors


def _parse(c: _Cursor, size: int, quant_sizes: Mapping[GGMLQuantizationType, tuple[int, int]],
           qtypes: type[GGMLQuantizationType], strings: Collection[str] = ()
           ) -> tuple[dict[str, GGUFValue], dict[str, TensorInfo]]:
    if bytes(c.buf[:4]) != MAGIC:
        raise GGUFFormatError("bad magic (not a GGUF file)")
    c.pos = 4
    version = c.uint("<I")
    if version not in (2, 3):
        raise GGUFFormatError(f"unsupported GGUF version {version}")
    n_tensors, n_kv = c.uint(), c.uint()
    fields: dict[str, GGUFValue] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors,
                                    "GGUF.kv_count": n_kv}
    for _ in range(n_kv):
        key = c.string()
        fields[key] = c.value(c.uint("<I"), key in strings)
    infos: list[tuple[str, list[int], int, int]] = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.uint("<I")
        if not 1 <= n_dims <= 4:                # GGML_MAX_DIMS
            raise GGUFFormatError(f"tensor {name!r} has {n_dims} dimensions")
        dims = [c.uint() for _ in range(n_dims)]
        ggml_type, offset = c.uint("<I"), c.uint()
        infos.append((name, dims, ggml_type, offset))
    alignment = fields.get("general.alignment", 32)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1 or \
            alignment & (alignment - 1):
        raise GGUFFormatError(f"general.alignment must be a power of two, got {str(alignment)[:40]!r}")
    data_start = -(-c.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, dims, ggml_type, offset in infos:
        try:
            block, type_size = quant_sizes[qtypes(ggml_type)]
        except (ValueError, KeyError):
            raise GGUFFormatError(f"tensor {name!r} has unknown type {ggml_type}") from None
        n = math.prod(dims)                     # exact: numpy's product would wrap around
        if n == 0 or n % block or dims[0] % block:
            raise GGUFFormatError(f"tensor {name!r} has dimensions {dims} (blocks of {block} along the "
                                  "first)")
        nbytes = n // block * type_size
        start = data_start + offset
        if start + nbytes > size:
            raise GGUFFormatError(f"tensor {name!r} runs past the end of the file (truncated?)")
        tensors[name] = TensorInfo(name=name, ggml_type=ggml_type, shape=tuple(reversed(dims)), offset=start,
                                   nbytes=nbytes)
    return fields, tensors
