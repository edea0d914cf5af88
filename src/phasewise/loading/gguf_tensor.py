"""GGUFTensor: one tensor of a GGUF file in Hugging Face's layout, read whole or in part straight
from the file's memory map. A part (rows, or columns on block boundaries) is cut from the stored
bytes before anything is dequantized, so a tensor-parallel rank touches only its share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import overload

import numpy as np
import torch


@dataclass(frozen=True)
class GGUFTensor:
    type_name: str            # the GGML type, e.g. "Q4_1", "F32"
    data: np.ndarray          # the stored bytes [rows, row bytes] uint8 (a memory-map view), file row order
    shape: tuple[int, ...]    # numpy/HF order: [out, in] for a matrix
    heads: int = 0            # llama.cpp permuted the rows within each of `heads` heads (Q, K); 0: not
    offset: float = 0.0       # added after dequantizing (Gemma 3's norms are stored as 1 + w)

    @overload
    def raw(self, rows: slice | None = None, cols: None = None) -> np.ndarray: ...

    @overload
    def raw(self, rows: slice | None, cols: slice | None) -> np.ndarray | None: ...

    def raw(self, rows: slice | None = None, cols: slice | None = None) -> np.ndarray | None:
        """The stored bytes of [rows, cols] in HF row order, [rows, row bytes]; None when `cols` does
        not start and end on a block boundary (blocks run along a row, so any rows cut exactly)."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        data = self._rows(rows)
        if cols is None:
            return data
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[self.type_name]]
        if cols.start % block or cols.stop % block:
            return None
        return data[:, cols.start // block * size:cols.stop // block * size]

    def read(self, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        """[rows, cols] as a writable fp32 tensor, only that part dequantized (a column cut inside a
        block dequantizes the rows, then cuts)."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        if len(self.shape) != 2 and (rows is not None or cols is not None):
            return self.read()[rows if rows is not None else slice(None)]
        raw = self.raw(rows, cols)
        if raw is None:
            return self.read(rows)[:, cols].contiguous()
        array = dequantize(np.ascontiguousarray(raw), GGMLQuantizationType[self.type_name])
        array = np.asarray(array, dtype=np.float32)
        if not array.flags.writeable:               # F32 is a view of the read-only memory map
            array = array.copy()
        if self.offset:
            array += self.offset
        shape = self.shape if rows is None and cols is None else (raw.shape[0], -1)
        return torch.from_numpy(array.reshape(shape))

    def _rows(self, rows: slice | None) -> np.ndarray:
        """Stored rows in HF order: a cut along whole heads is unpermuted on its own, anything else
        after unpermuting the whole tensor."""
        if not self.heads:
            return self.data if rows is None else self.data[rows]
        per = self.shape[0] // self.heads
        if rows is None:
            return unpermute(self.data, self.heads)
        if rows.start % per == 0 and rows.stop % per == 0:
            return unpermute(self.data[rows], (rows.stop - rows.start) // per)
        return unpermute(self.data, self.heads)[rows]


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's row permutation: per head, interleaved pairs → two halves."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
