"""GGUF's block types read into our packed formats (kernels/quant.py), without rounding: each type
into the format whose record lists it (`gguf_types`, kernels/weight_formats.py).

Each type decodes to integer values per block of 32 and that block's scales, then packs:
- Q4_0, Q4_1 → q4 (Q4_0's m = -8 d); Q8_0 → q8; Q5_0 → q5 (its q - 16 is in -16..15);
- Q4_K → k4: a super-block of 256 holds 8 sub-blocks of 32 with 6-bit sc, m, kept as they are with
  the super-block's fp16 d and dmin (w = d sc q - dmin m);
- Q5_K → k6: a fifth bit (q 0..31), d = d_K sc and m = -dmin_K m_K (exact in fp32; both halves
  share d: sc = 1);
- Q6_K → q6k: 16 sub-blocks of 16 with int8 scales, kept as they are with the super-block's fp16 d,
  q - 32 (w = d sc q).
The bit layouts follow llama.cpp's ggml-quants.c, as `gguf.quants` dequantizes them (the tests
compare every type with `gguf.quants.dequantize`); Q4_K's scale unpacking is gguf's own.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from phasewise.kernels import quant
from phasewise.kernels.kernel_api import Kernels
from phasewise.kernels.weight_formats import BY_GGUF_TYPE

# the types the kernel library repacks itself (csrc/repack_gguf.cpp, the same bytes): ggml's type ids
REPACKED = {"Q4_K": 12, "Q6_K": 14}


def _f16(b: np.ndarray) -> np.ndarray:
    """[n, 2] bytes → [n] fp32 (an fp16 each)."""
    return np.ascontiguousarray(b).view(np.float16)[:, 0].astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """[n, c * width] bytes → [n, 2c, width]: each run's low nibbles, then its high ones."""
    n = qs.shape[0]
    shifts = np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (qs.reshape(n, -1, 1, width) >> shifts & 0x0F).reshape(n, -1, width)


def decode(type_name: str,
           blocks: np.ndarray) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray] | None]:
    """GGUF blocks [n, type bytes] uint8 → values [n, S, 32] int16, scales, each [n, S] fp32 (S blocks
    of 32 per GGUF block), in the order quant.pack takes for BY_GGUF_TYPE[type_name], and k4's
    super-block d and dmin (q6k's d), each [n, 1] (None for the others)."""
    from gguf.quants import Q4_K

    n = blocks.shape[0]
    if type_name in ("Q4_0", "Q4_1", "Q8_0", "Q5_0"):
        d = _f16(blocks[:, 0:2])[:, None]
        if type_name == "Q8_0":
            return blocks[:, 2:34].view(np.int8).astype(np.int16)[:, None], [d], None
        if type_name == "Q4_1":
            m = _f16(blocks[:, 2:4])[:, None]
            return _nibbles(blocks[:, 4:20], 16).reshape(n, 1, 32).astype(np.int16), [d, m], None
        if type_name == "Q4_0":
            return _nibbles(blocks[:, 2:18], 16).reshape(n, 1, 32).astype(np.int16), [d, d * -8], None
        qh32 = np.ascontiguousarray(blocks[:, 2:6]).view(np.uint32)      # Q5_0: bit j is value j's
        high = ((qh32 >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16) << 4       # fifth bit
        low = _nibbles(blocks[:, 6:22], 16).reshape(n, 32).astype(np.int16)
        return ((low | high) - 16)[:, None], [d], None
    if type_name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks[:, 0:2])[:, None], _f16(blocks[:, 2:4])[:, None]
        sc, m = Q4_K.get_scale_min(blocks[:, 4:16])                                     # [n, 8] each
        if type_name == "Q4_K":
            return _nibbles(blocks[:, 16:144], 32).astype(np.int16), [sc, m], [d, dmin]
        scale, low = d * sc.astype(np.float32), -(dmin * m.astype(np.float32))
        qh = blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1) & 1
        q = _nibbles(blocks[:, 48:176], 32).astype(np.int16) | (qh.astype(np.int16) << 4)
        return q, [scale, np.ones_like(scale), np.ones_like(scale), low], None
    if type_name == "Q6_K":
        ql = _nibbles(blocks[:, 0:128], 64).reshape(n, 8, 32)
        shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        qh = (blocks[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3
        q = (ql.astype(np.int16) | (qh.reshape(n, 8, 32).astype(np.int16) << 4)) - 32
        sc = blocks[:, 192:208].view(np.int8).astype(np.float32)                        # [n, 16]
        return q, [sc[:, 0::2], sc[:, 1::2]], [_f16(blocks[:, 208:210])[:, None]]
    raise ValueError(f"GGUF type {type_name} has no packed format here")


def pack_gguf(type_name: str, raw: np.ndarray | torch.Tensor, chunk_rows: int = 2048,
              kernels: Kernels | None = None) -> quant.PackedWeight:
    """Raw GGUF rows [N, row bytes] uint8 of a type in BY_GGUF_TYPE → a PackedWeight, packed
    `chunk_rows` rows (whole tiles) at a time into one buffer, so decoding never holds more than a
    chunk's values (a 150k-row vocabulary's were several GB). With `kernels` (a KernelSet), the
    REPACKED types go through its repack_gguf instead (memory speed, the same bytes)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    raw = raw.numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw, dtype=np.uint8)
    size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][1]
    rows, fmt = raw.shape[0], BY_GGUF_TYPE[type_name].name
    blocks: torch.Tensor | None = None
    side: torch.Tensor | None = None
    if kernels is not None and type_name in REPACKED and rows:
        k = raw.shape[1] // size * 256
        with warnings.catch_warnings():     # a read-only map of the file: the kernel only reads it
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(np.ascontiguousarray(raw))
        blocks, side = kernels.repack_gguf(REPACKED[type_name], data, rows, k)
        return quant.PackedWeight(fmt=fmt, n=rows, k=k, blocks=blocks, scale=side)
    step = max(quant.TILE, chunk_rows // quant.TILE * quant.TILE)
    for r0 in range(0, rows, step):
        part = raw[r0:r0 + step]
        q, scales, sb = decode(type_name, part.reshape(-1, size))
        kb = q.shape[0] * q.shape[1] // part.shape[0]
        as_rows = lambda a: torch.from_numpy(np.ascontiguousarray(a).reshape(part.shape[0], -1))  # noqa: E731
        values = torch.from_numpy(q.reshape(part.shape[0], kb, quant.QK))
        packed = quant.pack(fmt, values, [as_rows(s) for s in scales],
                            None if sb is None else tuple(as_rows(x) for x in sb))
        if rows <= step:
            return packed
        if blocks is None:
            blocks = torch.empty(-(-rows // quant.TILE), *packed.blocks.shape[1:], dtype=torch.uint8)
            side = None if packed.scale is None else torch.empty(blocks.shape[0], *packed.scale.shape[1:],
                                                                 dtype=packed.scale.dtype)
        t0 = r0 // quant.TILE
        blocks[t0:t0 + packed.blocks.shape[0]] = packed.blocks
        if side is not None and packed.scale is not None:
            side[t0:t0 + packed.blocks.shape[0]] = packed.scale
    if blocks is None:
        raise ValueError("pack_gguf takes at least one row")
    return quant.PackedWeight(fmt=fmt, n=rows, k=blocks.shape[1] * quant.QK, blocks=blocks, scale=side)
